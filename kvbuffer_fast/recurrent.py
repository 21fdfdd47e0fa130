"""The recurrent gated delta rule: the state read and written once per launch, T tokens in registers.

``_recurrent_kernel``, grid (V / BV, B * HV): each program owns a [K, BV] tile of one request's state
for one value head; it loads the tile once, runs the gated delta rule over the T tokens and stores
the tile back.  With ``cu_seqlens`` (B = 1, N sequences along T) the grid is (V / BV, N * HV) and a
program runs its sequence's tokens cu[n] .. cu[n + 1] - 1, read from the offsets on the device.  Value
columns are independent (u_t = beta (v_t - S~^T k_t) is computed per column), so tiles never talk to
each other.  State traffic per launch: 2 |S| (read + write).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.checks import Dims, check_scale, check_state, check_tokens
from kvbuffer_ref.recurrent import check_cu_seqlens

from ._common import (_program_ids, _tile_offsets, as_input, block, checked_tokens, device_guard, new_output,
                      require_fp32_state, require_inplace)
from .launch import RecurrentConfig, check_config, config_for, key_of

__all__ = ["recurrent_gated_delta_rule"]


@triton.jit
def _gated_delta_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, i_bt, i_h, i_hv, o_k, o_v, m_k, m_v, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CHANNEL: tl.constexpr):
    """One token (flat index i_bt = b * T + t) of the gated delta rule on a [K, BV] state tile held in
    registers: S *= exp(g), u = beta (v - S^T k), S += k u^T, o = S^T q (q scaled), o stored.  Returns S.
    Shared by the recurrent kernel and the per-draft-state baseline (kvbuffer_fast.baselines)."""
    b_q = tl.load(q_ptr + (i_bt * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k_ptr + (i_bt * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v_ptr + (i_bt * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta_ptr + i_bt * HV + i_hv).to(tl.float32)
    if CHANNEL:
        b_g = tl.load(g_ptr + (i_bt * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        s = s * tl.exp(b_g)[:, None]
    else:
        s = s * tl.exp(tl.load(g_ptr + i_bt * HV + i_hv).to(tl.float32))
    b_u = b_beta * (b_v - tl.sum(s * b_k[:, None], 0))
    s = s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(s * b_q[:, None], 0)
    tl.store(o_ptr + (i_bt * HV + i_hv) * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    return s


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr,
    cu_ptr, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr, VARLEN: tl.constexpr,
):
    """The tokens of one (request or sequence, value head) on its [K, BV] state tile, updated in place."""
    i_v, i_bh, i_b, i_hv, i_h = _program_ids(H, HV)
    o_k, o_v, m_k, m_v = _tile_offsets(i_v, BK, BV, K, V)
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state_ptr + (i_bh * K + o_k[:, None]) * V + o_v[None, :]
    s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    if VARLEN:  # sequence i_b: tokens cu[i_b] .. cu[i_b + 1] - 1 of the batch of one
        first = tl.load(cu_ptr + i_b).to(tl.int64)
        end = tl.load(cu_ptr + i_b + 1).to(tl.int64)
    else:
        first = i_b * T
        end = first + T
    for t in range(first, end):
        s = _gated_delta_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, t, i_h, i_hv, o_k, o_v, m_k,
                              m_v, scale, H, HV, K, V, CHANNEL)
    tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_s)


def recurrent_step(q, k, v, g, beta, state: torch.Tensor, scale: Optional[float],
                   config: Optional[RecurrentConfig], cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The recurrent kernel over the tokens, ``state`` [B, HV, K, V] (contiguous; [N, HV, K, V] with
    ``cu_seqlens``, checked by the caller) updated IN PLACE; returns o [B, T, HV, V] in v's dtype
    (kvbuffer_fast.baselines.recurrent_decode is this)."""
    d, g = checked_tokens(q, k, v, g, beta)
    if state is None:
        raise ValueError("state: the recurrent step needs a state [B, HV, K, V] to update in place, got None")
    N = d.B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_state("state", state, Dims(**{**d.__dict__, "B": N}), q.device)
    require_fp32_state("state", state)
    require_inplace("state", state)
    s = check_scale(scale, d.K)
    if config is None:
        config = config_for("recurrent", key_of(q, B=d.B, HV=d.HV, V=d.V, channel=d.channel_gate))
    cfg = check_config("recurrent", config)
    o = new_output((d.B, d.T, d.HV, d.V), v.dtype, q.device)
    if N == 0 or d.T == 0:
        return o
    BV = max(16, min(cfg.BV, block(d.V)))
    with device_guard(q):
        _recurrent_kernel[(triton.cdiv(d.V, BV), N * d.HV)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), o, state,
            q if cu_seqlens is None else as_input(cu_seqlens), s, d.T,
            H=d.H, HV=d.HV, K=d.K, V=d.V, BK=block(d.K), BV=BV, CHANNEL=d.channel_gate,
            VARLEN=cu_seqlens is not None, num_warps=cfg.num_warps,
        )
    return o


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    config: Optional[RecurrentConfig] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``kvbuffer_ref.recurrent_gated_delta_rule`` on the recurrent kernel (inputs are not modified).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K]; beta: [B, T, HV];
    initial_state: [B, HV, K, V] or None (zeros).  Per value head, q scaled (``scale`` default K ** -0.5)::

        S~ = exp(g) S (per-channel: diag(exp(g)) S);  u = beta (v - S~^T k);  S = S~ + k u^T;  o = S^T q

    Returns o [B, T, HV, V] in v's dtype and, if ``output_final_state``, the final float32 state
    [B, HV, K, V].  ``cu_seqlens`` (int32 / int64 [N + 1] offsets on q's device, B = 1): N sequences
    concatenated along T, each from its own initial state ([N, HV, K, V]) to its own final state
    ([N, HV, K, V]); an empty sequence's final state is its initial state.  ``config``: a
    :class:`kvbuffer_fast.launch.RecurrentConfig`, None for the table's.
    """
    d = check_tokens(q, k, v, g, beta)
    N = d.B
    if cu_seqlens is not None:
        N = len(check_cu_seqlens(cu_seqlens, q, initial_state)) - 1
    check_state("initial_state", initial_state, Dims(**{**d.__dict__, "B": N}), q.device)
    if initial_state is None:
        state = torch.zeros(N, d.HV, d.K, d.V, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32, copy=True).contiguous()
    o = recurrent_step(q, k, v, g, beta, state, scale, config, cu_seqlens=cu_seqlens)
    return o, (state if output_final_state else None)
