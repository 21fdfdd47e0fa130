"""Buffered decode (no state write per step) and flush (the fold), on the u-cache (k, u, G).

Both kernels run one program per (request, q/k head): grid (B, H).  A program loads the request's
cached keys of its head once ([C, K]), computes the new token's key/query scores against them once,
then loops over the HV/H value heads of the group and, inside, over V-tiles of BV columns:

    decode, per value head (G_new = G_n + g; per-channel gates put the exp inside the dots):
        u = beta (v - exp(G_new) S0^T k - sum_j exp(G_new - G_j)(k.k_j) u_j)
        o = exp(G_new) S0^T q + sum_j exp(G_new - G_j)(q.k_j) u_j + (q.k) u
    one [K, BV] state tile gives both S0^T k and S0^T q; nothing is written to the state, except
    for a request whose buffer is full (n == C): its C entries are first folded (in the same
    program, the folded tile stays in registers and serves the new token with an empty buffer).

    flush: S = diag(exp(G_m)) S0 + sum_{j<m} (exp(G_m - G_j) * k_j) u_j^T for a per-request prefix m,
    then the remaining entries move down by m and their G is rebased (G_j - G_m).

Requests in direct mode (has_state False) use S0 = 0: their state loads are fully masked, so no
state memory is read.  The per-request bookkeeping (lengths, has_state) is written by the last
program of the request to finish (an atomic ticket), after every program of it has read them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.validation import check_buffer, check_scale, check_tokens

from ._common import (as_input, block, device_guard, flag_view, launch_config, new_output, require_inplace,
                      ticket_counters)

__all__ = ["buffered_decode", "flush", "materialize_state"]


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr,
    scale,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr,
):
    GROUP: tl.constexpr = HV // H
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    full = n >= C
    keep = tl.where(full, 0, n)  # entries the new token attends to; it is stored at row `keep`
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_n = o_c < n
    m_keep = o_c < keep
    m_nk = m_n[:, None] & m_k[None, :]
    m_own = o_k < tl.where(owns, K, 0)  # state rows to read: none in direct mode
    p_ck = ck_ptr + ((i_b * C + o_c[:, None]) * H + i_h) * K + o_k[None, :]
    kc = tl.load(p_ck, mask=m_nk, other=0.0).to(tl.float32)  # [BC, BK] cached keys, read once
    b_k_in = tl.load(k_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_k = b_k_in.to(tl.float32)
    b_q = tl.load(q_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    qk_self = tl.sum(b_q * b_k, 0)
    if not CHANNEL:
        kk = tl.sum(kc * b_k[None, :], 1)  # [BC] scores, shared by the group's value heads
        qk = tl.sum(kc * b_q[None, :], 1)
    for r in tl.static_range(GROUP):
        i_hv = i_h * GROUP + r
        i_bhv = i_b * HV + i_hv
        b_beta = tl.load(beta_ptr + i_bhv).to(tl.float32)
        if CHANNEL:
            p_cg = cg_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * K + o_k[None, :]
            gc = tl.load(p_cg, mask=m_nk, other=0.0).to(tl.float32)  # [BC, BK]
            g_last = tl.sum(tl.where((o_c == n - 1)[:, None], gc, 0.0), 0)  # [BK]
            g_new = tl.where(full, 0.0, g_last) + tl.load(g_ptr + i_bhv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            dec = tl.exp(tl.where(m_keep[:, None] & m_k[None, :], g_new[None, :] - gc, float("-inf")))
            wk = tl.sum(kc * dec * b_k[None, :], 1)
            wq = tl.sum(kc * dec * b_q[None, :], 1)
            e_new = tl.exp(g_new)
            kd = b_k * e_new
            qd = b_q * e_new
            s_dec = tl.exp(g_last)  # the fold's state decay (used only when full)
        else:
            gc = tl.load(cg_ptr + (i_b * C + o_c) * HV + i_hv, mask=m_n, other=0.0).to(tl.float32)  # [BC]
            g_last = tl.sum(tl.where(o_c == n - 1, gc, 0.0), 0)
            g_new = tl.where(full, 0.0, g_last) + tl.load(g_ptr + i_bhv).to(tl.float32)
            dec = tl.exp(tl.where(m_keep, g_new - gc, float("-inf")))
            wk = kk * dec
            wq = qk * dec
            e_new = tl.exp(g_new)
            kd = b_k * e_new
            qd = b_q * e_new
            s_dec = tl.exp(g_last)
        for iv in range(0, V, BV):
            o_v = iv + tl.arange(0, BV)
            m_v = o_v < V
            p_cu = cu_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :]
            uc = tl.load(p_cu, mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
            m_s = m_k[:, None] & m_v[None, :]
            p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
            if STORAGE:
                s = tl.load(p_s, mask=m_own[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                if full:
                    # fold all C entries first: S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T
                    if CHANNEL:
                        fd = tl.exp(tl.where(m_nk, g_last[None, :] - gc, float("-inf")))
                        s = s * s_dec[:, None] + tl.dot(tl.trans(kc * fd), uc, input_precision="ieee")
                    else:
                        fd = tl.exp(tl.where(m_n, g_last - gc, float("-inf")))
                        s = s * s_dec + tl.dot(tl.trans(kc * fd[:, None]), uc, input_precision="ieee")
                    tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_s)
            else:
                s = tl.zeros([BK, BV], dtype=tl.float32)
            b_v = tl.load(v_ptr + i_bhv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_u = b_beta * (b_v - tl.sum(s * kd[:, None], 0) - tl.sum(wk[:, None] * uc, 0))
            b_o = tl.sum(s * qd[:, None], 0) + tl.sum(wq[:, None] * uc, 0) + qk_self * b_u
            tl.store(o_ptr + i_bhv * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
            tl.debug_barrier()  # row `keep` may have just been read (fold): every warp is past its load
            tl.store(cu_ptr + ((i_b * C + keep) * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty), mask=m_v)
        tl.debug_barrier()
        if CHANNEL:
            tl.store(cg_ptr + ((i_b * C + keep) * HV + i_hv) * K + o_k, g_new.to(cg_ptr.dtype.element_ty), mask=m_k)
        else:
            tl.store(cg_ptr + (i_b * C + keep) * HV + i_hv, g_new.to(cg_ptr.dtype.element_ty))
    tl.store(ck_ptr + ((i_b * C + keep) * H + i_h) * K + o_k, b_k_in.to(ck_ptr.dtype.element_ty), mask=m_k)
    # the last program of request b to get here writes its bookkeeping (all H have read it by now)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == H - 1:
        tl.store(len_ptr + i_b, (keep + 1).to(len_ptr.dtype.element_ty))
        if full:
            tl.store(own_ptr + i_b, 1)
        tl.store(ticket_ptr + i_b, 0)


@triton.jit
def _flush_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr,
):
    GROUP: tl.constexpr = HV // H
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    m = tl.load(count_ptr + i_b).to(tl.int32)
    if m > 0:
        n = tl.load(len_ptr + i_b).to(tl.int32)
        owns = tl.load(own_ptr + i_b) != 0
        o_c = tl.arange(0, BC)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_n = o_c < n
        m_fold = o_c < m
        m_rest = m_n & (o_c >= m)  # entries that stay: they move to row j - m
        m_nk = m_n[:, None] & m_k[None, :]
        m_own = o_k < tl.where(owns, K, 0)  # state rows to read: none in direct mode
        kc = tl.load(ck_ptr + ((i_b * C + o_c[:, None]) * H + i_h) * K + o_k[None, :], mask=m_nk,
                     other=0.0)
        kf = kc.to(tl.float32)
        for r in tl.static_range(GROUP):
            i_hv = i_h * GROUP + r
            i_bhv = i_b * HV + i_hv
            if CHANNEL:
                p_cg = cg_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * K + o_k[None, :]
                gc = tl.load(p_cg, mask=m_nk, other=0.0).to(tl.float32)
                g_end = tl.sum(tl.where((o_c == m - 1)[:, None], gc, 0.0), 0)  # [BK]
                kd = kf * tl.exp(tl.where(m_fold[:, None] & m_k[None, :], g_end[None, :] - gc, float("-inf")))
                s_dec = tl.exp(g_end)[:, None]
            else:
                gc = tl.load(cg_ptr + (i_b * C + o_c) * HV + i_hv, mask=m_n, other=0.0).to(tl.float32)
                g_end = tl.sum(tl.where(o_c == m - 1, gc, 0.0), 0)
                kd = kf * tl.exp(tl.where(m_fold, g_end - gc, float("-inf")))[:, None]
                s_dec = tl.exp(g_end)
            kdt = tl.trans(kd)
            for iv in range(0, V, BV):
                o_v = iv + tl.arange(0, BV)
                m_v = o_v < V
                m_s = m_k[:, None] & m_v[None, :]
                p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
                p_cu = cu_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :]
                uc = tl.load(p_cu, mask=m_n[:, None] & m_v[None, :], other=0.0)
                s = tl.load(p_s, mask=m_own[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                s = s * s_dec + tl.dot(kdt, uc.to(tl.float32), input_precision="ieee")
                tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_s)
                tl.debug_barrier()  # every warp has read the rows before any is overwritten
                tl.store(p_cu - m * HV * V, uc, mask=m_rest[:, None] & m_v[None, :])
            tl.debug_barrier()
            if CHANNEL:
                tl.store(p_cg - m * HV * K, (gc - g_end[None, :]).to(cg_ptr.dtype.element_ty),
                         mask=m_rest[:, None] & m_k[None, :])
            else:
                tl.store(cg_ptr + (i_b * C + o_c - m) * HV + i_hv, (gc - g_end).to(cg_ptr.dtype.element_ty),
                         mask=m_rest)
        tl.debug_barrier()
        tl.store(ck_ptr + ((i_b * C + o_c[:, None] - m) * H + i_h) * K + o_k[None, :], kc,
                 mask=m_rest[:, None] & m_k[None, :])


def _check_u_form(buffer: KVBuffer, op: str) -> None:
    if buffer.form != "u":
        raise NotImplementedError(
            f"buffer: kvbuffer_fast.{op} implements the u-cache form (k, u, G) only; this buffer is in the raw "
            f"(k, v, g, beta) form.  Use kvbuffer_ref.{op} for it, or build the buffer with form='u'"
        )
    for name in ("k", "u", "G", "lengths", "has_state", "state"):
        require_inplace(f"buffer.{name}", getattr(buffer, name))


def buffered_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    buffer: KVBuffer,
    scale: Optional[float] = None,
    validate: bool = True,
    BV: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, KVBuffer]:
    """One new token per request from the stale state plus the buffer; returns (o, buffer).

    q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV]*; beta: [B, 1, HV]; o: [B, 1, HV, V] in v's
    dtype.  Same results as ``kvbuffer_ref.buffered_decode``, but the buffer is updated IN PLACE
    (the token's (k, u, G) is appended, lengths advance) and the same object is returned.  A
    request whose buffer is full (length C) first has its C entries folded into its state (in the
    same launch), then holds the new token alone; a direct-mode request folded so starts owning a
    state.  That needs state storage: ``buffer.state`` None with a full request is a ValueError.

    ``validate=False`` skips the checks that read device values (buffer lengths, has_state): no host
    synchronisation, e.g. inside a CUDA graph; shapes are still checked.  ``BV`` / ``num_warps``
    override the tuned launch (benchmarks only).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q: buffered_decode takes one token per request, expected [B, 1, H, K], got {shape}")
    d = check_tokens(q, k, v, g, beta)
    if validate:
        check_buffer(buffer, d, q.device)
    elif not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    _check_u_form(buffer, "buffered_decode")
    C = buffer.capacity
    if buffer.state is None and validate:
        full = buffer.lengths >= C
        if bool(full.any()):
            b = int(full.nonzero()[0, 0])
            raise ValueError(
                f"buffer: request {b} has {C} entries and gets 1 more, past the capacity C={C}, but the buffer "
                f"has no state storage to fold into (buffer.state is None); call flush() first (it allocates "
                f"the state) or use a larger capacity"
            )
    s = check_scale(scale, d.K)
    cfg = launch_config("decode", d.V, BV=BV, num_warps=num_warps)
    o = new_output((d.B, 1, d.HV, d.V), v.dtype, q.device)
    if d.B == 0:
        return o, buffer
    storage = buffer.state is not None
    state = buffer.state if storage else buffer.lengths  # a dummy pointer, never dereferenced
    with device_guard(q):
        _decode_kernel[(d.B, d.H)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), o,
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), state,
            ticket_counters(d.B, q.device),
            s,
            C=C, H=d.H, HV=d.HV, K=d.K, V=d.V, BC=block(C), BK=block(d.K), BV=cfg["BV"],
            CHANNEL=d.channel_gate, STORAGE=storage, num_warps=cfg["num_warps"],
        )
    return o, buffer


