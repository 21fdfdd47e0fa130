"""Engine conventions: validate a serving engine's kernel in its own calling convention.

The kernels SGLang, vLLM, TensorRT-LLM and FlashInfer run for Qwen3-Next / Qwen3.5 / Kimi Linear do not
take the oracle's signature.  An adapter states, as data, which convention its kernel follows, and the
validator converts the oracle's cases to it (``engine_adapter``)::

    from kvbuffer.peers.engine import engine_adapter

    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, cu_seqlens, scale):
        return my_kernel(A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, scale=scale,
                         initial_state=state, cu_seqlens=cu_seqlens, ssm_state_indices=slots,
                         use_qk_l2norm_in_kernel=True)

    adapter = engine_adapter(step, name="my-engine-decode", gating="raw", qk_l2norm=True, state_layout="VK",
                             pool=True, pad_slot=0, reserved_slots=(0,), varlen=True)

The convention (``Convention``; every field has the oracle's meaning as its default):

    tokens         "decode": one token per sequence per call (validated as ``recurrent_decode``), or
                   "sequence": T tokens per sequence per call, the state updated in place at the end
                   (validated as ``recurrent``, with and without an initial state)
    qkv            "separate": q [.., H, K], k [.., H, K], v [.., HV, V]; or "packed": ``mixed_qkv``
                   [.., 2 H K + HV V] (q | k | v, heads flattened)
    gating         "log": g [.., HV] (log decay) and beta [.., HV]; or "raw": ``A_log`` [HV], ``dt_bias`` [HV]
                   (float32), ``a`` [.., HV], ``b`` [.., HV] with g = -exp(A_log) softplus(a + dt_bias) and
                   beta = sigmoid(b) (scalar gates, beta in [0, 1])
    raw_gate_dtype the dtype ``a`` and ``b`` are handed over in: "float32" (the default with gating "raw", as
                   engines' projections give them) or "bfloat16" (a kernel whose wrapper rounds them,
                   FlashInfer's).  A_log and dt_bias are ``cases.raw_gate_params`` and a, b
                   ``cases.raw_gates_in``, and the adapter declares ``raw_gate_dtype`` so that the
                   validator's g and beta are those of the rounded raw gates (``cases.Case.raw_gate_dtype``)
                   and its baselines include the gates a float32 kernel computes from them
                   (``contracts.kernel_gates``)
    qk_l2norm      the kernel L2-normalises q and k itself (x / sqrt(sum x^2 + 1e-6), in float32 or wider):
                   the validator passes rows of any norm and computes the truth on their normalisation in
                   float64 (``cases.Case.qk_l2norm``)
    state_layout   "KV" ([.., K, V], the oracle's) or "VK" ([.., V, K], vLLM's and fla's ``state_v_first``)
    state_dtype    the dtype the state is stored in (bfloat16: judged by the "bf16-state" contract unless
                   the adapter declares another)
    pool           the states live in a pool [slots, HV, ., .] addressed by ``slots`` [N] (int32):
                   requests get random slots among more than they need (the rest NaN: never to be read),
                   padded rows carry ``pad_slot`` (-1; vLLM and SGLang: 0, the null block) and finite
                   garbage inputs; ``reserved_slots`` are never given to a request (vLLM: (0,)) and hold
                   finite garbage (a pad that reads the null block as a state and writes it back changes it)
    pad_writes     the null block (``pad_slot`` >= 0, or with ``pad_slot`` -1 the ``reserved_slots`` a kernel
                   redirects -1 to: FlashInfer's bfloat16-state kernel reads and writes slot 0 for a -1) is
                   scratch the pads may write: the kernel has no pad check (fla); default False: the null
                   block must stay bit for bit unchanged
    varlen         tokens flattened to [1, total, ..] with ``cu_seqlens`` [N + 1] (int32); in "sequence"
                   mode empty sequences are mixed in
    index_dtype    the dtype of ``slots`` and ``cu_seqlens`` (default int32)

What the validator checks besides the oracle's properties: after every call, every slot of the pool that
no request of the batch owns (the pads' too) is bit for bit unchanged ([pool-slots]: a pad written to
slot -1, i.e. the pool's last slot, or into the null block; a state stored into a neighbour's slot), that
the kernel's own inputs (q, k, v or mixed_qkv, the gating inputs, slots, cu_seqlens) are bit for bit
unchanged ([inputs-changed]: q normalised into the caller's tensor), and the owned slots hold the
new state in the kernel's layout and dtype.  Reports name the engine's own arguments (``mixed_qkv``,
``a``, ``slots``, ...).  A "sequence" call without an initial state gives the kernel a reused slot holding
the previous occupant's (finite) state and ``has_initial_state`` False per sequence (a kernel that reads
it leaks one request's state into the next: [state-leak] or a wrong result).
"""

