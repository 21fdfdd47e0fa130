"""The ground truth: the gated delta rule, one token at a time."""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import prepare_tokens
from .checks import check_state

__all__ = ["recurrent_gated_delta_rule"]


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
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-by-token gated delta rule (decay first, then the delta-rule write, output after it).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K] (log-space, <= 0);
    beta: [B, T, HV]; initial_state: [B, HV, K, V] or None (zeros).
    Returns o: [B, T, HV, V] in v's dtype and, if ``output_final_state``, the final state
    [B, HV, K, V] in the compute dtype (else None).  Per value head, with q scaled::

        S~  = exp(g_t) * S_{t-1}          (per-channel: diag(exp(g_t)) S_{t-1})
        u_t = beta_t * (v_t - S~^T k_t)
        S_t = S~ + k_t u_t^T
        o_t = S_t^T q_t
    """
    x = prepare_tokens(q, k, v, g, beta, scale)
    d = x.dims
    check_state("initial_state", initial_state, d, q.device)
    S = (
        torch.zeros(d.B, d.HV, d.K, d.V, dtype=x.v.dtype, device=q.device)
        if initial_state is None
        else initial_state.to(x.v.dtype)
    )
    o = torch.empty(d.B, d.T, d.HV, d.V, dtype=x.v.dtype, device=q.device)
    for t in range(d.T):
        decay = x.g[:, t].exp()
        decay = decay[..., None] if d.channel_gate else decay[..., None, None]
        S = decay * S
        u = x.beta[:, t, :, None] * (x.v[:, t] - torch.einsum("bhk,bhkv->bhv", x.k[:, t], S))
        S = S + torch.einsum("bhk,bhv->bhkv", x.k[:, t], u)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", x.q[:, t], S)
    return o.to(x.out_dtype), (S if output_final_state else None)
