"""The serving pool on the GPU: ``kvbuffer_ref.pool.KVPool``'s API and layout, its bookkeeping on the
device, so that every operation but ``admit`` and ``acquire`` can be captured in a CUDA graph and
replayed with new contents and new slot indices.

Layout (docs/pool.md): the reference pool's tensors (``tensors()`` gives them by the same names), each
with one more row behind its slots that no slot addresses (a *sink*: the torch-side scatters send pad
rows there, so they need no host-side filtering).  The operations run kvbuffer_fast's kernels on the
pool, addressed by the slot index tensors as given (int32 or int64; int64 offsets; a pad row's
programs read and write nothing).  Each operation's module owns its slot-addressed launches, which take
one layer of the pool as a ``PoolLayer`` (``KVPool._pool_layer``); this module keeps the bookkeeping
(the state-slot claims and commits, the sink rows, acquire / release / fork) and calls them.  Launches
per call (no torch kernels between them in a capture):

* decode: the state-slot bookkeeping (``_claims_kernel``, ``_commit_kernel``), then
  ``kvbuffer_fast.decode.decode_pool``: decode's fold, decode and bookkeeping launches on the pool;
* verify: verify's two phases on the pool (``kvbuffer_fast.verify.verify_pool``): the rows' buffer
  entries and state slots read, and their drafts written to the slots' draft rooms, by slot index; with
  ``fold``, the state-slot bookkeeping first (the flagged rows that hold entries), whose slots phase 2
  folds into;
* accept: the state-slot bookkeeping (which rows' accepted paths overflow, the lengths), then
  ``kvbuffer_fast.accept.accept_pool``: accept's fold and copy launches;
* flush: the state-slot bookkeeping, then ``kvbuffer_fast.flush.flush_pool``: flush's fold launch (keys
  and gates moved in torch).

``state_of`` and decode at C > 32 (the tile fold) go through a gathered ``KVBuffer``.

State slots are taken on the device (``KVPool._claims``): a row that folds into no state slot, or into
one it shares with a fork (copy-on-write), gets the lowest free slot (``refs == 0``) in its rank among
such rows, and the references move with it, before the folds (which read the slots the bookkeeping
returns).  A row leaving a shared slot has that state copied to its fresh slot first and folds there
in place: the sharer that keeps the slot (every sharer folds in the call) folds it in place in the
same launch, so no fold may read it.  The checks that read device values (slot ranges, duplicates,
live and pending requests, counts, free state slots) run unless a CUDA graph is being captured
(``_common.values_checked``); inside a capture out-of-range values are undefined behaviour, and a fold
that finds no free state slot writes the sink (its result is lost).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.checks import (check_accept_fold, check_counts, check_flush_count, check_nodes, check_scale,
                                 require_int_tensor, require_no_fold, require_tensor)
from kvbuffer_ref.pool import admit_state, check_slots, on_device, per_row, pool_fold, set_layout, varlen_admit

from ._common import (CACHE_DTYPES, STATE_DTYPES, PoolLayer, _pdl_prologue, as_input, block, checked_tokens,
                      device_guard, flag_view, index_input, new_output, pdl_launch, values_checked)
from .accept import accept_pool
from .decode import buffered_decode, decode_pool
from .flush import flush_pool
from .flush import materialize_state as fast_materialize
from .prefill import prefill as fast_prefill
from .launch import Key, check_config, config_for, key_of
from .verify import verify_pool

__all__ = ["KVPool"]

_VIEWS = ("state", "k", "u", "G", "lengths", "has_state", "state_slot", "refs", "dk", "du", "dG", "parents",
          "num_drafts", "pending", "live")


class KVPool:
    """The fast serving pool; arguments as ``kvbuffer_ref.pool.KVPool``.  ``state_dtype``: float32 (the
    default), bfloat16 or float16 (stored rounded once per fold, docs/kernels.md "Reduced-precision state
    and cache"); ``dtype``: the u-cache's, float32 (default), bfloat16 or float16; the cumulative gates
    ``G`` (and the drafts' ``dG``) are always float32.  Slot index tensors are int32 or int64 on the pool's
    device."""

    def __init__(self, *, layers: int, num_state_slots: int, num_buffer_slots: int, capacity: int,
                 max_drafts: int, num_heads: int, num_value_heads: int, head_k_dim: int, head_v_dim: int,
                 head_range: Optional[tuple] = None, channel_gate: bool = False, dtype: torch.dtype = torch.float32,
                 key_dtype: Optional[torch.dtype] = None, state_dtype: torch.dtype = torch.float32, device=None):
        if key_dtype is not None and not (isinstance(key_dtype, torch.dtype) and key_dtype.is_floating_point):
            raise TypeError(f"key_dtype: expected a floating-point torch.dtype, got {key_dtype}")
        for name, dt, allowed in (("state_dtype", state_dtype, STATE_DTYPES), ("dtype", dtype, CACHE_DTYPES)):
            if dt not in allowed:
                raise TypeError(f"{name}: kvbuffer_fast stores it in one of {[str(a) for a in allowed]}, got {dt}")
        set_layout(self, layers=layers, num_state_slots=num_state_slots, num_buffer_slots=num_buffer_slots,
                   capacity=capacity, max_drafts=max_drafts, num_heads=num_heads, num_value_heads=num_value_heads,
                   head_k_dim=head_k_dim, head_v_dim=head_v_dim, head_range=head_range, channel_gate=channel_gate,
                   device=device, least_state_slots=1)
        L, S, N, C, D, K, V = (self.layers, self.num_state_slots, self.num_buffer_slots, self.capacity,
                               self.max_drafts, self.head_k_dim, self.head_v_dim)
        H, HV = self.num_heads, self.num_value_heads
        kw = dict(device=self.device)
        gk = (K,) if channel_gate else ()
        key_dtype = key_dtype or dtype
        self._t = dict(  # one sink row behind the slots of every per-slot tensor
            state=torch.zeros(L, S + 1, HV, K, V, dtype=state_dtype, **kw),
            k=torch.zeros(L, N + 1, C, H, K, dtype=key_dtype, **kw),
            u=torch.zeros(L, N + 1, C, HV, V, dtype=dtype, **kw),
            G=torch.zeros(L, N + 1, C, HV, *gk, dtype=torch.float32, **kw),  # cumulative gates: always fp32
            lengths=torch.zeros(L, N + 1, dtype=torch.int64, **kw),
            has_state=torch.zeros(L, N + 1, dtype=torch.bool, **kw),
            state_slot=torch.full((L, N + 1), -1, dtype=torch.int64, **kw),
            refs=torch.zeros(L, S + 1, dtype=torch.int64, **kw),
            dk=torch.zeros(L, N + 1, D, H, K, dtype=key_dtype, **kw),
            du=torch.zeros(L, N + 1, D, HV, V, dtype=dtype, **kw),
            dG=torch.zeros(L, N + 1, D, HV, *gk, dtype=torch.float32, **kw),
            parents=torch.full((L, N + 1, D), -1, dtype=torch.int64, **kw),
            num_drafts=torch.zeros(L, N + 1, dtype=torch.int64, **kw),
            pending=torch.zeros(L, N + 1, dtype=torch.bool, **kw),
            live=torch.zeros(N + 1, dtype=torch.bool, **kw),
        )
        # _claims_kernel's per-layer counts (zero between calls) and ranks: the pool's own, so that no call
        # (nor a CUDA graph holding it) ever sees it reallocated
        self._claims_scratch = torch.zeros(L, 2 * S + N, dtype=torch.int32, **kw)

    # ------------------------------------------------------------------ views and bookkeeping
    def tensors(self) -> dict:
        """{name: view} of the pool's contents without the sink rows (names as the reference pool's)."""
        out = {}
        for name in _VIEWS:
            t = self._t[name]
            if name == "live":
                out[name] = t[:self.num_buffer_slots]
            elif name in ("state", "refs"):
                out[name] = t[:, :self.num_state_slots]
            else:
                out[name] = t[:, :self.num_buffer_slots]
        return out

    def __getattr__(self, name):
        if name in _VIEWS and "_t" in self.__dict__:
            return self.tensors()[name]
        raise AttributeError(name)

    def acquire(self, n: int) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.acquire`` (host side: reads which slots are free)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        live = self._t["live"]
        free = (~live[:self.num_buffer_slots]).nonzero().flatten()
        if free.numel() < n:
            raise ValueError(f"n: {n} buffer slots asked for, but only {free.numel()} of {self.num_buffer_slots} are "
                             f"free (release requests or build a larger pool)")
        got = free[:n]
        live[got] = True
        self._reset(got)
        return got

    def _reset(self, b: torch.Tensor) -> None:
        t = self._t
        for name, value in (("lengths", 0), ("has_state", False), ("state_slot", -1), ("num_drafts", 0),
                            ("pending", False)):
            t[name].index_fill_(1, b, value)

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ValueError(f"layer: expected an int in 0..{self.layers - 1}, got {layer!r}")
        return layer

    def _rows(self, name: str, slots) -> tuple[torch.Tensor, bool]:
        """(slots as given, int32 or int64, contiguous: the kernels read them; whether values were checked)."""
        require_tensor(name, slots)
        checked = values_checked(slots)
        if checked:
            check_slots(name, slots, self.num_buffer_slots, self.device, self._t["live"][:self.num_buffer_slots])
        elif slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            raise TypeError(f"{name}: expected a [B] int32 or int64 tensor of slot indices, got {slots.dtype} "
                            f"{list(slots.shape)}")
        return as_input(slots), checked

    def _sink(self, s: torch.Tensor) -> torch.Tensor:
        """``s`` as int64 with the pads sent to the sink row N (for torch indexing)."""
        return torch.where(s >= 0, s.to(torch.int64), self.num_buffer_slots)

    def _check_tokens(self, q, k, v, g, beta, s: torch.Tensor, T: Optional[int] = None,
                      num_drafts: Optional[torch.Tensor] = None):
        """The token checks over the valid rows (and, with verify's ``num_drafts`` [B], their drafts below
        it: padding drafts may hold anything); their heads and dims must be the pool's.  Returns (dims, g):
        ``checked_tokens``' sizes and gates."""
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            require_tensor(name, x)
            on_device(name, x, self.device)
            if x.dim() < 2 or x.shape[0] != s.shape[0]:
                raise ValueError(f"{name}: expected {s.shape[0]} rows (one per entry of slots), got shape "
                                 f"{list(x.shape)}")
        valid = (s >= 0)[:, None].expand(s.shape[0], q.shape[1]) if values_checked(s) else None
        if valid is not None and num_drafts is not None:
            valid = valid & (torch.arange(q.shape[1], device=s.device)[None, :] < num_drafts[:, None])
        d, g = checked_tokens(q, k, v, g, beta, valid=valid)
        for name, got, want in (("q", d.H, self.num_heads), ("v", d.HV, self.num_value_heads),
                                ("q", d.K, self.head_k_dim), ("v", d.V, self.head_v_dim)):
            if got != want:
                raise ValueError(f"{name}: the pool holds {want} of that axis (heads or dims), got {got}")
        if d.channel_gate != self.channel_gate:
            raise ValueError(f"g: the pool holds {'per-channel' if self.channel_gate else 'scalar'} gates")
        if T is not None and d.T != T:
            raise ValueError(f"q: expected {T} token(s) per request, got {d.T}")
        return d, g

    def _no_pending(self, layer: int, s: torch.Tensor, op: str) -> None:
        pend = self._t["pending"][layer, self._sink(s)] & (s >= 0)
        if bool(pend.any()):
            raise ValueError(f"slots: slot {int(s[pend.nonzero()[0, 0]])} has verified drafts pending in layer "
                             f"{layer}; accept them (accept(counts=0) rejects all) before {op}")

    def _claims(self, lay: slice, s: torch.Tensor, checked: bool, *, folds: Optional[torch.Tensor] = None,
                accepted: Optional[tuple] = None, verify_fold=None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """The state-slot bookkeeping of a call on the rows ``s`` in the layers of ``lay``, two launches:
        ``_claims_kernel`` decides, ``_commit_kernel`` copies and moves the references (before the folds,
        which read the returned slots, not ``state_slot``).  The rows that fold: ``folds`` ([layers, B]
        bool), else those of ``accepted`` = (name, counts or nodes: an int or [B]) whose accepted path
        overflows the buffer, else those of ``verify_fold`` (verify's ``fold``: True or a checked [B] bool
        tensor) that hold entries, else decode's (a full buffer).  Per layer, a folding row without a state
        slot, or sharing one, gets the lowest free slot in its rank among such rows for its fold's result
        (copy-on-write), except that of a slot all of whose sharers fold in this call the first row keeps
        it: exactly the slots the sequential rule (the reference pool's) leaves with the last of them.  A
        row leaving a shared slot has its state copied to its fresh slot and folds there in place: its
        fold must not read the old slot, which the sharer that keeps it folds in place in the same launch.
        With ``accepted`` the rows' ``pending`` and ``num_drafts`` are cleared too (accept's kernels read
        the draft room, not those).  Returns five values (cur, read, write, node, length): the row's slot
        before the call (-1: none), the slot its fold reads (-1: none, S0 = 0) and the slot it writes
        (non-folding rows: the sink S), [layers, B] int64 each; accept's nodes [B] int64 (pads -1; None
        without ``accepted``); the rows' lengths as the call began ([layers, B] int64; pads 0).  With no
        free slot for every needing row in some layer: a ValueError before anything is written (checked
        calls; unchecked, such a fold writes the sink)."""
        t, N, S = self._t, self.num_buffer_slots, self.num_state_slots
        NL, B, D, l0 = lay.stop - lay.start, s.shape[0], self.max_drafts, lay.start
        dev = s.device
        plan = torch.empty(5, NL, B, dtype=torch.int64, device=dev)
        node = torch.empty(B, dtype=torch.int64, device=dev) if accepted is not None else None
        if B == 0:
            return plan[0], plan[1], plan[2], node, plan[4]
        count = torch.empty(NL, 2, dtype=torch.int64, device=dev)
        rule = 0 if folds is not None else 2 if accepted is not None else 3 if verify_fold is not None else 1
        name, arg = accepted if accepted is not None else (None, 0)
        per_arg = isinstance(arg, torch.Tensor)
        per_row = per_arg or isinstance(verify_fold, torch.Tensor)
        flags = folds.contiguous() if folds is not None else verify_fold if isinstance(verify_fold, torch.Tensor) \
            else None  # the fold flags the rule reads: [layers, B] (rule 0) or [B] (rule 3)
        with device_guard(s):
            _claims_kernel[(NL,)](  # s stands in for the pointers this rule does not read
                s, t["state_slot"][l0], t["refs"][l0], t["lengths"][l0],
                flag_view(flags) if flags is not None else s, t["parents"][l0], arg if per_arg else s,
                0 if per_arg else arg, s if node is None else node, plan, count, self._claims_scratch[l0], B, NL, N,
                S, D,
                C=self.capacity, RULE=rule, PER_ROW=per_row, COUNTS=name == "counts", BB=block(B, 2),
                BD=block(D, 2), BS=min(block(S, 2), 4096), num_warps=4, **pdl_launch(s, True))
        if checked:
            short = count[:, 0] > count[:, 1]
            if bool(short.any()):
                i = int(short.nonzero()[0, 0])
                raise ValueError(f"slots: {int(count[i, 0])} requests fold into a state slot of their own in layer "
                                 f"{l0 + i}, but only {int(count[i, 1])} of {S} state slots are free")
        E = self.num_value_heads * self.head_k_dim * self.head_v_dim
        BLOCK = min(4096, block(E))
        with device_guard(s):
            _commit_kernel[(triton.cdiv(E, BLOCK), NL)](
                s, t["state_slot"][l0], t["refs"][l0], t["state"][l0], plan, flag_view(t["pending"][l0]),
                t["num_drafts"][l0], B, NL, N, S, E=E, BLOCK=BLOCK, BB=block(B, 2), ACCEPT=accepted is not None,
                **pdl_launch(s, True))
        return plan[0], plan[1], plan[2], node, plan[4]

    # ------------------------------------------------------------------ gather / scatter
    def _gather(self, layer: int, bs: torch.Tensor, cur: Optional[torch.Tensor] = None) -> KVBuffer:
        t, S = self._t, self.num_state_slots
        if cur is None:
            cur = t["state_slot"][layer, bs]
        return KVBuffer(k=t["k"][layer, bs], u=t["u"][layer, bs], G=t["G"][layer, bs], lengths=t["lengths"][layer, bs],
                        has_state=t["has_state"][layer, bs], state=t["state"][layer, torch.where(cur >= 0, cur, S)])

    def _scatter(self, layer: int, bs: torch.Tensor, buf: KVBuffer, write: torch.Tensor) -> None:
        """Write ``buf`` back to the rows ``bs``; its states only where ``write`` is a slot (else the sink)."""
        t = self._t
        for name in ("k", "u", "G", "lengths", "has_state"):
            t[name][layer, bs] = getattr(buf, name)
        t["state"][layer, write] = buf.state

    def _pool_layer(self, layer: int, s: torch.Tensor) -> PoolLayer:
        """Layer ``layer`` of the pool (sink rows included) as the operations' slot-addressed launches take
        it, for the call rows ``s``."""
        t = self._t
        rows = KVBuffer(k=t["k"][layer], u=t["u"][layer], G=t["G"][layer], lengths=t["lengths"][layer],
                        has_state=t["has_state"][layer], state=None)
        room = Drafts(parents=t["parents"][layer], num_drafts=t["num_drafts"][layer], k=t["dk"][layer],
                      u=t["du"][layer], G=t["dG"][layer])
        return PoolLayer(slots=s, buffer=rows, state=t["state"][layer], state_slot=t["state_slot"][layer], room=room,
                         pending=t["pending"][layer])

    def _padded_tokens(self, s: torch.Tensor, **x) -> dict:
        """Token tensors with the pad rows zeroed (the gathered sink rows compute on finite values)."""
        keep = s >= 0
        return {n: torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype,
                                                                                     device=t.device))
                for n, t in x.items()}

    # ------------------------------------------------------------------ operations
    def admit(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None, tail=None,
              initial_state=None, chunk_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.admit`` (``cu_seqlens``: prompts of any lengths concatenated in a
        batch of one, a pad's prompt not read; o [1, T, HV, V], a pad's tokens unspecified): the prompts
        through ``kvbuffer_fast.prefill`` (the chunk kernels; the tail written into the buffer rows in the
        u-cache form), then scattered into the slots (not capturable in a CUDA graph: prompts vary in
        length)."""
        layer = self._layer(layer)
        s, _ = self._rows("slots", slots)
        rows = (s >= 0).nonzero().flatten()
        t = self._t
        sv = s[rows].to(torch.int64)
        tokens = dict(q=q, k=k, v=v, g=g, beta=beta)
        if cu_seqlens is None:
            self._check_tokens(q, k, v, g, beta, s)
            x = {n: y[rows] for n, y in tokens.items()}
            s0, varlen = admit_state(initial_state, tokens, rows), {}
        else:
            x, idx, cu, s0 = varlen_admit(s.to(torch.int64), tokens, cu_seqlens, initial_state)
            self._check_tokens(*x.values(), torch.zeros(1, dtype=torch.int64, device=s.device))
            varlen = dict(cu_seqlens=cu)
        busy = (t["lengths"][layer, sv] > 0) | t["has_state"][layer, sv] | t["pending"][layer, sv]
        if bool(busy.any()):
            i = int(rows[busy.nonzero()[0, 0]])
            raise ValueError(f"slots: entry [{i}] is slot {int(s[i])}, which already holds entries or a state in "
                             f"layer {layer}; admit takes freshly acquired slots")
        o_rows, buf = fast_prefill(x.pop("q"), x.pop("k"), x.pop("v"), **x, capacity=self.capacity, tail=tail,
                                   scale=scale, initial_state=s0, chunk_size=chunk_size, **varlen)
        buf = buf.replace(state=buf.state.to(t["state"].dtype), u=buf.u.to(t["u"].dtype), G=buf.G.to(t["G"].dtype),
                          k=buf.k.to(t["k"].dtype))
        write = self._claims(slice(layer, layer + 1), sv, True, folds=buf.has_state[None])[2]
        self._scatter(layer, sv, buf, write[0])
        if cu_seqlens is None:
            o = new_output((s.shape[0],) + tuple(o_rows.shape[1:]), v.dtype, q.device)
            o[rows] = o_rows.to(v.dtype)
        else:
            o = new_output((1, q.shape[1]) + tuple(o_rows.shape[2:]), v.dtype, q.device)
            o[:, idx] = o_rows.to(v.dtype)
        return o

    def decode(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None, config=None) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.decode``: o [B, 1, HV, V] (pad rows: unspecified).  The two
        launches of the state-slot bookkeeping (``_claims``), then three on the pool (fold, decode,
        bookkeeping) addressed by slot index (``kvbuffer_fast.decode.decode_pool``); past the grouped fold
        (C > 32, or a config's tile fold) through a gathered KVBuffer."""
        layer = self._layer(layer)
        s, checked = self._rows("slots", slots)
        d, g = self._check_tokens(q, k, v, g, beta, s, T=1)
        if checked:
            self._no_pending(layer, s, "decode")
        C = self.capacity
        sc = check_scale(scale, d.K)
        if config is None:
            config = config_for("decode", key_of(q, C=C, B=d.B, HV=d.HV, V=d.V, channel=d.channel_gate,
                                                 state=self.state.dtype))
        cfg = check_config("decode", config)
        if cfg.fold != "group" or C > 32:
            return self._decode_gathered(q, k, v, g, beta, layer, s, checked, sc, cfg)
        cur, read, write, _, _ = self._claims(slice(layer, layer + 1), s, checked)
        return decode_pool(q, k, v, g, beta, self._pool_layer(layer, s), current=cur[0], read=read[0],
                           write=write[0], scale=sc, config=cfg)

    def _decode_gathered(self, q, k, v, g, beta, layer, s, checked, scale, cfg):
        """Decode through a gathered KVBuffer (capacities past the grouped fold's 32 rows)."""
        cur, _, write, _, _ = self._claims(slice(layer, layer + 1), s, checked)
        bs = self._sink(s)
        buf = self._gather(layer, bs, cur[0])
        x = self._padded_tokens(s, q=q, k=k, v=v, g=g, beta=beta)
        o, buf = buffered_decode(x.pop("q"), x.pop("k"), x.pop("v"), **x, buffer=buf, scale=scale, config=cfg)
        self._scatter(layer, bs, buf, write[0])
        return o

    def verify(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, parents=None, num_drafts=None,
               scale=None, config=None, fold=False) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.verify`` (pad rows: unspecified outputs); the drafts go to the
        slots' draft room, pending.  The two launches of ``kvbuffer_fast.verify`` addressing the pool
        (``kvbuffer_fast.verify.verify_pool``): the buffer rows, state slots and draft rooms read and
        written in place by slot index, nothing gathered or copied.

        ``fold`` (False, True or a bool tensor [B]): as the reference's; the state-slot bookkeeping's two
        launches (``_claims``: a folding row without a state slot, or sharing one, gets a fresh one, the
        shared state copied: copy-on-write) run first, then the two phases, whose phase 2 folds the rows'
        buffered entries into those slots as it streams the states (``kvbuffer_fast.verify``)."""
        layer = self._layer(layer)
        s, checked = self._rows("slots", slots)
        if fold is not False:
            fold = pool_fold(fold, s, self.device)
        if num_drafts is not None:
            require_int_tensor("num_drafts", num_drafts, tuple(s.shape), "[B]", self.device)
        d, g = self._check_tokens(q, k, v, g, beta, s, num_drafts=num_drafts)
        if d.T > self.max_drafts:
            raise ValueError(f"q: {d.T} drafts per request, but the pool's draft room holds max_drafts="
                             f"{self.max_drafts}")
        if parents is not None:
            require_int_tensor("parents", parents, (d.B, d.T), "[B, D]", self.device)

        def claim() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            _, read, write, _, n = self._claims(slice(layer, layer + 1), s, checked, verify_fold=fold)
            return read[0], write[0], n[0]
        return verify_pool(q, k, v, g, beta, self._pool_layer(layer, s), parents, num_drafts, scale, config,
                           fold=fold, claim=claim)

    def accept(self, *, slots: torch.Tensor, counts=None, nodes=None, layer: Optional[int] = None,
               fold: bool = True, config=None) -> None:
        """As ``kvbuffer_ref.pool.KVPool.accept`` (entries of pad rows are ignored): the state-slot
        bookkeeping's two launches (``_claims``: which rows' accepted paths overflow, their slots, the
        lengths as the call began), then the fold launch and the copy launch of ``kvbuffer_fast.accept`` on the
        pool (``kvbuffer_fast.accept.accept_pool``), addressed by slot index (the drafts are read from the slots' draft room, or from the buffer rows
        verify wrote them to); the copy reads n from that snapshot.  ``layer``: an int, or None for every layer
        at once (the same counts or nodes; each launch then covers all layers, one grid axis per layer).
        ``fold=False``: the caller's word that no addressed row passes the capacity (``kvbuffer_fast.accept``),
        so the fold launch is not made; checked calls raise ValueError, naming the slot and layer, where one
        does (while a CUDA graph is captured that is not checked)."""
        check_accept_fold(fold)
        lay = slice(0, self.layers) if layer is None else slice(self._layer(layer), self._layer(layer) + 1)
        s, checked = self._rows("slots", slots)
        t = self._t
        if checked:
            bs = self._sink(s)
            pend = t["pending"][lay][:, bs] | (s < 0)
            if not bool(pend.all()):
                i, b = (int(v) for v in (~pend).nonzero()[0])
                raise ValueError(f"slots: slot {int(s[b])} has no verified drafts pending in layer {lay.start + i}; "
                                 f"call verify first")
        if (counts is None) == (nodes is None):
            raise ValueError("accept: give exactly one of counts= (chain drafts) or nodes= (tree drafts)")
        name, x = ("counts", counts) if counts is not None else ("nodes", nodes)
        # an int reaches the claims kernel as a scalar; a tensor as a contiguous int32 or int64 [B] as given (the
        # kernel reads either at unit stride: a strided or expanded view is copied, other integer dtypes converted)
        arg = x if type(x) is int else index_input(per_row(name, x, s, int64=False))
        D = self.max_drafts
        if checked:  # the counts / nodes against each layer's verified drafts (kvbuffer_ref.checks)
            x = torch.where(s >= 0, per_row(name, x, s), 0 if counts is not None else -1)  # pads: accept none
            nd = torch.where(s >= 0, t["num_drafts"][lay][:, bs], 0)     # [layers, B]
            par = t["parents"][lay][:, bs]                                # [layers, B, D]
            for i in range(nd.shape[0]):
                if counts is not None:
                    chain = torch.arange(-1, D - 1, device=par.device)
                    is_chain = ((par[i] == chain[None, :]) |
                                (torch.arange(D, device=par.device)[None, :] >= nd[i][:, None])).all(1)
                    check_counts(x, nd[i], is_chain)
                else:
                    check_nodes(x, nd[i])
            if not fold:
                self._require_no_fold(lay, s, bs, x, par, counts is not None)
        _, read, write, node, length = self._claims(lay, s, checked, accepted=(name, arg))
        accept_pool(self._pool_layer(lay.start, s), nodes=node, read=read, write=write, lengths=length,
                    layers=lay.stop - lay.start, fold=fold, config=config)

    def _require_no_fold(self, lay: slice, s: torch.Tensor, bs: torch.Tensor, x: torch.Tensor, par: torch.Tensor,
                         is_count: bool) -> None:
        """``accept(fold=False)``'s condition in the layers of ``lay``: every valid row's length plus its
        accepted path's (``x``: the counts, or the nodes with pads -1, [B]; ``par`` [layers, B, D] the rows'
        parents) fits the capacity; ValueError naming the first slot and layer that does not."""
        n = torch.where(s >= 0, self._t["lengths"][lay][:, bs].long(), 0)  # [layers, B]
        if is_count:
            m = x.long()[None, :].expand_as(n)
        else:  # walk each accepted node to the root (at most D steps)
            node = x.long()[None, :].expand_as(n).clone()
            m = torch.zeros_like(n)
            for _ in range(par.shape[-1]):
                on = node >= 0
                m += on.long()
                node = torch.where(on, par.long().gather(-1, node.clamp(min=0)[..., None])[..., 0], -1)
        over = (n + m > self.capacity) & (s >= 0)[None, :]
        if bool(over.any()):
            i, b = (int(v) for v in over.nonzero()[0])
            require_no_fold(f"slot {int(s[b])} in layer {lay.start + i}", int(n[i, b]), int(m[i, b]), self.capacity)

    def flush(self, *, layer: int, slots: torch.Tensor, count=None, config=None) -> None:
        """As ``kvbuffer_ref.pool.KVPool.flush`` (entries of pad rows are ignored): the state-slot
        bookkeeping's two launches (``_claims``), then ``kvbuffer_fast.flush.flush_pool``: one launch on
        the pool addressed by slot index (the state fold and the u columns), the keys and gates of the
        addressed rows moved in torch."""
        layer = self._layer(layer)
        s, checked = self._rows("slots", slots)
        if checked:
            self._no_pending(layer, s, "flush")
        t, bs = self._t, self._sink(s)
        n = t["lengths"][layer, bs]
        c = torch.where(s >= 0, n if count is None else per_row("count", count, s), 0)
        c = check_flush_count(c, n, checked)  # 0..lengths
        folds = (s >= 0) & (c > 0)
        cfg = check_config("flush", config_for("flush", Key()) if config is None else config)
        if s.shape[0] == 0:
            return
        _, read, write, _, _ = self._claims(slice(layer, layer + 1), s, checked, folds=folds[None])
        flush_pool(self._pool_layer(layer, s), count=c, lengths=n, read=read[0], write=write[0], config=cfg)

    def fork(self, *, src: torch.Tensor, dst: torch.Tensor, keep) -> None:
        """As ``kvbuffer_ref.pool.KVPool.fork``: the state slot is shared (copy-on-write), the first ``keep``
        buffered entries copied (the whole buffer rows are, C entries)."""
        s, checked = self._rows("src", src)
        d, _ = self._rows("dst", dst)
        if s.shape != d.shape:
            raise ValueError(f"dst: expected {s.shape[0]} entries (one per entry of src), got {d.shape[0]}")
        valid = (s >= 0) & (d >= 0)
        N, S, t = self.num_buffer_slots, self.num_state_slots, self._t
        ss, ds = (torch.where(valid, x.to(torch.int64), N) for x in (s, d))
        kv = per_row("keep", keep, s)
        if checked:
            if bool(torch.isin(d[valid], s[valid]).any()):
                raise ValueError("dst: a slot is both a source and a destination of one fork")
            busy = ((t["lengths"][:, ds] > 0) | t["has_state"][:, ds] | t["pending"][:, ds]).any(0) & valid
            if bool(busy.any()):
                raise ValueError(f"dst: slot {int(d[busy.nonzero()[0, 0]])} already holds entries or a state; fork "
                                 f"into freshly acquired slots")
            over = ((kv[None, :] < 0) | (kv[None, :] > t["lengths"][:, ss])) & valid[None, :]
            if bool(over.any()):
                layer, i = (int(x) for x in over.nonzero()[0])
                raise ValueError(f"keep: entry [{i}] is {int(kv[i])}, expected 0..{int(t['lengths'][layer, ss[i]])} "
                                 f"(the source's buffered entries in layer {layer})")
        slot = t["state_slot"][:, ss]                                  # [L, B]
        t["state_slot"][:, ds] = slot
        t["refs"].scatter_add_(1, torch.where((slot >= 0) & valid, slot, S), torch.ones_like(slot))
        t["has_state"][:, ds] = t["has_state"][:, ss]
        t["lengths"][:, ds] = torch.where(valid, kv, 0).expand(self.layers, -1)  # the sink keeps lengths in 0..C
        for name in ("k", "u", "G"):
            t[name][:, ds] = t[name][:, ss]

    def release(self, slots: torch.Tensor) -> None:
        """As ``kvbuffer_ref.pool.KVPool.release``."""
        s, _ = self._rows("slots", slots)
        t, S, bs = self._t, self.num_state_slots, self._sink(s)
        slot = t["state_slot"][:, bs]
        t["refs"].scatter_add_(1, torch.where((slot >= 0) & (s >= 0), slot, S), -torch.ones_like(slot))
        self._reset(bs)
        t["live"].index_fill_(0, bs, False)

    def state_of(self, *, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.state_of`` (pad rows: zeros)."""
        layer = self._layer(layer)
        s, _ = self._rows("slots", slots)
        S = fast_materialize(self._gather(layer, self._sink(s)))
        return torch.where((s >= 0).view(-1, 1, 1, 1), S, torch.zeros((), dtype=S.dtype, device=S.device))


