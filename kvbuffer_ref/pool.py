"""A serving pool: preallocated state slots and buffer slots for many requests over L layers.

An engine embeds one pool per device (per tensor-parallel head shard, see ``head_range``).  A request
lives in one *buffer slot* (its index is the request's address in every operation); per layer it holds
a *state slot* only once it has folded (a request starts in direct mode and gets one at its first
fold), so short requests hold no state memory.  docs/pool.md describes the layout and the decisions.

Layout (``L`` layers, ``S`` state slots, ``N`` buffer slots, capacity ``C``, draft room ``D``; ``H``,
``HV`` the pool's own key / value heads; ``*`` = per-channel gates add a trailing K axis):

=================== =========================== ==============================================
tensor              shape                       meaning
=================== =========================== ==============================================
``state``           [L, S, HV, K, V]            state slots
``k``               [L, N, C, H, K]             buffered keys
``u``, ``G``        [L, N, C, HV, V], [..HV]*   buffered innovations and cumulative log-gates
``lengths``         [L, N] int64                entries in use, 0..C
``has_state``       [L, N] bool                 the request's S0 is its state slot (else S0 = 0)
``state_slot``      [L, N] int64                the request's state slot, -1 for none
``refs``            [L, S] int64                requests sharing the state slot (0 = free)
``dk``, ``du``,     [L, N, D, H, K], ...        the draft room: what ``verify`` computed, for
``dG``                                          ``accept``
``parents``         [L, N, D] int64             the verified drafts' tree
``num_drafts``      [L, N] int64                drafts verified (pending until accepted)
=================== =========================== ==============================================

Every operation takes ``slots``: a [B] int32 or int64 tensor of buffer slots on the pool's device,
-1 for a pad row (a CUDA-graph pad), which reads nothing and writes nothing.  The valid entries must
be distinct live slots.  Token tensors have B rows (one per entry of ``slots``, pads included) and the
pool's own heads.

This is the oracle of the pool: each operation gathers the addressed requests into a ``KVBuffer``,
runs the reference operation on it and scatters the result back, so it is exact by construction; the
rest is the slot bookkeeping.  It works on the host (it reads slot indices and lengths).  Shared
state slots (``fork``) are copy-on-write: a request that folds into a shared slot gets a slot of its
own for the result.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from .buffer import Drafts, KVBuffer
from .checks import (check_accept_fold, check_capacity, check_count_arg, check_fold, check_state, check_tokens,
                     require_no_fold, require_tensor, same_device)
from .decode import buffered_decode, flush, materialize_state
from .entries import fold_count
from .prefill import prefill
from .recurrent import check_cu_seqlens
from .speculative import accept, path_to, verify

__all__ = ["KVPool", "head_layout", "check_slots", "set_layout", "per_row", "on_device", "varlen_admit", "admit_state",
           "pool_fold"]


def set_layout(pool, *, layers: int, num_state_slots: int, num_buffer_slots: int, capacity: int, max_drafts: int,
               num_heads: int, num_value_heads: int, head_k_dim: int, head_v_dim: int, head_range, channel_gate: bool,
               device, least_state_slots: int = 0) -> None:
    """Check a pool's sizes (ValueError naming the argument) and set them on ``pool``: layers, num_state_slots,
    num_buffer_slots, capacity, max_drafts, the shard's num_heads / num_value_heads (``head_layout``),
    key_head_start, head_range, head_k_dim, head_v_dim, channel_gate, device."""
    for name, n, least in (("layers", layers, 1), ("num_state_slots", num_state_slots, least_state_slots),
                           ("num_buffer_slots", num_buffer_slots, 1), ("max_drafts", max_drafts, 0),
                           ("head_k_dim", head_k_dim, 1), ("head_v_dim", head_v_dim, 1)):
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {n!r}")
    check_capacity(capacity)
    if not isinstance(channel_gate, bool):
        raise TypeError(f"channel_gate: expected a bool, got {type(channel_gate).__name__}")
    try:
        device = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch.device or a device string, got {device!r} ({e})") from None
    pool.key_head_start, pool.num_heads, pool.num_value_heads = head_layout(num_heads, num_value_heads, head_range)
    pool.head_range = (0, num_value_heads) if head_range is None else tuple(head_range)
    pool.layers, pool.num_state_slots, pool.num_buffer_slots = layers, num_state_slots, num_buffer_slots
    pool.capacity, pool.max_drafts, pool.head_k_dim, pool.head_v_dim = capacity, max_drafts, head_k_dim, head_v_dim
    pool.channel_gate = channel_gate
    pool.device = device


def on_device(name: str, x: torch.Tensor, device) -> None:
    """ValueError naming ``name`` unless ``x`` is on the pool's ``device``."""
    if not same_device(x.device, torch.device(device)):
        raise ValueError(f"{name}: expected a tensor on the pool's device {device}, got one on {x.device}")


