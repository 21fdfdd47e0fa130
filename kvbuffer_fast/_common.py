"""Helpers shared by the kvbuffer_fast operations: program ids and tile masks inside kernels, output
allocation, input and in-place checks, the PDL prologue and launch flags, scratch counters.

Free of any particular kernel, so that every operation's module can use it.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.checks import RESET_GATE, byte_range, check_buffer, check_gate_values, check_tokens, require_tensor

#: A Python file whose ``install()`` runs once, here, when the Triton interpreter is on (TRITON_INTERPRET=1): before
#: any kvbuffer_fast launch, and in every process that loads kvbuffer_fast.  tests/conftest.py names
#: tests/interpreter_launches.py, so the programs the tests start run their launches as the tests do.  Unset: nothing.
INTERPRETER_SETUP_ENV = "KVBUFFER_INTERPRETER_SETUP"


def _interpreter_setup() -> None:
    import sys

    path = os.environ.get(INTERPRETER_SETUP_ENV, "")
    name = "_kvbuffer_interpreter_setup"
    if not path or os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or name in sys.modules:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"${INTERPRETER_SETUP_ENV}: no Python file at {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    sys.modules[name] = module


_interpreter_setup()

try:  # grid dependency control (Triton >= 3.3): used only when a launch asks for PDL
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover
    _gdc_wait = _gdc_launch_dependents = None

__all__ = [
    "block",
    "new_output",
    "values_checked",
    "as_input",
    "require_inplace",
    "require_no_overlap",
    "device_guard",
    "ticket_counters",
    "int_scratch",
    "flag_view",
    "check_u_form",
    "checked_buffer",
    "checked_tokens",
    "require_fp32_state",
    "STATE_DTYPES",
    "CACHE_DTYPES",
    "require_state_dtype",
    "require_cache_dtypes",
    "pdl_launch",
    "PoolLayer",
]


class PoolLayer(NamedTuple):
    """One layer of a serving pool (``kvbuffer_fast.pool.KVPool``) as the operations' slot-addressed
    launches (``verify_pool``, ``decode_pool``, ``accept_pool``, ``flush_pool``) address it: call row b
    works on buffer row ``slots[b]`` (-1: a pad, nothing read or written) of ``buffer`` (the layer's rows,
    a sink row behind them; state None), on the state slots of ``state`` ([slots + 1, HV, K, V]: a sink
    slot last; verify reads slot ``state_slot[slots[b]]``, -1: none, S0 = 0; the folds read and write the
    slots the pool's bookkeeping gives them) and on that row's draft room ``room`` (a Drafts of
    [rows, DR, ...] tensors: k, u, G, parents, num_drafts) and ``pending`` flag."""

    slots: torch.Tensor
    buffer: KVBuffer
    state: torch.Tensor
    state_slot: torch.Tensor
    room: Drafts
    pending: torch.Tensor


def block(n: int, minimum: int = 16) -> int:
    """Power-of-two tile covering ``n`` (at least ``minimum``: tl.dot needs 16 on every axis)."""
    return max(minimum, triton.next_power_of_2(int(n)))


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor kernels write before any reads it (an output, or a scratch read only where it was written):
    uninitialised, or NaN-filled when the environment variable ``KVBUFFER_POISON`` is ``1`` (tests set it,
    so an element a kernel forgets to write, or reads unwritten, fails)."""
    if os.environ.get("KVBUFFER_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


#: Host-built index tensors already on a device (the chunk tables, prefill's buffer rows), by a key of
#: host values and the device: a repeated call makes no host-to-device copy (which would wait for the
#: stream, and cannot be captured in a CUDA graph).  The oldest entry goes past ``_MAX_ON_DEVICE``.
_ON_DEVICE: dict = {}
_MAX_ON_DEVICE = 512


def on_device(key: tuple, device, make):
    """``make()`` (tensors built on ``device`` from host values), cached by (``key``, the device)."""
    full = (*key, str(torch.device(device or "cpu")))
    hit = _ON_DEVICE.get(full)
    if hit is None:
        if len(_ON_DEVICE) >= _MAX_ON_DEVICE:
            _ON_DEVICE.pop(next(iter(_ON_DEVICE)))
        hit = _ON_DEVICE[full] = make()
    return hit


#: Set to 1 under the Triton interpreter: float16 inputs take the 16-bit paths compiled CUDA kernels take
#: (``sixteen_bit_paths``), so that a CPU checks them.
SIXTEEN_BIT_PATHS_ENV = "KVBUFFER_FAST_16BIT_PATHS"


def sixteen_bit_paths(x: torch.Tensor) -> bool:
    """Whether 16-bit inputs on ``x``'s device take the compiled CUDA kernels' 16-bit products (the chunk
    launches' ``LOWP`` and ``MMA16`` paths, ``kvbuffer_fast.chunk``): on CUDA always; under the Triton
    interpreter when ``$KVBUFFER_FAST_16BIT_PATHS`` is 1, for float16 only (the interpreter's bfloat16
    arithmetic is not the GPU's).  The interpreter then computes what the compiled kernel computes with its
    16-bit operands, its other products in IEEE float32 (no TF32 there)."""
    if x.is_cuda:
        return True
    return x.dtype == torch.float16 and os.environ.get(SIXTEEN_BIT_PATHS_ENV, "0") == "1" and \
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def values_checked(x: torch.Tensor) -> bool:
    """Whether the checks that read device values (lengths, has_state, counts) may run for tensors on
    ``x``'s device: False while a CUDA graph is being captured there (a host read would break the
    capture), True otherwise (and always on the CPU / interpreter)."""
    if not x.is_cuda:
        return True
    with torch.cuda.device(x.device):
        return not torch.cuda.is_current_stream_capturing()


def as_input(x: torch.Tensor) -> torch.Tensor:
    """A read-only kernel input: contiguous (small per-token tensors; a copy only if needed)."""
    return x if x.is_contiguous() else x.contiguous()


def index_input(x: torch.Tensor) -> torch.Tensor:
    """A read-only integer kernel input (parents, draft counts, accepted counts or nodes): int32 and int64
    as given (the kernels load either), other integer dtypes as int64; contiguous.  An engine's int32
    tensors then reach the kernels without a conversion launch in between."""
    if x.dtype not in (torch.int32, torch.int64):
        x = x.to(torch.int64)
    return as_input(x)


def require_inplace(name: str, x: Optional[torch.Tensor]) -> None:
    """Tensors a kernel updates in place must be contiguous (a copy would silently drop the update)."""
    if x is not None and not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, because the kernel updates it in place "
                         f"(got strides {tuple(x.stride())} for shape {list(x.shape)})")


def require_no_overlap(written: dict, read: dict) -> None:
    """A ValueError naming both arguments when a tensor a call writes (``written``: name -> tensor or None)
    shares memory with another it writes or one it reads (``read``): a kernel would read values it has
    already overwritten, or two writes would land on the same elements.  Judged by the byte ranges the
    tensors span (data_ptr, sizes, strides) on one device: host arithmetic only, no device access, so it
    runs under CUDA graph capture too.  Disjoint parts of one storage (slots of a pool) pass; views whose
    ranges interleave count as sharing."""
    spans = {n: (x.device, *byte_range(x)) for n, x in {**read, **written}.items()
             if x is not None and x.numel() and x.device.type != "meta"}
    names = list(spans)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a not in written and b not in written:
                continue
            (da, a0, a1), (db, b0, b1) = spans[a], spans[b]
            if da == db and a0 < b1 and b0 < a1:
                w, other = (a, b) if a in written else (b, a)
                raise ValueError(f"{w}: shares memory with {other}, but the call writes {w} in place while it "
                                 f"{'writes' if other in written else 'reads'} {other}; pass tensors with memory "
                                 f"of their own (e.g. a .clone())")


def device_guard(x: torch.Tensor):
    """Launch on the device that holds ``x`` (the interpreter runs on the CPU)."""
    if x.is_cuda:
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


_SCRATCH: dict = {}
#: Scratches replaced by a larger one: kept alive, because a CUDA graph captured on one still uses it.
_RETIRED: list = []


def int_scratch(name: str, n: int, device) -> torch.Tensor:
    """A reusable int32 scratch of >= n entries on ``device``, zeroed when (re)allocated, one per name
    and device: launches that use one must be stream-ordered.  It grows to the next power of two; the
    one it replaces stays allocated (graphs captured on it keep valid memory).  A scratch that must grow
    while a CUDA graph is captured belongs to that graph (its zeroing is captured with it) and is not
    kept for later calls."""
    device = torch.device(device)
    key = (name, str(device))
    t = _SCRATCH.get(key)
    if t is None or t.numel() < n:
        grown = torch.zeros(max(64, triton.next_power_of_2(int(n))), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return grown
        if t is not None:
            _RETIRED.append(t)
        _SCRATCH[key] = t = grown
    return t


def ticket_counters(n: int, device) -> torch.Tensor:
    """A zeroed int32 scratch of >= n counters on ``device`` (``int_scratch("ticket", ...)``).

    Kernels use them to elect the last program of a request (``atomic_add`` returns H - 1), which
    then writes the per-request bookkeeping (lengths, has_state) after every program has read it,
    and resets its counter to 0: the scratch is always zero between launches.  One scratch per
    device, so launches that use it must be ordered (one stream), as a model's layers are.
    """
    return int_scratch("ticket", n, device)


def flag_view(x: torch.Tensor) -> torch.Tensor:
    """A bool tensor seen as uint8 (same storage), so kernels can read and set it portably."""
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def check_u_form(buffer: KVBuffer, op: str) -> None:
    """kvbuffer_fast's buffer operations take the u-cache form and update its tensors in place: a raw-form
    buffer is a NotImplementedError, a non-contiguous tensor a ValueError."""
    if buffer.form != "u":
        raise NotImplementedError(
            f"buffer: kvbuffer_fast.{op} implements the u-cache form (k, u, G) only; this buffer is in the raw "
            f"(k, v, g, beta) form.  Use kvbuffer_ref.{op} for it, or build the buffer with form='u'"
        )
    for name, x in buffer.tensors().items():
        require_inplace(f"buffer.{name}", x)


def require_fp32_state(name: str, x: Optional[torch.Tensor]) -> None:
    """The states the recurrent kernels update at every token (recurrent_decode's state, the per-draft
    intermediate states) must be float32: a 16-bit state there would round every token's update (a
    float64 one would silently lose its precision).  A buffer's state, written once per fold, may be
    16-bit: ``require_state_dtype``."""
    if x is not None:
        require_tensor(name, x)
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: kvbuffer_fast keeps states in float32, got {x.dtype} (shape {list(x.shape)}); "
                            f"convert it with .float() (kvbuffer_ref takes any floating dtype)")


#: The dtypes a buffer's (or a pool's) state may be stored in.  Every load converts to float32, the
#: arithmetic is float32, and every store rounds once to the storage dtype (round to nearest even, the
#: conversion Triton's ``.to()`` compiles to); docs/kernels.md, "Reduced-precision state and cache".
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The dtypes of the u-cache (``buffer.u``, ``drafts.u``): rounded the same way when stored.
CACHE_DTYPES = STATE_DTYPES


def require_state_dtype(name: str, x: Optional[torch.Tensor]) -> None:
    """A buffer's state storage (folded into in place): float32, bfloat16 or float16 (``STATE_DTYPES``).
    float64 is refused: the kernels compute in float32 and would silently drop its precision."""
    if x is not None:
        require_tensor(name, x)
        if x.dtype not in STATE_DTYPES:
            raise TypeError(f"{name}: kvbuffer_fast stores buffer states in float32, bfloat16 or float16, got "
                            f"{x.dtype} (shape {list(x.shape)}); convert it with .float() (kvbuffer_ref takes any "
                            f"floating dtype)")


def require_cache_dtypes(buffer: KVBuffer) -> None:
    """The u-cache kvbuffer_fast updates: ``u`` in float32, bfloat16 or float16 (``CACHE_DTYPES``); ``G``
    in float32 (cumulative log-gates: a 16-bit G would carry an absolute error of |G| * 2^-8 into every
    decay exp(G_i - G_j), about 1e-2 relative at a gate span of a few units)."""
    if buffer.u is not None and buffer.u.dtype not in CACHE_DTYPES:
        raise TypeError(f"buffer.u: kvbuffer_fast caches innovations in float32, bfloat16 or float16, got "
                        f"{buffer.u.dtype}")
    if buffer.G is not None and buffer.G.dtype != torch.float32:
        raise TypeError(f"buffer.G: kvbuffer_fast keeps the cumulative log-gates in float32 (a 16-bit G "
                        f"rounds every decay exp(G_i - G_j) by |G| x its epsilon), got {buffer.G.dtype}; "
                        f"convert it with .float()")


def checked_tokens(q, k, v, g, beta, valid=None, buffer: Optional[KVBuffer] = None):
    """``kvbuffer_ref.checks.check_tokens`` and, unless a CUDA graph is being captured, the value domain
    of ``g`` and ``beta`` (``check_gate_values``: no NaN / +inf gate, finite betas; ``valid`` [B, T]: the
    rows to check) and the growth the gates make (``check_growth``; ``buffer``: the checked buffer the
    tokens continue, whose stored G counts too).  Returns (dims, g) with gates below
    ``-RESET_GATE[float32]`` (-inf included: an exact reset) taken as that value, as the reference does (a
    copy, only when there are such gates): the kernels' cumulative gates stay finite, so they never form
    -inf - (-inf) = NaN."""
    d = check_tokens(q, k, v, g, beta)
    if values_checked(q):
        low = -RESET_GATE[torch.float32]
        if check_gate_values(g, beta, valid, below=low):
            g = g.clamp(min=low)
        check_growth(g, valid, buffer)
    return d, g


#: The largest growth in log space (per request, value head and channel) kvbuffer_fast takes: its
#: cumulative forms weigh entries by exp(G_i - G_j) and exp(G_i) in float32, which overflow (to inf, then
#: NaN) past exp(88.7); 80 keeps a margin.  The reference computes any finite gates.
GROWTH_LIMIT = 80.0


def check_growth(g: torch.Tensor, valid: Optional[torch.Tensor] = None, buffer: Optional[KVBuffer] = None) -> None:
    """Positive gates (a growing state) past ``GROWTH_LIMIT``, per request, value head and channel: a
    ValueError naming them (one host sync).  Without ``buffer``: the positive gates of the call's ``valid``
    tokens summed.  With it: also across calls, the largest rise of the buffer's stored G since its last
    flush (from G = 0 there; its fold multiplies by exp(G_end)) and the rise that ends in this call's tokens
    (from the lowest stored G to the tail, plus the call's positive gates), which is never below the sum."""
    if g.numel() == 0:
        return
    if valid is not None:
        g = torch.where(valid.view(*valid.shape, *([1] * (g.dim() - 2))), g, 0.0)
    grow = g.float().clamp(min=0).sum(1)  # [B, HV(, K)]
    if buffer is None:
        message = "g: the positive gates of {where} sum to {worst:.4g} over this call's tokens"
    else:
        G = buffer.G.float()
        B, C = G.shape[:2]
        extra = [1] * (G.dim() - 2)
        live = (torch.arange(C, device=G.device)[None, :] < buffer.lengths[:, None]).view(B, C, *extra)
        zero = torch.zeros_like(G[:, :1])
        lows = torch.cat([zero, torch.where(live, G, torch.inf)], 1).cummin(1).values  # lowest G up to each row
        highs = torch.cat([zero, torch.where(live, G, -torch.inf)], 1)
        stored = (highs - lows).amax(1)  # the largest rise inside the buffer
        last = (buffer.lengths - 1).clamp(min=0).view(B, 1, *extra).expand(B, 1, *G.shape[2:])
        tail = torch.where(buffer.lengths.view(B, *([1] * (G.dim() - 1))) > 0, G.gather(1, last), zero)[:, 0]
        grow = torch.maximum(stored, tail - lows[:, -1] + grow)
        message = ("g: {where} grows by {worst:.4g} in log space since its buffer's last flush (the buffered "
                   "gates and this call's)")
    worst = grow.max()
    if bool(worst > GROWTH_LIMIT):
        idx = [int(i) for i in (grow == worst).nonzero()[0]]
        where = f"request {idx[0]}, value head {idx[1]}" + (f", channel {idx[2]}" if len(idx) > 2 else "")
        raise ValueError(message.format(where=where, worst=float(worst))
                         + f"; kvbuffer_fast's float32 decays exp(G_i - G_j) overflow past {GROWTH_LIMIT:g}; "
                         + ("flush the buffer first or " if buffer is not None else "")
                         + "use kvbuffer_ref for such gates")


def checked_buffer(buffer: KVBuffer, op: str, dims=None, device=None) -> bool:
    """The buffer checks of kvbuffer_fast's buffer operation ``op``: a KVBuffer (TypeError), consistent
    and fitting ``dims`` / ``device`` (``kvbuffer_ref.checks.check_buffer``; its check that reads device
    values is skipped while a CUDA graph is captured), in the u-cache form and contiguous (``check_u_form``).
    Returns whether the device values were checked (``values_checked``), for the op's own such checks."""
    if not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    check_buffer(buffer, dims, device, values=False)
    checked = values_checked(buffer.k)
    if checked:
        check_buffer(buffer, dims, device)
    check_u_form(buffer, op)
    require_state_dtype("buffer.state", buffer.state)
    require_cache_dtypes(buffer)
    return checked


@triton.jit
def _pdl_prologue(PDL: tl.constexpr, WAIT: tl.constexpr = True):
    """With programmatic dependent launch (PDL, sm_90+): wait until the previous kernel of the stream has
    completed and its writes are visible (this kernel's programs may have been placed before that), then
    let the next kernel be launched early.  WAIT=False: only the latter, for a kernel whose first part
    reads nothing the previous kernel writes; it must call _gdc_wait itself before it does.  Nothing
    when PDL is off (the interpreter has no inline asm)."""
    if PDL:
        if WAIT:
            _gdc_wait()
        _gdc_launch_dependents()


def pdl_launch(x: torch.Tensor, on: bool) -> dict:
    """The launch kwargs of a kernel taking a ``PDL`` constexpr, launched on ``x``'s device: PDL (and
    ``launch_pdl``) only when ``on`` and the device is a CUDA GPU of compute capability 9.0 or newer."""
    on = bool(on) and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def _drafts_in_buffer(n, D, C: tl.constexpr):
    """Whether a pool row's D drafts are written to its own buffer rows n..n+D-1 (all fit in its C rows)
    instead of its draft room: verify's rule (``verify._draft_dest``), which accept's copy follows."""
    return n + D <= C


@triton.jit
def _program_ids(H: tl.constexpr, HV: tl.constexpr):
    """(i_v, i_bhv, i_b, i_hv, i_h) of a program of the (V / BV, B * HV) grid every state kernel uses:
    V-tile, (request, value head) as one int64 index, request, value head, and its q/k head
    (value heads i*HV/H .. (i+1)*HV/H - 1 share q/k head i)."""
    i_v = tl.program_id(0)
    i_bhv = tl.program_id(1).to(tl.int64)
    i_b = i_bhv // HV
    i_hv = i_bhv % HV
    i_h = i_hv // (HV // H)
    return i_v, i_bhv, i_b, i_hv, i_h


@triton.jit
def _tile_offsets(i_v, BK: tl.constexpr, BV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """(o_k, o_v, m_k, m_v): the rows and columns of V-tile i_v's [BK, BV] state tile and their masks."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    return o_k, o_v, o_k < K, o_v < V
