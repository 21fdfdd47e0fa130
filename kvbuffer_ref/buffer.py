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

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch

from .checks import (RESET_GATE, Dims, check_capacity, require_device, require_float, require_int_tensor,
                     require_rank, require_tensor, shape_str)

__all__ = ["KVBuffer", "Drafts"]

#: The lowest a stored cumulative log-gate ``G`` may go per buffered row: every gate a buffered token brings
#: is at least ``-RESET_GATE`` of its compute dtype (a reset, -inf included, is taken as that; the largest,
#: float64's, bounds every dtype), and a row's G sums at most C of them since the last flush; so a live G is
#: finite and at least ``-G_FLOOR_PER_ROW * (C + 1)`` (a row more for the rounding of those sums: -2000 plus a
#: tiny gate is -2000.0000000000002), and a live raw-form ``g`` finite and at least
#: ``-G_FLOOR_PER_ROW`` (``KVBuffer.check``).  A G of -inf gives -inf - (-inf) = NaN
#: in the decays exp(G_i - G_j), and -1e30 absorbs every later gate (a wrong finite answer).
G_FLOOR_PER_ROW = RESET_GATE[torch.float64]

#: Form of a buffer or drafts field: "u" (u-cache), "raw" (the paper's k, v, g, beta) or None (both forms).
FORMS = ("u", "raw")


def _slot(form: Optional[str] = None):
    """A per-slot field ([B, C, ...]: one row per entry): of one form (default None: unused by the
    other form) or of both (form None: required)."""
    if form is None:
        return field(metadata={"slot": True, "form": None})
    return field(default=None, metadata={"slot": True, "form": form})


@dataclass(frozen=True, kw_only=True)
class _Slots:
    """The per-slot fields buffered entries and drafts share, declared once: k, then the u-cache form's
    (u, G) and the raw form's (v, g, beta); and the field lists every copy, export and check uses."""

    k: torch.Tensor = _slot()
    u: Optional[torch.Tensor] = _slot("u")
    G: Optional[torch.Tensor] = _slot("u")
    v: Optional[torch.Tensor] = _slot("raw")
    g: Optional[torch.Tensor] = _slot("raw")
    beta: Optional[torch.Tensor] = _slot("raw")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """Every field name: the per-slot ones (k, u, G, v, g, beta), then the class's own (a buffer's
        lengths, state, has_state; drafts' parents, num_drafts)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def slot_fields(cls, form: Optional[str] = None) -> tuple[str, ...]:
        """The per-slot fields ([B, C, ...]): k, u, G, v, g, beta; with ``form``, those that form holds
        (``"u"``: k, u, G; ``"raw"``: k, v, g, beta)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("slot")
                     and (form is None or f.metadata["form"] in (None, form)))

    @classmethod
    def form_fields(cls, form: str) -> tuple[str, ...]:
        """The fields only ``form`` holds: ("u", "G") for the u-cache, ("v", "g", "beta") for raw."""
        if form not in FORMS:
            raise ValueError(f"form: expected 'u' (u-cache) or 'raw' (k, v, g, beta), got {form!r}")
        return tuple(f.name for f in fields(cls) if f.metadata.get("form") == form)

    def tensors(self) -> dict:
        """{field name: tensor or None} for every field."""
        return {name: getattr(self, name) for name in self.fields()}

    def cloned(self) -> dict:
        """{field name: a clone of the tensor, or None}: working copies a new buffer is built from."""
        return {name: None if x is None else x.clone() for name, x in self.tensors().items()}