def per_row(name: str, x, slots: torch.Tensor, *, int64: bool = True) -> torch.Tensor:
    """A per-request argument (an int for every row, or an integer tensor [B] with one entry per entry of
    ``slots``, on the slots' device) as an int64 tensor [B] on the slots' device (``int64=False``: a tensor
    is returned in its own integer dtype, unconverted)."""
    if isinstance(x, torch.Tensor):
        if tuple(x.shape) != tuple(slots.shape):
            raise ValueError(f"{name}: expected [B] = [{slots.shape[0]}] (one per entry of slots), got "
                             f"{list(x.shape)}")
        if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
            raise TypeError(f"{name}: expected an integer tensor, got {x.dtype}")
        on_device(name, x, slots.device)
        return x.to(torch.int64) if int64 else x
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int or an integer tensor [B], got {type(x).__name__}")
    return check_count_arg(name, x, slots.shape[0], slots.device, "the int64 range")


def pool_fold(fold, slots: torch.Tensor, device):
    """``verify``'s ``fold`` on a pool: False, True, or a bool tensor [B] (one per entry of ``slots``) on the
    pool's ``device``; returned as ``kvbuffer_ref.checks.check_fold`` returns it."""
    if isinstance(fold, torch.Tensor):
        on_device("fold", fold, device)
    return check_fold(fold, slots.shape[0], device)


def _accepted_lengths(drafts: Drafts, counts, nodes, rows: torch.Tensor) -> list:
    """The accepted path's length per request of ``drafts`` (whose rows are ``rows`` of the call), from
    ``counts`` or ``nodes`` (already checked by ``accept``)."""
    pick = lambda x: [int(x)] * rows.numel() if not isinstance(x, torch.Tensor) else x[rows].tolist()  # noqa: E731
    if counts is not None:
        return pick(counts)
    return [len(path_to(drafts.parents[i], node)) for i, node in enumerate(pick(nodes))]


