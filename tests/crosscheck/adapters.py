"""Adapters: other projects' gated-delta-rule functions behind kvbuffer_ref's signature.

Each adapter takes ``(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False)``
in this project's conventions (q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] or [B, T, HV, K];
beta [B, T, HV]; state [B, HV, K, V]) and returns ``(o [B, T, HV, V], state or None)``.  The mapping
of every convention is spelled out in docs/crosscheck.md; the comments below say which line maps what.
``namespace(fn)`` wraps an adapter as an object with the kvbuffer_ref names that golden.check calls
(``recurrent_gated_delta_rule``, ``chunk_gated_delta_rule``, ``direct_gated_delta_rule``).
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch

from kvbuffer_ref.checks import RESET_GATE
from kvbuffer_ref.core import expand_heads


def namespace(adapter: Callable, *, default_chunk: Optional[int] = None) -> types.SimpleNamespace:
    """kvbuffer_ref's three sequence-level names, all served by ``adapter``.

    A chunked adapter gets the case's chunk_size for chunk cases and ``default_chunk`` otherwise
    (small, so that the recurrent / direct cases also cross chunk boundaries)."""

    def recurrent(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
        kw = {} if default_chunk is None else {"chunk_size": default_chunk}
        return adapter(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, **kw)

    def chunk(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
        kw = {} if default_chunk is None else {"chunk_size": chunk_size}
        return adapter(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, **kw)

    def direct(q, k, v, *, g, beta, scale=None):
        return recurrent(q, k, v, g=g, beta=beta, scale=scale)[0]

    return types.SimpleNamespace(recurrent_gated_delta_rule=recurrent, chunk_gated_delta_rule=chunk,
                                 direct_gated_delta_rule=direct)


def _scale(scale, K: int) -> float:
    return K ** -0.5 if scale is None else float(scale)


# ------------------------------------------------------------------------------ flash-linear-attention
def fla_naive_recurrent(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
    """fla.ops.gated_delta_rule.naive_recurrent_gated_delta_rule (fla-core 0.6.0)."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    if g.dim() != 3:
        raise NotImplementedError("fla's naive recurrent takes scalar gates [B, T, H] only")
    HV = v.shape[2]
    # no grouped heads: q, k must already have one head per value head (expand: head i <- i // group);
    # positional order is (q, k, v, beta, g): beta BEFORE g; scale default K^-0.5, applied to q inside.
    o, S = naive_recurrent_gated_delta_rule(expand_heads(q, HV), expand_heads(k, HV), v, beta, g,
                                            scale=_scale(scale, q.shape[-1]), initial_state=initial_state,
                                            output_final_state=output_final_state)
    return o, S  # state [B, HV, K, V] (key-major, as ours); computed in float32 whatever the input dtype


def fla_naive_chunk(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """fla.ops.gated_delta_rule.naive_chunk_gated_delta_rule (fla-core 0.6.0)."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    if g.dim() != 3:
        raise NotImplementedError("fla's naive chunk takes scalar gates [B, T, H] only")
    HV = v.shape[2]
    # positional order here is (q, k, v, g, beta): g BEFORE beta (the opposite of the naive recurrent);
    # chunk_size comes before scale positionally, so pass everything after beta by keyword.
    o, S = naive_chunk_gated_delta_rule(expand_heads(q, HV), expand_heads(k, HV), v, g, beta,
                                        chunk_size=chunk_size, scale=_scale(scale, q.shape[-1]),
                                        initial_state=initial_state, output_final_state=output_final_state)
    return o, S


def fla_fused_recurrent(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
    """fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule (Triton; the interpreter on CPU)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    gates = {"gk": g} if g.dim() == 4 else {"g": g}  # per-channel gates go to gk [B, T, HV, K]
    # grouped heads are native (value head i reads q/k head i // (HV // H)); state [B, HV, K, V] unless
    # state_v_first=True; beta [B, T, HV] is "headwise" (a [B, T, HV, V] beta would be per value channel);
    # everything after v by keyword (g, gk, gv, beta are positional 4..7).
    o, S = fused_recurrent_gated_delta_rule(q, k, v, **gates, beta=beta, scale=_scale(scale, q.shape[-1]),
                                            initial_state=initial_state, output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=False, state_v_first=False)
    return o, S


# ----------------------------------------------------------------------------- HF transformers (Qwen3-Next)
def hf_torch_fallbacks():
    """The pure-torch fallbacks of transformers' Qwen3-Next gated delta rule.

    The module-level names are wrapped by ``use_kernel_func_from_hub_with_fallback``: when fla is
    importable they dispatch to fla's Triton kernels, not to the torch code.  ``__wrapped__`` is the
    torch function itself (functools.wraps).  Where the ``kernels`` package is installed (a dependency
    from transformers 5.25 on), the name is moreover an ``nn.Module`` instance whose ``forward`` closes
    over that wrapper.  Assert that what is found is the torch function, so the comparison is really
    with HF's code.
    """
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    from kvbuffer.integrations.transformers import torch_function_behind

    out = {}
    for name in ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"):
        fn = torch_function_behind(getattr(m, name), name)
        assert fn.__module__ == m.__name__ and fn.__name__ == name, f"{name} resolved to {fn.__module__}.{fn.__name__}"
        out[name] = fn
    return out


def _hf_call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, **kw):
    if g.dim() != 3:
        raise NotImplementedError("HF's Qwen3-Next fallbacks take scalar gates [B, T, HV] only")
    K = q.shape[-1]
    # no scale argument: q is always multiplied by K^-0.5 inside, so fold the ratio into q first;
    # grouped heads are native (repeat_interleave: value head i <- q/k head i // group, as ours);
    # use_qk_l2norm_in_kernel=False: the caller normalises (Qwen3-Next's layer passes True);
    # computed in float32 whatever the input dtype; state [B, HV, K, V] key-major.
    q = q * (_scale(scale, K) * K ** 0.5) if scale is not None else q
    # a gate below -200 decays to exactly 0 in float32 either way: take it as -200, the library's convention
    # for resets (the validator's peers do the same).  Unclamped, HF's float32 cumulative gates of a gate of
    # -832 lose their low bits, and its outputs on golden decode_edges are 9x a clamping kernel's error.
    g = g.clamp(min=-float(RESET_GATE[torch.float32]))
    return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=False, **kw)


def hf_recurrent(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
    fn = hf_torch_fallbacks()["torch_recurrent_gated_delta_rule"]
    return _hf_call(fn, q, k, v, g, beta, scale, initial_state, output_final_state)


def hf_chunk(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    fn = hf_torch_fallbacks()["torch_chunk_gated_delta_rule"]
    return _hf_call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size=chunk_size)
