"""Reading one request's buffered entries, and writing entries back with a fold when they overflow.

The reference works request by request (lengths are ragged), on plain per-request tensors:

* ``Entries``: a request's entries in the buffer's own form, keys per q/k head;
* ``memory_of``: the same entries as a ``core.Memory`` (u-form, value heads), recomputing u from
  the stale state for the raw form;
* ``store``: write a list of entries into a request's slots, folding the oldest into the state
  when there are more than C of them (``fold_count`` says how many).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Optional

import torch

from .buffer import KVBuffer
from .core import Memory, expand_heads, fold_state, innovations

__all__ = ["Entries", "fold_dtype", "entries_of", "concat_entries", "memory_of", "stale_state", "tail_gate",
           "fold_count", "store", "require_storage", "append"]

_SLOTS = KVBuffer.slot_fields()


class Entries(namedtuple("_Entries", _SLOTS, defaults=(None,) * (len(_SLOTS) - 1))):
    """n entries of one request, one field per slot field of the buffer.  k: [n, H, K]; u-form:
    u [n, HV, V], G [n, HV]*; raw form: v [n, HV, V], g [n, HV]*, beta [n, HV].  Unused fields are None."""

    __slots__ = ()

    def take(self, idx) -> "Entries":
        """The entries at ``idx`` (a slice or an index tensor)."""
        return Entries(*(None if x is None else x[idx] for x in self))

    @property
    def n(self) -> int:
        """Number of entries."""
        return self.k.shape[0]


def fold_dtype(buffer: KVBuffer) -> torch.dtype:
    """The dtype the buffer's folds compute in: the widest of its floating fields (keys, u / v, G / g,
    beta, state), at least float32.  A 16-bit field is a *stored* precision, never an arithmetic one:
    reading it converts exactly, and what a fold writes is rounded once to each field's dtype
    (``store``), so a buffer with a bfloat16 state and float64 everything else is the float64 oracle of a
    kernel that rounds its state at every fold."""
    dt = torch.float32
    for name, x in buffer.tensors().items():
        if x is not None and x.dtype.is_floating_point:
            dt = torch.promote_types(dt, x.dtype)
    return dt


def _read_dtype(buffer: KVBuffer, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or ``fold_dtype(buffer)`` where ``dtype`` is narrower than float32 (a 16-bit field's own
    dtype asked for as the working dtype: the 16-bit values are read exactly, the arithmetic stays wide)."""
    return dtype if torch.finfo(dtype).bits >= 32 else fold_dtype(buffer)


def entries_of(buffer: KVBuffer, b: int, dtype: torch.dtype) -> Entries:
    """Request b's buffered entries (the first ``lengths[b]`` slots) in ``dtype`` (a 16-bit ``dtype``
    reads in ``fold_dtype(buffer)``)."""
    dtype = _read_dtype(buffer, dtype)
    n = int(buffer.lengths[b])
    return Entries(**{f: None if getattr(buffer, f) is None else getattr(buffer, f)[b, :n].to(dtype) for f in _SLOTS})


def concat_entries(a: Entries, b: Entries) -> Entries:
    """Entries of ``a`` followed by those of ``b`` (the same form)."""
    return Entries(*(None if x is None else torch.cat([x, y.to(x.dtype)], dim=0) for x, y in zip(a, b)))


def stale_state(buffer: KVBuffer, b: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Request b's stale state S0 [HV, K, V] in ``dtype`` (a 16-bit ``dtype`` reads in
    ``fold_dtype(buffer)``), or None in direct mode (S0 = 0)."""
    if buffer.state is None or not bool(buffer.has_state[b]):
        return None
    return buffer.state[b].to(_read_dtype(buffer, dtype))


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
    and u-form gates are rebased on the last folded entry (``G_i - G_fold``).  Every value is computed
    in the dtype of ``e`` and ``S0`` and rounded once, by ``.to()`` (round to nearest even), to the dtype
    of the field it is written to: the folded state to the state's, each u to the u-cache's.
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
    for f, x in e._asdict().items():
        if x is not None:
            fields[f][b, :n] = x.to(fields[f].dtype)
    fields["lengths"][b] = n


def require_storage(buffer: KVBuffer, b: int, n_old: int, n_new: int) -> None:
    """A fold needs state storage: ValueError when ``buffer.state`` is None."""
    if buffer.state is None:
        raise ValueError(
            f"buffer: request {b} has {n_old} entries and gets {n_new} more, past the capacity "
            f"C={buffer.capacity}, but the buffer has no state storage to fold into (buffer.state is None); "
            f"call flush() first (it allocates the state) or use a larger capacity"
        )


def append(fields: dict, buffer: KVBuffer, b: int, old: Entries, new: Entries, S0: Optional[torch.Tensor]) -> None:
    """Append entries ``new`` after request b's entries ``old`` (its stale state S0) in ``fields``, the
    working copies of ``buffer``'s tensors; when they pass the capacity C, fold by ``fold_count`` first.

    Raises ValueError when a fold is needed and the buffer has no state storage (``state is None``).
    """
    fold = fold_count(old.n, new.n, buffer.capacity)
    if fold:
        require_storage(buffer, b, old.n, new.n)
    store(fields, b, concat_entries(old, new), S0, fold, buffer.num_value_heads)
