"""Speculative verification without per-draft states: verify (chains and trees) and accept, on the u-cache.

Rows.  With BD >= D drafts (a power of two >= 8), verify works on R = 2 BD rows: row i < BD is draft
i's key (its innovation u_i is computed there) and row BD + i is draft i's scaled query (its output
o_i).  Per value head, with G_i = G_parent(i) + g_i (the root's parent: the buffer's tail, 0 if
empty), D_ij = exp(G_i - G_j), m over the request's n buffered entries and j over the tree:

    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_m D_im (k_i.k_m) u_m - sum_{j proper anc i} D_ij (k_i.k_j) u_j)
    o_i = exp(G_i) S0^T q_i + sum_m D_im (q_i.k_m) u_m + sum_{j anc i or j = i} D_ij (q_i.k_j) u_j

In matrix form over the R rows: N [U; O] = diag(b) Z with b = [beta; 1],
Z = [v; 0] + W U_buf + diag(sgn) Y S0 (sgn = -1 on key rows, +1 on query rows; W the decayed
draft x buffer scores with that sign; Y the rows k_i, q_i scaled by exp(G_i)), and N unit lower
triangular: [[I + A, 0], [-QQ, I]] with A_ij = beta_i D_ij (k_i.k_j) over proper ancestors and
QQ_ij = D_ij (q_i.k_j) over ancestors-or-self.  With L = N^-1 diag(b):

    [U; O] = L [v; 0] + (L W) U_buf + P S0,     P = L diag(sgn) Y   ([R, K])

verify runs in two launches.  Phase 1 (grid B * H, one warp: ``_verify_prep_group_kernel``, the
default for scalar gates) does all that does not touch the state: the ancestor mask (a walk up
``parents``, at most d steps, on [R, R] registers), the scores ([R, K] x [K, C] and [R, K] x [K, R],
in chunks of key columns) once per q/k head, since its HV / H value heads share them, and then per
value head G along each path, the decays, N^-1 by forward substitution over the d key rows plus one
product for the query rows, L, L W and L' = L diag(sgn exp(G) s) (s: the query scale; fp32
scratch), Drafts.G and Drafts.k.  Phase 2 (``_verify_stream_kernel``, grid (V / BV, B * HV), BV=128):
the state product X S0 over [KB, BV] blocks of the state in a pipelined loop, X the raw key / query
rows read from the inputs (P S0 = L' X S0), then L [v; 0] + (L W) U_buf + L' (X S0) (direct-mode
requests select zeros with ``tl.where``), and stores o and u.  With pdl=True (CUDA, sm_90+) phase 2
is launched as a programmatic dependent of phase 1 and runs its state loop before it waits for
phase 1's results, so the two can overlap.  Per-channel (KDA) gates keep the per-value-head phase 1
(``_verify_prep_kernel``: the exp moves inside the scores, computed row by row) and its
P = L diag(sgn) Y ([R, K]), which phase 2 then multiplies by the state blocks (zp=False does that
for scalar gates too: the previous default).  variant='fused' (``_verify_fused_kernel``, scalar
gates) does both phases in one program per (request, value head, V-tile), without scratch; it
measured slower on the H200 (docs/speculative.md).  Nothing is written to the state and no state is
formed per draft: ``Drafts`` keeps the drafts' (k, u, G).

accept, grid (V / BV, B * HV): per request the accepted node's root-to-node path (m entries, found by
walking ``parents`` in registers) is appended from the drafts' cached (k, u, G).  When n + m > C the
reference's rule applies (``kvbuffer_ref.entries.fold_count``): all n old entries plus the oldest
max(0, m - C) path entries are folded into the state first, by a separate launch whose programs return
at once for every other request (rank-1 updates, as decode's fold; kept apart so that its registers
do not slow the common case).  Then the copy: u columns (every program), G rows (V-tile 0, rebased on
the last folded entry) and keys (one program per q/k head); the request's last program (atomic
ticket) advances ``lengths`` / ``has_state``.  The buffer is updated IN PLACE and returned.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.checks import (check_buffer, check_counts, check_nodes, check_num_drafts, check_parents,
                                     check_scale, check_tokens)

from ._common import (_gdc_wait, _pdl_prologue, _program_ids, as_input, block, device_guard, flag_view, new_output,
                      pdl_launch, ticket_counters)
from ._common import check_u_form as _check_u_form
from ._fold import fold_rows as _fold_rows

__all__ = ["verify", "accept", "MAX_DRAFTS", "launch_config", "set_launch", "LAUNCH_CANDIDATES"]

#: The largest draft count per request one launch handles (the [2D, 2D] algebra lives in registers).
MAX_DRAFTS = 64

# Launch parameters per kernel: BV (state columns per program), num_warps and, for verify, the fp32
# dot precision on CUDA ('tf32x3': three TF32 tensor-core products, ~fp32 accuracy; 'ieee': FMA).
# bench/gpu_verify.py --tune times LAUNCH_CANDIDATES on the GPU and calls set_launch with the best.
# verify default: the best of the H200 probes of 2026-11-29 (bench/results/h200_probe/, B=128, D=5):
# phase 1 per q/k head (37 us), phase 2 over BV=128 tiles reading the raw draft rows (108 us, 128
# registers), launched with PDL: 147 us, against 196 us for the previous default (P from phase 1,
# BV=64) and 220-507 us for the one-launch 'fused' kernel.  Session 4: phase 1 capped at 128
# registers (16 one-warp programs per SM instead of 9) with its per-value-head loads hoisted (8 bytes
# of spill instead of 104): 147.5 -> 137.6 us at B=128, 81.0 -> 78.1 at B=64, 531.9 -> 503.6 at B=512
# (bench/results/h200_probe/session4/); then phase 1's scores as 16-bit MMAs of the raw rows for bf16 /
# fp16 inputs (prep_mma): 138.0 -> 132.3 us at B=128 in call 12's tune.  accept: BV=32 (its sweep's
# best was within noise).
_CONFIG = {
    "verify": dict(BV=128, num_warps=4, precision="tf32x3", prep_warps=1, variant="stream", KB="auto", NS="auto",
                   prep_precision="tf32x3", zp=True, pdl=True, prep_group=True, prep_maxnreg=128,
                   prep_hoist=True, prep_mma=True, early="auto", xprec="auto"),
    "accept": dict(BV=32, num_warps=4, precision="tf32x3"),
    "accept_fold": dict(BV=128, num_warps=4, precision="ieee"),  # rank-1 updates: no spill at 128 / 4 warps
}

#: verify launches worth timing on a GPU (bench/gpu_verify.py --tune, at B = 128): changes to the default
#: launch (the tune merges each with it), the default first.  The default: the two-phase 'stream' variant
#: with phase 2 reading the raw draft rows (zp), programmatic dependent launch (pdl), phase 1 per q/k head
#: (prep_group), BV 128, phase 2's X S0 split in two TF32 pieces for 16-bit rows (xprec 'auto', session 7)
#: and its blocks by batch (KB / NS 'auto').  The probe (bench/gpu_probe.py, bench/results/h200_probe/)
#: timed more (8 warps, NS=2, KB=64, ieee phase 1, the one-launch 'fused' kernel, xprec 'bf16x3'): all
#: slower; docs/speculative.md has the numbers.
LAUNCH_CANDIDATES = [
    dict(),
    dict(xprec="tf32x3"),  # session 6's default: X S0 in tf32x3 whatever the rows
    # phase 1's solve by products: a tie with the row solve (B = 128: 132.5 against 132.3 us in session 5's
    # call 14, 122.2 against 122.1 in session 7's probe)
    dict(prep_solve="doubling"),
    dict(prep_mma=False),
    dict(prep_maxnreg=0, prep_hoist=False, prep_mma=False),
    dict(prep_group=False),
    dict(BV=64, KB=32, NS=3),
    dict(BV=64, KB=32, NS=3, zp=False, pdl=False, prep_group=False),
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
    _CONFIG[kernel].update(cfg)
    return old


def _precision(x: torch.Tensor, precision: Optional[str]) -> str:
    """fp32 dot precision on CUDA ('tf32x3' or 'ieee'; plain tf32 misses the fp32 budget); the
    interpreter always uses 'ieee'."""
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"precision: expected None, 'ieee' or 'tf32x3', got {precision!r} (plain 'tf32' was "
                         f"measured and misses the fp32 budget of the u-cache: docs/speculative.md)")
    return precision if x.is_cuda else "ieee"


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
def _draft_rows(len_ptr, nd_ptr, i_b, D, BD: tl.constexpr):
    """The request's buffer length n and draft count t, and the R = 2 BD rows every verify kernel works
    on: o_r (row index), dr (the draft a row belongs to), is_q (query rows BD..2BD-1), m_in (rows that
    exist in the [B, D, ...] inputs) and m_t (rows of real drafts; padding rows are zeroed by selects,
    never by multiplying)."""
    n = tl.load(len_ptr + i_b).to(tl.int32)
    t = tl.load(nd_ptr + i_b).to(tl.int32)
    o_r = tl.arange(0, 2 * BD)
    dr = o_r % BD
    is_q = o_r >= BD
    return n, t, o_r, dr, is_q, dr < D, dr < t


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
                   BC: tl.constexpr, SCORES: tl.constexpr):
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
    n_rows = t * 0
    if SCORES:  # else only G
        n_rows = 2 * t
    for rr in range(0, n_rows):
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
def _scalar_decays(SB, SS, gc, g_in, anc, is_self, m_t, m_ct, m_n, o_m, n):
    """Scalar gates: G of each row's draft (the buffer tail's G plus the gates along its path) and the
    scores vs the buffer [R, BC] and vs the tree [R, R] multiplied by their decays exp(G_i - G_j)."""
    base = tl.sum(tl.where(o_m == n - 1, gc, 0.0), 0)  # the buffer tail's G (0 if empty)
    gd = tl.where(m_ct, g_in.to(tl.float32), 0.0)  # [R] over columns
    Gr = tl.where(m_t, base + tl.sum(tl.where(anc, gd[None, :], 0.0), 1), 0.0)  # [R] G of each row's draft
    Gc = tl.sum(tl.where(is_self, Gr[:, None], 0.0), 0)  # [R] the same, over columns
    SB = SB * tl.exp(tl.where(m_t[:, None] & m_n[None, :], Gr[:, None] - gc[None, :], float("-inf")))
    SS = SS * tl.exp(tl.where(anc, Gr[:, None] - Gc[None, :], float("-inf")))
    return Gr, SB, SS


@triton.jit
def _solve_rows(SB, SS, is_q, proper, is_self, b_row, b_col, o_r, o_c, t, PREC: tl.constexpr,
                DOUBLING: tl.constexpr = False, LOG_BD: tl.constexpr = 3):
    """From the decayed scores: W (sign -1 on key rows), M = N - I (strictly lower), N^-1 of the key
    rows, one product for the query rows, and L = N^-1 diag(b).  The key rows by forward substitution
    over the t key rows, or with DOUBLING (prep_solve="doubling") by products: the key block A of M is
    strictly lower triangular (a draft's proper ancestors come before it), so A^BD = 0 and
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(BD/2)): 2 (log2 BD - 1) products of [R, R]
    instead of a chain of t dependent row steps."""
    W = tl.where(is_q[:, None], SB, -SB)
    M = tl.where(is_q[:, None], -SS, tl.where(proper, b_row[:, None] * SS, 0.0))
    eye = tl.where(is_self, 1.0, 0.0)
    if DOUBLING:
        A = tl.where(is_q[:, None], 0.0, M)  # query rows of Ninv stay rows of I here
        Ninv = eye - A
        P = A
        for _ in tl.static_range(LOG_BD - 1):
            P = tl.dot(P, P, input_precision=PREC)  # A^(2^i)
            Ninv = tl.dot(Ninv, eye + P, input_precision=PREC)
    else:
        Ninv = eye
        for i in range(0, t):
            a_i = tl.sum(tl.where((o_r == i)[:, None], M, 0.0), 0)
            row = tl.where(o_c == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Ninv, 0)
            Ninv = tl.where((o_r == i)[:, None], row[None, :], Ninv)
    Ninv -= tl.dot(tl.where(is_q[:, None], M, 0.0), Ninv, input_precision=PREC)
    return Ninv * b_col[None, :], W


@triton.jit
def _store_l(l_ptr, p_ptr, L, W, Gr, i_bhv, is_q, is_self, m_t, o_r, o_c, o_m, scale, R: tl.constexpr,
             BC: tl.constexpr, ZP: tl.constexpr, PREC: tl.constexpr):
    """Phase 1's results for one value head: L and L W ([R, R + BC]) and, with ZP, L' = L diag(sgn
    exp(G) s) ([R, R]; s = the query scale, zero on padding rows), which phase 2 applies to X S0."""
    p_l = l_ptr + (i_bhv * R + o_r[:, None]) * (R + BC)
    tl.store(p_l + o_c[None, :], L)
    tl.store(p_l + R + o_m[None, :], tl.dot(L, W, input_precision=PREC))
    if ZP:
        col = tl.where(m_t, tl.where(is_q, scale, -1.0) * tl.exp(Gr), 0.0)  # over rows of X = columns of L
        col_c = tl.sum(tl.where(is_self, col[:, None], 0.0), 0)
        tl.store(p_ptr + (i_bhv * R + o_r[:, None]) * R + o_c[None, :], L * col_c[None, :])


@triton.jit
def _verify_prep_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr,
    ck_ptr, cg_ptr, len_ptr, p_ptr, l_ptr,
    scale, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr,
    CHANNEL: tl.constexpr, PREC: tl.constexpr, ZP: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Phase 1, one program per (request, value head): everything that does not touch the state.
    Writes L = N^-1 diag(b) and L W ([R, R + BC], see the module docstring), P = L diag(sgn) Y
    ([R, K]), Drafts.G and (one program per q/k head) Drafts.k.  The key dimension is walked in
    chunks of KC columns (two passes: scores, then P), so that few registers are live: many
    programs share an SM and hide each other's latency.  ZP (scalar gates): instead of P, the [R, R]
    matrix L' = L diag(sgn exp(G) s) (s = scale on query rows, 0 on padding rows), so that
    P S0 = L' (X S0) with X the raw key / query rows, which phase 2 reads itself: no second pass."""
    R: tl.constexpr = 2 * BD  # rows: draft keys 0..BD-1, draft queries BD..2BD-1
    GROUP: tl.constexpr = HV // H
    _pdl_prologue(PDL)
    i_bhv = tl.program_id(0).to(tl.int64)
    i_b = i_bhv // HV
    i_hv = i_bhv % HV
    i_h = i_hv // GROUP
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, D, BD)
    o_c = tl.arange(0, R)  # column index of the [R, R] matrices (columns < BD: draft keys)
    m_own = dr < tl.where(i_hv % GROUP == 0, D, 0)  # one program per (request, q/k head) keeps the keys
    p_kq = ((i_b * D + dr) * H + i_h) * K
    p_rt = (i_b * D + dr) * HV + i_hv  # [R] offsets of per-(draft, value head) rows
    beta_in = tl.load(beta_ptr + p_rt, mask=m_in, other=0.0)
    m_cin = (o_c < BD) & (o_c < D)
    par_in = tl.load(par_ptr + i_b * D + o_c, mask=m_cin, other=-1)
    beta_cin = tl.load(beta_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
    if not CHANNEL:
        g_in = tl.load(g_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
    o_m = tl.arange(0, BC)
    m_n = o_m < n
    p_ck = ((i_b * C + o_m) * H + i_h) * K
    p_cg = (i_b * C + o_m) * HV + i_hv
    if not CHANNEL:
        gc = tl.load(cg_ptr + p_cg, mask=m_n, other=0.0).to(tl.float32)  # [BC]
    m_ct = (o_c < BD) & (o_c < t)
    b_row = tl.where(m_t, beta_in.to(tl.float32), 0.0)
    b_col = tl.where(o_c < BD, tl.where(m_ct, beta_cin.to(tl.float32), 0.0), 1.0)  # b = [beta; 1]
    par = tl.where(m_ct, par_in.to(tl.int32), -1)
    anc, proper, is_self = _ancestors(par, dr, m_t, o_r, o_c, t)
    # pass 1 over the key dimension: scores vs the buffer [R, BC] and vs the drafts [R, R]; Drafts.k
    SB = tl.zeros([R, BC], dtype=tl.float32)
    SS = tl.zeros([R, R], dtype=tl.float32)
    for k0 in range(0, K, KC):
        k_in, kq, g = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, k0, scale, K, KC, CHANNEL)
        kc, gcc = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, k0, K, KC, CHANNEL)
        o_k = k0 + tl.arange(0, KC)
        tl.store(dk_ptr + p_kq[:, None] + o_k[None, :],
                 tl.where(m_t[:, None], k_in, 0.0).to(dk_ptr.dtype.element_ty),
                 mask=(m_own & ~is_q)[:, None] & (o_k < K)[None, :])
        if CHANNEL:
            Gr_c, SB_c, SS_c = _chunk_channel(kq, g, kc, gcc, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC, True)
            SB += SB_c
            SS += SS_c
        else:
            SB += tl.dot(kq, tl.trans(kc), input_precision=PREC)
            SS += tl.dot(kq, tl.trans(kq), input_precision=PREC)  # columns < BD: the drafts' keys
    if not CHANNEL:  # scalar gates: the decays multiply the finished scores
        Gr, SB, SS = _scalar_decays(SB, SS, gc, g_in, anc, is_self, m_t, m_ct, m_n, o_m, n)
        tl.store(dg_ptr + p_rt, Gr.to(dg_ptr.dtype.element_ty), mask=m_in & ~is_q)
    else:
        Gr = b_row  # unused (per-channel G is formed chunk by chunk in pass 2)
    L, W = _solve_rows(SB, SS, is_q, proper, is_self, b_row, b_col, o_r, o_c, t, PREC)
    _store_l(l_ptr, p_ptr, L, W, Gr, i_bhv, is_q, is_self, m_t, o_r, o_c, o_m, scale, R, BC, ZP and not CHANNEL,
             PREC)
    if ZP and not CHANNEL:  # phase 2 forms X S0 itself: no P
        n_pass2 = 0
    else:
        n_pass2 = K
    # pass 2: P = L diag(sgn) Y, Y = the rows k_i, q_i scaled by exp(G_i) (per-channel: Drafts.G too)
    for k0 in range(0, n_pass2, KC):
        k_in, kq, g = _chunk_rows(k_ptr, q_ptr, g_ptr, p_kq, p_rt, m_in, is_q, m_t, k0, scale, K, KC, CHANNEL)
        o_k = k0 + tl.arange(0, KC)
        if CHANNEL:
            kc, gcc = _chunk_entries(ck_ptr, cg_ptr, p_ck, p_cg, m_n, k0, K, KC, CHANNEL)
            Gr_c, SB_c, SS_c = _chunk_channel(kq, g, kc, gcc, anc, o_r, o_m, m_t, m_n, n, t, BD, R, BC, False)
            tl.store(dg_ptr + p_rt[:, None] * K + o_k[None, :], Gr_c.to(dg_ptr.dtype.element_ty),
                     mask=(m_in & ~is_q)[:, None] & (o_k < K)[None, :])
            Y = kq * tl.exp(Gr_c)
        else:
            Y = kq * tl.exp(Gr)[:, None]
        P = tl.dot(L, tl.where(is_q[:, None], Y, -Y), input_precision=PREC)
        tl.store(p_ptr + (i_bhv * R + o_r[:, None]) * K + o_k[None, :], P, mask=(o_k < K)[None, :])


