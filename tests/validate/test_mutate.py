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
    from kvbuffer.validate.runner import CLASSES

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
    """Three mutants through mutate.py's default pool of two worker processes (the other runs here take one
    worker: each worker process imports torch and triton, and the suite's workers already fill the cores)."""
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
    assert [m.id for m in limits] == ["H01", "H02", "H06", "P29"]  # docs/testing.md explains each
    assert all("ieee" not in m.below_rounding for m in limits)  # IEEE float32 must kill every mutant
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py"), "--only", "P29", "--contracts",
                        "ieee,tf32", "--skip-baseline", "--jobs", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "P29  killed" in r.stdout and "P29@tf32  SURVIVED" in r.stdout
    assert "not killed, a genuine limit" in r.stdout and "\nnot killed: " not in r.stdout


def test_one_percent_and_16_bit_mutants_run_long_sequences_with_small_heads(mutate):
    """L: q scale, gate g and beta off by 1 % in each of the recurrent, chunk, decode and verify forms (float32);
    H: rounding to 16 bits where fp32 arithmetic is declared, and 1 % errors, with bfloat16 and float16 inputs.
    All at the "long" size budget (boundary cases at T = 256, heads small enough for a CPU run); none may survive
    under the IEEE or TF32 contract (``below_rounding`` names 16-bit contracts only)."""
    from kvbuffer.validate.cases import Sizes

    long = Sizes(**mutate.SIZES["long"])
    assert long.edge_T >= 256
    assert max(long.dims) <= 16 and max(max(kv) for kv in long.edge_dims) <= 16 and long.edge_HV[1] <= 4
    assert long.edge_B == 0
    L = [m for m in mutate.MUTANTS if m.id.startswith("L")]
    H = [m for m in mutate.MUTANTS if m.id.startswith("H")]
    forms = {("recurrent.py", "recurrent"), ("chunk.py", "chunk"), ("decode.py", "decode"),
             ("speculative.py", "verify_chain")}
    assert len(L) == 12 and {(m.file, m.ops) for m in L} == forms
    for form in ("recurrent", "chunk", "decode", "verify"):
        what = {m.what.split(": ")[1].split(" x ")[0] for m in L if m.what.startswith(form)}
        assert what == {"q scale", "gate g", "beta"}, form
    assert all("1.01" in m.new and "1.01" not in m.old for m in L)
    assert {m.dtype for m in H} == {"bfloat16", "float16"} and len(H) >= 8
    assert all(m.package == mutate.R and m.sizes == "long" for m in L + H)
    assert not any({"ieee", "tf32"} & set(m.below_rounding) for m in L + H)  # CI's contracts kill every one
    assert {m.dtype for m in L} == {"float32"}


def test_a_copy_declares_its_size_budget_and_16_bit_dtypes(mutate, tmp_path):
    import torch

    m = next(m for m in mutate.MUTANTS if m.id == "H01")
    mutate.plant(m, tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        impl = importlib.import_module(f"{mutate.copy_name(m)}_adapter").impl()
    finally:
        sys.path.remove(str(tmp_path))
    assert impl.sizes.edge_T == 256 and impl.sizes.name.startswith("long")
    assert {torch.bfloat16, torch.float32} <= set(impl.dtypes)  # the mutant's dtype beside the reference's
    assert impl.obj.__name__ == mutate.copy_name(m)  # the mutated copy, not the real kvbuffer_ref


def test_long_and_16_bit_mutants_are_killed(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py"), "--only", "L05", "H01", "H07",
                        "--contracts", "ieee", "--skip-baseline", "--jobs", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mutation score: 3/3 killed" in r.stdout
