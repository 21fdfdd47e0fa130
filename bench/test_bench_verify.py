"""CPU benchmarks of speculative decoding: verify, accept and whole rounds, buffered and per-draft-state,
with fla over the same tokens (bench/workloads.py defines each case, bench/conftest.py times it)."""

import pytest

from bench.workloads import OPS


@pytest.mark.parametrize("op", [op for op, group in OPS.items() if group != "decode"])
def test_speculative(timed, op):
    timed(op)