@triton.jit
def _verify_prep_group_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, dg_ptr, dk_ptr,
    ck_ptr, cg_ptr, len_ptr, p_ptr, l_ptr,
    scale, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False,
    HOIST: tl.constexpr = False, BG: tl.constexpr = 2, MMA16: tl.constexpr = False,
    DOUBLING: tl.constexpr = False, LOG_BD: tl.constexpr = 3,
):
    """Phase 1 for scalar gates with ZP, one program per (request, q/k head): the scores of the drafts'
    keys / queries against the buffer [R, BC] and the tree [R, R] are the same for the HV / H value
    heads that share the q/k head (only their decays, betas and gates differ), so they are formed
    once, then each value head's decays, N^-1, L, L W and L' are written as _verify_prep_kernel does.
    HOIST (the default, prep_hoist=True): the betas and gates of all the value heads ([BG, *], BG = the
    group size rounded up to a power of two) are loaded before the chunk loop, so no value head waits
    for a load after it (a load after a store cannot be moved above it: the pointers might alias).
    MMA16 (q, k and the buffered keys all bf16 or all fp16, prep_mma=True): the scores are 16-bit MMAs
    of the raw rows (exact products, fp32 sums: no tf32 splitting), and the query scale multiplies
    the finished scores' query rows / columns."""
    R: tl.constexpr = 2 * BD
    GROUP: tl.constexpr = HV // H
    _pdl_prologue(PDL)
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, D, BD)
    o_c = tl.arange(0, R)
    p_kq = ((i_b * D + dr) * H + i_h) * K
    m_cin = (o_c < BD) & (o_c < D)
    m_ct = (o_c < BD) & (o_c < t)
    par_in = tl.load(par_ptr + i_b * D + o_c, mask=m_cin, other=-1)
    par = tl.where(m_ct, par_in.to(tl.int32), -1)
    anc, proper, is_self = _ancestors(par, dr, m_t, o_r, o_c, t)
    o_m = tl.arange(0, BC)
    m_n = o_m < n
    p_ck = ((i_b * C + o_m) * H + i_h) * K
    if HOIST:
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
        gc2 = tl.load(cg_ptr + (i_b * C + o_m[None, :]) * HV + hv_g, mask=m_g & m_n[None, :],
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
        tl.store(dk_ptr + p_kq[:, None] + o_k[None, :], tl.where(m_t[:, None], k_in, 0.0).to(dk_ptr.dtype.element_ty),
                 mask=(m_in & ~is_q)[:, None] & (o_k < K)[None, :])
    if MMA16:  # the query rows carry the scale (kq = [k; s q] in the fp32 path); SS's query columns go unused
        s_r = tl.where(is_q, scale, 1.0)
        SB = SB * s_r[:, None]
        SS = SS * s_r[:, None]
    for j in tl.static_range(GROUP):
        i_hv = i_h * GROUP + j
        i_bhv = i_b * HV + i_hv
        p_rt = (i_b * D + dr) * HV + i_hv
        if HOIST:  # this value head's row of the loads issued before the chunk loop
            sel = (o_g == j)[:, None]
            beta_in = tl.sum(tl.where(sel, beta_in2, 0.0), 0)
            beta_cin = tl.sum(tl.where(sel, beta_cin2, 0.0), 0)
            g_in = tl.sum(tl.where(sel, g_in2, 0.0), 0)
            gc = tl.sum(tl.where(sel, gc2, 0.0), 0)
        else:
            beta_in = tl.load(beta_ptr + p_rt, mask=m_in, other=0.0)
            beta_cin = tl.load(beta_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
            g_in = tl.load(g_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0)
            gc = tl.load(cg_ptr + (i_b * C + o_m) * HV + i_hv, mask=m_n, other=0.0).to(tl.float32)
        b_row = tl.where(m_t, beta_in.to(tl.float32), 0.0)
        b_col = tl.where(o_c < BD, tl.where(m_ct, beta_cin.to(tl.float32), 0.0), 1.0)
        Gr, SBj, SSj = _scalar_decays(SB, SS, gc, g_in, anc, is_self, m_t, m_ct, m_n, o_m, n)
        tl.store(dg_ptr + p_rt, Gr.to(dg_ptr.dtype.element_ty), mask=m_in & ~is_q)
        L, W = _solve_rows(SBj, SSj, is_q, proper, is_self, b_row, b_col, o_r, o_c, t, PREC,
                           DOUBLING, LOG_BD)  # DOUBLING: timed a tie with the rows (session 5)
        _store_l(l_ptr, p_ptr, L, W, Gr, i_bhv, is_q, is_self, m_t, o_r, o_c, o_m, scale, R, BC, True, PREC)


@triton.jit
def _tf32_round(x):
    """x rounded to the nearest TF32 value (10 mantissa bits, ties away from zero), kept as fp32: the low
    13 bits cleared after adding half of their range.  x minus it is exact in fp32."""
    b = x.to(tl.uint32, bitcast=True)
    return ((b + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_pieces(s):
    """s = s1 + s2 + s3 + r in bfloat16 pieces, each the rounding of what the ones before it left:
    |r| <= 2^-27 |s| (each rounding keeps 9 bits), so three bf16 products carry s to about fp32 accuracy."""
    s1 = s.to(tl.bfloat16)
    r = s - s1.to(tl.float32)
    s2 = r.to(tl.bfloat16)
    s3 = (r - s2.to(tl.float32)).to(tl.bfloat16)
    return s1, s2, s3


@triton.jit
def _split_dot(x, s, acc, XPREC: tl.constexpr, XP: tl.constexpr):
    """acc + x s for x exactly representable in 16 bits (the raw bf16 / fp16 key and query rows), s fp32:
    only s needs splitting (the x part of tf32x3's split is zero), smallest piece first.
    "tf32x2": s = hi + lo, hi its TF32 rounding (|lo| <= 2^-11 |s|), two TF32 products: the terms of
    tf32x3 that are not zero, so its error (the product of lo truncated to TF32: <= 2^-21 |s|).
    "bf16x3" (x bf16 only): s in three bfloat16 pieces (_bf16_pieces), three bf16 products, each exact in
    the fp32 accumulator.
    XP: the pieces' product precision ("tf32" on CUDA; "ieee" in the interpreter, which has no TF32)."""
    if XPREC == "tf32x2":
        hi = _tf32_round(s)
        acc = tl.dot(x, s - hi, acc, input_precision=XP)
        acc = tl.dot(x, hi, acc, input_precision=XP)
    else:
        xh = x.to(tl.bfloat16)
        s1, s2, s3 = _bf16_pieces(s)
        acc = tl.dot(xh, s3, acc)
        acc = tl.dot(xh, s2, acc)
        acc = tl.dot(xh, s1, acc)
    return acc


@triton.jit
def _verify_stream_kernel(
    v_ptr, nd_ptr, o_ptr, du_ptr, cu_ptr, len_ptr, own_ptr, state_ptr, p_ptr, l_ptr, D,
    C: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    STORAGE: tl.constexpr, PREC: tl.constexpr, ZP: tl.constexpr = False, PDL: tl.constexpr = False,
    H: tl.constexpr = 1, q_ptr=None, k_ptr=None, EARLY: tl.constexpr = False, XPREC: tl.constexpr = "",
    XP: tl.constexpr = "ieee",
):
    """Phase 2, one program per (request, value head, V-tile): [U; O] = L [v; 0] + (L W) U_buf + P S0,
    the state streamed in [KB, BV] blocks through a pipelined loop (P S0 accumulated block by block;
    direct requests select 0).  ZP: the loop forms X S0 from the raw key / query rows instead (read
    from the inputs, shared by the value heads of a q/k head) and P S0 = L' (X S0) after it; the loop
    reads nothing phase 1 writes, so with PDL it runs before waiting for phase 1 (the two overlap).
    EARLY: the draft values and the buffer's n live u rows are loaded before the loop instead of after it
    (with PREC's X S0 it costs registers, so fewer programs per SM: faster at B = 64 only on the H200;
    with a split one it costs none and is faster at every batch: _early).
    XPREC (ZP, 16-bit q and k only): X S0 with the state block split by _split_dot ("tf32x2" or "bf16x3",
    the pieces' products in precision XP); "" takes PREC."""
    R: tl.constexpr = 2 * BD
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    _pdl_prologue(PDL, WAIT=not ZP)  # without ZP, L, L W and P are read first; with it, the wait is after the loop
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, D, BD)
    owns = tl.load(own_ptr + i_b) != 0
    o_kb = tl.arange(0, KB)
    p_s = state_ptr + (i_bhv * K + o_kb[:, None]) * V + o_v[None, :]
    X = tl.zeros([R, BV], dtype=tl.float32)
    p_rv = ((i_b * D + dr) * HV + i_hv)[:, None] * V + o_v[None, :]
    o_m = tl.arange(0, BC)
    p_u = cu_ptr + ((i_b * C + o_m[:, None]) * HV + i_hv) * V + o_v[None, :]
    if EARLY:
        v_in = tl.load(v_ptr + p_rv, mask=(m_in & ~is_q)[:, None] & m_v[None, :], other=0.0)
        uc = tl.load(p_u, mask=(o_m < n)[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
    if ZP:
        if STORAGE:
            p_x = ((i_b * D + dr) * H + i_h)[:, None] * K + o_kb[None, :]
            m_kx = (m_in & m_t & ~is_q)[:, None]
            m_qx = (m_in & m_t & is_q)[:, None]
            for k0 in tl.range(0, K, KB, num_stages=NS):
                m_kb = (k0 + o_kb) < K
                sb = tl.load(p_s + k0 * V, mask=m_kb[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                xb = (tl.load(k_ptr + p_x + k0, mask=m_kx & m_kb[None, :], other=0.0).to(tl.float32)
                      + tl.load(q_ptr + p_x + k0, mask=m_qx & m_kb[None, :], other=0.0).to(tl.float32))
                if XPREC == "":
                    X = tl.dot(xb, sb, X, input_precision=PREC)
                else:
                    X = _split_dot(xb, sb, X, XPREC, XP)
        if PDL:
            _gdc_wait()  # phase 1's L, L W, L' from here on
    if not EARLY:
        v_in = tl.load(v_ptr + p_rv, mask=(m_in & ~is_q)[:, None] & m_v[None, :], other=0.0)
    o_c = tl.arange(0, R)
    p_l = l_ptr + (i_bhv * R + o_r[:, None]) * (R + BC)
    L = tl.load(p_l + o_c[None, :])
    LW = tl.load(p_l + R + o_m[None, :])
    m_n = o_m < n
    if not EARLY:
        uc = tl.load(p_u, mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
    out = tl.dot(L, tl.where(m_t[:, None], v_in.to(tl.float32), 0.0), input_precision=PREC)
    out += tl.dot(LW, uc, input_precision=PREC)
    if STORAGE:
        if ZP:
            L2 = tl.load(p_ptr + (i_bhv * R + o_r[:, None]) * R + o_c[None, :])
            X = tl.dot(L2, X, input_precision=PREC)
        else:
            p_p = p_ptr + (i_bhv * R + o_r[:, None]) * K + o_kb[None, :]
            for k0 in tl.range(0, K, KB, num_stages=NS):
                m_kb = (k0 + o_kb) < K
                sb = tl.load(p_s + k0 * V, mask=m_kb[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                pb = tl.load(p_p + k0, mask=m_kb[None, :], other=0.0)
                X = tl.dot(pb, sb, X, input_precision=PREC)
        out += tl.where(owns, X, 0.0)
    out = tl.where(m_t[:, None], out, 0.0)
    m_out = m_in[:, None] & m_v[None, :]
    tl.store(o_ptr + p_rv, out.to(o_ptr.dtype.element_ty), mask=m_out & is_q[:, None])
    tl.store(du_ptr + p_rv, out.to(du_ptr.dtype.element_ty), mask=m_out & ~is_q[:, None])


@triton.jit
def _verify_fused_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr, o_ptr, du_ptr, dg_ptr, dk_ptr,
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    scale, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    STORAGE: tl.constexpr, PREC: tl.constexpr,
):
    """verify in ONE launch (scalar gates), one program per (request, value head, V-tile): a single loop
    over the key dimension in KB-row blocks accumulates the state product Y S0 ([R, BV]) and the
    scores vs the buffer (Y Kbuf^T) and vs the drafts (Y Y^T) from the same blocks of keys and
    queries; after it, the decays, the ancestor mask, one forward substitution over the draft rows
    (rows as in the module docstring) and the outputs.  Nothing goes through memory between phases."""
    R: tl.constexpr = 2 * BD
    GROUP: tl.constexpr = HV // H
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    n, t, o_r, dr, is_q, m_in, m_t = _draft_rows(len_ptr, nd_ptr, i_b, D, BD)
    owns = tl.load(own_ptr + i_b) != 0
    o_c = tl.arange(0, R)
    o_m = tl.arange(0, BC)
    m_n = o_m < n
    # everything that does not wait for the loop, issued first
    p_rt = (i_b * D + dr) * HV + i_hv
    beta_r = tl.where(m_t & ~is_q, tl.load(beta_ptr + p_rt, mask=m_in & ~is_q, other=0.0).to(tl.float32), 0.0)
    m_cin = (o_c < BD) & (o_c < D)
    m_ct = (o_c < BD) & (o_c < t)
    par = tl.where(m_ct, tl.load(par_ptr + i_b * D + o_c, mask=m_cin, other=-1).to(tl.int32), -1)
    gd = tl.where(m_ct, tl.load(g_ptr + (i_b * D + o_c) * HV + i_hv, mask=m_cin, other=0.0).to(tl.float32), 0.0)
    gc = tl.load(cg_ptr + (i_b * C + o_m) * HV + i_hv, mask=o_m < C, other=0.0).to(tl.float32)
    p_rv = p_rt[:, None] * V + o_v[None, :]
    v_in = tl.load(v_ptr + p_rv, mask=(m_in & ~is_q & m_t)[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    # the loop: rows k_i (i < BD) and scale * q_i (BD + i) of the drafts, the buffer's keys, the state
    o_kb = tl.arange(0, KB)
    p_kq = ((i_b * D + dr) * H + i_h) * K
    p_ck = ((i_b * C + o_m) * H + i_h) * K
    m_own = m_in & ~is_q & (dr < tl.where((i_v == 0) & (i_hv % GROUP == 0), BD, 0))  # one program per (request,
    # q/k head) writes Drafts.k (padding drafts: zeros, from the masked loads)
    X = tl.zeros([R, BV], dtype=tl.float32)
    SB = tl.zeros([R, BC], dtype=tl.float32)
    SS = tl.zeros([R, R], dtype=tl.float32)
    for k0 in tl.range(0, K, KB, num_stages=NS):
        m_kb = (k0 + o_kb) < K
        if STORAGE:
            st = tl.load(state_ptr + (i_bhv * K + k0 + o_kb[:, None]) * V + o_v[None, :],
                         mask=m_kb[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        k_in = tl.load(k_ptr + p_kq[:, None] + k0 + o_kb[None, :], mask=(m_t & ~is_q)[:, None] & m_kb[None, :],
                       other=0.0)
        q_in = tl.load(q_ptr + p_kq[:, None] + k0 + o_kb[None, :], mask=(m_t & is_q)[:, None] & m_kb[None, :],
                       other=0.0)
        y = k_in.to(tl.float32) + q_in.to(tl.float32) * scale  # [R, KB]; padding rows are 0 (masked loads)
        kc = tl.load(ck_ptr + p_ck[:, None] + k0 + o_kb[None, :], mask=m_n[:, None] & m_kb[None, :],
                     other=0.0).to(tl.float32)  # [BC, KB]
        tl.store(dk_ptr + p_kq[:, None] + k0 + o_kb[None, :], k_in, mask=m_own[:, None] & m_kb[None, :])
        SB = tl.dot(y, tl.trans(kc), SB, input_precision=PREC)
        SS = tl.dot(y, tl.trans(y), SS, input_precision=PREC)
        if STORAGE:
            X = tl.dot(y, st, X, input_precision=PREC)
    anc, proper, is_self = _ancestors(par, dr, m_t, o_r, o_c, t)
    base = tl.sum(tl.where(o_m == n - 1, gc, 0.0), 0)  # the buffer tail's G (0 if empty)
    base = tl.where(n > 0, base, 0.0)
    Gr = tl.where(m_t, base + tl.sum(tl.where(anc, gd[None, :], 0.0), 1), 0.0)  # [R] G of each row's draft
    Gc = tl.sum(tl.where(is_self, Gr[:, None], 0.0), 0)  # the same over columns (key rows = drafts)
    SB = SB * tl.exp(tl.where(m_t[:, None] & m_n[None, :], Gr[:, None] - gc[None, :], float("-inf")))
    SS = SS * tl.exp(tl.where(anc, Gr[:, None] - Gc[None, :], float("-inf")))
    uc = tl.load(cu_ptr + ((i_b * C + o_m[:, None]) * HV + i_hv) * V + o_v[None, :],
                 mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
    # Z = [v; 0] + sgn (SB U_buf + exp(G) S0^T y), sgn = -1 on key rows
    Z = tl.dot(SB, uc, input_precision=PREC)
    if STORAGE:
        Z += tl.where(owns, X * tl.exp(Gr)[:, None], 0.0)  # a select: direct requests' storage never read
    Z = tl.where(is_q[:, None], Z, v_in - Z)
    # key rows: U_i = beta_i Z_i - sum_{j proper anc i} beta_i D_ij (k_i.k_j) U_j, in draft order
    A = tl.where(proper & ~is_q[:, None], beta_r[:, None] * SS, 0.0)
    UO = tl.where(is_q[:, None], 0.0, beta_r[:, None] * Z)
    for i in range(0, t):
        a_i = tl.sum(tl.where((o_r == i)[:, None], A, 0.0), 0)  # [R] row i of A (over columns)
        a_i = tl.sum(tl.where(is_self, a_i[None, :], 0.0), 1)  # ... as a column vector over the rows of UO
        upd = tl.sum(a_i[:, None] * UO, 0)
        UO = tl.where((o_r == i)[:, None], UO - upd[None, :], UO)
    # query rows: O_i = Z_i + sum_{j anc-or-self i} D_ij (q_i.k_j) U_j
    QQ = tl.where(is_q[:, None] & anc, SS, 0.0)
    UO = tl.where(is_q[:, None], Z + tl.dot(QQ, UO, input_precision=PREC), UO)
    UO = tl.where(m_t[:, None], UO, 0.0)
    m_out = m_in[:, None] & m_v[None, :]
    tl.store(o_ptr + p_rv, UO.to(o_ptr.dtype.element_ty), mask=m_out & is_q[:, None])
    tl.store(du_ptr + p_rv, UO.to(du_ptr.dtype.element_ty), mask=m_out & ~is_q[:, None])
    tl.store(dg_ptr + p_rt, Gr.to(dg_ptr.dtype.element_ty), mask=m_in & ~is_q & (o_r < tl.where(i_v == 0, R, 0)))


@triton.jit
def _accept_path(par_ptr, node_ptr, len_ptr, i_b, D, C: tl.constexpr, BD: tl.constexpr):
    """The accepted node's root-to-node path (walked up ``parents`` in registers) and the overflow rule:
    returns (n, node, on_path [BD], pos [BD] index along the path, m, fold, nf = path entries folded)."""
    node = tl.load(node_ptr + i_b).to(tl.int32)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    o_d = tl.arange(0, BD)
    par = tl.load(par_ptr + i_b * D + o_d, mask=o_d < D, other=-1).to(tl.int32)
    on_path = o_d < 0
    cur = node
    for _ in range(0, node + 1):
        hit = o_d == cur
        on_path = on_path | hit
        cur = tl.where(cur >= 0, tl.sum(tl.where(hit, par, 0), 0), -1)
    pos = tl.sum(tl.where((o_d[None, :] < o_d[:, None]) & on_path[None, :], 1, 0), 1)
    m = tl.sum(on_path.to(tl.int32), 0)
    fold = n + m > C  # kvbuffer_ref.entries.fold_count: all old entries + the oldest max(0, m - C) new
    nf = tl.where(fold, tl.maximum(m - C, 0), 0)
    return n, node, on_path, pos, m, fold, nf


@triton.jit
def _accept_fold_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """Phase 1 of accept, only for requests past the capacity (the others return at once): fold the n
    old entries and the oldest nf path entries into this [K, BV] state tile,
    S = diag(exp(G_end)) S0 + sum_j exp(G_end - G_j) k_j u_j^T (rank-1 updates, as decode's fold)."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    n, node, on_path, pos, m, fold, nf = _accept_path(par_ptr, node_ptr, len_ptr, i_b, D, C, BD)
    if fold:
        owns = tl.load(own_ptr + i_b) != 0
        o_d = tl.arange(0, BD)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
        s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        s = tl.where(owns, s, 0.0)  # direct mode: S0 = 0 (the storage row is garbage)
        last = tl.maximum(n - 1, 0)
        j_end = tl.sum(tl.where(on_path & (pos == nf - 1), o_d, 0), 0)  # the last folded path entry, if any
        if CHANNEL:
            g_old = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + o_k, mask=o_k < tl.where(n > 0, K, 0),
                            other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + ((i_b * D + j_end) * HV + i_hv) * K + o_k, mask=o_k < tl.where(nf > 0, K, 0),
                            other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)  # [BK]
            s = s * tl.exp(g_end)[:, None]
        else:
            g_old = tl.load(cg_ptr + (i_b * C + last) * HV + i_hv, mask=n > 0, other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + (i_b * D + j_end) * HV + i_hv, mask=nf > 0, other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)
            s = s * tl.exp(g_end)
        s = _fold_rows(s, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, n, g_end, o_k, o_v, m_k, m_v,
                       C, H, HV, K, V, CHANNEL)
        for j in range(0, tl.where(nf > 0, node + 1, 0)):  # drafts <= node: real rows written by verify
            take = tl.sum(tl.where((o_d == j) & (pos < nf), on_path.to(tl.int32), 0), 0) > 0
            k_j = tl.load(dk_ptr + ((i_b * D + j) * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            u_j = tl.load(du_ptr + ((i_b * D + j) * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            if CHANNEL:
                G_j = tl.load(dg_ptr + ((i_b * D + j) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            else:
                G_j = tl.load(dg_ptr + (i_b * D + j) * HV + i_hv).to(tl.float32)
            w = tl.where(take, tl.exp(g_end - G_j), 0.0)
            s += (k_j * w)[:, None] * u_j[None, :]
        tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _accept_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """Phase 2 of accept (after any fold has read the old rows): append the kept path entries' u
    columns (every program), G (V-tile 0, rebased on the last folded entry) and keys (one program per
    q/k head); the request's last program (atomic ticket) advances lengths / has_state."""
    GROUP: tl.constexpr = HV // H
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    n, node, on_path, pos, m, fold, nf = _accept_path(par_ptr, node_ptr, len_ptr, i_b, D, C, BD)
    o_d = tl.arange(0, BD)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_keep = on_path & (pos >= nf)  # path entries that stay buffered ...
    dest = tl.where(fold, pos - nf, n + pos)  # ... at these rows
    p_dt = (i_b * D + o_d) * HV + i_hv
    ud = tl.load(du_ptr + p_dt[:, None] * V + o_v[None, :], mask=m_keep[:, None] & m_v[None, :], other=0.0)
    tl.store(cu_ptr + ((i_b * C + dest[:, None]) * HV + i_hv) * V + o_v[None, :],
             ud.to(cu_ptr.dtype.element_ty), mask=m_keep[:, None] & m_v[None, :])
    if i_v == 0:
        last = tl.maximum(n - 1, 0)
        j_end = tl.sum(tl.where(on_path & (pos == nf - 1), o_d, 0), 0)
        m_ko = o_k < tl.where(fold, K, 0)
        if CHANNEL:
            Gd = tl.load(dg_ptr + p_dt[:, None] * K + o_k[None, :], mask=m_keep[:, None] & m_k[None, :],
                         other=0.0).to(tl.float32)
            g_old = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + o_k,
                            mask=m_ko & (o_k < tl.where(n > 0, K, 0)), other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + ((i_b * D + j_end) * HV + i_hv) * K + o_k,
                            mask=m_ko & (o_k < tl.where(nf > 0, K, 0)), other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)  # 0 without a fold
            tl.store(cg_ptr + ((i_b * C + dest[:, None]) * HV + i_hv) * K + o_k[None, :],
                     (Gd - g_end[None, :]).to(cg_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
        else:
            Gd = tl.load(dg_ptr + p_dt, mask=m_keep, other=0.0).to(tl.float32)
            g_old = tl.load(cg_ptr + (i_b * C + last) * HV + i_hv, mask=tl.where(fold, n, 0) > 0,
                            other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + (i_b * D + j_end) * HV + i_hv, mask=nf > 0, other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)
            tl.store(cg_ptr + (i_b * C + dest) * HV + i_hv, (Gd - g_end).to(cg_ptr.dtype.element_ty), mask=m_keep)
        if i_hv % GROUP == 0:
            p_k = ((i_b * D + o_d[:, None]) * H + i_h) * K + o_k[None, :]
            k_new = tl.load(dk_ptr + p_k, mask=m_keep[:, None] & m_k[None, :], other=0.0)
            tl.store(ck_ptr + ((i_b * C + dest[:, None]) * H + i_h) * K + o_k[None, :],
                     k_new.to(ck_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
    # the request's last program writes what every program read: lengths and has_state
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == HV * NV - 1:
        if fold:
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
    variant: Optional[str] = None,
    KB: Optional[int] = None,
    NS: Optional[int] = None,
    prep_warps: Optional[int] = None,
    prep_precision: Optional[str] = None,
    zp: Optional[bool] = None,
    pdl: Optional[bool] = None,
    prep_group: Optional[bool] = None,
    prep_maxnreg: Optional[int] = None,
    prep_hoist: Optional[bool] = None,
    prep_mma: Optional[bool] = None,
    prep_solve: Optional[str] = None,
    early=None,
    xprec: Optional[str] = None,
) -> tuple[torch.Tensor, Drafts]:
    """Outputs of D draft tokens per request from the stale state plus the buffer, in ONE launch.

    q, k: [B, D, H, K]; v: [B, D, HV, V]; g: [B, D, HV]*; beta: [B, D, HV].  parents: [B, D] int
    (-1 = the buffer's tail; each parent before its child; default the chain -1, 0, ..., D-2);
    num_drafts: [B] int in 0..D (default D): ragged draft counts, padding rows get o = 0.  The defaults
    are made once per (B, D, device) and shared (the returned Drafts may hold them): do not modify them.
    Returns o [B, D, HV, V] (v's dtype, or written into ``out``) and ``Drafts`` in the u-cache form:
    u [B, D, HV, V] and G [B, D, HV]* (relative to the buffer's last flush) in the buffer's cache
    dtype, plus a copy of the keys.  Same results as ``kvbuffer_ref.verify``; the buffer is not
    modified and no per-draft state is ever formed.

    ``validate=False`` skips the checks that read device values (no host synchronisation).
    ``precision``: fp32 dot products on CUDA, 'tf32x3' (default) or 'ieee'; the interpreter uses 'ieee'.
    ``BV`` / ``num_warps`` / ``precision`` / ``variant`` ('stream': two launches, phase 2 streaming the
    state in KB-row blocks with NS pipeline stages; 'fused': one launch, scalar gates only, per-channel
    gates then take 'stream') / ``KB`` / ``NS`` (phase 2's state blocks: ints, or 'auto', the default, by
    batch: _blocks) /
    ``prep_warps`` / ``prep_precision`` / ``prep_maxnreg`` (a register cap) / ``prep_hoist`` (value
    heads' loads before the chunk loop) / ``prep_mma`` (16-bit MMA scores for bf16/fp16 inputs) /
    ``prep_solve`` ('rows' or 'doubling') (phase 1's) / ``early`` (phase 2 loads the draft values and
    u rows before its state loop: True, False or 'auto', the default: when it has at most 2048 programs) /
    ``xprec`` (phase 2's X S0 product: 'tf32x3' as ``precision``, or, for bf16 / fp16 q and k, which are
    exact in TF32, 'tf32x2' (the state split in two TF32 pieces) or, for bf16, 'bf16x3' (in three bf16
    pieces); 'auto' takes the fastest that applies)
    override the launch (``launch_config``; benchmarks tune them; docs/speculative.md).
    """
    d = check_tokens(q, k, v, g, beta)
    if parents is None:  # the chain; cached, so that a default call launches nothing but the kernels
        parents = _default_tensor("chain", d.B, d.T, q.device)
    if num_drafts is None:
        num_drafts = _default_tensor("count", d.B, d.T, q.device)
    if validate:
        check_buffer(buffer, d, q.device)
        parents = check_parents(parents, d.B, d.T, q.device)
        num_drafts = check_num_drafts(num_drafts, d.B, d.T, q.device)
    elif not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
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
    cfg = launch_config("verify", d.V, BV=BV, num_warps=num_warps, precision=precision, variant=variant, KB=KB,
                        NS=NS, prep_warps=prep_warps, prep_precision=prep_precision, zp=zp, pdl=pdl,
                        prep_group=prep_group, prep_maxnreg=prep_maxnreg, prep_hoist=prep_hoist,
                        prep_mma=prep_mma, prep_solve=prep_solve, early=early, xprec=xprec)
    doubling = _prep_solve(cfg) == "doubling"  # checked here: it applies to phase 1 per q/k head only
    if cfg["variant"] not in ("stream", "fused"):
        raise ValueError(f"variant: expected 'stream' or 'fused', got {cfg['variant']!r}")
    storage = buffer.state is not None
    BD = block(d.T, 8)
    R, BC = 2 * BD, block(buffer.capacity)
    prec = _precision(q, cfg["precision"])
    prep_prec = _precision(q, cfg.get("prep_precision") or cfg["precision"])
    fused = cfg["variant"] == "fused" and not d.channel_gate
    zp = bool(cfg.get("zp")) and not d.channel_gate
    xsplit = _xprec(cfg, q, k, zp and not fused)  # (checked here: the fused kernel forms Y S0 itself)
    programs = triton.cdiv(d.V, cfg["BV"]) * d.B * d.HV  # phase 2's (and the fused kernel's)
    early = _early(cfg, programs, xsplit)  # (checked here too: phase 2 only)
    KB, NS = _blocks(cfg, programs, xsplit, d.K, block(buffer.capacity))
    if fused:
        with device_guard(q):
            _verify_fused_kernel[(triton.cdiv(d.V, cfg["BV"]), d.B * d.HV)](
                as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), parents, num_drafts, o, du, dG, dk,
                buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
                buffer.state if storage else buffer.lengths,  # a dummy pointer when there is no state storage
                s, d.T, C=buffer.capacity, H=d.H, HV=d.HV, K=d.K, V=d.V, BD=BD, BC=BC,
                KB=KB, BV=cfg["BV"], NS=NS, STORAGE=storage, PREC=prec,
                num_warps=cfg["num_warps"])
        return o, drafts
    # phase 1's outputs for phase 2 (fp32): L and L W [B*HV, R, R + BC], P [B*HV, R, K] (ZP: L' [B*HV, R, R])
    pdl = pdl_launch(q, cfg)
    lw = torch.empty(d.B * d.HV, R, R + BC, dtype=torch.float32, device=q.device)
    pk = torch.empty(d.B * d.HV, R, R if zp else d.K, dtype=torch.float32, device=q.device)
    KC = block(d.K) // min(4, block(d.K) // 16)  # phase 1 walks the key dimension in (up to) 4 chunks
    # phase 1's register cap (prep_maxnreg; Triton's maxnreg): more of its one-warp programs per SM
    prep_cap = {"maxnreg": int(cfg["prep_maxnreg"])} if cfg.get("prep_maxnreg") else {}
    with device_guard(q):
        if zp and cfg.get("prep_group"):
            _verify_prep_group_kernel[(d.B * d.H,)](
                as_input(q), as_input(k), as_input(g), as_input(beta), parents, num_drafts, dG, dk,
                buffer.k, buffer.G, buffer.lengths, pk, lw,
                s, d.T,
                C=buffer.capacity, H=d.H, HV=d.HV, K=d.K, BD=BD, BC=BC, KC=KC,
                PREC=prep_prec, num_warps=cfg["prep_warps"], **prep_cap, **pdl,
                HOIST=bool(cfg.get("prep_hoist")), BG=triton.next_power_of_2(d.HV // d.H),
                MMA16=bool(cfg.get("prep_mma")) and q.dtype == k.dtype == buffer.k.dtype
                and q.dtype in (torch.bfloat16, torch.float16),
                DOUBLING=doubling, LOG_BD=BD.bit_length() - 1,
            )
        else:
            _verify_prep_kernel[(d.B * d.HV,)](
                as_input(q), as_input(k), as_input(g), as_input(beta), parents, num_drafts, dG, dk,
                buffer.k, buffer.G, buffer.lengths, pk, lw,
                s, d.T,
                C=buffer.capacity, H=d.H, HV=d.HV, K=d.K, BD=BD, BC=BC, KC=KC,
                CHANNEL=d.channel_gate, PREC=prep_prec, num_warps=cfg["prep_warps"], ZP=zp, **prep_cap, **pdl,
            )
        _verify_stream_kernel[(triton.cdiv(d.V, cfg["BV"]), d.B * d.HV)](
            as_input(v), num_drafts, o, du, buffer.u, buffer.lengths, flag_view(buffer.has_state),
            buffer.state if storage else buffer.lengths,  # a dummy pointer when there is no state storage
            pk, lw, d.T, C=buffer.capacity, HV=d.HV, K=d.K, V=d.V, BD=BD, BC=BC, BV=cfg["BV"],
            KB=KB, NS=NS, STORAGE=storage, PREC=prec,
            num_warps=cfg["num_warps"], ZP=zp, H=d.H, q_ptr=as_input(q), k_ptr=as_input(k), **pdl,
            EARLY=early, XPREC=xsplit, XP="tf32" if q.is_cuda else "ieee")
    return o, drafts


def _blocks(cfg: dict, programs: int, split: str, K: int, BC: int) -> tuple[int, int]:
    """Phase 2's state blocks: (KB rows, NS pipeline stages).  'auto' (the default for each): KB = 16 with
    NS = 4 for a split X S0 (xprec) when phase 2 has at most 2048 programs and the buffer at most 16 rows
    (BC; B = 64, C = 16 at Qwen3-Next heads: the whole verify 70.4 against 72.2-72.8 us in two runs of
    session 7; slower at B = 128 / 256, 125.2 / 237.6 against 122.2 / 224.7, and at B = 64 with C = 32,
    82.3 against 77.9), else KB = 32 with NS = 3.  KB is clipped to 16 .. block(K)."""
    small = bool(split) and programs <= 2048 and BC <= 16
    KB, NS = cfg.get("KB", "auto"), cfg.get("NS", "auto")
    KB = (16 if small else 32) if KB == "auto" else KB
    NS = (4 if small else 3) if NS == "auto" else NS
    for name, x in (("KB", KB), ("NS", NS)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name}: expected 'auto' or a positive int, got {x!r}")
    return max(16, min(KB, block(K))), NS


def _early(cfg: dict, programs: int, split: str) -> bool:
    """Phase 2 loads its draft values and u rows before its loop (True) or after it (False).  'auto' (the
    default): before it with a split X S0 (``split``, xprec: 128 registers either way on the H200, and
    faster at every batch: 72.7 / 121.6 / 225.3 / 425.7 against 74.7 / 128.3 / 237.5 / 453.3 us at
    B = 64 / 128 / 256 / 512 with tf32x2, session 7); with tf32x3 when phase 2 has at most 2048 programs
    (B = 64 at Qwen3-Next heads), where it was faster (74.5-74.8 against 77.0-77.2 us; slower at B = 128
    and 256, where it takes 182 registers: session 6's probes)."""
    early = cfg.get("early", "auto")
    if early == "auto":
        return bool(split) or programs <= 2048
    if not isinstance(early, bool):
        raise ValueError(f"early: expected True, False or 'auto', got {early!r}")
    return early


#: xprec="auto": phase 2's split X S0 product per input dtype of q and k (others take ``precision``).
#: tf32x2 was the fastest on the H200 at every batch (session 7, bf16 inputs, D = 5, with the early loads):
#: 72.2-72.7 / 121.6 / 225.3 / 425.7 us at B = 64 / 128 / 256 / 512 against 73.7-74.2 / 131.7-132.0 / 245.8
#: / 467.0 for tf32x3 and 72.8-73.8 / 125.9-126.2 / 235.6 / 446.9 for bf16x3 (bench/results/h200_probe/session7/)
XPREC_AUTO = {torch.bfloat16: "tf32x2", torch.float16: "tf32x2"}


def _xprec(cfg: dict, q: torch.Tensor, k: torch.Tensor, zp: bool) -> str:
    """Phase 2's X S0 product: "" (``precision``), "tf32x2" or "bf16x3" (_split_dot).  The splits need the
    raw rows X exact in the pieces' format: q and k both bf16 ("bf16x3", "tf32x2") or both fp16
    ("tf32x2"), and phase 2 forming X S0 (zp, scalar gates).  'auto' takes XPREC_AUTO where that holds
    and ``precision`` is not 'ieee'; an explicit split where it does not hold is a ValueError."""
    x = cfg.get("xprec") or "auto"
    if x not in ("auto", "tf32x3", "tf32x2", "bf16x3"):
        raise ValueError(f"xprec: expected 'auto', 'tf32x3', 'tf32x2' or 'bf16x3', got {x!r}")
    same = q.dtype == k.dtype
    if x == "auto":  # (precision='ieee' asks for FMA products: no TF32 pieces then)
        return XPREC_AUTO.get(q.dtype, "") if (same and zp and cfg.get("precision") != "ieee") else ""
    if x == "tf32x3":
        return ""
    ok = {"tf32x2": (torch.bfloat16, torch.float16), "bf16x3": (torch.bfloat16,)}[x]
    if not (same and q.dtype in ok):
        raise ValueError(f"xprec={x!r} needs q and k both in {[str(t).replace('torch.', '') for t in ok]} (exact "
                         f"in its pieces), got q {q.dtype} and k {k.dtype}; use 'auto' or 'tf32x3'")
    if not zp:
        raise ValueError(f"xprec={x!r} applies to phase 2's X S0 product (zp=True, scalar gates); this call "
                         f"forms P S0 (zp=False or per-channel gates); use 'auto' or 'tf32x3'")
    return x


def _prep_solve(cfg: dict) -> str:
    """Phase 1's triangular solve: 'rows' (forward substitution, the default) or 'doubling'."""
    solve = cfg.get("prep_solve") or "rows"
    if solve not in ("rows", "doubling"):
        raise ValueError(f"prep_solve: expected 'rows' or 'doubling', got {solve!r}")
    return solve


_DEFAULTS: dict = {}


def _default_tensor(kind: str, B: int, D: int, device) -> torch.Tensor:
    """The default parents (the chain -1, 0, ..., D-2 per request) or num_drafts (D per request), made once
    per (B, D, device) and then reused: without it a default call ran three small torch kernels (and
    their launch gaps) before verify's own.  The returned Drafts may hold it: treat it as read-only."""
    key = (kind, B, D, str(torch.device(device)))
    t = _DEFAULTS.get(key)
    if t is None:
        if kind == "chain":
            t = torch.arange(-1, D - 1, device=device, dtype=torch.long).expand(B, D).contiguous()
        else:
            t = torch.full((B,), D, dtype=torch.long, device=device)
        _DEFAULTS[key] = t
    return t


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
    _precision(buffer.k, cfg["precision"])  # validated; the fold is rank-1 updates in fp32 (no dot)
    storage = buffer.state is not None
    H, HV, K, V = buffer.num_heads, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim
    NV = triton.cdiv(V, cfg["BV"])
    args = (as_input(drafts.k), as_input(drafts.u), as_input(drafts.G), as_input(drafts.parents), nodes, D)
    consts = dict(C=C, H=H, HV=HV, K=K, V=V, BD=block(D), BK=block(K), CHANNEL=buffer.channel_gate)
    fcfg = launch_config("accept_fold", V)
    with device_guard(buffer.k):
        if storage:  # requests past the capacity fold first (the others' programs return at once)
            _accept_fold_kernel[(triton.cdiv(V, fcfg["BV"]), B * HV)](
                buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state, *args,
                BV=fcfg["BV"], num_warps=fcfg["num_warps"], **consts)
        _accept_kernel[(NV, B * HV)](buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
                                     ticket_counters(B, dev), *args, BV=cfg["BV"], NV=NV, num_warps=cfg["num_warps"],
                                     **consts)
    return buffer
