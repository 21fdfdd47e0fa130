"""kvbuffer_fast.pool.KVPool on drawn schedules (the Triton interpreter on a CPU; small shapes, float32):
every request's outputs and final state against the float64 recurrence within the error table's float32
budget, pads that read and write nothing, int32 and int64 indices; the reference pool's bad-input rules."""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvbuffer_fast.pool import KVPool  # noqa: E402

from .schedule import assert_untouched, run_schedule, snapshot  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEW = settings(max_examples=4, deadline=None) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else \
    settings(deadline=None)
SHAPES = dict(layers=1, N=4, C=3, D=3, H=1, HV=2, K=4, V=4)


def _pool(layers, N, C, D, H, HV, K, V, S=None, **kw):
    return KVPool(layers=layers, num_state_slots=N if S is None else S, num_buffer_slots=N, capacity=C,
                  max_drafts=D, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=DEVICE, **kw)


@FEW
@given(data=st.data(), C=st.sampled_from([1, 3]))
def test_fast_schedules_match_each_request_alone(data, C):
    shapes = dict(SHAPES, C=C)
    run_schedule(lambda: _pool(**shapes), data, dtype=torch.float32, device=DEVICE, steps=8, **shapes)
