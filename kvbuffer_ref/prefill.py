"""Prefill hand-off: a prompt becomes a state (its head, folded chunkwise) and a buffer (its tail)."""

from __future__ import annotations

from typing import Optional

import torch

from .buffer import KVBuffer
from .chunk import chunk_gated_delta_rule
from .speculative import accept, verify
from .checks import check_capacity, check_state, check_tokens

__all__ = ["prefill", "default_tail"]


def default_tail(T: int, capacity: int) -> int:
    """Tokens left in the buffer after a prompt of T tokens: all of them while T <= C (no state is
    formed: direct mode), else ``T mod C`` (the head folded into the state is a whole number of buffers)."""
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
) -> tuple[torch.Tensor, KVBuffer]:
    """Process a prompt and hand it off to buffered decoding; returns (o [B, T, HV, V], buffer).

    The first ``T - tail`` tokens are folded chunkwise into the state (on top of ``initial_state``
    if given); the last ``tail`` tokens (0..min(T, C), default ``default_tail(T, C)``) become the
    buffer's entries, their u computed by the buffered form.  A request whose prompt is entirely
    buffered and that has no ``initial_state`` owns no state (direct mode); state storage is
    allocated all the same, so later decodes can fold.
    """
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
