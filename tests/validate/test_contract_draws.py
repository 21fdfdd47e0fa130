"""Draws and checks of ``kvbuffer validate`` that realistic wrong kernels need: each adapter here passes
without the draw (or check) and fails with it, under the class the report names."""

import types

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes, runner
from kvbuffer.validate.cases import Case

VARLEN = ("recurrent_gated_delta_rule",)


def _run(obj, ops, *, dtype=torch.float32, max_examples=2, seed=11):
    impl = adapters.describe(types.SimpleNamespace(name="planted", dtypes=(dtype,), **obj))
    rep = runner.run_validation([impl], ops=lanes.select_ops(ops), dtypes=[dtype], seed=seed,
                                max_examples=max_examples, shrink=False, progress=None, explain=False)
    return [r for r in rep.lanes if r.status != "NOT PROVIDED"]


def _rec(q, k, v, **kw):
    return ref.recurrent_gated_delta_rule(q, k, v, **kw)


# ----------------------------------------------------------------------------- varlen anchors
def _sorted_states(q, k, v, *, cu_seqlens=None, **kw):
    """Sequences run longest first, the final states left in that order."""
    o, S = _rec(q, k, v, cu_seqlens=cu_seqlens, **kw)
    if S is not None and cu_seqlens is not None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        S = S[sorted(range(len(lens)), key=lambda n: -lens[n])]
    return o, S


def _initial_by_nonempty_index(q, k, v, *, cu_seqlens=None, initial_state=None, **kw):
    """initial_state indexed by the position among the non-empty sequences."""
    if cu_seqlens is not None and initial_state is not None:
        cu = cu_seqlens.tolist()
        s0 = initial_state.clone()
        for i, n in enumerate(n for n in range(len(cu) - 1) if cu[n + 1] > cu[n]):
            s0[n] = initial_state[i]
        initial_state = s0
    return _rec(q, k, v, cu_seqlens=cu_seqlens, initial_state=initial_state, **kw)


@pytest.mark.parametrize("fn", [_sorted_states, _initial_by_nonempty_index])
def test_varlen_anchors_catch_sequence_order_bugs(fn):
    # no drawn example at all: the lane's anchors (an empty sequence between others, unsorted lengths) catch it
    (r,) = [x for x in _run(dict(recurrent_gated_delta_rule=fn, varlen=VARLEN), "recurrent_varlen", max_examples=1)]
    assert r.status == "FAIL" and r.failure["anchor"] is not None, (r.status, r.failure)


def test_varlen_anchors_pass_the_reference():
    (r,) = _run(dict(recurrent_gated_delta_rule=_rec, chunk_gated_delta_rule=ref.chunk_gated_delta_rule,
                     varlen=VARLEN + ("chunk_gated_delta_rule",)), "recurrent_varlen", max_examples=1)
    assert r.status == "PASS", r.failure
    assert set(lanes.ANCHORS) >= {"recurrent_varlen", "chunk_varlen"}


# ----------------------------------------------------------------------------- tiny rows for an in-kernel norm
def test_qk_l2norm_any_norm_draws_tiny_rows():
    c = Case(B=3, T=5, H=1, HV=1, K=8, V=4, norm="any", qk_l2norm=True, seed=3)
    x = c.inputs(torch.float64)
    assert (x["q"].norm(dim=-1) < 1e-2).any() and (x["k"].norm(dim=-1) < 1e-2).any()
    plain = Case(B=3, T=5, H=1, HV=1, K=8, V=4, norm="any", seed=3).inputs(torch.float64)
    assert (plain["q"].norm(dim=-1) >= 0.25 - 1e-12).all()  # only an in-kernel norm gets them


def _eps_outside_sqrt(q, k, v, **kw):
    n = lambda x: x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)  # noqa: E731
    return _rec(n(q), n(k), v, **kw)


def test_in_kernel_norm_with_eps_outside_the_sqrt_fails():
    (r,) = _run(dict(recurrent_gated_delta_rule=_eps_outside_sqrt, qk_l2norm=True), "recurrent", max_examples=12)
    assert r.status == "FAIL" and r.klass == "domain", (r.status, r.klass, r.failure)


# ----------------------------------------------------------------------------- in-place arguments as views
def _decode_on_a_copy(q, k, v, *, g, beta, state, scale=None):
    s = state.contiguous()  # a copy when the caller's state is strided: the caller's is never updated
    o, new = _rec(q, k, v, g=g, beta=beta, scale=scale, initial_state=s, output_final_state=True)
    s.copy_(new)
    return o


def _decode(q, k, v, *, g, beta, state, scale=None):
    o, new = _rec(q, k, v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=True)
    state.copy_(new)
    return o


def _decode_contiguous_only(q, k, v, *, g, beta, state, scale=None):
    if not state.is_contiguous():
        raise ValueError("state: must be contiguous, because the kernel updates it in place")
    return _decode(q, k, v, g=g, beta=beta, state=state, scale=scale)


def test_in_place_state_passed_as_a_view():
    (bad,) = _run(dict(recurrent_decode=_decode_on_a_copy), "recurrent_decode", max_examples=1)
    assert bad.status == "FAIL" and bad.klass == "memory-layout", (bad.status, bad.klass, bad.failure)
    for fn in (_decode, _decode_contiguous_only):  # refusing a strided state is allowed
        (good,) = _run(dict(recurrent_decode=fn), "recurrent_decode", max_examples=1)
        assert good.status == "PASS", good.failure


# ----------------------------------------------------------------------------- returned tensors
def _workspace():
    out = {}

    def fn(q, k, v, **kw):
        o, S = _rec(q, k, v, **kw)
        buf = out.setdefault((tuple(o.shape), o.dtype), torch.empty_like(o))
        buf.copy_(o)
        return buf, S
    return fn


def test_output_workspace_returned_without_copy_is_a_state_leak():
    (r,) = _run(dict(recurrent_gated_delta_rule=_workspace()), "recurrent", max_examples=1)
    assert r.status == "FAIL" and r.klass == "state-leak" and "changed when" in r.failure["error"], r.failure


def _materialize_alias(buffer):
    """The buffer's own state tensor returned (right only when nothing is buffered)."""
    return buffer.state


def test_output_aliasing_an_input_is_a_state_leak():
    (r,) = _run(dict(materialize_state=_materialize_alias), "materialize", max_examples=1)
    assert r.status == "FAIL" and r.klass == "state-leak" and "shares memory" in r.failure["error"], r.failure


def test_shares_memory():
    x = torch.zeros(4, 6)
    assert adapters._shares_memory(x[1], x) and adapters._shares_memory(x[:, ::2], x[:, 2:3])
    assert not adapters._shares_memory(x[0], x[1]) and not adapters._shares_memory(x.clone(), x)


# ----------------------------------------------------------------------------- flush folds exactly `count`
def _flush_zero_is_all(buffer, *, count=None):
    if count is not None:
        count = torch.where(torch.as_tensor(count) == 0, buffer.lengths, torch.as_tensor(count))
    return ref.flush(buffer, count=count)


def test_flush_of_zero_entries_taken_as_all_fails():
    (r,) = _run(dict(buffered_decode=ref.buffered_decode, flush=_flush_zero_is_all), "flush[u]", max_examples=1)
    assert r.status == "FAIL" and r.klass == "partial-flush" and "lengths" in r.failure["error"], r.failure
