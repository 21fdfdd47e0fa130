"""Speculative verification without per-draft states: verify (chains and trees) and accept, on the u-cache.

verify, grid (V / BV, B * HV): one program per (request b, value head, V-tile of BV columns), the
layout of the recurrent decode kernel.  A program issues ALL its loads at once, the [K, BV] state tile
first (unconditionally when state storage exists; requests in direct mode select zeros with
``tl.where`` afterwards), the drafts' inputs with it, the buffered entries as soon as the length n is
known, and does all the small per-(request, value head) algebra while the tile is in flight.  After
the tile arrives there is ONE product ``[2 BD, K] x [K, BV]`` and the stores.

Rows.  With BD >= D drafts (a power of two >= 8), the program works on 2 BD rows: row i < BD is draft
i's key (its innovation u_i is computed there) and row BD + i is draft i's scaled query (its output
o_i).  Per value head, with G_i = G_parent(i) + g_i (the root's parent: the buffer's tail, 0 if
empty), D_ij = exp(G_i - G_j), m over the request's n buffered entries and j over the tree:

    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_m D_im (k_i.k_m) u_m - sum_{j proper anc i} D_ij (k_i.k_j) u_j)
    o_i = exp(G_i) S0^T q_i + sum_m D_im (q_i.k_m) u_m + sum_{j anc i or j = i} D_ij (q_i.k_j) u_j

In matrix form over the 2 BD rows: N [U; O] = diag(b) Z with b = [beta; 1],
Z = [v; 0] + W U_buf + diag(sgn) Y S0 (sgn = -1 on key rows, +1 on query rows; W the decayed
draft x buffer scores with that sign; Y the rows k_i, q_i scaled by exp(G_i)), and N unit lower
triangular: [[I + A, 0], [-QQ, I]] with A_ij = beta_i D_ij (k_i.k_j) over proper ancestors and
QQ_ij = D_ij (q_i.k_j) over ancestors-or-self.  So with L = N^-1 diag(b) (forward substitution over
the d key rows, then one product for the query rows):

    [U; O] = L ([v; 0] + W U_buf)  +  (L diag(sgn) Y) S0
             `-- before the tile --'   `-- [2BD, K], before the tile; x the tile after it

Scores come from two small products ([2BD, K] x [K, C] and [2BD, K] x [K, 2BD]), the ancestor mask
from a walk up ``parents`` (at most d steps, on [2BD, 2BD] registers), no [D, D, K] temporary.
Nothing is written to the state and no state is formed per draft: ``Drafts`` keeps the drafts' (k, u, G).
Per-channel (KDA) gates: the exp moves inside the dot products (scores row by row; slower, same layout).

accept, grid (V / BV, B * HV): per request the accepted node's root-to-node path (m entries, found by
walking ``parents`` in registers) is appended from the drafts' cached (k, u, G): each program copies
its [m, BV] u columns, the V-tile-0 programs the G rows (and one per q/k head the keys).  When
n + m > C the reference's rule applies (``kvbuffer_ref.entries.fold_count``): all n old entries plus
the oldest max(0, m - C) path entries are folded into the state tile by each program (rare), the rest
of the path goes to row 0 on; the keys and rebased G, which other programs of the request still read,
are then written by the request's last program (atomic ticket), which also advances ``lengths`` /
``has_state``.  The buffer is updated IN PLACE and returned.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.validation import (check_buffer, check_counts, check_nodes, check_num_drafts, check_parents,
                                     check_scale, check_tokens)

from ._common import block, as_input, device_guard, flag_view, new_output, ticket_counters
from .decode import _check_u_form

__all__ = ["verify", "accept", "MAX_DRAFTS", "launch_config", "set_launch", "LAUNCH_CANDIDATES"]

#: The largest draft count per request one launch handles (the [2D, 2D] algebra lives in registers).
MAX_DRAFTS = 64

# Launch parameters per kernel: BV (state columns per program), num_warps and, for verify, the fp32
# dot precision on CUDA ('tf32x3': three TF32 tensor-core products, ~fp32 accuracy; 'ieee': FMA).
# verify: no register spills at these (ptxas sm_90, cuobjdump -res-usage; docs/speculative.md);
# bench/gpu_verify.py --tune times LAUNCH_CANDIDATES on the GPU and calls set_launch with the best.
_CONFIG = {
    "verify": dict(BV=64, num_warps=4, precision="tf32x3"),
    "accept": dict(BV=64, num_warps=4, precision="tf32x3"),
}

#: The (BV, num_warps, precision) configurations of verify worth timing on a GPU (all spill-free at
#: Qwen3-Next shapes with D <= 8, C <= 64; see docs/speculative.md).
LAUNCH_CANDIDATES = [
    dict(BV=64, num_warps=4, precision="tf32x3"),
    dict(BV=32, num_warps=4, precision="tf32x3"),
    dict(BV=128, num_warps=8, precision="tf32x3"),
    dict(BV=64, num_warps=8, precision="tf32x3"),
    dict(BV=32, num_warps=2, precision="tf32x3"),
    dict(BV=64, num_warps=4, precision="ieee"),
    dict(BV=32, num_warps=4, precision="ieee"),
]


def launch_config(kernel: str, V: int, **override) -> dict:
    """(BV, num_warps, precision) for ``kernel`` ('verify' or 'accept') at value dim V; ``override``
    replaces entries that are not None (benchmarks tune with it)."""
    cfg = dict(_CONFIG[kernel])
    cfg.update({k: v for k, v in override.items() if v is not None})
    cfg["BV"] = max(16, min(int(cfg["BV"]), block(V)))
    return cfg


def set_launch(kernel: str, **cfg) -> dict:
    """Make ``cfg`` (BV / num_warps / precision) the default launch of ``kernel``; returns the old one."""
    if kernel not in _CONFIG:
        raise ValueError(f"kernel: expected one of {sorted(_CONFIG)}, got {kernel!r}")
    old = dict(_CONFIG[kernel])
    _CONFIG[kernel].update({k: v for k, v in cfg.items() if v is not None})
    return old


def _precision(x: torch.Tensor, precision: Optional[str]) -> str:
    """fp32 dot precision on CUDA ('tf32x3' or 'ieee'; plain tf32 misses the fp32 budget); the
    interpreter always uses 'ieee'."""
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"precision: expected None, 'ieee' or 'tf32x3', got {precision!r}")
    return precision if x.is_cuda else "ieee"


@triton.jit
def _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, k0, scale,
                K: tl.constexpr, KC: tl.constexpr, CHANNEL: tl.constexpr):
    """Columns k0..k0+KC of the draft rows: the raw keys (for Drafts.k), the rows k_i / scale*q_i (padding
    rows selected to 0) and, per-channel, the drafts' gates on the key rows."""
    o_k = k0 + tl.arange(0, KC)
    m_k = o_k < K
    k_in = tl.load(k_ptr + p_kq[:, None] + o_k[None, :], mask=(m_in & ~is_q)[:, None] & m_k[None, :], other=0.0)
    q_in = tl.load(q_ptr + p_kq[:, None] + o_k[None, :], mask=(m_in & is_q)[:, None] & m_k[None, :], other=0.0)
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
                   BC: tl.constexpr):
    """Per-channel gates, one column chunk: G of every row (base + the gates along its path) and this
    chunk's share of the decayed scores vs the buffer [R, BC] and vs the tree [R, R], row by row."""
    base = tl.sum(tl.where((o_m == n - 1)[:, None], gc, 0.0), 0)  # the buffer tail's G (0 if empty)
    Gr = tl.zeros(kq.shape, dtype=tl.float32)
    o_c = tl.arange(0, R)
    for j in range(0, t):
        a_j = tl.sum(tl.where(anc & (o_c[None, :] == j), 1, 0), 1) > 0
        g_j = tl.sum(tl.where((o_r == j)[:, None], g, 0.0), 0)
        Gr += tl.where(a_j[:, None], g_j[None, :], 0.0)
    Gr = tl.where(m_t[:, None], Gr + base[None, :], 0.0)
    SB = tl.zeros([R, BC], dtype=tl.float32)
    SS = tl.zeros([R, R], dtype=tl.float32)
    for rr in range(0, 2 * t):
        r = tl.where(rr < t, rr, BD + rr - t)
        sel = o_r == r
        x_r = tl.sum(tl.where(sel[:, None], kq, 0.0), 0)
        G_r = tl.sum(tl.where(sel[:, None], Gr, 0.0), 0)
        dec = tl.exp(tl.where(m_n[:, None], G_r[None, :] - gc, float("-inf")))
        SB = tl.where(sel[:, None], tl.sum(kc * dec * x_r[None, :], 1)[None, :], SB)
        a_r = tl.sum(tl.where(sel[:, None] & anc, 1, 0), 0) > 0  # [R] ancestors-or-self (as key rows)
        decd = tl.exp(tl.where(a_r[:, None], G_r[None, :] - Gr, float("-inf")))
        SS = tl.where(sel[:, None], tl.sum(kq * decd * x_r[None, :], 1)[None, :], SS)
    return Gr, SB, SS


