"""Helpers for the tests of ``kvbuffer validate``, its adapters, the pytest plugin and the mutation script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = "tests.validate.adapters_for_tests"


def run_cli(*args, cwd=None, timeout=300):
    """``python -m kvbuffer.cli validate ARGS`` in a subprocess (the real entry point); returns it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("HYPOTHESIS_PROFILE", None)
    return subprocess.run([sys.executable, "-m", "kvbuffer.cli", "validate", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
