"""The pytest plugin (``pytest --kvbuffer-impl module:attr``), run in a fresh pytest process."""

import os
import subprocess
import sys

from .conftest import ADAPTERS, ROOT


def _pytest(tmp_path, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("HYPOTHESIS_PROFILE", None)
    (tmp_path / "test_trivial.py").write_text("def test_trivial():\n    assert True\n")
    # pip-installed, the package registers the plugin through its pytest11 entry point; from a bare
    # checkout (PYTHONPATH only) it has to be named with -p, and naming it twice is an error
    load = [] if _entry_point_installed() else ["-p", "kvbuffer_ref.pytest_plugin"]
    return subprocess.run([sys.executable, "-m", "pytest", *load, "-p", "no:cacheprovider",
                           "-rs", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "kvbuffer_ref.pytest_plugin" for ep in entry_points(group="pytest11"))


def test_without_the_option_the_plugin_does_nothing(tmp_path):
    r = _pytest(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "kvbuffer[" not in r.stdout


def test_outside_implementations_become_test_items(tmp_path):
    r = _pytest(tmp_path, "-v", f"--kvbuffer-impl={ADAPTERS}:good", f"--kvbuffer-impl={ADAPTERS}:wrong_scale",
                "--kvbuffer-seed=5", "--kvbuffer-max-examples=4")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "kvbuffer[good-chunk-float64] PASSED" in out
    assert "kvbuffer[good-direct-float64] PASSED" in out
    assert "kvbuffer[wrong_scale-direct-float64] FAILED" in out
    assert "smallest failing case: Case(" in out and "--seed 5" in out
    assert "SKIPPED" in out and "not provided: the adapter has no buffered_decode" in out
    assert "test_trivial.py::test_trivial PASSED" in out


def test_a_bad_option_is_a_usage_error(tmp_path):
    r = _pytest(tmp_path, "--kvbuffer-impl=no_such_module_xyz:a")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "no module named 'no_such_module_xyz'" in r.stdout + r.stderr
