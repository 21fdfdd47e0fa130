"""What serving engines run today, written as well as we can so that the benchmarks' comparison with
the buffered operations is honest.  Not part of the API that mirrors kvbuffer_ref.

recurrent_decode: the recurrent decode step (the state read AND written for every token, 2 |S|).

per_draft_state_verify / per_draft_state_accept: speculative decoding with one state per draft token
(SGLang's ``intermediate_ssm``, vLLM's 1 + num_spec state blocks).  Verify, grid (V / BV, B * HV):
each program loads one [K, BV] tile of a request's state ONCE, runs the gated delta rule over the
request's d draft tokens (a chain) in registers, and writes the output of every token and the state
tile after every token (each intermediate state written exactly once; the state itself is not
modified).  A draft tree (``parents``) continues in registers where a node's parent is the node
before it and otherwise reads its parent's tile back (the intermediate state it wrote, or the state
for a root), as an engine's tree verify reads the parent's intermediate state.  Accept: after the
sampler keeps the first m_b drafts of request b (a chain) or node n_b (a tree), copy
intermediate[b, m_b - 1] (or [b, n_b]) over state[b] (m_b = 0 / n_b = -1 keeps the state), one
launch.  Traffic per request and layer: read |S| + write d |S| in verify (a tree: plus one |S| read
per node whose parent is not the node before it), then read + write |S| in accept; memory: (1 + d)
states per request.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.checks import (check_count_arg, check_parents, check_scale, check_state, require_int_tensor,
                                 require_rank, require_tensor, shape_str)

from ._common import (_program_ids, _tile_offsets, as_input, block, checked_tokens, device_guard, new_output,
                      require_fp32_state, require_inplace, require_no_overlap, values_checked)
from .launch import PerDraftStateConfig, RecurrentConfig, check_config, config_for, key_of
from .recurrent import _gated_delta_step, recurrent_step

__all__ = ["recurrent_decode", "per_draft_state_verify", "per_draft_state_accept"]


def recurrent_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
    config: Optional[RecurrentConfig] = None,
) -> torch.Tensor:
    """Gated delta rule over T tokens (normally 1), updating ``state`` IN PLACE; returns o.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K]; beta: [B, T, HV];
    state: [B, HV, K, V] (contiguous), read and overwritten.  Returns o [B, T, HV, V] in v's dtype;
    the recurrence of ``kvbuffer_ref.recurrent_gated_delta_rule``.
    """
    return recurrent_step(q, k, v, g, beta, state, scale, config)


@triton.jit
def _per_draft_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, inter_ptr, par_ptr,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr, TREE: tl.constexpr,
):
    """The T draft tokens of one (request, value head) on its [K, BV] state tile; the tile after token
    t goes to intermediate [B, T, HV, K, V].  TREE: token t starts from its parent's tile (parents
    [B, T]: -1 = the state), read back from intermediate (or the state) unless the parent is t - 1."""
    i_v, i_bh, i_b, i_hv, i_h = _program_ids(H, HV)
    o_k, o_v, m_k, m_v = _tile_offsets(i_v, BK, BV, K, V)
    m_s = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    s = tl.load(state_ptr + i_bh * K * V + tile, mask=m_s, other=0.0).to(tl.float32)
    for t in range(T):
        i_bt = i_b * T + t
        if TREE:
            p = tl.load(par_ptr + i_bt).to(tl.int32)
            if p != t - 1:
                tl.debug_barrier()  # the tiles this program stored are visible to all its threads
                if p < 0:
                    s = tl.load(state_ptr + i_bh * K * V + tile, mask=m_s, other=0.0).to(tl.float32)
                else:
                    s = tl.load(inter_ptr + ((i_b * T + p) * HV + i_hv) * K * V + tile, mask=m_s,
                                other=0.0).to(tl.float32)
        s = _gated_delta_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, i_bt, i_h, i_hv, o_k, o_v, m_k, m_v,
                              scale, H, HV, K, V, CHANNEL)
        tl.store(inter_ptr + (i_bt * HV + i_hv) * K * V + tile, s.to(inter_ptr.dtype.element_ty), mask=m_s)


@triton.jit
def _per_draft_accept_kernel(state_ptr, inter_ptr, count_ptr, T, HV: tl.constexpr, KV: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Copy block i_blk of intermediate[b, m - 1, hv] over state[b, hv] (nothing when m = 0)."""
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
    parents: Optional[torch.Tensor] = None,
    intermediate: Optional[torch.Tensor] = None,
    config: Optional[PerDraftStateConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify d draft tokens the per-draft-state way; returns (o, intermediate).

    q, k: [B, d, H, K]; v: [B, d, HV, V]; g: [B, d, HV]*; beta: [B, d, HV]; state: [B, HV, K, V]
    (read, not modified).  parents: [B, d] int, a draft tree (-1 = the state; each parent before its
    child; default: the chain).  Returns o [B, d, HV, V] (v's dtype) and intermediate [B, d, HV, K, V]
    in the state's dtype: the state after each draft token (on its root-to-node path).  Pass
    ``intermediate`` (preallocated, as engines keep it) to avoid an allocation per call.
    """
    dims, g = checked_tokens(q, k, v, g, beta)
    if state is None:
        raise ValueError("state: per_draft_state_verify needs the state [B, HV, K, V], got None")
    check_state("state", state, dims, q.device)
    require_fp32_state("state", state)
    require_inplace("state", state)
    s = check_scale(scale, dims.K)
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    tree = parents is not None
    if tree:
        if values_checked(q):
            parents = check_parents(parents, B, T, q.device)
        else:
            require_int_tensor("parents", parents, (B, T), "[B, d]", q.device)
        parents = parents.contiguous()
    if config is None:
        config = config_for("per_draft_state", key_of(q, B=B, HV=HV, V=V, channel=dims.channel_gate))
    cfg = check_config("per_draft_state", config)
    shape_i = (B, T, HV, K, V)
    if intermediate is None:
        intermediate = new_output(shape_i, state.dtype, q.device)
    else:
        require_tensor("intermediate", intermediate)
        if tuple(intermediate.shape) != shape_i or intermediate.device != q.device or not intermediate.is_contiguous():
            raise ValueError(f"intermediate: expected a contiguous tensor [B, d, HV, K, V] = {list(shape_i)} on "
                             f"{q.device}, got {list(intermediate.shape)} on {intermediate.device}"
                             f"{'' if intermediate.is_contiguous() else ' (not contiguous)'}")
        require_fp32_state("intermediate", intermediate)
        require_no_overlap(dict(intermediate=intermediate), dict(q=q, k=k, v=v, g=g, beta=beta, state=state,
                                                                 **({"parents": parents} if tree else {})))
    o = new_output((B, T, HV, V), v.dtype, q.device)
    if B == 0 or T == 0:
        return o, intermediate
    BV = max(16, min(cfg.BV, block(V)))
    with device_guard(q):
        _per_draft_verify_kernel[(triton.cdiv(V, BV), B * HV)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), o, state, intermediate,
            parents if tree else state, s, T, H=dims.H, HV=HV, K=K, V=V, BK=block(K), BV=BV,
            CHANNEL=dims.channel_gate, TREE=tree,
            num_warps=cfg.num_warps,
        )
    return o, intermediate


def per_draft_state_accept(state: torch.Tensor, intermediate: torch.Tensor, counts, *,
                           config: Optional[PerDraftStateConfig] = None) -> torch.Tensor:
    """Commit the first counts[b] drafts of each request: state[b] <- intermediate[b, counts[b] - 1]
    (counts[b] = 0 keeps state[b]).  IN PLACE, one launch; returns ``state``.  For a draft tree, the
    accepted node n_b's state is intermediate[b, n_b]: counts[b] = n_b + 1.

    state: [B, HV, K, V]; intermediate: [B, d, HV, K, V]; counts: int or [B] int tensor in 0..d.
    """
    require_tensor("state", state)
    require_rank("state", state, 4, "[B, HV, K, V]")
    require_fp32_state("state", state)
    require_inplace("state", state)
    require_tensor("intermediate", intermediate)
    if intermediate.dim() != 5 or intermediate.shape[0] != state.shape[0] or intermediate.shape[2:] != state.shape[1:]:
        raise ValueError(f"intermediate: expected [B, d, HV, K, V] matching state {list(state.shape)}, "
                         f"got {shape_str(intermediate)}")
    if intermediate.device != state.device:
        raise ValueError(f"intermediate: expected a tensor on device {state.device} (the device of state), got one "
                         f"on {intermediate.device}")
    require_fp32_state("intermediate", intermediate)
    B, T, HV, K, V = intermediate.shape
    if config is None:
        config = config_for("per_draft_state", key_of(state, B=B, HV=HV, V=V))
    cfg = check_config("per_draft_state", config)
    counts = check_count_arg("counts", counts, B, state.device, f"0..d = 0..{T}")
    if values_checked(state):
        bad = (counts < 0) | (counts > T)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"counts: entry [{b}] is {int(counts[b])}, expected a value in 0..d = 0..{T} "
                             f"(the draft tokens per request in intermediate)")
    counts = counts.contiguous()
    require_no_overlap(dict(state=state), dict(intermediate=intermediate, counts=counts))
    if B == 0 or T == 0:
        return state
    BLOCK = min(cfg.accept_block, triton.next_power_of_2(K * V))
    with device_guard(state):
        _per_draft_accept_kernel[(triton.cdiv(K * V, BLOCK), B * HV)](
            state, as_input(intermediate), counts, T, HV=HV, KV=K * V, BLOCK=BLOCK,
            num_warps=cfg.accept_warps,
        )
    return state
