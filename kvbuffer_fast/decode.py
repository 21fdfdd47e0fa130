"""Buffered decode on the u-cache (k, u, G): one token per request, no state write per step.

For every request and value head (G_new = G_n + g; per-channel gates put the exp inside the dots):
    u = beta (v - exp(G_new) S0^T k - sum_{j<n} exp(G_new - G_j)(k.k_j) u_j)
    o = exp(G_new) S0^T q + sum_{j<n} exp(G_new - G_j)(q.k_j) u_j + (q.k) u
A full buffer (n == C) is first folded, S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T, and the
token then sees S with an empty buffer.

One step is three launches (docs/kernels.md gives their costs and the launch table's reasons):
1. the fold launch, which touches only full requests (every other program returns at once):
   ``_fold_group_kernel`` (C <= 32), grid (V / BV, B * HV / FH): a program owns FH value heads of one
   request, walks their [K, BV] tiles in [KB, BV] blocks, folds each (one tl.dot of the C entries)
   and serves the request's token from the folded blocks; or ``_fold_tile_kernel`` (C > 32), grid
   (V / BV, B * HV): one [K, BV] tile per program, folded; the request's last program empties its
   buffer, and the decode launch serves its token.
2. ``_decode_kernel``, grid (V / BV, B * HV): one loop over the key dimension in [KB, BV] state
   blocks forms S0^T k, S0^T q and the scores of the buffered keys together, so only blocks are live
   (few registers, many programs per SM); then the decays, the u rows of the n live entries, u and o.
3. ``_book_kernel``, grid (B,): appends the token's key (per q/k head) and G (per value head) and
   advances the length, after every program of 2 has read them.

On sm_90+ the launches are chained by programmatic dependent launch (PDL): each kernel's programs may
start before the previous kernel ends and wait for it before reading anything.  Behind the grouped
(serving) fold launch the decode launch reads and writes nothing that launch touches, so it waits
only before exiting; the bookkeeping launch then still starts after both.

A serving pool (``kvbuffer_fast.pool.KVPool.decode``, grouped fold) runs the same three launches through
``decode_pool`` on a ``PoolLayer``: ``_fold_group_slots_kernel``, ``_decode_slots_kernel`` and
``_book_slots_kernel``, the same grids and bodies, each call row on its slot's buffer row and on the
state slots the pool's bookkeeping gives it (a pad row's programs do nothing).

The cached keys [C, K] of a q/k head are shared by its HV/H value heads and their V-tiles: those
programs are adjacent in the grid, so the keys come from HBM once and from L2 after.  Rows >= n that
a kernel loads are dropped by selects, never multiplied by 0, and a direct request's state storage is
never used (a select), so garbage there (NaN) cannot leak.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import check_scale, check_tokens

from ._common import (PoolLayer, _gdc_wait, _pdl_prologue, _program_ids, _tile_offsets, as_input, block,
                      checked_buffer, checked_tokens, device_guard, flag_view, new_output, pdl_launch, ticket_counters)
from ._fold import fold_block, fold_empty, fold_tile, state_tile
from .launch import SIXTEEN_BIT, DecodeConfig, check_config, config_for, key_of

__all__ = ["buffered_decode", "decode_pool", "state_dot"]


@triton.jit
def _book_kernel(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr,
                 C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Append request i_b's new key (every q/k head) and G (every value head) at row ``keep`` (0 for a
    request folded this step, else its length n), advance its length, and mark a folded request as
    owning a state.  Grid (B,), one warp."""
    _pdl_prologue(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    _book_row(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, i_b, C, H, HV, K, BK, BH, BHV, CHANNEL)


@triton.jit
def _book_slots_kernel(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, bslot_ptr,
                       C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                       BK: tl.constexpr, BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr,
                       PDL: tl.constexpr = False):
    """``_book_kernel`` on a pool: token row i_b books into buffer row ``bslot[i_b]`` (int64 offsets);
    a pad (-1) does nothing."""
    _pdl_prologue(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        _book_row(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, c_b, C, H, HV, K, BK, BH, BHV, CHANNEL)


@triton.jit
def _book_row(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, t_b, i_b,
              C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
              BK: tl.constexpr, BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr):
    """The bookkeeping of token row t_b in buffer row i_b (the same row outside a pool)."""
    n = tl.load(len_ptr + i_b).to(tl.int32)
    full = n >= C
    keep = tl.where(full, 0, n)
    has_last = (n > 0) & (n < C)  # the new G builds on G_n; on 0 when empty or folded (rebased)
    last = tl.maximum(n - 1, 0)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_h = tl.arange(0, BH)
    m_hk = (o_h < H)[:, None] & m_k[None, :]
    k_all = tl.load(k_ptr + (t_b * H + o_h[:, None]) * K + o_k[None, :], mask=m_hk, other=0.0)
    tl.store(ck_ptr + ((i_b * C + keep) * H + o_h[:, None]) * K + o_k[None, :], k_all.to(ck_ptr.dtype.element_ty),
             mask=m_hk)
    o_hv = tl.arange(0, BHV)
    if CHANNEL:
        m_g = (o_hv < HV)[:, None] & m_k[None, :]
        g_prev = tl.load(cg_ptr + ((i_b * C + last) * HV + o_hv[:, None]) * K + o_k[None, :], mask=m_g,
                         other=0.0).to(tl.float32)
        g_tok = tl.load(g_ptr + (t_b * HV + o_hv[:, None]) * K + o_k[None, :], mask=m_g, other=0.0).to(tl.float32)
        tl.store(cg_ptr + ((i_b * C + keep) * HV + o_hv[:, None]) * K + o_k[None, :],
                 (tl.where(has_last, g_prev, 0.0) + g_tok).to(cg_ptr.dtype.element_ty), mask=m_g)
    else:
        m_g = o_hv < HV
        g_prev = tl.load(cg_ptr + (i_b * C + last) * HV + o_hv, mask=m_g, other=0.0).to(tl.float32)
        g_tok = tl.load(g_ptr + t_b * HV + o_hv, mask=m_g, other=0.0).to(tl.float32)
        tl.store(cg_ptr + (i_b * C + keep) * HV + o_hv,
                 (tl.where(has_last, g_prev, 0.0) + g_tok).to(cg_ptr.dtype.element_ty), mask=m_g)
    tl.store(len_ptr + i_b, (keep + 1).to(len_ptr.dtype.element_ty))
    if full:
        tl.store(own_ptr + i_b, 1)


@triton.jit
def _decode_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PDL: tl.constexpr = False, SERVED: tl.constexpr = False,
    DOT: tl.constexpr = False,
):
    """The token of one (request, value head, V-tile): ONE loop over the key dimension in KB-row blocks
    forms S0^T k, S0^T q and the scores k.k_j, q.k_j of the n buffered keys together; then the u rows
    of the n entries (CB = block(C) rows, those >= n masked), u and o.  No request is full here unless
    SERVED: the fold launch ran first.  STORAGE: the buffer has state storage (else S0 = 0 for all).
    The state blocks load evict_first (streamed once per step), the buffer's rows evict_last (read
    again every step).  PDL: programmatic dependent launch (_common._pdl_prologue).
    SERVED (behind the grouped fold launch): a full request (n == C) was folded AND served there; here
    it skips the block loop and its stores are masked off (its length stays C until the bookkeeping).
    That launch then touches nothing this kernel reads or writes, so with PDL the programs wait for it
    only at their end, before exiting."""
    _pdl_prologue(PDL, WAIT=not SERVED)  # SERVED: the wait is at the end
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    _decode_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                    scale, i_v, i_bhv, i_b, i_hv, i_h, i_b, i_bhv, True, C, H, HV, K, V, CB, BV, KB, NS, CHANNEL,
                    STORAGE, PDL, SERVED, False, DOT)


