"""CPU benchmarks of the decode group: the read of the state alone, the recurrent baseline, fla's
fused_recurrent and buffered decode over a whole buffer cycle (bench/workloads.py defines each case,
bench/conftest.py times it)."""

import dataclasses

import pytest
import torch

from bench import io_model as io
from bench import read_state as R
from bench import workloads as W
from bench.workloads import OPS


@pytest.mark.parametrize("op", [op for op, group in OPS.items() if group == "decode"])
def test_decode(timed, op):
    timed(op)


def test_read_state_checks_every_tiling(api):
    """read_state at shapes where its tilings differ and their K loops run twice: each tiling's tile sums
    match torch's, the case runs the fastest, and its bytes are the states read plus one sum per tile."""
    plan = dataclasses.replace(W.SMOKE, shapes=io.Shapes(H=1, HV=2, K=64, V=128))
    case = W.build("read_state", api, W.Workload(plan, 2, "cpu"))
    assert case.passed and len(case.checks) == len(R.TILINGS) == len(case.info["tilings_us"])
    assert case.count == plan.layers and case.info["tiling"] in case.info["tilings_us"]
    best = next(t for t in R.TILINGS if str(t) == case.info["tiling"])
    assert case.io_bytes == io.state_bytes(plan.shapes, 2) + 2 * 2 * (128 // best.BV) * 4
    case.run()


def test_read_state_check_catches_a_wrong_read():
    """The sums of a state that differs from the one checked in one element fail the check."""
    state = torch.randn(2, 2, 64, 128)
    t = R.TILINGS[0]
    sums = R.launch(state, torch.empty(4, 128 // t.BV), t)
    assert R.sums_check("read_state", state, sums, t.BV)["passed"]
    other = state.clone()
    other[1, 1, 63, 127] += 1.0
    bad = R.sums_check("read_state", other, sums, t.BV)
    assert not bad["passed"] and "FAIL" in bad["text"]
