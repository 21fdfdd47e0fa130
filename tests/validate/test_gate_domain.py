"""The gate domain an adapter declares (``gates``), and a lane that fails on reset gates: the rest of the
lane still runs, with the resets excluded, and the report carries both verdicts."""

import types

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes, runner
from kvbuffer.validate.report import format_failure, table_row


def _plain_chunk(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """A chunkwise kernel as authors write one: the intra-chunk decays exp(G_i - G_j) from the gates' sums
    G inside each chunk, masked above the diagonal, with no special case for -inf (after a -inf gate,
    -inf - (-inf) is NaN).  And a real tile-boundary bug: value heads past a 32-head tile are never
    written (left 0)."""
    o, S = ref.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, chunk_size=chunk_size)
    gs = g if g.dim() == 4 else g.unsqueeze(-1)
    rows = torch.zeros_like(gs)
    for s in range(0, g.shape[1], chunk_size):
        G = gs[:, s:s + chunk_size].cumsum(1)
        c = G.shape[1]
        low = torch.ones(c, c, dtype=torch.bool).tril().view(1, c, c, 1, 1)
        rows[:, s:s + c] = torch.exp(torch.where(low, G[:, :, None] - G[:, None, :], float("-inf"))).sum(2)
    o = o * (rows.sum(-1, keepdim=True) * 0 + 1).to(o.dtype)  # a NaN decay reaches the token's output
    if o.shape[2] > 32:
        o[:, :, 32:] = 0
    return o, S


def _run(**declared):
    impl = adapters.describe(types.SimpleNamespace(name="plain-chunk", dtypes=(torch.float64,),
                                                   chunk_gated_delta_rule=_plain_chunk, **declared))
    rep = runner.run_validation([impl], ops=lanes.select_ops("chunk"), dtypes=[torch.float64], seed=11,
                                max_examples=3, shrink=False, progress=None)
    (r,) = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    return r


def test_a_reset_failure_does_not_hide_a_tile_boundary_bug():
    """The NaN on reset gates FAILs the lane as [domain], says how to declare the domain, and the rest of
    the lane (its boundary cases) still runs with the resets excluded: the head-tile bug is reported too."""
    r = _run()
    assert r.status == "FAIL" and r.klass == "domain", (r.status, r.klass, r.why)
    assert r.failure["case"].gate == "reset"
    assert "non-finite" in r.why and 'gates = "finite"' in r.why and "docs/validate-your-kernel.md" in r.why
    rest = r.failure["rest"]
    assert rest["status"] == "FAIL" and rest["klass"] == "tile-boundary", rest
    assert rest["failure"]["edge"] == "HV=36 (H=4)" and rest["failure"]["case"].gate != "reset"
    assert "[tile-boundary]" in r.why and "HV=36" in r.why
    assert "resets excluded: FAIL [tile-boundary]" in table_row(r)
    text = format_failure(r, "kvbuffer validate ...")
    assert "FAIL [domain]" in text and "HV=36" in text
    assert r.cases > rest["cases"] > 0 and r.checks > rest["checks"] > 0  # both runs counted
    assert "_comparisons" not in rest["failure"]


def test_a_finite_gate_domain_draws_no_reset():
    """Declared ``gates = "finite"``: no reset is drawn, the lane reports the tile-boundary bug itself."""
    r = _run(gates="finite")
    assert r.status == "FAIL" and r.klass == "tile-boundary", (r.status, r.klass, r.why)
    assert "rest" not in r.failure and r.failure["edge"] == "HV=36 (H=4)"


def test_a_reset_failure_alone_says_the_rest_passes():
    def chunk(*a, **kw):  # the same kernel without the tile bug: only the reset domain fails
        o, S = _plain_chunk(*a, **kw)
        o2, _ = ref.chunk_gated_delta_rule(*a, **kw)
        return torch.where(o.isnan(), o, o2), S

    impl = adapters.describe(types.SimpleNamespace(name="plain-chunk", dtypes=(torch.float64,),
                                                   chunk_gated_delta_rule=chunk))
    rep = runner.run_validation([impl], ops=lanes.select_ops("chunk"), dtypes=[torch.float64], seed=11,
                                max_examples=3, shrink=False, progress=None)
    (r,) = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    assert r.status == "FAIL" and r.klass == "domain" and r.failure["rest"]["status"] == "PASS", r.why
    assert "resets excluded: PASS" in table_row(r)
    assert rep.to_json()["results"][0]["failure"]["rest"]["status"] == "PASS"

    fine = adapters.describe(types.SimpleNamespace(name="plain-chunk", dtypes=(torch.float64,),
                                                   chunk_gated_delta_rule=chunk, gates="finite"))
    rep = runner.run_validation([fine], ops=lanes.select_ops("chunk"), dtypes=[torch.float64], seed=11,
                                max_examples=3, shrink=False, progress=None)
    assert rep.passed, [(r.status, r.klass, r.why) for r in rep.lanes]


def test_the_gate_domain_declaration():
    ns = types.SimpleNamespace(chunk_gated_delta_rule=_plain_chunk)
    assert adapters.describe(ns).gates == "all"
    assert adapters.describe(types.SimpleNamespace(chunk_gated_delta_rule=_plain_chunk, gates="finite")).gates \
        == "finite"
    with pytest.raises(adapters.AdapterError, match="gates must be one of"):
        adapters.describe(types.SimpleNamespace(chunk_gated_delta_rule=_plain_chunk, gates="positive"))
    assert "reset" not in runner.FINITE_GATES and "wide" in runner.FINITE_GATES


def test_no_reset_reaches_a_finite_adapter():
    """Declared finite: no call (anchors, the wide-domain anchor, boundary cases, fresh examples) sees a reset."""
    seen = []

    def direct(q, k, v, *, g, beta, scale=None):
        seen.append(float(g.min()) if g.numel() else 0.0)
        if g.numel() and not bool((g > -250).all()):
            raise ValueError(f"g: a reset reached a finite-gate kernel ({float(g.min())})")
        return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale)

    impl = adapters.describe(types.SimpleNamespace(name="finite", dtypes=(torch.float64,),
                                                   direct_gated_delta_rule=direct, gates="finite"))
    rep = runner.run_validation([impl], ops=lanes.select_ops("direct"), dtypes=[torch.float64], seed=5,
                                max_examples=15, shrink=False, progress=None)
    assert rep.passed, [(r.status, r.klass, r.why) for r in rep.lanes]
    assert len(seen) > 15 and min(seen) < -100  # the wide finite regimes still come up
