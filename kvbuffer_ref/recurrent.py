"""The ground truth: the gated delta rule, one token at a time."""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import prepare_tokens
from .checks import check_state, check_tokens, require_device, require_int_tensor, require_rank, require_tensor

__all__ = ["recurrent_gated_delta_rule", "check_cu_seqlens", "per_sequence"]


def check_cu_seqlens(cu_seqlens, q: torch.Tensor, initial_state=None) -> list[int]:
    """Check variable-length offsets and return them as a Python list [N + 1].

    cu_seqlens: int32 / int64 [N + 1] on q's device, 0 = cu[0] <= cu[1] <= ... <= cu[N] = T, for
    inputs of batch B = 1 holding the N sequences one after another (sequence n is tokens
    cu[n]..cu[n+1]-1); initial_state, if given, is [N, HV, K, V] (one per sequence).
    """
    require_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected an int32 or int64 tensor, got dtype {cu_seqlens.dtype}")
    require_rank("cu_seqlens", cu_seqlens, 1, "[N + 1]")
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected [N + 1] offsets (at least the leading 0), got an empty tensor")
    require_device("cu_seqlens", cu_seqlens, q.device)
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: with cu_seqlens the sequences are concatenated along T in a batch of B = 1, "
                         f"got shape {list(q.shape)}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    T = q.shape[1]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {T}, got {cu}")
    if initial_state is not None:
        require_tensor("initial_state", initial_state)
        if initial_state.dim() != 4 or initial_state.shape[0] != len(cu) - 1:
            raise ValueError(f"initial_state: with cu_seqlens expected [N, HV, K, V] with N = {len(cu) - 1} "
                             f"sequences, got {list(initial_state.shape)}")
    return cu


def per_sequence(fn, q, k, v, *, g, beta, cu_seqlens, initial_state=None, output_final_state=False, **kw):
    """``fn`` (a form with the recurrence's signature) on each sequence of a variable-length batch.

    q, k: [1, T, H, K]; v: [1, T, HV, V]; g: [1, T, HV]*; beta: [1, T, HV]; cu_seqlens [N + 1];
    initial_state [N, HV, K, V] or None.  Returns (o [1, T, HV, V], S [N, HV, K, V] or None): by
    definition, each sequence alone.
    """
    check_tokens(q, k, v, g, beta)
    cu = check_cu_seqlens(cu_seqlens, q, initial_state)
    outs, states = [], []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        sl = slice(a, b)
        s0 = None if initial_state is None else initial_state[n:n + 1]
        o, S = fn(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=s0,
                  output_final_state=True, **kw)
        outs.append(o)
        states.append(S)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(1, 0, v.shape[2], v.shape[3])
    if not output_final_state:
        return o, None
    if states:
        return o, torch.cat(states, dim=0)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return o, torch.zeros(0, v.shape[2], q.shape[3], v.shape[3], dtype=dt, device=q.device)


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

    ``cu_seqlens`` ([N + 1] int offsets, B = 1): N sequences concatenated along T, each run alone
    (``per_sequence``); initial and final states are then [N, HV, K, V].
    """
    if cu_seqlens is not None:
        return per_sequence(recurrent_gated_delta_rule, q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state)
    x = prepare_tokens(q, k, v, g, beta, scale)
    d = x.dims
    check_state("initial_state", initial_state, d, q.device)
    S = (
        torch.zeros(d.B, d.HV, d.K, d.V, dtype=x.v.dtype, device=q.device)
        if initial_state is None
        else initial_state.to(x.v.dtype, copy=True)  # the returned final state never aliases the input
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
