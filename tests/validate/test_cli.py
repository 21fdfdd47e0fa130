"""``kvbuffer validate``: exit codes 0 / 1 / 2, the printed table and failure report, --json, --seed, --replay."""

import json

import pytest
import torch

from kvbuffer import cli as kcli

from .conftest import ADAPTERS


def _main(capsys, *args):
    rc = kcli.main(["validate", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_correct_adapter_passes_and_the_rest_is_reported_not_provided(capsys):
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:good", "--seed", "3", "--max-examples", "4")
    assert rc == 0, out + err
    for col in ("operation", "implementation", "dtype", "cases", "worst rel-RMS", "budget", "result"):
        assert col in out
    lines = out.splitlines()
    assert any(l.startswith("chunk") and "good" in l and "float64" in l and "PASS" in l for l in lines), out
    assert any(l.startswith("direct") and "PASS" in l for l in lines), out
    # every operation it lacks is listed, with the reason
    for op in ("recurrent", "decode", "flush", "verify_chain", "verify_tree", "prefill", "materialize"):
        assert any(l.startswith(op) and "NOT PROVIDED" in l for l in lines), (op, out)
    assert "the adapter has no buffered_decode" in out
    assert "PASSED" in out


def test_a_broken_adapter_fails_with_its_smallest_case_and_how_to_replay_it(capsys, tmp_path):
    path = tmp_path / "report.json"
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:wrong_scale", "--seed", "7", "--json", str(path))
    assert rc == 1, out + err
    assert "FAIL" in out and "smallest failing case: Case(" in out
    assert "replay: kvbuffer validate --impl tests.validate.adapters_for_tests:wrong_scale --ops direct" in out
    assert "--seed 7" in out
    assert "anchor case 0 of direct" in out  # a wrong scale is caught by the first fixed case already
    report = json.loads(path.read_text())
    assert report["passed"] is False and report["seed"] == 7 and report["profile"] == "ci"
    (fail,) = [r for r in report["results"] if r["status"] == "FAIL"]
    assert fail["operation"] == "direct" and fail["implementation"] == "wrong_scale" and fail["dtype"] == "float64"
    assert fail["worst_rel"] > fail["budget"]
    case = fail["failure"]["case"]
    assert set(case) >= {"B", "T", "H", "HV", "K", "V", "channel_gate", "gate", "beta", "seed"}
    assert fail["failure"]["anchor"] == 0 and fail["failure"]["comparisons"]
    assert {r["status"] for r in report["results"]} == {"FAIL", "NOT PROVIDED"}


def test_an_exception_is_a_failure_shrunk_by_hypothesis_and_replayed_by_its_blob(capsys, tmp_path):
    path = tmp_path / "report.json"
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:raises", "--seed", "1", "--max-examples", "60",
                         "--json", str(path))
    assert rc == 1, out + err
    assert "the implementation raised RuntimeError: sequences longer than 2 tokens" in out
    assert "B=3, T=3" in out  # shrunk to the smallest failing batch and sequence
    assert "@reproduce_failure(" in out
    (fail,) = [r for r in json.loads(path.read_text())["results"] if r["status"] == "FAIL"]
    blob, case = fail["failure"]["blob"], fail["failure"]["case"]
    assert blob and fail["failure"]["anchor"] is None and "RuntimeError" in fail["failure"]["error"]
    # the blob replays exactly that case, without the anchors and the search
    rc2, out2, _ = _main(capsys, "--impl", f"{ADAPTERS}:raises", "--ops", "direct", "--dtype", "float64",
                         "--replay", blob)
    assert rc2 == 1
    assert f"seed={case['seed']}" in out2 and "B=3, T=3" in out2
    assert "  1  " in out2.splitlines()[3]  # one case run
    # the same case against a correct implementation: it passes (not an ERROR of hypothesis's replay)
    rc3, out3, _ = _main(capsys, "--impl", f"{ADAPTERS}:good", "--ops", "direct", "--dtype", "float64",
                         "--replay", blob)
    assert rc3 == 0 and "PASS" in out3 and "ERROR" not in out3, out3


def test_the_same_seed_draws_the_same_cases(capsys, tmp_path):
    reports = []
    for i in range(2):
        p = tmp_path / f"r{i}.json"
        rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:good", "--ops", "chunk", "--seed", "11",
                             "--max-examples", "5", "--json", str(p))
        assert rc == 0, out + err
        reports.append(json.loads(p.read_text()))
    strip = [[(r["operation"], r["cases"], r["worst_rel"], r["seed"]) for r in rep["results"]] for rep in reports]
    assert strip[0] == strip[1]


