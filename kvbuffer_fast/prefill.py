"""Prefill hand-off: a prompt's head folded into the state and its tail written into a KVBuffer, in one
pass over the state.

The chunk launches of ``kvbuffer_fast.chunk`` over a chunk table in which each prompt's last ``tail``
tokens form one chunk of their own.  The state launch walks a prompt's head chunks with the state tile in
registers (chunks folded), then reaches the tail chunk: its innovations U = U~ - W S on the state after
the head are exactly the buffer's u-cache rows (u_i relative to the stale state, G_i the cumulative gate
since the buffer's start), so it stores the tail's U, G and keys into the buffer's rows 0..tail-1 and does
not fold it; the state tile it holds is the buffer's stale state.  The output launch forms every chunk's
outputs, the tail's included.  The buffer is the one ``kvbuffer_ref.prefill`` builds (u-cache form, fp32 u, G, keys and state,
rows past the length 0), so ``kvbuffer_fast.buffered_decode`` continues from it.  Ragged prompts
(``cu_seqlens``) go in one launch, one buffer request per prompt.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import Dims, check_capacity, check_chunk_size, check_scale, check_state
from kvbuffer_ref.prefill import default_tail
from kvbuffer_ref.recurrent import check_cu_seqlens

from ._common import checked_tokens, on_device
from .chunk import run_chunks
from .launch import PrefillConfig, check_config, config_for, key_of

__all__ = ["prefill"]


def _tails(tail, lengths: list[int], capacity: int) -> list[int]:
    """Each prompt's tail: ``default_tail`` for None, else the int ``tail`` (0..min(length, C) for every prompt)."""
    if tail is None:
        return [default_tail(n, capacity) for n in lengths]
    bound = min(min(lengths, default=0), capacity)
    if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail <= bound:
        raise ValueError(f"tail: expected an int in 0..min(T, C) = 0..{bound} (the shortest prompt and the capacity), "
                         f"got {tail!r}")
    return [tail] * len(lengths)


def _buffer_rows(tails: list[int], owns: list[bool], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths [N] int64, has_state [N] bool) on ``device``, cached like the chunk tables
    (``_common.on_device``), so a repeated call copies nothing from the host."""
    return on_device(("prefill rows", tuple(tails), tuple(owns)), device, lambda: (
        torch.tensor(tails, dtype=torch.long, device=device), torch.tensor(owns, dtype=torch.bool, device=device)))


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    capacity: int,
    tail: Optional[int] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    form: str = "u",
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    config: Optional[PrefillConfig] = None,
) -> tuple[torch.Tensor, KVBuffer]:
    """``kvbuffer_ref.prefill`` on the chunk kernels; returns (o [B, T, HV, V] in v's dtype, a new KVBuffer).

    The first T - tail tokens are folded chunkwise into the state (on top of ``initial_state``), the last
    ``tail`` (0..min(T, C); default ``default_tail(T, C)``) become the buffer's entries in the u-cache form.
    A request with no head and no ``initial_state`` owns no state (direct mode); state storage is allocated
    for every request.  ``cu_seqlens`` (int [N + 1], B = 1): N prompts concatenated along T, one buffer
    request each (``tail`` None: each prompt's default; an int: the same for all), initial_state
    [N, HV, K, V].  ``form``: "u" only (``NotImplementedError`` for "raw").  ``chunk_size``: tokens per chunk
    at most (as ``chunk_gated_delta_rule``'s).  ``config``: a :class:`kvbuffer_fast.launch.PrefillConfig`, None
    for the table's.
    """
    d, g = checked_tokens(q, k, v, g, beta)
    check_capacity(capacity)
    check_chunk_size(chunk_size)
    if form not in ("u", "raw"):
        raise ValueError(f"form: expected 'u' (u-cache) or 'raw' (k, v, g, beta), got {form!r}")
    if form == "raw":
        raise NotImplementedError("form: kvbuffer_fast.prefill builds the u-cache form (k, u, G) only; use "
                                  "kvbuffer_ref.prefill for the raw form")
    s = check_scale(scale, d.K)
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, q, initial_state)
    else:
        cu = [b * d.T for b in range(d.B + 1)]
    N = len(cu) - 1
    check_state("initial_state", initial_state, Dims(**{**d.__dict__, "B": N}), q.device)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    tails = _tails(tail, lengths, capacity)
    cfg = check_config("prefill", config) if config is not None else config_for(
        "prefill", key_of(q, C=capacity, B=N, HV=d.HV, V=d.V, channel=d.channel_gate))
    buf = KVBuffer.empty(N, d.H, d.HV, d.K, d.V, capacity, channel_gate=d.channel_gate, form="u",
                         dtype=torch.float32, device=q.device)
    o, S = run_chunks(q, k, v, g, beta, d, cu, s, chunk_size, initial_state, True, cfg, tails=tails, buffer=buf)
    owns = [n - t > 0 or initial_state is not None for n, t in zip(lengths, tails)]
    buf = buf.replace(state=S)
    lengths, has_state = _buffer_rows(tails, owns, q.device)
    buf.lengths.copy_(lengths)
    buf.has_state.copy_(has_state)
    return o, buf
