"""The serving pool on the GPU: ``kvbuffer_ref.pool.KVPool``'s API and layout, its bookkeeping on the
device, so that every operation but ``admit`` and ``acquire`` can be captured in a CUDA graph and
replayed with new contents and new slot indices.

Layout (docs/pool.md): the reference pool's tensors (``tensors()`` gives them by the same names), each
with one more row behind its slots that no slot addresses (a *sink*: the bookkeeping's scatters send
pad rows there, so they need no host-side filtering).  The operations run kvbuffer_fast's kernels on the
pool, addressed by slot index tensors (int64 offsets; a pad row's programs read and write nothing):
decode's fold, decode and bookkeeping launches (``_fold_group_slots_kernel``, ``_decode_slots_kernel``,
``_book_slots_kernel``), accept's fold and copy launches, flush's fold launch (keys and gates moved in
torch), verify's phase 2 reading the states from the slots (its phase 1 and outputs on the addressed
rows' buffer entries, gathered).  ``state_of`` and decode at C > 32 (the tile fold) go through a gathered
``KVBuffer``.

State slots are taken on the device: a row that folds into no state slot, or into one it shares with
a fork (copy-on-write), gets the lowest free slot (``refs == 0``) in its rank among such rows, and the
references move with it.  A row leaving a shared slot has that state copied to its fresh slot by one
launch before the fold (``_copy_slots_kernel``) and folds there in place: the sharer that keeps the
slot (every sharer folds in the call) folds it in place in the same launch, so no fold may read it.  The checks that
read device values (slot ranges, duplicates, live and pending requests, counts, free state slots) run
unless a CUDA graph is being captured (``_common.values_checked``); inside a capture out-of-range
values are undefined behaviour, and a fold that finds no free state slot writes the sink (its result
is lost).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import (check_counts, check_flush_count, check_nodes, check_scale, require_int_tensor,
                                 require_tensor)
from kvbuffer_ref.pool import check_slots, on_device, per_row, set_layout

from . import decode as _decode
from ._common import (CACHE_DTYPES, STATE_DTYPES, as_input, block, checked_tokens, device_guard, flag_view,
                      new_output, pdl_launch, ticket_counters, values_checked)
from .accept import _accept_fold_slots_kernel, _accept_slots_kernel
from .flush import _flush_slots_kernel, _shift_keys_and_gates
from .flush import materialize_state as fast_materialize
from .prefill import prefill as fast_prefill
from .launch import Key, check_config, config_for, key_of
from .verify import _verify

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

    def _rows(self, name: str, slots) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(slots as int64, the same with pads sent to the sink row N, whether values were checked)."""
        require_tensor(name, slots)
        checked = values_checked(slots)
        if checked:
            check_slots(name, slots, self.num_buffer_slots, self.device, self._t["live"][:self.num_buffer_slots])
        elif slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            raise TypeError(f"{name}: expected a [B] int32 or int64 tensor of slot indices, got {slots.dtype} "
                            f"{list(slots.shape)}")
        s = slots.to(torch.int64)
        return s, torch.where(s >= 0, s, self.num_buffer_slots), checked

    def _check_tokens(self, q, k, v, g, beta, s: torch.Tensor, T: Optional[int] = None):
        """The token checks over the valid rows; their heads and dims must be the pool's.  Returns g."""
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            require_tensor(name, x)
            on_device(name, x, self.device)
            if x.dim() < 2 or x.shape[0] != s.shape[0]:
                raise ValueError(f"{name}: expected {s.shape[0]} rows (one per entry of slots), got shape "
                                 f"{list(x.shape)}")
        d, g = checked_tokens(q, k, v, g, beta, valid=(s >= 0)[:, None].expand(s.shape[0], q.shape[1]))
        for name, got, want in (("q", d.H, self.num_heads), ("v", d.HV, self.num_value_heads),
                                ("q", d.K, self.head_k_dim), ("v", d.V, self.head_v_dim)):
            if got != want:
                raise ValueError(f"{name}: the pool holds {want} of that axis (heads or dims), got {got}")
        if d.channel_gate != self.channel_gate:
            raise ValueError(f"g: the pool holds {'per-channel' if self.channel_gate else 'scalar'} gates")
        if T is not None and d.T != T:
            raise ValueError(f"q: expected {T} token(s) per request, got {d.T}")
        return d, g

    def _no_pending(self, layer: int, bs: torch.Tensor, s: torch.Tensor, op: str) -> None:
        pend = self._t["pending"][layer, bs] & (s >= 0)
        if bool(pend.any()):
            raise ValueError(f"slots: slot {int(s[pend.nonzero()[0, 0]])} has verified drafts pending in layer "
                             f"{layer}; accept them (accept(counts=0) rejects all) before {op}")

    def _claims(self, lay: slice, bs: torch.Tensor, folds: torch.Tensor, checked: bool):
        """(current slot, write slot, need), each [layers of ``lay``, B], for the rows that ``folds``
        ([layers, B]): per layer, a row without a state slot, or sharing one, gets a fresh slot (``need``)
        for its fold's result, except that of a slot all of whose sharers fold in this call the first row
        keeps it; the others write their own (non-folding rows: the sink).  The rows that take a slot from
        a sharer read it through ``_copy_on_write``.  With no free slot for every such row in some layer:
        a ValueError before anything is written (checked calls)."""
        t, S = self._t, self.num_state_slots
        NL, B = folds.shape
        dev = bs.device
        cur = t["state_slot"][lay][:, bs]
        # a slot all of whose sharers fold in this call stays with one of them (the first row): exactly the
        # slots the sequential rule (the reference pool's) leaves with the last of them
        at = torch.where(folds & (cur >= 0), cur, S)
        row = torch.arange(B, device=dev).expand(NL, B)
        folders = torch.zeros(NL, S + 1, dtype=torch.int64, device=dev).scatter_add_(1, at, torch.ones_like(at))
        first = torch.full((NL, S + 1), B, dtype=torch.int64, device=dev).scatter_reduce_(1, at, row, "amin")
        c = cur.clamp(min=0)
        refs = t["refs"][lay]
        keeps = folds & (cur >= 0) & (refs.gather(1, c) == folders.gather(1, c)) & (first.gather(1, c) == row)
        need = folds & ~keeps
        free = refs[:, :S] == 0
        if checked:
            short = need.sum(1) > free.sum(1)
            if bool(short.any()):
                i = int(short.nonzero()[0, 0])
                raise ValueError(f"slots: {int(need[i].sum())} requests fold into a state slot of their own in layer "
                                 f"{lay.start + i}, but only {int(free[i].sum())} of {S} state slots are free")
        rank = need.to(torch.int64).cumsum(1)
        fresh = torch.searchsorted(free.to(torch.int64).cumsum(1), rank).clamp(max=S)  # the rank-th free slot
        write = torch.where(need, fresh, torch.where(folds, cur, S))
        return cur, write, need

    def _copy_on_write(self, lay: slice, cur: torch.Tensor, write: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
        """[layers, B] int64: the slot each row's fold reads.  A row leaving a shared slot (``need`` with a
        slot) has its state copied to its fresh slot first (one launch for the layers of ``lay``; the other
        rows' programs copy nothing) and folds there in place: its fold must not read the old slot, which
        the sharer that keeps it (``_claims``: when every sharer folds in this call) folds in place in the
        same launch.  The other rows read their own slot (-1: none, S0 = 0)."""
        src = torch.where(need & (cur >= 0), cur, -1).contiguous()
        write = write.contiguous()
        E = self.num_value_heads * self.head_k_dim * self.head_v_dim
        BLOCK = min(4096, block(E))
        NL, B = src.shape
        with device_guard(src):
            _copy_slots_kernel[(triton.cdiv(E, BLOCK), B, NL)](self._t["state"][lay], src, write, B,
                                                               (self.num_state_slots + 1) * E, E=E, BLOCK=BLOCK)
        return torch.where(src >= 0, write, cur)

    def _rebind(self, lay: slice, bs: torch.Tensor, cur: torch.Tensor, write: torch.Tensor,
                need: torch.Tensor) -> None:
        """After the folds: the rows that took a fresh slot move their reference from the old one."""
        t, S = self._t, self.num_state_slots
        refs = t["refs"][lay]
        one = torch.ones_like(cur)
        refs.scatter_add_(1, torch.where(need & (cur >= 0), cur, S), -one)
        refs.scatter_add_(1, torch.where(need, write, S), one)
        t["state_slot"][lay].scatter_(1, bs.expand(cur.shape[0], -1), torch.where(need, write, cur))

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

    def _padded_tokens(self, s: torch.Tensor, **x) -> dict:
        """Token tensors with the pad rows zeroed (the gathered sink rows compute on finite values)."""
        keep = s >= 0
        return {n: torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype,
                                                                                     device=t.device))
                for n, t in x.items()}

    # ------------------------------------------------------------------ operations
    def admit(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None, tail=None,
              initial_state=None, chunk_size: int = 64) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.admit``: the prompts through ``kvbuffer_fast.prefill`` (the chunk
        kernels; the tail written into the buffer rows in the u-cache form), then scattered into the slots
        (not capturable in a CUDA graph: prompts vary in length)."""
        layer = self._layer(layer)
        s, bs, _ = self._rows("slots", slots)
        rows = (s >= 0).nonzero().flatten()
        self._check_tokens(q, k, v, g, beta, s)
        t = self._t
        sv = s[rows]
        busy = (t["lengths"][layer, sv] > 0) | t["has_state"][layer, sv] | t["pending"][layer, sv]
        if bool(busy.any()):
            i = int(rows[busy.nonzero()[0, 0]])
            raise ValueError(f"slots: entry [{i}] is slot {int(s[i])}, which already holds entries or a state in "
                             f"layer {layer}; admit takes freshly acquired slots")
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        o_rows, buf = fast_prefill(q[rows], k[rows], v[rows], g=g[rows], beta=beta[rows], capacity=self.capacity,
                                   tail=tail, scale=scale, initial_state=pick(initial_state), chunk_size=chunk_size)
        buf = buf.replace(state=buf.state.to(t["state"].dtype), u=buf.u.to(t["u"].dtype), G=buf.G.to(t["G"].dtype),
                          k=buf.k.to(t["k"].dtype))
        lay = slice(layer, layer + 1)
        cur, write, need = self._claims(lay, sv, buf.has_state[None], True)
        self._scatter(layer, sv, buf, write[0])
        self._rebind(lay, sv, cur, write, need)
        o = new_output((s.shape[0],) + tuple(o_rows.shape[1:]), v.dtype, q.device)
        o[rows] = o_rows.to(v.dtype)
        return o

    def decode(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None, config=None) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.decode``: o [B, 1, HV, V] (pad rows: unspecified).  Three launches
        on the pool (fold, decode, bookkeeping) addressed by slot index, plus the state-slot bookkeeping."""
        layer = self._layer(layer)
        s, bs, checked = self._rows("slots", slots)
        d, g = self._check_tokens(q, k, v, g, beta, s, T=1)
        if checked:
            self._no_pending(layer, bs, s, "decode")
        C, t = self.capacity, self._t
        folds = (s >= 0) & (t["lengths"][layer, bs] >= C)
        lay = slice(layer, layer + 1)
        cur, write, need = self._claims(lay, bs, folds[None], checked)
        sc = check_scale(scale, d.K)
        if config is None:
            config = config_for("decode", key_of(q, C=C, B=d.B, HV=d.HV, V=d.V, channel=d.channel_gate))
        cfg = check_config("decode", config)
        if cfg.fold != "group" or C > 32:
            return self._decode_gathered(q, k, v, g, beta, layer, s, bs, cur, write, need, sc, cfg)
        cur0, write0 = cur[0], write[0]
        o = new_output((d.B, 1, d.HV, d.V), v.dtype, q.device)
        if d.B == 0:
            return o
        read = self._copy_on_write(lay, cur, write, need)[0]
        pdl = pdl_launch(q, cfg.pdl)
        tokens = dict(q_ptr=as_input(q), k_ptr=as_input(k), v_ptr=as_input(v), g_ptr=as_input(g),
                      beta_ptr=as_input(beta), o_ptr=o, scale=sc)
        pool = (t["k"][layer], t["u"][layer], t["G"][layer], t["lengths"][layer], flag_view(t["has_state"][layer]),
                t["state"][layer])
        H, HV, K, V = d.H, d.HV, d.K, d.V
        with device_guard(q):
            BV = _decode._columns(cfg.fold_BV, V)
            FH = math.gcd(HV, cfg.fold_FH)
            _decode._fold_group_slots_kernel[(triton.cdiv(V, BV), d.B * HV // FH)](
                *pool, **tokens, bslot_ptr=s, sread_ptr=read, swrite_ptr=write0, C=C, H=H, HV=HV, K=K, V=V,
                CB=block(C), KB=_decode._rows(cfg.fold_KB, K), BV=BV, FH=FH, NS=cfg.fold_NS, CHANNEL=d.channel_gate,
                num_warps=cfg.fold_warps, **pdl)
            BV = _decode._columns(cfg.BV, V)
            _decode._decode_slots_kernel[(triton.cdiv(V, BV), d.B * HV)](
                *pool, **tokens, bslot_ptr=s, sslot_ptr=cur0, C=C, H=H, HV=HV, K=K, V=V, CB=block(C), BV=BV,
                KB=_decode._rows(cfg.KB, K), NS=cfg.NS, CHANNEL=d.channel_gate, STORAGE=True, SERVED=True,
                num_warps=cfg.num_warps, **pdl)
            _decode._book_slots_kernel[(d.B,)](
                tokens["k_ptr"], tokens["g_ptr"], t["k"][layer], t["G"][layer], t["lengths"][layer],
                flag_view(t["has_state"][layer]), s, C=C, H=H, HV=HV, K=K, BK=block(K), BH=block(H, 1),
                BHV=block(HV, 1), CHANNEL=d.channel_gate, num_warps=1, **pdl)
        self._rebind(lay, bs, cur, write, need)
        return o

    def _decode_gathered(self, q, k, v, g, beta, layer, s, bs, cur, write, need, scale, cfg):
        """Decode through a gathered KVBuffer (capacities past the grouped fold's 32 rows); cur, write,
        need: ``_claims``' [1, B]."""
        buf = self._gather(layer, bs, cur[0])
        x = self._padded_tokens(s, q=q, k=k, v=v, g=g, beta=beta)
        o, buf = _decode.buffered_decode(x.pop("q"), x.pop("k"), x.pop("v"), **x, buffer=buf, scale=scale, config=cfg)
        self._scatter(layer, bs, buf, write[0])
        self._rebind(slice(layer, layer + 1), bs, cur, write, need)
        return o

    def verify(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, parents=None, num_drafts=None,
               scale=None, config=None) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.verify`` (pad rows: unspecified outputs); the drafts go to the
        slots' draft room, pending.  The kernels of ``kvbuffer_fast.verify`` on the addressed rows' buffer
        entries (gathered: C rows each), the state read from the pool's slots by index."""
        layer = self._layer(layer)
        s, bs, checked = self._rows("slots", slots)
        d, g = self._check_tokens(q, k, v, g, beta, s)
        if d.T > self.max_drafts:
            raise ValueError(f"q: {d.T} drafts per request, but the pool's draft room holds max_drafts="
                             f"{self.max_drafts}")
        B, Dn = d.B, d.T
        if parents is not None:
            require_int_tensor("parents", parents, (B, Dn), "[B, D]", self.device)
        if num_drafts is not None:
            require_int_tensor("num_drafts", num_drafts, (B,), "[B]", self.device)
        if num_drafts is None:
            num_drafts = torch.full((B,), Dn, dtype=torch.int64, device=q.device)
        num_drafts = torch.where(s >= 0, num_drafts.to(torch.int64), 0)  # pads verify nothing
        if parents is not None:  # pads: the chain (their values are not read)
            chain = torch.arange(-1, Dn - 1, device=q.device).expand(B, Dn)
            parents = torch.where((s >= 0)[:, None], parents.to(torch.int64), chain)
        x = self._padded_tokens(s, q=q, k=k, v=v, g=g, beta=beta)
        t = self._t
        rows = KVBuffer(k=t["k"][layer, bs], u=t["u"][layer, bs], G=t["G"][layer, bs], lengths=t["lengths"][layer, bs],
                        has_state=torch.zeros_like(t["has_state"][layer, bs]), state=None)  # C entries each;
        # the states (has_state <=> a state slot) are read by the kernel from the pool's slots
        cur = torch.where(s >= 0, t["state_slot"][layer, bs], -1)
        o, drafts = _verify(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("g"), x.pop("beta"), rows, parents, num_drafts,
                            scale, config, pool_state=(t["state"][layer], cur))
        t["dk"][layer, bs, :Dn] = drafts.k.to(t["dk"].dtype)
        t["du"][layer, bs, :Dn] = drafts.u.to(t["du"].dtype)
        t["dG"][layer, bs, :Dn] = drafts.G.to(t["dG"].dtype)
        par = torch.full((B, self.max_drafts), -1, dtype=torch.int64, device=q.device)
        par[:, :Dn] = drafts.parents
        t["parents"][layer, bs] = par
        t["num_drafts"][layer, bs] = drafts.num_drafts.to(torch.int64)
        t["pending"][layer].index_fill_(0, bs, True)
        return o

    def accept(self, *, slots: torch.Tensor, counts=None, nodes=None, layer: Optional[int] = None,
               config=None) -> None:
        """As ``kvbuffer_ref.pool.KVPool.accept`` (entries of pad rows are ignored): the fold launch and the
        copy launch of ``kvbuffer_fast.accept`` on the pool, addressed by slot index (the drafts are read
        from the slots' draft room).  ``layer``: an int, or None for every layer at once (the same counts
        or nodes; each launch then covers all layers, one grid axis per layer)."""
        lay = slice(0, self.layers) if layer is None else slice(self._layer(layer), self._layer(layer) + 1)
        s, bs, checked = self._rows("slots", slots)
        t = self._t
        if checked:
            pend = t["pending"][lay][:, bs] | (s < 0)
            if not bool(pend.all()):
                i, b = (int(v) for v in (~pend).nonzero()[0])
                raise ValueError(f"slots: slot {int(s[b])} has no verified drafts pending in layer {lay.start + i}; "
                                 f"call verify first")
        if (counts is None) == (nodes is None):
            raise ValueError("accept: give exactly one of counts= (chain drafts) or nodes= (tree drafts)")
        name, x = ("counts", counts) if counts is not None else ("nodes", nodes)
        x = torch.where(s >= 0, per_row(name, x, s), 0 if counts is not None else -1)  # pads: accept none
        nd = torch.where(s >= 0, t["num_drafts"][lay][:, bs], 0)         # [layers, B]
        par = t["parents"][lay][:, bs]                                    # [layers, B, D]
        D = self.max_drafts
        if checked:  # the counts / nodes against each layer's verified drafts (kvbuffer_ref.checks)
            for i in range(nd.shape[0]):
                if counts is not None:
                    chain = torch.arange(-1, D - 1, device=par.device)
                    is_chain = ((par[i] == chain[None, :]) |
                                (torch.arange(D, device=par.device)[None, :] >= nd[i][:, None])).all(1)
                    check_counts(x, nd[i], is_chain)
                else:
                    check_nodes(x, nd[i])
        node = (x - 1 if counts is not None else x).contiguous()
        m = _path_lengths(par, node)
        folds = (s >= 0) & (t["lengths"][lay][:, bs] + m > self.capacity)
        cur, write, need = self._claims(lay, bs, folds, checked)
        NL, B = folds.shape
        C, H, HV, K, V = self.capacity, self.num_heads, self.num_value_heads, self.head_k_dim, self.head_v_dim
        if B > 0 and D > 0:
            if config is None:
                config = config_for("accept", key_of(t["k"], C=C, B=B, HV=HV, V=V, channel=self.channel_gate))
            cfg = check_config("accept", config)
            BV = max(16, min(cfg.BV, block(V)))
            l0 = lay.start
            buf = (t["k"][l0], t["u"][l0], t["G"][l0], t["lengths"][l0], flag_view(t["has_state"][l0]))
            room = (t["dk"][l0], t["du"][l0], t["dG"][l0], t["parents"][l0], node, D)
            consts = dict(C=C, H=H, HV=HV, K=K, V=V, BD=block(D), CHANNEL=self.channel_gate)
            NR, SR = self.num_buffer_slots + 1, self.num_state_slots + 1
            read = self._copy_on_write(lay, cur, write, need).contiguous()
            with device_guard(s):
                FH = math.gcd(HV, cfg.FH)
                _accept_fold_slots_kernel[(triton.cdiv(V, BV), B * HV // FH, NL)](
                    *buf, t["state"][l0], *room, s, read, write.contiguous(), NR, SR, B, CB=block(C),
                    KB=max(16, min(cfg.KB, block(K))), BV=BV, FH=FH, NS=cfg.NS, num_warps=cfg.num_warps, **consts)
                _accept_slots_kernel[(cfg.splits, B, NL)](*buf, ticket_counters(NL * B, s.device), *room, s, NR, B,
                                                          CH=cfg.CH, SPLITS=cfg.splits, num_warps=cfg.copy_warps,
                                                          **consts)
        self._rebind(lay, bs, cur, write, need)
        t["pending"][lay].index_fill_(1, bs, False)
        t["num_drafts"][lay].index_fill_(1, bs, 0)

    def flush(self, *, layer: int, slots: torch.Tensor, count=None, config=None) -> None:
        """As ``kvbuffer_ref.pool.KVPool.flush`` (entries of pad rows are ignored): one launch on the pool
        addressed by slot index (``_flush_slots_kernel``: the state fold and the u columns), the keys and
        gates of the addressed rows moved in torch."""
        layer = self._layer(layer)
        s, bs, checked = self._rows("slots", slots)
        if checked:
            self._no_pending(layer, bs, s, "flush")
        t = self._t
        n = t["lengths"][layer, bs]
        c = torch.where(s >= 0, n if count is None else per_row("count", count, s), 0)
        c = check_flush_count(c, n, checked)  # 0..lengths
        folds = (s >= 0) & (c > 0)
        lay = slice(layer, layer + 1)
        cur, write, need = self._claims(lay, bs, folds[None], checked)
        cfg = check_config("flush", config_for("flush", Key()) if config is None else config)
        B, C, H, HV, K, V = s.shape[0], self.capacity, self.num_heads, self.num_value_heads, self.head_k_dim, \
            self.head_v_dim
        if B == 0:
            return
        BV = max(16, min(cfg.BV, block(V)))
        read = self._copy_on_write(lay, cur, write, need)[0]
        with device_guard(s):
            _flush_slots_kernel[(triton.cdiv(V, BV), B * HV)](
                t["k"][layer], t["u"][layer], t["G"][layer], t["lengths"][layer], flag_view(t["has_state"][layer]),
                t["state"][layer], c, s, read, write[0], C=C, H=H, HV=HV, K=K, V=V, BC=block(C), BK=block(K), BV=BV,
                CHANNEL=self.channel_gate, num_warps=cfg.num_warps)
        rows = SimpleNamespace(k=t["k"][layer, bs], G=t["G"][layer, bs])  # keys and G: small, moved in torch
        _shift_keys_and_gates(rows, c)
        t["k"][layer, bs] = rows.k
        t["G"][layer, bs] = rows.G
        t["lengths"][layer, bs] = n - c
        t["has_state"][layer, bs] = t["has_state"][layer, bs] | (c > 0)
        self._rebind(lay, bs, cur, write, need)

    def fork(self, *, src: torch.Tensor, dst: torch.Tensor, keep) -> None:
        """As ``kvbuffer_ref.pool.KVPool.fork``: the state slot is shared (copy-on-write), the first ``keep``
        buffered entries copied (the whole buffer rows are, C entries)."""
        s, ss, checked = self._rows("src", src)
        d, ds, _ = self._rows("dst", dst)
        if s.shape != d.shape:
            raise ValueError(f"dst: expected {s.shape[0]} entries (one per entry of src), got {d.shape[0]}")
        valid = (s >= 0) & (d >= 0)
        N, S, t = self.num_buffer_slots, self.num_state_slots, self._t
        ss, ds = torch.where(valid, ss, N), torch.where(valid, ds, N)
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
        s, bs, _ = self._rows("slots", slots)
        t, S = self._t, self.num_state_slots
        slot = t["state_slot"][:, bs]
        t["refs"].scatter_add_(1, torch.where((slot >= 0) & (s >= 0), slot, S), -torch.ones_like(slot))
        self._reset(bs)
        t["live"].index_fill_(0, bs, False)

    def state_of(self, *, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """As ``kvbuffer_ref.pool.KVPool.state_of`` (pad rows: zeros)."""
        layer = self._layer(layer)
        s, bs, _ = self._rows("slots", slots)
        S = fast_materialize(self._gather(layer, bs))
        return torch.where((s >= 0).view(-1, 1, 1, 1), S, torch.zeros((), dtype=S.dtype, device=S.device))


@triton.jit
def _copy_slots_kernel(state_ptr, src_ptr, dst_ptr, B, LAYER, E: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (E / BLOCK, B, layers): in layer l (``LAYER`` state elements after the previous one), copy
    state slot ``src[l, i]`` to slot ``dst[l, i]`` (E = HV K V elements each; BLOCK of them per program,
    int64 offsets) for each row i with ``src[l, i] >= 0``; the other rows' programs copy nothing."""
    i_l = tl.program_id(2).to(tl.int64)
    i = i_l * B + tl.program_id(1)
    state_ptr += i_l * LAYER
    s = tl.load(src_ptr + i).to(tl.int64)
    if s >= 0:
        d = tl.load(dst_ptr + i).to(tl.int64)
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < E
        tl.store(state_ptr + d * E + o, tl.load(state_ptr + s * E + o, mask=m), mask=m)


def _path_lengths(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """[layers, B] int64: the length of each row's root-to-``node`` path ([B]) in each layer's ``parents``
    [layers, B, D] (0 for -1); D steps of static shape (graph-capturable)."""
    cur = node.expand(parents.shape[0], -1).clone()
    m = torch.zeros_like(cur)
    for _ in range(parents.shape[2]):
        on = cur >= 0
        m += on.to(m.dtype)
        cur = torch.where(on, parents.gather(2, cur.clamp(min=0)[..., None])[..., 0], -1)
    return m
