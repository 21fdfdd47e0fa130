"""Adapters used by the tests of ``kvbuffer validate``: a correct one, deliberately broken ones."""

import types

import torch

import kvbuffer_ref as ref

#: A correct adapter: the reference's direct and chunk forms, float64 only.
good = types.SimpleNamespace(
    name="good", dtypes=(torch.float64,),
    direct_gated_delta_rule=ref.direct_gated_delta_rule,
    chunk_gated_delta_rule=ref.chunk_gated_delta_rule,
)


def _wrong_scale_direct(q, k, v, *, g, beta, scale=None):
    """Forgets that the default scale is K ** -0.5 (uses 1)."""
    return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0 if scale is None else scale)


#: Broken: direct mode ignores the default scale.
wrong_scale = types.SimpleNamespace(name="wrong_scale", dtypes=(torch.float64,),
                                    direct_gated_delta_rule=_wrong_scale_direct)


def _raising_direct(q, k, v, *, g, beta, scale=None):
    if 3 <= q.shape[0] <= 5 and 2 < q.shape[1] <= 20:
        raise RuntimeError("sequences longer than 2 tokens are not supported in batches of 3")
    return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale)


#: Broken: raises for 3 <= B <= 5 and 2 < T <= 20 (no fixed anchor or boundary case has that shape: hypothesis
#: must find it).
raises = types.SimpleNamespace(name="raises", dtypes=(torch.float64,), direct_gated_delta_rule=_raising_direct)

#: Not an adapter: no operation at all.
empty = types.SimpleNamespace(name="empty")


def factory():
    """A factory: called with no arguments, returns the adapter."""
    return good


# ----------------------------------------------------------------------------- arithmetic contracts
def _emulated(contract, fn):
    from kvbuffer.validate.contracts import under_contract

    return under_contract(fn, contract)


def _tf32_recurrent(q, k, v, **kw):
    return _emulated("tf32", ref.recurrent_gated_delta_rule)(q, k, v, **kw)


def _tf32_chunk(q, k, v, **kw):
    return _emulated("tf32", ref.chunk_gated_delta_rule)(q, k, v, **kw)


#: A kernel that multiplies in TF32 (emulated: every product's operands rounded to TF32), declaring the
#: default contract (IEEE float32): it must FAIL, and the report must say it passes as tf32.
tf32_undeclared = types.SimpleNamespace(name="tf32-undeclared", dtypes=(torch.float32,),
                                        recurrent_gated_delta_rule=_tf32_recurrent,
                                        chunk_gated_delta_rule=_tf32_chunk)
#: The same kernel declaring what it keeps: it passes.
tf32_declared = types.SimpleNamespace(name="tf32-declared", dtypes=(torch.float32,), contract="tf32",
                                      recurrent_gated_delta_rule=_tf32_recurrent,
                                      chunk_gated_delta_rule=_tf32_chunk)


def _bf16_recurrent(q, k, v, **kw):
    return _emulated("bf16", ref.recurrent_gated_delta_rule)(q, k, v, **kw)


#: bf16 products declared as tf32: too coarse for the tf32 budget (FAIL), passes as bf16.
bf16_as_tf32 = types.SimpleNamespace(name="bf16-as-tf32", dtypes=(torch.float32,), contract="tf32",
                                     recurrent_gated_delta_rule=_bf16_recurrent)


def _tf32_wrong_beta(q, k, v, *, beta, **kw):
    """TF32 products and a real bug (beta squared): no contract explains it."""
    return _tf32_recurrent(q, k, v, beta=beta * beta, **kw)


tf32_buggy = types.SimpleNamespace(name="tf32-buggy", dtypes=(torch.float32,), contract="tf32",
                                   recurrent_gated_delta_rule=_tf32_wrong_beta)


# ----------------------------------------------------------------------------- the precision report
def _step(q, k, v, *, g, beta, state, scale=None, state_round=None, gate=1.0):
    """One in-place decode step by the reference recurrence (float32), the state rounded by ``state_round``."""
    o, S = ref.recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g=gate * g.float(), beta=beta.float(),
                                          scale=scale, initial_state=state.float(), output_final_state=True)
    state.copy_(S if state_round is None else state_round(S))
    return o.to(v.dtype)


