"""The chunkwise (UT / WY) form: the prefill algorithm, for any T and any chunk size."""

from __future__ import annotations

from typing import Optional

import torch

from .core import decay_rows, decayed_dot, fold_state, read_state
from .inputs import prepare_tokens
from .checks import check_chunk_size, check_state
from .recurrent import per_sequence

__all__ = ["chunk_gated_delta_rule"]


def _wy_chunk(q, k, v, beta, G, S):
    """One chunk of L tokens in WY form, batched over B.

    q (scaled), k: [B, L, HV, K]; v: [B, L, HV, V]; beta: [B, L, HV]; G: [B, L, HV]* the gates'
    cumsum inside the chunk; S: [B, HV, K, V] the state before the chunk.
    With T = (I + A)^{-1}, A_ij = beta_i D_ij (k_i.k_j) (i > j):
        W = T diag(beta) (exp(G) * K),  U~ = T diag(beta) V,  U = U~ - W S,
        O = exp(G) S^T q + (causal D * QK^T) U.
    Returns (o [B, L, HV, V], u [B, L, HV, V]).
    """
    L = k.shape[1]
    strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    A = decayed_dot(k, k, G, G, strict) * beta.unsqueeze(-2)  # [B, L, L, HV]
    M = A.permute(0, 3, 1, 2) + torch.eye(L, dtype=A.dtype, device=A.device)  # [B, HV, L, L]
    Tinv = torch.linalg.solve_triangular(M, torch.eye(L, dtype=A.dtype, device=A.device).expand_as(M),
                                         upper=False, unitriangular=True)
    Wk = torch.einsum("bhij,bjhk->bihk", Tinv, beta.unsqueeze(-1) * decay_rows(k, G))
    Ut = torch.einsum("bhij,bjhv->bihv", Tinv, beta.unsqueeze(-1) * v)
    u = Ut - torch.einsum("bihk,bhkv->bihv", Wk, S)
    causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
    o = read_state(S, q, G) + torch.einsum("bijh,bjhv->bihv", decayed_dot(q, k, G, G, causal), u)
    return o, u


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunkwise gated delta rule; same signature and results as ``recurrent_gated_delta_rule``.

    The sequence is cut into chunks of ``chunk_size`` tokens (the last may be shorter).  Inside a
    chunk the innovations come from the UT transform (``_wy_chunk``); between chunks the state is
    folded once: ``S <- diag(exp(G_L)) S + sum_j (exp(G_L - G_j) * k_j) u_j^T``.
    ``cu_seqlens`` ([N + 1] int offsets, B = 1): N sequences concatenated along T, each chunked alone
    (states [N, HV, K, V]).
    """
    if cu_seqlens is not None:
        check_chunk_size(chunk_size)
        return per_sequence(chunk_gated_delta_rule, q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state,
                            chunk_size=chunk_size)
    x = prepare_tokens(q, k, v, g, beta, scale)
    d = x.dims
    check_state("initial_state", initial_state, d, q.device)
    check_chunk_size(chunk_size)
    S = (
        torch.zeros(d.B, d.HV, d.K, d.V, dtype=x.v.dtype, device=q.device)
        if initial_state is None
        else initial_state.to(x.v.dtype, copy=True)  # the returned final state never aliases the input
    )
    outputs = []
    for start in range(0, d.T, chunk_size):
        sl = slice(start, min(start + chunk_size, d.T))
        G = x.g[:, sl].cumsum(dim=1)
        o, u = _wy_chunk(x.q[:, sl], x.k[:, sl], x.v[:, sl], x.beta[:, sl], G, S)
        S = fold_state(S, x.k[:, sl], u, G, G[:, -1])
        outputs.append(o)
    o = torch.cat(outputs, dim=1) if outputs else x.v.new_zeros(d.B, 0, d.HV, d.V)
    return o.to(x.out_dtype), (S if output_final_state else None)