from __future__ import annotations

import random
import types
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from ..validate.adapters import OPERATION_ATTRS, AdapterError, ContractViolation, _bits, interpreter_active
from ..validate.cases import RAW_GATE_DTYPES, softplus_inv, raw_gates_in
from ._sources import dtypes

__all__ = ["Convention", "engine_adapter", "to_raw_gates", "from_raw_gates", "token_rows", "next_pow2"]


@dataclass(frozen=True)
class Convention:
    tokens: str = "decode"
    qkv: str = "separate"
    gating: str = "log"
    raw_gate_dtype: str = ""
    qk_l2norm: bool = False
    state_layout: str = "KV"
    state_dtype: torch.dtype = torch.float32
    pool: bool = False
    pad_slot: int = -1
    reserved_slots: tuple = ()
    pad_writes: bool = False
    varlen: bool = False
    index_dtype: torch.dtype = torch.int32

    def __post_init__(self):
        for name, ok in (("tokens", ("decode", "sequence")), ("qkv", ("separate", "packed")),
                         ("gating", ("log", "raw")), ("state_layout", ("KV", "VK"))):
            if getattr(self, name) not in ok:
                raise AdapterError(f"convention {name}: expected one of {', '.join(ok)}, got {getattr(self, name)!r}")
        if not isinstance(self.state_dtype, torch.dtype) or not self.state_dtype.is_floating_point:
            raise AdapterError(f"convention state_dtype: expected a floating torch dtype, got {self.state_dtype!r}")
        if self.gating == "raw" and not self.raw_gate_dtype:  # float32 a and b, as engines' projections hand them
            object.__setattr__(self, "raw_gate_dtype", "float32")
        if self.raw_gate_dtype and (self.gating != "raw" or self.raw_gate_dtype not in RAW_GATE_DTYPES):
            raise AdapterError(f"convention raw_gate_dtype: one of {sorted(RAW_GATE_DTYPES)} with gating='raw', "
                               f"got {self.raw_gate_dtype!r} with gating={self.gating!r}")
        if self.pad_slot >= 0 and self.pad_slot not in self.reserved_slots:
            raise AdapterError(f"convention pad_slot: {self.pad_slot} is a real slot; reserve it (reserved_slots="
                               f"({self.pad_slot},)) or use -1")


def next_pow2(n: int) -> int:
    """The next power of two >= n (``triton.next_power_of_2``, without importing triton): the block sizes
    peers' launchers derive from K, V and lengths."""
    return 1 << max(0, int(n) - 1).bit_length()


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [.., W] as the token rows [L, W] an engine layer hands its preprocessing kernels: the leading
    dimensions flattened (``reshape``), and a copy with unit stride along W where ``x`` has another one (the
    layer's tensors always have it: the convolution's output rows, the ``ba`` projection's halves; the kernels
    address the last dimension with stride 1 and take only the row stride)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()



class InputsAdapter:
    """An engine's preprocessing kernels (``kernels``, with their ``version``) behind the ``engine_inputs`` lane
    alone: float32 and float16 (bfloat16 on a GPU), IEEE float32 arithmetic, scalar gates; every other
    operation not provided, for the reason ``only`` (which implementations serve them).  A subclass writes
    ``engine_inputs`` as its engine's layer calls its kernels."""

    contract = "ieee"
    channel_gate = False
    forms = ("u",)

    def __init__(self, kernels, name: str, only: str):
        self._k = kernels
        self.version = kernels.version
        self.name = name
        self.interpreted = interpreter_active()
        self.dtypes = dtypes(torch.float32, torch.float16)
        self.not_provided = {a: only for a in OPERATION_ATTRS if a != "engine_inputs"}

