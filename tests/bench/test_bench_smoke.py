"""Both benchmark harnesses run end to end on the CPU (Triton interpreter, tiny shapes; no timing claim):
the GPU runner with --smoke, against this tree and a copy of it given as --before, and the
pytest-benchmark suites; the report is built from each JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton not installed: the benchmarks time the Triton kernels")

ROOT = Path(__file__).resolve().parents[2]
RUNNER_OPS = "recurrent_decode,buffered_decode,verify,per_draft_state_verify,accept,round"


def _run(args, timeout=240):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for name in [n for n in env if n.startswith("PYTEST_")]:  # a clean inner session, also under pytest-xdist
        env.pop(name)
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args} failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-3000:]}"
    return r


def test_gpu_runner_smoke_with_a_second_package_root(tmp_path):
    before = tmp_path / "before"
    for pkg in ("kvbuffer_fast", "kvbuffer_ref"):
        shutil.copytree(ROOT / pkg, before / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "latest"
    r = _run(["-m", "bench.gpu", "--smoke", "--out", str(out), "--before", str(before), "--ops", RUNNER_OPS])
    assert r.stdout.strip().splitlines()[-1] == f"JSON: {out / 'gpu.json'}"
    data = json.loads((out / "gpu.json").read_text())
    assert data["smoke"] is True and {"device", "torch", "triton", "fla"} <= set(data)
    assert Path(data["trees"]["before"]["package"]) == before
    for name, tree in data["trees"].items():
        assert not tree["failures"], (name, tree["failures"])
        assert {r["op"] for r in tree["rows"]} == set(RUNNER_OPS.split(",")), name
        for row in tree["rows"]:
            assert row["checks"] and all(c["passed"] for c in row["checks"]), row
            assert row["device_us"] > 0 and row["floor_us"] > 0 and row["ops_per_replay"] >= 2
    after = {r["op"]: r for r in data["trees"]["after"]["rows"]}
    assert after["buffered_decode"]["vs_recurrent_decode"] > 0 and after["verify"]["vs_per_draft_state_verify"] > 0
    assert {(r["op"], r["B"]) for r in data["before_after"]} == {(op, 2) for op in RUNNER_OPS.split(",")}
    md = (out / "report.md").read_text()
    assert "SMOKE RUN" in md and "## Decode" in md and "## After / before" in md


def test_pytest_benchmark_suites_and_report(tmp_path):
    pytest.importorskip("pytest_benchmark", reason="pytest-benchmark not installed")
    js = tmp_path / "cpu.json"
    _run(["-m", "pytest", "bench/", "-p", "no:cacheprovider", "-q", "--benchmark-enable", "--benchmark-json", str(js),
          "-k", "recurrent_decode or per_draft_state_verify or test_speculative[accept]"])
    data = json.loads(js.read_text())
    ops = {b["extra_info"]["op"] for b in data["benchmarks"]}
    assert ops == {"recurrent_decode", "per_draft_state_verify", "accept"}, ops
    assert all(c["passed"] for b in data["benchmarks"] for c in b["extra_info"]["checks"])
    _run(["-m", "bench.report", str(js), "--out", str(tmp_path)])
    assert "test_speculative[accept]" in (tmp_path / "report.md").read_text()
