"""Buffered decode (no state write per step) and flush (the fold), on the u-cache (k, u, G).

Every kernel runs one program per (request, value head, V-tile of BV columns): grid (V / BV, B * HV),
the layout of the recurrent kernel.  decode (G_new = G_n + g; per-channel gates put the exp inside
the dots):
    u = beta (v - exp(G_new) S0^T k - sum_{j<n} exp(G_new - G_j)(k.k_j) u_j)
    o = exp(G_new) S0^T q + sum_{j<n} exp(G_new - G_j)(q.k_j) u_j + (q.k) u
A full buffer (n == C) is first folded, S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T, and the
token then sees S with an empty buffer (C -> 1).

The default launch (variant="lean", fold="split", book="launch", pdl="late", the fold kernel "group";
docs/kernels.md has the H200 measurements that chose it):
1. ``_fold_group_kernel``, grid (V / BV, B * HV / FH): a program owns FH value heads of one request;
   if the request is full it walks their [K, BV] tiles in [KB, BV] blocks, folds each (one tl.dot of
   the C entries, fp32 FMA) and writes it back; serving (the default) it also serves the request's
   token from the folded blocks, else the request's last program (atomic ticket) empties the buffer.
   Otherwise it returns at once.  Few programs (FH="auto" takes 8 value heads, or 4 where 8 would give
   fewer than 1024 programs: 1024 at B=64 and at B=128): the launch costs ~1.5-2 us when no buffer is
   full.  It holds the u rows of all C entries per program, so for C > 32 the default ("auto") takes
   the tile kernel below, measured 2x faster at C=64.  (The previous fold kernel,
   ``_fold_full_kernel`` with one program of 167 registers per [K, BV] tile, took 9.3 us doing
   nothing: fold_launch=dict(kernel="tile").)
2. ``_decode_lean_kernel``: one loop over the key dimension in [KB, BV] state blocks that also forms
   the scores of the buffered keys block by block, so only blocks are live (few registers, many
   programs per SM); then the decays, the u rows of the n live entries, u and o.  A request launch 1
   served skips the loop (SERVED).
3. ``_book_kernel`` (one program per request): appends the new key (per q/k head) and G (per value
   head) and advances the length, after every program of launch 2 has read them.
With pdl=True (CUDA, sm_90+) the three are chained by programmatic dependent launch: each kernel's
programs may be placed before the previous kernel ends and wait for it (griddepcontrol.wait) before
they read anything, which hides part of the gaps between launches.  pdl="late" (the default) differs
for launch 2 only, when launch 1 serves the tokens of the requests it folds (fold_launch serve, the
default with the grouped kernel): launch 2 then reads and writes nothing launch 1 touches (the full
requests are launch 1's, the others only read there), so its programs run at once and wait for
launch 1 only before they exit, which is what lets launch 3 rely on both being complete.
Options: book="ticket" (the request's last decode program does 3, after an atomic ticket), "early"
(the ticket taken before the loop) or "snapshot" (1 copies the lengths to a scratch that 2 reads,
so 2 can append the rows itself); fold="fused" (a full request folds inside launch 2; no launch 1);
variant="tile" (the first kernel: the whole [K, BV] tile in registers, one round trip at C <= 16
with G_{n-1} picked out of the loaded rows, the fold fused in the same launch (fold="fused") or
split off).  Rows >= n that a kernel loads are dropped by selects, never multiplied by 0, and a
direct request's state storage is never used (a select), so garbage there (NaN) cannot leak.

    flush: S = diag(exp(G_m)) S0 + sum_{j<m} (exp(G_m - G_j) * k_j) u_j^T for a per-request prefix m,
    then the remaining u columns of the tile move down by m (rank-1 steps, off the hot path).

The cached keys [C, K] of a q/k head are shared by its HV/H value heads and their V-tiles: those
programs are adjacent in the grid, so the keys come from HBM once and from L2 after; each program
recomputes the scores (C*K multiply-adds, nothing next to its K*BV state tile).
"""


from __future__ import annotations

import math

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import check_buffer, check_flush_count, check_scale, check_tokens

from ._fold import fold_dot as _fold_dot, fold_rows as _fold_rows
from ._common import (check_u_form as _check_u_form, _CONFIG, _gdc_wait, _pdl_prologue, _program_ids, as_input, block, device_guard, flag_view,
                      int_scratch, launch_config, new_output, pdl_launch, require_inplace, ticket_counters)

__all__ = ["buffered_decode", "flush", "materialize_state"]


@triton.jit
def _bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, n,
                 C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr):
    """Append request i_b's new key (every q/k head) and G (every value head) at row `keep`, advance its
    length, and mark a folded request as owning a state.  n is its length before the step."""
    full = n >= C
    keep = tl.where(full, 0, n)
    has_last = (n > 0) & (n < C)  # the new G builds on G_n; on 0 when empty or folded (rebased)
    last = tl.maximum(n - 1, 0)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_h = tl.arange(0, BH)
    m_hk = (o_h < H)[:, None] & m_k[None, :]
    k_all = tl.load(k_ptr + (i_b * H + o_h[:, None]) * K + o_k[None, :], mask=m_hk, other=0.0)
    tl.store(ck_ptr + ((i_b * C + keep) * H + o_h[:, None]) * K + o_k[None, :], k_all.to(ck_ptr.dtype.element_ty),
             mask=m_hk)
    o_hv = tl.arange(0, BHV)
    if CHANNEL:
        m_g = (o_hv < HV)[:, None] & m_k[None, :]
        g_prev = tl.load(cg_ptr + ((i_b * C + last) * HV + o_hv[:, None]) * K + o_k[None, :], mask=m_g,
                         other=0.0).to(tl.float32)
        g_tok = tl.load(g_ptr + (i_b * HV + o_hv[:, None]) * K + o_k[None, :], mask=m_g, other=0.0).to(tl.float32)
        tl.store(cg_ptr + ((i_b * C + keep) * HV + o_hv[:, None]) * K + o_k[None, :],
                 (tl.where(has_last, g_prev, 0.0) + g_tok).to(cg_ptr.dtype.element_ty), mask=m_g)
    else:
        m_g = o_hv < HV
        g_prev = tl.load(cg_ptr + (i_b * C + last) * HV + o_hv, mask=m_g, other=0.0).to(tl.float32)
        g_tok = tl.load(g_ptr + i_b * HV + o_hv, mask=m_g, other=0.0).to(tl.float32)
        tl.store(cg_ptr + (i_b * C + keep) * HV + o_hv,
                 (tl.where(has_last, g_prev, 0.0) + g_tok).to(cg_ptr.dtype.element_ty), mask=m_g)
    tl.store(len_ptr + i_b, (keep + 1).to(len_ptr.dtype.element_ty))
    if full:
        tl.store(own_ptr + i_b, 1)


