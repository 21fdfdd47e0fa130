"""``kvbuffer --version``: the package, torch and triton versions, exit status 0."""

import subprocess
import sys
from pathlib import Path

import torch

import kvbuffer_ref
from kvbuffer.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_names_the_package_torch_and_triton(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"kvbuffer {kvbuffer_ref.__version__} (torch {torch.__version__}, triton ")
    assert out.endswith(")")


def test_version_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "kvbuffer.cli", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"kvbuffer {kvbuffer_ref.__version__} ")
