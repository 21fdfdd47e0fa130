"""Helpers shared by the kvbuffer_fast kernels: launch sizes, dtype handling, in-place checks.

Kept free of any particular kernel so that every module (decode, flush, speculative, ...) can use it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import KVBuffer

try:  # grid dependency control (Triton >= 3.3): used only when a launch asks for PDL
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover
    _gdc_wait = _gdc_launch_dependents = None

__all__ = [
    "POISON",
    "block",
    "new_output",
    "as_input",
    "require_inplace",
    "device_guard",
    "ticket_counters",
    "int_scratch",
    "flag_view",
    "launch_config",
]

#: Set to True (tests do) to allocate every library-owned output filled with NaN instead of
#: uninitialised memory, so an element a kernel forgets to write fails loudly.
POISON = False


def block(n: int, minimum: int = 16) -> int:
    """Power-of-two tile covering ``n`` (at least ``minimum``: tl.dot needs 16 on every axis)."""
    return max(minimum, triton.next_power_of_2(int(n)))


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output tensor the kernel fully overwrites (NaN-filled when ``POISON`` is set)."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def as_input(x: torch.Tensor) -> torch.Tensor:
    """A read-only kernel input: contiguous (small per-token tensors; a copy only if needed)."""
    return x if x.is_contiguous() else x.contiguous()


def require_inplace(name: str, x: Optional[torch.Tensor]) -> None:
    """Tensors a kernel updates in place must be contiguous (a copy would silently drop the update)."""
    if x is not None and not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, because the kernel updates it in place "
                         f"(got strides {tuple(x.stride())} for shape {list(x.shape)})")


def device_guard(x: torch.Tensor):
    """Launch on the device that holds ``x`` (the interpreter runs on the CPU)."""
    if x.is_cuda:
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


_SCRATCH: dict = {}


def int_scratch(name: str, n: int, device) -> torch.Tensor:
    """A reusable int32 scratch of >= n entries on ``device``, zeroed when (re)allocated, one per name
    and device (the tickets; decode's length snapshot, which one launch writes and the next reads):
    launches that use one must be stream-ordered."""
    key = (name, str(torch.device(device)))
    t = _SCRATCH.get(key)
    if t is None or t.numel() < n:
        t = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        _SCRATCH[key] = t
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
    if buffer.form != "u":
        raise NotImplementedError(
            f"buffer: kvbuffer_fast.{op} implements the u-cache form (k, u, G) only; this buffer is in the raw "
            f"(k, v, g, beta) form.  Use kvbuffer_ref.{op} for it, or build the buffer with form='u'"
        )
    for name in ("k", "u", "G", "lengths", "has_state", "state"):
        require_inplace(f"buffer.{name}", getattr(buffer, name))


# Launch parameters per kernel: (BV, num_warps); the interpreter ignores num_warps.
# recurrent: best of a sweep on an H200 (bench/results/gpu_decode_h200_run1.json, 91% of copy at B=128).
# decode: BV=64 / 2 warps like recurrent (no stack, sm_90, offline); the GPU tune (bench/gpu_decode.py --tune)
# picks among kvbuffer_fast.decode.DECODE_TUNE_CONFIGS; book: see decode.py.
# flush: no spills at BV=128 / 4 warps (same check).  Docs: docs/kernels.md.  decode pdl="late" (session 5): the
# decode launch waits for the serving fold launch only at its end (51.5 / 93.3 against 51.8 / 93.8 us per step at
# B = 64 / 128, bench/results/h200_probe/session5/call1).
_CONFIG = {
    "recurrent": dict(BV=64, num_warps=2),
    "decode": dict(BV=64, num_warps=2, CB=16, book="launch", variant="lean", fold="split", KB=32, NS=1,
                   loadn=True, keyn=True, kt=False, pf=False, pdl="late", evict="auto"),
    "flush": dict(BV=128, num_warps=4),
    # fold_full: the fold launch; serve (session 4, bench/results/h200_gpu_check/call12_*): the grouped kernel
    # also serves the tokens of the requests it folds (92.9 against 93.6 us per step at B=128 in the tune)
    "fold_full": dict(BV=64, num_warps=2, kernel="auto", FH="auto", KB=32, NS=2, tile_BV=64, tile_warps=4, serve=True,
                      prec="ieee"),
}


def launch_config(name: str, V: int, **override) -> dict:
    """(BV, num_warps, ...) for kernel ``name`` at value dim V; ``override`` replaces entries (benchmarks tune
    with it)."""
    cfg = dict(_CONFIG[name])
    cfg.update({k: v for k, v in override.items() if v is not None})
    cfg["BV"] = min(cfg["BV"], block(V))
    cfg["BV"] = max(cfg["BV"], 16)
    return cfg


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


def pdl_launch(x: torch.Tensor, cfg: dict) -> dict:
    """(PDL flag, launch kwargs) for kernels launched on ``x``'s device: PDL only when ``cfg["pdl"]`` is set
    and the device is a CUDA GPU of compute capability 9.0 or newer."""
    on = bool(cfg.get("pdl")) and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


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
