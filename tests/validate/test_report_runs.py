"""``kvbuffer report`` renders the run you mean, failures carry the label of their cause, the table
stays aligned, and the plots say what they show."""

import json
import sys
from pathlib import Path

import pytest

from kvbuffer import cli as kcli
from kvbuffer.validate import report as rep
from kvbuffer.implementations import resolve
from kvbuffer.validate.lanes import parse_dtypes, select_ops
from kvbuffer.validate.runner import run_validation

from .conftest import ADAPTERS, ROOT


def _validate(capsys, *args):
    rc = kcli.main(["validate", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _report(capsys, *args):
    rc = kcli.main(["report", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- which run
def test_each_environment_and_checkout_reports_its_own_last_run(capsys, tmp_path, monkeypatch):
    """Two environments (sys.prefix) in two folders share one cache: each `kvbuffer report` shows its
    own last run, never the other's, and never a report left at the cache's top by an older version."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(cache))
    cache.mkdir()
    (cache / kcli.LAST_REPORT).write_text(json.dumps({"tool": "kvbuffer validate", "passed": False, "results": []}))
    envs = {"a": (tmp_path / "venv-a", tmp_path / "work-a", f"{ADAPTERS}:good", 0),
            "b": (tmp_path / "venv-b", tmp_path / "work-b", f"{ADAPTERS}:wrong_scale", 1)}
    keys = set()
    for prefix, work, impl, want in envs.values():
        work.mkdir()
        monkeypatch.setattr(sys, "prefix", str(prefix))
        monkeypatch.chdir(work)
        rc, out, err = _validate(capsys, "--impl", impl, "--ops", "direct", "--seed", "4", "--max-examples", "2")
        assert rc == want, out + err
        keys.add(kcli.last_report_path())
    assert len(keys) == 2
    for name, (prefix, work, impl, want) in envs.items():
        monkeypatch.setattr(sys, "prefix", str(prefix))
        monkeypatch.chdir(work)
        rc, md, err = _report(capsys)
        assert rc == 0, err
        lines = md.splitlines()
        assert lines[1] == f"# kvbuffer validate: {'PASSED' if want == 0 else 'FAILED'}", md
        head = "\n".join(lines[:8])
        assert f"--impl {impl}" in head and f"`{prefix}`" in head and str(work) in head, head
        assert "seed 4" in head and "started 20" in head
        assert impl.split(":")[1] in lines[4]  # the implementations line


def test_validate_json_then_report_path_names_the_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "run.json"
    rc, out, err = _validate(capsys, "--impl", f"{ADAPTERS}:good", "--ops", "direct", "--seed", "9",
                             "--max-examples", "2", "--json", str(path))
    assert rc == 0, out + err
    assert f"kvbuffer report {path}" in out
    data = json.loads(path.read_text())
    assert data["implementations"] == ["good"] and data["environment"]["prefix"] == sys.prefix
    assert data["environment"]["cwd"] and data["started"]
    rc, md, err = _report(capsys, str(path))
    assert rc == 0, err
    head = md.splitlines()[:6]
    assert head[1] == "# kvbuffer validate: PASSED"
    assert head[3].startswith("- Command: `kvbuffer validate --impl") and "--seed 9" in head[3]
    assert head[4].startswith("- Implementations: good; seed 9; started ")
    assert head[5].startswith(f"- Environment: `{sys.prefix}`")


# ----------------------------------------------------------------------------- failure labels
@pytest.fixture(scope="module")
def gate_axis_lane():
    (r,) = [x for x in run_validation([resolve(f"{ADAPTERS}:gate_wrong_axis")], ops=select_ops("recurrent_decode"),
                                      seed=3, max_examples=2, progress=None).lanes if x.status != "NOT PROVIDED"]
    return r


def test_an_exception_on_a_later_call_is_raised_with_the_call_that_raised(gate_axis_lane):
    """A per-channel gate applied on the V axis raises whenever K != V: the first anchor (K=8, V=12, a
    scalar gate) passes, the third call of its sequence (another shape, a per-channel gate) raises."""
    r = gate_axis_lane
    assert r.status == "FAIL" and r.klass == "raised", (r.klass, r.why, r.failure)
    f = r.failure
    assert f["call"] == "a third call with another shape" and "a third call with another shape" in r.why
    assert f["case"].channel_gate and f["case"].K != f["case"].V  # the call that raised, not the first call
    assert f["error"].startswith("RuntimeError: The size of tensor") and "state-leak" not in f["error"]
    assert r.checks > 0  # the calls before the one that raised made their comparisons
    text = rep.format_failure(r, "replay")
    assert "FAIL [raised]: recurrent_decode /" in text
    assert "the call that raised (a third call with another shape" in text and "smallest failing case" not in text
    assert "[raised] the implementation raised RuntimeError" in text and "state-leak" not in text
    row = rep.table_row(r)
    assert "FAIL [raised]" in row and row.rstrip().split()[-1] == str(r.checks) != "0"


def test_the_markdown_of_a_raise_says_raised_not_state_leak(gate_axis_lane, tmp_path):
    report = rep.Report(profile="ci", seed=3, device="cpu", triton="-", lanes=[gate_axis_lane])
    md = kcli.validation_markdown(report.to_json())
    assert "| FAIL [raised] |" in md and "### FAIL [raised]: recurrent_decode" in md
    assert "- The implementation raised `RuntimeError: The size of tensor" in md
    assert "- Caught by [raised]: recurrent_decode raised on a third call with another shape" in md
    assert "state-leak" not in md


def test_a_failing_recurrent_decode_lane_names_its_comparisons_after_its_lane():
    (r,) = [x for x in run_validation([resolve(f"{ADAPTERS}:decode_double_gate")], ops=select_ops("recurrent_decode"),
                                      dtypes=parse_dtypes("float32"), seed=3, max_examples=2, progress=None, explain=False).lanes
            if x.status != "NOT PROVIDED"]
    assert r.status == "FAIL" and r.checks > 0
    comps = r.failure["comparisons"]
    assert comps and all("recurrent_decode[" in c for c in comps if c.startswith("FAIL")), comps
    assert not any(" recurrent[" in c for c in comps) and r.worst_comparison.startswith("recurrent_decode[")
    assert "recurrent[" not in rep.format_failure(r, "replay").replace("recurrent_decode[", "")


def test_the_table_stays_aligned_with_long_implementation_names():
    long = "an-implementation-name-far-longer-than-its-column-x" * 2
    rows = [rep.LaneResult("recurrent_decode", "gate-wrong-axis-with-a-long-name", "float32", "FAIL", cases=3,
                           klass="raised", checks=4, seconds=0.5),
            rep.LaneResult("verify_chain[raw]", long, "float32", "PASS", cases=12, worst_rel=1e-7, budget=1e-5,
                           checks=30, seconds=2.0),
            rep.LaneResult("chunk", "good", None, "NOT PROVIDED", reason="the adapter has no chunk_gated_delta_rule")]
    widths = rep.column_widths([r.implementation for r in rows])
    text = "\n".join([rep.table_header(widths)] + [rep.table_row(r, widths) for r in rows])
    lines = text.splitlines()
    col = lines[0].index("dtype")
    assert all(l[col:].startswith(("dtype", "-", "float32")) for l in lines), text
    assert "gate-wrong-axis-with-a-long-name" in lines[2]  # fits: the column grew to it
    assert len(lines[3].split("float32")[0].rstrip()) <= widths[0] + 2 + rep.MAX_NAME_WIDTH and "…" in lines[3]
    assert lines[3].split()[1].startswith("an-implementation") and lines[3].split()[1].endswith("column-x")


# ----------------------------------------------------------------------------- --impl
def test_impl_of_a_module_without_attr_suggests_its_adapters(capsys):
    rc, out, err = _validate(capsys, "--impl", ADAPTERS)
    assert rc == 2 and "nothing to validate" not in err
    assert "is not itself an adapter" in err and "ATTR one of" in err
    for name in ("good", "wrong_scale", "gate_wrong_axis", "factory"):
        assert name in err
    assert "empty" not in err.split("ATTR one of")[1]  # no operation: not an adapter


def test_impl_of_a_module_in_the_working_directory_needs_no_pythonpath(capsys, tmp_path, monkeypatch):
    (tmp_path / "kvb_local_adapter_mod.py").write_text(
        "import types, torch, kvbuffer_ref as ref\n"
        "adapter = types.SimpleNamespace(name='local', dtypes=(torch.float64,),\n"
        "                                direct_gated_delta_rule=ref.direct_gated_delta_rule)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != tmp_path])
    monkeypatch.delitem(sys.modules, "kvb_local_adapter_mod", raising=False)
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / "cache"))
    rc, out, err = _validate(capsys, "--impl", "kvb_local_adapter_mod", "--max-examples", "1", "-q")
    assert rc == 2 and "did you mean --impl kvb_local_adapter_mod:adapter?" in err, err
    rc, out, err = _validate(capsys, "--impl", "kvb_local_adapter_mod:adapter", "--ops", "direct", "--max-examples",
                             "1", "-q")
    assert rc == 0, out + err
    sys.modules.pop("kvb_local_adapter_mod", None)


# ----------------------------------------------------------------------------- plots
def test_report_out_without_matplotlib_warns_and_says_so_in_the_report(capsys, tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / "cache"))
    rc, out, err = _validate(capsys, "--impl", f"{ADAPTERS}:good", "--ops", "direct", "--seed", "1",
                             "--max-examples", "1", "--json", str(path))
    assert rc == 0, out + err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc, out, err = _report(capsys, str(path), "--out", str(tmp_path / "out"))
    assert rc == 0 and "warning: no plots: matplotlib is not installed" in err
    md = (tmp_path / "out" / "report.md").read_text()
    assert "No plot: no plots: matplotlib is not installed" in md and "![" not in md
    assert not list((tmp_path / "out").glob("*.png"))


def test_the_lanes_plot_marks_an_exact_zero_and_colours_pass_and_fail(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    data = {"seed": 1, "device": "cpu", "passed": False, "results": [
        dict(operation="direct", implementation="a", dtype="float64", status="PASS", worst_rel=0.0, budget=1e-12),
        dict(operation="chunk", implementation="a", dtype="float32", status="PASS", worst_rel=1e-7, budget=1e-5),
        dict(operation="decode", implementation="a", dtype="float32", status="FAIL", worst_rel=1e-3, budget=1e-5,
             klass="wrong-result"),
        dict(operation="verify", implementation="a", dtype="float32", status="FAIL", klass="raised")]}
    seen = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, *a, **kw):
        ax = fig.axes[0]
        seen["texts"] = [t.get_text() for t in ax.texts]
        seen["colours"] = {tuple(round(c, 3) for c in p.get_facecolor()[:3]) for p in ax.patches}
        seen["xmin"] = ax.get_xlim()[0]
        return real_savefig(fig, *a, **kw)

    plt.Figure.savefig, saved = spy, plt.Figure.savefig
    try:
        assert kcli.plot_lanes(data, tmp_path / "lanes.png")
    finally:
        plt.Figure.savefig = saved
    assert "0 (exact)" in seen["texts"] and "FAIL [raised]: no comparison" in seen["texts"]
    assert "0.01" in seen["texts"] and "100" in seen["texts"]  # each bar labelled with its ratio
    assert len(seen["colours"]) == 2 and seen["xmin"] > 1e-6  # blue and red; the axis starts near the data
    assert (tmp_path / "lanes.png").stat().st_size > 1000


def test_the_benchmark_plot_has_ratio_panels_with_our_series_marked(tmp_path):
    pytest.importorskip("matplotlib")
    gpu = ROOT / "bench" / "results" / "latest" / "gpu.json"
    if not gpu.is_file():
        pytest.skip("no committed benchmark results")
    sys.path.insert(0, str(ROOT))
    try:
        import bench.report as br
    finally:
        sys.path.remove(str(ROOT))
    data = json.loads(gpu.read_text())
    panels = br.latency_panels(data)
    groups = {p["group"] for p in panels}
    assert {"decode", "round"} <= groups
    kinds = {(p["group"], p["kind"]) for p in panels}
    assert ("decode", "ratio") in kinds and ("decode", "floor") in kinds and ("decode", "time") in kinds
    ratio = next(p for p in panels if p["group"] == "decode" and p["kind"] == "ratio")
    assert "buffered_decode / fla_fused_recurrent" in [s["label"] for s in ratio["series"]]
    time = next(p for p in panels if p["group"] == "decode" and p["kind"] == "time")
    ours = {s["label"] for s in time["series"] if s["ours"]}
    assert "buffered_decode" in ours and "fla_fused_recurrent" not in ours and "replayssm_decode" not in ours
    assert br.plot_latency(data, tmp_path / "latency.png")
    assert (tmp_path / "latency.png").stat().st_size > 10000


def test_every_lane_reports_its_margin_and_its_error_over_a_correct_kernels():
    """A passing lane of the recurrence in float32 reports its worst error / budget (below 1) and, at that
    slice, its error over the correct forms' (about 1: the recurrence is one of them); a kernel whose q is
    scaled by 1.01 reports both past them."""
    import types

    import torch

    import kvbuffer_ref as ref
    from kvbuffer.validate import adapters
    from kvbuffer.validate.report import over_correct, table_row
    from kvbuffer.validate.runner import run_validation

    def scaled(q, k, v, **kw):
        return ref.recurrent_gated_delta_rule(1.01 * q, k, v, **kw)

    lanes = {}
    for name, fn in (("right", ref.recurrent_gated_delta_rule), ("scaled", scaled)):
        impl = adapters.describe(types.SimpleNamespace(name=name, recurrent_gated_delta_rule=fn))
        (lanes[name],) = run_validation([impl], ops=[("recurrent", None)], dtypes=[torch.float32], seed=5,
                                        max_examples=4, progress=None, explain=False, shrink=False).lanes
    right, wrong = lanes["right"], lanes["scaled"]
    assert right.status == "PASS" and wrong.status == "FAIL", (right, wrong)
    assert 0 < right.margin < 1 and 0.5 < over_correct(right.worst_rel, right.baseline) < 2, (right.margin, right.baseline)
    assert wrong.margin > 1 and over_correct(wrong.worst_rel, wrong.baseline) > 100, (wrong.margin, wrong.baseline)
    row = table_row(right).split()
    assert f"{right.margin:.2f}" in row and f"{over_correct(right.worst_rel, right.baseline):.3g}x" in row