@triton.jit
def _copy_block(src_ptr, dst_ptr, n, i_p, BLOCK: tl.constexpr):
    """Copy block ``i_p`` (BLOCK elements, int64 offsets) of the n elements at ``src_ptr`` to ``dst_ptr``
    (converted to its dtype)."""
    o = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(dst_ptr + o, tl.load(src_ptr + o, mask=m).to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _claims_kernel(slot_ptr, sslot_ptr, refs_ptr, len_ptr, fold_ptr, par_ptr, arg_ptr, arg, node_ptr, plan_ptr,
                   count_ptr, scratch_ptr, B, NL, N, S, D,
                   C: tl.constexpr, RULE: tl.constexpr, PER_ROW: tl.constexpr, COUNTS: tl.constexpr,
                   BB: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (layers,): ``KVPool._claims`` of layer ``program_id(0)`` (after the call's first; N buffer
    and S state slots per layer, each tensor with its sink row) for the B call rows ``slot`` (-1: a pad),
    in registers.  Which rows fold (RULE): 0, ``fold[layer, i]`` (uint8); 1, decode's (a full buffer);
    2, accept's (the accepted path overflows the buffer: the node ``arg[i]``, or the int ``arg`` for
    every row without PER_ROW, minus 1 with COUNTS; the rows' nodes (pads: -1) go to ``node``); 3,
    verify's fold (the rows flagged by ``fold[i]``, every row without PER_ROW, that hold entries).
    Writes ``plan`` [5, layers, B] (current slot, read slot, write slot, need, the row's length) and ``count`` [layers, 2]
    (rows that need a fresh slot, free slots).  The sharers of a slot that fold are counted in the
    int32 ``scratch`` ([layers, 2 S + N], zero between calls: reset here), and so is the first of them
    (``B - max(B - row)``); the fresh slots go out by rank (the rank-th needing row, kept in the scratch,
    gets the rank-th free slot).  Scratch and plan values that other threads wrote are read at L2.
    PDL: a programmatic dependent launch (it waits for the kernel before it first)."""
    _pdl_prologue(PDL)
    i_l = tl.program_id(0).to(tl.int64)
    sslot_ptr += i_l * (N + 1)
    len_ptr += i_l * (N + 1)
    refs_ptr += i_l * (S + 1)
    scratch_ptr += i_l * (2 * S + N)
    o_b = tl.arange(0, BB)
    m_b = o_b < B
    slot = tl.load(slot_ptr + o_b, mask=m_b, other=-1).to(tl.int64)
    valid = slot >= 0
    cur = tl.load(sslot_ptr + slot, mask=valid, other=-1).to(tl.int64)
    n = tl.load(len_ptr + slot, mask=valid, other=0)
    tl.store(plan_ptr + (4 * NL + i_l) * B + o_b, n.to(tl.int64), mask=m_b)  # the lengths as the call began
    if RULE == 0:
        folds = valid & (tl.load(fold_ptr + i_l * B + o_b, mask=m_b, other=0) != 0)
    elif RULE == 1:
        folds = valid & (n >= C)
    elif RULE == 3:
        folds = valid & (n > 0)
        if PER_ROW:
            folds = folds & (tl.load(fold_ptr + o_b, mask=m_b, other=0) != 0)
    else:
        if PER_ROW:
            x = tl.load(arg_ptr + o_b, mask=valid, other=0).to(tl.int32)
        else:
            x = tl.zeros([BB], dtype=tl.int32) + arg
        if COUNTS:
            x -= 1
        node = tl.where(valid, x, -1).to(tl.int32)  # int32 through the walk below
        if i_l == 0:
            tl.store(node_ptr + o_b, node.to(node_ptr.dtype.element_ty), mask=m_b)
        o_d = tl.arange(0, BD)
        par = tl.load(par_ptr + (i_l * (N + 1) + slot[:, None]) * D + o_d[None, :],
                      mask=valid[:, None] & (o_d < D)[None, :], other=-1).to(tl.int32)
        m = tl.zeros([BB], dtype=tl.int32)
        for _ in range(D):  # the path's length: up the parents from the node
            on = node >= 0
            m += on.to(tl.int32)
            node = tl.where(on, tl.sum(tl.where(o_d[None, :] == node[:, None], par, 0), 1), -1)
        folds = valid & (n + m > C)
    shared = folds & (cur >= 0)
    at = tl.where(shared, cur, 0)
    tl.atomic_add(scratch_ptr + at, 1, mask=shared)
    tl.atomic_max(scratch_ptr + S + at, B - o_b, mask=shared)
    tl.debug_barrier()
    folders = tl.load(scratch_ptr + at, mask=shared, other=0, cache_modifier=".cg")
    first = B - tl.load(scratch_ptr + S + at, mask=shared, other=0, cache_modifier=".cg")
    refs = tl.load(refs_ptr + at, mask=shared, other=0)
    keeps = shared & (refs == folders) & (first == o_b)
    need = folds & ~keeps
    tl.debug_barrier()  # every row has read the counts: zero them for the next call
    tl.store(scratch_ptr + at, 0, mask=shared)
    tl.store(scratch_ptr + S + at, 0, mask=shared)
    rank_ptr = scratch_ptr + 2 * S  # ranks 1..n_need <= N: the valid rows are distinct slots
    rank = tl.cumsum(need.to(tl.int32), 0)
    n_need = tl.sum(need.to(tl.int32), 0)
    tl.store(rank_ptr + rank - 1, o_b, mask=need)
    write_ptr = plan_ptr + (2 * NL + i_l) * B
    tl.store(write_ptr + o_b, tl.where(keeps, cur, S), mask=m_b)  # needing rows: S unless a slot is free
    tl.debug_barrier()
    free = tl.zeros([], dtype=tl.int32)
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        fr = (tl.load(refs_ptr + o_s, mask=o_s < S, other=1) == 0).to(tl.int32)
        r = free + tl.cumsum(fr, 0)
        take = (fr != 0) & (r <= n_need)
        row = tl.load(rank_ptr + r - 1, mask=take, other=0, cache_modifier=".cg")
        tl.store(write_ptr + row, o_s.to(tl.int64), mask=take)
        free += tl.sum(fr, 0)
    tl.debug_barrier()
    write = tl.load(write_ptr + o_b, mask=m_b, other=S, cache_modifier=".cg")
    tl.store(plan_ptr + i_l * B + o_b, cur, mask=m_b)
    tl.store(plan_ptr + (NL + i_l) * B + o_b, tl.where(need & (cur >= 0), write, cur), mask=m_b)
    tl.store(plan_ptr + (3 * NL + i_l) * B + o_b, need.to(tl.int64), mask=m_b)
    tl.store(count_ptr + 2 * i_l, n_need.to(tl.int64))
    tl.store(count_ptr + 2 * i_l + 1, free.to(tl.int64))


@triton.jit
def _commit_kernel(slot_ptr, sslot_ptr, refs_ptr, state_ptr, plan_ptr, pend_ptr, nd_ptr, B, NL, N, S,
                   E: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr, ACCEPT: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Grid (E / BLOCK, layers), after ``_claims_kernel``: in layer ``program_id(1)``, copy block
    ``program_id(0)`` of the state of every row that leaves a shared slot (``need`` with a current slot)
    to its fresh slot (E = HV K V elements per slot); program 0 moves the rows' references (``refs``,
    ``state_slot``) to their write slots and, with ACCEPT, clears their ``pending`` / ``num_drafts``.
    PDL: as ``_claims_kernel``'s."""
    _pdl_prologue(PDL)
    i_p = tl.program_id(0)
    i_l = tl.program_id(1).to(tl.int64)
    o_b = tl.arange(0, BB)
    m_b = o_b < B
    cur = tl.load(plan_ptr + i_l * B + o_b, mask=m_b, other=-1)
    write = tl.load(plan_ptr + (2 * NL + i_l) * B + o_b, mask=m_b, other=S)
    need = tl.load(plan_ptr + (3 * NL + i_l) * B + o_b, mask=m_b, other=0) != 0
    copies = need & (cur >= 0)
    state_ptr += i_l * (S + 1) * E
    i = tl.full([], -1, dtype=tl.int32)
    for _ in range(tl.sum(copies.to(tl.int32), 0)):  # the copying rows, in order
        i = tl.min(tl.where(copies & (o_b > i), o_b, BB), 0)
        src = tl.sum(tl.where(o_b == i, cur, 0), 0)
        dst = tl.sum(tl.where(o_b == i, write, 0), 0)
        _copy_block(state_ptr + src * E, state_ptr + dst * E, E, i_p, BLOCK)
    if i_p == 0:
        slot = tl.load(slot_ptr + o_b, mask=m_b, other=-1).to(tl.int64)
        valid = slot >= 0
        refs_ptr += i_l * (S + 1)
        tl.atomic_add(refs_ptr + tl.where(copies, cur, 0), -1, mask=copies)
        tl.atomic_add(refs_ptr + write, 1, mask=need)  # S (the sink) when no slot was free
        row = i_l * (N + 1) + slot
        tl.store(sslot_ptr + row, tl.where(need, write, cur), mask=valid)
        if ACCEPT:
            tl.store(pend_ptr + row, 0, mask=valid)
            tl.store(nd_ptr + row, 0, mask=valid)
