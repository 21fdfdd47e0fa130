"""Direct mode: the outputs of short prompts from their tokens alone, with no state (S0 = 0).

The chunk launches of ``kvbuffer_fast.chunk`` with no initial state and no final state written: the
per-chunk launch forms U~ = (I + A)^-1 diag(beta) V and the decayed Q K^T; the state launch, from a zero
state, forms U and, for prompts longer than one chunk, carries the state between chunks; the output
launch computes O = exp(G) Q h + (causal D * Q K^T) U.  A prompt of T <= ``chunk_size`` tokens is one
chunk: h = 0 and U = U~.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvbuffer_ref.checks import check_scale

from ._common import checked_tokens
from .chunk import run_chunks
from .launch import DirectConfig, check_config, config_for, key_of

__all__ = ["direct_gated_delta_rule"]


def direct_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    chunk_size: int = 64,
    config: Optional[DirectConfig] = None,
) -> torch.Tensor:
    """``kvbuffer_ref.direct_gated_delta_rule``: the recurrence from a zero state, no state formed.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV]*; beta: [B, T, HV].  Returns o [B, T, HV, V] in
    v's dtype.  ``chunk_size``: tokens per chunk at most (a prompt within it is a single chunk; as
    ``chunk_gated_delta_rule``'s).  ``config``: a :class:`kvbuffer_fast.launch.DirectConfig`, None for the
    table's.
    """
    d, g = checked_tokens(q, k, v, g, beta)
    s = check_scale(scale, d.K)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    cfg = check_config("direct", config) if config is not None else config_for(
        "direct", key_of(q, B=d.B, HV=d.HV, V=d.V, channel=d.channel_gate))
    cu = [b * d.T for b in range(d.B + 1)]
    o, _ = run_chunks(q, k, v, g, beta, d, cu, s, chunk_size, None, False, cfg)
    return o
