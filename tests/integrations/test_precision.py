"""Next-token precision of the served models (``kvbuffer.integrations.precision``): the KL divergence and
top-1 agreement of reduced-precision pools against the fp32 and float64 pools over a generation.

Tiny configs, random weights (seed 0), a few dozen tokens: seconds per test.  Bounds come from the error
table (``kvbuffer.validate.tolerances``) and from Hoeffding's lemma, which turns a logit error into a KL
bound: KL(p || q) <= (max d - min d)^2 / 8 for d = logits_q - logits_p, hence <= ||d||^2 / 2.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("HF transformers not installed (pip install -e '.[hf]')", allow_module_level=True)

import torch  # noqa: E402

from kvbuffer.integrations import precision as mp  # noqa: E402
from kvbuffer.integrations import transformers as kt  # noqa: E402
from kvbuffer import cli as kcli  # noqa: E402
from kvbuffer.validate.tolerances import compare, tolerance_for  # noqa: E402

F64_REL = tolerance_for(torch.float64).floor * torch.finfo(torch.float64).eps  # the float64 row's floor


@functools.lru_cache(maxsize=None)
def model(model_type: str):
    m = kt.build_model(model_type, seed=0)
    mp.slow_gates(m, 0)
    return m


def test_kl_of_a_hand_computed_case():
    # p = (1/4, 3/4), q = (1/2, 1/2): KL(p || q) = 1/4 ln(1/2) + 3/4 ln(3/2); KL(q || p) = 1/2 ln 2 + 1/2 ln(2/3)
    lp = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    lq = torch.tensor([5.0, 5.0], dtype=torch.float64)  # a shift changes no distribution
    want_pq = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    want_qp = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    assert abs(float(mp.kl_divergence(lp, lq)) - want_pq) <= F64_REL * want_pq
    assert abs(float(mp.kl_divergence(lq, lp)) - want_qp) <= F64_REL * want_qp
    assert float(mp.kl_divergence(lp, lp + 0.5)) == 0.0  # an exact shift
    assert mp.top1_agreement(lp, lq).item() is False and mp.top1_agreement(lp, lp - 1).item() is True


def test_kl_matches_the_textbook_sum_and_keeps_tiny_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 256, generator=g, dtype=torch.float64)
    y = x + 0.3 * torch.randn(3, 5, 256, generator=g, dtype=torch.float64)
    lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    direct = (lp.exp() * (lp - lq)).sum(-1)  # fine at this size of KL
    got = mp.kl_divergence(x, y)
    assert got.shape == (3, 5) and bool(((got - direct).abs() <= F64_REL * direct).all())
    # a perturbation of 1e-9: KL = Var_p(d) / 2 to first order, about 5e-19, which the textbook sum loses
    d = 1e-9 * torch.randn(256, generator=g, dtype=torch.float64)
    p = torch.softmax(x[0, 0], -1)
    var = float((p * d * d).sum() - (p * d).sum() ** 2)
    tiny = float(mp.kl_divergence(x[0, 0], x[0, 0] + d))
    assert abs(tiny - var / 2) <= 1e-3 * var / 2


def test_checkpoints_are_the_powers_of_four_then_the_last_step():
    assert mp.checkpoints4(1) == [1] and mp.checkpoints4(64) == [1, 4, 16, 64]
    assert mp.checkpoints4(100) == [1, 4, 16, 64, 100]
    with pytest.raises(ValueError, match="steps"):
        mp.checkpoints4(0)


def test_the_pool_stores_the_asked_precisions():
    """The precision pool holds its state and u in bf16, keys and cumulative gates in the compute dtype."""
    sp = mp.ServingPrecision("bf16 state + u-cache", state_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    runner = kt.KVBufferRunner(model("qwen3_5"), capacity=4, pool_cls=mp.precision_pool(mp.KVPool, sp),
                               max_requests=1)
    t = runner.pool.tensors()
    assert (t["state"].dtype, t["u"].dtype, t["k"].dtype, t["G"].dtype) == (torch.bfloat16, torch.bfloat16,
                                                                             torch.float32, torch.float32)


def test_fp32_against_itself_is_exact():
    """A second fp32 run teacher-forced on the first run's tokens reads exactly the same history: KL 0,
    top-1 1, state error 0 (a step misaligned by one token would not be)."""
    precisions = mp.serving_precisions()[:2] + [mp.ServingPrecision("fp32 again")]
    rep = mp.model_precision_report("qwen3_5", steps=12, precisions=precisions, model=model("qwen3_5"))
    again = rep["series"]["fp32 again"]["vs_fp32"]
    assert again["kl_max"] == 0.0 and again["top1"] == 1.0 and again["state_rel_max"] == 0.0
    assert again["logit_rel_max"] == 0.0 and rep["checkpoints"] == [1, 4, 12] and len(rep["tokens"][0]) == 12


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_float64_against_fp32_within_the_table(model_type):
    """The fp32 pool's logits pass the float32 row of the error table against the float64 run, and their KL
    stays under what that budget admits (||d|| <= budget x ||truth|| per (request, step) slice, so KL <=
    (budget x ||truth||)^2 / 2); the 16-bit state's KL is larger than that bound."""
    m = model(model_type)
    m64 = copy.deepcopy(m).double()
    m64.config._experts_implementation = "eager"
    ids, mask = mp.random_prompts(2, 20, m.config.vocab_size, 0)
    fp32, f64, bf16 = mp.serving_precisions()[1], mp.serving_precisions()[0], mp.serving_precisions()[2]
    tok, lg32, _ = mp.serve(m, ids, mask, steps=24, sp=fp32, capacity=4)
    _, lg64, _ = mp.serve(m64, ids, mask, steps=24, sp=f64, capacity=4, tokens=tok)
    _, lg16, _ = mp.serve(m, ids, mask, steps=24, sp=bf16, capacity=4, tokens=tok)
    c = compare(lg32, lg64, None, name=f"{model_type} fp32 logits", dtype=torch.float32, head_axis=1)
    assert c.passed, str(c)
    bound = 0.5 * (c.budget * lg64.norm(dim=-1)) ** 2  # [B, N]
    kl32, kl16 = mp.kl_divergence(lg64, lg32), mp.kl_divergence(lg64, lg16)
    assert bool((kl32 <= bound).all()) and bool((mp.top1_agreement(lg64, lg32)).all())
    assert float(kl16.mean()) > float(bound.max())