def test_a_factory_and_the_ops_selection(capsys):
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:factory", "--ops", "direct", "--max-examples", "3", "-q")
    assert rc == 0, out + err
    assert "chunk" not in out  # not selected, not listed


@pytest.mark.parametrize("args, message", [
    (["--impl", "no_such_module_xyz:adapter"], "no module named 'no_such_module_xyz'"),
    (["--impl", f"{ADAPTERS}:no_such_attr"], "has no attribute 'no_such_attr'"),
    (["--impl", f"{ADAPTERS}:empty"], "is not an adapter"),
    (["--ops", "decode,bogus"], "unknown operation 'bogus'"),
    (["--ops", "direct[u]"], "has no buffer form"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
    (["--impl", f"{ADAPTERS}:good", "--ops", "decode"], "nothing to validate"),
    (["--impl", f"{ADAPTERS}:good", "--replay", "AAAA"], "--replay: select exactly one lane"),
    (["--max-examples", "0"], "--max-examples"),
])
def test_bad_arguments_exit_2_with_a_message_and_no_traceback(capsys, args, message):
    rc, out, err = _main(capsys, *args)
    assert rc == 2
    assert message in err and "Traceback" not in err + out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_cuda_exits_2(capsys):
    rc, out, err = _main(capsys, "--device", "cuda")
    assert rc == 2 and "CUDA is not available" in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        kcli.main(["validate", "--profile", "nope"])
    assert e.value.code == 2


def test_the_entry_point_runs_as_a_program(cli, tmp_path):
    """The real command line in a fresh process: the interpreter enabled before triton loads, the bundled
    Triton kernels validated through the fast adapter (a buffer operation and the stepwise decode step,
    the fixed anchor cases plus one drawn case each: the kernels themselves are tested in
    tests/property/test_fast_*.py), the JSON written."""
    p = tmp_path / "fast.json"
    r = cli("--impl", "fast", "--ops", "materialize[u],recurrent_decode", "--max-examples", "1", "--seed", "5",
            "--json", str(p))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(Triton interpreter)" in r.stdout
    rep = json.loads(p.read_text())
    ran = {(x["operation"], x["status"]) for x in rep["results"]}
    assert ("materialize[u]", "PASS") in ran and ("recurrent_decode", "PASS") in ran
    r2 = cli("--impl", "no_such_module_xyz:a")
    assert r2.returncode == 2 and "Traceback" not in r2.stderr


# ----------------------------------------------------------------------------- kvbuffer report
def test_validate_keeps_its_last_report_and_report_renders_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no bench/results/latest here: only the validation report is rendered
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:wrong_scale", "--ops", "direct,chunk", "--seed", "7",
                         "--max-examples", "2")
    assert rc == 1, out + err
    assert kcli.last_report_path().is_file() and kcli.last_report_path().is_relative_to(tmp_path / "cache")
    rc = kcli.main(["report"])
    md = capsys.readouterr().out
    assert rc == 0
    assert md.splitlines()[1] == "# kvbuffer validate: FAILED"
    assert ("| operation | implementation | dtype | cases | worst rel-RMS | budget | error / budget | "
            "error / a correct kernel's | result | time |") in md
    row = next(l for l in md.splitlines() if l.startswith("| direct | wrong_scale | float64 |"))
    # error / budget past 1, its error many times a correct kernel's, the class
    assert "| FAIL [wrong-result] |" in row and float(row.split("|")[7]) > 1.0
    assert float(row.split("|")[8].strip().rstrip("x")) > 4.0
    assert "## Failures" in md and "Smallest failing case: `Case(" in md and "FAIL direct.o [float64]" in md
    assert "NOT PROVIDED: the adapter has no" in md or "| chunk | wrong_scale | float64 |" in md