@triton.jit
def _chunk_store(dk_ptr, dg_ptr, k_in, Gr, p_kq, p_rt, m_in, is_q, m_t, k0, DK: tl.constexpr, K: tl.constexpr,
                 KC: tl.constexpr, CHANNEL: tl.constexpr):
    """Drafts.k (when DK) and, per-channel, Drafts.G for columns k0..k0+KC."""
    o_k = k0 + tl.arange(0, KC)
    m = (m_in & ~is_q)[:, None] & (o_k < K)[None, :]
    if DK:
        tl.store(dk_ptr + p_kq[:, None] + o_k[None, :], tl.where(m_t[:, None], k_in, 0.0).to(dk_ptr.dtype.element_ty),
                 mask=m)
    if CHANNEL:
        tl.store(dg_ptr + p_rt[:, None] * K + o_k[None, :], Gr.to(dg_ptr.dtype.element_ty), mask=m)


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr,
    o_ptr, du_ptr, dg_ptr, dk_ptr,
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    scale, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr, BV: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PREC: tl.constexpr,
):
    # The key dimension is handled in NKC (1, 2 or 4) column chunks of KC: every product over K is a
    # sum of per-chunk products, so no dot operand ever spans all of K (registers: tf32x3 splits both
    # operands in two).  Chunks are separate variables (c0..c3) written out below.
    R: tl.constexpr = 2 * BD  # rows: draft keys 0..BD-1, draft queries BD..2BD-1
    GROUP: tl.constexpr = HV // H
    i_v = tl.program_id(0)
    i_bhv = tl.program_id(1).to(tl.int64)
    i_b = i_bhv // HV
    i_hv = i_bhv % HV
    i_h = i_hv // GROUP
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_kc = tl.arange(0, KC)
    # ---- every load first.  The state tile: unconditional (direct requests select zeros below)
    if STORAGE:
        p_s = state_ptr + (i_bhv * K + o_kc[:, None]) * V + o_v[None, :]
        m_s = (o_kc < K)[:, None] & m_v[None, :]
        s0 = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
        if NKC > 1:
            s1 = tl.load(p_s + KC * V, mask=m_s & (o_kc < K - KC)[:, None], other=0.0).to(tl.float32)
        if NKC > 2:
            s2 = tl.load(p_s + 2 * KC * V, mask=m_s & (o_kc < K - 2 * KC)[:, None], other=0.0).to(tl.float32)
            s3 = tl.load(p_s + 3 * KC * V, mask=m_s & (o_kc < K - 3 * KC)[:, None], other=0.0).to(tl.float32)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    t = tl.load(nd_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    o_r = tl.arange(0, R)  # row index
    o_c = tl.arange(0, R)  # column index of the [R, R] matrices (columns < BD: draft keys)
    dr = o_r % BD  # the draft a row belongs to
    is_q = o_r >= BD
    m_in = dr < D  # rows that exist in the [B, D, ...] inputs
    m_t = dr < t  # rows of real drafts; padding rows are zeroed by selects, never by multiplying
    p_kq = ((i_b * D + dr) * H + i_h) * K
    p_rt = (i_b * D + dr) * HV + i_hv  # [R] offsets of per-(draft, value head) rows
    p_rv = p_rt[:, None] * V + o_v[None, :]
    k0_in, kq0, g0 = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, 0, scale, K, KC, CHANNEL)
    if NKC > 1:
        k1_in, kq1, g1 = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, KC, scale, K, KC, CHANNEL)
    if NKC > 2:
        k2_in, kq2, g2 = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, 2 * KC, scale, K, KC, CHANNEL)
        k3_in, kq3, g3 = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, 3 * KC, scale, K, KC, CHANNEL)
    v_in = tl.load(v_ptr + p_rv, mask=(m_in & ~is_q)[:, None] & m_v[None, :], other=0.0)
    beta_in = tl.load(beta_ptr + p_rt, mask=m_in, other=0.0)
    m_cin = (o_c < BD) & (o_c < D)
    par_in = tl.load(par_ptr + i_b * D + o_c, mask=m_cin, other=-1)
    beta_cin = tl.load(beta_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
    if not CHANNEL:
        g_in = tl.load(g_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
    # the buffered entries (the only loads that wait for n)
    o_m = tl.arange(0, BC)
    m_n = o_m < n
    p_ck = ((i_b * C + o_m) * H + i_h) * K
    p_cg = (i_b * C + o_m) * HV + i_hv
    uc = tl.load(cu_ptr + p_cg[:, None] * V + o_v[None, :], mask=m_n[:, None] & m_v[None, :], other=0.0)
    uc = uc.to(tl.float32)  # [BC, BV]
    kc0, gc0 = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, 0, K, KC, CHANNEL)
    if NKC > 1:
        kc1, gc1 = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, KC, K, KC, CHANNEL)
    if NKC > 2:
        kc2, gc2 = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, 2 * KC, K, KC, CHANNEL)
        kc3, gc3 = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, 3 * KC, K, KC, CHANNEL)
    if not CHANNEL:
        gc = tl.load(cg_ptr + p_cg, mask=m_n, other=0.0).to(tl.float32)  # [BC]
    # ---- the small algebra, while the tile is in flight
    m_ct = (o_c < BD) & (o_c < t)
    b_row = tl.where(m_t, beta_in.to(tl.float32), 0.0)
    b_col = tl.where(o_c < BD, tl.where(m_ct, beta_cin.to(tl.float32), 0.0), 1.0)  # b = [beta; 1]
    par = tl.where(m_ct, par_in.to(tl.int32), -1)
    # ancestor-or-self mask anc[r, c]: draft c is on the root-to-dr path; walk up d steps at most
    cur = tl.where(m_t, dr, -1)
    anc = (o_r[:, None] < 0) & (o_c[None, :] < 0)
    for _ in range(0, t):
        hit = cur[:, None] == o_c[None, :]
        anc = anc | hit
        up = tl.sum(tl.where(hit, par[None, :], 0), 1)
        cur = tl.where(cur >= 0, up, -1)
    proper = anc & (o_c[None, :] != dr[:, None])
    is_self = o_r[:, None] == o_c[None, :]  # row c of the key half is draft c
    if CHANNEL:
        G0, SB, SS = _chunk_channel(kq0, g0, kc0, gc0, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC)
        Y0 = kq0 * tl.exp(G0)
        if NKC > 1:
            G1, SB1, SS1 = _chunk_channel(kq1, g1, kc1, gc1, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC)
            Y1 = kq1 * tl.exp(G1)
            SB += SB1
            SS += SS1
        if NKC > 2:
            G2, SB2, SS2 = _chunk_channel(kq2, g2, kc2, gc2, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC)
            G3, SB3, SS3 = _chunk_channel(kq3, g3, kc3, gc3, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC)
            Y2 = kq2 * tl.exp(G2)
            Y3 = kq3 * tl.exp(G3)
            SB += SB2 + SB3
            SS += SS2 + SS3
    else:
        base = tl.sum(tl.where(o_m == n - 1, gc, 0.0), 0)  # the buffer tail's G (0 if empty)
        gd = tl.where(m_ct, g_in.to(tl.float32), 0.0)  # [R] over columns
        Gr = tl.where(m_t, base + tl.sum(tl.where(anc, gd[None, :], 0.0), 1), 0.0)  # [R] G of each row's draft
        Gc = tl.sum(tl.where(is_self, Gr[:, None], 0.0), 0)  # [R] the same, over columns
        eG = tl.exp(Gr)[:, None]
        SB = tl.dot(kq0, tl.trans(kc0), input_precision=PREC)  # [R, BC]
        SS = tl.dot(kq0, tl.trans(kq0), input_precision=PREC)  # [R, R]; columns < BD: the drafts' keys
        Y0 = kq0 * eG
        if NKC > 1:
            SB += tl.dot(kq1, tl.trans(kc1), input_precision=PREC)
            SS += tl.dot(kq1, tl.trans(kq1), input_precision=PREC)
            Y1 = kq1 * eG
        if NKC > 2:
            SB += tl.dot(kq2, tl.trans(kc2), input_precision=PREC)
            SS += tl.dot(kq2, tl.trans(kq2), input_precision=PREC)
            SB += tl.dot(kq3, tl.trans(kc3), input_precision=PREC)
            SS += tl.dot(kq3, tl.trans(kq3), input_precision=PREC)
            Y2 = kq2 * eG
            Y3 = kq3 * eG
        SB *= tl.exp(tl.where(m_t[:, None] & m_n[None, :], Gr[:, None] - gc[None, :], float("-inf")))
        SS *= tl.exp(tl.where(anc, Gr[:, None] - Gc[None, :], float("-inf")))
    W = tl.where(is_q[:, None], SB, -SB)
    M = tl.where(is_q[:, None], -SS, tl.where(proper, b_row[:, None] * SS, 0.0))  # N - I, strictly lower
    # N^-1: forward substitution over the key rows, then the query rows in one product
    Ninv = tl.where(is_self, 1.0, 0.0)
    for i in range(0, t):
        a_i = tl.sum(tl.where((o_r == i)[:, None], M, 0.0), 0)
        row = tl.where(o_c == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Ninv, 0)
        Ninv = tl.where((o_r == i)[:, None], row[None, :], Ninv)
    Ninv -= tl.dot(tl.where(is_q[:, None], M, 0.0), Ninv, input_precision=PREC)
    L = Ninv * b_col[None, :]
    Z = tl.where(m_t[:, None], v_in.to(tl.float32), 0.0) + tl.dot(W, uc, input_precision=PREC)
    out = tl.dot(L, Z, input_precision=PREC)  # [R, BV]
    if STORAGE:  # the products with the state tile: (L diag(sgn) Y) S0, chunk by chunk
        X = tl.dot(tl.dot(L, tl.where(is_q[:, None], Y0, -Y0), input_precision=PREC), s0, input_precision=PREC)
        if NKC > 1:
            X += tl.dot(tl.dot(L, tl.where(is_q[:, None], Y1, -Y1), input_precision=PREC), s1, input_precision=PREC)
        if NKC > 2:
            X += tl.dot(tl.dot(L, tl.where(is_q[:, None], Y2, -Y2), input_precision=PREC), s2, input_precision=PREC)
            X += tl.dot(tl.dot(L, tl.where(is_q[:, None], Y3, -Y3), input_precision=PREC), s3, input_precision=PREC)
        out += tl.where(owns, X, 0.0)
    out = tl.where(m_t[:, None], out, 0.0)
    m_out = m_in[:, None] & m_v[None, :]
    tl.store(o_ptr + p_rv, out.to(o_ptr.dtype.element_ty), mask=m_out & is_q[:, None])
    tl.store(du_ptr + p_rv, out.to(du_ptr.dtype.element_ty), mask=m_out & ~is_q[:, None])
    if i_v == 0:
        DK: tl.constexpr = True
        if not CHANNEL:
            tl.store(dg_ptr + p_rt, Gr.to(dg_ptr.dtype.element_ty), mask=m_in & ~is_q)
            G0 = kq0  # unused below
            G1 = kq0
            G2 = kq0
            G3 = kq0
        m_own = dr < tl.where(i_hv % GROUP == 0, D, 0)  # one program per (request, q/k head) keeps the keys
        _chunk_store(dk_ptr, dg_ptr, k0_in, G0, p_kq, p_rt, m_own, is_q, m_t, 0, DK, K, KC, False)
        if CHANNEL:
            _chunk_store(dk_ptr, dg_ptr, k0_in, G0, p_kq, p_rt, m_in, is_q, m_t, 0, False, K, KC, CHANNEL)
        if NKC > 1:
            _chunk_store(dk_ptr, dg_ptr, k1_in, G1, p_kq, p_rt, m_own, is_q, m_t, KC, DK, K, KC, False)
            if CHANNEL:
                _chunk_store(dk_ptr, dg_ptr, k1_in, G1, p_kq, p_rt, m_in, is_q, m_t, KC, False, K, KC, CHANNEL)
        if NKC > 2:
            _chunk_store(dk_ptr, dg_ptr, k2_in, G2, p_kq, p_rt, m_own, is_q, m_t, 2 * KC, DK, K, KC, False)
            _chunk_store(dk_ptr, dg_ptr, k3_in, G3, p_kq, p_rt, m_own, is_q, m_t, 3 * KC, DK, K, KC, False)
            if CHANNEL:
                _chunk_store(dk_ptr, dg_ptr, k2_in, G2, p_kq, p_rt, m_in, is_q, m_t, 2 * KC, False, K, KC, CHANNEL)
                _chunk_store(dk_ptr, dg_ptr, k3_in, G3, p_kq, p_rt, m_in, is_q, m_t, 3 * KC, False, K, KC, CHANNEL)


