"""flush (fold a prefix of every request's buffer into its state, in place) and materialize_state.

``_flush_kernel``, grid (V / BV, B * HV): for a per-request prefix m (count[b]) a program folds
    S = diag(exp(G_m)) S0 + sum_{j<m} (exp(G_m - G_j) * k_j) u_j^T
into its [K, BV] state tile (``_fold.fold_tile``, the loop of decode's tile fold: FB entries per fold
step) and moves the remaining u columns of its tile down by m.  The keys and G, shared with other
programs, are moved and rebased afterwards in plain torch (small tensors).

A serving pool (``kvbuffer_fast.pool.KVPool.flush``) runs the same launch through ``flush_pool`` on a
``PoolLayer`` (``_flush_slots_kernel``, the same grid and body): each call row on its slot's buffer row,
the state read from and written to the slots the pool's bookkeeping gives it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import check_flush_count

from ._common import PoolLayer, _program_ids, _tile_offsets, block, checked_buffer, device_guard, flag_view
from ._fold import fold_tile
from .launch import FlushConfig, Key, check_config, config_for

__all__ = ["flush", "flush_pool", "materialize_state"]


@triton.jit
def _flush_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FB: tl.constexpr, CHANNEL: tl.constexpr,
):
    """Fold the first m entries into the state tile and move this tile's remaining u columns down.
    A request in direct mode folds into S0 = 0 (its storage is not read)."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    _flush_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr, i_v, i_b, i_hv, i_h, i_b, i_bhv,
                   i_bhv, C, H, HV, K, V, BC, BK, BV, FB, CHANNEL)


