"""``kvbuffer validate --report precision``: the error growth over decode length (small lengths here)."""

import json
import sys

import pytest
import torch

from kvbuffer.validate import adapters, precision as prec
from kvbuffer import cli as kcli

from kvbuffer import implementations
from kvbuffer.validate.tolerances import tolerance_for

from .conftest import ADAPTERS

#: the one error policy's float32 row: a correct float32 state stays within the floor (8 eps), and a correct
#: implementation's error within kappa times the float32 recurrence's
_T32 = tolerance_for(torch.float32)
FLOOR32 = _T32.floor * torch.finfo(torch.float32).eps
KAPPA32 = _T32.kappa


def test_checkpoints_are_the_powers_of_two_then_the_last_step():
    assert prec.checkpoints(1) == [1]
    assert prec.checkpoints(8) == [1, 2, 4, 8]
    assert prec.checkpoints(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="steps"):
        prec.checkpoints(0)


def _report(name, steps=16, **kw):
    return prec.precision_report(implementations.resolve(f"{ADAPTERS}:{name}"), steps=steps, **kw)


def test_the_rows_tell_a_bf16_state_and_a_bug_from_the_fp32_recurrence():
    good = _report("decode_fp32")
    s = good["series"]
    assert good["steps"] == [1, 2, 4, 8, 16] and set(s) == {"fp32 recurrence", "bf16-state recurrence",
                                                            "decode-fp32 recurrent_decode"}
    fp32, bf16, mine = s["fp32 recurrence"], s["bf16-state recurrence"], s["decode-fp32 recurrent_decode"]
    # float32 state: float32 rounding only, within the policy's floor (8 eps)
    assert max(fp32["state"]) <= FLOOR32 and max(mine["state"]) <= FLOOR32
    assert min(bf16["state"]) > 100 * max(fp32["state"])  # the emulated bf16 state: bfloat16 rounding
    assert fp32["o"][0] > 1e-5  # float16 outputs: the outputs' own rounding is in every row
    assert max(good["ratio_to_fp32"]["state"]["decode-fp32 recurrent_decode"]) <= KAPPA32
    # an implementation keeping a bf16 state lands on the emulated bf16-state row, far from the fp32 one
    st = _report("decode_bf16_state")["series"]["decode-bf16-state recurrent_decode"]["state"]
    assert all(0.2 * b < a < 5 * b for a, b in zip(st, bf16["state"])), (st, bf16["state"])
    # a wrong decay is no rounding: its error is far past both, and grows with the length
    bad = _report("decode_double_gate")["series"]["decode-double-gate recurrent_decode"]
    assert bad["state"][-1] > 20 * max(bf16["state"]) and bad["state"][-1] > 10 * bad["state"][0]


def test_the_buffered_decode_row_folds_its_buffer_and_reads_its_state():
    rep = prec.precision_report(implementations.reference(), steps=8, capacity=3)
    row = rep["series"]["kvbuffer_ref buffered_decode[C=3]"]
    assert max(row["state"]) <= FLOOR32
    assert max(rep["ratio_to_fp32"]["o"]["kvbuffer_ref buffered_decode[C=3]"]) <= KAPPA32
    assert any("no recurrent_decode" in n for n in rep["notes"])
    md = prec.precision_markdown(rep)
    assert "**Output error**" in md and "**State error**" in md and "| 8 |" in md


def _main(capsys, *args):
    rc = kcli.main(["validate", "--report", "precision", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_command_writes_the_table_the_json_and_the_plot(capsys, tmp_path, monkeypatch):
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:decode_bf16_state", "--steps", "4", "--json", str(js),
                         "--plot", str(png), "--device", "cpu")
    assert rc == 0, out + err
    assert "# Precision report: decode-bf16-state" in out and "float16 inputs" in out
    data = json.loads(js.read_text())
    assert data["reports"][0]["steps"] == [1, 2, 4] and data["reports"][0]["dtype"] == "float16"
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # matplotlib missing: the table, and a message
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:decode_fp32", "--steps", "2", "--plot",
                         str(tmp_path / "q.png"), "--device", "cpu")
    assert rc == 0 and "| 2 |" in out and "matplotlib is not installed" in err and not (tmp_path / "q.png").exists()


