"""Speculative verification without per-draft states: verify (chains and trees) and accept, on the u-cache.

verify, one program per (request, q/k head): grid (B, H).  The program loads its head's buffered keys
[C, K] and the D drafts' keys and queries [D, K] once, forms every score it needs with one matrix
product each (drafts x buffer, drafts x drafts), builds the tree's ancestor matrix from ``parents``
(boolean powers of I + P, log2(D) squarings), then loops over the group's value heads:

    G_i  = G_parent(i) + g_i                      (the root's parent: G of the buffer's tail, 0 if empty)
    u_i  = beta_i (v_i - exp(G_i) S0^T k_i - sum_m D_im (k_i.k_m) u_m - sum_{j anc i} D_ij (k_i.k_j) u_j)
    o_i  = exp(G_i) S0^T q_i + sum_m D_im (q_i.k_m) u_m + sum_{j anc i or j = i} D_ij (q_i.k_j) u_j

with m over the request's n buffered entries and D_ij = exp(G_i - G_j).  The unit lower-triangular
system ``(I + A) U = diag(beta) rhs`` (A_ij = beta_i D_ij (k_i.k_j) over proper ancestors) is inverted
once per value head by forward substitution on the [D, D] matrix; then, per V-tile of BV columns,
ONE pass over the state tile gives ``S0^T k_i`` and ``S0^T q_i`` for every draft (two [D, K] x [K, BV]
products), and U, o follow from small products.  Nothing is written to the state and no state is
formed per draft: what is kept is the drafts' (k, u, G), D rows of the u-cache.  Requests in direct
mode (has_state False) mask their state loads entirely, so they read no state memory.

accept, grid (B, H): per request, the accepted node's root-to-node path (m entries, found by walking
``parents``) is appended to the buffer from the drafts' cached (k, u, G) (no recomputation).  When
n + m > C the reference's rule applies (``kvbuffer_ref.entries.fold_count``): all n old entries plus
the oldest max(0, m - C) path entries are folded into the state in the same program, the rest of the
path is stored from row 0 with G rebased.  The buffer is updated IN PLACE and returned.

Per-channel (KDA) gates are supported: the exp moves inside the dot products, computed row by row.
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

__all__ = ["verify", "accept", "MAX_DRAFTS"]

#: The largest draft count per request one launch handles (the [D, D] solve lives in registers).
MAX_DRAFTS = 64

# (BV, num_warps) per kernel; benchmarks override them (bench/gpu_verify.py).
_CONFIG = {"verify": dict(BV=32, num_warps=4), "accept": dict(BV=32, num_warps=4)}


def _launch(kernel: str, V: int, BV: Optional[int], num_warps: Optional[int]) -> dict:
    cfg = dict(_CONFIG[kernel])
    if BV is not None:
        cfg["BV"] = BV
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    cfg["BV"] = max(16, min(cfg["BV"], block(V)))
    return cfg


def _precision(x: torch.Tensor, precision: Optional[str]) -> str:
    """fp32 dot precision: 'ieee' under the interpreter; on CUDA 'tf32x3' (three TF32 products, about
    fp32 accuracy, on the tensor cores) unless told otherwise."""
    if precision is None:
        return "tf32x3" if x.is_cuda else "ieee"
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"precision: expected None, 'ieee' or 'tf32x3', got {precision!r}")
    return precision if x.is_cuda else "ieee"


@triton.jit
def _row(x, o_r, i):
    """Row ``i`` of a 2-D block ``x`` whose rows are indexed by ``o_r`` (a [R] range)."""
    return tl.sum(tl.where((o_r == i)[:, None], x, 0.0), 0)


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, par_ptr, nd_ptr,
    o_ptr, du_ptr, dg_ptr, dk_ptr,
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    scale, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, LOG_BD: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PREC: tl.constexpr,
):
    GROUP: tl.constexpr = HV // H
    i_v = tl.program_id(0)
    i_bhv = tl.program_id(1).to(tl.int64)
    i_b = i_bhv // HV
    i_hv = i_bhv % HV
    i_h = i_hv // GROUP
    n = tl.load(len_ptr + i_b).to(tl.int32)
    t = tl.load(nd_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    o_c = tl.arange(0, BC)
    o_d = tl.arange(0, BD)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_n = o_c < n
    m_t = o_d < t
    m_rows = o_d < D  # rows that exist in the [B, D, ...] tensors (padding rows get zeros)
    m_nk = m_n[:, None] & m_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    m_own = o_k < tl.where(owns, K, 0)  # state rows to read: none in direct mode
    if STORAGE:  # the state tile, read once, issued first so that its latency hides behind the scores
        s = tl.load(state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :],
                    mask=m_own[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    kc = tl.load(ck_ptr + ((i_b * C + o_c[:, None]) * H + i_h) * K + o_k[None, :], mask=m_nk, other=0.0)
    kc = kc.to(tl.float32)  # [BC, BK] buffered keys of this head
    p_dk = ((i_b * D + o_d[:, None]) * H + i_h) * K + o_k[None, :]
    kd_in = tl.load(k_ptr + p_dk, mask=m_tk, other=0.0)
    if (i_v == 0) & (i_hv % GROUP == 0):  # one program per (request, q/k head) keeps the drafts' keys
        tl.store(dk_ptr + p_dk, kd_in, mask=m_rows[:, None] & m_k[None, :])
    kd = kd_in.to(tl.float32)  # [BD, BK]
    qd = tl.load(q_ptr + p_dk, mask=m_tk, other=0.0).to(tl.float32) * scale
    p_dt = (i_b * D + o_d) * HV + i_hv  # [BD] row offsets of per-(draft, value head) tensors
    p_dv = p_dt[:, None] * V + o_v[None, :]
    vd = tl.load(v_ptr + p_dv, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    uc = tl.load(cu_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :],
                 mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BC, BV]
    b_beta = tl.load(beta_ptr + p_dt, mask=m_t, other=0.0).to(tl.float32)
    # ancestor-or-self matrix R[i, j] (j on the root-to-i path): nonzero pattern of (I + P)^(2^LOG_BD)
    par = tl.load(par_ptr + i_b * D + o_d, mask=m_t, other=-1).to(tl.int32)
    eye = (o_d[:, None] == o_d[None, :]).to(tl.float32)
    R = eye + ((par[:, None] == o_d[None, :]) & m_t[:, None]).to(tl.float32)
    for _ in tl.static_range(LOG_BD):
        R = tl.minimum(tl.dot(R, R, input_precision="ieee"), 1.0)
    anc_self = (R > 0.5) & m_t[:, None]
    anc = anc_self & (o_d[:, None] != o_d[None, :])
    if CHANNEL:
        gc = tl.load(cg_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_nk,
                     other=0.0).to(tl.float32)  # [BC, BK]
        base = _row(gc, o_c, n - 1)  # [BK], zeros for an empty buffer
        gd = tl.load(g_ptr + p_dt[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        Gd = tl.zeros([BD, BK], dtype=tl.float32)
        for i in range(0, t):  # topological order: a parent's G is final before its children
            p_i = tl.load(par_ptr + i_b * D + i).to(tl.int32)
            g_par = tl.where(p_i < 0, base, _row(Gd, o_d, p_i))
            Gd = tl.where((o_d == i)[:, None], (g_par + _row(gd, o_d, i))[None, :], Gd)
        wk = tl.zeros([BD, BC], dtype=tl.float32)
        wq = tl.zeros([BD, BC], dtype=tl.float32)
        kk = tl.zeros([BD, BD], dtype=tl.float32)
        qq = tl.zeros([BD, BD], dtype=tl.float32)
        for i in range(0, t):
            sel = (o_d == i)[:, None]
            G_i = _row(Gd, o_d, i)
            k_i = _row(kd, o_d, i)
            q_i = _row(qd, o_d, i)
            a_i = _row(anc_self.to(tl.float32), o_d, i) > 0.5  # [BD] ancestors-or-self of i
            dec = tl.exp(tl.where(m_nk, G_i[None, :] - gc, float("-inf")))  # [BC, BK]
            wk = tl.where(sel, tl.sum(kc * dec * k_i[None, :], 1)[None, :], wk)
            wq = tl.where(sel, tl.sum(kc * dec * q_i[None, :], 1)[None, :], wq)
            decd = tl.exp(tl.where(a_i[:, None] & m_k[None, :], G_i[None, :] - Gd, float("-inf")))  # [BD, BK]
            kk = tl.where(sel, tl.sum(kd * decd * k_i[None, :], 1)[None, :], kk)
            qq = tl.where(sel, tl.sum(kd * decd * q_i[None, :], 1)[None, :], qq)
        a = tl.where(anc, b_beta[:, None] * kk, 0.0)
        eG = tl.exp(Gd)
        kdS = kd * eG  # S0^T (exp(G_i) * k_i): the decay goes inside the state read
        qdS = qd * eG
    else:
        kkb = tl.dot(kd, tl.trans(kc), input_precision=PREC)  # [BD, BC]
        qkb = tl.dot(qd, tl.trans(kc), input_precision=PREC)
        kkd = tl.dot(kd, tl.trans(kd), input_precision=PREC)  # [BD, BD]
        qkd = tl.dot(qd, tl.trans(kd), input_precision=PREC)
        gc = tl.load(cg_ptr + (i_b * C + o_c) * HV + i_hv, mask=m_n, other=0.0).to(tl.float32)  # [BC]
        base = tl.sum(tl.where(o_c == n - 1, gc, 0.0), 0)
        gd = tl.load(g_ptr + p_dt, mask=m_t, other=0.0).to(tl.float32)
        Gd = base + tl.sum(tl.where(anc_self, gd[None, :], 0.0), 1)  # [BD] along each path
        dec = tl.exp(tl.where(m_t[:, None] & m_n[None, :], Gd[:, None] - gc[None, :], float("-inf")))
        wk = kkb * dec
        wq = qkb * dec
        decd = tl.exp(tl.where(anc_self, Gd[:, None] - Gd[None, :], float("-inf")))
        a = tl.where(anc, b_beta[:, None] * kkd * decd, 0.0)
        qq = qkd * decd
        eG = tl.exp(Gd)
        kdS = kd * eG[:, None]
        qdS = qd * eG[:, None]
    # (I + A)^-1 by forward substitution over the rows (rows >= t stay 0: padding)
    T_inv = tl.zeros([BD, BD], dtype=tl.float32)
    for i in range(0, t):
        a_i = _row(a, o_d, i)
        row = tl.where(o_d == i, 1.0, 0.0) - tl.sum(a_i[:, None] * T_inv, 0)
        T_inv = tl.where((o_d == i)[:, None], row[None, :], T_inv)
    rhs = vd - tl.dot(wk, uc, input_precision=PREC)
    out = tl.dot(wq, uc, input_precision=PREC)
    if STORAGE:  # one pass over the tile: S0^T k_i and S0^T q_i for every draft
        rhs -= tl.dot(kdS, s, input_precision=PREC)
        out += tl.dot(qdS, s, input_precision=PREC)
    U = tl.dot(T_inv, b_beta[:, None] * rhs, input_precision=PREC)
    out += tl.dot(qq, U, input_precision=PREC)
    m_out = m_rows[:, None] & m_v[None, :]
    tl.store(o_ptr + p_dv, tl.where(m_t[:, None], out, 0.0).to(o_ptr.dtype.element_ty), mask=m_out)
    tl.store(du_ptr + p_dv, U.to(du_ptr.dtype.element_ty), mask=m_out)
    if i_v == 0:
        if CHANNEL:
            tl.store(dg_ptr + p_dt[:, None] * K + o_k[None, :], tl.where(m_t[:, None], Gd, 0.0).to(
                dg_ptr.dtype.element_ty), mask=m_rows[:, None] & m_k[None, :])
        else:
            tl.store(dg_ptr + p_dt, tl.where(m_t, Gd, 0.0).to(dg_ptr.dtype.element_ty), mask=m_rows)


@triton.jit
def _accept_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, ticket_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHANNEL: tl.constexpr, STORAGE: tl.constexpr, PREC: tl.constexpr,
):
    GROUP: tl.constexpr = HV // H
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    node = tl.load(node_ptr + i_b).to(tl.int32)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    owns = tl.load(own_ptr + i_b) != 0
    o_c = tl.arange(0, BC)
    o_d = tl.arange(0, BD)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    # the root-to-node path: walk up from the node (parents precede children)
    on_path = tl.zeros([BD], dtype=tl.int32)
    cur = node
    for jj in range(0, node + 1):
        j = node - jj
        hit = j == cur
        on_path = tl.where((o_d == j) & hit, 1, on_path)
        cur = tl.where(hit, tl.load(par_ptr + i_b * D + j).to(tl.int32), cur)
    pos = tl.sum(tl.where(o_d[None, :] < o_d[:, None], on_path[None, :], 0), 1)  # [BD] index along the path
    m = tl.sum(on_path, 0)
    fold = n + m > C  # kvbuffer_ref.entries.fold_count: all old entries + the oldest max(0, m - C) new
    nf = tl.where(fold, tl.maximum(m - C, 0), 0)
    m_path = on_path != 0
    m_fd = m_path & (pos < nf)  # path entries folded into the state
    m_keep = m_path & (pos >= nf)  # path entries that stay buffered ...
    dest = tl.where(fold, pos - nf, n + pos)  # ... at these rows
    m_n = o_c < tl.where(fold, n, 0)  # old entries are read only to be folded
    m_nk = m_n[:, None] & m_k[None, :]
    m_pk = m_path[:, None] & m_k[None, :]
    m_own = o_k < tl.where(owns, K, 0)
    kc = tl.load(ck_ptr + ((i_b * C + o_c[:, None]) * H + i_h) * K + o_k[None, :], mask=m_nk, other=0.0).to(tl.float32)
    dk_in = tl.load(dk_ptr + ((i_b * D + o_d[:, None]) * H + i_h) * K + o_k[None, :], mask=m_pk, other=0.0)
    dk = dk_in.to(tl.float32)
    for r in tl.static_range(GROUP):
        i_hv = i_h * GROUP + r
        i_bhv = i_b * HV + i_hv
        p_dt = (i_b * D + o_d) * HV + i_hv
        if CHANNEL:
            Gd = tl.load(dg_ptr + p_dt[:, None] * K + o_k[None, :], mask=m_pk, other=0.0).to(tl.float32)
            gc = tl.load(cg_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_nk,
                         other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, tl.sum(tl.where((m_path & (pos == nf - 1))[:, None], Gd, 0.0), 0),
                             _row(gc, o_c, n - 1))  # [BK] G of the last folded entry
            g_end = tl.where(fold, g_end, 0.0)
            kcd = kc * tl.exp(tl.where(m_nk, g_end[None, :] - gc, float("-inf")))
            kdd = dk * tl.exp(tl.where(m_fd[:, None] & m_k[None, :], g_end[None, :] - Gd, float("-inf")))
            s_dec = tl.exp(g_end)[:, None]
        else:
            Gd = tl.load(dg_ptr + p_dt, mask=m_path, other=0.0).to(tl.float32)
            gc = tl.load(cg_ptr + (i_b * C + o_c) * HV + i_hv, mask=m_n, other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, tl.sum(tl.where(m_path & (pos == nf - 1), Gd, 0.0), 0),
                             tl.sum(tl.where(o_c == n - 1, gc, 0.0), 0))
            g_end = tl.where(fold, g_end, 0.0)
            kcd = kc * tl.exp(tl.where(m_n, g_end - gc, float("-inf")))[:, None]
            kdd = dk * tl.exp(tl.where(m_fd, g_end - Gd, float("-inf")))[:, None]
            s_dec = tl.exp(g_end)
        for iv in range(0, V, BV):
            o_v = iv + tl.arange(0, BV)
            m_v = o_v < V
            ud = tl.load(du_ptr + p_dt[:, None] * V + o_v[None, :], mask=m_path[:, None] & m_v[None, :], other=0.0)
            if STORAGE:
                if fold:
                    # S = diag(exp(G_end)) S0 + sum over folded entries exp(G_end - G_j) k_j u_j^T
                    p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
                    uc = tl.load(cu_ptr + ((i_b * C + o_c[:, None]) * HV + i_hv) * V + o_v[None, :],
                                 mask=m_n[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                    s = tl.load(p_s, mask=m_own[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                    s = s * s_dec + tl.dot(tl.trans(kcd), uc, input_precision=PREC)
                    s += tl.dot(tl.trans(kdd), ud.to(tl.float32), input_precision=PREC)
                    tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
            tl.debug_barrier()  # every warp has read the old rows before any is overwritten
            tl.store(cu_ptr + ((i_b * C + dest[:, None]) * HV + i_hv) * V + o_v[None, :],
                     ud.to(cu_ptr.dtype.element_ty), mask=m_keep[:, None] & m_v[None, :])
        tl.debug_barrier()
        if CHANNEL:
            tl.store(cg_ptr + ((i_b * C + dest[:, None]) * HV + i_hv) * K + o_k[None, :],
                     (Gd - g_end[None, :]).to(cg_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
        else:
            tl.store(cg_ptr + (i_b * C + dest) * HV + i_hv, (Gd - g_end).to(cg_ptr.dtype.element_ty), mask=m_keep)
    tl.debug_barrier()
    tl.store(ck_ptr + ((i_b * C + dest[:, None]) * H + i_h) * K + o_k[None, :], dk_in.to(ck_ptr.dtype.element_ty),
             mask=m_keep[:, None] & m_k[None, :])
    # the last program of request b writes its bookkeeping (every program has read it by now)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == H - 1:
        tl.store(len_ptr + i_b, tl.where(fold, m - nf, n + m).to(len_ptr.dtype.element_ty))
        if fold:
            tl.store(own_ptr + i_b, 1)
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
    BD = block(d.T)
    cfg = _launch("verify", d.V, BV, num_warps)
    storage = buffer.state is not None
    with device_guard(q):
        _verify_kernel[(triton.cdiv(d.V, cfg["BV"]), d.B * d.HV)](
            as_input(q), as_input(k), as_input(v), as_input(g), as_input(beta), parents, num_drafts,
            o, du, dG, dk,
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
            buffer.state if storage else buffer.lengths,  # a dummy pointer when there is no state storage
            s, d.T,
            C=buffer.capacity, H=d.H, HV=d.HV, K=d.K, V=d.V,
            BD=BD, LOG_BD=max(1, (BD - 1).bit_length()), BC=block(buffer.capacity), BK=block(d.K), BV=cfg["BV"],
            CHANNEL=d.channel_gate, STORAGE=storage, PREC=_precision(q, precision), num_warps=cfg["num_warps"],
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
    cfg = _launch("accept", buffer.head_v_dim, BV, num_warps)
    storage = buffer.state is not None
    H, HV, K, V = buffer.num_heads, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim
    with device_guard(buffer.k):
        _accept_kernel[(B, H)](
            buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
            buffer.state if storage else buffer.lengths, ticket_counters(B, dev),
            as_input(drafts.k), as_input(drafts.u), as_input(drafts.G), as_input(drafts.parents), nodes, D,
            C=C, H=H, HV=HV, K=K, V=V, BD=block(D), BC=block(C), BK=block(K), BV=cfg["BV"],
            CHANNEL=buffer.channel_gate, STORAGE=storage, PREC=_precision(buffer.k, precision),
            num_warps=cfg["num_warps"],
        )
    return buffer