def to_raw_gates(g: torch.Tensor, beta: torch.Tensor, rng: random.Random):
    """Engine gating inputs for log-gates ``g`` [.., HV] and ``beta`` [.., HV]: A_log, dt_bias [HV] (float32,
    drawn in [-1, 1] or [-4, -2]), a, b [.., HV] (float32) with -exp(A_log) softplus(a + dt_bias) = g and
    sigmoid(b) = beta."""
    if g.dim() != beta.dim():
        raise AdapterError("gating='raw' takes scalar gates only (per-channel gates are not raw-gated here)")
    HV = g.shape[-1]
    # half the heads with a small exp(A_log): a + dt_bias then often lies past the softplus threshold (20),
    # the branch engine kernels take separately
    A_log = torch.tensor([rng.uniform(-1, 1) if rng.random() < 0.5 else rng.uniform(-4, -2) for _ in range(HV)],
                         dtype=torch.float32)
    dt_bias = torch.tensor([rng.uniform(-1, 1) for _ in range(HV)], dtype=torch.float32)
    sp = -g.detach().to(torch.float64).cpu() / A_log.double().exp()
    a = (softplus_inv(sp) - dt_bias.double()).float()
    bb = beta.detach().to(torch.float64).cpu()
    b = torch.where(bb >= 1, torch.full_like(bb, float("inf")), torch.log(bb) - torch.log1p(-bb)).float()
    dev = g.device
    return A_log.to(dev), dt_bias.to(dev), a.to(dev), b.to(dev)


def from_raw_gates(A_log, dt_bias, a, b, threshold: float = 20.0):
    """(g, beta) of raw gating inputs, the way engine kernels compute them (float32, softplus threshold)."""
    x = a.float() + dt_bias.float()
    sp = torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)
    return -torch.exp(A_log.float()) * sp, torch.sigmoid(b.float())


