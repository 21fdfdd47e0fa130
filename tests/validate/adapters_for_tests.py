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
    from kvbuffer_ref.validate.contracts import emulate

    def call(*a, **kw):
        with emulate(contract):
            return fn(*a, **kw)
    return call


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
