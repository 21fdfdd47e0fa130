"""The CPU harness: pytest-benchmark over the cases of bench/workloads.py (the GPU runner's cases).

    python3 -m pytest bench/ --benchmark-enable --benchmark-json out.json && python3 -m bench.report out.json

Each test builds one case (bench.workloads.SMOKE: tiny shapes, under the Triton interpreter), fails it
without timing if layer 0 does not match the float64 oracle, then times ``case.run()`` (every layer,
model order) with pytest-benchmark's own clock: the host cost of the interpreted kernels, not device
performance (bench/gpu.py measures that).  ``KVBUFFER_BENCH_ROUNDS`` (default 1) sets the rounds.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402

from bench import workloads as W  # noqa: E402

ROUNDS = int(os.environ.get("KVBUFFER_BENCH_ROUNDS", "1"))


@pytest.fixture(scope="session")
def api() -> W.Api:
    return W.Api()


@pytest.fixture(scope="session")
def workload() -> W.Workload:
    return W.Workload(W.SMOKE, W.SMOKE.batches[0], "cpu")


@pytest.fixture
def timed(benchmark, api, workload):
    """``timed(op)``: build the case, require its oracle checks, time it and record the row."""

    def run(op: str) -> W.Case:
        try:
            case = W.build(op, api, workload)
        except W.Skip as e:
            pytest.skip(str(e))
        bad = [c["text"] for c in case.checks if not c["passed"]]
        if bad:
            pytest.fail("wrong result, not timed: " + "; ".join(bad), pytrace=False)
        benchmark.extra_info.update(op=case.op, group=case.group, B=case.B, count=case.count, io_bytes=case.io_bytes,
                                    checks=[{k: v for k, v in c.items() if k != "text"} for c in case.checks],
                                    **case.info)
        benchmark.pedantic(case.run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
        return case

    return run