def head_layout(num_heads: int, num_value_heads: int, head_range: Optional[tuple] = None) -> tuple[int, int, int]:
    """The pool's own heads for a shard of a model with ``num_heads`` q/k heads and ``num_value_heads``
    value heads: ``head_range = (start, stop)`` of the model's value heads (None: all of them).

    Returns (first q/k head, H, HV) of the shard: its value heads ``start..stop-1`` read the q/k heads
    ``start // group .. (stop - 1) // group`` (group = num_value_heads // num_heads), which must split
    them evenly (each local q/k head serving the same number of consecutive local value heads).
    """
    for name, n in (("num_heads", num_heads), ("num_value_heads", num_value_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    if num_value_heads % num_heads:
        raise ValueError(f"num_value_heads: expected a multiple of num_heads={num_heads}, got {num_value_heads}")
    if head_range is None:
        return 0, num_heads, num_value_heads
    if (not isinstance(head_range, (tuple, list)) or len(head_range) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in head_range)):
        raise TypeError(f"head_range: expected (start, stop) value heads as two ints, got {head_range!r}")
    start, stop = head_range
    if not 0 <= start < stop <= num_value_heads:
        raise ValueError(f"head_range: expected 0 <= start < stop <= num_value_heads={num_value_heads}, "
                         f"got {tuple(head_range)}")
    group = num_value_heads // num_heads
    h0, h1 = start // group, (stop - 1) // group + 1
    H, HV = h1 - h0, stop - start
    per = [min(stop, (h + 1) * group) - max(start, h * group) for h in range(h0, h1)]
    if len(set(per)) != 1:
        raise ValueError(f"head_range: value heads {start}..{stop - 1} split the q/k head groups of {group} value "
                         f"heads unevenly ({per} value heads per q/k head {h0}..{h1 - 1}); choose a range that "
                         f"covers whole groups or lies within one")
    return h0, H, HV


def check_slots(name: str, slots, num_slots: int, device, live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``slots``: a [B] int32 / int64 tensor on ``device`` of values in -1..num_slots-1 (-1: a pad), the
    valid ones distinct and (with ``live`` [num_slots] bool) live.  Returns it as int64."""
    require_tensor(name, slots)
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected an int32 or int64 tensor of slot indices, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name}: expected a [B] tensor of slot indices, got shape {list(slots.shape)}")
    on_device(name, slots, device)
    s = slots.to(torch.int64)
    bad = (s < -1) | (s >= num_slots)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}: entry [{b}] is {int(s[b])}, expected a slot in 0..{num_slots - 1} or -1 (a pad)")
    valid = s[s >= 0]
    if valid.numel() != valid.unique().numel():
        vals, counts = valid.unique(return_counts=True)
        raise ValueError(f"{name}: slot {int(vals[counts > 1][0])} appears more than once in one call")
    if live is not None:
        dead = (s >= 0) & ~live[s.clamp(min=0)]
        if bool(dead.any()):
            b = int(dead.nonzero()[0, 0])
            raise ValueError(f"{name}: entry [{b}] is slot {int(s[b])}, which holds no live request (never acquired "
                             f"or released)")
    return s


def admit_state(initial_state, tokens: dict, rows: torch.Tensor):
    """``admit``'s initial states without ``cu_seqlens``: None, or [B, HV, K, V] (one per entry of slots, pads
    included) on q's device, checked against the tokens ``tokens`` (q, k, v, g, beta) before it is indexed;
    returns the rows ``rows`` of it (the valid entries)."""
    if initial_state is None:
        return None
    check_state("initial_state", initial_state, check_tokens(**tokens), tokens["q"].device)
    return initial_state[rows]


def varlen_admit(s: torch.Tensor, tokens: dict, cu_seqlens, initial_state=None):
    """``admit``'s variable-length batch: the prompts of the valid entries.  s: the checked slots [N] (-1 for
    a pad); tokens: q, k, v, g, beta with the N prompts concatenated along T in a batch of one (q
    [1, T, H, K]); cu_seqlens: [N + 1] (``recurrent.check_cu_seqlens``).  Returns (the valid entries'
    prompts gathered along T, their tokens as an int64 index into T on q's device, their offsets [n + 1]
    as a tensor like ``cu_seqlens``, their initial states or None).  A pad's prompt is never read."""

    check_tokens(**tokens)  # the packed tensors' shapes agree before any token is gathered along T
    q = tokens["q"]
    cu = check_cu_seqlens(cu_seqlens, q, initial_state)
    if len(cu) - 1 != s.shape[0]:
        raise ValueError(f"cu_seqlens: expected {s.shape[0] + 1} offsets (one prompt per entry of slots), got "
                         f"{len(cu)}")
    keep = [n for n, b in enumerate(s.tolist()) if b >= 0]
    idx = torch.tensor([t for n in keep for t in range(cu[n], cu[n + 1])], dtype=torch.int64, device=q.device)
    offsets = [0]
    for n in keep:
        offsets.append(offsets[-1] + cu[n + 1] - cu[n])
    s0 = None if initial_state is None else initial_state[torch.tensor(keep, dtype=torch.int64,
                                                                       device=initial_state.device)]
    return ({n: x.index_select(1, idx) for n, x in tokens.items()}, idx,
            torch.tensor(offsets, dtype=cu_seqlens.dtype, device=cu_seqlens.device), s0)


