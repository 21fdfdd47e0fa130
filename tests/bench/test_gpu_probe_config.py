"""bench/gpu_probe.py's launch lists must name options and kernels that exist (the probe runs only on
the GPU machine, where a stale name costs a device call): every listed launch runs once here, under
the interpreter, on a tiny buffer, and is compared with the float64 oracle."""

from __future__ import annotations

import pytest
import torch

import bench.gpu_probe as probe
from kvbuffer_ref.testing import Case
from kvbuffer_ref.testing import properties as P
from tests.property.fast_adapter import Poisoned, verify_launch

from kvbuffer_fast.decode import DECODE_TUNE_CONFIGS  # noqa: E402 (after the interpreter switch)
from kvbuffer_fast.speculative import LAUNCH_CANDIDATES  # noqa: E402

DEVICE = "cpu"


def _check_decode(cfg: dict, seed: int) -> None:
    """buffered_decode launched with ``cfg`` matches the float64 oracle on a tiny buffer (one fold)."""

    class Cfg(Poisoned):
        @staticmethod
        def buffered_decode(*args, buffer, **kw):
            return Poisoned.buffered_decode(*args, buffer=buffer, **cfg, **kw)

    case = Case(B=2, T=4 + 5, H=1, HV=2, K=16, V=16, gate="mild", beta="uniform", seed=seed)
    res = P.check_decode(Cfg, case, torch.float32, capacity=4, history=4, lengths=[4, 1], device=DEVICE)
    assert res and all(r.passed for r in res), [str(r) for r in res if not r.passed]


def _check_verify(cfg: dict, dtype: torch.dtype, seed: int) -> None:
    """verify + accept with the default launch updated by ``cfg`` match the float64 oracle (trees, a fold)."""
    with verify_launch(**cfg):
        case = Case(B=2, T=3 + 3 + 1, H=1, HV=2, K=16, V=16, gate="mild", beta="uniform", seed=seed)
        res = P.check_verify_accept(Poisoned, case, dtype, capacity=4, history=3, lengths=[3, 1],
                                    parents=[[-1, 0, 0], [-1, 0, 1]], num_drafts=[3, 2], nodes=[2, 1], after=1,
                                    device=DEVICE)
    assert res and all(r.passed for r in res), [str(r) for r in res if not r.passed]


def test_kernel_lists_exist():
    assert all(callable(k) or hasattr(k, "run") for k in probe.decode_kernels() + probe.verify_kernels())


@pytest.mark.parametrize("i", range(len(probe.DECODE_VARIANTS)))
def test_decode_variant_runs_and_matches_the_oracle(i):
    cfg = {k: v for k, v in probe.DECODE_VARIANTS[i].items() if k not in ("fold_BV", "fold_warps")}  # probe-only
    if "fold_launch" in cfg:  # the probe's fold launch at this test's small V
        cfg["fold_launch"] = dict(cfg["fold_launch"], BV=16, KB=16)
    _check_decode({**cfg, "BV": 16, "KB": 16}, seed=3)


@pytest.mark.parametrize("i", range(len(probe.VERIFY_VARIANTS)))
def test_verify_variant_runs_and_matches_the_oracle(i):
    cfg = probe.VERIFY_VARIANTS[i]
    # phase 2's split X S0 (xprec) needs 16-bit rows: tf32x2 runs on fp16 here; bf16x3 only on bf16, whose
    # dots the interpreter gets wrong (tests/property/test_fast_verify.py checks its pieces here instead)
    xprec = cfg.get("xprec", "auto")
    if xprec == "bf16x3":
        pytest.skip("xprec='bf16x3' needs bfloat16 rows; the Triton interpreter's bf16 dots are wrong (CUDA only)")
    dtype = torch.float16 if xprec == "tf32x2" else torch.float32
    _check_verify({**cfg, "BV": 16, "KB": 16}, dtype, seed=4)


def test_aot_register_report_runs():
    """scripts/aot_regs.py (registers / spills without a GPU) still compiles the lean decode kernel for
    sm_90 with the kernel's current signature and reads ptxas's report (a stale constexpr list broke
    it once).  In a subprocess: the tests run Triton in interpreter mode."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(root / "scripts" / "aot_regs.py"), "decode", "FOLD=1"],
                         capture_output=True, text=True, env=env, timeout=300)
    if "regs [" not in out.stdout:
        pytest.fail(f"aot_regs.py printed no register report:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    regs = out.stdout.split("regs [")[1].split("]")[0]
    if not regs:
        if "ptxas" in out.stdout + out.stderr or not out.stdout:
            pytest.skip("no usable ptxas for sm_90 in this Triton install")
        pytest.fail(out.stdout[-2000:])
    assert int(regs.strip("'\" ").split("'")[0]) > 0


@pytest.mark.parametrize("i", range(len(DECODE_TUNE_CONFIGS)))
def test_decode_tune_config_runs_and_matches_the_oracle(i):
    """bench/gpu_decode.py --tune times DECODE_TUNE_CONFIGS on the GPU: each must exist and be correct."""
    _check_decode(dict(DECODE_TUNE_CONFIGS[i]), seed=5)


@pytest.mark.parametrize("i", range(len(LAUNCH_CANDIDATES)))
def test_verify_launch_candidate_runs_and_matches_the_oracle(i):
    """bench/gpu_verify.py's tune times LAUNCH_CANDIDATES: each must exist and be correct (fp16 inputs, so
    that prep_mma's 16-bit path runs under the interpreter too)."""
    _check_verify({**LAUNCH_CANDIDATES[i], "BV": 16, "KB": 16}, torch.float16, seed=6)