class _Engine:
    """The oracle-side adapter ``engine_adapter`` returns."""

    def __init__(self, fn: Callable, conv: Convention, name: str, contract: str, seed: int):
        self._fn, self.conv, self.name, self.contract = fn, conv, name, contract
        self._seed = seed
        self._rng = random.Random(seed)
        self._previous = None  # the last pool (its finite states: what a reused slot holds)
        self.qk_l2norm = conv.qk_l2norm
        self.raw_gate_dtype = conv.raw_gate_dtype
        self.channel_gate = conv.gating == "log"
        self.dtypes = (torch.float32, torch.float16)
        self.in_place = {"recurrent_decode": ("state",)}
        if conv.tokens == "decode":
            self.recurrent_decode = self._decode
            self.not_provided = {"recurrent_gated_delta_rule": "the kernel is a decode step (tokens='decode')"}
        else:
            self.recurrent_gated_delta_rule = self._sequence
            self.not_provided = {"recurrent_decode": "the kernel takes whole sequences (tokens='sequence')"}

    # -- state layout and pool
    def _to_kernel(self, S: torch.Tensor) -> torch.Tensor:
        S = S.transpose(-1, -2) if self.conv.state_layout == "VK" else S
        return S.to(self.conv.state_dtype).contiguous()

    def _from_kernel(self, S: torch.Tensor) -> torch.Tensor:
        S = S.transpose(-1, -2) if self.conv.state_layout == "VK" else S
        return S.float()

    def _slots(self, B: int):
        """(slot per request, pool size): distinct random slots, never a reserved one, among B + 3."""
        n = B + 3 + len(self.conv.reserved_slots)
        free = [s for s in range(n) if s not in self.conv.reserved_slots]
        self._rng.shuffle(free)
        return free[:B], n

    def _rows(self, B: int) -> list:
        """The batch rows: request index, or None for a pad row (one or two pads mixed in when pooled)."""
        rows = list(range(B))
        if self.conv.pool:
            for _ in range(self._rng.randint(1, 2)):
                rows.insert(self._rng.randint(0, len(rows)), None)
        return rows

    def _call(self, q, k, v, g, beta, states, initial, scale, T):
        """One kernel call in the engine's terms for requests b = 0..B-1 with T tokens each; returns
        (o [B, T, HV, V], the new states [B, HV, K, V] in float32)."""
        c = self.conv
        # the slots, pads and raw gates are drawn from the call's own inputs: the same call, replayed (as the
        # runner does to attribute a failure), gets the same slots
        self._rng = random.Random(hash((self._seed, tuple(q.shape), float(q.detach().double().sum()),
                                        float(v.detach().double().sum()))))
        B, _, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dev = q.device
        rows = self._rows(B)
        slot_of, n_slots = self._slots(B) if c.pool else (list(range(B)), B)
        # per row: the tokens of its request; a pad row: finite garbage (decode: one token; a varlen
        # sequence call: an empty sequence; otherwise T tokens)
        pad_len = 1 if c.tokens == "decode" else (0 if c.varlen else T)
        lens = [T if r is not None else pad_len for r in rows]
        garbage = dict(q=0.5, k=0.5, v=0.5, g=-0.1, beta=0.5)

        def per_row(name, x):
            return [x[r] if r is not None else torch.full_like(x[0, :1], garbage[name]).expand(
                pad_len, *x.shape[2:]).contiguous() for r in rows]
        xs = {n: per_row(n, t) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
        cat = (lambda parts: torch.cat(parts).unsqueeze(0)) if c.varlen else torch.stack
        xs = {n: cat(parts) for n, parts in xs.items()}  # [N, T, ..] or [1, total, ..]
        call = {}
        if c.gating == "raw":
            # the fixed A_log, dt_bias the validator's gates were rounded with (``Case.raw_gate_dtype``)
            A_log, dt_bias, a, b = raw_gates_in(xs["g"], xs["beta"], c.raw_gate_dtype)
            call.update(A_log=A_log, dt_bias=dt_bias, a=a, b=b)
        else:
            call.update(g=xs["g"], beta=xs["beta"])
        N = len(rows)
        if c.qkv == "packed":
            call["mixed_qkv"] = torch.cat([xs["q"].flatten(-2), xs["k"].flatten(-2), xs["v"].flatten(-2)], -1)
        else:
            call.update(q=xs["q"], k=xs["k"], v=xs["v"])
        token_keys = [n for n in ("q", "k", "v", "mixed_qkv", "g", "beta", "a", "b") if n in call]
        if c.varlen:
            offs = [0]
            for n_ in lens:
                offs.append(offs[-1] + n_)
            call["cu_seqlens"] = torch.tensor(offs, dtype=c.index_dtype, device=dev)
        elif c.tokens == "decode":  # [N, 1, ...] -> [N, ...]: one token per row
            for n in token_keys:
                call[n] = call[n][:, 0]
        # the states
        if c.pool:
            pool = torch.full((n_slots, HV, *((V, K) if c.state_layout == "VK" else (K, V))), float("nan"),
                              dtype=c.state_dtype, device=dev)
            for s in c.reserved_slots:  # the null block: finite, so that a pad writing it changes it (NaN over NaN
                pool[s] = 0.5           # would not show) and a pad reading it as a state computes a finite one
            prev = self._previous
            for b in range(B):
                if initial is not None:
                    pool[slot_of[b]] = self._to_kernel(initial[b])
                elif prev is not None and prev.shape[1:] == pool.shape[1:]:  # a reused slot: its last occupant's state
                    pool[slot_of[b]] = torch.nan_to_num(prev[slot_of[b] % prev.shape[0]], nan=0.25)
                else:
                    pool[slot_of[b]] = 0.25
            call["state"] = pool
            call["slots"] = torch.tensor([slot_of[r] if r is not None else c.pad_slot for r in rows],
                                         dtype=c.index_dtype, device=dev)
        else:
            S0 = initial if initial is not None else torch.zeros(B, HV, K, V, device=dev)
            call["state"] = self._to_kernel(S0)
        if c.tokens == "sequence":
            call["has_initial_state"] = torch.tensor([initial is not None] * N, dtype=torch.bool, device=dev)
        call["scale"] = K ** -0.5 if scale is None else float(scale)
        before = call["state"].clone()
        read_only = {n: _bits(x).clone() for n, x in call.items() if isinstance(x, torch.Tensor) and n != "state"}
        o = self._fn(**call)
        for n, x in read_only.items():  # the engine's own inputs (the Guarded check sees the oracle's only)
            if not torch.equal(_bits(call[n]), x):
                raise ContractViolation("inputs-changed", f"the kernel's input {n} (shape {list(call[n].shape)}) "
                                        f"changed by the call (only the state pool is updated in place)")
        if isinstance(o, tuple):
            o = o[0]
        if not isinstance(o, torch.Tensor):
            raise AdapterError(f"{self.name}: the kernel must return the output tensor, got {type(o).__name__}")
        if c.varlen:
            o = o.reshape(-1, HV, V)
            o = torch.stack([o[offs[i]:offs[i] + T] for i, r in enumerate(rows) if r is not None]) if B else \
                o.new_zeros(0, T, HV, V)
        else:
            o = o.reshape(N, T, HV, V)
            keep = [i for i, r in enumerate(rows) if r is not None]
            o = o[keep] if keep else o[:0]
        after = call["state"]
        if c.pool:
            owned = set(slot_of)
            if c.pad_writes:  # a scratch null block: pads may write it
                owned.update((c.pad_slot,) if c.pad_slot >= 0 else c.reserved_slots)
            for s in range(n_slots):
                if s not in owned and not torch.equal(torch.nan_to_num(after[s], nan=7.0),
                                                      torch.nan_to_num(before[s], nan=7.0)):
                    who = "the pad slot" if s == c.pad_slot % n_slots else "a slot no request of the batch owns"
                    raise ContractViolation("pool-slots", f"state pool slot {s} ({who}) changed by the call (slots "
                                            f"{call['slots'].tolist()}, pad_slot {c.pad_slot})")
            new = torch.stack([self._from_kernel(after[s]) for s in slot_of]) if B else after[:0].float()
            self._previous = after.detach().clone()
        else:
            new = self._from_kernel(after)
        return o, new

    def _decode(self, q, k, v, *, g, beta, state, scale=None):
        if g.dim() == 4 and self.conv.gating == "raw":
            raise NotImplementedError("raw gating: scalar gates only")
        o, new = self._call(q, k, v, g, beta, state, state, scale, T=1)
        state.copy_(new.to(state.dtype))
        return o.to(v.dtype)

    def _sequence(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
        o, new = self._call(q, k, v, g, beta, None, initial_state, scale, T=q.shape[1])
        return o.to(v.dtype), (new if output_final_state else None)


def engine_adapter(fn: Callable, *, name: str = "engine-kernel", contract: Optional[str] = None, seed: int = 0,
                   **convention) -> types.SimpleNamespace:
    """An adapter for ``fn``, an engine kernel called with keyword arguments in its own convention
    (``Convention``: the keywords it takes are those of ``convention``; see the module docstring).  ``fn``
    returns the output ([N, HV, V], [N, T, HV, V] or [1, N * T, HV, V]) and updates ``state`` in place.
    contract: its arithmetic contract (default: "bf16-state" for a bfloat16 state, else "ieee")."""
    known = {f.name for f in fields(Convention)}
    bad = sorted(set(convention) - known)
    if bad:
        raise AdapterError(f"engine_adapter: unknown convention field(s) {bad}; known: {sorted(known)}")
    conv = Convention(**convention)
    if contract is None:
        contract = "bf16-state" if conv.state_dtype == torch.bfloat16 else "ieee"
    return _Engine(fn, conv, name, contract, seed)
