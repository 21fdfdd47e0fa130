"""kvbuffer_fast's int32 scratches (ticket counters): zeroed, large enough, grown to a power of two, and
the scratch a larger one replaces stays allocated, since a CUDA graph captured on it still uses it."""

import torch

from kvbuffer_fast import _common


def test_scratch_grows_and_keeps_the_one_it_replaces():
    name = "test-scratch"
    small = _common.int_scratch(name, 10, "cpu")
    assert small.dtype == torch.int32 and small.numel() >= 10 and not small.any()
    assert _common.int_scratch(name, small.numel(), "cpu") is small  # big enough: the same tensor
    big = _common.int_scratch(name, 1000, "cpu")
    assert big.numel() == 1024 and not big.any()
    assert any(t is small for t in _common._RETIRED), "the replaced scratch must stay allocated"
    assert _common.int_scratch(name, 5, "cpu") is big