@triton.jit
def _ticket_bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, i_b, n,
                        C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, NV: tl.constexpr,
                        BK: tl.constexpr, BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr):
    """book="ticket": the request's last program to finish (an atomic ticket after a barrier, once every
    program of it has read them) writes what the others read (key / G rows, lengths, has_state) and
    resets its counter."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == HV * NV - 1:
        _bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, n, C, H, HV, K, BK, BH, BHV, CHANNEL)
        tl.store(ticket_ptr + i_b, 0)


@triton.jit
def _book_kernel(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr,
                 C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr,
                 PDL: tl.constexpr = False):
    """book="launch": the bookkeeping as a second, tiny launch (grid (B,)), after every decode program."""
    _pdl_prologue(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    _bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, n, C, H, HV, K, BK, BH, BHV, CHANNEL)


@triton.jit
def _entry_chunk(ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, rows, m_load, m_r, b_k, b_q, g_new, o_k, o_v, m_k, m_v,
                 C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 CHANNEL: tl.constexpr):
    """(sum_j w^k_j u_j, sum_j w^q_j u_j) over the rows of one chunk, w^x_j = exp(G_new - G_j)(x.k_j).

    Rows are loaded where m_load holds and used where m_r holds; the others may hold anything (NaN
    included): every use goes through tl.where, never through a multiplication by 0."""
    m2 = m_load[:, None] & m_k[None, :]
    kc = tl.load(ck_ptr + ((i_b * C + rows[:, None]) * H + i_h) * K + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
    uc = tl.load(cu_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                 mask=m_load[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    if CHANNEL:
        gc = tl.load(cg_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        kd = kc * tl.exp(tl.where(m_r[:, None], g_new[None, :] - gc, float("-inf")))
        kd = tl.where(m_r[:, None], kd, 0.0)
        wk = tl.sum(kd * b_k[None, :], 1)
        wq = tl.sum(kd * b_q[None, :], 1)
    else:
        gc = tl.load(cg_ptr + (i_b * C + rows) * HV + i_hv, mask=m_load, other=0.0).to(tl.float32)
        dec = tl.exp(tl.where(m_r, g_new - gc, float("-inf")))
        wk = tl.where(m_r, tl.sum(kc * b_k[None, :], 1) * dec, 0.0)
        wq = tl.where(m_r, tl.sum(kc * b_q[None, :], 1) * dec, 0.0)
    uc = tl.where(m_r[:, None], uc, 0.0)
    return tl.sum(wk[:, None] * uc, 0), tl.sum(wq[:, None] * uc, 0)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr,
    scale,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, FB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr, STORAGE: tl.constexpr, TICKET: tl.constexpr,
    FOLD: tl.constexpr = True,
):
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
    # ---- round trip 1: nothing here depends on a loaded value.  The state tile first, unmasked by
    # has_state (a direct request's storage may hold garbage: it is dropped by a select below).
    if STORAGE:
        s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(q_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_v = tl.load(v_ptr + i_bhv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta_ptr + i_bhv).to(tl.float32)
    if CHANNEL:
        g_tok = tl.load(g_ptr + i_bhv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    else:
        g_tok = tl.load(g_ptr + i_bhv).to(tl.float32)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    # the first CB cached rows always exist (rows < C): loaded before n is known, used where j < n
    rows = tl.arange(0, CB)
    m_r = rows < n
    if C <= CB:
        # G_{n-1} (the new token's G builds on it) is one of these rows: picked out, not loaded
        if CHANNEL:
            g_last = tl.sum(tl.where((rows == n - 1)[:, None] & m_k[None, :],
                                     tl.load(cg_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * K + o_k[None, :],
                                             mask=(rows < C)[:, None] & m_k[None, :], other=0.0).to(tl.float32),
                                     0.0), 0)
        else:
            g_last = tl.sum(tl.where(rows == n - 1, tl.load(cg_ptr + (i_b * C + rows) * HV + i_hv, mask=rows < C,
                                                            other=0.0).to(tl.float32), 0.0), 0)
    else:
        last = tl.maximum(n - 1, 0)
        if CHANNEL:
            g_last = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        else:
            g_last = tl.load(cg_ptr + (i_b * C + last) * HV + i_hv).to(tl.float32)
        g_last = tl.where(n > 0, g_last, 0.0)
    g_new = g_last + g_tok  # also when full: the folded state serves the token, G_C + g (see module doc)
    acc_k, acc_q = _entry_chunk(ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, rows, rows < C, m_r, b_k, b_q, g_new,
                                o_k, o_v, m_k, m_v, C, H, HV, K, V, CHANNEL)
    # ---- later chunks (C > CB only) depend on n
    if C > CB:
        for c0 in range(CB, n, CB):
            rows_c = c0 + rows
            a_k, a_q = _entry_chunk(ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, rows_c, rows_c < n, rows_c < n, b_k, b_q,
                                    g_new, o_k, o_v, m_k, m_v, C, H, HV, K, V, CHANNEL)
            acc_k += a_k
            acc_q += a_q
    e_new = tl.exp(g_new)
    if STORAGE:
        s = tl.where(owns, s, 0.0)  # a select: NaN in a direct request's storage never propagates
        sk = tl.sum(s * (b_k * e_new)[:, None], 0)
        sq = tl.sum(s * (b_q * e_new)[:, None], 0)
    else:
        sk = tl.zeros([BV], dtype=tl.float32)
        sq = tl.zeros([BV], dtype=tl.float32)
    b_u = b_beta * (b_v - sk - acc_k)
    b_o = sq + acc_q + tl.sum(b_q * b_k, 0) * b_u
    tl.store(o_ptr + i_bhv * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    full = n >= C
    if STORAGE and FOLD:
        if full:
            # the fold (1 step in C): S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T, FB rows per tl.dot
            if CHANNEL:
                s = s * tl.exp(g_last)[:, None]
            else:
                s = s * tl.exp(g_last)
            s = _fold_dot(s, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, tl.minimum(n, C), g_last, o_k, o_v, m_k, m_v,
                          C, H, HV, K, V, FB, CHANNEL)
            tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
            tl.debug_barrier()  # the fold read row 0 of this tile's u columns: every warp is past it
    keep = tl.where(full, 0, n)
    tl.store(cu_ptr + ((i_b * C + keep) * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty), mask=m_v)
    if TICKET:
        _ticket_bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, i_b, n, C, H, HV, K, NV,
                            BK, BH, BHV, CHANNEL)


@triton.jit
def _fold_block(st, owns, ck_ptr, cu_ptr, cg_ptr, p_blk, i_b, i_h, i_hv, n, g_fold, k0, o_kb, m_kb, o_v, m_v,
                C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                CHANNEL: tl.constexpr):
    """fold="fused" in the lean loop: rows k0 .. k0+KB of a full request's state, exp(G_C) S0 +
    sum_j exp(G_C - G_j) k_j u_j^T over its n = C entries, written back and returned.  st: the [KB, BV]
    block of S0 (anything where the request has no state: S0 = 0 then, by a select); g_fold: G_C
    (CHANNEL: loaded here for the block).  Rank-1 steps (_fold_rows, n a runtime trip count): a tl.dot
    here made ptxas allocate 255 registers and spill for the whole kernel (H200, triton 3.6)."""
    o_k = k0 + o_kb
    st = tl.where(owns, st, 0.0)
    if CHANNEL:
        g_end = tl.load(cg_ptr + ((i_b * C + C - 1) * HV + i_hv) * K + o_k, mask=m_kb, other=0.0).to(tl.float32)
        st = st * tl.exp(g_end)[:, None]
    else:
        g_end = g_fold
        st = st * tl.exp(g_end)
    st = _fold_rows(st, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, n, g_end, o_k, o_v, m_kb, m_v, C, H, HV, K, V,
                    CHANNEL)
    tl.store(p_blk, st.to(p_blk.dtype.element_ty), mask=m_kb[:, None] & m_v[None, :])
    return st


@triton.jit
def _fold_serve(state_ptr, k_ptr, q_ptr, g_ptr, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, i_bhv, n, g_fold, owns,
                o_kb, o_v, m_v, C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr):
    """fold="fused", a full request: its own loop over the KB-row blocks folds each block (_fold_block)
    and forms S^T k, S^T q from the folded block (the buffer is empty for the new token: G_new = g).
    Returns (S^T k, S^T q, the per-channel products k * q summed over blocks); exp(g) scales the first
    two later for scalar gates, per channel here."""
    sk = tl.zeros([BV], dtype=tl.float32)
    sq = tl.zeros([BV], dtype=tl.float32)
    qk = tl.zeros([KB], dtype=tl.float32)
    p_s = state_ptr + (i_bhv * K + o_kb[:, None]) * V + o_v[None, :]
    p_x = (i_b * H + i_h) * K + o_kb
    for k0 in range(0, K, KB):
        m_kb = (k0 + o_kb) < K
        st = tl.load(p_s + k0 * V, mask=m_kb[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        kb = tl.load(k_ptr + p_x + k0, mask=m_kb, other=0.0).to(tl.float32)
        qb = tl.load(q_ptr + p_x + k0, mask=m_kb, other=0.0).to(tl.float32)
        st = _fold_block(st, owns, ck_ptr, cu_ptr, cg_ptr, p_s + k0 * V, i_b, i_h, i_hv, n, g_fold, k0,
                         o_kb, m_kb, o_v, m_v, C, H, HV, K, V, CHANNEL)
        qk += kb * qb
        if CHANNEL:
            en = tl.exp(tl.load(g_ptr + i_bhv * K + k0 + o_kb, mask=m_kb, other=0.0).to(tl.float32))
            kb = kb * en
            qb = qb * en
        sk += tl.sum(st * kb[:, None], 0)
        sq += tl.sum(st * qb[:, None], 0)
    return sk, sq, qk


@triton.jit
def _decode_lean_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr,
    scale, snap_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    BH: tl.constexpr, BHV: tl.constexpr, CHANNEL: tl.constexpr, STORAGE: tl.constexpr, TICKET: tl.constexpr,
    KB: tl.constexpr, NS: tl.constexpr, LOADN: tl.constexpr, KEYN: tl.constexpr = False,
    KT: tl.constexpr = False, SNAP: tl.constexpr = False, FOLD: tl.constexpr = False,
    EARLY: tl.constexpr = False, PF: tl.constexpr = False, PDL: tl.constexpr = False,
    SERVED: tl.constexpr = False, LATE: tl.constexpr = False, EV_STATE: tl.constexpr = "",
    EV_ROWS: tl.constexpr = "",
):
    """ONE loop over the key dimension in KB-row blocks forms S0^T k, S0^T q and the scores k.k_j,
    q.k_j of the buffered keys together, so only [KB, *] blocks are live (few registers, many programs
    per SM).  CB = block(C) rows of entries.  LOADN / KEYN: load the u rows / key blocks of the n live
    entries only (else all C, dropped by selects); KT: key blocks as [KB, CB]; SNAP: book="snapshot"
    (the length from the fold launch's copy, and this kernel appends the key / G rows and the length
    itself).  Without FOLD (fold="split", the default) no request is full here: the fold launch ran
    first.  FOLD (fold="fused"): a full request (n == C) takes its own loop (_fold_serve), which folds
    its C entries into each state block, writes it back and serves the token from it with an empty
    buffer.  EARLY (book="early"): each program takes a "has read its length" ticket before its block
    loop (with PF: after issuing the first block, so the state load hides its latency); the request's
    last reader appends the key / G rows and advances the length at once, since no program reads row
    n; a folded request reads rows 0..C-1 to its end, so its rows are written by its last program to
    finish (a second ticket after a barrier).  PF: the state blocks are prefetched one iteration ahead
    in registers (two blocks in flight per program).  PDL: programmatic dependent launch (see
    _common._pdl_prologue).  FOLD, EARLY and PF measured slower on the H200 (docs/kernels.md).
    SERVED (fold launch with serve): a full request (n == C) was folded AND served by the fold launch;
    here it skips the block loop and its stores are masked off (its length stays C until the bookkeeping
    launch).
    LATE (pdl="late", only with SERVED): the previous kernel is the serving fold launch, which touches
    nothing this kernel reads or writes (full requests are its own, the rest only read there), so with
    PDL the programs run at once and wait for it only at their end, before exiting: the bookkeeping
    launch after this one then still starts after both.  EV_STATE / EV_ROWS: the L2 eviction policy of the
    state blocks (read once per step) and of the buffer's rows (keys, u, G: read again every step), e.g.
    "evict_first" / "evict_last" (decode option evict=True; "" is the default policy)."""
    GROUP: tl.constexpr = HV // H
    _pdl_prologue(PDL, WAIT=not LATE)  # LATE: the wait is at the end
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if SNAP:  # the fold launch's snapshot of the length (-1: folded just now); lengths is written below
        n_in = tl.load(snap_ptr + i_b).to(tl.int32)
        folded = n_in < 0
        n = tl.maximum(n_in, 0)
        owns = (tl.load(own_ptr + i_b) != 0) | folded
    else:
        n = tl.load(len_ptr + i_b).to(tl.int32)
        owns = tl.load(own_ptr + i_b) != 0
    if SERVED:  # served by the fold launch: nothing of this request is written here (nor its rows read)
        m_v = o_v < tl.where(n < C, V, 0)
    n_buf = n  # n: the entries loaded; n_buf: those live for the new token (0 once folded)
    if FOLD and STORAGE:
        full = n >= C
        n_buf = tl.where(full, 0, n)
    b_v = tl.load(v_ptr + i_bhv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta_ptr + i_bhv).to(tl.float32)
    rows = tl.arange(0, CB)
    m_c = rows < C
    if not CHANNEL:
        g_tok = tl.load(g_ptr + i_bhv).to(tl.float32)
        gc = tl.load(cg_ptr + (i_b * C + rows) * HV + i_hv, mask=m_c, other=0.0).to(tl.float32)
    if not LOADN:  # all C rows, issued before anything waits (rows >= n are dropped by selects)
        uc = tl.load(cu_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                     mask=m_c[:, None] & m_v[None, :], other=0.0, eviction_policy=EV_ROWS).to(tl.float32)
    o_kb = tl.arange(0, KB)
    p_s = state_ptr + (i_bhv * K + o_kb[:, None]) * V + o_v[None, :]
    p_x = (i_b * H + i_h) * K + o_kb
    if KT:  # the keys as [KB, CB] blocks: K on axis 0 like the state blocks (reductions along the same axis)
        p_c = ((i_b * C + rows[None, :]) * H + i_h) * K + o_kb[:, None]
    else:
        p_c = ((i_b * C + rows[:, None]) * H + i_h) * K + o_kb[None, :]
    sk = tl.zeros([BV], dtype=tl.float32)
    sq = tl.zeros([BV], dtype=tl.float32)
    wk = tl.zeros([CB], dtype=tl.float32)
    wq = tl.zeros([CB], dtype=tl.float32)
    qk = tl.zeros([KB], dtype=tl.float32)
    last = tl.maximum(n_buf - 1, 0)
    m_key = (rows < n) if KEYN else m_c  # KEYN: only the n stored rows (waits for n), else all C
    if CHANNEL:  # the fold loads its per-channel gates block by block
        g_fold = 0.0
    else:
        g_fold = tl.sum(tl.where(rows == C - 1, gc, 0.0), 0)  # G_C: used only by a full request
    tk = tl.zeros([], dtype=tl.int32)
    folding = False
    if FOLD and STORAGE:
        folding = full
    if SERVED:  # a served request skips the block loop: masked loads still issue (29 us of the loop's
        unserved = n < C  # instructions at B = 64 under ncu, beside the fold launch)
    else:
        unserved = True
    if folding:  # fold the C entries into each block, write it back, serve the token from it (buffer empty)
        sk, sq, qk = _fold_serve(state_ptr, k_ptr, q_ptr, g_ptr, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, i_bhv, n,
                                 g_fold, owns, o_kb, o_v, m_v, C, H, HV, K, V, KB, BV, CHANNEL)
        if EARLY:
            tk = tl.atomic_add(ticket_ptr + 2 * i_b, 1, sem="relaxed")
    elif unserved:
        st_next = tl.zeros([KB, BV], dtype=tl.float32)  # (defined on every path: the loop carries it when PF)
        if PF:  # the first block issued here; each iteration then issues the next before using its own
            if STORAGE:
                st_next = tl.load(p_s, mask=(o_kb < K)[:, None] & m_v[None, :], other=0.0,
                                  eviction_policy=EV_STATE).to(tl.float32)
        if EARLY:  # (after the first block's load when PF) the increment depends on n: taken once n is read
            tk = tl.atomic_add(ticket_ptr + 2 * i_b, tl.where(n >= 0, 1, 0), sem="relaxed")
        for k0 in tl.range(0, K, KB, num_stages=NS):
            m_kb = (k0 + o_kb) < K
            if STORAGE:
                if PF:
                    st = st_next
                    m_nx = (k0 + KB + o_kb) < K
                    st_next = tl.load(p_s + (k0 + KB) * V, mask=m_nx[:, None] & m_v[None, :], other=0.0,
                                      eviction_policy=EV_STATE).to(tl.float32)
                else:
                    st = tl.load(p_s + k0 * V, mask=m_kb[:, None] & m_v[None, :], other=0.0,
                                 eviction_policy=EV_STATE).to(tl.float32)
            kb = tl.load(k_ptr + p_x + k0, mask=m_kb, other=0.0).to(tl.float32)
            qb = tl.load(q_ptr + p_x + k0, mask=m_kb, other=0.0).to(tl.float32)
            if KT:
                kc = tl.load(ck_ptr + p_c + k0, mask=m_kb[:, None] & m_key[None, :], other=0.0,
                             eviction_policy=EV_ROWS).to(tl.float32)
            else:
                kc = tl.load(ck_ptr + p_c + k0, mask=m_key[:, None] & m_kb[None, :], other=0.0,
                             eviction_policy=EV_ROWS).to(tl.float32)
            qk += kb * qb
            if CHANNEL:
                gb = tl.load(g_ptr + i_bhv * K + k0 + o_kb, mask=m_kb, other=0.0).to(tl.float32)
                gl = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + k0 + o_kb, mask=m_kb, other=0.0).to(tl.float32)
                gn = tl.where(n_buf > 0, gl, 0.0) + gb  # G_new over this block of channels
                if KT:
                    gcb = tl.load(cg_ptr + ((i_b * C + rows[None, :]) * HV + i_hv) * K + k0 + o_kb[:, None],
                                  mask=m_kb[:, None] & m_c[None, :], other=0.0).to(tl.float32)
                    live = (rows < n_buf)[None, :]
                    kd = tl.where(live, kc * tl.exp(tl.where(live, gn[:, None] - gcb, 0.0)), 0.0)
                    wk += tl.sum(kd * kb[:, None], 0)
                    wq += tl.sum(kd * qb[:, None], 0)
                else:
                    gcb = tl.load(cg_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * K + k0 + o_kb[None, :],
                                  mask=m_c[:, None] & m_kb[None, :], other=0.0).to(tl.float32)
                    live = (rows < n_buf)[:, None]
                    kd = tl.where(live, kc * tl.exp(tl.where(live, gn[None, :] - gcb, 0.0)), 0.0)
                    wk += tl.sum(kd * kb[None, :], 1)
                    wq += tl.sum(kd * qb[None, :], 1)
                en = tl.exp(gn)
                if STORAGE:
                    sk += tl.sum(st * (kb * en)[:, None], 0)
                    sq += tl.sum(st * (qb * en)[:, None], 0)
            else:
                if KT:
                    wk += tl.sum(kc * kb[:, None], 0)
                    wq += tl.sum(kc * qb[:, None], 0)
                else:
                    wk += tl.sum(kc * kb[None, :], 1)
                    wq += tl.sum(kc * qb[None, :], 1)
                if STORAGE:
                    sk += tl.sum(st * kb[:, None], 0)
                    sq += tl.sum(st * qb[:, None], 0)
    m_r = rows < n_buf
    if LOADN:
        uc = tl.load(cu_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                     mask=m_r[:, None] & m_v[None, :], other=0.0, eviction_policy=EV_ROWS).to(tl.float32)
    uc = tl.where(m_r[:, None], uc, 0.0)
    if not CHANNEL:
        g_last = tl.where(n_buf > 0, tl.sum(tl.where(rows == n_buf - 1, gc, 0.0), 0), 0.0)
        g_new = g_last + g_tok
        dec = tl.exp(tl.where(m_r, g_new - gc, float("-inf")))
        wk = tl.where(m_r, wk * dec, 0.0)
        wq = tl.where(m_r, wq * dec, 0.0)
        e_new = tl.exp(g_new)
        sk = sk * e_new
        sq = sq * e_new
    acc_k = tl.sum(wk[:, None] * uc, 0)
    acc_q = tl.sum(wq[:, None] * uc, 0) * scale
    if STORAGE:
        if FOLD:
            owns = owns | full  # a folded block was written from S0 = 0 when the request had no state
        sk = tl.where(owns, sk, 0.0)  # a select: a direct request's storage (maybe NaN) never propagates
        sq = tl.where(owns, sq, 0.0) * scale
    b_u = b_beta * (b_v - sk - acc_k)
    b_o = sq + acc_q + tl.sum(qk, 0) * scale * b_u
    tl.store(o_ptr + i_bhv * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    # n_buf < C here (full buffers were folded, by this loop or by the split launch; a full one without
    # storage is refused); the new u row is the program's own slice, read by no other program
    tl.store(cu_ptr + ((i_b * C + n_buf) * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty),
             mask=o_v < tl.where(n_buf < C, V, 0), eviction_policy=EV_ROWS)
    if SNAP:
        # no other program reads row n (their reads of rows >= n are dropped by selects) nor lengths
        # (they read the snapshot): the new key / G rows and the length are written here directly.
        # n == C only with SERVED (the fold launch folded and served the request; the snapshot keeps C):
        # the buffer restarts at row 0 with this token's key and G, as the bookkeeping launch would
        restart = n >= C
        row = tl.where(restart, 0, n)
        if i_v == 0:
            if CHANNEL:
                o_k = tl.arange(0, BK)
                m_k = o_k < K
                gl = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                gt = tl.load(g_ptr + i_bhv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                tl.store(cg_ptr + ((i_b * C + row) * HV + i_hv) * K + o_k,
                         (tl.where((n > 0) & ~restart, gl, 0.0) + gt).to(cg_ptr.dtype.element_ty), mask=m_k)
            else:
                g_row = tl.where(restart, g_tok, g_new)
                tl.store(cg_ptr + (i_b * C + row) * HV + i_hv, g_row.to(cg_ptr.dtype.element_ty))
            if i_hv % GROUP == 0:
                o_k = tl.arange(0, BK)
                kk = tl.load(k_ptr + (i_b * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
                tl.store(ck_ptr + ((i_b * C + row) * H + i_h) * K + o_k, kk.to(ck_ptr.dtype.element_ty),
                         mask=o_k < K)
            if i_hv == 0:
                tl.store(len_ptr + i_b, (row + 1).to(len_ptr.dtype.element_ty))
                # the value every program computed (benign race); a served request now owns its state
                tl.store(own_ptr + i_b, (owns | restart).to(tl.uint8))
    if TICKET:
        _ticket_bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, i_b, n, C, H, HV, K, NV,
                            BK, BH, BHV, CHANNEL)
    if EARLY:
        last_reader = tk == HV * NV - 1
        if last_reader:
            tl.store(ticket_ptr + 2 * i_b, 0)
        if n < C:  # (n == C only with FOLD: a full buffer without it is folded by the split launch first)
            if last_reader:
                _bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, n, C, H, HV, K, BK, BH, BHV,
                             CHANNEL)
        else:
            tl.debug_barrier()
            done = tl.atomic_add(ticket_ptr + 2 * i_b + 1, 1)
            if done == HV * NV - 1:
                _bookkeeping(k_ptr, g_ptr, ck_ptr, cg_ptr, len_ptr, own_ptr, i_b, n, C, H, HV, K, BK, BH, BHV,
                             CHANNEL)
                tl.store(ticket_ptr + 2 * i_b + 1, 0)
    if LATE:
        if PDL:
            _gdc_wait()  # the fold launch has completed (and its writes are visible) when this program ends


@triton.jit
def _fold_snapshot(snap_ptr, i_b, n, first, C: tl.constexpr, STORAGE: tl.constexpr, SERVE: tl.constexpr = False):
    """book="snapshot": the request's first fold program copies its length for the decode launch
    (-1: folded here; without state storage nothing is folded; SERVE: folded and served here, the length
    C is copied as it is and the decode launch restarts the buffer)."""
    if first:
        if STORAGE and not SERVE:
            tl.store(snap_ptr + i_b, tl.where(n >= C, -1, n))
        else:
            tl.store(snap_ptr + i_b, n)


@triton.jit
def _fold_empty(len_ptr, own_ptr, ticket_ptr, i_b, programs):
    """After a full request's fold: its last program (an atomic ticket after a barrier, once all
    ``programs`` of the request have read its length) empties the buffer, marks the request as owning
    a state and resets the counter."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == programs - 1:  # the request's last program: every one has read its length
        tl.store(len_ptr + i_b, tl.zeros([], dtype=len_ptr.dtype.element_ty))  # emptied
        tl.store(own_ptr + i_b, 1)  # (a direct request now owns its folded state)
        tl.store(ticket_ptr + i_b, 0)


