"""flash-linear-attention (fla-core 0.6.0) behind the adapter protocol: ``fla`` (its gated-delta-rule and KDA
kernels, ``FlaAdapter``) and ``fla_pool`` (its pooled KDA decode step in its engine convention).  fla is
imported when an adapter is built, so that the validator runs without it."""

from __future__ import annotations

import sys
import warnings

import torch

from ..validate.adapters import AdapterError, Implementation, describe, interpreter_active
from ._sources import interpretable_chunk_kernels
from .engine import engine_adapter

__all__ = ["FlaAdapter", "fla", "fla_pool"]


class FlaAdapter:
    """flash-linear-attention (fla >= 0.6) behind the protocol: scalar gates go to its gated-delta-rule
    kernels (``fla.ops.gated_delta_rule``), per-channel gates [B, T, HV, K] to its KDA kernels
    (``fla.ops.kda``, Kimi Delta Attention).

    * ``recurrent_gated_delta_rule`` -> ``fused_recurrent_gated_delta_rule`` (scalar ``g`` [B, T, HV]) or
      ``fused_recurrent_kda`` (per-channel ``g``), fla's decode kernels.  fla takes g and beta
      positionally after v; here they are keywords.  beta [B, T, HV] is "head-wise" (one per value
      head); fla's default scale is also K ** -0.5; its initial_state is [B, HV, K, V] in float32 (the
      same layout; ``state_v_first=False``); q/k normalisation inside the kernel is off
      (``use_qk_l2norm_in_kernel=False``: the caller normalises, as our convention says); grouped
      value heads (HV > H, head i uses q/k head i // (HV // H)) are native to fla.  KDA's gate is
      passed in log space as it is (``use_gate_in_kernel=False``: no in-kernel ``-exp(A_log)
      softplus(g + dt_bias)``) and beta as it is (``use_beta_sigmoid_in_kernel=False``): no conversion.
    * ``recurrent_decode``: the same kernels called with T = 1, the state passed in and its final state
      copied back (how a serving engine calls them per decode step).
    * ``chunk_gated_delta_rule`` -> ``chunk_gated_delta_rule`` (scalar gates) or ``chunk_kda``
      (per-channel gates), fla's prefill kernels, with fla's own chunk size 64 (the requested size is a
      property of our reference form; fla takes 16/32/64, KDA 32/64).  Under the Triton interpreter they
      run after ``interpretable_chunk_kernels`` (each autotuner keeps the first of its configs, and the
      kernels' loop indices are tensors as when compiled); the interpreter multiplies in IEEE float32,
      so there they are a check of fla's chunked algorithm, not of its GPU arithmetic.
    * Every kernel takes ``cu_seqlens`` (int64 offsets, B = 1): the varlen lanes.
    * No buffered decode, flush, verify or accept exists in fla: not provided.  Its pooled KDA decode
      (state slots addressed by ``ssm_state_indices``) is the separate adapter ``fla_pool``.
    """

    name = "fla"
    forms = ("u",)
    channel_gate = frozenset({"recurrent_gated_delta_rule", "recurrent_decode", "chunk_gated_delta_rule"})

    def __init__(self):
        try:
            with warnings.catch_warnings():  # fla warns at import when it finds no GPU
                warnings.simplefilter("ignore")
                import fla  # noqa: F401
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
                from fla.ops.kda import chunk_kda, fused_recurrent_kda
        except ImportError as e:
            raise AdapterError(f"the fla adapter needs fla-core 0.6.0 (pip install 'kvbuffer[crosscheck]', or pip install fla-core==0.6.0): {e}") \
                from None
        self._fused, self._fused_kda = fused_recurrent_gated_delta_rule, fused_recurrent_kda
        self._chunk, self._chunk_kda = chunk_gated_delta_rule, chunk_kda
        self.version = getattr(fla, "__version__", "?")
        self.name = f"fla {self.version}"
        self.interpreted = interpreter_active()
        on_gpu = torch.cuda.is_available() and not self.interpreted
        self.dtypes = (torch.float32, torch.float16, torch.bfloat16) if on_gpu else (torch.float32, torch.float16)
        self.not_provided = {
            "direct_gated_delta_rule": "fla has no stateless (direct) form",
            "buffered_decode": "fla has no buffered decode (it reads and writes the state every step)",
            "flush": "fla has no buffer", "materialize_state": "fla has no buffer",
            "verify": "fla has no gated-delta-rule speculative verification",
            "accept": "fla has no gated-delta-rule speculative verification",
            "prefill": "fla has no buffer hand-off",
        }
        if self.interpreted:
            interpretable_chunk_kernels({n: m for n, m in sys.modules.items() if n.startswith("fla.ops.")})
        elif not on_gpu:
            self.not_provided["chunk_gated_delta_rule"] = (
                "fla's chunk kernels (chunk_gated_delta_rule, chunk_kda) run on a GPU or under the Triton "
                "interpreter; validate them with --device cuda or TRITON_INTERPRET=1")
            self.chunk_gated_delta_rule = None

    varlen = ("recurrent_gated_delta_rule", "chunk_gated_delta_rule")  # fla's cu_seqlens (int64 offsets)

    @staticmethod
    def declines(case, op: str = "") -> str:
        """fla's chunk_kda takes K <= 256 only (it asserts so); its recurrent KDA kernel and the gated-delta-rule
        kernels take any K."""
        if op in ("chunk", "chunk_varlen") and case.channel_gate and case.K > 256:
            return f"K = {case.K}: fla's chunk_kda takes key heads of K <= 256 only (per-channel gates)"
        return ""

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   cu_seqlens=None):
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        kw = dict(beta=beta, scale=scale, initial_state=_fla_state(initial_state), output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=False, **_fla_offsets(cu_seqlens))
        if g.dim() == 4:
            return self._fused_kda(q, k, v, g=g, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kw)
        return self._fused(q, k, v, g=g, **kw)

    def recurrent_decode(self, q, k, v, *, g, beta, state, scale=None):
        """One decode step the way serving calls fla: state in, final state out, copied back in place."""
        o, new = self.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                                 output_final_state=True)
        state.copy_(new)
        return o

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                               chunk_size=64, cu_seqlens=None):
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        kw = dict(scale=scale, initial_state=_fla_state(initial_state), output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=False, **_fla_offsets(cu_seqlens))
        if g.dim() == 4:
            return self._chunk_kda(q, k, v, g, beta, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kw)
        return self._chunk(q, k, v, g, beta, **kw)


