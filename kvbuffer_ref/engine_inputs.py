"""Engine inputs: what a serving engine's gated-delta-rule layer hands its kernels, turned into the
oracle's per-token inputs.

SGLang, vLLM and FlashInfer call their GDN kernels for Qwen3-Next / Qwen3.5 with the packed output of
the layer's short convolution, ``mixed_qkv`` (q | k | v of a token, heads flattened), the raw gating
inputs (``A_log``, ``dt_bias`` per value head, ``a``, ``b`` per token and value head) and q, k still to
be L2-normalised.  ``engine_inputs`` is the exact map from those to ``q, k, v, g, beta`` of every
operation of this package::

    g    = -exp(A_log) * softplus(a + dt_bias)      (softplus(x) = x past the threshold, 20, as engines do)
    beta = sigmoid(b)
    q, k = x / sqrt(sum(x^2) + eps)                 (per head, eps = 1e-6, when qk_l2norm)

``kvbuffer_fast.engine_inputs`` computes the same in one launch; docs/serving.md shows it in an
engine's step.
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import RESET_GATE, require_float, require_tensor, shape_str

__all__ = ["engine_inputs", "check_engine_inputs", "SOFTPLUS_THRESHOLD", "NORM_EPS"]

#: Past this, softplus(x) is taken as x (torch's and the engines' default; the difference is below 2e-9).
SOFTPLUS_THRESHOLD = 20.0
#: The L2 norm's epsilon: x / sqrt(sum(x^2) + NORM_EPS), as flash-linear-attention's l2norm and the
#: engines' in-kernel norm.
NORM_EPS = 1e-6


def check_engine_inputs(mixed_qkv, a, b, A_log, dt_bias, num_heads: int, head_k_dim: int, *,
                        check_values: bool = True) -> tuple[int, int, int, int, int, int]:
    """Check ``engine_inputs``' arguments; returns (B, T, H, HV, K, V).

    mixed_qkv: [N, 2 H K + HV V] (one token per request) or [B, T, 2 H K + HV V]; a, b: [N, HV] or
    [B, T, HV]; A_log, dt_bias: [HV] with HV their length.  ``check_values``: also the values (one host
    read): no NaN in a or b, finite A_log and dt_bias."""
    for name, x in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        require_tensor(name, x)
        require_float(name, x)
    for name, n in (("num_heads", num_heads), ("head_k_dim", head_k_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.dim() != 1 or x.shape[0] == 0:
            raise ValueError(f"{name}: expected [HV] (one value per value head, HV >= 1), got {shape_str(x)}")
    HV = A_log.shape[0]
    if dt_bias.shape[0] != HV:
        raise ValueError(f"dt_bias: expected [HV] = [{HV}] (the length of A_log), got {shape_str(dt_bias)}")
    if mixed_qkv.dim() not in (2, 3):
        raise ValueError(f"mixed_qkv: expected [N, 2 H K + HV V] or [B, T, 2 H K + HV V], got rank "
                         f"{mixed_qkv.dim()} with shape {shape_str(mixed_qkv)}")
    lead = tuple(mixed_qkv.shape[:-1])
    B, T = (lead[0], 1) if mixed_qkv.dim() == 2 else lead
    H, K = num_heads, head_k_dim
    if HV % H:
        raise ValueError(f"A_log: the number of value heads HV={HV} (its length) must be a multiple of "
                         f"num_heads={H} (value head i uses q/k head i // (HV // H))")
    rest = mixed_qkv.shape[-1] - 2 * H * K
    if rest <= 0 or rest % HV:
        raise ValueError(f"mixed_qkv: the last dimension {mixed_qkv.shape[-1]} must be 2 H K + HV V with H = {H}, "
                         f"K = {K}, HV = {HV} and V >= 1 (q | k | v of a token, heads flattened)")
    V = rest // HV
    for name, x in (("a", a), ("b", b)):
        if tuple(x.shape) != lead + (HV,):
            want = "[N, HV]" if mixed_qkv.dim() == 2 else "[B, T, HV]"
            raise ValueError(f"{name}: expected {want} = {list(lead + (HV,))} (mixed_qkv's leading dimensions, "
                             f"then the value heads), got {shape_str(x)}")
    devices = {x.device for x in (mixed_qkv, a, b, A_log, dt_bias)}
    if len(devices) > 1:
        raise ValueError(f"mixed_qkv, a, b, A_log, dt_bias: expected one device, got {sorted(map(str, devices))}")
    if check_values:
        for name, x in (("a", a), ("b", b)):
            if x.numel() and bool(torch.isnan(x).any()):
                raise ValueError(f"{name}: NaN at index {tuple(torch.isnan(x).nonzero()[0].tolist())}")
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if not bool(torch.isfinite(x).all()):
                i = int((~torch.isfinite(x)).nonzero()[0, 0])
                raise ValueError(f"{name}: expected finite values (a per-head parameter), got {float(x[i])} at "
                                 f"value head {i}")
    return B, T, H, HV, K, V


def engine_inputs(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, num_heads: int, head_k_dim: int, qk_l2norm: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, g, beta) of an engine's packed tokens and raw gates, the inputs of every operation.

    mixed_qkv: [N, 2 H K + HV V] (decode: one token per request, read as B = N, T = 1) or
    [B, T, 2 H K + HV V] (a varlen batch: B = 1, T the total), q | k | v of each token with heads
    flattened; a, b: [N, HV] or [B, T, HV]; A_log, dt_bias: [HV]; num_heads H, head_k_dim K (V follows).

    Returns q, k [B, T, H, K] (L2-normalised per head when ``qk_l2norm``), v [B, T, HV, V] in mixed_qkv's
    dtype (a copy), and g, beta [B, T, HV].  q, k, g and beta are in the compute dtype: float64 for float64
    inputs, float32 otherwise (normalised keys are not rounded back to 16 bits).  Computed in float64 and
    rounded once.  A gate whose decay is 0 in the compute dtype (a = +inf, or a decay below its range) is
    returned as ``-RESET_GATE`` of that dtype (200 in float32, 2000 in float64: the same decay, as every
    operation takes -inf); a = -inf gives g = 0 (no decay, whatever A_log), b = -inf / +inf gives
    beta = 0 / 1.
    """
    B, T, H, HV, K, V = check_engine_inputs(mixed_qkv, a, b, A_log, dt_bias, num_heads, head_k_dim)
    dt = torch.float64 if mixed_qkv.dtype == torch.float64 else torch.float32
    D = mixed_qkv.shape[-1]
    x = mixed_qkv.reshape(B, T, D).to(torch.float64)
    q = x[..., :H * K].unflatten(-1, (H, K))
    k = x[..., H * K:2 * H * K].unflatten(-1, (H, K))
    v = mixed_qkv.reshape(B, T, D)[..., 2 * H * K:].unflatten(-1, (HV, V)).clone()
    if qk_l2norm:
        q = q / torch.sqrt(torch.einsum("bthk,bthk->bth", q, q) + NORM_EPS)[..., None]
        k = k / torch.sqrt(torch.einsum("bthk,bthk->bth", k, k) + NORM_EPS)[..., None]
    z = a.reshape(B, T, HV).to(torch.float64) + dt_bias.to(torch.float64)
    softplus = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z)))
    rate = torch.exp(A_log.to(torch.float64))
    g = -rate * softplus
    g = torch.where(softplus == 0, torch.zeros_like(g), torch.where(torch.isinf(softplus), -torch.inf, g))
    g = g.clamp(min=-RESET_GATE[dt]).to(dt)
    beta = torch.sigmoid(b.reshape(B, T, HV).to(torch.float64))
    return q.to(dt, copy=True), k.to(dt, copy=True), v, g, beta.to(dt)  # never views of mixed_qkv