def test_report_writes_markdown_and_plots(capsys, tmp_path):
    from .conftest import ROOT

    p = tmp_path / "run.json"
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:good", "--ops", "direct", "--seed", "2", "--max-examples",
                         "2", "--json", str(p))
    assert rc == 0, out + err
    rc = kcli.main(["report", str(p), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0 and "wrote" in out
    md = (tmp_path / "out" / "report.md").read_text()
    assert "# kvbuffer validate: PASSED" in md and "| direct | good | float64 |" in md
    bench = ROOT / "bench" / "results" / "latest" / "gpu.json"
    if bench.is_file():  # benchmark JSON is bench/'s to render (bench/ is not in the wheel): the message says how
        rc = kcli.main(["report", str(bench)])
        assert rc == 2 and "python3 -m bench.report" in capsys.readouterr().err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "out" / "run-lanes.png").stat().st_size > 1000
    assert "![error / budget per lane](run-lanes.png)" in md


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not readable JSON"),
    ('{"kind": "something else"}', "not a `kvbuffer validate --json` report"),
    ("[1, 2]", "expected a JSON object"),
])
def test_report_bad_files_exit_2_with_a_message(capsys, tmp_path, content, message):
    p = tmp_path / "x.json"
    if content is not None:
        p.write_text(content)
    rc = kcli.main(["report", str(p)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_report_with_nothing_to_render_says_where_it_looked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    rc = kcli.main(["report"])
    err = capsys.readouterr().err
    assert rc == 2 and "run `kvbuffer validate` first" in err and str(tmp_path / "empty") in err


# ----------------------------------------------------------------------------- install: what the docs promise
def _pyproject():
    import tomllib

    from .conftest import ROOT
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_ships_every_golden_vector_file():
    """pyproject's package data covers every file of the golden data directory (a new case ships too)."""
    from fnmatch import fnmatch

    from kvbuffer import golden

    patterns = _pyproject()["tool"]["setuptools"]["package-data"]["kvbuffer.golden"]
    base = golden.PACKAGE_DIR.parent
    files = [p.relative_to(base).as_posix() for p in golden.PACKAGE_DIR.rglob("*") if p.is_file()]
    assert len(files) > 10
    assert [f for f in files if not any(fnmatch(f, pat) for pat in patterns)] == []


def test_the_extras_are_pinned_as_the_docs_say():
    from .conftest import ROOT

    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["fast"] == ["triton>=3.0"]
    assert "fla-core==0.6.0" in extras["crosscheck"]
    (tf,) = [d for d in extras["crosscheck"] if d.startswith("transformers")]
    assert "<" in tf and ">=" in tf, tf  # a tested range, not any release
    readme = (ROOT / "README.md").read_text()
    assert f"`{tf}`" in readme and "`fla-core==0.6.0`" in readme and "`triton>=3.0`" in readme
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in (ROOT / "scripts" / "install.sh").read_text()


def test_the_readme_names_the_rows_validate_reports_not_provided_for_kvbuffer_fast():
    from kvbuffer.validate import adapters, lanes
    from kvbuffer import implementations

    from .conftest import ROOT

    impl = implementations.fast()
    missing = sorted(op.key for op in lanes.OPS if any(a in impl.not_provided for a in op.needs))
    readme = " ".join((ROOT / "README.md").read_text().split())
    if not missing:  # every operation has a kernel: the README must not say otherwise
        assert "NOT PROVIDED for `kvbuffer_fast`" not in readme
        return
    said = "`kvbuffer validate` lists " + ", ".join(f"`{m}`" for m in missing[:-1]) + f" and `{missing[-1]}` " \
        "as NOT PROVIDED for `kvbuffer_fast`"
    assert said in readme, (missing, said)