def _fla_state(S):
    """An initial state as fla's kernels take it: [N, HV, K, V], float32, contiguous (or None)."""
    return None if S is None else S.to(torch.float32).contiguous()


def _fla_offsets(cu_seqlens) -> dict:
    """fla's ``cu_seqlens`` keyword (int64 offsets), or none."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(torch.int64)}


def fla() -> Implementation:
    """flash-linear-attention's kernels (see ``FlaAdapter``)."""
    return describe(FlaAdapter())


def fla_pool() -> Implementation:
    """fla's pooled KDA decode step in its own calling convention (``engine.engine_adapter``), as a serving
    engine calls it: ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` with the states in a pool
    [slots, HV, K, V] (float32) addressed by ``ssm_state_indices`` and updated in place
    (``inplace_final_state=True``), tokens flattened with ``cu_seqlens``, q and k L2-normalised in the
    kernel (``use_qk_l2norm_in_kernel=True``).  Padded rows carry slot 0, a reserved null block (the
    kernel has no pad check: a negative slot would address memory before the pool).  The gate goes in
    log space and beta as it is (``use_gate_in_kernel=False``, ``use_beta_sigmoid_in_kernel=False``): the
    in-kernel gating (``-exp(A_log) softplus(g + dt_bias)`` per channel, ``sigmoid(beta)``) would need
    raw inputs converted from our log gates, which float32 cannot hold exactly, so it is not exercised.
    A scalar gate is passed as the same gate in every key channel (exact).  Inputs in float32 and float16
    (the engine convention's dtypes)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fla
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:
        raise AdapterError(f"the fla-pool adapter needs fla-core 0.6.0 (pip install fla-core==0.6.0): {e}") from None

    def step(*, q, k, v, g, beta, state, slots, cu_seqlens, scale):
        if g.dim() == beta.dim():
            g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
        o, _ = fused_recurrent_kda_fwd(q, k, v, g.contiguous(), beta, scale=scale, initial_state=state,
                                       inplace_final_state=True, cu_seqlens=cu_seqlens, ssm_state_indices=slots,
                                       use_qk_l2norm_in_kernel=True)
        return o

    adapter = engine_adapter(step, name=f"fla {getattr(fla, '__version__', '?')} kda pool decode", qk_l2norm=True,
                             pool=True, pad_slot=0, reserved_slots=(0,), pad_writes=True, varlen=True)
    adapter.interpreted = interpreter_active()
    return describe(adapter)
