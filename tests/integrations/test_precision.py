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
