"""The benchmark suites and the report generator work end to end (SMOKE mode, CPU, interpreter).

Runs ``pytest bench/ --benchmark-json`` in a subprocess with KVBUFFER_BENCH=smoke (tiny shapes,
the Triton interpreter, wall-clock: no performance claim), then ``python -m bench.report`` on the
JSON, and checks the rows, the oracle checks they carry, the Markdown and the plots.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark not installed (pip install -e '.[test]')")
pytest.importorskip("matplotlib", reason="matplotlib not installed: the report's plots need it")
pytest.importorskip("triton", reason="triton not installed: the suites time the Triton kernels")

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, timeout):
    env = dict(os.environ, KVBUFFER_BENCH="smoke", TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for name in [n for n in env if n.startswith("PYTEST_")]:  # a clean session, also under pytest-xdist (its
        env.pop(name)  # worker's PYTEST_XDIST_WORKER made the inner run write an empty --benchmark-json)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_suites_and_report_smoke(tmp_path):
    out_json = tmp_path / "smoke.json"
    r = _run(["-m", "pytest", "bench/", "-p", "no:cacheprovider", "-q", "-rfE", "--benchmark-columns=median",
              "--benchmark-json", str(out_json)],
             tmp_path, timeout=300)
    assert r.returncode == 0, f"pytest bench/ failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    data = json.loads(out_json.read_text())
    assert data["kvbuffer"]["smoke"] is True and data["machine_info"]["kvbuffer"]["mode"] == "smoke"
    rows = [b["extra_info"] for b in data["benchmarks"]]
    kinds = {r["kind"] for r in rows}
    assert {"recurrent", "buffered_cycle", "flush", "direct", "verify", "step"} <= kinds, kinds
    expected_styles = {"buffered", "per_draft_state"}
    if importlib.util.find_spec("fla") is not None:
        expected_styles.add("fla")  # fla's fused_recurrent over the same d tokens
    assert {r["style"] for r in rows if r["kind"] == "verify"} == expected_styles
    for b in data["benchmarks"]:
        info = b["extra_info"]
        assert info["checks"], f"{b['name']}: no oracle check recorded"
        assert all(c["worst_rel"] <= c["budget"] for c in info["checks"])
        assert info["device_us"] > 0 and info["io_bytes"] > 0 and info["copy_TBps"] > 0
        # the JSON's stats are the harness's clock (per operation), the same number as device_us
        assert b["stats"]["median"] * 1e6 == pytest.approx(info["device_us"], rel=1e-6)

    rep = tmp_path / "report"
    r = _run(["-m", "bench.report", str(out_json), "--before", str(out_json), "--out", str(rep)], tmp_path, timeout=120)
    assert r.returncode == 0, f"bench.report failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    md = (rep / "report.md").read_text()
    assert "SMOKE RUN" in md and "## Decode" in md and "## Speculative verify" in md and "## Capacity" in md
    assert "## Change against the earlier run" in md
    pngs = sorted(rep.glob("*.png"))
    assert len(pngs) >= 1 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs), pngs
    assert "decode (device µs per step)" in r.stdout