@triton.jit
def _flush_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr, bslot_ptr, sread_ptr, swrite_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FB: tl.constexpr, CHANNEL: tl.constexpr,
):
    """``_flush_kernel`` on a pool: row i_b (its count count[i_b]) folds buffer row ``bslot[i_b]`` on the
    state of slot ``sread[i_b]`` (-1: none) into slot ``swrite[i_b]``, int64 offsets; a pad (-1) does
    nothing."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        s_r = tl.maximum(tl.load(sread_ptr + i_b).to(tl.int64), 0)
        s_w = tl.load(swrite_ptr + i_b).to(tl.int64)
        _flush_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr, i_v, i_b, i_hv, i_h, c_b,
                       s_r * HV + i_hv, s_w * HV + i_hv, C, H, HV, K, V, BC, BK, BV, FB, CHANNEL)


@triton.jit
def _flush_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr, i_v, i_b, i_hv, i_h, c_b,
                   s_r, s_w, C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FB: tl.constexpr,
                   CHANNEL: tl.constexpr):
    """The body of the flush kernels: count row i_b on buffer row c_b, the state read at row s_r and
    written at row s_w (per value head: slot * HV + i_hv; outside a pool all are the program's own)."""
    m = tl.load(count_ptr + i_b).to(tl.int32)
    if m > 0:
        n = tl.load(len_ptr + c_b).to(tl.int32)
        owns = tl.load(own_ptr + c_b) != 0
        o_c = tl.arange(0, BC)
        o_k, o_v, m_k, m_v = _tile_offsets(i_v, BK, BV, K, V)
        p_s = state_ptr + (s_r * K + o_k[:, None]) * V + o_v[None, :]
        s = tl.load(p_s, mask=(o_k < tl.where(owns, K, 0))[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        s = fold_tile(s, ck_ptr, cu_ptr, cg_ptr, c_b, i_h, i_hv, m, o_k, o_v, m_k, m_v, C, H, HV, K, V, FB,
                      CHANNEL)
        p_s = state_ptr + (s_w * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
        m_rest = (o_c >= m) & (o_c < n)  # entries that stay: row j moves to row j - m
        p_cu = cu_ptr + ((c_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :]
        uc = tl.load(p_cu, mask=m_rest[:, None] & m_v[None, :], other=0.0)
        tl.debug_barrier()  # every warp has read the rows before any is overwritten
        tl.store(p_cu - m * HV * V, uc, mask=m_rest[:, None] & m_v[None, :])


def flush(buffer: KVBuffer, *, count=None, config: Optional[FlushConfig] = None) -> KVBuffer:
    """Fold the first ``count`` entries of each request into its state, IN PLACE; return the buffer.

    count: None (all entries), an int, or a [B] int tensor, each in 0..lengths[b] (the range is checked
    unless a CUDA graph is being captured).  Folded requests own a state from now on; the remaining
    entries move to the front and their cumulative gates are rebased (``G_i - G_count``).  A buffer
    without state storage (``state is None``) gets a zero-initialised one: then the returned buffer is a
    new object sharing every other tensor.  ``config``: a :class:`kvbuffer_fast.launch.FlushConfig`,
    None for the launch table's.
    """
    checked = checked_buffer(buffer, "flush")
    count = check_flush_count(count, buffer.lengths, checked)
    cfg = check_config("flush", config_for("flush", Key()) if config is None else config)
    if buffer.state is None:
        B, HV, K, V = buffer.batch, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim
        state = torch.zeros(B, HV, K, V, dtype=torch.promote_types(buffer.u.dtype, torch.float32),
                            device=buffer.k.device)
        buffer = buffer.replace(state=state)
    B, C, H, K = buffer.k.shape
    HV, V = buffer.num_value_heads, buffer.head_v_dim
    if B == 0:
        return buffer
    BV = max(16, min(cfg.BV, block(V)))
    with device_guard(buffer.k):
        _flush_kernel[(triton.cdiv(V, BV), B * HV)](
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state, count,
            C=C, H=H, HV=HV, K=K, V=V, BC=block(C), BK=block(K), BV=BV, FB=cfg.FB, CHANNEL=buffer.channel_gate,
            num_warps=cfg.num_warps,
        )
        _shift_keys_and_gates(buffer, count)
    buffer.lengths.sub_(count)
    buffer.has_state.logical_or_(count > 0)
    return buffer


def flush_pool(pool: PoolLayer, *, count: torch.Tensor, lengths: torch.Tensor, read: torch.Tensor,
               write: torch.Tensor, config: FlushConfig) -> None:
    """``flush`` on a pool's layer (``PoolLayer``): call row b folds the first ``count[b]`` entries of
    buffer row ``pool.slots[b]`` (-1: a pad, nothing read or written; int32 or int64, contiguous) on the
    state of slot ``read[b]`` (-1: none, S0 = 0) into slot ``write[b]``.  One launch addressed by slot
    index, ``_flush_slots_kernel``, grid (V / BV, B * HV): the state fold and the u columns, int64
    offsets; then the keys and gates of the rows moved and rebased in torch (small tensors), ``lengths``
    set to ``lengths - count`` and ``has_state`` to the rows that folded (pads: the sink row's).

    count: [B] int64 in 0..lengths[b] (pads 0); lengths: [B] int64, the rows' lengths before the call
    (pads: the sink row's); read, write: [B] int64, the state slots the pool's bookkeeping
    (``KVPool._claims``) gave the rows.  ``config``: a FlushConfig.  The caller checked the slots and
    the counts."""
    buf = pool.buffer
    cfg = check_config("flush", config)
    B, C, H, K = pool.slots.shape[0], buf.capacity, buf.num_heads, buf.head_k_dim
    HV, V = buf.num_value_heads, buf.head_v_dim
    if B == 0:
        return
    BV = max(16, min(cfg.BV, block(V)))
    with device_guard(pool.slots):
        _flush_slots_kernel[(triton.cdiv(V, BV), B * HV)](
            buf.k, buf.u, buf.G, buf.lengths, flag_view(buf.has_state), pool.state, count, pool.slots, read, write,
            C=C, H=H, HV=HV, K=K, V=V, BC=block(C), BK=block(K), BV=BV, FB=cfg.FB, CHANNEL=buf.channel_gate,
            num_warps=cfg.num_warps)
    bs = torch.where(pool.slots >= 0, pool.slots.to(torch.int64), buf.k.shape[0] - 1)  # pads: the sink row
    rows = SimpleNamespace(k=buf.k[bs], G=buf.G[bs])  # keys and G: small, moved in torch
    _shift_keys_and_gates(rows, count)
    buf.k[bs] = rows.k
    buf.G[bs] = rows.G
    buf.lengths[bs] = lengths - count
    buf.has_state[bs] = buf.has_state[bs] | (count > 0)


def _shift_keys_and_gates(buffer: KVBuffer, count: torch.Tensor) -> None:
    """Move each request's keys and G down by count[b] rows, rebasing G on the last folded entry.

    Rows past the new lengths keep whatever they hold (never read).  Small tensors: plain torch.
    """
    B, C = buffer.k.shape[:2]
    rows = (torch.arange(C, device=count.device)[None, :] + count[:, None]).clamp_(max=C - 1)  # [B, C]
    G = buffer.G
    tail = (count - 1).clamp(min=0)
    g_end = G[torch.arange(B, device=count.device), tail]  # [B, HV]*
    g_end = torch.where((count > 0).view(-1, *([1] * (g_end.dim() - 1))), g_end, torch.zeros_like(g_end))
    k_rows = rows.view(B, C, *([1] * (buffer.k.dim() - 2))).expand_as(buffer.k)
    g_rows = rows.view(B, C, *([1] * (G.dim() - 2))).expand_as(G)
    buffer.k.copy_(buffer.k.gather(1, k_rows))
    G.copy_(G.gather(1, g_rows) - g_end.unsqueeze(1).to(G.dtype))


def materialize_state(buffer: KVBuffer) -> torch.Tensor:
    """The current state S_n of every request [B, HV, K, V] (zeros where none exists); the buffer is unchanged.

    A copy of the buffer is flushed (every entry folded) and its state returned.
    """
    if not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    copy = KVBuffer(**buffer.cloned())
    folded = flush(copy)
    # a request that owns no state and had nothing to fold: its storage row is not its state
    owns = folded.has_state[:, None, None, None]
    return torch.where(owns, folded.state, torch.zeros((), dtype=folded.state.dtype, device=folded.state.device))
