"""The pytest plugin (``pytest --kvbuffer-impl module:attr``): a pytest session of its own (pytester,
in this process: the plugin, torch and the adapters are imported once) in an empty directory."""

import types

from .conftest import ADAPTERS

pytest_plugins = ["pytester"]


def _pytest(pytester, *args):
    pytester.makepyfile(test_trivial="def test_trivial():\n    assert True\n")
    # pip-installed, the package registers the plugin through its pytest11 entry point; from a bare
    # checkout (PYTHONPATH only) it has to be named with -p, and naming it twice is an error
    load = [] if _entry_point_installed() else ["-p", "kvbuffer.pytest_plugin"]
    r = pytester.runpytest_inprocess(*load, "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:benchmark", "-rs", *args)
    return types.SimpleNamespace(returncode=int(r.ret), stdout=r.stdout.str(), stderr=r.stderr.str())


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "kvbuffer.pytest_plugin" for ep in entry_points(group="pytest11"))


def test_without_the_option_the_plugin_does_nothing(pytester):
    r = _pytest(pytester)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "kvbuffer[" not in r.stdout


def test_outside_implementations_become_test_items(pytester):
    r = _pytest(pytester, "-v", f"--kvbuffer-impl={ADAPTERS}:good", f"--kvbuffer-impl={ADAPTERS}:wrong_scale",
                "--kvbuffer-seed=5", "--kvbuffer-max-examples=4")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "kvbuffer[good-chunk-float64] PASSED" in out
    assert "kvbuffer[good-direct-float64] PASSED" in out
    assert "kvbuffer[wrong_scale-direct-float64] FAILED" in out
    assert "smallest failing case: Case(" in out and "--seed 5" in out
    assert "SKIPPED" in out and "not provided: the adapter has no buffered_decode" in out
    assert "test_trivial.py::test_trivial PASSED" in out


def test_a_bad_option_is_a_usage_error(pytester):
    r = _pytest(pytester, "--kvbuffer-impl=no_such_module_xyz:a")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "no module named 'no_such_module_xyz'" in r.stdout + r.stderr
