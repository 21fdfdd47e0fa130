"""Prefill hand-off: a prompt becomes a state (its head, folded chunkwise) and a buffer (its tail)."""

from __future__ import annotations

from typing import Optional

import torch

from .buffer import KVBuffer
from .chunk import chunk_gated_delta_rule
from .speculative import accept, verify
from .checks import check_capacity, check_state, check_tokens
from .recurrent import check_cu_seqlens

__all__ = ["prefill", "default_tail"]


def default_tail(T: int, capacity: int) -> int:
    """Tokens left in the buffer after a prompt of T tokens: all of them while T <= C (no state is
    formed: direct mode), else ``T mod C`` (the head folded into the state is a whole number of buffers)."""
    check_capacity(capacity)
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T: expected an int >= 0 (the prompt's tokens), got {T!r}")
    return T if T <= capacity else T % capacity


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
) -> tuple[torch.Tensor, KVBuffer]:
    """Process a prompt and hand it off to buffered decoding; returns (o [B, T, HV, V], buffer).

    The first ``T - tail`` tokens are folded chunkwise into the state (on top of ``initial_state``
    if given); the last ``tail`` tokens (0..min(T, C), default ``default_tail(T, C)``) become the
    buffer's entries, their u computed by the buffered form.  A request whose prompt is entirely
    buffered and that has no ``initial_state`` owns no state (direct mode); state storage is
    allocated all the same, so later decodes can fold.

    ``cu_seqlens`` ([N + 1] int offsets, B = 1): N prompts concatenated along T, each prefilled alone
    into request n of one buffer of N requests (``tail`` None: each prompt's default tail; an int: the
    same tail for every prompt); ``initial_state`` is then [N, HV, K, V].
    """
    if cu_seqlens is not None:
        return _prefill_ragged(q, k, v, g=g, beta=beta, capacity=capacity, tail=tail, scale=scale,
                               initial_state=initial_state, form=form, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    d = check_tokens(q, k, v, g, beta)
    check_capacity(capacity)
    check_state("initial_state", initial_state, d, q.device)
    if form not in ("u", "raw"):
        raise ValueError(f"form: expected 'u' (u-cache) or 'raw' (k, v, g, beta), got {form!r}")
    if tail is None:
        tail = default_tail(d.T, capacity)
    if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail <= min(d.T, capacity):
        raise ValueError(f"tail: expected an int in 0..min(T, C) = 0..{min(d.T, capacity)}, got {tail!r}")
    head = d.T - tail
    o_head, S = chunk_gated_delta_rule(
        q[:, :head], k[:, :head], v[:, :head], g=g[:, :head], beta=beta[:, :head],
        scale=scale, initial_state=initial_state, output_final_state=True, chunk_size=chunk_size,
    )
    dt = S.dtype
    buffer = KVBuffer.empty(d.B, d.H, d.HV, d.K, d.V, capacity, channel_gate=d.channel_gate, form=form,
                            dtype=dt, device=q.device)
    owns = head > 0 or initial_state is not None
    buffer = buffer.replace(state=S, has_state=torch.full((d.B,), owns, dtype=torch.bool, device=q.device))
    tl = slice(head, d.T)
    o_tail, drafts = verify(q[:, tl], k[:, tl], v[:, tl], g=g[:, tl], beta=beta[:, tl], buffer=buffer, scale=scale)
    return torch.cat([o_head, o_tail], dim=1), accept(buffer, drafts, counts=tail)


def _prefill_ragged(q, k, v, *, g, beta, capacity, tail, scale, initial_state, form, chunk_size, cu_seqlens):
    """``prefill`` of each prompt of a variable-length batch alone; the buffers side by side (dim 0)."""
    check_tokens(q, k, v, g, beta)
    check_capacity(capacity)
    cu = check_cu_seqlens(cu_seqlens, q, initial_state)
    outs, bufs = [], []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        sl = slice(a, b)
        s0 = None if initial_state is None else initial_state[n:n + 1]
        o, buf = prefill(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], capacity=capacity, tail=tail,
                         scale=scale, initial_state=s0, form=form, chunk_size=chunk_size)
        outs.append(o)
        bufs.append(buf)
    if not bufs:  # no prompt (cu_seqlens = [0]): an empty buffer of N = 0 requests
        s0 = None if initial_state is None else initial_state[:0]
        o, buf = prefill(q[:0], k[:0], v[:0], g=g[:0], beta=beta[:0], capacity=capacity, tail=tail, scale=scale,
                         initial_state=s0, form=form, chunk_size=chunk_size)
        return o.new_zeros(1, 0, *o.shape[2:]), buf
    fields = {name: None if x is None else torch.cat([getattr(bf, name) for bf in bufs], dim=0)
              for name, x in bufs[0].tensors().items()}
    return torch.cat(outs, dim=1), KVBuffer(**fields)
