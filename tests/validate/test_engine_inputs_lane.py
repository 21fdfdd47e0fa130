"""The engine_inputs lane: an engine's packed q|k|v and raw gates turned into q, k, v, g, beta, validated against
the float64 map (kvbuffer_ref.engine_inputs) under the one tolerance table.  The reference and kvbuffer_fast
pass it; maps wrong in the ways an engine's preprocessing goes wrong fail it (beta off by 1 %, g without
dt_bias, the norm's eps 1e-3 instead of 1e-6, q and k swapped in the packed split); an adapter without the
attribute gets a NOT PROVIDED row.  Few examples: the anchors and boundary cases carry most of it."""

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import kvbuffer_ref as ref
from kvbuffer import implementations
from kvbuffer.validate import adapters, lanes, runner
from kvbuffer.validate.cases import Case
from kvbuffer.validate.properties import check_engine_inputs, engine_case_inputs

OPS = lanes.select_ops("engine_inputs")


def _run(impls, examples=2, seed=3, **kw):
    return runner.run_validation(impls, ops=OPS, seed=seed, max_examples=examples, shrink=False, progress=None,
                                 explain=False, **kw)


def _map(x, a, b, *, A_log, dt_bias, num_heads, head_k_dim, qk_l2norm=True, eps=1e-6, beta_factor=1.0,
         use_dt_bias=True, swap=False):
    """The engine map written out in float32 (as an engine's preprocessing computes it), with one of the
    mistakes switched on."""
    H, K, HV = num_heads, head_k_dim, A_log.shape[0]
    B, T = (x.shape[0], 1) if x.dim() == 2 else tuple(x.shape[:2])
    xm = x.reshape(B, T, x.shape[-1]).float()
    q, k = xm[..., :H * K].unflatten(-1, (H, K)), xm[..., H * K:2 * H * K].unflatten(-1, (H, K))
    if swap:
        q, k = k, q
    if qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    v = x.reshape(B, T, x.shape[-1])[..., 2 * H * K:].unflatten(-1, (HV, -1)).clone()
    z = a.reshape(B, T, HV).float() + (dt_bias.float() if use_dt_bias else 0.0)
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(z)  # torch's threshold (20) too
    beta = torch.sigmoid(b.reshape(B, T, HV).float()) * beta_factor
    return q.contiguous(), k.contiguous(), v, g.clamp(min=-200.0), beta


def _adapter(name, **mistake):
    def engine_inputs(mixed_qkv, a, b, **kw):
        return _map(mixed_qkv, a, b, **kw, **mistake)
    return adapters.describe(types.SimpleNamespace(name=name, dtypes=(torch.float32, torch.float16),
                                                   engine_inputs=engine_inputs))


def test_the_reference_passes_in_float64_and_float32():
    rep = _run([implementations.reference()], examples=3)
    rows = {r.dtype: r for r in rep.lanes}
    assert set(rows) == {"float64", "float32"}
    for r in rows.values():
        assert r.status == "PASS" and r.checks > 0, (r.dtype, r.failure)


def test_kvbuffer_fast_passes():
    rep = _run([implementations.fast()], examples=1)
    run = [r for r in rep.lanes if r.status != "NOT RUN"]
    assert {r.dtype for r in run} >= {"float32", "float16"}
    for r in run:
        assert r.status == "PASS" and r.checks > 0, (r.dtype, r.failure)


def test_a_correct_float32_map_written_otherwise_passes():
    """torch's softplus (its own threshold 20), float32 throughout: a correct engine map, not the oracle's code."""
    rep = _run([_adapter("float32 map")], examples=2)
    assert all(r.status == "PASS" for r in rep.lanes), [(r.dtype, r.failure) for r in rep.lanes]


