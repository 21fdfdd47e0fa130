"""Direct mode: outputs from the tokens alone, with no state (short contexts)."""

from __future__ import annotations

from typing import Optional

import torch

from .core import innovations, outputs
from .inputs import prepare_tokens

__all__ = ["direct_gated_delta_rule"]


def direct_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Stateless gated delta rule over the whole sequence: S0 = 0, every token buffered.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV]*; beta: [B, T, HV].  Returns o [B, T, HV, V]
    equal to the recurrence from a zero state, computed as one triangular solve for u
    (``(I + A) U = diag(beta) V``) and one masked product for o.
    """
    x = prepare_tokens(q, k, v, g, beta, scale)
    T = x.dims.T
    G = x.g.cumsum(dim=1)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1)
    u = innovations(x.k, x.v, x.beta, G, causal)
    return outputs(x.q, x.k, u, G, causal).to(x.out_dtype)
