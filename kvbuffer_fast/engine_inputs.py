"""Engine inputs in one launch: an engine's packed tokens and raw gates turned into the operations' q, k, v,
g, beta (``kvbuffer_ref.engine_inputs``' signature and results; docs/serving.md).

One program per token: q and k L2-normalised per head in float32 (stored in float32: normalised keys are
not rounded back to 16 bits), v copied out of the packed row into a contiguous [HV, V] (mixed_qkv's
dtype), g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) in float32.  mixed_qkv may be a
strided view (its rows at any stride, its last dimension contiguous), as an engine slices it from the
convolution's output; the outputs are contiguous, so the operations that follow copy nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvbuffer_ref.checks import RESET_GATE
from kvbuffer_ref.engine_inputs import NORM_EPS, SOFTPLUS_THRESHOLD, check_engine_inputs

from ._common import as_input, block, device_guard, new_output, values_checked

__all__ = ["engine_inputs"]


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """exp(x): libdevice's, compiled (tl.exp compiles to the GPU's approximate ex2, whose relative error grows
    with |x|: 1e-6 at x = -28); tl.exp under the Triton interpreter (numpy's, which has no libdevice)."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log1p(e, LIBDEVICE: tl.constexpr):
    """log(1 + e) for e >= 0 to a few ulps: libdevice's, compiled; under the interpreter Goldberg's
    log(u) e / (u - 1) with u = 1 + e rounded."""
    if LIBDEVICE:
        return libdevice.log1p(e)
    else:
        u = 1.0 + e
        return tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _engine_inputs_kernel(x_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                          T, sx_b, sx_t, sa_b, sa_t, sb_b, sb_t, RESET, THRESHOLD, EPS,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BH: tl.constexpr, BK: tl.constexpr, BHV: tl.constexpr, BVV: tl.constexpr,
                          NORM: tl.constexpr, LIBDEVICE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # the token: request i // T, position i % T
    bi, ti = i // T, i % T
    row = x_ptr + bi * sx_b + ti * sx_t
    h = tl.arange(0, BH)[:, None]
    kk = tl.arange(0, BK)[None, :]
    m = (h < H) & (kk < K)
    for part in tl.static_range(2):  # q, then k
        x = tl.load(row + part * H * K + h * K + kk, mask=m, other=0.0).to(tl.float32)
        if NORM:
            x = x / tl.sqrt(tl.sum(x * x, axis=1) + EPS)[:, None]
        out = q_ptr if part == 0 else k_ptr
        tl.store(out + i * H * K + h * K + kk, x, mask=m)
    j = tl.arange(0, BVV)
    mv = j < HV * V
    tl.store(v_ptr + i * HV * V + j, tl.load(row + 2 * H * K + j, mask=mv), mask=mv)
    c = tl.arange(0, BHV)
    mh = c < HV
    z = (tl.load(a_ptr + bi * sa_b + ti * sa_t + c, mask=mh, other=0.0).to(tl.float32)
         + tl.load(dtb_ptr + c, mask=mh, other=0.0).to(tl.float32))
    sp = tl.where(z > THRESHOLD, z, _log1p(_exp(tl.minimum(z, THRESHOLD), LIBDEVICE), LIBDEVICE))
    g = -_exp(tl.load(alog_ptr + c, mask=mh, other=0.0).to(tl.float32), LIBDEVICE) * sp
    g = tl.where(sp == 0.0, 0.0, tl.where(sp == float("inf"), -RESET, g))
    tl.store(g_ptr + i * HV + c, tl.maximum(g, -RESET), mask=mh)
    bv = tl.load(b_ptr + bi * sb_b + ti * sb_t + c, mask=mh, other=0.0).to(tl.float32)
    e = _exp(-tl.abs(bv), LIBDEVICE)  # sigmoid without overflow: 1 / (1 + e) for b >= 0, e / (1 + e) below
    tl.store(beta_ptr + i * HV + c, tl.where(bv >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), mask=mh)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` with a contiguous last dimension, and its (request, position) strides in elements."""
    if x.stride(-1) != 1:
        x = as_input(x)
    if x.dim() == 2:
        return x, x.stride(0), 0
    return x, x.stride(0), x.stride(1)


def engine_inputs(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, num_heads: int, head_k_dim: int, qk_l2norm: bool = True):
    """As ``kvbuffer_ref.engine_inputs`` (q, k, g, beta in float32; v in mixed_qkv's dtype), one launch.
    mixed_qkv: float32, bfloat16 or float16 (float64 is refused: the kernel computes in float32).  The
    values of a, b, A_log and dt_bias are checked on the host except while a CUDA graph is captured."""
    if isinstance(mixed_qkv, torch.Tensor) and mixed_qkv.dtype == torch.float64:
        raise TypeError("mixed_qkv: kvbuffer_fast.engine_inputs computes in float32, got float64; use "
                        "kvbuffer_ref.engine_inputs for float64")
    checked = isinstance(mixed_qkv, torch.Tensor) and values_checked(mixed_qkv)
    B, T, H, HV, K, V = check_engine_inputs(mixed_qkv, a, b, A_log, dt_bias, num_heads, head_k_dim,
                                            check_values=checked)
    dev = mixed_qkv.device
    q = new_output((B, T, H, K), torch.float32, dev)
    k = new_output((B, T, H, K), torch.float32, dev)
    v = new_output((B, T, HV, V), mixed_qkv.dtype, dev)
    g = new_output((B, T, HV), torch.float32, dev)
    beta = new_output((B, T, HV), torch.float32, dev)
    if B * T == 0:
        return q, k, v, g, beta
    x, sx_b, sx_t = _rows(mixed_qkv)
    a_, sa_b, sa_t = _rows(a)
    b_, sb_b, sb_t = _rows(b)
    with device_guard(mixed_qkv):
        _engine_inputs_kernel[(B * T,)](
            x, a_, b_, as_input(A_log), as_input(dt_bias), q, k, v, g, beta, T, sx_b, sx_t, sa_b, sa_t, sb_b, sb_t,
            RESET_GATE[torch.float32], SOFTPLUS_THRESHOLD, NORM_EPS, H=H, HV=HV, K=K, V=V, BH=block(H, 1),
            BK=block(K, 1), BHV=block(HV, 1), BVV=block(HV * V, 1), NORM=bool(qk_l2norm),
            LIBDEVICE=x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), num_warps=4)
    return q, k, v, g, beta
