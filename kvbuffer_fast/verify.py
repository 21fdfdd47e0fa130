"""verify: the outputs of D draft tokens per request (chains and trees, ragged) from the stale state plus
the buffer, on the u-cache, without forming any per-draft state.

Rows.  With BD >= D drafts (a power of two >= 8), the kernels work on R = 2 BD rows: row i < BD is
draft i's key (its innovation u_i is computed there) and row BD + i is draft i's scaled query (its
output o_i).  Per value head, with G_i = G_parent(i) + g_i (the root's parent: the buffer's tail, 0 if
empty), D_ij = exp(G_i - G_j), m over the request's n buffered entries and j over the tree:

    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_m D_im (k_i.k_m) u_m - sum_{j proper anc i} D_ij (k_i.k_j) u_j)
    o_i = exp(G_i) S0^T q_i + sum_m D_im (q_i.k_m) u_m + sum_{j anc i or j = i} D_ij (q_i.k_j) u_j

In matrix form over the R rows: N [U; O] = diag(b) Z with b = [beta; 1],
Z = [v; 0] + W U_buf + diag(sgn) Y S0 (sgn = -1 on key rows, +1 on query rows; W the decayed
draft x buffer scores with that sign; Y the rows k_i, s q_i scaled by exp(G_i), s the query scale), and
N unit lower triangular: [[I + A, 0], [-QQ, I]] with A_ij = beta_i D_ij (k_i.k_j) over proper
ancestors and QQ_ij = D_ij (q_i.k_j) over ancestors-or-self.  With L = N^-1 diag(b):

    [U; O] = L ([v; 0] + W U_buf) + P S0,     P = L diag(sgn) Y   ([R, K])

For scalar gates Y = diag(exp(G)) X with X the raw rows k_i, s q_i, so P S0 = L (diag(c) X S0) with the
row weights c = sgn exp(G) s (zero on padding rows), and [U; O] = L Z: the right-hand side Z is summed
elementwise in fp32, where the innovations' cancellation happens, before the one product by L.

Two launches:

1. Phase 1, everything that does not touch the state: the ancestor mask (a walk up ``parents``, at
   most d steps, on [R, R] registers), the scores vs the buffer and vs the tree, G along each path, the
   decays, N^-1 by forward substitution over the d key rows plus one product for the query rows, L and
   W (fp32 scratch), Drafts.G and Drafts.k.  Scalar gates: ``_verify_prep_group_kernel``, one
   program per (request, q/k head), since the HV / H value heads of a q/k head share the scores; it
   writes c per value head.  Per-channel (KDA) gates: ``_verify_prep_kernel``, one program per
   (request, value head), the decays inside the scores; it writes P.
2. Phase 2, ``_verify_stream_kernel``, grid (V / BV, B * HV): the state in [KB, BV] blocks through a
   pipelined loop, then L ([v; 0] + W U_buf + diag(c) X S0) (scalar gates; X read from the inputs) or
   L ([v; 0] + W U_buf) + P S0 (per-channel gates); direct-mode requests select zeros (of X S0, P S0);
   stores o and Drafts.u.

With PDL (CUDA, sm_90+) phase 2 is a programmatic dependent launch of phase 1: for scalar gates its
state loop, which reads nothing phase 1 writes, runs before it waits for phase 1's results.  With
``config.prep_per_sm`` (scalar gates) phase 1 runs on that many programs per SM, each taking (request,
q/k head) pairs in turn and flagging each pair's results ready (``_mark_ready``); a phase-2 program then
waits for its own pair's flag (``_wait_ready``) instead of the whole launch, so phase 2 streams the state
beside phase 1 from the start.  Nothing is written to the buffer, except with ``fold``.

``verify(fold=...)`` (a constexpr FOLD in both phases; fold=False compiles the kernels without it) also
folds the folding requests' n buffered entries into their states: phase 2 folds each [KB, BV] state block
it loads, S1 = exp(G_n) S0 + sum_m exp(G_n - G_m) k_m u_m^T (``_fold.fold_block``, the buffer's k, u, G
rows), and stores it over S0; the request's last phase-2 program (an atomic ticket, after every program
of the request has read n and has_state, and after the wait for phase 1, which reads n and the buffer's G
too) sets its length to 0 and has_state (``_fold.fold_empty``).  Phase 1 stores such a request's Drafts.G
as the path sums from 0 (what a verify after a flush stores; its decays between drafts are theirs) and
works in S0's frame (the tail's G added once) for the decays against the buffer and exp(G) S0.  Before
that wait phase 2 writes only the state, which phase 1 does not read.

The launch (tile sizes, warps, the early loads, PDL) is a ``kvbuffer_fast.launch.VerifyConfig``;
docs/speculative.md gives the measurements behind the table.

A serving pool (``kvbuffer_fast.pool.KVPool.verify``) runs the same two launches through ``verify_pool``
on a ``PoolLayer``: each call row reads its slot's buffer row and state slot and writes its drafts into
the slot's draft room by index (``_verify_stream_slots_kernel``; the phase-1 kernels with ``POOL``).
With ``fold`` the pool's bookkeeping gives each row the state slot it reads and the one its fold writes
(copy-on-write), and a folding row's drafts go to its emptied buffer's rows from 0 where they fit:
phase 1 leaves their keys and G in the draft room (phase 2 still reads the buffer's for the fold) and
the request's last phase-2 program moves them (``_drafts_to_buffer``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.checks import (check_fold, check_num_drafts, check_parents, check_scale, check_tokens,
                                 require_int_tensor)

from ._common import (PoolLayer, _drafts_in_buffer, _gdc_wait, _pdl_prologue, _program_ids, as_input, block,
                      check_growth, checked_buffer, checked_tokens, device_guard, flag_view, index_input, int_scratch,
                      new_output, pdl_launch, ticket_counters, values_checked)
from ._fold import fold_block, fold_empty
from .flush import flush, flush_pool
from .launch import SIXTEEN_BIT, Key, VerifyConfig, check_config, config_for, key_of

__all__ = ["verify", "MAX_DRAFTS", "PoolLayer", "verify_pool"]

#: The largest draft count per request one launch handles (the [2D, 2D] algebra lives in registers).
MAX_DRAFTS = 64


@triton.jit
def _ancestors(par, dr, m_t, o_r, o_c, t):
    """Over the [R, R] rows x draft columns: anc (draft c is on the root-to-dr(r) path, itself included),
    proper (the same without c = dr(r)) and is_self (r == c: row c of the key half is draft c).  A walk
    up ``par`` (the parents over the columns, -1 = the buffer's tail) of at most t steps."""
    cur = tl.where(m_t, dr, -1)
    anc = (o_r[:, None] < 0) & (o_c[None, :] < 0)
    for _ in range(0, t):
        hit = cur[:, None] == o_c[None, :]
        anc = anc | hit
        up = tl.sum(tl.where(hit, par[None, :], 0), 1)
        cur = tl.where(cur >= 0, up, -1)
    proper = anc & (o_c[None, :] != dr[:, None])
    is_self = o_r[:, None] == o_c[None, :]
    return anc, proper, is_self


@triton.jit
def _draft_rows(len_ptr, nd_ptr, i_b, c_b, D, BD: tl.constexpr):
    """The request's buffer length n (buffer row c_b) and draft count t (call row i_b), and the R = 2 BD rows every verify kernel works
    on: o_r (row index), dr (the draft a row belongs to), is_q (query rows BD..2BD-1), m_in (rows that
    exist in the [B, D, ...] inputs) and m_t (rows of real drafts; padding rows are zeroed by selects,
    never by multiplying)."""
    n = tl.load(len_ptr + c_b).to(tl.int32)
    t = tl.load(nd_ptr + i_b).to(tl.int32)
    o_r = tl.arange(0, 2 * BD)
    dr = o_r % BD
    is_q = o_r >= BD
    return n, t, o_r, dr, is_q, dr < D, dr < t


@triton.jit
def _buffer_row(bslot_ptr, i_b, POOL: tl.constexpr):
    """The buffer row of call row i_b: ``bslot[i_b]`` in a pool (-1: a pad, nothing to do), else i_b."""
    if POOL:
        c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    else:
        c_b = i_b
    return c_b


@triton.jit
def _folds(fold_ptr, i_b, FOLD: tl.constexpr):
    """Whether call row i_b folds its buffer (``verify(fold=...)``): FOLD 1, every row; FOLD 2, the row's
    flag ``fold[i_b]``.  Only called with FOLD != 0."""
    if FOLD == 2:
        f = tl.load(fold_ptr + i_b) != 0
    else:
        f = i_b >= 0
    return f


@triton.jit
def _fold_row(fold_ptr, i_b, n, FOLD: tl.constexpr):
    """Phase 1's fold flags of call row i_b with n buffered entries: (fr, whether the row folds, which sets
    the frame of its Drafts.G; moved, whether it has entries to fold: a pool row then leaves its drafts' keys
    and G in the room, ``_draft_dest``).  Without FOLD both are false."""
    if FOLD:
        fr = _folds(fold_ptr, i_b, FOLD)
    else:
        fr = n < 0
    return fr, fr & (n > 0)


@triton.jit
def _draft_dest(room_ptr, buf_ptr, c_b, n, C: tl.constexpr, DR, POOL: tl.constexpr, to_room, FOLD: tl.constexpr):
    """Where the drafts of buffer row c_b (n entries) are written: (tensor, first row).  In a pool, the
    buffer's own rows n..n+DR-1 when all DR fit in its C rows (``n + DR <= C``, the room's drafts in
    place, so that accepting a chain moves nothing) unless ``to_room`` (read with FOLD only); otherwise,
    and outside a pool, the draft room's rows c_b * DR.. .  ``room_ptr`` and ``buf_ptr`` are the same kind
    of rows (keys, u or G).  ``to_room``: phase 1 of a pool row that folds (``verify(fold=...)``), whose
    buffer rows phase 2 still reads for the fold: its keys and G wait in the room (``_drafts_to_buffer``
    moves them)."""
    dst = room_ptr
    r0 = c_b * DR
    if POOL:
        inb = _drafts_in_buffer(n, DR, C)
        if FOLD:
            inb = inb & ~to_room
        if inb:
            dst = buf_ptr
            r0 = c_b * C + n
    return dst, r0


@triton.jit
def _copy_flat(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Copy the n contiguous elements at ``src_ptr`` to ``dst_ptr`` (converted to its dtype), BLOCK at a time."""
    o = tl.arange(0, BLOCK)
    for i0 in range(0, n, BLOCK):
        m = i0 + o < n
        tl.store(dst_ptr + i0 + o, tl.load(src_ptr + i0 + o, mask=m).to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _drafts_to_buffer(dk_ptr, dg_ptr, ck_ptr, cg_ptr, c_b, D, DR, C: tl.constexpr, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, GK: tl.constexpr, BLOCK: tl.constexpr):
    """A pool row that folded in verify, by its last phase-2 program (every other one has read the buffer's
    keys and G for the fold): where its DR drafts fit the emptied buffer (``_drafts_in_buffer(0, ...)``), the
    keys and G phase 1 left in the room rows c_b * DR.. (D of them: the call's drafts) go to the buffer's
    rows from 0, where accept looks for them (its rule, with the length 0 it finds); otherwise they stay
    in the room, accept's other source.  The rows are contiguous: two flat copies (GK: the G columns per
    value head, K for per-channel gates)."""
    if _drafts_in_buffer(0, DR, C):
        _copy_flat(dk_ptr + c_b * DR * (H * K), ck_ptr + c_b * C * (H * K), D * (H * K), BLOCK)
        _copy_flat(dg_ptr + c_b * DR * (HV * GK), cg_ptr + c_b * C * (HV * GK), D * (HV * GK), BLOCK)


@triton.jit
def _room_meta(par_ptr, nd_ptr, rpar_ptr, rnd_ptr, pend_ptr, i_b, c_b, D, DR, BDR: tl.constexpr):
    """A pool's draft room row c_b: the call's parents of row i_b (-1 past its D drafts, up to the room's DR),
    its draft count, and the pending flag."""
    o_d = tl.arange(0, BDR)
    par = tl.load(par_ptr + i_b * D + o_d, mask=o_d < D, other=-1)
    tl.store(rpar_ptr + c_b * DR + o_d, par.to(rpar_ptr.dtype.element_ty), mask=o_d < DR)
    tl.store(rnd_ptr + c_b, tl.load(nd_ptr + i_b).to(rnd_ptr.dtype.element_ty))
    tl.store(pend_ptr + c_b, 1)


@triton.jit
def _chunk_inputs(k_ptr, q_ptr, p_kq, m_in, is_q, o_k, m_k):
    """Columns o_k of the draft rows as stored: the keys on the key rows, the queries on the query rows
    (0 elsewhere; the inputs' dtype)."""
    k_in = tl.load(k_ptr + p_kq[:, None] + o_k[None, :], mask=(m_in & ~is_q)[:, None] & m_k[None, :], other=0.0)
    q_in = tl.load(q_ptr + p_kq[:, None] + o_k[None, :], mask=(m_in & is_q)[:, None] & m_k[None, :], other=0.0)
    return k_in, q_in


@triton.jit
def _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, k0, scale,
                K: tl.constexpr, KC: tl.constexpr, CHANNEL: tl.constexpr):
    """Columns k0..k0+KC of the draft rows: the raw keys (for Drafts.k), the rows k_i / scale*q_i (padding
    rows selected to 0) and, per-channel, the drafts' gates on the key rows."""
    o_k = k0 + tl.arange(0, KC)
    m_k = o_k < K
    k_in, q_in = _chunk_inputs(k_ptr, q_ptr, p_kq, m_in, is_q, o_k, m_k)
    kq = tl.where(m_t[:, None], k_in.to(tl.float32) + q_in.to(tl.float32) * scale, 0.0)
    if CHANNEL:
        g = tl.load(g_ptr + p_rt[:, None] * K + o_k[None, :], mask=(m_in & ~is_q)[:, None] & m_k[None, :], other=0.0)
        g = tl.where(m_t[:, None], g.to(tl.float32), 0.0)
    else:
        g = kq  # unused
    return k_in, kq, g


@triton.jit
def _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, k0, K: tl.constexpr, KC: tl.constexpr, CHANNEL: tl.constexpr):
    """Columns k0..k0+KC of the buffered keys [BC, KC] (and per-channel G) of the first n entries."""
    o_k = k0 + tl.arange(0, KC)
    m = m_n[:, None] & (o_k < K)[None, :]
    kc = tl.load(ck_ptr + p_ck[:, None] + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if CHANNEL:
        gc = tl.load(cg_ptr + p_cg[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        gc = kc  # unused
    return kc, gc


@triton.jit
def _chunk_channel(kq, g, kc, gc, anc, o_r, o_m, m_t, m_n, n, t, BD: tl.constexpr, R: tl.constexpr,
                   BC: tl.constexpr, SCORES: tl.constexpr, fr, FOLD: tl.constexpr):
    """Per-channel gates, one column chunk: G of every row (base + the gates along its path) and this
    chunk's share of the decayed scores vs the buffer [R, BC] and vs the tree [R, R], row by row, the decays
    differences of those G and the buffer's (``_group_decays`` says why).  Returns (G in S0's frame, G as
    Drafts.G stores it, SB, SS); FOLD with ``fr`` (the request folds): ``_group_decays``'s two frames."""
    base = tl.sum(tl.where((o_m == n - 1)[:, None], gc, 0.0), 0)  # the buffer tail's G (0 if empty)
    if FOLD:
        start = tl.where(fr, 0.0, base)
    else:
        start = base
    Gr = tl.zeros(kq.shape, dtype=tl.float32) + start[None, :]
    o_c = tl.arange(0, R)
    for j in range(0, t):  # root to node: G_i = G_parent(i) + g_i, one rounding per step as a decode stores it
        a_j = tl.sum(tl.where(anc & (o_c[None, :] == j), 1, 0), 1) > 0
        g_j = tl.sum(tl.where((o_r == j)[:, None], g, 0.0), 0)
        Gr += tl.where(a_j[:, None], g_j[None, :], 0.0)
    Gr = tl.where(m_t[:, None], Gr, 0.0)
    if FOLD:  # S0's frame: the tail's G added once to the path sums from 0
        Gb = tl.where(m_t[:, None], Gr + (base - start)[None, :], 0.0)
    else:
        Gb = Gr
    SB = tl.zeros([R, BC], dtype=tl.float32)
    SS = tl.zeros([R, R], dtype=tl.float32)
    n_rows = t * 0
    if SCORES:  # else only G
        n_rows = 2 * t
    for rr in range(0, n_rows):
        r = tl.where(rr < t, rr, BD + rr - t)
        sel = o_r == r
        x_r = tl.sum(tl.where(sel[:, None], kq, 0.0), 0)
        G_r = tl.sum(tl.where(sel[:, None], Gr, 0.0), 0)
        if FOLD:
            Gb_r = tl.sum(tl.where(sel[:, None], Gb, 0.0), 0)
        else:
            Gb_r = G_r
        dec = tl.exp(tl.where(m_n[:, None], Gb_r[None, :] - gc, float("-inf")))
        SB = tl.where(sel[:, None], tl.sum(kc * dec * x_r[None, :], 1)[None, :], SB)
        a_r = tl.sum(tl.where(sel[:, None] & anc, 1, 0), 0) > 0  # [R] ancestors-or-self (as key rows)
        decd = tl.exp(tl.where(a_r[:, None], G_r[None, :] - Gr, float("-inf")))
        SS = tl.where(sel[:, None], tl.sum(kq * decd * x_r[None, :], 1)[None, :], SS)
    return Gb, Gr, SB, SS


@triton.jit
def _group_path_sums(gc2, g_in2, anc, m_t, m_ct, o_m, n, t, fr, FOLD: tl.constexpr):
    """Scalar gates, the value heads of a q/k head at once ([BG, *] rows, one per head): G of each row's
    draft, the buffer tail's G plus the gates along its path ([BG, R]; 0 on padding rows), as Drafts.G
    stores it, and the tail's G ([BG]; 0 if the buffer is empty).  The walk over the drafts' columns and
    its ancestor masks are the heads' common part.

    FOLD with ``fr`` (the request's buffer is folded by this verify): Drafts.G are the path sums from 0,
    as a verify after a flush stores them and as accept will fold them (``_group_decays`` adds the tail's
    G for S0's frame); otherwise the sums from the tail's G."""
    base = tl.sum(tl.where((o_m == n - 1)[None, :], gc2, 0.0), 1)  # [BG] the buffer tail's G
    if FOLD:
        start = tl.where(fr, 0.0, base)
    else:
        start = base
    gd2 = tl.where(m_ct[None, :], g_in2, 0.0)  # [BG, R] over columns
    Gr2 = tl.zeros_like(gd2) + start[:, None]
    o_c = tl.arange(0, gd2.shape[1])
    for j in range(0, t):  # root to node: G_i = G_parent(i) + g_i, one rounding per step as a decode stores it
        a_j = tl.sum(tl.where(anc & (o_c[None, :] == j), 1, 0), 1) > 0
        g_j = tl.sum(tl.where((o_c == j)[None, :], gd2, 0.0), 1)  # [BG]
        Gr2 += tl.where(a_j[None, :], g_j[:, None], 0.0)
    return tl.where(m_t[None, :], Gr2, 0.0), base


@triton.jit
def _group_decays(SB, SS, gc2, Gd2, base2, is_self, anc, m_t, m_n, fr, FOLD: tl.constexpr):
    """Scalar gates, the value heads of a q/k head at once: the shared scores vs the buffer [R, BC] and vs
    the tree [R, R] multiplied by each head's decays exp(G_i - G_j) ([BG, R, BC] and [BG, R, R]), from Gd2
    (G of each row's draft as Drafts.G stores it, ``_group_path_sums``), the buffer's G ``gc2`` and its
    tail's ``base2``.

    The decays are differences of the G that are stored (the buffer's, and Drafts.G as returned): accept and
    flush fold the drafts' u with exactly those G, so u must be solved with them.  At |G| of a few hundred a
    float32 G carries ~1e-5 of rounding; a fold undoes what the solve saw, and only that (decays taken from
    the drafts' path sums alone, more accurate by themselves, left the state after accept + flush 4-5x the
    error of the oracle's float32 forms: tests/property/test_fast_verify.py, the buffer's frame).

    Returns (G in S0's frame [BG, R], SB3, SS3).  FOLD with ``fr``: Gd2 are the path sums from 0 and the
    decays between drafts are their differences; S0's frame (the decays against the buffer and exp(G) S0)
    adds the tail's G to them once.  Otherwise Gd2 is already in S0's frame."""
    Gc2 = tl.sum(tl.where(is_self[None, :, :], Gd2[:, :, None], 0.0), 1)  # [BG, R] G over columns
    if FOLD:  # S0's frame: the tail's G added once to the path sums from 0
        Gb2 = tl.where(m_t[None, :], Gd2 + tl.where(fr, base2, 0.0)[:, None], 0.0)
    else:
        Gb2 = Gd2
    SB3 = SB[None, :, :] * tl.exp(tl.where((m_t[:, None] & m_n[None, :])[None, :, :],
                                           Gb2[:, :, None] - gc2[:, None, :], float("-inf")))
    SS3 = SS[None, :, :] * tl.exp(tl.where(anc[None, :, :], Gd2[:, :, None] - Gc2[:, None, :], float("-inf")))
    return Gb2, SB3, SS3


@triton.jit
def _group_solve(SB3, SS3, is_q, proper, is_self, b_row2, b_col2, o_r, o_c, t, PREC: tl.constexpr):
    """``_solve_rows`` for the value heads of a q/k head at once ([BG, R, *]; b_row2, b_col2 [BG, R]): one
    forward substitution carries every head's rows, so their dependent steps interleave.  Returns (L3, W3)."""
    W3 = tl.where(is_q[None, :, None], SB3, -SB3)
    M3 = tl.where(is_q[None, :, None], -SS3, tl.where(proper[None, :, :], b_row2[:, :, None] * SS3, 0.0))
    Ninv = tl.zeros_like(M3) + tl.where(is_self, 1.0, 0.0)[None, :, :]
    for i in range(0, t):
        a_i = tl.sum(tl.where((o_r == i)[None, :, None], M3, 0.0), 1)  # [BG, R] row i of M
        row = tl.where((o_c == i)[None, :], 1.0, 0.0) - tl.sum(a_i[:, :, None] * Ninv, 1)
        Ninv = tl.where((o_r == i)[None, :, None], row[:, None, :], Ninv)
    Ninv -= tl.dot(tl.where(is_q[None, :, None], M3, 0.0), Ninv, input_precision=PREC)
    return Ninv * b_col2[:, None, :], W3


@triton.jit
def _solve_rows(SB, SS, is_q, proper, is_self, b_row, b_col, o_r, o_c, t, PREC: tl.constexpr):
    """From the decayed scores: W (sign -1 on key rows), M = N - I (strictly lower), N^-1 of the key
    rows by forward substitution over the t key rows, one product for the query rows, and
    L = N^-1 diag(b)."""
    W = tl.where(is_q[:, None], SB, -SB)
    M = tl.where(is_q[:, None], -SS, tl.where(proper, b_row[:, None] * SS, 0.0))
    eye = tl.where(is_self, 1.0, 0.0)
    Ninv = eye
    for i in range(0, t):
        a_i = tl.sum(tl.where((o_r == i)[:, None], M, 0.0), 0)
        row = tl.where(o_c == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Ninv, 0)
        Ninv = tl.where((o_r == i)[:, None], row[None, :], Ninv)
    Ninv -= tl.dot(tl.where(is_q[:, None], M, 0.0), Ninv, input_precision=PREC)
    return Ninv * b_col[None, :], W


@triton.jit
def _store_l(l_ptr, L, W, i_bhv, o_r, o_c, o_m, R: tl.constexpr, BC: tl.constexpr):
    """Phase 1's L and W for one value head ([R, R + BC] rows of ``l_ptr``)."""
    p_l = l_ptr + (i_bhv * R + o_r[:, None]) * (R + BC)
    tl.store(p_l + o_c[None, :], L)
    tl.store(p_l + R + o_m[None, :], W)


@triton.jit
def _group_store(l_ptr, c_ptr, dg_dst, L3, W3, Gb2, Gd2, hv2, m_g1, i_b, p_dg, m_dg, is_q, m_t, o_r, o_c, o_m, m_n,
                 scale, HV: tl.constexpr, R: tl.constexpr, BC: tl.constexpr):
    """Phase 1's results for the value heads hv2 ([BG], those with ``m_g1``) of a q/k head: L and W
    ([R, R + BC] rows of ``l_ptr`` per head; only the rows of real drafts, and of W the columns of the n
    live entries: phase 2 reads no more, the rest being zero), the row weights c = sgn exp(G) s ([R];
    s = the query scale on query rows, zero on padding rows), by which phase 2 scales X S0 before L
    multiplies it, and Drafts.G (Gd2, at rows p_dg [R] where m_dg)."""
    p_l = l_ptr + ((i_b * HV + hv2)[:, None, None] * R + o_r[None, :, None]) * (R + BC)
    m_row = m_g1[:, None, None] & m_t[None, :, None]
    tl.store(p_l + o_c[None, None, :], L3, mask=m_row)
    tl.store(p_l + R + o_m[None, None, :], W3, mask=m_row & m_n[None, None, :])
    c2 = tl.where(m_t[None, :], tl.where(is_q, scale, -1.0)[None, :] * tl.exp(Gb2), 0.0)
    tl.store(c_ptr + (i_b * HV + hv2)[:, None] * R + o_r[None, :], c2, mask=m_g1[:, None])
    tl.store(dg_dst + p_dg[None, :] * HV + hv2[:, None], Gd2.to(dg_dst.dtype.element_ty),
             mask=m_g1[:, None] & m_dg[None, :])


@triton.jit
def _verify_prep_group_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr,
    ck_ptr, cg_ptr, len_ptr, p_ptr, l_ptr,
    scale, D, bslot_ptr, rpar_ptr, rnd_ptr, pend_ptr, DR,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
    BG: tl.constexpr, MMA16: tl.constexpr, POOL: tl.constexpr, BDR: tl.constexpr,
    fold_ptr, FOLD: tl.constexpr, ready_ptr, NBH, READY: tl.constexpr = 0,
):
    """Phase 1 for scalar gates, one program per (request, q/k head), or (READY > 0) a grid of fewer
    programs, each taking (request, q/k head) pairs i_bh = program, program + grid, ... in turn, that marks
    each pair's results ready as it finishes them (``_mark_ready``: READY, the phase-2 programs that read
    them) so that phase 2 waits for its own pair only (``_wait_ready``), not for the whole launch.
    The scores of the drafts' keys / queries against the buffer [R, BC] and the tree [R, R] are the same
    for the HV / H value heads that share the q/k head (only their decays, betas and gates differ), so
    they are formed once, in chunks
    of KC key columns; then G, the decays, N^-1, L, W and the row weights c = sgn exp(G) s of all those
    value heads at once ([BG, R, *] tensors: ``_group_path_sums``, ``_group_decays``, ``_group_solve``,
    ``_group_store``), and Drafts.G and Drafts.k.
    The betas and gates of all the value heads ([BG, *], BG = the group size rounded up to a power of
    two) are loaded before the chunk loop, so that no value head waits for a load issued after a store
    (such a load cannot be moved above the store: the pointers might alias).
    MMA16 (q, k and the buffered keys all bf16 or all fp16): the scores are 16-bit MMAs of the raw rows
    (exact products, fp32 sums: nothing to split), and the query scale multiplies the finished scores'
    query rows; otherwise fp32 dots of the rows k_i, s q_i in PREC.
    POOL: call row i_b works on buffer row ``bslot[i_b]`` of a serving pool (-1: a pad, nothing done) and
    writes its drafts to that row's draft room (DR drafts per row), with the room's parents, draft count
    and pending flag; else buffer row i_b and drafts of D rows per request (DR = D).
    FOLD (``verify(fold=...)``; ``_folds``): a folding row's Drafts.G are stored relative to the empty
    buffer its phase 2 leaves: the path sums from 0, as a verify after a flush stores them
    (``_group_path_sums``); in a pool, a row that folds entries writes its drafts' k and G to its draft room
    (``_fold_row``, ``_draft_dest``)."""
    _pdl_prologue(PDL)
    if READY:
        for i_bh in range(tl.program_id(0), NBH, tl.num_programs(0)):
            _verify_prep_group_pair(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr,
                                    len_ptr, p_ptr, l_ptr, scale, D, bslot_ptr, rpar_ptr, rnd_ptr, pend_ptr, DR,
                                    i_bh, C, H, HV, K, BD, BC, KC, PREC, BG, MMA16, POOL, BDR, fold_ptr, FOLD,
                                    ready_ptr, READY)
    else:
        _verify_prep_group_pair(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr,
                                len_ptr, p_ptr, l_ptr, scale, D, bslot_ptr, rpar_ptr, rnd_ptr, pend_ptr, DR,
                                tl.program_id(0), C, H, HV, K, BD, BC, KC, PREC, BG, MMA16, POOL, BDR, fold_ptr, FOLD,
                                ready_ptr, READY)


@triton.jit
def _verify_prep_group_pair(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr,
                            len_ptr, p_ptr, l_ptr, scale, D, bslot_ptr, rpar_ptr, rnd_ptr, pend_ptr, DR, i_bh,
                            C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                            BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
                            BG: tl.constexpr, MMA16: tl.constexpr, POOL: tl.constexpr, BDR: tl.constexpr,
                            fold_ptr, FOLD: tl.constexpr, ready_ptr, READY: tl.constexpr):
    """Phase 1 of the (call row, q/k head) pair i_bh (nothing for a pool's pad), then, with READY, its flag."""
    i_b = tl.cast(i_bh, tl.int64) // H
    i_h = tl.cast(i_bh, tl.int64) % H
    c_b = _buffer_row(bslot_ptr, i_b, POOL)
    if c_b >= 0:
        _verify_prep_group_program(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr,
                                   len_ptr, p_ptr, l_ptr, scale, D, rpar_ptr, rnd_ptr, pend_ptr, DR, i_b, i_h, c_b,
                                   C, H, HV, K, BD, BC, KC, PREC, BG, MMA16, POOL, BDR, fold_ptr, FOLD)
        if READY:
            _mark_ready(ready_ptr + i_bh, READY)


@triton.jit
def _mark_ready(flag_ptr, consumers: tl.constexpr):
    """Phase 1's results of a (request, q/k head) pair are stored: its flag set to the number of phase-2
    programs that will read them (each takes one back, ``_wait_ready``), a release after a barrier, so that
    every thread's stores are visible to a program that sees the flag."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, consumers, sem="release", scope="gpu")


@triton.jit
def _wait_ready(flag_ptr):
    """Phase 2's wait for phase 1's results of its (request, q/k head) pair: spin until the pair's flag is
    set (an acquire), then take one back (the last reader leaves it 0 for the next launch)."""
    f = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while f == 0:
        f = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    tl.atomic_add(flag_ptr, -1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _verify_prep_group_program(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr,
                               len_ptr, p_ptr, l_ptr, scale, D, rpar_ptr, rnd_ptr, pend_ptr, DR, i_b, i_h, c_b,
                               C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                               BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
                               BG: tl.constexpr, MMA16: tl.constexpr, POOL: tl.constexpr, BDR: tl.constexpr,
                               fold_ptr, FOLD: tl.constexpr):
    """The body of ``_verify_prep_group_kernel``: call row i_b, q/k head i_h, buffer row c_b (the drafts'
    k and G go to the rows ``_draft_dest`` picks; a pool's room metadata from the program of q/k head 0)."""
    R: tl.constexpr = 2 * BD
    GROUP: tl.constexpr = HV // H
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, c_b, D, BD)
    fr, moved = _fold_row(fold_ptr, i_b, n, FOLD)
    o_c = tl.arange(0, R)
    p_kq = ((i_b * D + dr) * H + i_h) * K
    dk_dst, r0 = _draft_dest(dk_ptr, ck_ptr, c_b, n, C, DR, POOL, moved, FOLD)
    dg_dst, _ = _draft_dest(dg_ptr, cg_ptr, c_b, n, C, DR, POOL, moved, FOLD)
    p_dk = ((r0 + dr) * H + i_h) * K
    if POOL:
        if i_h == 0:
            _room_meta(par_ptr, nd_ptr, rpar_ptr, rnd_ptr, pend_ptr, i_b, c_b, D, DR, BDR)
    m_cin = (o_c < BD) & (o_c < D)
    m_ct = (o_c < BD) & (o_c < t)
    par_in = tl.load(par_ptr + i_b * D + o_c, mask=m_cin, other=-1)
    par = tl.where(m_ct, par_in.to(tl.int32), -1)
    anc, proper, is_self = _ancestors(par, dr, m_t, o_r, o_c, t)
    o_m = tl.arange(0, BC)
    m_n = o_m < n
    p_ck = ((c_b * C + o_m) * H + i_h) * K
    tl.static_assert(BG >= GROUP)
    o_g = tl.arange(0, BG)
    hv_g = (i_h * GROUP + o_g)[:, None]
    m_g = (o_g < GROUP)[:, None]
    beta_in2 = tl.load(beta_ptr + (i_b * D + dr[None, :]) * HV + hv_g, mask=m_g & m_in[None, :],
                       other=0.0).to(tl.float32)
    beta_cin2 = tl.load(beta_ptr + (i_b * D + o_c[None, :]) * HV + hv_g, mask=m_g & m_cin[None, :],
                        other=0.0).to(tl.float32)
    g_in2 = tl.load(g_ptr + (i_b * D + o_c[None, :]) * HV + hv_g, mask=m_g & m_cin[None, :],
                    other=0.0).to(tl.float32)
    gc2 = tl.load(cg_ptr + (c_b * C + o_m[None, :]) * HV + hv_g, mask=m_g & m_n[None, :],
                  other=0.0).to(tl.float32)
    SB = tl.zeros([R, BC], dtype=tl.float32)
    SS = tl.zeros([R, R], dtype=tl.float32)
    for k0 in range(0, K, KC):
        o_k = k0 + tl.arange(0, KC)
        if MMA16:
            m_k = o_k < K
            k_in, q_in = _chunk_inputs(k_ptr, q_ptr, p_kq, m_in, is_q, o_k, m_k)
            x = tl.where(m_t[:, None], k_in + q_in, tl.zeros_like(k_in))  # one of the two is 0: exact
            kc = tl.load(ck_ptr + p_ck[:, None] + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            SB += tl.dot(x, tl.trans(kc))
            SS += tl.dot(x, tl.trans(x))
        else:
            k_in, kq, g = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_kq, m_in, is_q, m_t, k0, scale, K, KC, False)
            kc, gcc = _chunk_entries(ck_ptr, ck_ptr, p_ck, p_ck, m_n, k0, K, KC, False)
            SB += tl.dot(kq, tl.trans(kc), input_precision=PREC)
            SS += tl.dot(kq, tl.trans(kq), input_precision=PREC)
        tl.store(dk_dst + p_dk[:, None] + o_k[None, :], tl.where(m_t[:, None], k_in, 0.0).to(dk_ptr.dtype.element_ty),
                 mask=(m_in & ~is_q)[:, None] & (o_k < K)[None, :])
    if MMA16:  # the query rows carry the scale (kq = [k; s q] in the fp32 path); SS's query columns go unused
        s_r = tl.where(is_q, scale, 1.0)
        SB = SB * s_r[:, None]
        SS = SS * s_r[:, None]
    Gd2, base2 = _group_path_sums(gc2, g_in2, anc, m_t, m_ct, o_m, n, t, fr, FOLD)
    Gb2, SB3, SS3 = _group_decays(SB, SS, gc2, Gd2, base2, is_self, anc, m_t, m_n, fr, FOLD)
    b_row2 = tl.where(m_t[None, :], beta_in2, 0.0)
    b_col2 = tl.where((o_c < BD)[None, :], tl.where(m_ct[None, :], beta_cin2, 0.0), 1.0)
    L3, W3 = _group_solve(SB3, SS3, is_q, proper, is_self, b_row2, b_col2, o_r, o_c, t, PREC)
    _group_store(l_ptr, p_ptr, dg_dst, L3, W3, Gb2, Gd2, i_h * GROUP + o_g, o_g < GROUP, i_b, r0 + dr, m_in & ~is_q,
                 is_q, m_t, o_r, o_c, o_m, m_n, scale, HV, R, BC)


@triton.jit
def _verify_prep_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr,
    ck_ptr, cg_ptr, len_ptr, p_ptr, l_ptr,
    scale, D, bslot_ptr, rpar_ptr, rnd_ptr, pend_ptr, DR,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
    POOL: tl.constexpr, BDR: tl.constexpr, fold_ptr, FOLD: tl.constexpr,
):
    """Phase 1 for per-channel (KDA) gates, one program per (request, value head): the decays depend on
    the key column, so they go inside the scores (``_chunk_channel``, row by row).  Writes L and W
    ([R, R + BC]), P = L diag(sgn) Y ([R, K]; Y = the rows k_i, s q_i scaled by exp(G_i) per column),
    Drafts.G and (one program per q/k head) Drafts.k.  The key dimension is walked in chunks of KC
    columns, twice (the scores, then P and G), so that few registers are live.  POOL and FOLD: as
    ``_verify_prep_group_kernel``'s (the room metadata from the program of value head 0)."""
    _pdl_prologue(PDL)
    i_bhv = tl.program_id(0).to(tl.int64)
    i_b = i_bhv // HV
    c_b = _buffer_row(bslot_ptr, i_b, POOL)
    if c_b >= 0:
        _verify_prep_program(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr, len_ptr,
                             p_ptr, l_ptr, scale, D, rpar_ptr, rnd_ptr, pend_ptr, DR, i_bhv, c_b,
                             C, H, HV, K, BD, BC, KC, PREC, POOL, BDR, fold_ptr, FOLD)


@triton.jit
def _verify_prep_program(q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr, ck_ptr, cg_ptr, len_ptr,
                         p_ptr, l_ptr, scale, D, rpar_ptr, rnd_ptr, pend_ptr, DR, i_bhv, c_b,
                         C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
                         POOL: tl.constexpr, BDR: tl.constexpr, fold_ptr, FOLD: tl.constexpr):
    """The body of ``_verify_prep_kernel``: program i_bhv = (call row, value head) on buffer row c_b."""
    R: tl.constexpr = 2 * BD  # rows: draft keys 0..BD-1, draft queries BD..2BD-1
    GROUP: tl.constexpr = HV // H
    i_b = i_bhv // HV
    i_hv = i_bhv % HV
    i_h = i_hv // GROUP
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, c_b, D, BD)
    fr, moved = _fold_row(fold_ptr, i_b, n, FOLD)
    if POOL:
        if i_hv == 0:
            _room_meta(par_ptr, nd_ptr, rpar_ptr, rnd_ptr, pend_ptr, i_b, c_b, D, DR, BDR)
    o_c = tl.arange(0, R)  # column index of the [R, R] matrices (columns < BD: draft keys)
    m_own = dr < tl.where(i_hv % GROUP == 0, D, 0)  # one program per (request, q/k head) keeps the keys
    p_kq = ((i_b * D + dr) * H + i_h) * K
    p_rt = (i_b * D + dr) * HV + i_hv  # [R] offsets of per-(draft, value head) rows
    dk_dst, r0 = _draft_dest(dk_ptr, ck_ptr, c_b, n, C, DR, POOL, moved, FOLD)
    dg_dst, _ = _draft_dest(dg_ptr, cg_ptr, c_b, n, C, DR, POOL, moved, FOLD)
    p_drt = (r0 + dr) * HV + i_hv  # ... of the drafts' G rows
    p_dk = ((r0 + dr) * H + i_h) * K
    beta_in = tl.load(beta_ptr + p_rt, mask=m_in, other=0.0)
    m_cin = (o_c < BD) & (o_c < D)
    par_in = tl.load(par_ptr + i_b * D + o_c, mask=m_cin, other=-1)
    beta_cin = tl.load(beta_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
    o_m = tl.arange(0, BC)
    m_n = o_m < n
    p_ck = ((c_b * C + o_m) * H + i_h) * K
    p_cg = (c_b * C + o_m) * HV + i_hv
    m_ct = (o_c < BD) & (o_c < t)
    b_row = tl.where(m_t, beta_in.to(tl.float32), 0.0)
    b_col = tl.where(o_c < BD, tl.where(m_ct, beta_cin.to(tl.float32), 0.0), 1.0)  # b = [beta; 1]
    par = tl.where(m_ct, par_in.to(tl.int32), -1)
    anc, proper, is_self = _ancestors(par, dr, m_t, o_r, o_c, t)
    # pass 1 over the key dimension: scores vs the buffer [R, BC] and vs the drafts [R, R]; Drafts.k
    SB = tl.zeros([R, BC], dtype=tl.float32)
    SS = tl.zeros([R, R], dtype=tl.float32)
    for k0 in range(0, K, KC):
        k_in, kq, g = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, k0, scale, K, KC, True)
        kc, gcc = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, k0, K, KC, True)
        o_k = k0 + tl.arange(0, KC)
        tl.store(dk_dst + p_dk[:, None] + o_k[None, :],
                 tl.where(m_t[:, None], k_in, 0.0).to(dk_ptr.dtype.element_ty),
                 mask=(m_own & ~is_q)[:, None] & (o_k < K)[None, :])
        Gb_c, Gr_c, SB_c, SS_c = _chunk_channel(kq, g, kc, gcc, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC, True,
                                                fr, FOLD)
        SB += SB_c
        SS += SS_c
    L, W = _solve_rows(SB, SS, is_q, proper, is_self, b_row, b_col, o_r, o_c, t, PREC)
    _store_l(l_ptr, L, W, i_bhv, o_r, o_c, o_m, R, BC)
    # pass 2: P = L diag(sgn) Y, Y = the rows k_i, q_i scaled by exp(G_i); Drafts.G
    for k0 in range(0, K, KC):
        k_in, kq, g = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, k0, scale, K, KC, True)
        o_k = k0 + tl.arange(0, KC)
        kc, gcc = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, k0, K, KC, True)
        Gb_c, Gr_c, SB_c, SS_c = _chunk_channel(kq, g, kc, gcc, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC, False,
                                                fr, FOLD)
        tl.store(dg_dst + p_drt[:, None] * K + o_k[None, :], Gr_c.to(dg_ptr.dtype.element_ty),
                 mask=(m_in & ~is_q)[:, None] & (o_k < K)[None, :])
        Y = kq * tl.exp(Gb_c)
        P = tl.dot(L, tl.where(is_q[:, None], Y, -Y), input_precision=PREC)
        tl.store(p_ptr + (i_bhv * R + o_r[:, None]) * K + o_k[None, :], P, mask=(o_k < K)[None, :])