def test_bad_arguments_are_refused(capsys):
    assert _main(capsys, "--impl", f"{ADAPTERS}:decode_fp32", "--steps", "0", "--device", "cpu")[0] == 2
    rc, _, err = _main(capsys, "--impl", f"{ADAPTERS}:decode_interpreted", "--dtype", "bfloat16", "--device", "cpu")
    assert rc == 2 and "interpreter" in err
    rc, _, err = _main(capsys, "--impl", f"{ADAPTERS}:decode_fp32", "--state-dtype", "int8", "--device", "cpu")
    assert rc == 2 and "--state-dtype" in err
    rc = kcli.main(["validate", "--impl", f"{ADAPTERS}:decode_fp32", "--steps", "4"])
    assert rc == 2 and "only with --report precision" in capsys.readouterr().err


def test_an_implementation_that_normalises_q_and_k_is_measured_on_the_normalised_inputs():
    """An engine kernel L2-normalises q and k itself (``qk_l2norm``): 16-bit unit rows are ~1e-4 off unit norm,
    so a truth on the raw rows would charge that to the kernel (400-540x the fp32 row's state error)."""
    import types

    import kvbuffer_ref as ref
    from kvbuffer.validate.cases import l2norm_qk

    def recurrent_decode(q, k, v, *, g, beta, state, scale=None):
        x = l2norm_qk(dict(q=q, k=k), torch.float32)
        o, new = ref.recurrent_gated_delta_rule(x["q"], x["k"], v.float(), g=g, beta=beta, scale=scale,
                                                initial_state=state, output_final_state=True)
        state.copy_(new)
        return o.to(v.dtype)

    impl = adapters.describe(types.SimpleNamespace(name="normalising", recurrent_decode=recurrent_decode,
                                                   qk_l2norm=True, dtypes=(torch.float16,)))
    rep = prec.precision_report(impl, steps=64)
    assert any("L2-normalised" in n for n in rep["notes"])
    assert max(rep["ratio_to_fp32"]["state"]["normalising recurrent_decode"]) <= KAPPA32


from .test_flashinfer_peers import fake_flashinfer  # noqa: E402,F401 - the fixture: a fake flashinfer package


def test_a_peer_keeping_its_own_bf16_state_is_reported_so(fake_flashinfer, capsys):  # noqa: F811
    """flashinfer-bf16 keeps a bfloat16 pool whatever state it is handed (its engine convention's state_dtype): the
    report states a bfloat16 state, and its state error is the bf16-state recurrence's, not the fp32 one's;
    flashinfer (a float32 pool) handed a float32 state is stated float32 and stays at float32 rounding.  FlashInfer
    is CUDA-only: a fake package computes its kernels' arithmetic in float64 here."""
    from kvbuffer.peers import flashinfer as FI

    rep = prec.precision_report(FI.flashinfer_bf16(), steps=16, dtype=torch.bfloat16)
    assert rep["state_dtype"] == "float32" and rep["stored_state_dtype"] == "bfloat16"
    assert any("stores its recurrent state in bfloat16 itself" in n for n in rep["notes"])
    s = rep["series"]
    mine = next(v for k, v in s.items() if k.endswith("recurrent_decode"))["state"]
    fp32, bf16 = s["fp32 recurrence"]["state"], s["bf16-state recurrence"]["state"]
    assert all(0.2 * b < a < 5 * b for a, b in zip(mine, bf16)) and min(mine) > 100 * max(fp32)
    assert "recurrent_decode state bfloat16 (stored so by the implementation itself; handed over in float32)" in \
        prec.precision_markdown(rep)
    rep32 = prec.precision_report(FI.flashinfer(), steps=16, dtype=torch.bfloat16)
    assert rep32["stored_state_dtype"] == "float32"
    assert max(next(v for k, v in rep32["series"].items() if k.endswith("recurrent_decode"))["state"]) <= FLOOR32
    # the command: bfloat16 inputs (FlashInfer's), no interpreter involved
    rc, out, err = _main(capsys, "--impl", "flashinfer-bf16", "--dtype", "bfloat16", "--steps", "4", "--device", "cpu")
    assert rc == 0, out + err
    assert "state bfloat16 (stored so by the implementation itself" in out