@triton.jit
def _decode_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale, bslot_ptr, sslot_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PDL: tl.constexpr = False, SERVED: tl.constexpr = False,
    DOT: tl.constexpr = False,
):
    """``_decode_kernel`` on a pool: token row i_b reads and writes buffer row ``bslot[i_b]`` and reads
    state row ``sslot[i_b]`` (-1: none, nothing read, S0 = 0), offsets in int64; a pad row (bslot -1)
    reads and writes nothing."""
    _pdl_prologue(PDL, WAIT=not SERVED)
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        s_b = tl.load(sslot_ptr + i_b).to(tl.int64)
        _decode_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                        o_ptr, scale, i_v, i_bhv, i_b, i_hv, i_h, c_b, tl.maximum(s_b, 0) * HV + i_hv, s_b >= 0,
                        C, H, HV, K, V, CB, BV, KB, NS, CHANNEL, STORAGE, PDL, SERVED, True, DOT)


@triton.jit
def _decode_program(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale, i_v, i_bhv, t_b, i_hv, i_h, i_b, s_bhv, s_ok,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PDL: tl.constexpr, SERVED: tl.constexpr, SLOTS: tl.constexpr,
    DOT: tl.constexpr,
):
    """The body of the decode kernels for token row t_b (value head i_hv, q/k head i_h, V-tile i_v;
    i_bhv = t_b * HV + i_hv) on buffer row i_b and state row s_bhv (per value head); outside a pool
    i_b = t_b and s_bhv = i_bhv.  SLOTS: the state row exists only where ``s_ok``.  DOT (a 16-bit state of
    q's and k's dtype, scalar gates; ``state_dot``): S0^T k and S0^T q are the first two rows of one tl.dot
    per block, the [16, KB] rows (k, q, then zeros) by the [KB, BV] state block in their own dtype with
    fp32 accumulation: the products are exact, as in the fp32 sums without it, which take two cross-lane
    reductions per block (the scores of the cached keys keep those sums)."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    n = tl.load(len_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    if SERVED:  # served by the fold launch: nothing of this request is written here (nor its rows read)
        m_v = o_v < tl.where(n < C, V, 0)
    b_v = tl.load(v_ptr + i_bhv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta_ptr + i_bhv).to(tl.float32)
    rows = tl.arange(0, CB)
    m_c = rows < C
    if not CHANNEL:
        g_tok = tl.load(g_ptr + i_bhv).to(tl.float32)
        gc = tl.load(cg_ptr + (i_b * C + rows) * HV + i_hv, mask=m_c, other=0.0).to(tl.float32)
    o_kb = tl.arange(0, KB)
    p_s = state_ptr + (s_bhv * K + o_kb[:, None]) * V + o_v[None, :]
    p_x = (t_b * H + i_h) * K + o_kb
    p_c = ((i_b * C + rows[:, None]) * H + i_h) * K + o_kb[None, :]
    sk = tl.zeros([BV], dtype=tl.float32)
    sq = tl.zeros([BV], dtype=tl.float32)
    if DOT:
        o_x = tl.arange(0, 16)
        X = tl.zeros([16, BV], dtype=tl.float32)  # rows 0 and 1: S0^T k and S0^T q
    wk = tl.zeros([CB], dtype=tl.float32)
    wq = tl.zeros([CB], dtype=tl.float32)
    qk = tl.zeros([KB], dtype=tl.float32)
    last = tl.maximum(n - 1, 0)
    m_key = rows < n
    if SERVED:  # a served request skips the block loop (its masked loads would still issue)
        unserved = n < C
    else:
        unserved = True
    if unserved:
        for k0 in tl.range(0, K, KB, num_stages=NS):
            m_kb = (k0 + o_kb) < K
            if STORAGE:
                if SLOTS:  # a request without a state slot reads none (its S0 is 0)
                    m_st = ((k0 + o_kb) < tl.where(s_ok, K, 0))[:, None] & m_v[None, :]
                else:
                    m_st = m_kb[:, None] & m_v[None, :]
                st = tl.load(p_s + k0 * V, mask=m_st, other=0.0, eviction_policy="evict_first")
                if not DOT:
                    st = st.to(tl.float32)
            kb = tl.load(k_ptr + p_x + k0, mask=m_kb, other=0.0)
            qb = tl.load(q_ptr + p_x + k0, mask=m_kb, other=0.0)
            if DOT:
                xb = tl.where(o_x[:, None] == 0, kb[None, :], tl.where(o_x[:, None] == 1, qb[None, :], 0.0))
                xb = xb.to(st.dtype)
                X = tl.dot(xb, st, X)
            kb = kb.to(tl.float32)
            qb = qb.to(tl.float32)
            kc = tl.load(ck_ptr + p_c + k0, mask=m_key[:, None] & m_kb[None, :], other=0.0,
                         eviction_policy="evict_last").to(tl.float32)
            qk += kb * qb
            if CHANNEL:
                gb = tl.load(g_ptr + i_bhv * K + k0 + o_kb, mask=m_kb, other=0.0).to(tl.float32)
                gl = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + k0 + o_kb, mask=m_kb,
                             other=0.0).to(tl.float32)
                gt = tl.where(n > 0, gl, 0.0)  # the tail's G over this block of channels (0 if empty)
                gn = gt + gb  # G_new
                gcb = tl.load(cg_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * K + k0 + o_kb[None, :],
                              mask=m_c[:, None] & m_kb[None, :], other=0.0).to(tl.float32)
                live = (rows < n)[:, None]
                # G_new as stored minus the entry's: the decays the fold will use (math.md, "Numerics")
                kd = tl.where(live, kc * tl.exp(tl.where(live, gn[None, :] - gcb, 0.0)), 0.0)
                wk += tl.sum(kd * kb[None, :], 1)
                wq += tl.sum(kd * qb[None, :], 1)
                en = tl.exp(gn)
                if STORAGE:
                    sk += tl.sum(st * (kb * en)[:, None], 0)
                    sq += tl.sum(st * (qb * en)[:, None], 0)
            else:
                wk += tl.sum(kc * kb[None, :], 1)
                wq += tl.sum(kc * qb[None, :], 1)
                if STORAGE and not DOT:
                    sk += tl.sum(st * kb[:, None], 0)
                    sq += tl.sum(st * qb[:, None], 0)
        if DOT:
            sk = tl.sum(tl.where(o_x[:, None] == 0, X, 0.0), 0)
            sq = tl.sum(tl.where(o_x[:, None] == 1, X, 0.0), 0)
    m_r = rows < n
    uc = tl.load(cu_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                 mask=m_r[:, None] & m_v[None, :], other=0.0, eviction_policy="evict_last").to(tl.float32)
    uc = tl.where(m_r[:, None], uc, 0.0)
    if not CHANNEL:
        g_last = tl.where(n > 0, tl.sum(tl.where(rows == n - 1, gc, 0.0), 0), 0.0)
        g_new = g_last + g_tok
        dec = tl.exp(tl.where(m_r, g_new - gc, float("-inf")))  # G_new as stored: the fold's decays
        wk = tl.where(m_r, wk * dec, 0.0)
        wq = tl.where(m_r, wq * dec, 0.0)
        e_new = tl.exp(g_new)
        sk = sk * e_new
        sq = sq * e_new
    acc_k = tl.sum(wk[:, None] * uc, 0)
    acc_q = tl.sum(wq[:, None] * uc, 0) * scale
    if STORAGE:
        sk = tl.where(owns, sk, 0.0)  # a select: a direct request's storage (maybe NaN) never propagates
        sq = tl.where(owns, sq, 0.0) * scale
    b_u = b_beta * (b_v - sk - acc_k)
    b_o = sq + acc_q + tl.sum(qk, 0) * scale * b_u
    tl.store(o_ptr + i_bhv * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    # n < C here unless SERVED (whose stores are off); the new u row is the program's own slice
    tl.store(cu_ptr + ((i_b * C + n) * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty),
             mask=o_v < tl.where(n < C, V, 0), eviction_policy="evict_last")
    if SERVED:
        if PDL:
            _gdc_wait()  # the fold launch has completed (and its writes are visible) when this program ends


@triton.jit
def _serve_folded(v_ptr, beta_ptr, g_ptr, o_ptr, cu_ptr, i_b, i_hv, i_bhv, sk, sq, qk, scale, o_v, m_v,
                  C: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, CHANNEL: tl.constexpr):
    """The token of a request folded just now, from the folded state S with an empty buffer:
    sk = S^T k, sq = S^T q (per-channel gates: already with exp(g) inside), qk = k.q;
    u = beta (v - exp(g) S^T k), o = exp(g) S^T q s + (q.k) s u; u is written to row 0 of its own
    columns of buffer row i_b (the bookkeeping launch appends the key / G rows there and sets the length
    to 1); the token's own tensors are read and written at i_bhv."""
    if not CHANNEL:
        e_new = tl.exp(tl.load(g_ptr + i_bhv).to(tl.float32))
        sk = sk * e_new
        sq = sq * e_new
    b_v = tl.load(v_ptr + i_bhv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta_ptr + i_bhv).to(tl.float32)
    b_u = b_beta * (b_v - sk)
    b_o = sq * scale + qk * scale * b_u
    tl.store(o_ptr + i_bhv * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(cu_ptr + (i_b * C * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def _serve_sums(st, k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, sk, sq, qk,
                H: tl.constexpr, K: tl.constexpr, CHANNEL: tl.constexpr):
    """Accumulate S^T k, S^T q (exp(g) inside for per-channel gates: the new token's G with an empty
    buffer) and k.q over the rows o_k of a folded state block st [len(o_k), BV]."""
    kb = tl.load(k_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    qb = tl.load(q_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    kq = tl.sum(kb * qb, 0)
    if CHANNEL:
        en = tl.exp(tl.load(g_ptr + i_bhv * K + o_k, mask=m_k, other=0.0).to(tl.float32))
        kb = kb * en
        qb = qb * en
    # Both sums as rows 0 and 1 of one product [16, KB] @ st.  A row is then taken out by adding exact
    # zeros, so every thread that holds a copy of a sum holds the same value (a tl.sum over st's rows
    # leaves differently rounded copies in the lanes of its butterfly, which the layout conversion
    # after it writes to one shared-memory word: a write-write race that racecheck reports).
    r = tl.arange(0, 16)[:, None]
    p = tl.dot(tl.where(r == 0, kb[None, :], tl.where(r == 1, qb[None, :], 0.0)), st, input_precision="ieee")
    return sk + tl.sum(tl.where(r == 0, p, 0.0), 0), sq + tl.sum(tl.where(r == 1, p, 0.0), 0), qk + kq


@triton.jit
def _fold_tile_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    FB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """The fold launch for C > 32: every FULL buffer (n == C) is folded into its state tile,
    S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T (``_fold.fold_tile``: FB entries per fold step), and
    emptied (the request's last program sets its length to 0 and has_state); every other program returns
    at once.  The decode launch then serves those requests with an empty buffer and the folded state."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    if n >= C:
        owns = tl.load(own_ptr + i_b) != 0
        o_k, o_v, m_k, m_v = _tile_offsets(i_v, BK, BV, K, V)
        p_s, s = state_tile(state_ptr, owns, i_bhv, o_k, o_v, m_k, m_v, K, V)
        s = fold_tile(s, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, tl.minimum(n, C), o_k, o_v, m_k, m_v,
                      C, H, HV, K, V, FB, CHANNEL)
        tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
        fold_empty(len_ptr, own_ptr, ticket_ptr, i_b, i_b, HV * NV)


@triton.jit
def _fold_group_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, FH: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, PDL: tl.constexpr = False,
):
    """The fold launch for C <= 32: a program owns FH value heads of one request (grid (V / BV,
    B * HV / FH)); for a FULL request it walks their [K, BV] tiles in KB-row blocks, folds each with one
    tl.dot of the C entries (fp32 FMA), writes it back, and feeds S^T k, S^T q of the request's token,
    which it serves (_serve_folded).  The length stays C: the decode launch skips the request and the
    bookkeeping launch restarts its buffer at row 0.  Few programs of few registers, so the launch
    costs little when no request is full (most steps)."""
    NG: tl.constexpr = HV // FH
    _pdl_prologue(PDL)
    i_v = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_b = i_g // NG
    hv0 = (i_g % NG) * FH
    _fold_group_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                        o_ptr, scale, i_v, i_b, hv0, i_b, i_b, i_b, C, H, HV, K, V, CB, KB, BV, FH, NS, CHANNEL, False)


@triton.jit
def _fold_group_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale, bslot_ptr, sread_ptr, swrite_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, FH: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, PDL: tl.constexpr = False,
):
    """``_fold_group_kernel`` on a pool: token row i_b folds buffer row ``bslot[i_b]`` on the state read
    from slot ``sread[i_b]`` (-1: none, S0 = 0) into slot ``swrite[i_b]`` (the same slot, or a fresh one
    for a request without one or sharing it: copy-on-write), int64 offsets; a pad (bslot -1) does nothing."""
    NG: tl.constexpr = HV // FH
    _pdl_prologue(PDL)
    i_v = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_b = i_g // NG
    hv0 = (i_g % NG) * FH
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        s_r = tl.maximum(tl.load(sread_ptr + i_b).to(tl.int64), 0)
        s_w = tl.load(swrite_ptr + i_b).to(tl.int64)
        _fold_group_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr,
                            beta_ptr, o_ptr, scale, i_v, i_b, hv0, c_b, s_r, s_w, C, H, HV, K, V, CB, KB, BV, FH, NS,
                            CHANNEL, True)


@triton.jit
def _fold_group_program(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, scale, i_v, i_b, hv0, c_b, s_r, s_w,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, FH: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, SLOTS: tl.constexpr,
):
    """The body of the grouped fold kernels: token row i_b, value heads hv0..hv0+FH-1, V-tile i_v, on
    buffer row c_b; SLOTS: the state is read from slot s_r and written to slot s_w (else both are the
    token row's, i_b * HV + i_hv)."""
    n = tl.load(len_ptr + c_b).to(tl.int32)
    if n >= C:
        owns = tl.load(own_ptr + c_b) != 0
        o_kb = tl.arange(0, KB)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        rows = tl.arange(0, CB)
        m_c = rows < C
        for hh in range(FH):
            i_hv = hv0 + hh
            i_h = i_hv // (HV // H)
            i_bhv = i_b * HV + i_hv
            uf = tl.load(cu_ptr + ((c_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                         mask=m_c[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [CB, BV]
            if not CHANNEL:
                gj = tl.load(cg_ptr + (c_b * C + rows) * HV + i_hv, mask=m_c, other=0.0).to(tl.float32)
                g_end = tl.sum(tl.where(rows == C - 1, gj, 0.0), 0)
                w = tl.where(m_c, tl.exp(g_end - gj), 0.0)
            sk = tl.zeros([BV], dtype=tl.float32)
            sq = tl.zeros([BV], dtype=tl.float32)
            qk = tl.zeros([], dtype=tl.float32)
            for k0 in tl.range(0, K, KB, num_stages=NS):
                o_k = k0 + o_kb
                m_k = o_k < K
                if SLOTS:  # read the request's state slot (none: S0 = 0), write the fold to slot s_w
                    p_s = state_ptr + ((s_r * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
                    m_s = m_k[:, None] & m_v[None, :]
                    st = tl.load(p_s, mask=(o_k < tl.where(owns, K, 0))[:, None] & m_v[None, :],
                                 other=0.0).to(tl.float32)
                    p_s = state_ptr + ((s_w * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
                else:
                    p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
                    m_s = m_k[:, None] & m_v[None, :]
                    st = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
                st = tl.where(owns, st, 0.0)  # direct mode: S0 = 0 (the storage row may hold anything)
                kf = tl.load(ck_ptr + ((c_b * C + rows[None, :]) * H + i_h) * K + o_k[:, None],
                             mask=m_k[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [KB, CB]
                if CHANNEL:  # G_end over the block's rows; the entries' G (pointers)
                    ge = tl.load(cg_ptr + ((c_b * C + C - 1) * HV + i_hv) * K + o_k, mask=m_k,
                                 other=0.0).to(tl.float32)
                    gw = cg_ptr + ((c_b * C + rows[None, :]) * HV + i_hv) * K + o_k[:, None]
                else:  # the scalar G_end and the entries' weights (above the block loop)
                    ge, gw = g_end, w
                st = fold_block(st, ge, m_k, kf, uf, gw, m_c, kf, uf, gw, m_c, CHANNEL, False, True)
                st = st.to(state_ptr.dtype.element_ty)  # rounded once (a no-op for an fp32 state) ...
                tl.store(p_s, st, mask=m_s)
                st = st.to(tl.float32)  # ... and the token is served from the state as stored
                sk, sq, qk = _serve_sums(st, k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, sk, sq, qk,
                                         H, K, CHANNEL)
            _serve_folded(v_ptr, beta_ptr, g_ptr, o_ptr, cu_ptr, c_b, i_hv, i_bhv, sk, sq, qk, scale,
                          o_v, m_v, C, HV, V, CHANNEL)


def buffered_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    buffer: KVBuffer,
    scale: Optional[float] = None,
    config: Optional[DecodeConfig] = None,
) -> tuple[torch.Tensor, KVBuffer]:
    """One new token per request from the stale state plus the buffer; returns (o, buffer).

    q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV]*; beta: [B, 1, HV]; o: [B, 1, HV, V] in v's
    dtype.  Same results as ``kvbuffer_ref.buffered_decode``, but the buffer is updated IN PLACE (the
    token's (k, u, G) is appended, lengths advance) and the same object is returned.  A request whose
    buffer is full (length C) first has its C entries folded into its state, then holds the new token
    alone; a direct-mode request folded so starts owning a state.  That needs state storage:
    ``buffer.state`` None with a full request is a ValueError (checked unless a CUDA graph is being
    captured).  ``config``: a :class:`kvbuffer_fast.launch.DecodeConfig`, None for the launch table's.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q: buffered_decode takes one token per request, expected [B, 1, H, K], got {shape}")
    d = check_tokens(q, k, v, g, beta)
    checked = checked_buffer(buffer, "buffered_decode", d, q.device)
    _, g = checked_tokens(q, k, v, g, beta, buffer=buffer)  # after the buffer's checks: its G counts
    C = buffer.capacity
    if checked and buffer.state is None:
        _require_no_full(buffer)
    s = check_scale(scale, d.K)
    if config is None:
        config = config_for("decode", key_of(q, C=C, B=d.B, HV=d.HV, V=d.V, channel=d.channel_gate,
                                             state=None if buffer.state is None else buffer.state.dtype))
    cfg = check_config("decode", config)
    if cfg.fold not in ("group", "tile"):
        raise ValueError(f"config.fold: expected 'group' or 'tile', got {cfg.fold!r}")
    o = new_output((d.B, 1, d.HV, d.V), v.dtype, q.device)
    if d.B == 0:
        return o, buffer
    storage = buffer.state is not None
    served = storage and cfg.fold == "group"
    pdl = pdl_launch(q, cfg.pdl)
    tokens = dict(q_ptr=as_input(q), k_ptr=as_input(k), v_ptr=as_input(v), g_ptr=as_input(g),
                  beta_ptr=as_input(beta), o_ptr=o, scale=s)
    with device_guard(q):
        if storage:
            _fold_launch(buffer, d, cfg, tokens, pdl)
        BV = _columns(cfg.BV, d.V)
        dot = state_dot(cfg, q, buffer.state, d.channel_gate)
        _decode_kernel[(triton.cdiv(d.V, BV), d.B * d.HV)](
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
            buffer.state if storage else buffer.lengths,  # without storage: a dummy pointer, never dereferenced
            **tokens, C=C, H=d.H, HV=d.HV, K=d.K, V=d.V, CB=block(C), BV=BV, KB=_rows(cfg.KB, d.K),
            NS=cfg.NS, CHANNEL=d.channel_gate, STORAGE=storage, SERVED=served, DOT=dot, num_warps=cfg.num_warps,
            **pdl,
        )
        _book_kernel[(d.B,)](tokens["k_ptr"], tokens["g_ptr"], buffer.k, buffer.G, buffer.lengths,
                             flag_view(buffer.has_state), C=C, H=d.H, HV=d.HV, K=d.K, BK=block(d.K),
                             BH=block(d.H, 1), BHV=block(d.HV, 1), CHANNEL=d.channel_gate, num_warps=1, **pdl)
    return o, buffer


def decode_pool(q, k, v, g, beta, pool: PoolLayer, *, current: torch.Tensor, read: torch.Tensor,
                write: torch.Tensor, scale: float, config: DecodeConfig) -> torch.Tensor:
    """``buffered_decode`` on a pool's layer (``PoolLayer``) with the grouped fold (C <= 32): three launches
    addressed by slot index, token row b on buffer row ``pool.slots[b]`` (-1: a pad, nothing read or
    written; int32 or int64, contiguous), int64 offsets:

    1. ``_fold_group_slots_kernel``: a full row folds the state of slot ``read[b]`` (-1: none, S0 = 0) into
       slot ``write[b]`` and serves its token;
    2. ``_decode_slots_kernel``: every other row's token, on the state of slot ``current[b]`` (-1: none);
    3. ``_book_slots_kernel``: the token's key and G appended, the length advanced.

    q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV]*; beta: [B, 1, HV]; current, read, write: [B] int64,
    the state slots the pool's bookkeeping (``KVPool._claims``) gave the rows in this layer; ``scale``: the
    checked query scale (a float); ``config``: the launch (``fold`` "group").  Returns o [B, 1, HV, V] in v's
    dtype (pad rows: unspecified).  The caller checked the tokens and the slots and took the state slots."""
    d = check_tokens(q, k, v, g, beta)
    cfg = check_config("decode", config)
    o = new_output((d.B, 1, d.HV, d.V), v.dtype, q.device)
    if d.B == 0:
        return o
    C, H, HV, K, V = pool.buffer.capacity, d.H, d.HV, d.K, d.V
    rows = (pool.buffer.k, pool.buffer.u, pool.buffer.G, pool.buffer.lengths, flag_view(pool.buffer.has_state),
            pool.state)
    tokens = dict(q_ptr=as_input(q), k_ptr=as_input(k), v_ptr=as_input(v), g_ptr=as_input(g),
                  beta_ptr=as_input(beta), o_ptr=o, scale=scale)
    pdl = pdl_launch(q, cfg.pdl)
    with device_guard(q):
        BV = _columns(cfg.fold_BV, V)
        FH = math.gcd(HV, cfg.fold_FH)
        _fold_group_slots_kernel[(triton.cdiv(V, BV), d.B * HV // FH)](
            *rows, **tokens, bslot_ptr=pool.slots, sread_ptr=read, swrite_ptr=write, C=C, H=H, HV=HV, K=K, V=V,
            CB=block(C), KB=_rows(cfg.fold_KB, K), BV=BV, FH=FH, NS=cfg.fold_NS, CHANNEL=d.channel_gate,
            num_warps=cfg.fold_warps, **pdl)
        BV = _columns(cfg.BV, V)
        dot = state_dot(cfg, q, pool.state, d.channel_gate)
        _decode_slots_kernel[(triton.cdiv(V, BV), d.B * HV)](
            *rows, **tokens, bslot_ptr=pool.slots, sslot_ptr=current, C=C, H=H, HV=HV, K=K, V=V,
            CB=block(C), BV=BV, KB=_rows(cfg.KB, K), NS=cfg.NS, CHANNEL=d.channel_gate, STORAGE=True,
            SERVED=True, DOT=dot,
            num_warps=cfg.num_warps, **pdl)
        _book_slots_kernel[(d.B,)](
            tokens["k_ptr"], tokens["g_ptr"], pool.buffer.k, pool.buffer.G, pool.buffer.lengths,
            flag_view(pool.buffer.has_state), pool.slots, C=C, H=H, HV=HV, K=K, BK=block(K), BH=block(H, 1),
            BHV=block(HV, 1), CHANNEL=d.channel_gate, num_warps=1, **pdl)
    return o


def state_dot(cfg: DecodeConfig, q: torch.Tensor, state: Optional[torch.Tensor], channel: bool) -> bool:
    """Whether the decode launch forms S0^T k and S0^T q by tl.dot (``cfg.dot``): only where that dot's
    products are exact, a 16-bit state of q's dtype with scalar gates; elsewhere by fp32 sums."""
    return (bool(cfg.dot) and state is not None and state.dtype == q.dtype and q.dtype in SIXTEEN_BIT
            and not channel)


def _require_no_full(buffer: KVBuffer) -> None:
    """A buffer without state storage cannot fold: a full request is a ValueError."""
    full = buffer.lengths >= buffer.capacity
    if bool(full.any()):
        b = int(full.nonzero()[0, 0])
        raise ValueError(
            f"buffer: request {b} has {buffer.capacity} entries and gets 1 more, past the capacity "
            f"C={buffer.capacity}, but the buffer has no state storage to fold into (buffer.state is None); "
            f"call flush() first (it allocates the state) or use a larger capacity"
        )


def _columns(BV: int, V: int) -> int:
    """A column tile of at most BV, no wider than V needs, at least 16 (tl.dot's minimum)."""
    return max(16, min(BV, block(V)))


def _rows(KB: int, K: int) -> int:
    """A block of at most KB key rows, no taller than K needs, at least 16."""
    return max(16, min(KB, block(K)))


def _fold_launch(buffer: KVBuffer, d, cfg: DecodeConfig, tokens: dict, pdl: dict) -> None:
    """Launch 1: fold the full buffers (grouped kernel, serving their tokens, or tile kernel)."""
    C = buffer.capacity
    BV = _columns(cfg.fold_BV, d.V)
    NV = triton.cdiv(d.V, BV)
    fields = (buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state)
    if cfg.fold == "group":
        FH = math.gcd(d.HV, cfg.fold_FH)
        _fold_group_kernel[(NV, d.B * d.HV // FH)](
            *fields, **tokens, C=C, H=d.H, HV=d.HV, K=d.K, V=d.V, CB=block(C), KB=_rows(cfg.fold_KB, d.K), BV=BV,
            FH=FH, NS=cfg.fold_NS, CHANNEL=d.channel_gate, num_warps=cfg.fold_warps, **pdl)
    else:
        _fold_tile_kernel[(NV, d.B * d.HV)](
            *fields, ticket_counters(d.B, buffer.k.device), C=C, H=d.H, HV=d.HV, K=d.K, V=d.V, FB=16,
            BK=block(d.K), BV=BV, NV=NV, CHANNEL=d.channel_gate, num_warps=cfg.fold_warps)
