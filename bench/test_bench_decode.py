"""CPU benchmarks of the decode group: the recurrent baseline, fla's fused_recurrent and buffered
decode over a whole buffer cycle (bench/workloads.py defines each case, bench/conftest.py times it)."""

import pytest

from bench.workloads import OPS


@pytest.mark.parametrize("op", [op for op, group in OPS.items() if group == "decode"])
def test_decode(timed, op):
    timed(op)
