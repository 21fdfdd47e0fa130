"""Buffered decode (no state write per step), flush (the fold) and reading the current state."""

from __future__ import annotations

from typing import Optional

import torch

from .buffer import KVBuffer
from .checks import check_buffer, check_flush_count
from .core import innovations, outputs
from .entries import (Entries, append, entries_of, fold_dtype, memory_of, require_storage, stale_state, store,
                      tail_gate)
from .inputs import prepare_tokens

__all__ = ["buffered_decode", "flush", "materialize_state"]


def buffered_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    buffer: KVBuffer,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, KVBuffer]:
    """One new token per request from the stale state plus the buffer; returns (o, new buffer).

    q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV]*; beta: [B, 1, HV]; o: [B, 1, HV, V].
    The token's entry is appended.  A request whose buffer is already full (length C) first has
    its C entries folded into its state (which needs ``buffer.state`` storage), so the new buffer
    holds one entry; the token then reads the folded state as stored (rounded to the state's dtype,
    which matters for a 16-bit state).  Otherwise this is ``verify`` of one draft followed by ``accept``
    of it, written out: per request, u from (2) and o from (3) of docs/math.md on top of S0 and the
    buffered entries.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q: buffered_decode takes one token per request, expected [B, 1, H, K], got {shape}")
    x = prepare_tokens(q, k, v, g, beta, scale)
    d = x.dims
    check_buffer(buffer, d, q.device)
    # the token is computed in dt from the state and entries as stored; the fold of a full buffer in the
    # buffer's fold dtype (entries.fold_dtype: at least float32), the state and u rounded when written
    dt, kept = x.v.dtype, fold_dtype(buffer)
    alone = torch.zeros(1, 1, dtype=torch.bool, device=q.device)  # the token has no ancestor among new tokens
    o = torch.zeros(d.B, 1, d.HV, d.V, dtype=dt, device=q.device)
    fields = buffer.cloned()
    for b in range(d.B):  # full buffers fold first, into the working copies
        n = int(buffer.lengths[b])
        if n >= buffer.capacity:
            require_storage(buffer, b, n, 1)
            store(fields, b, entries_of(buffer, b, kept), stale_state(buffer, b, kept), n, d.HV)
    buffer = KVBuffer(**fields)  # shares the working copies: request b's appends touch only its own rows
    for b in range(d.B):
        S0 = stale_state(buffer, b, dt)
        old = entries_of(buffer, b, dt)
        mem = memory_of(old, S0, d.HV)
        G = tail_gate(old, x.g[b, 0]) + x.g[b]  # [1, HV]*: the token's cumulative gate since the last flush
        u = innovations(x.k[b], x.v[b], x.beta[b], G, alone, S0, mem)
        o[b] = outputs(x.q[b], x.k[b], u, G, alone, S0, mem)
        own = dict(u=u, G=G) if buffer.form == "u" else dict(v=x.v[b], g=x.g[b], beta=x.beta[b])
        append(fields, buffer, b, entries_of(buffer, b, kept), Entries(k=x.k_heads[b], **own),
               stale_state(buffer, b, kept))
    return o.to(x.out_dtype), buffer


def flush(buffer: KVBuffer, *, count=None) -> KVBuffer:
    """Fold the first ``count`` entries of each request into its state; return a new buffer.

    count: None (all entries), an int, or a [B] int tensor, each in 0..lengths[b].  The folded
    requests own a state from now on; the remaining entries keep their u and, in the u-cache
    form, have their cumulative gates rebased (``G_i - G_count``).  A buffer without state
    storage (``state is None``) gets a zero-initialised one here.
    """
    check_buffer(buffer)
    B = buffer.batch
    count = check_flush_count(count, buffer.lengths)
    dt = fold_dtype(buffer)
    fields = buffer.cloned()
    if fields["state"] is None:
        K, V = buffer.head_k_dim, buffer.head_v_dim
        fields["state"] = torch.zeros(B, buffer.num_value_heads, K, V,
                                      dtype=torch.promote_types(buffer.values.dtype, torch.float32),
                                      device=buffer.k.device)
    for b in range(B):
        m = int(count[b])
        if m > 0:
            store(fields, b, entries_of(buffer, b, dt), stale_state(buffer, b, dt), m, buffer.num_value_heads)
    return KVBuffer(**fields)


def materialize_state(buffer: KVBuffer) -> torch.Tensor:
    """The current state S_n of every request [B, HV, K, V] (zeros where none exists); the buffer is unchanged."""
    folded = flush(buffer)
    owns = folded.has_state[:, None, None, None]
    return torch.where(owns, folded.state, torch.zeros((), dtype=folded.state.dtype, device=folded.state.device))
