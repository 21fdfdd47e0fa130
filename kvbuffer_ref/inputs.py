"""Turn validated user inputs into the reference's working form (one place, used by every op)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import compute_dtype, expand_heads
from .checks import RESET_GATE, Dims, check_gate_values, check_scale, check_tokens

__all__ = ["Tokens", "prepare_tokens"]


@dataclass(frozen=True)
class Tokens:
    """Per-token inputs in the compute dtype, q scaled, q/k expanded to value heads.

    q, k: [B, T, HV, K]; v: [B, T, HV, V]; g: [B, T, HV]*; beta: [B, T, HV];
    ``k_heads`` keeps the keys per q/k head [B, T, H, K] for caching.
    """

    dims: Dims
    q: torch.Tensor
    k: torch.Tensor
    k_heads: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    out_dtype: torch.dtype


def prepare_tokens(q, k, v, g, beta, scale, *, check_values: bool = True) -> Tokens:
    """Validate, pick the compute dtype (float64 stays, narrower types run in float32), scale q.

    Gates below ``-RESET_GATE[dt]`` (-inf included), whose decay is exactly 0 in ``dt``, are taken as
    ``-RESET_GATE[dt]`` (the same decay, 0, and finite cumulative sums; ``checks.RESET_GATE``); every
    other gate is passed on unchanged, bit for bit.  ``check_values=False``: the caller checks the
    values of ``g`` and ``beta`` itself (``checks.check_gate_values``; verify, over its valid rows only).
    """
    dims = check_tokens(q, k, v, g, beta)
    if check_values:
        check_gate_values(g, beta)
    s = check_scale(scale, dims.K)
    dt = compute_dtype(q.dtype)
    k_heads = k.to(dt)
    return Tokens(
        dims=dims,
        q=expand_heads(q.to(dt) * s, dims.HV),
        k=expand_heads(k_heads, dims.HV),
        k_heads=k_heads,
        v=v.to(dt),
        g=g.to(dt).clamp(min=-RESET_GATE[dt]),
        beta=beta.to(dt),
        out_dtype=v.dtype,
    )
