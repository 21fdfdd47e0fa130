"""``kvbuffer validate --jobs N``: lanes in worker processes give the rows, verdicts and JSON of one process."""

import functools
import json
import sys

from kvbuffer import cli as kcli
from kvbuffer.implementations import resolve
from kvbuffer.validate import lanes, runner

from .conftest import ADAPTERS

JOBS_ADAPTERS = "tests.validate.adapters_for_jobs"
#: what differs between two runs of the same seed: the clock
TIMINGS = ("seconds", "started", "argv")


def _run(capsys, tmp_path, jobs, *extra):
    """good, wrong_scale (it fails) and the reference, direct in float64: 3 lanes."""
    path = tmp_path / f"jobs{jobs}.json"
    rc = kcli.main(["validate", "--impl", f"{ADAPTERS}:good", "--impl", f"{ADAPTERS}:wrong_scale", "--impl",
                    "reference", "--ops", "direct", "--dtype", "float64", "--seed", "7", "--max-examples", "2",
                    "--jobs", str(jobs), "--json", str(path), *extra])
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    for k in TIMINGS:
        data.pop(k)
    for r in data["results"]:
        r.pop("seconds")
    rows = [line.split("  PASS")[0].split("  FAIL")[0].split("  SKIP")[0] for line in out.splitlines()
            if line.startswith("direct ")]
    return rc, rows, out, data


def test_two_jobs_give_the_rows_and_json_of_one(capsys, tmp_path):
    rc1, rows1, out1, data1 = _run(capsys, tmp_path, 1)
    rc2, rows2, out2, data2 = _run(capsys, tmp_path, 2)
    assert rc1 == rc2 == 1
    assert [r["status"] for r in data1["results"]] == ["PASS", "FAIL", "PASS"]
    assert data2 == data1
    assert rows2 == rows1 and len(rows1) == 3
    failure = out1[out1.index("\nFAIL ["):out1.index("\nFAILED: ")]
    assert failure in out2


def test_fail_fast_skips_the_lanes_after_the_first_failure_with_two_jobs(capsys, tmp_path):
    rc, _, _, data = _run(capsys, tmp_path, 2, "--fail-fast")
    assert rc == 1
    assert [(r["status"], r["reason"]) for r in data["results"]] == [
        ("PASS", ""), ("FAIL", ""), ("SKIP", "--fail-fast: an earlier lane failed")]


def test_a_lane_that_ends_its_worker_is_that_lanes_error_and_the_rest_run():
    impls = [resolve(f"{JOBS_ADAPTERS}:crashes"), resolve("reference")]
    rep = runner.run_validation(impls, ops=lanes.select_ops("direct"), seed=3, max_examples=1, shrink=False,
                                progress=None, jobs=2)
    crashed, *rest = rep.lanes
    assert (crashed.implementation, crashed.status, crashed.klass) == ("crashes", "ERROR", "raised")
    assert "the worker process running this lane ended (exit status 3)" in crashed.failure["error"]
    assert [(r.implementation, r.dtype, r.status) for r in rest] == [("kvbuffer_ref", "float64", "PASS"),
                                                                     ("kvbuffer_ref", "float32", "PASS")]
    assert not rep.passed


def test_the_lanes_run_in_this_process_when_the_workers_cannot_rebuild_the_adapter(capsys):
    impl = resolve("reference")
    impl.rebuild = functools.partial(resolve, "tests.validate.no_such_module:reference")
    rep = runner.run_validation([impl], ops=lanes.select_ops("direct"), seed=3, max_examples=1, jobs=2,
                                progress=sys.stderr)
    assert [r.status for r in rep.lanes] == ["PASS", "PASS"]
    assert "the worker processes could not start, so the lanes run in this process" in capsys.readouterr().err


def test_after_a_fault_that_loses_the_gpu_context_the_later_lanes_are_not_run(capsys, tmp_path, monkeypatch):
    """A kernel's illegal address is sticky on CUDA: the lanes after it would raise the same error, so they are
    NOT RUN with the fault named (simulated here: the failing lane leaves a lost context)."""
    seen = []

    def lost(device):
        seen.append(device)
        return "AcceleratorError: CUDA error: an illegal memory access was encountered"

    monkeypatch.setattr(runner, "_cuda_lost", lost)
    rc, _, out, data = _run(capsys, tmp_path, 1)
    assert rc == 1 and seen == ["cpu"]  # asked once, after the failing lane only
    assert [r["status"] for r in data["results"]] == ["PASS", "FAIL", "NOT RUN"]
    reason = data["results"][2]["reason"]
    assert "the CUDA context was lost to a fault in direct / wrong_scale / float64" in reason
    assert "illegal memory access" in reason and "a process of its own" in reason


def test_the_context_check_is_the_gpus_only():
    assert runner._cuda_lost("cpu") is None