def test_rounding_at_every_token_costs_more_than_at_every_fold():
    """bf16 state at C = 1 (rounded after every token, as a 16-bit recurrent state) against bf16 state at
    C = 16 (rounded once per fold): a larger KL and a larger state error; both larger than fp32's own."""
    all_ = {sp.name: sp for sp in mp.serving_precisions()}
    precisions = [all_[n] for n in ("float64", "fp32", "bf16 state", "bf16 state, C = 1")]
    rep = mp.model_precision_report("qwen3_next", steps=40, precisions=precisions, model=model("qwen3_next"))
    s = rep["series"]
    fp32, buffered, harsh = s["fp32"]["vs_float64"], s["bf16 state"]["vs_fp32"], s["bf16 state, C = 1"]["vs_fp32"]
    assert harsh["kl_mean"] > 4 * buffered["kl_mean"] > 4 * fp32["kl_max"]
    assert harsh["state_rel_max"] > 2 * buffered["state_rel_max"]
    assert buffered["state_rel_max"] > 1000 * fp32["state_rel_max"]
    md = mp.model_precision_markdown(rep)
    assert "| bf16 state, C = 1 |" in md and "**State rel-RMS at step n**" in md and "| 40 |" in md


def test_the_command_prints_and_writes_the_model_table(capsys, tmp_path):
    js = tmp_path / "p.json"
    rc = kcli.main(["validate", "--report", "precision", "--impl", "reference", "--device", "cpu", "--steps", "4",
                    "--models", "kimi_linear", "--json", str(js)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "## Next-token precision: kimi_linear" in out.out and "| bf16 state + u-cache |" in out.out
    data = json.loads(js.read_text())
    assert [r["model"] for r in data["models"]] == ["kimi_linear"] and data["models"][0]["steps"] == 4
    rc = kcli.main(["validate", "--report", "precision", "--impl", "reference", "--models", "llama"])
    assert rc == 2 and "--models" in capsys.readouterr().err
    rc = kcli.main(["validate", "--impl", "reference", "--models", "all"])
    assert rc == 2 and "only with --report precision" in capsys.readouterr().err


def test_without_transformers_the_model_table_is_skipped_with_a_line(capsys, monkeypatch):
    def missing():
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(kt, "_transformers", missing)
    rc = kcli.main(["validate", "--report", "precision", "--impl", "reference", "--device", "cpu", "--steps", "2",
                    "--models", "all"])
    out = capsys.readouterr().out
    assert rc == 0 and "Next-token precision: skipped" in out and "needs HF transformers" in out


# ----------------------------------------------------------------------------- implementations' own decode steps
from kvbuffer import implementations  # noqa: E402
from kvbuffer.validate import adapters as kadapters  # noqa: E402

ADAPTERS = "tests.validate.adapters_for_tests"
BF16_C1 = next(sp for sp in mp.serving_precisions() if sp.name == "bf16 state, C = 1")


def _peer_report(impls, state_dtypes=(torch.float32,), steps=10, extra=(), model_type="qwen3_5"):
    peers, lines = mp.peer_servings(impls, state_dtypes)
    return mp.model_precision_report(model_type, steps=steps, precisions=mp.serving_precisions()[:2] + list(extra),
                                     model=model(model_type), peers=peers, peer_lines=lines)


def test_the_reference_step_on_a_bf16_state_is_the_pool_rounding_after_every_token():
    """``--impl reference`` with a float32 and a bfloat16 state: the float32 row stays at float32 rounding (so
    the prompt's state was handed over: a zero state would be off by 100%), the bfloat16 row's KL is far
    above it, and it lands on the pool's bf16 state at C = 1, which rounds the state after every token too."""
    rep = _peer_report([implementations.reference()], (torch.float32, torch.bfloat16), extra=[BF16_C1])
    s = rep["series"]
    r32 = s["kvbuffer_ref recurrence, T = 1 per step (state fp32)"]
    r16 = s["kvbuffer_ref recurrence, T = 1 per step (state bf16)"]
    fp32 = s["fp32"]["vs_float64"]
    assert r32["state_dtype"] == "fp32" and r16["state_dtype"] == "bf16"
    assert r32["vs_fp32"]["state_rel_max"] < 1e-5 and r32["vs_fp32"]["kl_max"] < 1e-13
    assert r32["vs_fp32"]["checkpoints"]["state_rel"][0] < 1e-6  # step 1: the prompt's state, handed over
    assert r16["vs_fp32"]["kl_mean"] > 1e4 * max(r32["vs_fp32"]["kl_max"], fp32["kl_max"])
    assert r16["vs_fp32"]["state_rel_max"] > 1e-3
    c1 = s["bf16 state, C = 1"]["vs_fp32"]
    assert 0.8 < r16["vs_fp32"]["kl_mean"] / c1["kl_mean"] < 1.25
    assert 0.8 < r16["vs_fp32"]["state_rel_max"] / c1["state_rel_max"] < 1.25
    md = mp.model_precision_markdown(rep)
    assert "| kvbuffer_ref recurrence, T = 1 per step (state bf16) |" in md and "prefill" in md


def _scaled_q(q, k, v, *, g, beta, state, scale=None):
    """A decode step 1% off: q scaled by 1.01."""
    import kvbuffer_ref as ref

    o, S = ref.recurrent_gated_delta_rule(1.01 * q.float(), k.float(), v.float(), g=g.float(), beta=beta.float(),
                                          scale=scale, initial_state=state.float(), output_final_state=True)
    state.copy_(S)
    return o.to(v.dtype)


def test_a_peer_rounding_its_state_or_scaling_q_shows_in_its_row():
    """Fakes handed a float32 state: a correct step stays at float32 rounding; one that rounds its state to
    bfloat16 after every token, and one that scales q by 1.01, have KLs orders of magnitude above it."""
    import types

    good, bf16 = (implementations.resolve(f"{ADAPTERS}:{n}") for n in ("decode_fp32", "decode_bf16_state"))
    wrong = kadapters.describe(types.SimpleNamespace(name="q-times-1.01", recurrent_decode=_scaled_q))
    s = _peer_report([good, bf16, wrong])["series"]
    ok = s["decode-fp32 recurrent_decode (state fp32)"]["vs_fp32"]
    rounds = s["decode-bf16-state recurrent_decode (state fp32)"]["vs_fp32"]
    off = s["q-times-1.01 recurrent_decode (state fp32)"]["vs_fp32"]
    assert ok["kl_max"] < 1e-13 and ok["state_rel_max"] < 1e-5
    assert rounds["kl_mean"] > 1e4 * ok["kl_max"] and rounds["state_rel_max"] > 1e-3
    assert off["kl_mean"] > 1e4 * ok["kl_max"] and off["logit_rel_max"] > 100 * ok["logit_rel_max"]


def test_fla_float16_state_under_the_interpreter():
    """fla's fused_recurrent kernel (Triton interpreter) on a float32 state agrees with the fp32 pool to float32
    rounding; on a float16 state its KL is far larger."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core not installed (pip install 'kvbuffer[crosscheck]')")
    from kvbuffer.peers.fla import fla

    impl = fla()
    if not impl.interpreted and not torch.cuda.is_available():
        pytest.skip("fla's kernels need a GPU or TRITON_INTERPRET=1")
    s = _peer_report([impl], (torch.float32, torch.float16), steps=6)["series"]
    r32, r16 = (s[f"{impl.name} recurrent_decode (state {d})"]["vs_fp32"] for d in ("fp32", "fp16"))
    assert r32["kl_max"] < 1e-13 and r32["state_rel_max"] < 1e-5
    assert r16["kl_mean"] > 100 * r32["kl_max"] and r16["state_rel_max"] > 1e-4


def test_unavailable_and_stepless_implementations_are_listed_not_dropped():
    """One not installed: NOT RUN with its reason; one without recurrent_decode: NOT PROVIDED; one whose step
    refuses the state it is handed (TypeError): NOT RUN with the error; per-channel gates it does not take
    (Kimi): NOT RUN."""
    import types

    gone = kadapters.unavailable("gone-peer", "not installed here")
    chunk_only = kadapters.describe(types.SimpleNamespace(
        name="chunk-only", chunk_gated_delta_rule=lambda *a, **k: None,
        not_provided={"recurrent_decode": "a prefill kernel only"}))

    def refuse(q, k, v, *, g, beta, state, scale=None):
        raise TypeError(f"state: float32 only, got {state.dtype}")

    picky = kadapters.describe(types.SimpleNamespace(name="picky", recurrent_decode=refuse))
    scalar = kadapters.describe(types.SimpleNamespace(name="scalar-gates", recurrent_decode=refuse,
                                                      channel_gate=False))
    rep = _peer_report([gone, chunk_only, picky, scalar], steps=3, model_type="kimi_linear")
    got = {(x["implementation"], x["status"]) for x in rep["peers"]}
    assert got == {("gone-peer", "NOT RUN"), ("chunk-only", "NOT PROVIDED"),
                   ("picky recurrent_decode (state fp32)", "NOT RUN"),
                   ("scalar-gates recurrent_decode (state fp32)", "NOT RUN")}
    reasons = {x["implementation"]: x["reason"] for x in rep["peers"]}
    assert reasons["gone-peer"] == "not installed here" and reasons["chunk-only"] == "a prefill kernel only"
    assert "TypeError: state: float32 only" in reasons["picky recurrent_decode (state fp32)"]
    assert "per-channel" in reasons["scalar-gates recurrent_decode (state fp32)"]
    assert set(rep["series"]) == {"fp32"}
    md = mp.model_precision_markdown(rep)
    assert "- gone-peer: NOT RUN: not installed here" in md and "- chunk-only: NOT PROVIDED: a prefill kernel only" in md


def test_the_command_adds_a_row_per_impl_and_state_dtype(capsys, tmp_path):
    js = tmp_path / "p.json"
    rc = kcli.main(["validate", "--report", "precision", "--impl", "reference", "--impl", "flashinfer",
                    "--device", "cpu", "--steps", "3", "--state-dtype", "float32,bfloat16", "--models", "qwen3_5",
                    "--json", str(js)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "| kvbuffer_ref recurrence, T = 1 per step (state fp32) |" in out.out
    assert "| kvbuffer_ref recurrence, T = 1 per step (state bf16) |" in out.out
    data = json.loads(js.read_text())
    series = data["models"][0]["series"]
    assert series["kvbuffer_ref recurrence, T = 1 per step (state bf16)"]["state_dtype"] == "bf16"
    if importlib.util.find_spec("flashinfer") is None:
        assert "- flashinfer: NOT RUN: " in out.out
        assert [x["status"] for x in data["models"][0]["peers"]] == ["NOT RUN"]


from tests.validate.test_flashinfer_peers import fake_flashinfer  # noqa: E402,F401 - a fake flashinfer package


def test_a_peer_with_its_own_bf16_pool_is_a_bf16_row(fake_flashinfer):  # noqa: F811
    """flashinfer-bf16 (through the fake package: FlashInfer is CUDA-only) handed a float32 state stores bfloat16:
    its row says so.  Both FlashInfer rows take bfloat16 q, k, v and raw gates (the inputs' rounding is in both
    rows), so the bfloat16 pool is measured against the float32 pool's run on the same inputs: its states
    differ by bfloat16 rounding, where a second float32-pool run differs by nothing."""
    from kvbuffer.peers import flashinfer as FI

    rep = _peer_report([FI.flashinfer(), FI.flashinfer_bf16()], steps=4)
    s = rep["series"]
    f32 = next(v for k, v in s.items() if "float32 pool" in k)
    b16 = next(v for k, v in s.items() if "bfloat16 pool" in k)
    name16 = next(k for k in s if "bfloat16 pool" in k)
    assert name16.endswith("(state bf16, its own; handed fp32, bf16 q/k/v)"), name16
    assert b16["state_dtype"] == "bf16" and b16["handed_state_dtype"] == "fp32" and f32["state_dtype"] == "fp32"
    assert any("raw-gated" in n for n in rep["notes"]) and any("L2-normalises" in n for n in rep["notes"])
    peers, _ = mp.peer_servings([FI.flashinfer(), FI.flashinfer_bf16()])
    m = model("qwen3_5")
    ids, mask = mp.random_prompts(2, 24, m.config.vocab_size, 0)
    fp32 = mp.serving_precisions()[1]
    tok, _, _ = mp.serve(m, ids, mask, steps=4, sp=fp32, capacity=16)
    runs = [mp.serve(m, ids, mask, steps=4, sp=fp32, capacity=16, tokens=tok, marks=[4],
                     pool=mp.peer_pool(mp.KVPool, p.step, state_dtype=p.state_dtype, input_dtype=p.input_dtype))[2][4]
            for p in (peers[0], peers[0], peers[1])]
    assert torch.equal(runs[0], runs[1])
    diff = float(max(mp.rel_rms_slices(runs[2][i], runs[0][i], 1).max() for i in range(runs[0].shape[0])))
    assert 1e-4 < diff < 3e-2, diff
