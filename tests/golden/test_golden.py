"""The golden vectors: well-formed, reproducible, and matched by every reference implementation.

* every stored case is run through the kvbuffer_ref function of its operation (buffered operations
  in both buffer forms) and compared with the stored float64 RECURRENT truth under the float64
  budget of the tolerance table; a few also at float32 (the calibrated budget path of golden.check);
* a few cases are rebuilt by scripts/make_golden.py and must equal the stored files bit for bit where
  this machine's float64 sums run in the files' order, else within the table's float64 row;
* the index covers every operation and edge case the vectors promise, and describes the files exactly;
* the checker itself fails a wrong implementation (it is not vacuous).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import kvbuffer_ref
from kvbuffer_ref.buffer import KVBuffer
from kvbuffer import golden

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "kvbuffer" / "golden" / "data"  # the vectors: package data, shipped in the wheel
CASES = golden.load_cases(HERE)
BY_ID = {c.id: c for c in CASES}


def _ids(ops=None):
    return [c.id for c in CASES if ops is None or c.op in ops]


def _fail_message(reports) -> str:
    return "\n".join(str(r) for r in reports if not r.passed)


# ------------------------------------------------------------------ the reference matches the truth
@pytest.mark.parametrize("case_id", _ids())
def test_reference_matches_recurrent_truth(case_id):
    """Each operation's kvbuffer_ref function (chunk, direct, buffered decode, flush, verify + accept,
    prefill; u-cache and raw buffers) reproduces the stored recurrent truth to the float64 budget."""
    reports = golden.check(kvbuffer_ref, cases=[BY_ID[case_id]], dtype=torch.float64)
    assert all(r.passed for r in reports), _fail_message(reports)


@pytest.mark.parametrize("case_id", ["chunk_gates_mixed", "decode_ragged_lengths", "verify_tree_forest_grouped",
                                     "prefill_kda_initial_state_full_tail", "flush_partial_kda"])
def test_reference_float32_within_calibrated_budget(case_id):
    """The float32 path of golden.check: inputs rounded to float32, budget from the float32 recurrence."""
    reports = golden.check(kvbuffer_ref, cases=[BY_ID[case_id]], dtype=torch.float32)
    assert all(r.passed for r in reports), _fail_message(reports)


# ---------------------------------------------------------------------------- reproducibility
def _generator():
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "scripts" / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REBUILT = ["recurrent_kda_gates_mixed", "chunk_grouped_nonpow2", "direct_edges", "decode_edges", "flush_partial_kda",
           "verify_chain_ragged_overflow", "verify_tree_ragged", "prefill_default_tail"]


def test_generator_reproduces_stored_files_bit_for_bit(tmp_path):
    """scripts/make_golden.py rebuilds a sample of cases (one per operation) byte for byte."""
    gen = _generator()
    built = gen.build_all(set(REBUILT))
    assert sorted(e["id"] for e, _ in built) == sorted(REBUILT)
    index = {e["id"]: e for e in golden.load_index(HERE)["cases"]}
    for entry, arrays in built:
        f = tmp_path / f"{entry['id']}.npz"
        golden.write_npz(f, arrays)
        stored = golden.read_npz(HERE / entry["file"])
        assert sorted(stored) == sorted(arrays), entry["id"]
        for name in arrays:  # name the first differing tensor before comparing bytes
            why = golden.stored_mismatch(f"{entry['id']}: tensor {name}", arrays[name], stored[name])
            assert why is None, why
        if all(np.array_equal(stored[n], arrays[n], equal_nan=True) for n in arrays):
            assert f.read_bytes() == (HERE / entry["file"]).read_bytes(), f"{entry['id']}: file bytes differ"
        stored_entry = dict(index[entry["id"]])
        stored_entry.pop("sha256")
        assert json.loads(json.dumps(entry)) == stored_entry, f"{entry['id']}: index entry differs"


def test_truth_of_stored_inputs_is_stored_expected():
    """golden.truth (the recurrence) on every stored input reproduces the stored expected outputs."""
    for c in CASES:
        got = golden.truth(c.op, c.params, c.inputs, torch.float64)
        assert sorted(got) == sorted(c.expected), c.id
        for name, x in got.items():
            why = golden.stored_mismatch(f"{c.id}: {name}", x.numpy(), c.expected[name])
            assert why is None, why


# ------------------------------------------------------------------------------ the index itself
REQUIRED_TAGS = {"gdn", "kda", "grouped_heads", "non_pow2_dims", "t_not_multiple", "gate_zero", "gate_underflow",
                 "beta_zero", "beta_one", "zero_key", "empty_buffer", "full_buffer", "ragged_batch", "tree",
                 "chain", "prefill", "direct_mode", "fold", "partial_fold", "initial_state"}


def test_index_covers_every_operation_and_edge_case():
    assert len(CASES) >= 40
    assert {c.op for c in CASES} == set(golden.OPS)
    tags = set().union(*(c.exercises for c in CASES))
    assert REQUIRED_TAGS <= tags, f"missing: {sorted(REQUIRED_TAGS - tags)}"
    decode_lengths = {n for c in CASES if c.op == "decode" for n in c.params["lengths"]}
    assert len(decode_lengths) >= 5, "decode should start from several buffer lengths"
    for tag in ("kda", "grouped_heads", "non_pow2_dims"):
        missing = {op for op in golden.OPS if not any(c.op == op and tag in c.exercises for c in CASES)}
        assert not missing, f"{tag} is not exercised by {sorted(missing)}"


def test_index_describes_files_exactly():
    index = golden.load_index(HERE)
    total = (HERE / "index.json").stat().st_size
    for e in index["cases"]:
        f = HERE / e["file"]
        data = f.read_bytes()
        total += len(data)
        assert hashlib.sha256(data).hexdigest() == e["sha256"], e["id"]
        arrays = golden.read_npz(f)
        described = e["inputs"] | e["expected"]
        assert sorted(described) == sorted(arrays), e["id"]
        for name, a in arrays.items():
            assert described[name] == {"dtype": str(a.dtype), "shape": list(a.shape)}, (e["id"], name)
            if a.dtype.kind == "f":
                assert a.dtype == np.float64, (e["id"], name)
        assert e["params"]["scale"] > 0 and e["op"] in golden.OPS
    assert total < 5_000_000, f"golden vectors take {total} bytes"


def test_padding_is_poisoned():
    """Unused buffer slots and padded draft rows are NaN, so an implementation that reads them fails."""
    for c in CASES:
        a = c.arrays
        if "buffer_lengths" in a:
            C = a["buffer_k"].shape[1]
            for b, n in enumerate(a["buffer_lengths"]):
                for f in KVBuffer.slot_fields():
                    assert np.isnan(a[f"buffer_{f}"][b, n:]).all(), (c.id, f)
                    assert np.isfinite(a[f"buffer_{f}"][b, :n]).all(), (c.id, f)
        if "num_drafts" in a:
            for b, n in enumerate(a["num_drafts"]):
                assert np.isnan(a["q"][b, n:]).all() and np.isfinite(a["q"][b, :n]).all(), c.id
                assert (a["expected_o"][b, n:] == 0).all(), c.id
        assert all(np.isfinite(x).all() for n, x in c.expected.items() if not n.startswith("expected_buffer_")), c.id


# ------------------------------------------------------------------------------------ loading
def test_load_from_explicit_path_and_env(tmp_path, monkeypatch):
    import shutil

    dst = tmp_path / "vectors"
    shutil.copytree(HERE / "cases", dst / "cases")
    shutil.copy(HERE / "index.json", dst / "index.json")
    assert [c.id for c in golden.load_cases(dst, ops=["flush"])] == _ids(["flush"])
    monkeypatch.setenv(golden.ENV_VAR, str(dst))
    assert golden.default_dir() == dst
    assert len(golden.load_cases()) == len(CASES)
    monkeypatch.setenv(golden.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="index.json"):
        golden.load_cases()


def test_the_default_is_the_package_data_the_wheel_ships(monkeypatch):
    """Without $KVBUFFER_GOLDEN_DIR the vectors come from the installed package itself (a wheel holds
    them: pyproject.toml's package data), not from a checkout's tests/ folder."""
    monkeypatch.delenv(golden.ENV_VAR, raising=False)
    assert golden.default_dir() == HERE and (HERE / "index.json").is_file()
    assert golden.default_dir().is_relative_to(Path(golden.__file__).resolve().parent)
    assert len(golden.load_cases()) == len(CASES)


def test_a_missing_directory_names_a_path_that_exists_or_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(golden.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as e:
        golden.load_cases()
    msg = str(e.value)
    assert str(tmp_path / "nowhere") in msg and golden.ENV_VAR in msg
    assert str(HERE) in msg  # the vectors this installation ships, which do exist
    monkeypatch.delenv(golden.ENV_VAR)
    monkeypatch.setattr(golden.files, "PACKAGE_DIR", tmp_path / "stripped")  # an installation without its data
    with pytest.raises(FileNotFoundError, match="pip install --force-reinstall kvbuffer"):
        golden.load_cases()


def test_numpy_only_reading():
    """What docs/golden.md promises: np.load + json, nothing else."""
    index = json.loads((HERE / "index.json").read_text())
    e = next(x for x in index["cases"] if x["op"] == "recurrent")
    with np.load(HERE / e["file"], allow_pickle=False) as z:
        assert set(z.files) == set(e["inputs"]) | set(e["expected"])
        assert list(z["expected_o"].shape) == e["expected"]["expected_o"]["shape"]


# ------------------------------------------------------------------------ the checker is not vacuous
def _broken(**overrides):
    ns = {n: getattr(kvbuffer_ref, n) for n in kvbuffer_ref.__all__}
    ns.update(overrides)
    return types.SimpleNamespace(**ns)


def test_checker_fails_wrong_implementations():
    ref = kvbuffer_ref

    def ignores_scale(q, k, v, *, g, beta, scale=None, **kw):
        return ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)

    def late_decay(q, k, v, *, g, beta, **kw):  # decay applied one token late: a classic off-by-one
        return ref.recurrent_gated_delta_rule(q, k, v, g=torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1),
                                              beta=beta, **kw)

    def never_folds(q, k, v, *, g, beta, buffer, scale=None):  # reads the buffer, but drops its full entries
        full = buffer.lengths == buffer.capacity
        buffer = buffer.replace(lengths=torch.where(full, torch.zeros_like(buffer.lengths), buffer.lengths))
        return ref.buffered_decode(q, k, v, g=g, beta=beta, buffer=buffer, scale=scale)

    cases = golden.load_cases(HERE, ids=["recurrent_custom_scale", "recurrent_gdn_basic", "decode_ragged_lengths"])
    by = {c.id: c for c in cases}
    assert not golden.check_case(by["recurrent_custom_scale"], _broken(recurrent_gated_delta_rule=ignores_scale)).passed
    assert not golden.check_case(by["recurrent_gdn_basic"], _broken(recurrent_gated_delta_rule=late_decay)).passed
    assert not golden.check_case(by["decode_ragged_lengths"], _broken(buffered_decode=never_folds)).passed
    # an exception is a failure with the message, not a crash of the checker
    rep = golden.check_case(by["recurrent_gdn_basic"], types.SimpleNamespace())
    assert not rep.passed and "AttributeError" in rep.error