@triton.jit
def _serve_folded(v_ptr, beta_ptr, g_ptr, o_ptr, cu_ptr, i_b, i_hv, i_bhv, sk, sq, qk, scale, o_v, m_v,
                  C: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, CHANNEL: tl.constexpr):
    """fold launch with serve: the token of a request folded just now, from the folded state S with an
    empty buffer: sk = S^T k, sq = S^T q (per-channel gates: already with exp(g) inside), qk = k.q;
    u = beta (v - exp(g) S^T k), o = exp(g) S^T q s + (q.k) s u; u is written to row 0 of its own
    columns (the bookkeeping launch appends the key / G rows there and sets the length to 1)."""
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
def _serve_rows(k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                CHANNEL: tl.constexpr):
    """The token's k and q over the rows o_k of a state block, times exp(g) for per-channel gates (the
    new token's G with an empty buffer), and their part of k.q."""
    kb = tl.load(k_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    qb = tl.load(q_ptr + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    kq = tl.sum(kb * qb, 0)
    if CHANNEL:
        en = tl.exp(tl.load(g_ptr + i_bhv * K + o_k, mask=m_k, other=0.0).to(tl.float32))
        kb = kb * en
        qb = qb * en
    return kb, qb, kq


@triton.jit
def _serve_sums(st, k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, sk, sq, qk,
                H: tl.constexpr, K: tl.constexpr, CHANNEL: tl.constexpr):
    """Accumulate S^T k, S^T q (exp(g) inside for per-channel gates) and k.q over the rows o_k of a
    folded state block st [len(o_k), BV]."""
    kb, qb, kq = _serve_rows(k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, H, K, CHANNEL)
    return sk + tl.sum(st * kb[:, None], 0), sq + tl.sum(st * qb[:, None], 0), qk + kq


@triton.jit
def _fold_full_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr, snap_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    FB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, CHANNEL: tl.constexpr,
    SNAP: tl.constexpr = False, STORAGE: tl.constexpr = True, SERVE: tl.constexpr = False,
    q_ptr=None, k_ptr=None, v_ptr=None, g_ptr=None, beta_ptr=None, o_ptr=None, scale=1.0,
):
    """fold="split": before the decode launch, fold every FULL buffer (n == C) into its state,
    S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T (FB rows per tl.dot), and empty it (the request's
    last program sets its length to 0 and has_state); every other program returns at once.  The decode
    launch then sees those requests with an empty buffer and the folded state: the same outputs.
    SERVE (fold_launch serve=True): the program also serves the request's token from its folded tile
    (_serve_folded) and leaves the length at C; the decode launch skips full requests and the
    bookkeeping launch restarts their buffer at row 0."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    if SNAP:  # snapshot for the decode launch, which then writes lengths / has_state itself
        _fold_snapshot(snap_ptr, i_b, n, (i_v == 0) & (i_hv == 0), C, STORAGE, SERVE)
    if STORAGE:
        if n >= C:
            owns = tl.load(own_ptr + i_b) != 0
            o_k = tl.arange(0, BK)
            o_v = i_v * BV + tl.arange(0, BV)
            m_k = o_k < K
            m_v = o_v < V
            m_s = m_k[:, None] & m_v[None, :]
            p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
            s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
            s = tl.where(owns, s, 0.0)  # direct mode: S0 = 0 (the storage row may hold anything)
            if CHANNEL:
                g_end = tl.load(cg_ptr + ((i_b * C + C - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                s = s * tl.exp(g_end)[:, None]
            else:
                g_end = tl.load(cg_ptr + (i_b * C + C - 1) * HV + i_hv).to(tl.float32)
                s = s * tl.exp(g_end)
            s = _fold_dot(s, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, tl.minimum(n, C), g_end, o_k, o_v, m_k, m_v,
                          C, H, HV, K, V, FB, CHANNEL)
            tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_s)
            if SERVE:
                zero = tl.zeros([BV], dtype=tl.float32)
                sk, sq, qk = _serve_sums(s, k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, zero, zero,
                                         tl.zeros([], dtype=tl.float32), H, K, CHANNEL)
                _serve_folded(v_ptr, beta_ptr, g_ptr, o_ptr, cu_ptr, i_b, i_hv, i_bhv, sk, sq, qk, scale, o_v, m_v,
                              C, HV, V, CHANNEL)
    if STORAGE:
        if not SNAP and not SERVE:
            if n >= C:
                _fold_empty(len_ptr, own_ptr, ticket_ptr, i_b, HV * NV)


@triton.jit
def _fold_group_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr, snap_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, FH: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, SNAP: tl.constexpr = False, STORAGE: tl.constexpr = True, PDL: tl.constexpr = False,
    SERVE: tl.constexpr = False, q_ptr=None, k_ptr=None, v_ptr=None, g_ptr=None, beta_ptr=None, o_ptr=None,
    scale=1.0, FP: tl.constexpr = "ieee",
):
    """fold="split" with the fold kernel "group": like _fold_full_kernel, but a program owns FH value
    heads of one request (grid (V / BV, B * HV / FH)) and walks their [K, BV] tiles in KB-row blocks,
    each folded with one tl.dot of the C entries (fp32 FMA) and written back.  Few programs and few
    registers, so the launch costs little when no request is full (most steps), which is what the
    tile kernel's 8192 programs of 167 registers did not (10 us at B=128 under ncu).  SERVE: as in
    _fold_full_kernel, each folded block also feeds S^T k, S^T q of the token, which is served here.
    FP: the fold product's precision, "ieee" (fp32 FMA) or "tf32x3" (three TF32 tensor-core products,
    about fp32 accuracy; CUDA only): the FMA product made the kernel issue-bound."""
    NG: tl.constexpr = HV // FH
    _pdl_prologue(PDL)
    i_v = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_b = i_g // NG
    hv0 = (i_g % NG) * FH
    n = tl.load(len_ptr + i_b).to(tl.int32)
    if SNAP:
        _fold_snapshot(snap_ptr, i_b, n, (i_v == 0) & (hv0 == 0), C, STORAGE, SERVE)
    if STORAGE:
        if n >= C:
            owns = tl.load(own_ptr + i_b) != 0
            o_kb = tl.arange(0, KB)
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            rows = tl.arange(0, CB)
            m_c = rows < C
            for hh in range(FH):
                i_hv = hv0 + hh
                i_h = i_hv // (HV // H)
                i_bhv = i_b * HV + i_hv
                uf = tl.load(cu_ptr + ((i_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                             mask=m_c[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [CB, BV]
                if not CHANNEL:
                    gj = tl.load(cg_ptr + (i_b * C + rows) * HV + i_hv, mask=m_c, other=0.0).to(tl.float32)
                    g_end = tl.sum(tl.where(rows == C - 1, gj, 0.0), 0)
                    w = tl.where(m_c, tl.exp(g_end - gj), 0.0)
                sk = tl.zeros([BV], dtype=tl.float32)
                sq = tl.zeros([BV], dtype=tl.float32)
                qk = tl.zeros([], dtype=tl.float32)
                for k0 in tl.range(0, K, KB, num_stages=NS):
                    o_k = k0 + o_kb
                    m_k = o_k < K
                    p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
                    m_s = m_k[:, None] & m_v[None, :]
                    st = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
                    st = tl.where(owns, st, 0.0)  # direct mode: S0 = 0 (the storage row may hold anything)
                    kf = tl.load(ck_ptr + ((i_b * C + rows[None, :]) * H + i_h) * K + o_k[:, None],
                                 mask=m_k[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [KB, CB]
                    if CHANNEL:
                        ge = tl.load(cg_ptr + ((i_b * C + C - 1) * HV + i_hv) * K + o_k, mask=m_k,
                                     other=0.0).to(tl.float32)
                        gjk = tl.load(cg_ptr + ((i_b * C + rows[None, :]) * HV + i_hv) * K + o_k[:, None],
                                      mask=m_k[:, None] & m_c[None, :], other=0.0).to(tl.float32)
                        kf = tl.where(m_c[None, :], kf * tl.exp(ge[:, None] - gjk), 0.0)
                        st = st * tl.exp(ge)[:, None]
                    else:
                        kf = kf * w[None, :]
                        st = st * tl.exp(g_end)
                    st = tl.dot(kf, uf, st, input_precision=FP)
                    tl.store(p_s, st.to(state_ptr.dtype.element_ty), mask=m_s)
                    if SERVE:
                        sk, sq, qk = _serve_sums(st, k_ptr, q_ptr, g_ptr, i_b, i_h, i_bhv, o_k, m_k, sk, sq, qk,
                                                 H, K, CHANNEL)
                if SERVE:
                    _serve_folded(v_ptr, beta_ptr, g_ptr, o_ptr, cu_ptr, i_b, i_hv, i_bhv, sk, sq, qk, scale,
                                  o_v, m_v, C, HV, V, CHANNEL)
            if not SNAP and not SERVE:
                _fold_empty(len_ptr, own_ptr, ticket_ptr, i_b, NG * NV)  # NG * NV programs per request


@triton.jit
def _flush_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, count_ptr,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """Fold the first m entries into the state tile and move this tile's remaining u columns down.
    Keys and G (shared with other programs) are moved and rebased by the caller afterwards."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    m = tl.load(count_ptr + i_b).to(tl.int32)
    if m > 0:
        n = tl.load(len_ptr + i_b).to(tl.int32)
        owns = tl.load(own_ptr + i_b) != 0
        o_c = tl.arange(0, BC)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
        s = tl.load(p_s, mask=(o_k < tl.where(owns, K, 0))[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        if CHANNEL:
            g_end = tl.load(cg_ptr + ((i_b * C + m - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            s = s * tl.exp(g_end)[:, None]
        else:
            g_end = tl.load(cg_ptr + (i_b * C + m - 1) * HV + i_hv).to(tl.float32)
            s = s * tl.exp(g_end)
        s = _fold_rows(s, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, m, g_end, o_k, o_v, m_k, m_v, C, H, HV, K, V,
                       CHANNEL)
        tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
        m_rest = (o_c >= m) & (o_c < n)  # entries that stay: row j moves to row j - m
        p_cu = cu_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :]
        uc = tl.load(p_cu, mask=m_rest[:, None] & m_v[None, :], other=0.0)
        tl.debug_barrier()  # every warp has read the rows before any is overwritten
        tl.store(p_cu - m * HV * V, uc, mask=m_rest[:, None] & m_v[None, :])


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
    CB: Optional[int] = None,
    book: Optional[str] = None,
    maxnreg: Optional[int] = None,
    variant: Optional[str] = None,
    KB: Optional[int] = None,
    NS: Optional[int] = None,
    fold: Optional[str] = None,
    loadn: Optional[bool] = None,
    keyn: Optional[bool] = None,
    kt: Optional[bool] = None,
    pf: Optional[bool] = None,
    fold_launch: Optional[dict] = None,
    pdl=None,
    evict=None,
) -> tuple[torch.Tensor, KVBuffer]:
    """One new token per request from the stale state plus the buffer; returns (o, buffer).

    q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g: [B, 1, HV]*; beta: [B, 1, HV]; o: [B, 1, HV, V] in v's
    dtype.  Same results as ``kvbuffer_ref.buffered_decode``, but the buffer is updated IN PLACE
    (the token's (k, u, G) is appended, lengths advance) and the same object is returned.  A
    request whose buffer is full (length C) first has its C entries folded into its state (in the
    same launch), then holds the new token alone; a direct-mode request folded so starts owning a
    state.  That needs state storage: ``buffer.state`` None with a full request is a ValueError.

    ``validate=False`` skips the checks that read device values (buffer lengths, has_state): no host
    synchronisation, e.g. inside a CUDA graph; shapes are still checked.  ``BV`` / ``num_warps`` /
    ``CB`` (cached rows per chunk) / ``book`` ("ticket": the last program of a request appends the
    shared rows; "launch": a second tiny launch does) / ``maxnreg`` / ``fold_launch`` (a dict for the
    fold launch: ``kernel`` 'auto' / 'group' / 'tile', ``serve`` (it serves the tokens of the requests
    it folds; the default with the grouped kernel), ``prec`` 'ieee' / 'tf32x3', ``FH``, ``BV``, ``KB``,
    ``NS``, ``num_warps``, ``tile_BV``, ``tile_warps``; another key is a ValueError), ``pdl`` (True:
    the launches chained by programmatic dependent launch on sm_90+; "late", the default: the decode
    launch, whose requests the serving fold launch does not touch, waits for that launch only at its
    end, and as True where the fold launch does not serve; False: plain launches), ``evict`` (True: the
    lean kernel's state loads evict_first, its buffer-row loads and stores evict_last; 'auto', the
    default: True for the lean kernel; False: no hints) override the tuned
    launch (benchmarks only; ``DECODE_TUNE_CONFIGS`` lists the ones bench/gpu_decode.py --tune sweeps;
    docs/kernels.md the others).
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
    cfg = launch_config("decode", d.V, BV=BV, num_warps=num_warps, CB=CB, book=book, maxnreg=maxnreg,
                        variant=variant, KB=KB, NS=NS, fold=fold, loadn=loadn,
                        keyn=keyn, kt=kt, pf=pf, pdl=pdl, evict=evict)
    if cfg["variant"] not in ("tile", "lean"):
        raise ValueError(f"variant: expected 'tile' or 'lean', got {cfg['variant']!r}")
    ev = _evict(cfg)  # (checked here: before any launch)
    if cfg["fold"] not in ("fused", "split"):
        raise ValueError(f"fold: expected 'fused' or 'split', got {cfg['fold']!r}")
    if cfg["book"] not in ("ticket", "launch", "snapshot", "early"):
        raise ValueError(f"book: expected 'ticket', 'launch', 'snapshot' or 'early', got {cfg['book']!r}")
    if cfg["book"] == "early" and cfg["variant"] != "lean":
        raise ValueError("book: 'early' is only for variant='lean'")
    if cfg["book"] == "snapshot" and (cfg["variant"] != "lean" or cfg["fold"] != "split"):
        raise ValueError("book: 'snapshot' is only for variant='lean' with fold='split'")
    if cfg["pdl"] not in (True, False, "late"):
        raise ValueError(f"pdl: expected True, False or 'late', got {cfg['pdl']!r}")
    o = new_output((d.B, 1, d.HV, d.V), v.dtype, q.device)
    if d.B == 0:
        return o, buffer
    storage = buffer.state is not None
    state = buffer.state if storage else buffer.lengths  # a dummy pointer, never dereferenced
    NV = triton.cdiv(d.V, cfg["BV"])
    ticket = cfg["book"] == "ticket"
    shared = dict(C=C, H=d.H, HV=d.HV, K=d.K, BK=block(d.K), BH=block(d.H, 1), BHV=block(d.HV, 1),
                  CHANNEL=d.channel_gate)
    with device_guard(q):
        if cfg["variant"] == "lean":
            kernel, extra = _decode_lean_kernel, dict(KB=max(16, min(cfg["KB"], block(d.K))), NS=cfg["NS"],
                                                      CB=block(C),
                                                      LOADN=bool(cfg.get("loadn")), KEYN=bool(cfg.get("keyn")),
                                                      KT=bool(cfg.get("kt")), FOLD=cfg["fold"] == "fused",
                                                      EARLY=cfg["book"] == "early", PF=bool(cfg.get("pf")),
                                                      **ev)
        else:
            kernel, extra = _decode_kernel, dict(FB=16)
        if cfg["fold"] == "split" and cfg["variant"] == "tile":
            extra["FOLD"] = False
        snap = cfg["book"] == "snapshot"
        pdl = pdl_launch(q, cfg)  # programmatic dependent launch: the lean kernels and the group fold / book
        snapshot = int_scratch("snapshot", d.B, q.device) if snap else buffer.lengths
        if snap:
            extra.update(SNAP=True, snap_ptr=snapshot)
        elif cfg["variant"] == "lean":
            extra.update(snap_ptr=buffer.lengths)  # never read
        if cfg["fold"] == "split" and (storage or snap):
            unknown = sorted(set(fold_launch or {}) - set(_CONFIG["fold_full"]))
            if unknown:
                raise ValueError(f"fold_launch: unknown option(s) {unknown}; expected some of "
                                 f"{sorted(_CONFIG['fold_full'])}")
            fcfg = launch_config("fold_full", d.V, **(fold_launch or {}))
            if fcfg.get("kernel", "tile") not in ("tile", "group", "auto"):
                raise ValueError(f"fold_launch: kernel expected 'auto', 'tile' or 'group', got {fcfg['kernel']!r}")
            FH = fcfg["FH"]  # checked whichever kernel runs (only the grouped one uses it)
            if FH != "auto" and (not isinstance(FH, int) or isinstance(FH, bool) or FH < 1):
                raise ValueError(f"fold_launch: FH expected 'auto' or a positive int, got {FH!r}")
            if fcfg["kernel"] == "auto":  # measured on the H200: the grouped kernel holds all C rows of u
                if C <= 32:  # per program; at C=64 the tile one (BV=64, 4 warps) was 2x faster
                    fcfg["kernel"] = "group"
                else:
                    fcfg.update(kernel="tile", BV=max(16, min(fcfg["tile_BV"], block(d.V))),
                                num_warps=fcfg["tile_warps"])
            # serve: the fold launch also serves the token of each request it folds (a fold step reads the
            # state once).  The default (serve=True) applies where it was measured faster: the grouped kernel
            # with the lean decode kernel and the bookkeeping launch; asked for explicitly it must apply.
            serve = bool(fcfg.get("serve"))
            fits = cfg["variant"] == "lean" and cfg["book"] in ("launch", "snapshot")
            if serve and not (fits and fcfg["kernel"] == "group") and not (fold_launch or {}).get("serve"):
                serve = False  # the default, where it does not apply (the tile fold was slower serving: C = 64)
            if serve and not fits:
                raise ValueError(f"fold_launch: serve=True needs variant='lean' and book='launch' or 'snapshot' "
                                 f"(the decode launch skips served requests, the bookkeeping restarts their buffer), "
                                 f"got variant={cfg['variant']!r}, book={cfg['book']!r}")
            if serve:
                served = dict(SERVE=True, q_ptr=as_input(q), k_ptr=as_input(k), v_ptr=as_input(v),
                              g_ptr=as_input(g), beta_ptr=as_input(beta), o_ptr=o, scale=s)
                extra["SERVED"] = True
                # pdl="late": the decode launch reads and writes nothing of the serving fold launch's
                # requests, so it waits for that launch only at its end (the default pdl=True: at its start)
                extra["LATE"] = cfg["pdl"] == "late" and not snap  # (snapshot: read at the decode launch's start)
            else:
                served = {}
            NVF = triton.cdiv(d.V, fcfg["BV"])
            if fcfg.get("kernel", "tile") == "group":
                if FH == "auto":  # measured (session 6): FH = 4 at B = 64, 8 at B = 128 (Qwen3-Next heads): the
                    # 8-head programs until they number fewer than 1024 (about 8 per SM on an H200), then 4
                    FH = 8 if NVF * d.B * d.HV >= 8 * 1024 else 4
                FH = math.gcd(d.HV, FH)
                _fold_group_kernel[(NVF, d.B * d.HV // FH)](
                    buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), state,
                    ticket_counters(d.B, q.device), snapshot, C=C, H=d.H, HV=d.HV, K=d.K, V=d.V, CB=block(C),
                    KB=max(16, min(fcfg["KB"], block(d.K))), BV=fcfg["BV"], NV=NVF, FH=FH, NS=fcfg["NS"],
                    CHANNEL=d.channel_gate, SNAP=snap, STORAGE=storage, num_warps=fcfg["num_warps"], **pdl,
                    **served, FP=_fold_precision(q, fcfg.get("prec", "ieee")))
            else:
                _fold_full_kernel[(NVF, d.B * d.HV)](
                    buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), state,
                    ticket_counters(d.B, q.device), snapshot, C=C, H=d.H, HV=d.HV, K=d.K, V=d.V,
                    FB=16, BK=block(d.K), BV=fcfg["BV"], NV=NVF, CHANNEL=d.channel_gate, SNAP=snap,
                    STORAGE=storage, num_warps=fcfg["num_warps"], **served)
        kernel[(NV, d.B * d.HV)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), o,
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), state,
            ticket_counters(2 * d.B, q.device) if ticket or cfg["book"] == "early" else buffer.lengths,
            s,
            V=d.V, BV=cfg["BV"], NV=NV, STORAGE=storage, TICKET=ticket,
            num_warps=cfg["num_warps"], **shared, **{"CB": max(16, cfg["CB"]), **extra}, **_maxnreg(cfg),
            **(pdl if cfg["variant"] == "lean" else {}),
        )
        if cfg["book"] == "launch":
            _book_kernel[(d.B,)](as_input(k), as_input(g), buffer.k, buffer.G, buffer.lengths,
                                 flag_view(buffer.has_state), num_warps=1, **shared, **pdl)
    return o, buffer


def _fold_precision(x: torch.Tensor, prec: str) -> str:
    """The grouped fold kernel's product precision: 'ieee' or 'tf32x3' (CUDA; the interpreter: 'ieee')."""
    if prec not in ("ieee", "tf32x3"):
        raise ValueError(f"fold_launch: prec expected 'ieee' or 'tf32x3', got {prec!r}")
    return prec if x.is_cuda else "ieee"


def _evict(cfg: dict) -> dict:
    """The lean kernel's L2 eviction policies: with evict=True the state blocks (streamed once per step)
    are evicted first and the buffer's rows (keys and u, read again every step, stored evict_last too)
    last, so that the u-cache stays in L2 while the state streams past it.  'auto' (the default): True
    for the lean kernel (session 7 on the H200: B = 64 cycle 49.8 -> 46.7 us per step, B = 128 90.9 ->
    88.5), False for the tile kernel, which has no hints; True with the tile kernel is a ValueError."""
    evict = cfg.get("evict", "auto")
    if evict == "auto":
        evict = cfg["variant"] == "lean"
    elif not isinstance(evict, bool):
        raise ValueError(f"evict: expected True, False or 'auto', got {evict!r}")
    elif evict and cfg["variant"] != "lean":
        raise ValueError(f"evict: the eviction hints are the lean kernel's, got variant={cfg['variant']!r}")
    return dict(EV_STATE="evict_first", EV_ROWS="evict_last") if evict else {}


def _maxnreg(cfg: dict) -> dict:
    """The launch's register cap, passed only when set (Triton >= 3.0 takes ``maxnreg``)."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}


#: Launch configurations ``bench/gpu_decode.py --tune`` sweeps for buffered_decode (the best one that
#: passes its correctness check is timed).  The lean ones were the fastest in bench/gpu_probe.py's runs
#: (bench/results/h200_probe/); the register-tile kernel with its fold fused is the previous default.
DECODE_TUNE_CONFIGS = (
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True, pdl=True),
    dict(variant="lean", fold="split", book="snapshot", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True,
         pdl=True),
    dict(variant="lean", fold="split", book="snapshot", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True,
         kt=True, pdl=True),
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True,
         pdl=False),
    dict(variant="tile", fold="fused", book="ticket", BV=64, num_warps=2),
    # the grouped fold in tf32x3 on 4 warps, serving or not (slower in call 12), and session 3's default (the
    # fold launch not serving: 93.6 against 92.9 us per step for the default in call 12)
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True, pdl=True,
         fold_launch=dict(kernel="auto", prec="tf32x3", num_warps=4, serve=False)),
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True, pdl=True,
         fold_launch=dict(kernel="auto", prec="tf32x3", num_warps=4, serve=True)),
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True, pdl=True,
         fold_launch=dict(kernel="auto", prec="tf32x3", num_warps=4, serve=True, NS=1)),
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True, pdl=True,
         fold_launch=dict(kernel="auto", serve=False)),
    # the decode launch waits for the serving fold launch only at its end (session 5)
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True,
         pdl="late"),
    # with L2 eviction hints: the state blocks evicted first, the buffer's rows (read every step) last
    dict(variant="lean", fold="split", book="launch", BV=64, num_warps=2, KB=32, NS=1, loadn=True, keyn=True,
         pdl="late", evict=True),
)


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
    count = check_flush_count(count, buffer.lengths, validate)
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
        _flush_kernel[(triton.cdiv(V, cfg["BV"]), B * HV)](
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state, count,
            C=C, H=H, HV=HV, K=K, V=V, BC=block(C), BK=block(K), BV=cfg["BV"], CHANNEL=buffer.channel_gate,
            num_warps=cfg["num_warps"],
        )
        _shift_keys_and_gates(buffer, count)
    buffer.lengths.sub_(count)
    buffer.has_state.logical_or_(count > 0)
    return buffer


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
    """The current state S_n of every request [B, HV, K, V] (zeros where none exists); the buffer is unchanged."""
    fields = {f: (None if getattr(buffer, f) is None else getattr(buffer, f).clone())
              for f in ("k", "lengths", "state", "has_state", "u", "G", "v", "g", "beta")}
    folded = flush(KVBuffer(**fields))
    # a request that owns no state and had nothing to fold: its storage row is not its state
    owns = folded.has_state[:, None, None, None]
    return torch.where(owns, folded.state, torch.zeros((), dtype=folded.state.dtype, device=folded.state.device))
