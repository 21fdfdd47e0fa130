"""bench/gpu_probe.py's launch lists must name options and kernels that exist (the probe runs only on
the GPU machine, where a stale name costs a device call): every listed launch runs once here, under
the interpreter, on a tiny buffer, and is compared with the float64 oracle."""

from __future__ import annotations

import pytest
import torch

import bench.gpu_probe as probe
from kvbuffer_ref.testing import Case
from kvbuffer_ref.testing import properties as P
from tests.property.fast_adapter import Poisoned

DEVICE = "cpu"


def test_kernel_lists_exist():
    assert all(callable(k) or hasattr(k, "run") for k in probe.decode_kernels() + probe.verify_kernels())


@pytest.mark.parametrize("i", range(len(probe.DECODE_VARIANTS)))
def test_decode_variant_runs_and_matches_the_oracle(i):
    cfg = {k: v for k, v in probe.DECODE_VARIANTS[i].items() if not k.startswith("fold_")}  # fold_BV: probe-only

    class Cfg(Poisoned):
        @staticmethod
        def buffered_decode(*args, buffer, **kw):
            return Poisoned.buffered_decode(*args, buffer=buffer, **{**cfg, "BV": 16, "KB": 16}, **kw)

    case = Case(B=2, T=4 + 5, H=1, HV=2, K=16, V=16, gate="mild", beta="uniform", seed=3)
    res = P.check_decode(Cfg, case, torch.float32, capacity=4, history=4, lengths=[4, 1], device=DEVICE)
    assert res and all(r.passed for r in res), [str(r) for r in res if not r.passed]


@pytest.mark.parametrize("i", range(len(probe.VERIFY_VARIANTS)))
def test_verify_variant_runs_and_matches_the_oracle(i):
    import kvbuffer_fast.speculative as spec

    old = spec.set_launch("verify", **{**probe.VERIFY_VARIANTS[i], "BV": 16, "KB": 16})
    try:
        case = Case(B=2, T=3 + 3 + 1, H=1, HV=2, K=16, V=16, gate="mild", beta="uniform", seed=4)
        res = P.check_verify_accept(Poisoned, case, torch.float32, capacity=4, history=3, lengths=[3, 1],
                                    parents=[[-1, 0, 0], [-1, 0, 1]], num_drafts=[3, 2], nodes=[2, 1], after=1,
                                    device=DEVICE)
    finally:
        spec.set_launch("verify", **old)
    assert res and all(r.passed for r in res), [str(r) for r in res if not r.passed]
