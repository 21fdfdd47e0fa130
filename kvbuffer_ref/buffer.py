"""The KVBuffer: a stale state plus the most recent tokens of every request.

A buffer holds, per request b of a batch:

* ``state[b]``: the stale state S0 ``[HV, K, V]``, meaningful only where ``has_state[b]``.
  A request without a state is in *direct mode*: S0 = 0.  ``state`` itself may be ``None``
  (no request owns a state and no storage exists); such a buffer cannot fold.
* ``lengths[b]``: how many entries (0..C) are buffered since the last flush.
* the entries themselves, in one of two forms:

  - u-cache ``(k, u, G)``: the key, the innovation ``u_i = beta_i (v_i - S~_i^T k_i)`` of the
    recurrence, and the cumulative log-gate ``G_i = g_1 + ... + g_i`` since the last flush;
  - raw ``(k, v, g, beta)``: the token's own inputs, as the paper caches them; u is recomputed
    from the stale state whenever it is needed.

Both forms give the same outputs (docs/math.md).  Keys are stored per q/k head ``[B, C, H, K]``;
values, innovations, gates and betas per value head.  Entries at positions ``>= lengths[b]`` are
garbage and never read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

__all__ = ["KVBuffer", "Drafts"]


@dataclass(frozen=True)
class KVBuffer:
    """Stale state + buffered entries for a batch of B requests, capacity C.

    Fields (``*`` = per-channel gate adds a trailing K axis):

    ================ ======================= ==========================================
    field            shape                   meaning
    ================ ======================= ==========================================
    ``k``            [B, C, H, K]            cached keys (shared by a group's value heads)
    ``lengths``      [B] int64               entries in use, 0..C
    ``state``        [B, HV, K, V] or None   stale state S0 (storage for every request)
    ``has_state``    [B] bool                request owns a state (else direct mode, S0 = 0)
    ``u``            [B, C, HV, V]           u-cache form: innovations
    ``G``            [B, C, HV]*             u-cache form: cumulative log-gates since the flush
    ``v``            [B, C, HV, V]           raw form: values
    ``g``            [B, C, HV]*             raw form: per-token log-gates
    ``beta``         [B, C, HV]              raw form: write strengths
    ================ ======================= ==========================================

    Exactly one form is populated: ``(u, G)`` or ``(v, g, beta)``.
    """

    k: torch.Tensor
    lengths: torch.Tensor
    state: Optional[torch.Tensor]
    has_state: torch.Tensor
    u: Optional[torch.Tensor] = None
    G: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None
    beta: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ sizes
    @property
    def form(self) -> str:
        """``"u"`` for the u-cache (k, u, G), ``"raw"`` for the paper's (k, v, g, beta)."""
        return "u" if self.u is not None else "raw"

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def num_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_k_dim(self) -> int:
        return self.k.shape[3]

    @property
    def values(self) -> torch.Tensor:
        """The per-value-head payload: ``u`` (u-cache) or ``v`` (raw)."""
        return self.u if self.u is not None else self.v

    @property
    def gates(self) -> torch.Tensor:
        """The gate tensor: ``G`` (u-cache, cumulative) or ``g`` (raw, per token)."""
        return self.G if self.G is not None else self.g

    @property
    def num_value_heads(self) -> int:
        return self.values.shape[2]

    @property
    def head_v_dim(self) -> int:
        return self.values.shape[3]

    @property
    def channel_gate(self) -> bool:
        return self.gates.dim() == 4

    def replace(self, **changes) -> "KVBuffer":
        """A copy with some fields replaced (the buffer itself is never modified)."""
        return replace(self, **changes)

    # ------------------------------------------------------------ construction
    @classmethod
    def empty(
        cls,
        batch: int,
        num_heads: int,
        num_value_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        capacity: int,
        *,
        channel_gate: bool = False,
        form: str = "u",
        with_state: bool = True,
        dtype: torch.dtype = torch.float64,
        key_dtype: Optional[torch.dtype] = None,
        state_dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> "KVBuffer":
        """An empty buffer (every length 0, no request owning a state yet).

        ``dtype`` is the dtype of the cached u / v, G / g and beta; ``key_dtype`` of the keys
        (default ``dtype``); ``state_dtype`` of the state storage (default ``dtype``).
        ``with_state=False`` allocates no state storage at all (a direct-only buffer).
        """
        from .checks import check_capacity

        check_capacity(capacity)
        if form not in ("u", "raw"):
            raise ValueError(f"form: expected 'u' (u-cache) or 'raw' (k, v, g, beta), got {form!r}")
        if num_heads < 1 or num_value_heads % num_heads != 0:
            raise ValueError(
                f"num_value_heads: expected a positive multiple of num_heads={num_heads}, got {num_value_heads}"
            )
        B, C, H, HV, K, V = batch, capacity, num_heads, num_value_heads, head_k_dim, head_v_dim
        key_dtype = key_dtype or dtype
        state_dtype = state_dtype or dtype
        gshape = (B, C, HV, K) if channel_gate else (B, C, HV)
        kw = dict(device=device)
        fields = dict(
            k=torch.zeros(B, C, H, K, dtype=key_dtype, **kw),
            lengths=torch.zeros(B, dtype=torch.long, **kw),
            state=torch.zeros(B, HV, K, V, dtype=state_dtype, **kw) if with_state else None,
            has_state=torch.zeros(B, dtype=torch.bool, **kw),
        )
        if form == "u":
            fields.update(u=torch.zeros(B, C, HV, V, dtype=dtype, **kw), G=torch.zeros(gshape, dtype=dtype, **kw))
        else:
            fields.update(
                v=torch.zeros(B, C, HV, V, dtype=dtype, **kw),
                g=torch.zeros(gshape, dtype=dtype, **kw),
                beta=torch.zeros(B, C, HV, dtype=dtype, **kw),
            )
        return cls(**fields)


@dataclass(frozen=True)
class Drafts:
    """What ``verify`` computed for each draft node, kept so that ``accept`` recomputes nothing.

    ``D`` is the largest draft count in the batch; rows past ``num_drafts[b]`` are padding.

    ============== ================= ==================================================
    field          shape             meaning
    ============== ================= ==================================================
    ``parents``    [B, D] int64      parent of each node (-1 = the buffer's tail)
    ``num_drafts`` [B] int64         drafts verified per request
    ``k``          [B, D, H, K]      the drafts' keys
    ``u``, ``G``   [B, D, HV, V], *  u-cache form: innovation and cumulative log-gate along the
                                     node's path, relative to the buffer's last flush
    ``v``, ``g``,  [B, D, HV, V], *, raw form: the drafts' own inputs
    ``beta``       [B, D, HV]
    ============== ================= ==================================================
    """

    parents: torch.Tensor
    num_drafts: torch.Tensor
    k: torch.Tensor
    u: Optional[torch.Tensor] = None
    G: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None
    beta: Optional[torch.Tensor] = None

    @property
    def form(self) -> str:
        return "u" if self.u is not None else "raw"

    @property
    def is_chain(self) -> torch.Tensor:
        """[B] bool: request b's drafts are the chain -1, 0, 1, ... (over its num_drafts rows)."""
        D = self.parents.shape[1]
        chain = torch.arange(-1, D - 1, device=self.parents.device)
        valid = torch.arange(D, device=self.parents.device)[None, :] < self.num_drafts[:, None]
        return ((self.parents == chain[None, :]) | ~valid).all(dim=1)
