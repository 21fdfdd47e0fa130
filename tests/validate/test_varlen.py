"""The cu_seqlens lanes: a variable-length batch (empty sequences included) against each sequence
alone.  The reference passes; kernels with the bugs varlen kernels have (the state carried from one
sequence into the next, offsets read one token late, a per-sequence initial state ignored) fail; an
adapter that does not declare ``varlen`` gets NOT PROVIDED, not a call with an argument it lacks."""

import types

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import adapters
from kvbuffer.validate.runner import run_validation


def _run(obj, ops=(("chunk_varlen", None),), n=8, seed=5):
    impl = adapters.describe(obj)
    rep = run_validation([impl], ops=list(ops), dtypes=[torch.float32], seed=seed, max_examples=n, progress=None,
                         explain=False)
    return {r.operation: r for r in rep.lanes}


def _chunk(fn):
    return types.SimpleNamespace(name="varlen-under-test", chunk_gated_delta_rule=fn,
                                 varlen=("chunk_gated_delta_rule",))


def test_the_reference_passes():
    lanes = _run(types.SimpleNamespace(name="ref", chunk_gated_delta_rule=ref.chunk_gated_delta_rule,
                                       recurrent_gated_delta_rule=ref.recurrent_gated_delta_rule,
                                       varlen=("chunk_gated_delta_rule", "recurrent_gated_delta_rule")),
                 ops=(("chunk_varlen", None), ("recurrent_varlen", None)))
    for op in ("chunk_varlen", "recurrent_varlen"):
        assert lanes[op].status == "PASS", (op, lanes[op].failure)
        assert lanes[op].checks > 0


def _leaky(q, k, v, *, g, beta, cu_seqlens=None, initial_state=None, output_final_state=False, **kw):
    """Carries each sequence's final state into the next (no reset at a sequence boundary)."""
    offs = cu_seqlens.tolist()
    outs, states, S = [], [], None if initial_state is None else initial_state[:1]
    for n, (a, e) in enumerate(zip(offs, offs[1:])):
        sl = slice(a, e)
        o, S = ref.chunk_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl],
                                          initial_state=S, output_final_state=True, **kw)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), torch.cat(states, 0) if output_final_state else None


def _late(q, k, v, *, g, beta, cu_seqlens=None, **kw):
    """Reads every sequence's offsets one token late (the last sequence keeps its end)."""
    cu = cu_seqlens.clone()
    cu[1:-1] = (cu[1:-1] + 1).clamp(max=int(cu[-1]))
    cu = torch.maximum(cu, torch.cat([cu[:1], cu[:-1]]))
    return ref.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, **kw)


def _first_state_only(q, k, v, *, g, beta, cu_seqlens=None, initial_state=None, **kw):
    """Gives every sequence the first sequence's initial state."""
    if initial_state is not None:
        initial_state = initial_state[:1].expand_as(initial_state).contiguous()
    return ref.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state, **kw)


@pytest.mark.parametrize("bug", [_leaky, _late, _first_state_only], ids=lambda f: f.__name__.strip("_"))
def test_varlen_bugs_fail(bug):
    lane = _run(_chunk(bug), n=12)["chunk_varlen"]
    assert lane.status == "FAIL", (bug.__name__, lane.status)


def test_an_adapter_without_varlen_is_not_given_cu_seqlens():
    lanes = _run(types.SimpleNamespace(name="no-varlen", chunk_gated_delta_rule=ref.chunk_gated_delta_rule),
                 ops=(("chunk_varlen", None), ("chunk", None)), n=2)
    assert lanes["chunk_varlen"].status == "NOT PROVIDED" and "cu_seqlens" in lanes["chunk_varlen"].reason