def _counts(buffer: KVBuffer, count, validate: bool) -> torch.Tensor:
    """count (None = all, an int, or a [B] int tensor, each in 0..lengths[b]) as a [B] int64 tensor."""
    B = buffer.batch
    if count is None:
        return buffer.lengths.clone()
    if isinstance(count, int) and not isinstance(count, bool):
        count = torch.full((B,), count, dtype=torch.long, device=buffer.k.device)
    if not isinstance(count, torch.Tensor) or count.dtype.is_floating_point or count.dtype == torch.bool \
            or tuple(count.shape) != (B,):
        desc = f"{count.dtype} {list(count.shape)}" if isinstance(count, torch.Tensor) else type(count).__name__
        raise ValueError(f"count: expected None, an int or an integer tensor [B] = [{B}], got {desc}")
    count = count.to(device=buffer.k.device, dtype=torch.long)
    if validate:
        bad = (count < 0) | (count > buffer.lengths)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"count: entry [{b}] is {int(count[b])}, expected a value in 0..{int(buffer.lengths[b])} "
                             f"(request {b}'s buffer length)")
    return count.contiguous()


def flush(buffer: KVBuffer, *, count=None, validate: bool = True, BV: Optional[int] = None,
          num_warps: Optional[int] = None) -> KVBuffer:
    """Fold the first ``count`` entries of each request into its state, IN PLACE; return the buffer.

    count: None (all entries), an int, or a [B] int tensor, each in 0..lengths[b].  Folded requests
    own a state from now on; the remaining entries move to the front and their cumulative gates
    are rebased (``G_i - G_count``).  A buffer without state storage (``state is None``) gets a
    zero-initialised one: then the returned buffer is a new object sharing every other tensor.
    """
    if validate:
        check_buffer(buffer)
    elif not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    _check_u_form(buffer, "flush")
    count = _counts(buffer, count, validate)
    if buffer.state is None:
        B, HV, K, V = buffer.batch, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim
        state = torch.zeros(B, HV, K, V, dtype=torch.promote_types(buffer.u.dtype, torch.float32),
                            device=buffer.k.device)
        buffer = buffer.replace(state=state)
    B, C, H, K = buffer.k.shape
    HV, V = buffer.num_value_heads, buffer.head_v_dim
    if B == 0:
        return buffer
    cfg = launch_config("flush", V, BV=BV, num_warps=num_warps)
    with device_guard(buffer.k):
        _flush_kernel[(B, H)](
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state, count,
            C=C, H=H, HV=HV, K=K, V=V, BC=block(C), BK=block(K), BV=cfg["BV"], CHANNEL=buffer.channel_gate,
            num_warps=cfg["num_warps"],
        )
    buffer.lengths.sub_(count)
    buffer.has_state.logical_or_(count > 0)
    return buffer


def materialize_state(buffer: KVBuffer) -> torch.Tensor:
    """The current state S_n of every request [B, HV, K, V] (zeros where none exists); the buffer is unchanged."""
    fields = {f: (None if getattr(buffer, f) is None else getattr(buffer, f).clone())
              for f in ("k", "lengths", "state", "has_state", "u", "G", "v", "g", "beta")}
    return flush(KVBuffer(**fields)).state