@pytest.mark.parametrize("mistake, output", [
    (dict(beta_factor=1.01), "beta"),
    (dict(use_dt_bias=False), "g"),
    (dict(eps=1e-3), "q"),
    (dict(swap=True), "q"),
])
def test_a_wrong_map_fails(mistake, output):
    rep = _run([_adapter("wrong map", **mistake)], examples=1)
    for r in rep.lanes:
        assert r.status == "FAIL" and r.klass != "raised", (mistake, r.dtype, r.status, r.failure)
        bad = [c for c in r.failure["comparisons"] if c.startswith("FAIL")]
        assert any(f"].{output} [" in c for c in bad), (mistake, bad)
        assert r.worst_rel > 10 * r.budget, (mistake, r.dtype, r.worst_rel, r.budget)  # far past, not marginal


@pytest.mark.parametrize("mistake", [dict(beta_factor=1.01), dict(use_dt_bias=False), dict(eps=1e-3), dict(swap=True)],
                         ids=["beta", "dt_bias", "eps", "swap"])
def test_each_wrong_map_fails_on_every_anchor_and_boundary_case(mistake):
    """Not one lucky example: every fixed case of the lane exposes each mistake, in float32 and float16."""
    impl = _adapter("wrong map", **mistake)
    cases = lanes.ANCHORS["engine_inputs"] + lanes.edge_params("engine_inputs", lanes.SMALL)
    for dt in (torch.float32, torch.float16):
        for p in cases:
            comps = check_engine_inputs(impl.obj, p["case"], dt, decode=p["decode"])
            assert not all(c.passed for c in comps), (mistake, dt, p.get("edge"), [str(c) for c in comps])


def _drawn(sizes, n):
    op = next(o for o in lanes.OPS if o.key == "engine_inputs")
    out = []

    @settings(max_examples=n, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(op.strategy(sizes, {}))
    def collect(p):
        out.append(p)

    collect()
    return out


@pytest.mark.parametrize("mistake", [dict(beta_factor=1.01), dict(use_dt_bias=False), dict(eps=1e-3), dict(swap=True)],
                         ids=["beta", "dt_bias", "eps", "swap"])
def test_each_wrong_map_fails_on_every_drawn_case(mistake):
    """The drawing is strong enough whatever hypothesis picks: every drawn case (a fixed draw of the interpreter's
    and the normal sizes, every gate regime, single-element batches included) exposes each mistake."""
    impl = _adapter("wrong map", **mistake)
    for p in _drawn(lanes.SMALL, 40) + _drawn(lanes.NORMAL, 25):
        for dt in (torch.float32, torch.float16):
            comps = check_engine_inputs(impl.obj, p["case"], dt, decode=p["decode"])
            assert max(c.ratio for c in comps) > 10, (mistake, dt, p, [str(c) for c in comps])


def test_an_adapter_without_engine_inputs_is_not_provided():
    impl = adapters.describe(types.SimpleNamespace(name="x", recurrent_gated_delta_rule=ref.recurrent_gated_delta_rule))
    rows = lanes.plan([impl], OPS)
    assert [(l.status, l.reason) for l in rows] == [("NOT PROVIDED", "the adapter has no engine_inputs")]


def test_the_drawn_inputs_reach_the_regimes_engines_see():
    c = Case(B=4, T=6, H=2, HV=4, K=8, V=4, gate="wide", norm="any", seed=11)
    x = engine_case_inputs(c, torch.float64)
    z = x["a"] + x["dt_bias"]
    assert x["a"].min() < -10 and x["a"].max() > 25 and ((z - 20).abs() < 1).any()
    assert x["b"].abs().max() > 5 and x["A_log"].max() > 0 > x["A_log"].min()
    qk = x["mixed_qkv"][..., :2 * 2 * 8].unflatten(-1, (2, 2, 8)).norm(dim=-1)
    assert (qk < 1e-2).sum() >= 4 and (qk > 1).any()  # a tiny q and k row in every request, large ones
    r = engine_case_inputs(Case(B=3, T=1, H=1, HV=3, K=4, V=4, gate="reset", norm="unit", seed=2), torch.float32,
                           decode=True)
    assert r["mixed_qkv"].shape == (3, 2 * 4 + 3 * 4) and r["a"].shape == (3, 3)
    assert torch.isinf(r["a"]).any() and torch.isinf(r["b"]).any()
