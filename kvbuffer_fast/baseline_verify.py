"""The per-draft-state verify serving systems use today (SGLang ``intermediate_ssm``, vLLM 1 + num_spec
state blocks), written as well as we can so that the comparison with buffered verify is honest.

per_draft_state_verify, grid (V / BV, B * HV): each program loads one [K, BV] tile of a request's
state ONCE, runs the gated delta rule over the request's d draft tokens (a chain) in registers, and
writes the output of every token plus the full state tile after every token (one intermediate state
per draft token, each written exactly once).  The state itself is not modified: nothing is committed.

per_draft_state_accept: after the sampler decides that request b keeps its first m_b drafts, copy
intermediate[b, m_b - 1] over state[b] (m_b = 0 keeps the state); one launch.

Traffic per request and layer: read |S| + write d |S| in verify, then read + write |S| in accept; memory:
(1 + d) states per request (the persistent one plus d intermediates).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.checks import check_scale, check_state, check_tokens

from ._common import as_input, block, device_guard, new_output, require_inplace
from .recurrent import _gated_delta_step

__all__ = ["per_draft_state_verify", "per_draft_state_accept"]

# verify default: the fastest of bench/gpu_verify.py's sweep on the H200 (B=128, D=5: 471 us at
# BV=64 / 2 warps, 473-529 us for the others), so the comparison is against the baseline at its best.
_CONFIG = {"verify": dict(BV=64, num_warps=2), "accept": dict(BLOCK=2048, num_warps=4)}


@triton.jit
def _per_draft_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, inter_ptr,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    s = tl.load(state_ptr + i_bh * K * V + tile, mask=m_s, other=0.0).to(tl.float32)
    for t in range(T):
        i_bt = i_b * T + t
        s = _gated_delta_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, i_bt, i_h, i_hv, o_k, o_v, m_k, m_v,
                              scale, H, HV, K, V, CHANNEL)
        # intermediate [B, T, HV, K, V]: the state after token t
        tl.store(inter_ptr + (i_bt * HV + i_hv) * K * V + tile, s.to(inter_ptr.dtype.element_ty), mask=m_s)


@triton.jit
def _per_draft_accept_kernel(state_ptr, inter_ptr, count_ptr, T, HV: tl.constexpr, KV: tl.constexpr,
                             BLOCK: tl.constexpr):
    i_blk = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    m = tl.load(count_ptr + i_b).to(tl.int32)
    if m > 0:
        o = i_blk * BLOCK + tl.arange(0, BLOCK)
        mask = o < KV
        src = inter_ptr + ((i_b * T + m - 1) * HV + i_hv) * KV + o
        tl.store(state_ptr + i_bh * KV + o, tl.load(src, mask=mask), mask=mask)


def per_draft_state_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
    intermediate: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    BV: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of d draft tokens the per-draft-state way; returns (o, intermediate).

    q, k: [B, d, H, K]; v: [B, d, HV, V]; g: [B, d, HV]*; beta: [B, d, HV]; state: [B, HV, K, V]
    (read, not modified).  Returns o [B, d, HV, V] (v's dtype) and intermediate [B, d, HV, K, V] in the
    state's dtype: the state after each draft token.  Pass ``intermediate`` (preallocated, as serving
    systems keep it) to avoid an allocation per call.
    """
    dims = check_tokens(q, k, v, g, beta)
    if state is None:
        raise ValueError("state: per_draft_state_verify needs the state [B, HV, K, V], got None")
    check_state("state", state, dims, q.device)
    require_inplace("state", state)
    s = check_scale(scale, dims.K)
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    shape_i = (B, T, HV, K, V)
    if intermediate is None:
        intermediate = new_output(shape_i, state.dtype, q.device)
    elif tuple(intermediate.shape) != shape_i or intermediate.device != q.device or not intermediate.is_contiguous():
        raise ValueError(f"intermediate: expected a contiguous tensor [B, d, HV, K, V] = {list(shape_i)} on "
                         f"{q.device}, got {list(intermediate.shape)} on {intermediate.device}")
    o = out if out is not None else new_output((B, T, HV, V), v.dtype, q.device)
    if B == 0 or T == 0:
        return o, intermediate
    cfg = dict(_CONFIG["verify"])
    cfg.update({n: x for n, x in (("BV", BV), ("num_warps", num_warps)) if x is not None})
    bv = max(16, min(cfg["BV"], block(V)))
    with device_guard(q):
        _per_draft_verify_kernel[(triton.cdiv(V, bv), B * HV)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), o, state, intermediate,
            s, T, H=dims.H, HV=HV, K=K, V=V, BK=block(K), BV=bv, CHANNEL=dims.channel_gate,
            num_warps=cfg["num_warps"],
        )
    return o, intermediate


def per_draft_state_accept(state: torch.Tensor, intermediate: torch.Tensor, counts) -> torch.Tensor:
    """Commit the first counts[b] drafts of each request: state[b] <- intermediate[b, counts[b] - 1]
    (counts[b] = 0 keeps state[b]).  IN PLACE, one launch; returns ``state``.

    state: [B, HV, K, V]; intermediate: [B, d, HV, K, V]; counts: int or [B] int tensor in 0..d.
    """
    require_inplace("state", state)
    if intermediate.dim() != 5 or intermediate.shape[0] != state.shape[0] or intermediate.shape[2:] != state.shape[1:]:
        raise ValueError(f"intermediate: expected [B, d, HV, K, V] matching state {list(state.shape)}, "
                         f"got {list(intermediate.shape)}")
    B, T, HV, K, V = intermediate.shape
    if isinstance(counts, int) and not isinstance(counts, bool):
        counts = torch.full((B,), counts, dtype=torch.long, device=state.device)
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (B,) or counts.dtype.is_floating_point:
        raise ValueError(f"counts: expected an int or an integer tensor [B] = [{B}]")
    counts = counts.to(device=state.device).contiguous()
    if B == 0 or T == 0:
        return state
    BLOCK = min(_CONFIG["accept"]["BLOCK"], triton.next_power_of_2(K * V))
    with device_guard(state):
        _per_draft_accept_kernel[(triton.cdiv(K * V, BLOCK), B * HV)](
            state, as_input(intermediate), counts, T, HV=HV, KV=K * V, BLOCK=BLOCK,
            num_warps=_CONFIG["accept"]["num_warps"],
        )
    return state
