"""The primitives every buffered form is built from.

All functions take an optional leading batch shape ``...`` and work per value head.
Shapes (``n`` / ``m`` token axes, ``*`` = the per-channel gate's trailing K axis):

    keys / queries x : [..., n, HV, K]     values / innovations u : [..., n, HV, V]
    cumulative gates G : [..., n, HV]*     state S : [..., HV, K, V]

Numerics rule (docs/math.md, section 4): a decay is only ever ``exp(G_i - G_j)`` with ``j`` at or before
``i`` on the same path, so it is ``<= 1``; disallowed pairs are masked *before* the exp.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from einops import rearrange, repeat

__all__ = [
    "compute_dtype",
    "expand_heads",
    "cumulative_gates",
    "ancestors",
    "decayed_dot",
    "decay_rows",
    "read_state",
    "fold_state",
    "Memory",
    "innovations",
    "outputs",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference computes in: float64 stays float64, anything narrower runs in float32.

    Half-precision inputs are accumulated in float32, as kernels do (docs/testing.md).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[..., H, D] -> [..., HV, D]: value head i gets q/k head i // (HV // H)."""
    group = num_value_heads // x.shape[-2]
    return repeat(x, "... h d -> ... (h r) d", r=group)


def cumulative_gates(g: torch.Tensor, parents: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Cumulative log-gates along tree paths.

    g: [t, HV]* per-node log-gates; parents: [t] (-1 = the root, whose cumulative gate is ``base``);
    base: [HV]*.  Returns G: [t, HV]* with G_i = G_parent(i) + g_i.  A chain gives a cumsum.
    """
    G = torch.empty_like(g)
    for i in range(g.shape[0]):
        p = int(parents[i])
        G[i] = (base if p < 0 else G[p]) + g[i]
    return G


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[t] parent indices -> [t, t] bool, ``anc[i, j]`` = node j is a proper ancestor of node i."""
    t = parents.shape[0]
    anc = torch.zeros(t, t, dtype=torch.bool, device=parents.device)
    for i in range(t):
        p = int(parents[i])
        if p >= 0:
            anc[i] = anc[p]
            anc[i, p] = True
    return anc


def decayed_dot(
    a: torch.Tensor, b: torch.Tensor, Ga: torch.Tensor, Gb: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Gated inner products ``sum_c a_ic b_jc exp(Ga_ic - Gb_jc)`` for every pair (i, j).

    a: [..., n, HV, K], b: [..., m, HV, K], Ga: [..., n, HV]*, Gb: [..., m, HV]*,
    mask: [n, m] bool (pairs to keep; the rest are exactly 0).  Returns [..., n, m, HV].
    Scalar gates factor out of the sum as ``exp(Ga_i - Gb_j) (a_i . b_j)``.
    """
    channel = Ga.dim() == a.dim()
    if channel:
        diff = Ga.unsqueeze(-3) - Gb.unsqueeze(-4)  # [..., n, m, HV, K]
        if mask is not None:
            diff = diff.masked_fill(~mask[:, :, None, None], float("-inf"))
        return torch.einsum("...ihc,...jhc,...ijhc->...ijh", a, b, diff.exp())
    diff = Ga.unsqueeze(-2) - Gb.unsqueeze(-3)  # [..., n, m, HV]
    if mask is not None:
        diff = diff.masked_fill(~mask[:, :, None], float("-inf"))
    return torch.einsum("...ihc,...jhc->...ijh", a, b) * diff.exp()


def decay_rows(x: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``exp(G_i) * x_i`` row by row: x [..., n, HV, K], G [..., n, HV]* (per-channel: elementwise)."""
    return x * (G.exp() if G.dim() == x.dim() else G.exp().unsqueeze(-1))


def read_state(S: torch.Tensor, x: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """The decayed stale-state read ``exp(G_i) S^T x_i`` (KDA: ``S^T (exp(G_i) * x_i)``).

    S: [..., HV, K, V], x: [..., n, HV, K], G: [..., n, HV]*.  Returns [..., n, HV, V].
    """
    return torch.einsum("...nhk,...hkv->...nhv", decay_rows(x, G), S)


def fold_state(
    S: Optional[torch.Tensor], k: torch.Tensor, u: torch.Tensor, G: torch.Tensor, G_end: torch.Tensor
) -> torch.Tensor:
    """Fold entries into a state: ``diag(exp(G_end)) S + sum_j (exp(G_end - G_j) * k_j) u_j^T``.

    S: [..., HV, K, V] or None (= 0), k: [..., n, HV, K], u: [..., n, HV, V], G: [..., n, HV]*,
    G_end: [..., HV]* the cumulative gate of the last folded entry.  Returns [..., HV, K, V].
    """
    if G.dim() == k.dim():  # per-channel gates
        decay = (G_end.unsqueeze(-3) - G).exp()
        new = torch.einsum("...nhk,...nhv->...hkv", k * decay, u)
        old = 0 if S is None else S * G_end.exp().unsqueeze(-1)
    else:
        decay = (G_end.unsqueeze(-2) - G).exp()
        new = torch.einsum("...nhk,...nhv->...hkv", k * decay.unsqueeze(-1), u)
        old = 0 if S is None else S * G_end.exp()[..., None, None]
    return old + new


def _solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve ``(I + A) X = rhs`` per head, A strictly lower triangular.

    A: [..., t, t, HV], rhs: [..., t, HV, V]; returns X: [..., t, HV, V].
    """
    eye = torch.eye(A.shape[-2], dtype=A.dtype, device=A.device)
    M = rearrange(A, "... i j h -> ... h i j") + eye
    X = torch.linalg.solve_triangular(M, rearrange(rhs, "... t h v -> ... h t v"), upper=False, unitriangular=True)
    return rearrange(X, "... h t v -> ... t h v")


class Memory(NamedTuple):
    """Buffered entries that precede every new token: k [..., n, HV, K], u [..., n, HV, V], G [..., n, HV]*."""

    k: torch.Tensor
    u: torch.Tensor
    G: torch.Tensor


def innovations(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    G: torch.Tensor,
    anc: torch.Tensor,
    S0: Optional[torch.Tensor] = None,
    mem: Optional[Memory] = None,
) -> torch.Tensor:
    """The innovations u of t new tokens on top of a stale state and buffered entries.

    k: [..., t, HV, K]; v: [..., t, HV, V]; beta: [..., t, HV]; G: [..., t, HV]* cumulative
    gates relative to the buffer's start; anc: [t, t] bool proper ancestors among the new tokens
    (strictly lower triangular); S0: [..., HV, K, V] or None (= 0); mem: the buffered entries::

        u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_m D_im (k_i.k_m) u_m - sum_{j anc i} D_ij (k_i.k_j) u_j)

    solved as ``(I + A) U = diag(beta) rhs`` with ``A_ij = beta_i D_ij (k_i.k_j)``.
    Returns u: [..., t, HV, V].
    """
    rhs = v
    if S0 is not None:
        rhs = rhs - read_state(S0, k, G)
    if mem is not None and mem.k.shape[-3] > 0:
        rhs = rhs - torch.einsum("...imh,...mhv->...ihv", decayed_dot(k, mem.k, G, mem.G), mem.u)
    A = decayed_dot(k, k, G, G, anc) * beta.unsqueeze(-2)
    return _solve_unit_lower(A, beta.unsqueeze(-1) * rhs)


def outputs(
    q: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    G: torch.Tensor,
    anc: torch.Tensor,
    S0: Optional[torch.Tensor] = None,
    mem: Optional[Memory] = None,
) -> torch.Tensor:
    """Outputs of t new tokens whose innovations are known.

    q (already scaled), k: [..., t, HV, K]; u: [..., t, HV, V]; the rest as in ``innovations``::

        o_i = exp(G_i) S0^T q_i + sum_m D_im (q_i.k_m) u_m + sum_{j anc i or j = i} D_ij (q_i.k_j) u_j

    Returns o: [..., t, HV, V].
    """
    own = anc | torch.eye(anc.shape[0], dtype=torch.bool, device=anc.device)
    o = torch.einsum("...ijh,...jhv->...ihv", decayed_dot(q, k, G, G, own), u)
    if S0 is not None:
        o = o + read_state(S0, q, G)
    if mem is not None and mem.k.shape[-3] > 0:
        o = o + torch.einsum("...imh,...mhv->...ihv", decayed_dot(q, mem.k, G, mem.G), mem.u)
    return o