@triton.jit
def _tf32_round(x):
    """x rounded to the nearest TF32 value (10 mantissa bits, ties away from zero), kept as fp32: the low
    13 bits cleared after adding half of their range.  x minus it is exact in fp32."""
    b = x.to(tl.uint32, bitcast=True)
    return ((b + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _split_dot(x, s, acc, XP: tl.constexpr):
    """acc + x s for x exactly representable in TF32 (the raw bf16 / fp16 key and query rows), s fp32:
    s = hi + lo, hi its TF32 rounding (|lo| <= 2^-11 |s|), two TF32 products, smallest first.  These
    are the terms of tf32x3 that are not zero (x's own low part is), so its error: the product of lo
    truncated to TF32, <= 2^-21 |s|.  XP: the pieces' product precision ("tf32" on CUDA; "ieee" in
    the interpreter, which has no TF32)."""
    hi = _tf32_round(s)
    acc = tl.dot(x, s - hi, acc, input_precision=XP)
    acc = tl.dot(x, hi, acc, input_precision=XP)
    return acc


@triton.jit
def _fold_keys(k0, o_kb, m_kb, k_fold, SLOTS: tl.constexpr):
    """The key rows k0 + o_kb of a state block that phase 2's fold reads the entries' keys (and per-channel
    G) on: the block's rows ``m_kb``, or in a pool (SLOTS) those below ``k_fold`` (K where the row folds),
    since there ``m_kb`` masks out a row without a state slot to read, whose fold still needs its keys."""
    if SLOTS:
        m = (k0 + o_kb) < k_fold
    else:
        m = m_kb
    return m


@triton.jit
def _verify_stream_kernel(
    v_ptr, nd_ptr, o_ptr, du_ptr, cu_ptr, len_ptr, own_ptr, state_ptr, p_ptr, l_ptr, D,
    C: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    STORAGE: tl.constexpr, PREC: tl.constexpr, ZP: tl.constexpr, PDL: tl.constexpr,
    H: tl.constexpr, q_ptr, k_ptr, EARLY: tl.constexpr, XSPLIT: tl.constexpr, XP: tl.constexpr,
    ck_ptr, cg_ptr, fold_ptr, ticket_ptr, FOLD: tl.constexpr, ready_ptr, READY: tl.constexpr = False,
):
    """Phase 2, one program per (request, value head, V-tile): [U; O] = L ([v; 0] + W U_buf) + P S0,
    the state streamed in [KB, BV] blocks through a pipelined loop of NS stages (direct-mode requests
    select 0).  ZP (scalar gates): the loop forms X S0 from the raw key / query rows (read from the
    inputs, shared by the value heads of a q/k head) and P S0 = L (diag(c) X S0) after it; the loop reads
    nothing phase 1 writes, so with PDL it runs before waiting for phase 1 (the two overlap); READY: the
    wait is for this program's (request, q/k head) flag (``_wait_ready``), and with PDL for the whole of
    phase 1 only at the end.  Without ZP (per-channel gates) the loop multiplies phase 1's P by the state
    blocks, after the wait.
    EARLY: the draft values and the buffer's n live u rows are loaded before the loop instead of after
    it.  XSPLIT (ZP with 16-bit q and k): X S0 with the state split in two TF32 pieces (``_split_dot``,
    products in precision XP); 2, a 16-bit state as well: one product in XP (the low piece is zero);
    otherwise in PREC.
    FOLD (``verify(fold=...)``; ``_folds`` picks the rows): a folding request's n buffered entries (k, u, G
    of buffer row i_b) are folded into each state block as it is loaded, S1 = exp(G_n) S0 + sum_m
    exp(G_n - G_m) k_m u_m^T (``_fold.fold_block``), and S1 is stored over S0; the request's last
    program (an atomic ticket in ``ticket_ptr``, after every program has read the length and phase 1
    has finished) empties its buffer and marks it as owning a state (``_fold.fold_empty``)."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    _verify_stream_program(v_ptr, nd_ptr, o_ptr, du_ptr, cu_ptr, len_ptr, own_ptr, state_ptr, p_ptr, l_ptr, D, i_v,
                           i_bhv, i_b, i_hv, i_h, i_bhv, True, i_b, D, C, HV, K, V, BD, BC, KB, BV, NS, STORAGE, PREC,
                           ZP, PDL, H, q_ptr, k_ptr, EARLY, XSPLIT, XP, False, ck_ptr, cg_ptr, fold_ptr, ticket_ptr,
                           FOLD, du_ptr, du_ptr, ready_ptr, READY)


@triton.jit
def _verify_stream_slots_kernel(
    v_ptr, nd_ptr, o_ptr, du_ptr, cu_ptr, len_ptr, own_ptr, state_ptr, p_ptr, l_ptr, D,
    C: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    STORAGE: tl.constexpr, PREC: tl.constexpr, ZP: tl.constexpr, PDL: tl.constexpr,
    H: tl.constexpr, q_ptr, k_ptr, EARLY: tl.constexpr, XSPLIT: tl.constexpr, XP: tl.constexpr, sslot_ptr,
    bslot_ptr, DR, ck_ptr, cg_ptr, fold_ptr, ticket_ptr, dk_ptr, dg_ptr, sread_ptr, swrite_ptr, FOLD: tl.constexpr,
    ready_ptr, READY: tl.constexpr = False,
):
    """``_verify_stream_kernel`` on a serving pool: call row i_b reads buffer row c_b = ``bslot[i_b]``
    (-1: a pad, nothing done) and state slot ``sslot[c_b]`` of ``state_ptr`` (-1: none, nothing read), and
    writes its drafts' u to row c_b's draft room (DR drafts per row); int64 offsets.
    FOLD (``KVPool.verify(fold=...)``): the state slots are the pool's bookkeeping's (``KVPool._claims``,
    run before the launch): call row i_b's S0 is slot ``sread[i_b]`` (-1: none, S0 = 0), and a folding row
    (``_folds`` with entries) folds into slot ``swrite[i_b]``, which is its read slot when it has one (a
    shared one was copied there first: copy-on-write); a row that does not fold reads its own slot
    (``sread``), and its ``swrite`` (the sink) is never used.  A folding row's drafts then take the rows of
    its emptied buffer: their u from row 0 where all DR fit (else the room), their keys and G moved there
    by its last program (``_drafts_to_buffer``; phase 1 left them in the room, the fold reading the
    buffer's); that program also empties the buffer and sets ``has_state`` (``own_ptr``)."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        if FOLD:
            s_r = tl.load(sread_ptr + i_b).to(tl.int64)
            s_b = tl.where(s_r >= 0, s_r, tl.load(swrite_ptr + i_b).to(tl.int64))
        else:
            s_r = tl.load(sslot_ptr + c_b).to(tl.int64)
            s_b = s_r
        _verify_stream_program(v_ptr, nd_ptr, o_ptr, du_ptr, cu_ptr, len_ptr, own_ptr, state_ptr, p_ptr, l_ptr, D,
                               i_v, i_bhv, i_b, i_hv, i_h, tl.maximum(s_b, 0) * HV + i_hv, s_r >= 0, c_b, DR,
                               C, HV, K, V, BD, BC, KB, BV, NS, STORAGE, PREC, ZP, PDL, H, q_ptr, k_ptr, EARLY, XSPLIT,
                               XP, True, ck_ptr, cg_ptr, fold_ptr, ticket_ptr, FOLD, dk_ptr, dg_ptr, ready_ptr, READY)


@triton.jit
def _verify_stream_program(
    v_ptr, nd_ptr, o_ptr, du_ptr, cu_ptr, len_ptr, own_ptr, state_ptr, p_ptr, l_ptr, D,
    i_v, i_bhv, i_b, i_hv, i_h, s_bhv, s_ok, c_b, DR,
    C: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    STORAGE: tl.constexpr, PREC: tl.constexpr, ZP: tl.constexpr, PDL: tl.constexpr,
    H: tl.constexpr, q_ptr, k_ptr, EARLY: tl.constexpr, XSPLIT: tl.constexpr, XP: tl.constexpr, SLOTS: tl.constexpr,
    ck_ptr, cg_ptr, fold_ptr, ticket_ptr, FOLD: tl.constexpr, dk_ptr, dg_ptr, ready_ptr, READY: tl.constexpr,
):
    """The body of the phase-2 kernels: program (i_v, i_bhv) of request i_b, its state read at row s_bhv
    (per value head; i_bhv outside a pool; SLOTS: the request owns a state, and it is read, only where
    ``s_ok``; its buffer's has_state is not read), its buffer entries at buffer row c_b and its drafts'
    u written to the rows ``_draft_dest`` picks (room rows i_b * D + draft outside a pool).  FOLD:
    ``_verify_stream_kernel``'s (the folded state stored at row s_bhv; the buffer's u rows loaded before the
    state loop), and with SLOTS ``_verify_stream_slots_kernel``'s (the drafts' keys and G of a pool row,
    rooms ``dk_ptr`` / ``dg_ptr``, moved to the emptied buffer by the last program)."""
    R: tl.constexpr = 2 * BD
    _pdl_prologue(PDL, WAIT=not ZP)  # without ZP, L, W and P are read first; with it, the wait is after the loop
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, c_b, D, BD)
    if SLOTS:  # a pool's request owns a state exactly when it has a state slot
        owns = s_ok
    else:
        owns = tl.load(own_ptr + i_b) != 0
    o_kb = tl.arange(0, KB)
    p_s = state_ptr + (s_bhv * K + o_kb[:, None]) * V + o_v[None, :]
    X = tl.zeros([R, BV], dtype=tl.float32)
    p_rv = ((i_b * D + dr) * HV + i_hv)[:, None] * V + o_v[None, :]
    o_m = tl.arange(0, BC)
    p_u = cu_ptr + ((c_b * C + o_m[:, None]) * HV + i_hv) * V + o_v[None, :]
    if EARLY:
        v_in = tl.load(v_ptr + p_rv, mask=(m_in & ~is_q)[:, None] & m_v[None, :], other=0.0)
    if EARLY or FOLD:
        uc = tl.load(p_u, mask=(o_m < n)[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
    if FOLD:  # the fold's entries: keys [KB, BC] per state block; G_n and the weights exp(G_n - G_m)
        fb = _folds(fold_ptr, i_b, FOLD) & (n > 0)
        k_fold = tl.where(fb, K, 0)  # the state rows written: all where the request folds (a mask by bound)
        m_f = o_m < n
        p_fk = ck_ptr + ((c_b * C + o_m[None, :]) * H + i_h) * K + o_kb[:, None]
        if ZP:  # scalar gates
            gf = tl.load(cg_ptr + (c_b * C + o_m) * HV + i_hv, mask=m_f, other=0.0).to(tl.float32)
            g_end = tl.sum(tl.where(o_m == n - 1, gf, 0.0), 0)
            wf = tl.where(m_f, tl.exp(g_end - gf), 0.0)
        else:  # per-channel: G_n over each block's rows, and the pointers of the entries' G
            p_ge = cg_ptr + ((c_b * C + n - 1) * HV + i_hv) * K + o_kb
            p_fg = cg_ptr + ((c_b * C + o_m[None, :]) * HV + i_hv) * K + o_kb[:, None]
    if ZP:
        if STORAGE:
            p_x = ((i_b * D + dr) * H + i_h)[:, None] * K + o_kb[None, :]
            m_kx = (m_in & m_t & ~is_q)[:, None]
            m_qx = (m_in & m_t & is_q)[:, None]
            for k0 in tl.range(0, K, KB, num_stages=NS):
                if SLOTS:  # no state slot: nothing read
                    m_kb = (k0 + o_kb) < tl.where(s_ok, K, 0)
                else:
                    m_kb = (k0 + o_kb) < K
                sb = tl.load(p_s + k0 * V, mask=m_kb[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                xb = (tl.load(k_ptr + p_x + k0, mask=m_kx & m_kb[None, :], other=0.0).to(tl.float32)
                      + tl.load(q_ptr + p_x + k0, mask=m_qx & m_kb[None, :], other=0.0).to(tl.float32))
                if XSPLIT == 2:
                    X = tl.dot(xb, sb, X, input_precision=XP)
                elif XSPLIT:
                    X = _split_dot(xb, sb, X, XP)
                else:
                    X = tl.dot(xb, sb, X, input_precision=PREC)
                if FOLD:
                    m_kf = _fold_keys(k0, o_kb, m_kb, k_fold, SLOTS)
                    kf = tl.load(p_fk + k0, mask=m_kf[:, None] & m_f[None, :], other=0.0).to(tl.float32)
                    s1 = fold_block(tl.where(owns, sb, 0.0), g_end, m_kf, kf, uc, wf, m_f, kf, uc, wf, m_f,
                                    False, False, True)
                    tl.store(p_s + k0 * V, s1.to(state_ptr.dtype.element_ty),
                             mask=((k0 + o_kb) < k_fold)[:, None] & m_v[None, :])
        if READY:  # phase 1's L, W, c of this (request, q/k head) from here on
            _wait_ready(ready_ptr + i_b * H + i_h)
        elif PDL:
            _gdc_wait()  # phase 1's L, W, c from here on
    if not EARLY:
        v_in = tl.load(v_ptr + p_rv, mask=(m_in & ~is_q)[:, None] & m_v[None, :], other=0.0)
    o_c = tl.arange(0, R)
    p_l = l_ptr + (i_bhv * R + o_r[:, None]) * (R + BC)
    m_n = o_m < n
    # only what phase 1 stores is read: the rows of real drafts, W's columns of the n live entries
    L = tl.load(p_l + o_c[None, :], mask=m_t[:, None], other=0.0)
    W = tl.load(p_l + R + o_m[None, :], mask=m_t[:, None] & m_n[None, :], other=0.0)
    if not (EARLY or FOLD):
        uc = tl.load(p_u, mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
    # Z = [v; 0] + W U_buf (+ diag(c) X S0): the right-hand side, summed elementwise before L multiplies it
    z = tl.dot(W, uc, tl.where(m_t[:, None], v_in.to(tl.float32), 0.0), input_precision=PREC)
    if STORAGE:
        if ZP:
            c = tl.load(p_ptr + i_bhv * R + o_r)
            z += tl.where(owns, c[:, None] * X, 0.0)
            out = tl.dot(L, z, input_precision=PREC)
        else:
            p_p = p_ptr + (i_bhv * R + o_r[:, None]) * K + o_kb[None, :]
            for k0 in tl.range(0, K, KB, num_stages=NS):
                if SLOTS:
                    m_kb = (k0 + o_kb) < tl.where(s_ok, K, 0)
                else:
                    m_kb = (k0 + o_kb) < K
                sb = tl.load(p_s + k0 * V, mask=m_kb[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                pb = tl.load(p_p + k0, mask=m_kb[None, :], other=0.0)
                X = tl.dot(pb, sb, X, input_precision=PREC)
                if FOLD:
                    m_kf = _fold_keys(k0, o_kb, m_kb, k_fold, SLOTS)
                    kf = tl.load(p_fk + k0, mask=m_kf[:, None] & m_f[None, :], other=0.0).to(tl.float32)
                    ge = tl.load(p_ge + k0, mask=(k0 + o_kb) < k_fold, other=0.0).to(tl.float32)
                    s1 = fold_block(tl.where(owns, sb, 0.0), ge, m_kf, kf, uc, p_fg + k0, m_f, kf, uc, p_fg + k0,
                                    m_f, True, False, True)
                    tl.store(p_s + k0 * V, s1.to(state_ptr.dtype.element_ty),
                             mask=((k0 + o_kb) < k_fold)[:, None] & m_v[None, :])
            out = tl.dot(L, z, tl.where(owns, X, 0.0), input_precision=PREC)
    else:
        out = tl.dot(L, z, input_precision=PREC)
    out = tl.where(m_t[:, None], out, 0.0)
    m_out = m_in[:, None] & m_v[None, :]
    tl.store(o_ptr + p_rv, out.to(o_ptr.dtype.element_ty), mask=m_out & is_q[:, None])
    n_dst = n
    if FOLD:  # a folding pool row's drafts follow its emptied buffer (the u rows it reads were loaded above)
        n_dst = tl.where(fb, 0, n)
    du_dst, r0 = _draft_dest(du_ptr, cu_ptr, c_b, n_dst, C, DR, SLOTS, n < 0, False)
    p_du = ((r0 + dr) * HV + i_hv)[:, None] * V + o_v[None, :]
    tl.store(du_dst + p_du, out.to(du_ptr.dtype.element_ty), mask=m_out & ~is_q[:, None])
    if FOLD:
        if fb:  # every program of the request has read n and has_state, and (after its wait) phase 1 is done
            last = fold_empty(len_ptr, own_ptr, ticket_ptr, i_b, c_b, tl.num_programs(0) * HV)
            if SLOTS:
                if last:  # ... and every program has read the buffer's keys and G for the fold
                    _drafts_to_buffer(dk_ptr, dg_ptr, ck_ptr, cg_ptr, c_b, D, DR, C, H, HV, K, 1 if ZP else K,
                                      1024)
    if READY:
        if PDL:  # this launch completes after phase 1 has: a later launch waiting for it waits for both
            _gdc_wait()


def verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    buffer: KVBuffer,
    parents: Optional[torch.Tensor] = None,
    num_drafts: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    config: Optional[VerifyConfig] = None,
    fold=False,
):
    """Outputs of D draft tokens per request from the stale state plus the buffer; nothing is committed.

    q, k: [B, D, H, K]; v: [B, D, HV, V]; g: [B, D, HV]*; beta: [B, D, HV].  parents: [B, D] int
    (-1 = the buffer's tail; each parent before its child; default the chain -1, 0, ..., D-2);
    num_drafts: [B] int in 0..D (default D): ragged draft counts, padding rows get o = 0.
    Returns o [B, D, HV, V] (v's dtype) and ``Drafts`` in the u-cache form: u [B, D, HV, V] and
    G [B, D, HV]* (relative to the buffer's last flush) in the buffer's cache dtype, a copy of the keys,
    and parents / num_drafts (the defaults are tensors of the call's own: the caller may edit them).
    Same results as ``kvbuffer_ref.verify``; no per-draft state is formed, and without ``fold`` the buffer
    is not modified.
    ``config``: the launch (a ``kvbuffer_fast.launch.VerifyConfig``; default: the launch table's row
    for these shapes).  The checks that read device values are skipped while a CUDA graph is captured.

    ``fold``: False (default), True, or a bool tensor [B] (the requests that fold).  A folding request's
    buffered entries are also folded into its state, IN PLACE, inside phase 2's state loop (the state
    blocks it loads anyway are written back folded): S1 = exp(G_n) S0 + sum_m exp(G_n - G_m) k_m u_m^T
    over its n entries; its buffer length becomes 0, it owns a state from then on (if n > 0), and its
    Drafts.G are relative to the emptied buffer (the path sums of the drafts' gates from 0).  Returns
    ``(o, drafts, buffer)``: the buffer is the given one, or, if it had no state storage, a new KVBuffer
    with a zero-initialised state sharing every other tensor (as ``flush``).  o and Drafts.u are the same
    math as fold=False's, from S0 and the buffer.  Same results as ``kvbuffer_ref.verify(..., fold=fold)``,
    i.e. ``flush`` of the folding requests then verify: ``accept`` afterwards sees what it would see after
    a separate flush.  The buffer's entry rows keep their contents (past the new lengths: never read).
    A serving pool's verify takes ``fold`` too (``kvbuffer_fast.pool.KVPool.verify``, ``verify_pool``).
    """
    return _verify(q, k, v, g, beta, buffer, parents, num_drafts, scale, config, fold)


def verify_pool(q, k, v, g, beta, pool: PoolLayer, parents, num_drafts, scale, config, fold=False,
                claim=None) -> torch.Tensor:
    """``verify`` on a pool's layer (``PoolLayer``), the drafts written to the addressed rows' draft rooms;
    returns o [B, D, HV, V] (pad rows: unspecified).  The caller checked the tokens and the slots;
    parents / num_drafts are checked here over the valid rows (while no CUDA graph is captured).

    ``fold``: False, True or a checked bool tensor [B] (``verify(fold=...)``): the valid rows it flags that
    hold entries fold them into their states in phase 2, as ``verify``'s fold does, into the state slots
    ``claim`` gives them: the pool's state-slot bookkeeping for those rows (``KVPool._claims``), called once
    every check has passed and returning the call rows' (read, write) state slots and their lengths as
    the call began ([B] int64 each).  Such a row's drafts go where a verify after a flush puts them (the
    rows of its emptied buffer where they fit, else its draft room).  With no drafts (D = 0) the fold
    alone: ``flush_pool``."""
    d = check_tokens(q, k, v, g, beta)
    parents, num_drafts = _default_drafts(parents, num_drafts, d.B, d.T, q)
    if values_checked(q):
        valid = pool.slots >= 0
        chain = torch.arange(-1, d.T - 1, device=q.device)
        require_int_tensor("parents", parents, (d.B, d.T), "[B, D]", q.device)
        require_int_tensor("num_drafts", num_drafts, (d.B,), "[B]", q.device)
        parents = check_parents(torch.where(valid[:, None], parents, chain[None, :]), d.B, d.T, q.device)
        num_drafts = check_num_drafts(torch.where(valid, num_drafts, 0), d.B, d.T, q.device)
        # the gates' growth across calls, from the rows' stored G (pads: no entries), as verify checks it
        at = torch.where(valid, pool.slots.to(torch.int64), 0)
        rows = SimpleNamespace(G=pool.buffer.G[at], lengths=torch.where(valid, pool.buffer.lengths[at], 0))
        drafted = valid[:, None] & (torch.arange(d.T, device=q.device)[None, :] < num_drafts[:, None])
        check_growth(g, drafted, rows)
    else:
        _check_draft_kinds(parents, num_drafts, d.B, d.T, q.device)
    s, cfg = _launch_settings(q, k, d, pool.buffer, scale, config, pool.state)
    o = new_output((d.B, d.T, d.HV, d.V), v.dtype, q.device)
    if d.B == 0:
        return o
    states = None if fold is False else claim()  # (read, write, lengths)
    if d.T == 0:  # no drafts: the rooms are empty and pending (pads go to the sink row, then cleared)
        sink = pool.pending.shape[0] - 1
        rows = torch.where(pool.slots >= 0, pool.slots.to(torch.int64), sink)
        pool.room.parents[rows] = -1
        pool.room.num_drafts[rows] = 0
        pool.pending[rows] = True
        pool.pending[sink] = False
        if states is not None:  # the fold alone: the rows that hold entries (pads: none), those flagged
            read, write, lengths = states
            count = lengths if fold is True else torch.where(fold, lengths, 0)
            flush_pool(pool, count=count, lengths=lengths, read=read, write=write,
                       config=check_config("flush", config_for("flush", Key())))
        return o
    _launch(q, k, v, g, beta, pool.buffer, index_input(parents), index_input(num_drafts), s, o, pool.room, d, cfg,
            pool, fold=fold, states=None if states is None else states[:2])
    return o


def _verify(q, k, v, g, beta, buffer: KVBuffer, parents, num_drafts, scale, config, fold=False):
    """``verify``'s body."""
    d = check_tokens(q, k, v, g, beta)
    checked = checked_buffer(buffer, "verify", d, q.device)
    if fold is not False:
        fold = check_fold(fold, d.B, q.device)
        if buffer.state is None:  # the fold needs storage: a zeroed state, as flush allocates it
            state = torch.zeros(d.B, d.HV, d.K, d.V, dtype=torch.promote_types(buffer.u.dtype, torch.float32),
                                device=q.device)
            buffer = buffer.replace(state=state)
    parents, num_drafts = _default_drafts(parents, num_drafts, d.B, d.T, q)
    if checked:
        parents = check_parents(parents, d.B, d.T, q.device)
        num_drafts = check_num_drafts(num_drafts, d.B, d.T, q.device)
        valid = torch.arange(d.T, device=q.device)[None, :] < num_drafts[:, None]
        _, g = checked_tokens(q, k, v, g, beta, valid=valid, buffer=buffer)
    else:
        _check_draft_kinds(parents, num_drafts, d.B, d.T, q.device)
    s, cfg = _launch_settings(q, k, d, buffer, scale, config, buffer.state)
    parents, num_drafts = index_input(parents), index_input(num_drafts)
    shape_o = (d.B, d.T, d.HV, d.V)
    o = new_output(shape_o, v.dtype, q.device)
    du = new_output(shape_o, buffer.u.dtype, q.device)
    dG = new_output(tuple(g.shape), buffer.G.dtype, q.device)
    dk = new_output(tuple(k.shape), k.dtype, q.device)
    drafts = Drafts(parents=parents, num_drafts=num_drafts, k=dk, u=du, G=dG)
    if d.B == 0 or d.T == 0:
        if fold is not False and d.B > 0:  # no drafts: the fold alone
            flush(buffer, count=None if fold is True else torch.where(fold, buffer.lengths, 0))
        return (o, drafts) if fold is False else (o, drafts, buffer)
    _launch(q, k, v, g, beta, buffer, parents, num_drafts, s, o, drafts, d, cfg, fold=fold)
    return (o, drafts) if fold is False else (o, drafts, buffer)


def _check_draft_kinds(parents, num_drafts, B: int, D: int, device) -> None:
    """While a CUDA graph is captured (no value checks): parents / num_drafts are still integer tensors of
    the right shape and device, so the kernels' reads stay inside them."""
    require_int_tensor("parents", parents, (B, D), "[B, D]", device)
    require_int_tensor("num_drafts", num_drafts, (B,), "[B]", device)


def _launch_settings(q, k, d, buffer: KVBuffer, scale, config, state=None) -> tuple[float, VerifyConfig]:
    """The draft count within one launch's reach, the query scale and the launch (``config``, else the
    launch table's row for these shapes and ``state``'s dtype, S0's storage), shared by ``verify`` and
    ``verify_pool``."""
    if d.T > MAX_DRAFTS:
        raise ValueError(f"q: {d.T} draft tokens per request, but kvbuffer_fast.verify handles at most "
                         f"{MAX_DRAFTS} in one launch; verify them in parts or use kvbuffer_ref.verify")
    s = check_scale(scale, d.K)
    cfg = check_config("verify", config) if config is not None else config_for("verify", _key(q, k, d, buffer, state))
    return s, cfg


def _key(q: torch.Tensor, k: torch.Tensor, d, buffer: KVBuffer, state: Optional[torch.Tensor] = None):
    """The launch table's key.  Its rows count phase 2's programs (B * HV * V-tiles; measured at V = 128),
    so ``columns`` is 128 per program of the default tile; the dtype is q's where q and k share it, else
    float32 (mixed inputs take the fp32 products); the state's is ``state``'s (S0's storage; float32 if
    None)."""
    BV = max(16, min(VerifyConfig.BV, block(d.V)))
    dtype = q.dtype if q.dtype == k.dtype else torch.float32
    return key_of(q, C=buffer.capacity, B=d.B, HV=d.HV, V=triton.cdiv(d.V, BV) * 128, channel=d.channel_gate,
                  dtype=dtype, state=None if state is None else state.dtype)


def _sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs in turn)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def prep_warps(cfg: VerifyConfig, BD: int) -> tuple[int, int]:
    """Phase 1's (warps, register cap; 0 = none) for drafts in blocks of BD: from BD = 32 at least BD / 8
    warps, since its [2 BD, 2 BD] matrices on one warp compile for minutes (Triton 3.9 for sm_90: 5.8 s at
    BD = 16, 35 s at 32, over 15 minutes at 64; 8.9 s and 35 s at 32 and 64 with BD / 8 warps; the launches
    timed on the H200, up to 16 drafts, keep the configured warps), and ``prep_maxnreg`` only at the
    configured count."""
    warps = max(cfg.prep_warps, BD // 8) if BD >= 32 else cfg.prep_warps
    return warps, (cfg.prep_maxnreg if warps == cfg.prep_warps else 0)


def _launch(q, k, v, g, beta, buffer: KVBuffer, parents, num_drafts, s: float, o, drafts: Drafts, d,
            cfg: VerifyConfig, pool: Optional[PoolLayer] = None, fold=False, states=None) -> None:
    """Phase 1 then phase 2 (module docstring).  Phase 1's products: FMA ("ieee"); phase 2's fp32
    products: tf32x3 on CUDA, FMA in the interpreter; phase 2's X S0 splits only the state for 16-bit q
    and k (exact in TF32).  ``pool``: the kernels address a pool's layer (``PoolLayer``; ``buffer`` and
    ``drafts`` are then its rows and its draft room).  ``fold``: False, True or a checked [B] bool tensor;
    the buffer has state storage, and in a pool ``states`` = (read, write), the [B] int64 state slots the
    pool's bookkeeping gave the call rows (``_verify_stream_slots_kernel``)."""
    storage = buffer.state is not None or pool is not None
    state = pool.state if pool is not None else buffer.state  # S0's storage (None: no state storage)
    BD = block(d.T, 8)
    R, BC = 2 * BD, block(buffer.capacity)
    BV = max(16, min(cfg.BV, block(d.V)))
    KB = max(16, min(cfg.KB, block(d.K)))
    prec = "tf32x3" if q.is_cuda else "ieee"
    zp = not d.channel_gate  # phase 2 forms X S0 from the raw rows (scalar gates) or multiplies P by S0
    # X S0 for 16-bit q and k: the state in two TF32 pieces (1), or one product (2) where the state is 16-bit
    # too, a TF32 value whose low piece is zero (the same bits)
    xsplit = 0
    if zp and q.dtype == k.dtype and q.dtype in SIXTEEN_BIT:
        xsplit = 2 if state is not None and state.dtype in SIXTEEN_BIT else 1
    pdl = pdl_launch(q, cfg.pdl)
    # phase 1's outputs for phase 2 (fp32): L and W [B*HV, R, R + BC]; c [B*HV, R] or P [B*HV, R, K]
    # (NaN-poisoned under KVBUFFER_POISON=1, like the outputs: phase 2 must read only what phase 1 wrote)
    lw = new_output((d.B * d.HV, R, R + BC), torch.float32, q.device)
    pk = new_output((d.B * d.HV, R) if zp else (d.B * d.HV, R, d.K), torch.float32, q.device)
    KC = block(d.K) // min(4, block(d.K) // 16)  # phase 1 walks the key dimension in (up to) 4 chunks
    # phase 1's products are small (R x R, R x C per (request, head)) and form the scores and their
    # solves, where cancellation is common (nearly orthogonal q and k): FMA ("ieee") everywhere
    warps, cap = prep_warps(cfg, BD)
    prep = dict(C=buffer.capacity, H=d.H, HV=d.HV, K=d.K, BD=BD, BC=BC, KC=KC, PREC="ieee",
                num_warps=warps, **({"maxnreg": cap} if cap else {}), **pdl)
    DR = d.T if pool is None else drafts.k.shape[1]  # draft rows per buffer row
    room = ((num_drafts,) * 4 if pool is None  # dummy pointers outside a pool
            else (pool.slots, drafts.parents, drafts.num_drafts, flag_view(pool.pending)))
    args = (as_input(q), as_input(k), as_input(g), as_input(beta), parents, num_drafts, drafts.G, drafts.k,
            buffer.k, buffer.G, buffer.lengths, pk, lw, s, d.T, *room, DR)
    FOLD = 0 if fold is False else (1 if fold is True else 2)
    fold_ptr = flag_view(fold) if FOLD == 2 else num_drafts  # a dummy pointer unless per-request flags
    ticket = ticket_counters(d.B, q.device) if FOLD else num_drafts
    prep.update(POOL=pool is not None, BDR=block(DR, 2), fold_ptr=fold_ptr, FOLD=FOLD)
    nbh = d.B * d.H
    # scalar gates with prep_per_sm: phase 1 on a grid of prep_per_sm programs per SM, each pair's results
    # flagged ready for its GROUP * V / BV phase-2 readers (flags zero between launches)
    ready = (d.HV // d.H) * triton.cdiv(d.V, BV) if zp and cfg.prep_per_sm > 0 else 0
    flags = int_scratch("verify_ready", nbh, q.device) if ready else num_drafts  # a dummy pointer without flags
    with device_guard(q):
        if zp:
            mma16 = q.dtype == k.dtype == buffer.k.dtype and q.dtype in SIXTEEN_BIT
            grid = min(nbh, cfg.prep_per_sm * _sm_count(q.device)) if ready else nbh
            _verify_prep_group_kernel[(grid,)](*args, BG=triton.next_power_of_2(d.HV // d.H), MMA16=mma16,
                                               ready_ptr=flags, NBH=nbh, READY=ready, **prep)
        else:
            _verify_prep_kernel[(d.B * d.HV,)](*args, **prep)
        folding = dict(ck_ptr=buffer.k, cg_ptr=buffer.G, fold_ptr=fold_ptr, ticket_ptr=ticket, FOLD=FOLD,
                       ready_ptr=flags, READY=ready > 0)
        own = flag_view(buffer.has_state)  # in a pool written by a fold only (its rows' S0 come from their slots)
        if pool is None:
            stream, slots = _verify_stream_kernel, folding
        else:
            stream = _verify_stream_slots_kernel
            read, write = states if FOLD else (num_drafts, num_drafts)  # dummy pointers without a fold
            slots = dict(sslot_ptr=pool.state_slot, bslot_ptr=pool.slots, DR=DR, dk_ptr=drafts.k, dg_ptr=drafts.G,
                         sread_ptr=read, swrite_ptr=write, **folding)
        stream[(triton.cdiv(d.V, BV), d.B * d.HV)](
            as_input(v), num_drafts, o, drafts.u, buffer.u, buffer.lengths, own,
            state if storage else buffer.lengths,  # a dummy pointer when there is no state storage
            pk, lw, d.T, C=buffer.capacity, HV=d.HV, K=d.K, V=d.V, BD=BD, BC=BC, KB=KB, BV=BV, NS=cfg.NS,
            STORAGE=storage, PREC=prec, ZP=zp, H=d.H, q_ptr=as_input(q), k_ptr=as_input(k), EARLY=cfg.early,
            XSPLIT=xsplit, XP="tf32" if q.is_cuda else "ieee", num_warps=cfg.num_warps, **slots, **pdl)


#: Rows of default (parents, num_drafts) per (B, D, device): [block, next row].  Each default call takes a
#: row of its own, so no two calls' Drafts share memory and a caller may edit them; a block of _ROWS rows
#: is made by a few small torch ops every _ROWS / 2 calls, so a default call launches only the kernels.
_DEFAULT_ROWS: dict = {}
_ROWS = 64


def _default_drafts(parents, num_drafts, B: int, D: int, q: torch.Tensor):
    """``parents`` / ``num_drafts`` with the defaults (the chain -1, 0, ..., D-2; D per request) filled in
    from a fresh row of [B * D + B] int64.  A new block is made when fewer than half its rows are left,
    except while a CUDA graph is captured (its contents would exist only in the graph): then only when
    it is used up, and the rows made in the capture serve that call alone."""
    if parents is not None and num_drafts is not None:
        return parents, num_drafts
    device = q.device
    key = (B, D, str(device))
    capturing = not values_checked(q)
    pool = _DEFAULT_ROWS.get(key)
    if pool is None or pool[1] >= (_ROWS if capturing else _ROWS // 2):
        chain = torch.arange(-1, D - 1, device=device, dtype=torch.long).repeat(B)
        row = torch.cat([chain, torch.full((B,), D, dtype=torch.long, device=device)])
        pool = [row.repeat(1 if capturing else _ROWS, 1), 0]
        if not capturing:
            _DEFAULT_ROWS[key] = pool
    row = pool[0][pool[1]]
    pool[1] += 1
    parents = row[: B * D].view(B, D) if parents is None else parents
    num_drafts = row[B * D:] if num_drafts is None else num_drafts
    return parents, num_drafts