#: A correct in-place decode step (float32 state).
decode_fp32 = types.SimpleNamespace(name="decode-fp32", dtypes=(torch.float32, torch.float16),
                                    recurrent_decode=_step)
#: The same step keeping its state in bfloat16 (rounded after every token, as engines storing a bf16 state).
decode_bf16_state = types.SimpleNamespace(
    name="decode-bf16-state", dtypes=(torch.float32, torch.float16),
    recurrent_decode=lambda *a, **kw: _step(*a, state_round=lambda S: S.to(torch.bfloat16).float(), **kw))
#: Broken: the gate applied twice (a decay of exp(2 g)): its error grows with the decode length.
decode_double_gate = types.SimpleNamespace(name="decode-double-gate", dtypes=(torch.float32, torch.float16),
                                           recurrent_decode=lambda *a, **kw: _step(*a, gate=2.0, **kw))
#: Claims to run on the Triton interpreter (the report refuses bfloat16 for it on the CPU).
decode_interpreted = types.SimpleNamespace(name="decode-interpreted", dtypes=(torch.float32, torch.float16),
                                           interpreted=True, recurrent_decode=_step)


def agrees_with_recurrence(got, x, initial_state=None, chunk=None):
    """An adapter's (o, S) against the float64 recurrence over the inputs ``x`` (from ``initial_state``), with
    the correct forms in float32 as the baseline (``truth_and_baseline``: the recurrence, and with ``chunk``, the
    chunk of a kernel that keeps cumulative gates, the chunkwise form too): the one error table decides."""
    from kvbuffer.validate.properties import truth_and_baseline
    from kvbuffer.validate.tolerances import compare

    truth, base = truth_and_baseline(x, initial_state, chunk=chunk)
    for name, a, e, b, axis in (("o", got[0], truth[0], base[0], 2), ("state", got[1], truth[1], base[1], 1)):
        c = compare(a, e, b, name=name, head_axis=axis)
        assert c.passed, str(c)


# ----------------------------------------------------------------------------- failure labels
def _gate_axis_step(q, k, v, *, g, beta, state, scale=None):
    """A decode step that applies a per-channel gate ``[B, 1, HV, K]`` along the state's V axis: a
    shape error whenever K != V (a scalar gate takes the correct step; K == V decays the wrong axis)."""
    if g.dim() == 4:
        state.mul_(g[:, 0].exp()[..., None, :])  # wrong axis: broadcasts over [B, HV, K, V] only when K == V
        return _step(q, k, v, g=torch.zeros_like(g), beta=beta, state=state, scale=scale)
    return _step(q, k, v, g=g, beta=beta, state=state, scale=scale)


#: Broken: raises RuntimeError on a per-channel gate whenever K != V (the gate applied on the wrong axis).
gate_wrong_axis = types.SimpleNamespace(name="gate-wrong-axis-with-a-rather-long-implementation-name",
                                        dtypes=(torch.float32,), recurrent_decode=_gate_axis_step)


def _tf32_no_resets(q, k, v, *, g, **kw):
    """TF32 products, and NaN outputs for a request that has a reset gate (below -RESET_GATE: -inf, -1e30, -300)."""
    from kvbuffer_ref.checks import RESET_GATE

    o = _tf32_recurrent(q, k, v, g=g, **kw)
    reset = (g < -RESET_GATE[torch.float32]).flatten(1).any(1).view(-1, 1, 1, 1)
    if isinstance(o, tuple):
        return (o[0].masked_fill(reset, float("nan")), *o[1:])
    return o.masked_fill(reset, float("nan"))


#: TF32 products declared as IEEE float32, and no reset gates: it fails as fp32 on mild gates, and as tf32 on
#: reset gates only; the report must say that tf32 explains the first failure.
tf32_no_resets = types.SimpleNamespace(name="tf32-no-resets", dtypes=(torch.float32,),
                                       recurrent_gated_delta_rule=_tf32_no_resets)