class KVPool:
    """The reference serving pool (see the module docstring for the layout).

    ``layers`` L, ``num_state_slots`` S, ``num_buffer_slots`` N (the most concurrent requests),
    ``capacity`` C, ``max_drafts`` D (the draft room per request); the model's ``num_heads`` q/k heads
    and ``num_value_heads`` value heads, of which the pool holds ``head_range`` (``head_layout``);
    ``head_k_dim`` K, ``head_v_dim`` V.  ``dtype``: the u-cache's and the computation's dtype;
    ``key_dtype`` (default ``dtype``) of the keys; ``state_dtype`` (default ``dtype``) of the states;
    ``gate_dtype`` (default ``dtype``) of the cumulative gates G and dG (float32 with a 16-bit u-cache is
    ``kvbuffer_fast.pool.KVPool``'s layout).  A 16-bit field is stored precision only: the operations read
    it exactly, compute in the tokens' dtype (at least float32) and round once per store.
    """

    def __init__(self, *, layers: int, num_state_slots: int, num_buffer_slots: int, capacity: int,
                 max_drafts: int, num_heads: int, num_value_heads: int, head_k_dim: int, head_v_dim: int,
                 head_range: Optional[tuple] = None, channel_gate: bool = False, dtype: torch.dtype = torch.float64,
                 key_dtype: Optional[torch.dtype] = None, state_dtype: Optional[torch.dtype] = None,
                 gate_dtype: Optional[torch.dtype] = None, device=None):
        set_layout(self, layers=layers, num_state_slots=num_state_slots, num_buffer_slots=num_buffer_slots,
                   capacity=capacity, max_drafts=max_drafts, num_heads=num_heads, num_value_heads=num_value_heads,
                   head_k_dim=head_k_dim, head_v_dim=head_v_dim, head_range=head_range, channel_gate=channel_gate,
                   device=device)
        for name, dt in (("dtype", dtype), ("key_dtype", key_dtype), ("state_dtype", state_dtype),
                         ("gate_dtype", gate_dtype)):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise TypeError(f"{name}: expected a floating-point torch.dtype, got {dt}")
        L, S, N, C, D, K, V = (self.layers, self.num_state_slots, self.num_buffer_slots, self.capacity,
                               self.max_drafts, self.head_k_dim, self.head_v_dim)
        H, HV = self.num_heads, self.num_value_heads
        key_dtype, state_dtype, gate_dtype = key_dtype or dtype, state_dtype or dtype, gate_dtype or dtype
        kw = dict(device=self.device)
        gk = (K,) if channel_gate else ()
        self.state = torch.zeros(L, S, HV, K, V, dtype=state_dtype, **kw)
        self.k = torch.zeros(L, N, C, H, K, dtype=key_dtype, **kw)
        self.u = torch.zeros(L, N, C, HV, V, dtype=dtype, **kw)
        self.G = torch.zeros(L, N, C, HV, *gk, dtype=gate_dtype, **kw)
        self.lengths = torch.zeros(L, N, dtype=torch.int64, **kw)
        self.has_state = torch.zeros(L, N, dtype=torch.bool, **kw)
        self.state_slot = torch.full((L, N), -1, dtype=torch.int64, **kw)
        self.refs = torch.zeros(L, S, dtype=torch.int64, **kw)
        self.dk = torch.zeros(L, N, D, H, K, dtype=key_dtype, **kw)
        self.du = torch.zeros(L, N, D, HV, V, dtype=dtype, **kw)
        self.dG = torch.zeros(L, N, D, HV, *gk, dtype=gate_dtype, **kw)
        self.parents = torch.full((L, N, D), -1, dtype=torch.int64, **kw)
        self.num_drafts = torch.zeros(L, N, dtype=torch.int64, **kw)
        self.pending = torch.zeros(L, N, dtype=torch.bool, **kw)
        self.live = torch.zeros(N, dtype=torch.bool, **kw)

    # ------------------------------------------------------------------ bookkeeping
    def tensors(self) -> dict:
        """{name: tensor} of everything the pool holds (its whole contents)."""
        return {n: getattr(self, n) for n in ("state", "k", "u", "G", "lengths", "has_state", "state_slot", "refs",
                                              "dk", "du", "dG", "parents", "num_drafts", "pending", "live")}

    def acquire(self, n: int) -> torch.Tensor:
        """Reserve ``n`` free buffer slots for new requests ([n] int64, lowest first): live, empty in every
        layer, in direct mode.  ValueError when fewer than n are free (the pool is unchanged)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        free = (~self.live).nonzero().flatten()
        if free.numel() < n:
            raise ValueError(f"n: {n} buffer slots asked for, but only {free.numel()} of {self.num_buffer_slots} are "
                             f"free (release requests or build a larger pool)")
        got = free[:n]
        self.live[got] = True
        self._reset(got)
        return got

    def release(self, slots: torch.Tensor) -> None:
        """End the requests in ``slots`` [B] (-1: pads): their state slots' references are dropped (a slot
        no request references is free) and the buffer slots become free, holding no entry."""
        s = self._valid(check_slots("slots", slots, self.num_buffer_slots, self.device, self.live))
        for layer in range(self.layers):
            self._drop_states(layer, s)
        self._reset(s)
        self.live[s] = False

    def _reset(self, s: torch.Tensor) -> None:
        self.lengths[:, s] = 0
        self.has_state[:, s] = False
        self.state_slot[:, s] = -1
        self.num_drafts[:, s] = 0
        self.pending[:, s] = False

    def _drop_states(self, layer: int, s: torch.Tensor) -> None:
        for b in s.tolist():
            slot = int(self.state_slot[layer, b])
            if slot >= 0:
                self.refs[layer, slot] -= 1
                self.state_slot[layer, b] = -1

    def _new_state_slot(self, layer: int) -> int:
        free = (self.refs[layer] == 0).nonzero().flatten()
        if free.numel() == 0:
            raise ValueError(f"layer {layer}: no free state slot left of {self.num_state_slots} for a request's fold "
                             f"(release requests or build the pool with more state slots)")
        slot = int(free[0])
        self.refs[layer, slot] = 1
        return slot

    def _valid(self, s: torch.Tensor) -> torch.Tensor:
        return s[s >= 0]

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ValueError(f"layer: expected an int in 0..{self.layers - 1}, got {layer!r}")
        return layer

    def _addressed(self, slots, layer) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(layer, slots as int64 [B], the rows of the valid entries)."""
        layer = self._layer(layer)
        s = check_slots("slots", slots, self.num_buffer_slots, self.device, self.live)
        return layer, s, (s >= 0).nonzero().flatten()

    def _tokens(self, name: str, x: torch.Tensor, B: int) -> None:
        require_tensor(name, x)
        if x.dim() < 1 or x.shape[0] != B:
            raise ValueError(f"{name}: expected {B} rows (one per entry of slots), got shape {list(x.shape)}")
        on_device(name, x, self.device)

    def _check_tokens(self, q, k, v, g, beta, B: int) -> None:
        """The token tensors of a call on B rows: B rows each, on the pool's device, of the pool's heads,
        dims and gate kind (``kvbuffer_ref.checks.check_tokens`` for the rest), before anything is read."""
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            self._tokens(name, x, B)
        d = check_tokens(q, k, v, g, beta)
        for name, what, got, want in (("q", "q/k heads H", d.H, self.num_heads),
                                      ("v", "value heads HV", d.HV, self.num_value_heads),
                                      ("q", "key dim K", d.K, self.head_k_dim),
                                      ("v", "value dim V", d.V, self.head_v_dim)):
            if got != want:
                raise ValueError(f"{name}: the pool holds {what} = {want}, got {got}")
        if d.channel_gate != self.channel_gate:
            kind = "per-channel [B, T, HV, K]" if self.channel_gate else "scalar [B, T, HV]"
            raise ValueError(f"g: the pool holds {kind} gates, got shape {list(g.shape)}")

    def _check_free_states(self, layer: int, s: torch.Tensor, folds: torch.Tensor) -> None:
        """Enough free state slots for the requests of ``s`` that fold (``folds`` [n] bool) and need one."""
        need, refs = 0, {}
        for b, f in zip(s.tolist(), folds.tolist()):  # as _scatter takes them: in order
            slot = int(self.state_slot[layer, b])
            if not f:
                continue
            r = refs.get(slot, int(self.refs[layer, slot])) if slot >= 0 else 0
            if slot < 0 or r > 1:
                need += 1
                refs[slot] = r - 1
        free = int((self.refs[layer] == 0).sum())
        if need > free:
            raise ValueError(f"slots: {need} requests fold into a state slot of their own in layer {layer}, but only "
                             f"{free} of {self.num_state_slots} state slots are free")

    # ------------------------------------------------------------------ gather / scatter
    def buffer(self, layer: int, slots: torch.Tensor) -> KVBuffer:
        """The requests in ``slots`` (valid entries only, in order) as a KVBuffer of their own (copies);
        a request without a state slot gets a zero state row (unused: it is in direct mode)."""
        layer = self._layer(layer)
        s = self._valid(check_slots("slots", slots, self.num_buffer_slots, self.device, self.live))
        return self._gather(layer, s)

    def _gather(self, layer: int, s: torch.Tensor) -> KVBuffer:
        slot = self.state_slot[layer, s]
        state = torch.where((slot >= 0)[:, None, None, None], self.state[layer, slot.clamp(min=0)],
                            torch.zeros((), dtype=self.state.dtype, device=self.device))
        return KVBuffer(k=self.k[layer, s].clone(), u=self.u[layer, s].clone(), G=self.G[layer, s].clone(),
                        lengths=self.lengths[layer, s].clone(), has_state=self.has_state[layer, s].clone(),
                        state=state)

    def _scatter(self, layer: int, s: torch.Tensor, buf: KVBuffer, folded: torch.Tensor) -> None:
        """Write ``buf`` (one row per slot of ``s``) back; the states of the ``folded`` rows go to the
        request's own state slot (a free one for a request without one or sharing one: copy-on-write)."""
        self.k[layer, s] = buf.k.detach().to(self.k.dtype)  # stored values: the pool joins no autograd graph
        self.u[layer, s] = buf.u.detach().to(self.u.dtype)
        self.G[layer, s] = buf.G.detach().to(self.G.dtype)
        self.lengths[layer, s] = buf.lengths
        self.has_state[layer, s] = buf.has_state
        for i in folded.nonzero().flatten().tolist():
            b = int(s[i])
            slot = int(self.state_slot[layer, b])
            if slot < 0 or int(self.refs[layer, slot]) > 1:
                if slot >= 0:
                    self.refs[layer, slot] -= 1
                slot = self._new_state_slot(layer)
                self.state_slot[layer, b] = slot
            self.state[layer, slot] = buf.state[i].detach().to(self.state.dtype)

    # ------------------------------------------------------------------ operations
    def admit(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None, tail=None,
              initial_state=None, chunk_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Prefill hand-off of one prompt per entry of ``slots`` (acquired, empty slots) in ``layer``.

        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV]*; beta: [B, T, HV]; initial_state
        [B, HV, K, V] or None; ``tail`` as ``kvbuffer_ref.prefill``.  The head of each prompt is folded
        into a state slot (taken only if the prompt has a head or an initial state), the tail is buffered.
        Returns o [B, T, HV, V] (pad rows: zeros).

        ``cu_seqlens`` ([N + 1] int32 / int64 offsets): prompts of any lengths, as engines batch them: the N
        prompts of the N entries of ``slots`` concatenated along T in a batch of one (q [1, T, H, K], ...,
        initial_state [N, HV, K, V]); ``tail`` None gives each prompt its default tail, an int the same
        for all.  Returns o [1, T, HV, V] (a pad's tokens: zeros; its prompt is not read).
        """
        layer, s, rows = self._addressed(slots, layer)
        tokens = dict(q=q, k=k, v=v, g=g, beta=beta)
        if cu_seqlens is None:
            self._check_tokens(q, k, v, g, beta, s.shape[0])
            x = {n: t[rows] for n, t in tokens.items()}
            s0, varlen = admit_state(initial_state, tokens, rows), {}
        else:
            x, idx, cu, s0 = varlen_admit(s, tokens, cu_seqlens, initial_state)
            self._check_tokens(q, k, v, g, beta, 1)
            varlen = dict(cu_seqlens=cu)
        sv = s[rows]
        busy = (self.lengths[layer, sv] > 0) | self.has_state[layer, sv] | self.pending[layer, sv]
        if bool(busy.any()):
            raise ValueError(f"slots: entry [{int(rows[busy.nonzero()[0, 0]])}] is slot "
                             f"{int(sv[busy.nonzero()[0, 0]])}, which already holds entries or a state in "
                             f"layer {layer}; admit takes freshly acquired slots")
        o_rows, buf = prefill(x.pop("q"), x.pop("k"), x.pop("v"), **x, capacity=self.capacity, tail=tail, scale=scale,
                              initial_state=s0, chunk_size=chunk_size, **varlen)
        self._check_free_states(layer, sv, buf.has_state)
        self._scatter(layer, sv, buf, buf.has_state)
        if cu_seqlens is None:
            o = torch.zeros(s.shape[0], *o_rows.shape[1:], dtype=o_rows.dtype, device=o_rows.device)
            o[rows] = o_rows
        else:
            o = torch.zeros(1, q.shape[1], *o_rows.shape[2:], dtype=o_rows.dtype, device=o_rows.device)
            o[:, idx] = o_rows
        return o

    def _no_pending(self, layer: int, s: torch.Tensor, op: str) -> None:
        pend = self.pending[layer, s]
        if bool(pend.any()):
            raise ValueError(f"slots: slot {int(s[pend.nonzero()[0, 0]])} has verified drafts pending in layer "
                             f"{layer}; accept them (accept(counts=0) rejects all) before {op}")

    def decode(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None) -> torch.Tensor:
        """One token per entry of ``slots`` in ``layer``: q, k [B, 1, H, K]; v [B, 1, HV, V]; g [B, 1, HV]*;
        beta [B, 1, HV].  Returns o [B, 1, HV, V] (pad rows: zeros).  A full request folds first (into a
        state slot of its own)."""
        layer, s, rows = self._addressed(slots, layer)
        self._check_tokens(q, k, v, g, beta, s.shape[0])
        sv = s[rows]
        self._no_pending(layer, sv, "decode")
        buf = self._gather(layer, sv)
        folds = buf.lengths >= self.capacity
        self._check_free_states(layer, sv, folds)
        o_rows, new = buffered_decode(q[rows], k[rows], v[rows], g=g[rows], beta=beta[rows], buffer=buf, scale=scale)
        self._scatter(layer, sv, new, folds)
        o = torch.zeros(s.shape[0], *o_rows.shape[1:], dtype=o_rows.dtype, device=o_rows.device)
        o[rows] = o_rows
        return o

    def verify(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, parents=None, num_drafts=None,
               scale=None, fold=False) -> torch.Tensor:
        """Outputs for D' <= max_drafts drafts per entry of ``slots`` (as ``kvbuffer_ref.verify``: q, k
        [B, D', H, K], ..., parents [B, D'], num_drafts [B]); nothing is committed, the drafts are kept in
        the slots' draft room (pending) for ``accept``.  Returns o [B, D', HV, V] (pad rows: zeros).

        ``fold``: False (default), True, or a bool tensor [B] (one per entry of slots; pads ignored): the
        requests that also fold their whole buffers into their states, as ``kvbuffer_ref.verify(fold=...)``
        does: the call is ``flush`` of those requests followed by this verify (o is the same; the drafts
        are relative to the emptied buffers), and a request that folds entries gets a state slot of its
        own for the result (copy-on-write, as ``flush``)."""
        layer, s, rows = self._addressed(slots, layer)
        B = s.shape[0]
        if fold is not False:
            fold = pool_fold(fold, s, self.device)
        self._check_tokens(q, k, v, g, beta, B)
        Dn = q.shape[1]
        if Dn > self.max_drafts:
            raise ValueError(f"q: {Dn} drafts per request, but the pool's draft room holds max_drafts="
                             f"{self.max_drafts}")
        for name, x in (("parents", parents), ("num_drafts", num_drafts)):
            if x is not None:
                self._tokens(name, x, B)
        sv = s[rows]
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        buf = self._gather(layer, sv)
        out = verify(q[rows], k[rows], v[rows], g=g[rows], beta=beta[rows], buffer=buf, parents=pick(parents),
                     num_drafts=pick(num_drafts), scale=scale, fold=fold if isinstance(fold, bool) else fold[rows])
        o_rows, drafts = out[:2]
        if fold is not False:  # the flushed buffers go back as flush writes them
            folds = out[2].lengths < buf.lengths
            self._check_free_states(layer, sv, folds)
            self._scatter(layer, sv, out[2], folds)
        self.dk[layer, sv, :Dn] = drafts.k.detach().to(self.dk.dtype)
        self.du[layer, sv, :Dn] = drafts.u.detach().to(self.du.dtype)
        self.dG[layer, sv, :Dn] = drafts.G.detach().to(self.dG.dtype)
        self.parents[layer, sv] = -1
        self.parents[layer, sv, :Dn] = drafts.parents
        self.num_drafts[layer, sv] = drafts.num_drafts
        self.pending[layer, sv] = True
        o = torch.zeros(B, *o_rows.shape[1:], dtype=o_rows.dtype, device=o_rows.device)
        o[rows] = o_rows
        return o

    def _drafts(self, layer: int, s: torch.Tensor) -> Drafts:
        """The pending drafts of the slots ``s`` as a Drafts of D = max_drafts rows."""
        return Drafts(k=self.dk[layer, s], u=self.du[layer, s], G=self.dG[layer, s],
                      parents=self.parents[layer, s], num_drafts=self.num_drafts[layer, s])

    def accept(self, *, slots: torch.Tensor, counts=None, nodes=None, layer: Optional[int] = None,
               fold: bool = True) -> None:
        """Commit the drafts ``verify`` left pending in ``slots``: ``counts`` (int or [B] int tensor: the first
        m drafts of a chain) or ``nodes`` (int or [B]: the accepted node, -1 for none), as
        ``kvbuffer_ref.accept``; entries of pad rows are ignored.  A request that passes the capacity folds
        (into a state slot of its own).  ``layer``: an int, or None for every layer (the same counts or
        nodes in each; every layer is checked before any is written).  ``fold=False``: the caller's word
        that no addressed row passes the capacity (``kvbuffer_ref.accept``): ValueError, naming the slot
        and layer, where one does."""
        check_accept_fold(fold)
        layers = range(self.layers) if layer is None else [self._layer(layer)]
        plans = [self._accept_plan(l, slots, counts, nodes, fold) for l in layers]  # checks; writes nothing
        for l, (sv, new, folds) in zip(layers, plans):
            self._scatter(l, sv, new, folds)
            self.pending[l, sv] = False
            self.num_drafts[l, sv] = 0

    def _accept_plan(self, layer: int, slots, counts, nodes, fold: bool = True):
        """accept's checks and results in one layer, nothing written: (valid slots, new buffer, folds)."""
        layer, s, rows = self._addressed(slots, layer)
        sv = s[rows]
        if not bool(self.pending[layer, sv].all()):
            b = int(sv[(~self.pending[layer, sv]).nonzero()[0, 0]])
            raise ValueError(f"slots: slot {b} has no verified drafts pending in layer {layer}; call verify first")
        pick = lambda x: x[rows] if isinstance(x, torch.Tensor) else x  # noqa: E731
        for name, x in (("counts", counts), ("nodes", nodes)):
            if isinstance(x, torch.Tensor):
                self._tokens(name, x, s.shape[0])
        buf, drafts = self._gather(layer, sv), self._drafts(layer, sv)
        new = accept(buf, drafts, counts=pick(counts), nodes=pick(nodes))  # checks the counts / nodes
        ns, ms = buf.lengths.tolist(), _accepted_lengths(drafts, counts, nodes, rows)
        folds = torch.tensor([fold_count(int(n), m, self.capacity) > 0 for n, m in zip(ns, ms)],
                             dtype=torch.bool, device=self.device)
        if not fold:
            for i, (n, m) in enumerate(zip(ns, ms)):
                require_no_fold(f"slot {int(sv[i])} in layer {layer}", int(n), int(m), self.capacity)
        self._check_free_states(layer, sv, folds)
        return sv, new, folds

    def flush(self, *, layer: int, slots: torch.Tensor, count=None) -> None:
        """Fold the first ``count`` entries (None: all; int or [B] int tensor) of each request in ``slots``
        into its state (a state slot of its own for a request that folds any), as ``kvbuffer_ref.flush``."""
        layer, s, rows = self._addressed(slots, layer)
        sv = s[rows]
        self._no_pending(layer, sv, "flush")
        if isinstance(count, torch.Tensor):
            self._tokens("count", count, s.shape[0])
            count = count[rows]
        buf = self._gather(layer, sv)
        new = flush(buf, count=count)  # checks count
        folds = new.lengths < buf.lengths
        self._check_free_states(layer, sv, folds)
        self._scatter(layer, sv, new, folds)

    def fork(self, *, src: torch.Tensor, dst: torch.Tensor, keep) -> None:
        """New requests ``dst`` [B] (acquired, empty slots) sharing a prefix of ``src`` [B] (live slots; -1
        pads in either skip the row): in every layer, the source's state (the same state slot, shared
        copy-on-write) and its first ``keep`` buffered entries (int or [B] int tensor, 0..lengths), i.e. the
        source's tokens up to its last fold plus ``keep``.  Pending drafts are not shared."""
        s = check_slots("src", src, self.num_buffer_slots, self.device, self.live)
        d = check_slots("dst", dst, self.num_buffer_slots, self.device, self.live)
        if s.shape != d.shape:
            raise ValueError(f"dst: expected {s.shape[0]} entries (one per entry of src), got {d.shape[0]}")
        rows = ((s >= 0) & (d >= 0)).nonzero().flatten()
        sv, dv = s[rows], d[rows]
        if bool(torch.isin(dv, sv).any()):
            raise ValueError("dst: a slot is both a source and a destination of one fork")
        kv = per_row("keep", keep, s)[rows]
        busy = ((self.lengths[:, dv] > 0) | self.has_state[:, dv] | self.pending[:, dv]).any(0)
        if bool(busy.any()):
            raise ValueError(f"dst: slot {int(dv[busy.nonzero()[0, 0]])} already holds entries or a state; fork into "
                             f"freshly acquired slots")
        over = (kv[None, :] < 0) | (kv[None, :] > self.lengths[:, sv])
        if bool(over.any()):
            layer, i = (int(x) for x in over.nonzero()[0])
            raise ValueError(f"keep: entry [{int(rows[i])}] is {int(kv[i])}, expected 0..{int(self.lengths[layer, sv[i]])}"
                             f" (the source's buffered entries in layer {layer})")
        for layer in range(self.layers):
            slot = self.state_slot[layer, sv]
            self.state_slot[layer, dv] = slot
            self.refs[layer].index_add_(0, slot[slot >= 0], torch.ones_like(slot[slot >= 0]))
            self.has_state[layer, dv] = self.has_state[layer, sv]
            self.lengths[layer, dv] = kv
            for name in ("k", "u", "G"):
                t = getattr(self, name)
                t[layer, dv] = t[layer, sv]

    def state_of(self, *, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The current state S_n [B, HV, K, V] of each request in ``slots`` (its state slot plus its buffer,
        folded in a copy; pad rows: zeros); the pool is unchanged."""
        layer, s, rows = self._addressed(slots, layer)
        S = materialize_state(self._gather(layer, s[rows]))
        out = torch.zeros(s.shape[0], *S.shape[1:], dtype=S.dtype, device=self.device)
        out[rows] = S
        return out
