"""scripts/mutate.py: every planted bug still applies to the current code, and one is killed end to end."""

import importlib.util
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("kvbuffer_mutate", ROOT / "scripts" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_at_least_twenty_mutants_in_the_ci_selection(mutate):
    ids = [m.id for m in mutate.MUTANTS]
    assert len(ids) == len(set(ids))
    assert sum(m.quick for m in mutate.MUTANTS) >= 20
    assert {m.package for m in mutate.MUTANTS} == {"kvbuffer_fast", "kvbuffer_ref", mutate.PT}


def test_several_mutants_per_class_plain_pytorch_and_kernel(mutate):
    from kvbuffer_ref.validate.runner import CLASSES

    planted = [m for m in mutate.MUTANTS if m.klass]
    assert sum(m.id[0] in "PK" for m in planted) >= 30  # written for the classes (P: plain PyTorch, K: kernel)
    assert {m.klass for m in planted} <= set(CLASSES)
    for klass in ("inputs-changed", "arguments", "tile-boundary", "state-leak", "domain", "memory-layout",
                  "partial-flush"):
        mine = [m for m in mutate.MUTANTS if m.klass == klass]
        assert len(mine) >= 2, klass
    assert {mutate.PT, "kvbuffer_fast"} <= {m.package for m in planted if m.id[0] in "PK"}


def test_every_mutant_applies_to_the_current_code(mutate, tmp_path):
    """A kernel rewrite that removes a mutated line must update the mutant (else it silently tests nothing)."""
    for m in mutate.MUTANTS:
        name = mutate.copy_name(m)
        mutate.plant(m, tmp_path / m.id)  # ValueError if the text to mutate is not there exactly once
        if m.package == mutate.PT:  # a plain-PyTorch adapter, written whole
            assert (tmp_path / m.id / f"{name}_adapter.py").read_text().endswith(m.new), m.id
            continue
        text = (tmp_path / m.id / name / m.file).read_text()
        assert text != (ROOT / m.package / m.file).read_text(), m.id
        assert m.new in text, m.id


def test_a_mutant_is_killed_and_the_real_files_are_untouched(tmp_path):
    before = (ROOT / "kvbuffer_ref" / "direct.py").read_text()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py"), "--only", "R03", "R07", "P02",
                        "--skip-baseline"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "R03  killed" in r.stdout and "mutation score: 3/3 killed" in r.stdout
    assert "by [partial-flush]" in r.stdout.split("R07")[1].splitlines()[0]  # the killing class is named
    assert "by [inputs-changed]" in r.stdout.split("P02")[1].splitlines()[0]
    assert "inputs-changed  1/1" in r.stdout  # the score per planted class
    assert (ROOT / "kvbuffer_ref" / "direct.py").read_text() == before


def test_a_bug_below_a_contracts_rounding_is_listed_as_a_limit_and_fails_nothing(mutate):
    limits = [m for m in mutate.MUTANTS if m.below_rounding]
    assert [m.id for m in limits] == ["P29"]  # docs/testing.md explains each
    assert all("ieee" not in m.below_rounding for m in limits)  # IEEE float32 must kill every mutant
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py"), "--only", "P29", "--contracts",
                        "ieee,tf32", "--skip-baseline"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "P29  killed" in r.stdout and "P29@tf32  SURVIVED" in r.stdout
    assert "not killed, a genuine limit" in r.stdout and "\nnot killed: " not in r.stdout