@dataclass(frozen=True, kw_only=True)
class KVBuffer(_Slots):
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

    lengths: torch.Tensor
    state: Optional[torch.Tensor]
    has_state: torch.Tensor

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
        gate_dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> "KVBuffer":
        """An empty buffer (every length 0, no request owning a state yet).

        ``dtype`` is the dtype of the cached u / v and beta; ``gate_dtype`` of the gates G / g (default
        ``dtype``); ``key_dtype`` of the keys (default ``dtype``); ``state_dtype`` of the state storage
        (default ``dtype``).  ``with_state=False`` allocates no state storage at all (a direct-only
        buffer).  A field narrower than float32 is a stored precision: the reference reads it exactly,
        computes at least in float32 and rounds what it writes there once (``entries.store``).
        kvbuffer_fast takes a state and u in float32, bfloat16 or float16 and G in float32, e.g.
        ``KVBuffer.empty(..., dtype=torch.bfloat16, gate_dtype=torch.float32, state_dtype=torch.bfloat16)``.
        """
        check_capacity(capacity)
        form_names = cls.form_fields(form)
        for name, flag in (("channel_gate", channel_gate), ("with_state", with_state)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device: expected a torch.device or a device string, got {device!r} "
                                 f"({e})") from None
        for name, n, least in (("batch", batch, 0), ("num_heads", num_heads, 1), ("num_value_heads", num_value_heads, 1),
                               ("head_k_dim", head_k_dim, 1), ("head_v_dim", head_v_dim, 1)):
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
            if n < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {n}")
        if num_value_heads % num_heads != 0:
            raise ValueError(
                f"num_value_heads: expected a positive multiple of num_heads={num_heads}, got {num_value_heads}"
            )
        for name, dt in (("dtype", dtype), ("key_dtype", key_dtype), ("state_dtype", state_dtype),
                         ("gate_dtype", gate_dtype)):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise TypeError(f"{name}: expected a floating-point torch.dtype, got {dt}")
        B, C, H, HV, K, V = batch, capacity, num_heads, num_value_heads, head_k_dim, head_v_dim
        key_dtype = key_dtype or dtype
        state_dtype = state_dtype or dtype
        gshape = (B, C, HV, K) if channel_gate else (B, C, HV)
        kw = dict(device=device)
        shapes = dict(u=(B, C, HV, V), G=gshape, v=(B, C, HV, V), g=gshape, beta=(B, C, HV))
        return cls(
            k=torch.zeros(B, C, H, K, dtype=key_dtype, **kw),
            lengths=torch.zeros(B, dtype=torch.long, **kw),
            state=torch.zeros(B, HV, K, V, dtype=state_dtype, **kw) if with_state else None,
            has_state=torch.zeros(B, dtype=torch.bool, **kw),
            **{name: torch.zeros(shapes[name], dtype=(gate_dtype or dtype) if name in ("G", "g") else dtype,
                                 **kw) for name in form_names},
        )

    # ------------------------------------------------------------ invariants
    def check(self, dims: Optional[Dims] = None, device: Optional[torch.device] = None, *,
              values: bool = True) -> None:
        """Check the buffer's own consistency and, when ``dims`` is given, that it fits the tokens.

        Raises ValueError / TypeError naming the field, what was expected and what was given.
        ``values=False`` skips the checks that read device memory (lengths in 0..C; the live rows of the
        stored gates finite and not below their floor, ``_bad_gates``: one host sync for both), e.g. while
        a CUDA graph is captured; shapes, dtypes and devices are checked either way.
        ``kvbuffer_ref.checks.check_buffer`` calls this.
        """
        k, lengths = self.k, self.lengths
        require_tensor("buffer.k", k)
        require_rank("buffer.k", k, 4, "[B, C, H, K]")
        B, C, H, K = k.shape
        for axis, what, n in ((1, "capacity C", C), (2, "q/k heads H", H), (3, "key dimension K", K)):
            if n < 1:
                raise ValueError(f"buffer.k: the {what} (dimension {axis}) must be positive, got shape {shape_str(k)}")
        form = self._populated_form()
        vname, gname = ("buffer.u", "buffer.G") if form == "u" else ("buffer.v", "buffer.g")
        vals = self.values
        for name in self.fields():
            x = getattr(self, name)
            if x is not None:
                require_tensor(f"buffer.{name}", x)
        require_rank(vname, vals, 4, "[B, C, HV, V]")
        HV, V = vals.shape[2], vals.shape[3]
        if tuple(vals.shape[:2]) != (B, C):
            raise ValueError(f"{vname}: expected leading dims [B, C] = [{B}, {C}], got {shape_str(vals)}")
        if HV < 1 or V < 1:
            raise ValueError(f"{vname}: the value heads HV and the value dimension V must be positive, "
                             f"got shape {shape_str(vals)}")
        if HV % H != 0:
            raise ValueError(f"buffer: value heads HV={HV} must be a multiple of key heads H={H}")
        if tuple(self.gates.shape) not in ((B, C, HV), (B, C, HV, K)):
            raise ValueError(f"{gname}: expected [B, C, HV] = [{B}, {C}, {HV}] or [B, C, HV, K] = "
                             f"[{B}, {C}, {HV}, {K}], got {shape_str(self.gates)}")
        if form == "raw" and tuple(self.beta.shape) != (B, C, HV):
            raise ValueError(f"buffer.beta: expected [B, C, HV] = [{B}, {C}, {HV}], got {shape_str(self.beta)}")
        require_int_tensor("buffer.lengths", lengths, (B,), "[B]", k.device)
        bad = (lengths < 0) | (lengths > C) if values else None
        bad_G = self._bad_gates(C) if values else None
        flags = torch.stack([bad.any()] + ([bad_G.any()] if bad_G is not None else [])).tolist() if values else []
        if values and flags[0]:
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"buffer.lengths: entry [{b}] is {int(lengths[b])}, expected a value in 0..{C} "
                             f"(the capacity)")
        if values and bad_G is not None and flags[1]:
            idx = [int(i) for i in bad_G.nonzero()[0]]
            where = f"entry {idx} (request {idx[0]}, row {idx[1]} of its {int(lengths[idx[0]])} buffered) is " \
                    f"{float(self.gates[tuple(idx)])}"
            if form == "u":
                raise ValueError(
                    f"buffer.G: {where}, expected a finite cumulative log-gate not below -{G_FLOOR_PER_ROW * (C + 1):g} "
                    f"(-RESET_GATE[float64] = -{G_FLOOR_PER_ROW:g} per buffered row x (the capacity C={C} + 1)): every "
                    f"operation that writes G takes a reset gate (-inf, -1e30) as -RESET_GATE (kvbuffer_ref.checks."
                    f"RESET_GATE, docs/conventions.md \"Reset gates\"), so a G of -inf, NaN, +inf or below that "
                    f"floor was not made by prefill, buffered_decode, flush or accept, and its decays exp(G_i - G_j) "
                    f"would be NaN or absorb every later gate")
            raise ValueError(
                f"buffer.g: {where}, expected a finite log-gate not below -{G_FLOOR_PER_ROW:g} (-RESET_GATE[float64]): "
                f"every operation that buffers a token stores a reset gate (-inf, -1e30) as -RESET_GATE "
                f"(kvbuffer_ref.checks.RESET_GATE, docs/conventions.md \"Reset gates\"), so -inf, NaN, +inf or a "
                f"gate below that was not made by prefill, buffered_decode or accept, and its cumulative decays "
                f"would be NaN or absorb every later gate")
        self._check_state(B, HV, K, V, values)
        for name, x in self.tensors().items():
            if x is not None:
                require_device(f"buffer.{name}", x, k.device)
                if name not in ("has_state", "lengths"):
                    require_float(f"buffer.{name}", x)
        if dims is not None:
            self._check_fits(dims, dict(B=B, H=H, HV=HV, K=K, V=V))
        if device is not None:
            require_device("buffer", k, device)

    def _bad_gates(self, C: int) -> Optional[torch.Tensor]:
        """[B, C, HV(, K)] bool: the live rows (below ``lengths[b]``) of the stored gates that are not finite or
        lie below their floor: the u-cache's cumulative ``G`` below ``-G_FLOOR_PER_ROW * (C + 1)``, the raw form's
        per-token ``g`` below ``-G_FLOOR_PER_ROW``.  None for gates the later checks reject anyway (not
        floating, on another device, of another shape).  Rows past the lengths are garbage (never read) and
        may hold anything."""
        G, lengths = self.gates, self.lengths
        if (not isinstance(G, torch.Tensor) or not G.dtype.is_floating_point or G.device != lengths.device
                or G.dim() < 3 or tuple(G.shape[:2]) != (lengths.shape[0], C)):
            return None
        floor = G_FLOOR_PER_ROW * (C + 1 if self.G is not None else 1)
        n = lengths.clamp(0, C)
        live = (torch.arange(C, device=G.device)[None, :] < n[:, None]).view(*G.shape[:2], *([1] * (G.dim() - 2)))
        return live & ~(torch.isfinite(G) & (G >= -floor))

    def _populated_form(self) -> str:
        """The one form whose fields are all set; ValueError for none, both or a partial form."""
        present = {form: [getattr(self, n) is not None for n in self.form_fields(form)] for form in FORMS}
        if any(present["u"]) == any(present["raw"]):
            raise ValueError("buffer: expected exactly one form populated: (u, G) for the u-cache or (v, g, beta) "
                             "for raw")
        if any(present["u"]) and not all(present["u"]):
            raise ValueError("buffer: the u-cache form needs both u and G")
        if any(present["raw"]) and not all(present["raw"]):
            raise ValueError("buffer: the raw form needs v, g and beta")
        return "u" if any(present["u"]) else "raw"

    def _check_state(self, B: int, HV: int, K: int, V: int, values: bool = True) -> None:
        hs = self.has_state
        require_tensor("buffer.has_state", hs)
        if hs.dtype != torch.bool or tuple(hs.shape) != (B,):
            raise ValueError(f"buffer.has_state: expected a bool tensor [B] = [{B}], got {hs.dtype} {shape_str(hs)}")
        if self.state is None:
            if values and bool(hs.any()):
                raise ValueError("buffer.has_state: a request is marked as owning a state but buffer.state is None")
            return
        require_float("buffer.state", self.state)
        if tuple(self.state.shape) != (B, HV, K, V):
            raise ValueError(f"buffer.state: expected [B, HV, K, V] = [{B}, {HV}, {K}, {V}], "
                             f"got {shape_str(self.state)}")

    def _check_fits(self, dims: Dims, got: dict) -> None:
        want = dict(B=dims.B, H=dims.H, HV=dims.HV, K=dims.K, V=dims.V)
        for key in got:
            if got[key] != want[key]:
                raise ValueError(f"buffer: its {key}={got[key]} does not match the tokens' {key}={want[key]}")
        if self.channel_gate != dims.channel_gate:
            kinds = {False: "scalar [B, T, HV]", True: "per-channel [B, T, HV, K]"}
            raise ValueError(f"g: the buffer holds {kinds[self.channel_gate]} gates but g is "
                             f"{kinds[dims.channel_gate]}")


@dataclass(frozen=True, kw_only=True)
class Drafts(_Slots):
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

    def slot(self, b: int, idx: torch.Tensor) -> dict:
        """{per-slot field: rows ``idx`` of request b, or None}: the entries ``accept`` appends."""
        return {name: None if getattr(self, name) is None else getattr(self, name)[b, idx]
                for name in self.slot_fields()}

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
