"""Reading one request's buffered entries, and writing entries back with a fold when they overflow.

The reference works request by request (lengths are ragged), on plain per-request tensors:

* ``Entries``: a request's entries in the buffer's own form, keys per q/k head;
* ``memory_of``: the same entries as a ``core.Memory`` (u-form, value heads), recomputing u from
  the stale state for the raw form;
* ``store``: write a list of entries into a request's slots, folding the oldest into the state
  when there are more than C of them (``fold_count`` says how many).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .buffer import KVBuffer
from .core import Memory, expand_heads, fold_state, innovations

__all__ = ["Entries", "entries_of", "concat_entries", "memory_of", "stale_state", "tail_gate", "fold_count", "store"]


class Entries(NamedTuple):
    """n entries of one request.  k: [n, H, K]; u-form: u [n, HV, V], G [n, HV]*;
    raw form: v [n, HV, V], g [n, HV]*, beta [n, HV].  Unused fields are None."""

    k: torch.Tensor
    u: Optional[torch.Tensor] = None
    G: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None
    beta: Optional[torch.Tensor] = None

    def take(self, idx) -> "Entries":
        """The entries at ``idx`` (a slice or an index tensor)."""
        return Entries(*(None if x is None else x[idx] for x in self))

    @property
    def n(self) -> int:
        """Number of entries."""
        return self.k.shape[0]


_FIELDS = ("k", "u", "G", "v", "g", "beta")


def entries_of(buffer: KVBuffer, b: int, dtype: torch.dtype) -> Entries:
    """Request b's buffered entries (the first ``lengths[b]`` slots) in ``dtype``."""
    n = int(buffer.lengths[b])
    return Entries(*(None if getattr(buffer, f) is None else getattr(buffer, f)[b, :n].to(dtype) for f in _FIELDS))


def concat_entries(a: Entries, b: Entries) -> Entries:
    """Entries of ``a`` followed by those of ``b`` (the same form)."""
    return Entries(*(None if x is None else torch.cat([x, y.to(x.dtype)], dim=0) for x, y in zip(a, b)))


def stale_state(buffer: KVBuffer, b: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Request b's stale state S0 [HV, K, V], or None in direct mode (S0 = 0)."""
    if buffer.state is None or not bool(buffer.has_state[b]):
        return None
    return buffer.state[b].to(dtype)


def _cumulative(e: Entries) -> torch.Tensor:
    """G of the entries: stored (u-form) or the cumsum of the per-token gates (raw form)."""
    return e.G if e.G is not None else e.g.cumsum(dim=0)


def tail_gate(e: Entries, like: torch.Tensor) -> torch.Tensor:
    """The cumulative gate after the last entry ([HV]*), zeros for no entries.  ``like``: a [HV]* tensor."""
    G = _cumulative(e)
    return G[-1] if G.shape[0] > 0 else torch.zeros_like(like)


def memory_of(e: Entries, S0: Optional[torch.Tensor], num_value_heads: int) -> Memory:
    """The entries as a u-form ``Memory`` over value heads; raw entries get their u recomputed from S0."""
    k = expand_heads(e.k, num_value_heads)
    G = _cumulative(e)
    if e.u is not None:
        return Memory(k, e.u, G)
    n = k.shape[0]
    chain = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
    return Memory(k, innovations(k, e.v, e.beta, G, chain, S0), G)


def fold_count(n_old: int, n_new: int, capacity: int) -> int:
    """How many of ``n_old + n_new`` entries to fold so that the rest fits in ``capacity``.

    Nothing while everything fits; otherwise all the old entries, plus the oldest new ones
    beyond ``capacity`` (so at most ``capacity`` new entries stay buffered).
    """
    if n_old + n_new <= capacity:
        return 0
    return n_old + max(0, n_new - capacity)


def store(fields: dict, b: int, e: Entries, S0: Optional[torch.Tensor], fold: int, num_value_heads: int) -> None:
    """Write entries ``e`` into request b's slots of the (cloned) buffer ``fields``, folding the first ``fold``.

    ``fields`` maps KVBuffer field names to tensors this call may modify (clones of the caller's).
    The folded entries go into ``fields['state'][b]`` (which must exist); the rest keep their u,
    and u-form gates are rebased on the last folded entry (``G_i - G_fold``).
    """
    if fold > 0:
        mem = memory_of(e.take(slice(0, fold)), S0, num_value_heads)
        G_end = mem.G[-1]
        fields["state"][b] = fold_state(S0, mem.k, mem.u, mem.G, G_end).to(fields["state"].dtype)
        fields["has_state"][b] = True
        rest = e.take(slice(fold, None))
        if rest.G is not None:
            rest = rest._replace(G=rest.G - G_end)
        e = rest
    n = e.n
    for f in _FIELDS:
        x = getattr(e, f)
        if x is not None:
            fields[f][b, :n] = x.to(fields[f].dtype)
    fields["lengths"][b] = n