@triton.jit
def _accept_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BHV: tl.constexpr, NV: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PREC: tl.constexpr,
):
    GROUP: tl.constexpr = HV // H
    i_v = tl.program_id(0)
    i_bhv = tl.program_id(1).to(tl.int64)
    i_b = i_bhv // HV
    i_hv = i_bhv % HV
    i_h = i_hv // GROUP
    node = tl.load(node_ptr + i_b).to(tl.int32)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    o_d = tl.arange(0, BD)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    par = tl.load(par_ptr + i_b * D + o_d, mask=o_d < D, other=-1).to(tl.int32)
    # the root-to-node path, walked up in registers (parents precede children)
    on_path = o_d < 0
    cur = node
    for _ in range(0, node + 1):
        hit = o_d == cur
        on_path = on_path | hit
        cur = tl.where(cur >= 0, tl.sum(tl.where(hit, par, 0), 0), -1)
    pos = tl.sum(tl.where((o_d[None, :] < o_d[:, None]) & on_path[None, :], 1, 0), 1)  # index along the path
    m = tl.sum(on_path.to(tl.int32), 0)
    fold = n + m > C  # kvbuffer_ref.entries.fold_count: all old entries + the oldest max(0, m - C) new
    nf = tl.where(fold, tl.maximum(m - C, 0), 0)
    m_fd = on_path & (pos < nf)  # path entries folded into the state
    m_keep = on_path & (pos >= nf)  # path entries that stay buffered ...
    dest = tl.where(fold, pos - nf, n + pos)  # ... at these rows
    p_dt = (i_b * D + o_d) * HV + i_hv
    ud = tl.load(du_ptr + p_dt[:, None] * V + o_v[None, :], mask=on_path[:, None] & m_v[None, :], other=0.0)
    if CHANNEL:
        Gd = tl.load(dg_ptr + p_dt[:, None] * K + o_k[None, :], mask=on_path[:, None] & m_k[None, :],
                     other=0.0).to(tl.float32)
    else:
        Gd = tl.load(dg_ptr + p_dt, mask=on_path, other=0.0).to(tl.float32)
    if STORAGE:
        if fold:  # rare: S = diag(exp(G_end)) S0 + sum over folded entries exp(G_end - G_j) k_j u_j^T
            p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
            s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            s = tl.where(owns, s, 0.0)
            o_c = tl.arange(0, BC)
            m_n = o_c < n
            m_nk = m_n[:, None] & m_k[None, :]
            kc = tl.load(ck_ptr + ((i_b * C + o_c[:, None]) * H + i_h) * K + o_k[None, :], mask=m_nk,
                         other=0.0).to(tl.float32)
            uc = tl.load(cu_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :],
                         mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            dk = tl.load(dk_ptr + ((i_b * D + o_d[:, None]) * H + i_h) * K + o_k[None, :],
                         mask=m_fd[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            if CHANNEL:
                gc = tl.load(cg_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_nk,
                             other=0.0).to(tl.float32)
                g_end = tl.where(nf > 0, tl.sum(tl.where((on_path & (pos == nf - 1))[:, None], Gd, 0.0), 0),
                                 tl.sum(tl.where((o_c == n - 1)[:, None], gc, 0.0), 0))  # [BK]
                kcd = kc * tl.exp(tl.where(m_nk, g_end[None, :] - gc, float("-inf")))
                kdd = dk * tl.exp(tl.where(m_fd[:, None] & m_k[None, :], g_end[None, :] - Gd, float("-inf")))
                s = s * tl.exp(g_end)[:, None]
            else:
                gc = tl.load(cg_ptr + (i_b * C + o_c) * HV + i_hv, mask=m_n, other=0.0).to(tl.float32)
                g_end = tl.where(nf > 0, tl.sum(tl.where(on_path & (pos == nf - 1), Gd, 0.0), 0),
                                 tl.sum(tl.where(o_c == n - 1, gc, 0.0), 0))
                kcd = kc * tl.exp(tl.where(m_n, g_end - gc, float("-inf")))[:, None]
                kdd = dk * tl.exp(tl.where(m_fd, g_end - Gd, float("-inf")))[:, None]
                s = s * tl.exp(g_end)
            s += tl.dot(tl.trans(kcd), uc, input_precision=PREC)
            s += tl.dot(tl.trans(kdd), tl.where(m_fd[:, None], ud.to(tl.float32), 0.0), input_precision=PREC)
            tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
            tl.debug_barrier()  # every warp has read the old u rows before any is overwritten
    tl.store(cu_ptr + ((i_b * C + dest[:, None]) * HV + i_hv) * V + o_v[None, :],
             ud.to(cu_ptr.dtype.element_ty), mask=m_keep[:, None] & m_v[None, :])
    if (i_v == 0) & (n + m <= C):  # no fold: no old row is read by anyone: write the new key and G rows now
        if CHANNEL:
            tl.store(cg_ptr + ((i_b * C + dest[:, None]) * HV + i_hv) * K + o_k[None, :],
                     Gd.to(cg_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
        else:
            tl.store(cg_ptr + (i_b * C + dest) * HV + i_hv, Gd.to(cg_ptr.dtype.element_ty), mask=m_keep)
        if i_hv % GROUP == 0:
            p_k = ((i_b * D + o_d[:, None]) * H + i_h) * K + o_k[None, :]
            k_new = tl.load(dk_ptr + p_k, mask=m_keep[:, None] & m_k[None, :], other=0.0)
            tl.store(ck_ptr + ((i_b * C + dest[:, None]) * H + i_h) * K + o_k[None, :],
                     k_new.to(ck_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
    # the request's last program writes what the others read: lengths, has_state and, after a fold,
    # the kept keys and rebased G of every head
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == HV * NV - 1:
        if fold:
            for h in range(0, H):
                p_k = ((i_b * D + o_d[:, None]) * H + h) * K + o_k[None, :]
                k_new = tl.load(dk_ptr + p_k, mask=m_keep[:, None] & m_k[None, :], other=0.0)
                tl.store(ck_ptr + ((i_b * C + dest[:, None]) * H + h) * K + o_k[None, :],
                         k_new.to(ck_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
            last = tl.maximum(n - 1, 0)
            if CHANNEL:
                for hv in range(0, HV):
                    m_pk = on_path[:, None] & m_k[None, :]
                    G_p = tl.load(dg_ptr + ((i_b * D + o_d[:, None]) * HV + hv) * K + o_k[None, :], mask=m_pk,
                                  other=0.0).to(tl.float32)
                    g_old = tl.load(cg_ptr + ((i_b * C + last) * HV + hv) * K + o_k, mask=o_k < tl.where(n > 0, K, 0),
                                    other=0.0).to(tl.float32)
                    g_end = tl.where(nf > 0, tl.sum(tl.where((on_path & (pos == nf - 1))[:, None], G_p, 0.0), 0),
                                     g_old)
                    tl.store(cg_ptr + ((i_b * C + dest[:, None]) * HV + hv) * K + o_k[None, :],
                             (G_p - g_end[None, :]).to(cg_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
            else:
                o_hv = tl.arange(0, BHV)
                m_hv = o_hv < HV
                G_p = tl.load(dg_ptr + (i_b * D + o_d[:, None]) * HV + o_hv[None, :],
                              mask=on_path[:, None] & m_hv[None, :], other=0.0).to(tl.float32)  # [BD, BHV]
                g_old = tl.load(cg_ptr + (i_b * C + last) * HV + o_hv, mask=o_hv < tl.where(n > 0, HV, 0), other=0.0).to(tl.float32)
                g_end = tl.where(nf > 0, tl.sum(tl.where((on_path & (pos == nf - 1))[:, None], G_p, 0.0), 0), g_old)
                tl.store(cg_ptr + (i_b * C + dest[:, None]) * HV + o_hv[None, :],
                         (G_p - g_end[None, :]).to(cg_ptr.dtype.element_ty), mask=m_keep[:, None] & m_hv[None, :])
            tl.store(own_ptr + i_b, 1)
        tl.store(len_ptr + i_b, tl.where(fold, m - nf, n + m).to(len_ptr.dtype.element_ty))
        tl.store(ticket_ptr + i_b, 0)


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
    validate: bool = True,
    out: Optional[torch.Tensor] = None,
    precision: Optional[str] = None,
    BV: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, Drafts]:
    """Outputs of D draft tokens per request from the stale state plus the buffer, in ONE launch.

    q, k: [B, D, H, K]; v: [B, D, HV, V]; g: [B, D, HV]*; beta: [B, D, HV].  parents: [B, D] int
    (-1 = the buffer's tail; each parent before its child; default the chain -1, 0, ..., D-2);
    num_drafts: [B] int in 0..D (default D): ragged draft counts, padding rows get o = 0.
    Returns o [B, D, HV, V] (v's dtype, or written into ``out``) and ``Drafts`` in the u-cache form:
    u [B, D, HV, V] and G [B, D, HV]* (relative to the buffer's last flush) in the buffer's cache
    dtype, plus a copy of the keys.  Same results as ``kvbuffer_ref.verify``; the buffer is not
    modified and no per-draft state is ever formed.

    ``validate=False`` skips the checks that read device values (no host synchronisation).
    ``precision``: fp32 dot products on CUDA, 'tf32x3' (default) or 'ieee'; the interpreter uses 'ieee'.
    ``BV`` / ``num_warps`` / ``precision`` override the launch (``launch_config``; benchmarks tune them).
    """
    d = check_tokens(q, k, v, g, beta)
    if validate:
        check_buffer(buffer, d, q.device)
        parents = check_parents(parents, d.B, d.T, q.device)
        num_drafts = check_num_drafts(num_drafts, d.B, d.T, q.device)
    else:
        if not isinstance(buffer, KVBuffer):
            raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
        if parents is None:
            parents = torch.arange(-1, d.T - 1, device=q.device, dtype=torch.long).expand(d.B, d.T)
        if num_drafts is None:
            num_drafts = torch.full((d.B,), d.T, dtype=torch.long, device=q.device)
    _check_u_form(buffer, "verify")
    if d.T > MAX_DRAFTS:
        raise ValueError(f"q: {d.T} draft tokens per request, but kvbuffer_fast.verify handles at most "
                         f"{MAX_DRAFTS} in one launch; verify them in parts or use kvbuffer_ref.verify")
    s = check_scale(scale, d.K)
    parents = parents.to(torch.long).contiguous()
    num_drafts = num_drafts.to(torch.long).contiguous()
    shape_o = (d.B, d.T, d.HV, d.V)
    if out is None:
        o = new_output(shape_o, v.dtype, q.device)
    else:
        if tuple(out.shape) != shape_o or out.device != q.device or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor [B, D, HV, V] = {list(shape_o)} on {q.device}, "
                             f"got {list(out.shape)} on {out.device}")
        o = out
    du = new_output(shape_o, buffer.u.dtype, q.device)
    dG = new_output(tuple(g.shape), buffer.G.dtype, q.device)
    dk = new_output(tuple(k.shape), k.dtype, q.device)
    drafts = Drafts(parents=parents, num_drafts=num_drafts, k=dk, u=du, G=dG)
    if d.B == 0 or d.T == 0:
        return o, drafts
    cfg = launch_config("verify", d.V, BV=BV, num_warps=num_warps, precision=precision)
    nkc = min(4, block(d.K) // 16)  # key-dimension chunks of the kernel (1, 2 or 4)
    storage = buffer.state is not None
    with device_guard(q):
        _verify_kernel[(triton.cdiv(d.V, cfg["BV"]), d.B * d.HV)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), parents, num_drafts,
            o, du, dG, dk,
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
            buffer.state if storage else buffer.lengths,  # a dummy pointer when there is no state storage
            s, d.T,
            C=buffer.capacity, H=d.H, HV=d.HV, K=d.K, V=d.V,
            BD=block(d.T, 8), BC=block(buffer.capacity), KC=block(d.K) // nkc, NKC=nkc, BV=cfg["BV"],
            CHANNEL=d.channel_gate, STORAGE=storage, PREC=_precision(q, cfg["precision"]),
            num_warps=cfg["num_warps"],
        )
    return o, drafts


def _check_drafts(buffer: KVBuffer, drafts: Drafts) -> None:
    if not isinstance(drafts, Drafts):
        raise TypeError(f"drafts: expected the Drafts returned by verify, got {type(drafts).__name__}")
    if drafts.form != "u":
        raise NotImplementedError("drafts: kvbuffer_fast.accept takes u-cache drafts (from kvbuffer_fast.verify or "
                                  "kvbuffer_ref.verify on a u-form buffer); got raw-form drafts")
    if drafts.k.shape[0] != buffer.batch or drafts.k.shape[2:] != buffer.k.shape[2:]:
        raise ValueError(f"drafts: keys of shape {list(drafts.k.shape)} do not fit the buffer's "
                         f"[B, C, H, K] = {list(buffer.k.shape)}")
    B, D = drafts.k.shape[:2]
    if tuple(drafts.u.shape) != (B, D) + tuple(buffer.u.shape[2:]) or \
            tuple(drafts.G.shape) != (B, D) + tuple(buffer.G.shape[2:]):
        raise ValueError(f"drafts: u {list(drafts.u.shape)} / G {list(drafts.G.shape)} do not fit the buffer's "
                         f"u {list(buffer.u.shape)} / G {list(buffer.G.shape)}")


def _path_lengths(parents: torch.Tensor, nodes: torch.Tensor) -> list[int]:
    """Host-side depth of each accepted node (0 for -1); only for the no-storage check."""
    par, out = parents.tolist(), []
    for b, node in enumerate(nodes.tolist()):
        m = 0
        while node >= 0:
            m, node = m + 1, par[b][node]
        out.append(m)
    return out


def accept(
    buffer: KVBuffer,
    drafts: Drafts,
    *,
    counts=None,
    nodes=None,
    validate: bool = True,
    precision: Optional[str] = None,
    BV: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> KVBuffer:
    """Commit accepted drafts IN PLACE, in one launch: append their cached (k, u, G); return the buffer.

    Exactly one of ``counts`` ([B] int or int: the first m drafts of a chain) or ``nodes`` ([B] int
    or int: the accepted node, -1 for none; its root-to-node path is appended).  ``buffer`` must be
    the one ``verify`` saw.  Past the capacity, the reference's rule folds all old entries plus the
    oldest max(0, m - C) accepted ones into the state (same launch) and keeps the rest, G rebased.
    ``validate=False``: no host synchronisation (CUDA graphs); ``BV`` / ``num_warps`` / ``precision``
    override the launch.
    """
    if validate:
        check_buffer(buffer)
    elif not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    _check_u_form(buffer, "accept")
    _check_drafts(buffer, drafts)
    if (counts is None) == (nodes is None):
        raise ValueError("accept: give exactly one of counts= (chain drafts) or nodes= (tree drafts)")
    B, D = drafts.k.shape[:2]
    dev = buffer.k.device
    if validate:
        if counts is not None:
            nodes = check_counts(counts, drafts.num_drafts, drafts.is_chain) - 1
        else:
            nodes = check_nodes(nodes, drafts.num_drafts)
    else:
        x = counts if counts is not None else nodes
        if isinstance(x, int) and not isinstance(x, bool):
            x = torch.full((B,), x, dtype=torch.long, device=dev)
        nodes = x.to(device=dev, dtype=torch.long) - (1 if counts is not None else 0)
    nodes = nodes.contiguous()
    C = buffer.capacity
    if buffer.state is None and validate:
        ms = _path_lengths(drafts.parents, nodes)
        for b, (n, m) in enumerate(zip(buffer.lengths.tolist(), ms)):
            if n + m > C:
                raise ValueError(
                    f"buffer: request {b} has {n} entries and gets {m} more, past the capacity C={C}, but the "
                    f"buffer has no state storage to fold into (buffer.state is None); call flush() first (it "
                    f"allocates the state) or use a larger capacity")
    if B == 0 or D == 0:
        return buffer
    cfg = launch_config("accept", buffer.head_v_dim, BV=BV, num_warps=num_warps, precision=precision)
    storage = buffer.state is not None
    H, HV, K, V = buffer.num_heads, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim
    NV = triton.cdiv(V, cfg["BV"])
    with device_guard(buffer.k):
        _accept_kernel[(NV, B * HV)](
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
            buffer.state if storage else buffer.lengths, ticket_counters(B, dev),
            as_input(drafts.k), as_input(drafts.u), as_input(drafts.G), as_input(drafts.parents), nodes, D,
            C=C, H=H, HV=HV, K=K, V=V, BD=block(D), BC=block(C), BK=block(K), BV=cfg["BV"], BHV=block(HV, 1), NV=NV,
            CHANNEL=buffer.channel_gate, STORAGE=storage, PREC=_precision(buffer.k, cfg["precision"]),
            num_warps=cfg["num_warps"],
        )
    return buffer
