"""accept: commit the accepted drafts of each request IN PLACE, appending their cached (k, u, G).

Two launches.  Each program walks the accepted node's root-to-node path up ``parents`` in registers (m
entries); nothing is recomputed.

1. The fold, grid (V / BV, B * HV / FH) (a pool: a third axis over layers), only when the buffer has
   state storage: when n + m > C the reference's rule applies (``kvbuffer_ref.entries.fold_count``): all
   n old entries plus the oldest max(0, m - C) path entries are folded into the state, FH value heads
   per program, each [K, BV] tile in KB-row blocks through two fp32 tl.dot (old entries, path entries).
   A program whose request has n + D <= C (it cannot overflow) returns after one load, so a round that
   folds nothing costs little more than the launch.
2. The copy, grid (P, B) (a pool: (P, B, layers)), P programs per request (``programs_per_request``: the
   request's share of the config's ``programs``, at most its H q/k heads): program i_p owns q/k heads
   i_p, i_p + P, ..., and moves those heads' columns of the kept path entries (the key row; the u and G
   rows of their HV / H value heads, G rebased on the last folded entry) to the buffer rows they take: a
   head's rows all loaded, then (after one barrier) all stored.
   Where nothing moves (a pool's chain whose drafts verify wrote to the buffer rows themselves) nothing
   is read but the path.  One program advances ``lengths`` / ``has_state``: program 0 on a pool, whose
   claims kernel took a snapshot of the lengths before the launches, else the request's last program
   (atomic ticket; none for P = 1) once every program has read them.

A serving pool (``kvbuffer_fast.pool.KVPool.accept``) runs both launches through ``accept_pool`` on a
``PoolLayer`` (``_accept_fold_slots_kernel``, ``_accept_slots_kernel``): each call row on its slot's buffer
row and draft room and on the state slots the pool's bookkeeping gives it, over one layer or all at once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.checks import (check_accept_fold, check_count_arg, check_counts, check_nodes, check_num_drafts,
                                 check_parents, require_device, require_float, require_int_tensor, require_no_fold,
                                 require_rank, require_tensor)

from ._common import (PoolLayer, _drafts_in_buffer, _pdl_prologue, as_input, block, checked_buffer, device_guard,
                      flag_view, pdl_launch, require_no_overlap, ticket_counters)
from ._fold import fold_block
from .launch import AcceptConfig, check_config, config_for, key_of

__all__ = ["accept", "accept_pool", "programs_per_request", "launch_constants"]


def programs_per_request(cfg: AcceptConfig, requests: int, H: int) -> int:
    """P, the programs of the accept launch per request (``requests`` = call rows x layers): the request's
    share of ``cfg.programs``, at least 1, at most its H q/k heads (the unit a program owns)."""
    return max(1, min(H, triton.cdiv(cfg.programs, max(1, requests))))


def launch_constants(cfg: AcceptConfig, *, C: int, H: int, HV: int, K: int, V: int, D: int, channel: bool
                     ) -> tuple[dict, dict]:
    """The tile constexprs of the fold launch and of the copy launch for ``cfg`` at these shapes."""
    common = dict(C=C, H=H, HV=HV, K=K, V=V, BD=block(D), CHANNEL=channel)
    fold = dict(common, CB=block(C), KB=max(16, min(cfg.KB, block(K))), BV=max(16, min(cfg.BV, block(V))),
                FH=math.gcd(HV, cfg.FH), NS=cfg.NS)
    copy = dict(common, CU=min(cfg.CH, block(HV // H * V)), CK=min(cfg.CH, block(K)),
                GB=block(HV // H * (K if channel else 1)))
    return fold, copy


@triton.jit
def _accept_path(par_ptr, node_ptr, i_b, c_b, n, D, C: tl.constexpr, BD: tl.constexpr, COUNTS: tl.constexpr):
    """The accepted node's root-to-node path (walked up ``parents`` in registers) and the overflow rule for a
    request with n buffered entries: returns (on_path [BD], pos [BD] index along the path, m, fold, nf =
    path entries folded).  The node is call row i_b's (COUNTS: ``node_ptr`` holds accepted counts of a
    chain, node = count - 1), the parents draft row c_b's (i_b outside a pool)."""
    node = tl.load(node_ptr + i_b).to(tl.int32)
    if COUNTS:
        node = node - 1
    o_d = tl.arange(0, BD)
    par = tl.load(par_ptr + c_b * D + o_d, mask=o_d < D, other=-1).to(tl.int32)
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
    return on_path, pos, m, fold, nf


@triton.jit
def _pool_layer(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, NR, SR, D,
                C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                CHANNEL: tl.constexpr):
    """The pool tensors' pointers moved to layer ``program_id(2)`` (NR buffer rows, SR state rows and D draft
    rows per layer, the sinks included; int64 offsets)."""
    GK: tl.constexpr = K if CHANNEL else 1
    i_l = tl.program_id(2).to(tl.int64)
    nr = i_l * NR
    return (ck_ptr + nr * C * H * K, cu_ptr + nr * C * HV * V, cg_ptr + nr * C * HV * GK, len_ptr + nr,
            own_ptr + nr, state_ptr + i_l * SR * HV * K * V, dk_ptr + nr * D * H * K, du_ptr + nr * D * HV * V,
            dg_ptr + nr * D * HV * GK, par_ptr + nr * D, i_l)


@triton.jit
def _fold_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
                  i_v, i_b, hv0, c_b, s_r, s_w,
                  C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BD: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, FH: tl.constexpr,
                  NS: tl.constexpr, CHANNEL: tl.constexpr, COUNTS: tl.constexpr):
    """The fold launch's program for value heads hv0..hv0+FH-1, V-tile i_v, of call row i_b on buffer and
    draft rows c_b: nothing unless the request overflows (one load decides it for a request with
    n + D <= C, which cannot), else, for each of its value heads, the [K, BV] state tile read from state
    row s_r, in KB-row blocks (NS pipeline stages), folded and written to s_w:
    S = diag(exp(G_end)) S0 + sum_j exp(G_end - G_j) k_j u_j^T over the n old entries (one tl.dot of
    [KB, CB] x [CB, BV]) and the oldest nf path entries (one of [KB, BD] x [BD, BV]), fp32 FMA; S0 = 0
    where the request owns no state."""
    n = tl.load(len_ptr + c_b).to(tl.int32)
    if n + D > C:
        on_path, pos, m, fold, nf = _accept_path(par_ptr, node_ptr, i_b, c_b, n, D, C, BD, COUNTS)
        if fold:
            owns = tl.load(own_ptr + c_b) != 0
            o_kb = tl.arange(0, KB)
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            rows = tl.arange(0, CB)
            m_c = rows < n  # every old entry is folded
            o_d = tl.arange(0, BD)
            take = on_path & (pos < nf)  # ... and the oldest nf path entries
            last = c_b * C + tl.maximum(n - 1, 0)
            j_end = c_b * D + tl.sum(tl.where(on_path & (pos == nf - 1), o_d, 0), 0)  # the last folded path entry
            for hh in range(FH):
                i_hv = hv0 + hh
                i_h = i_hv // (HV // H)
                uf = tl.load(cu_ptr + ((c_b * C + rows[:, None]) * HV + i_hv) * V + o_v[None, :],
                             mask=m_c[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [CB, BV]
                ud = tl.load(du_ptr + ((c_b * D + o_d[:, None]) * HV + i_hv) * V + o_v[None, :],
                             mask=take[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BD, BV]
                if not CHANNEL:
                    g_old = tl.load(cg_ptr + last * HV + i_hv, mask=n > 0, other=0.0).to(tl.float32)
                    g_new = tl.load(dg_ptr + j_end * HV + i_hv, mask=nf > 0, other=0.0).to(tl.float32)
                    g_end = tl.where(nf > 0, g_new, g_old)
                    gj = tl.load(cg_ptr + (c_b * C + rows) * HV + i_hv, mask=m_c, other=0.0).to(tl.float32)
                    wc = tl.where(m_c, tl.exp(g_end - gj), 0.0)
                    gd = tl.load(dg_ptr + (c_b * D + o_d) * HV + i_hv, mask=take, other=0.0).to(tl.float32)
                    wd = tl.where(take, tl.exp(g_end - gd), 0.0)
                for k0 in tl.range(0, K, KB, num_stages=NS):
                    o_k = k0 + o_kb
                    m_k = o_k < K
                    st = tl.load(state_ptr + ((s_r * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :],
                                 mask=(o_k < tl.where(owns, K, 0))[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                    st = tl.where(owns, st, 0.0)  # direct mode: S0 = 0 (the storage row may hold anything)
                    kf = tl.load(ck_ptr + ((c_b * C + rows[None, :]) * H + i_h) * K + o_k[:, None],
                                 mask=m_k[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [KB, CB]
                    kd = tl.load(dk_ptr + ((c_b * D + o_d[None, :]) * H + i_h) * K + o_k[:, None],
                                 mask=m_k[:, None] & take[None, :], other=0.0).to(tl.float32)  # [KB, BD]
                    if CHANNEL:  # G_end over the block's rows; the old and the path entries' G (pointers)
                        ge_old = tl.load(cg_ptr + (last * HV + i_hv) * K + o_k, mask=o_k < tl.where(n > 0, K, 0),
                                         other=0.0).to(tl.float32)
                        ge_new = tl.load(dg_ptr + (j_end * HV + i_hv) * K + o_k, mask=o_k < tl.where(nf > 0, K, 0),
                                         other=0.0).to(tl.float32)
                        ge = tl.where(nf > 0, ge_new, ge_old)  # [KB]
                        gw_c = cg_ptr + ((c_b * C + rows[None, :]) * HV + i_hv) * K + o_k[:, None]
                        gw_d = dg_ptr + ((c_b * D + o_d[None, :]) * HV + i_hv) * K + o_k[:, None]
                    else:  # the scalar G_end and the entries' weights (above the block loop)
                        ge, gw_c, gw_d = g_end, wc, wd
                    # the n old entries, then the oldest nf path entries
                    st = fold_block(st, ge, m_k, kf, uf, gw_c, m_c, kd, ud, gw_d, take, CHANNEL, True, True)
                    tl.store(state_ptr + ((s_w * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :],
                             st.to(state_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _row_block(ptr, row, m_keep, W: tl.constexpr, c0, NC, CH: tl.constexpr):
    """Pointers and mask of the first min(NC, CH) columns from c0 of rows ``row`` [BD] where ``m_keep``:
    [BD, CH] (rows of W elements)."""
    o_c = tl.arange(0, CH)
    return ptr + row[:, None] * W + c0 + o_c[None, :], m_keep[:, None] & (o_c < NC)[None, :]


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src_row, dst_row, m_keep, W: tl.constexpr, c0, NC: tl.constexpr, CH: tl.constexpr):
    """Rows of W elements: columns c0..c0+NC of source rows ``src_row`` [BD] to destination rows ``dst_row``
    where ``m_keep``, in chunks of CH columns."""
    for c in tl.static_range(0, NC, CH):
        p_src, m = _row_block(src_ptr, src_row, m_keep, W, c0 + c, NC - c, CH)
        p_dst, _ = _row_block(dst_ptr, dst_row, m_keep, W, c0 + c, NC - c, CH)
        x = tl.load(p_src, mask=m, other=0.0)
        tl.debug_barrier()  # every source row read before any is overwritten (a tree's path moves down)
        tl.store(p_dst, x.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _copy_group(ck_ptr, cu_ptr, cg_ptr, dk_ptr, du_ptr, dg_ptr, D, c_b, n, on_path, pos, fold, nf, i_h,
                C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BD: tl.constexpr, CU: tl.constexpr, CK: tl.constexpr, GB: tl.constexpr, CHANNEL: tl.constexpr,
                INPLACE: tl.constexpr):
    """The kept path entries' columns of q/k head i_h's group (its key row; the u and G of its HV / H value
    heads) moved to the buffer rows they take, G rebased on G_end (read before a barrier: it may be an old
    row that is overwritten), after any fold of the group has read the old rows: no other program reads or
    writes these columns.  INPLACE (a pool): where the buffer row had room for all D drafts (n + D <= C)
    verify wrote them to its rows n.. (``kvbuffer_fast.verify._draft_dest``): only the path entries not yet
    at their row n + position move, within the buffer (none for a chain), and no such request folds.
    Nothing is read where no entry moves.  Chunks of CU u columns and CK key columns; GB >= the group's G
    columns.  Where the group's u and key columns fit one chunk each (ONE), every load of the group comes
    before one barrier and its stores: one memory latency per group; otherwise u and keys move chunk by
    chunk (``_copy_rows``), then G."""
    GROUP: tl.constexpr = HV // H
    GK: tl.constexpr = K if CHANNEL else 1
    GW: tl.constexpr = HV * GK
    ONE: tl.constexpr = (GROUP * V <= CU) and (K <= CK)
    o_d = tl.arange(0, BD)
    m_keep = on_path & (pos >= nf)  # path entries that stay buffered ...
    dst = c_b * C + tl.where(fold, pos - nf, n + pos)  # ... at these rows
    src = c_b * D + o_d
    su_ptr, sk_ptr, sg_ptr = du_ptr, dk_ptr, dg_ptr
    if INPLACE:
        if _drafts_in_buffer(n, D, C):  # the drafts are the buffer's rows n..n+D-1: move those off their row
            su_ptr, sk_ptr, sg_ptr = cu_ptr, ck_ptr, cg_ptr
            src = c_b * C + n + o_d
            m_keep = m_keep & (pos != o_d)
    if tl.sum(m_keep.to(tl.int32), 0) > 0:
        hv0 = i_h * GROUP
        if ONE:  # every u and key column in one chunk: all the group's loads, then (after one barrier) its stores
            p_su, m_u = _row_block(su_ptr, src, m_keep, HV * V, hv0 * V, GROUP * V, CU)
            p_sk, m_k = _row_block(sk_ptr, src, m_keep, H * K, i_h * K, K, CK)
            xu = tl.load(p_su, mask=m_u, other=0.0)
            xk = tl.load(p_sk, mask=m_k, other=0.0)
        else:
            _copy_rows(su_ptr, cu_ptr, src, dst, m_keep, HV * V, hv0 * V, GROUP * V, CU)
            _copy_rows(sk_ptr, ck_ptr, src, dst, m_keep, H * K, i_h * K, K, CK)
        last = c_b * C + tl.maximum(n - 1, 0)
        j_end = c_b * D + tl.sum(tl.where(on_path & (pos == nf - 1), o_d, 0), 0)  # last folded path entry
        o_g = tl.arange(0, GB)
        cols = hv0 * GK + o_g
        m_c = o_g < GROUP * GK
        g_old = tl.load(cg_ptr + last * GW + cols, mask=o_g < tl.where(fold & (n > 0), GROUP * GK, 0), other=0.0)
        g_new = tl.load(dg_ptr + j_end * GW + cols, mask=o_g < tl.where(nf > 0, GROUP * GK, 0), other=0.0)
        g_end = tl.where(nf > 0, g_new.to(tl.float32), g_old.to(tl.float32))  # 0 without a fold
        m_g = m_keep[:, None] & m_c[None, :]
        Gd = tl.load(sg_ptr + src[:, None] * GW + cols[None, :], mask=m_g, other=0.0).to(tl.float32)
        tl.debug_barrier()
        if ONE:
            p_du, _ = _row_block(cu_ptr, dst, m_keep, HV * V, hv0 * V, GROUP * V, CU)
            p_dk, _ = _row_block(ck_ptr, dst, m_keep, H * K, i_h * K, K, CK)
            tl.store(p_du, xu.to(cu_ptr.dtype.element_ty), mask=m_u)
            tl.store(p_dk, xk.to(ck_ptr.dtype.element_ty), mask=m_k)
        tl.store(cg_ptr + dst[:, None] * GW + cols[None, :], (Gd - g_end[None, :]).to(cg_ptr.dtype.element_ty),
                 mask=m_g)


@triton.jit
def _copy_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
                  i_p, i_b, c_b, n, C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BD: tl.constexpr, CU: tl.constexpr, CK: tl.constexpr, GB: tl.constexpr,
                  P: tl.constexpr, CHANNEL: tl.constexpr, COUNTS: tl.constexpr, INPLACE: tl.constexpr,
                  SNAP: tl.constexpr):
    """Program i_p of the copy launch's P programs for call row i_b (buffer and draft rows c_b, n entries as
    the call began), after the fold launch: the kept entries' columns of q/k heads i_p, i_p + P, ...
    (``_copy_group``).  The bookkeeping (``lengths``, ``has_state``) is written by program 0 when n came
    from a snapshot taken before the launch (SNAP: a pool's claims kernel), else by the request's last
    program (atomic ticket; none for P = 1) once every program has read ``lengths``."""
    on_path, pos, m, fold, nf = _accept_path(par_ptr, node_ptr, i_b, c_b, n, D, C, BD, COUNTS)
    for i_h in range(i_p, H, P):
        _copy_group(ck_ptr, cu_ptr, cg_ptr, dk_ptr, du_ptr, dg_ptr, D, c_b, n, on_path, pos, fold, nf, i_h,
                    C, H, HV, K, V, BD, CU, CK, GB, CHANNEL, INPLACE)
    is_last = i_p == 0
    if not SNAP:
        if P > 1:  # every program has read lengths before the last one writes it
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr + i_b, 1)
            is_last = ticket == P - 1
            if is_last:
                tl.store(ticket_ptr + i_b, 0)
    if is_last:
        if fold:
            tl.store(own_ptr + c_b, 1)
        tl.store(len_ptr + c_b, tl.where(fold, m - nf, n + m).to(len_ptr.dtype.element_ty))


@triton.jit
def _accept_fold_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, FH: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, COUNTS: tl.constexpr, PDL: tl.constexpr = False,
):
    """The fold launch on a buffer, grid (V / BV, B * HV / FH): request i_b's rows and state rows."""
    _pdl_prologue(PDL)
    i_v = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_b = i_g // (HV // FH)
    _fold_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
                  i_v, i_b, (i_g % (HV // FH)) * FH, i_b, i_b, i_b, C, H, HV, K, V, BD, CB, KB, BV, FH, NS, CHANNEL,
                  COUNTS)


@triton.jit
def _accept_fold_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    bslot_ptr, sread_ptr, swrite_ptr, NR, SR, B,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, FH: tl.constexpr, NS: tl.constexpr,
    CHANNEL: tl.constexpr, PDL: tl.constexpr = False,
):
    """The fold launch on a pool, grid (V / BV, B * HV / FH, layers): call row i_b (its node node[i_b]) on
    buffer row and draft room ``bslot[i_b]`` of layer ``program_id(2)``, the state read from slot
    ``sread[layer, i_b]`` (-1: none) and written to ``swrite[layer, i_b]`` ([layers, B]), int64 offsets; a
    pad (-1) does nothing."""
    _pdl_prologue(PDL)
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, i_l = _pool_layer(
        ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, NR, SR, D,
        C, H, HV, K, V, CHANNEL)
    i_v = tl.program_id(0)
    i_g = tl.program_id(1).to(tl.int64)
    i_b = i_g // (HV // FH)
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        s_r = tl.maximum(tl.load(sread_ptr + i_l * B + i_b).to(tl.int64), 0)
        s_w = tl.load(swrite_ptr + i_l * B + i_b).to(tl.int64)
        _fold_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr,
                      D, i_v, i_b, (i_g % (HV // FH)) * FH, c_b, s_r, s_w, C, H, HV, K, V, BD, CB, KB, BV, FH, NS,
                      CHANNEL, False)


@triton.jit
def _accept_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BD: tl.constexpr,
    CU: tl.constexpr, CK: tl.constexpr, GB: tl.constexpr, P: tl.constexpr, CHANNEL: tl.constexpr,
    COUNTS: tl.constexpr, PDL: tl.constexpr = False,
):
    """The copy launch on a buffer, grid (P, B): program i_p of request i_b (``_copy_program``)."""
    _pdl_prologue(PDL)
    i_b = tl.program_id(1).to(tl.int64)
    n = tl.load(len_ptr + i_b).to(tl.int32)
    _copy_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
                  tl.program_id(0), i_b, i_b, n, C, H, HV, K, V, BD, CU, CK, GB, P, CHANNEL, COUNTS, False, False)


@triton.jit
def _accept_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D, bslot_ptr, n_ptr, NR, B,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BD: tl.constexpr,
    CU: tl.constexpr, CK: tl.constexpr, GB: tl.constexpr, P: tl.constexpr, CHANNEL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The copy launch on a pool, grid (P, B, layers): call row i_b (its node ``node[i_b]``) on buffer row and
    draft room ``bslot[i_b]`` of layer ``program_id(2)``, with n entries (``n[layer, i_b]``, the claims
    kernel's snapshot); int64 offsets; a pad (-1) does nothing."""
    _pdl_prologue(PDL)
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, _, dk_ptr, du_ptr, dg_ptr, par_ptr, i_l = _pool_layer(
        ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, len_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, NR, 0, D,
        C, H, HV, K, V, CHANNEL)
    i_b = tl.program_id(1).to(tl.int64)
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        n = tl.load(n_ptr + i_l * B + i_b).to(tl.int32)
        _copy_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, len_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr,
                      D, tl.program_id(0), i_b, c_b, n, C, H, HV, K, V, BD, CU, CK, GB, P, CHANNEL, False, True, True)


def accept(
    buffer: KVBuffer,
    drafts: Drafts,
    *,
    counts=None,
    nodes=None,
    fold: bool = True,
    config: Optional[AcceptConfig] = None,
) -> KVBuffer:
    """Commit accepted drafts IN PLACE: append their cached (k, u, G); return the buffer.

    Exactly one of ``counts`` ([B] int or int: the first m drafts of a chain) or ``nodes`` ([B] int
    or int: the accepted node, -1 for none; its root-to-node path is appended).  ``buffer`` must be
    the one ``verify`` saw.  Past the capacity, the reference's rule folds all old entries plus the
    oldest max(0, m - C) accepted ones into the state and keeps the rest, G rebased; a buffer without
    state storage cannot fold (ValueError).  ``fold=False``: the caller's word that no request's n + m
    passes C (as after a ``verify(fold=...)`` that emptied the buffers that could), so the fold launch
    is not made (its B * HV / FH * V / BV programs would only read their request's length and return);
    ValueError where a request would pass C.  ``config``: the launch (a
    ``kvbuffer_fast.launch.AcceptConfig``; default: the launch table's).  The checks that read device
    values (the counts or nodes, the no-storage fold, ``fold=False``'s condition) are skipped while a
    CUDA graph is captured; a request that passes C there without its fold loses the entries the fold
    would have taken, as on a buffer without state storage.
    """
    check_accept_fold(fold)
    checked = checked_buffer(buffer, "accept")
    _check_drafts(buffer, drafts, checked)
    if (counts is None) == (nodes is None):
        raise ValueError("accept: give exactly one of counts= (chain drafts) or nodes= (tree drafts)")
    B, D = drafts.k.shape[:2]
    H, HV, K, V, C = buffer.num_heads, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim, buffer.capacity
    nodes, is_count = _accepted_nodes(counts, nodes, drafts, checked, buffer.k.device)
    if checked and (buffer.state is None or not fold):
        _require_room(buffer, drafts, nodes, is_count, fold)
    require_no_overlap({f"buffer.{n}": x for n, x in buffer.tensors().items()},
                       {**{f"drafts.{n}": x for n, x in drafts.tensors().items()}, "counts" if is_count else "nodes": nodes})
    if B == 0 or D == 0:
        return buffer
    if config is None:
        config = config_for("accept", key_of(buffer.k, C=C, B=B, HV=HV, V=V, channel=buffer.channel_gate))
    cfg = check_config("accept", config)
    P = programs_per_request(cfg, B, H)
    fold_k, copy_k = launch_constants(cfg, C=C, H=H, HV=HV, K=K, V=V, D=D, channel=buffer.channel_gate)
    args = (as_input(drafts.k), as_input(drafts.u), as_input(drafts.G), as_input(drafts.parents), nodes, D)
    pdl = pdl_launch(buffer.k, cfg.pdl)
    with device_guard(buffer.k):
        if buffer.state is not None and fold:  # requests past C fold first (the others' programs return at once)
            _accept_fold_kernel[(triton.cdiv(V, fold_k["BV"]), B * HV // fold_k["FH"])](
                buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state, *args,
                COUNTS=is_count, num_warps=cfg.num_warps, **fold_k, **pdl)
        _accept_kernel[(P, B)](buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
                               ticket_counters(B, buffer.k.device), *args, P=P, COUNTS=is_count,
                               num_warps=cfg.copy_warps, **copy_k, **pdl)
    return buffer


def accept_pool(pool: PoolLayer, *, nodes: torch.Tensor, read: torch.Tensor, write: torch.Tensor,
                lengths: torch.Tensor, layers: int = 1, fold: bool = True,
                config: Optional[AcceptConfig] = None) -> None:
    """``accept`` on a pool: ``layers`` consecutive layers from ``pool``'s (their tensors one layer apart,
    as a pool's slices of [layers, rows, ...] tensors are), each launch one grid axis over them; call row b
    on buffer row and draft room ``pool.slots[b]`` (-1: a pad, nothing read or written; int32 or int64,
    contiguous), int64 offsets:

    1. ``_accept_fold_slots_kernel``, grid (V / BV, B * HV / FH, layers): a row whose accepted path
       overflows the buffer folds the state of slot ``read[l, b]`` (-1: none, S0 = 0) into slot
       ``write[l, b]``;
    2. ``_accept_slots_kernel``, grid (P, B, layers): the kept path entries moved to the buffer rows they
       take (from the draft room, or within the buffer rows verify wrote them to), ``lengths`` /
       ``has_state`` advanced from ``lengths[l, b]``, the rows' lengths as the call began.

    nodes: [B] int64, the accepted node per row (pads -1); read, write, lengths: [layers, B] int64 (the
    pool's bookkeeping, ``KVPool._claims``, gives all four).  ``fold=False``: launch 1 is not made (the
    caller knows no row overflows).  ``config``: an AcceptConfig, None for the launch table's.  The caller
    checked the slots and the nodes."""
    buf, room = pool.buffer, pool.room
    B, D = pool.slots.shape[0], room.k.shape[1]
    C, H, HV, K, V = buf.capacity, buf.num_heads, buf.num_value_heads, buf.head_k_dim, buf.head_v_dim
    if B == 0 or D == 0:
        return
    channel = buf.channel_gate
    if config is None:
        config = config_for("accept", key_of(buf.k, C=C, B=B, HV=HV, V=V, channel=channel))
    cfg = check_config("accept", config)
    P = programs_per_request(cfg, layers * B, H)
    fold_k, copy_k = launch_constants(cfg, C=C, H=H, HV=HV, K=K, V=V, D=D, channel=channel)
    rows = (buf.k, buf.u, buf.G, buf.lengths, flag_view(buf.has_state))
    drafts = (room.k, room.u, room.G, room.parents, nodes, D)
    NR, SR = buf.k.shape[0], pool.state.shape[0]
    pdl = pdl_launch(pool.slots, cfg.pdl)
    with device_guard(pool.slots):
        if fold:
            _accept_fold_slots_kernel[(triton.cdiv(V, fold_k["BV"]), B * HV // fold_k["FH"], layers)](
                *rows, pool.state, *drafts, pool.slots, read, write, NR, SR, B, num_warps=cfg.num_warps, **fold_k,
                **pdl)
        _accept_slots_kernel[(P, B, layers)](*rows, *drafts, pool.slots, lengths, NR, B, P=P,
                                             num_warps=cfg.copy_warps, **copy_k, **pdl)


def _check_drafts(buffer: KVBuffer, drafts: Drafts, checked: bool = True) -> None:
    """``drafts`` are u-cache Drafts whose shapes, dtypes and device fit ``buffer``, with parents in
    -1..i-1 and num_drafts in 0..D (the kernels walk them; those values are checked when ``checked``)."""
    if not isinstance(drafts, Drafts):
        raise TypeError(f"drafts: expected the Drafts returned by verify, got {type(drafts).__name__}")
    if drafts.form != "u":
        raise NotImplementedError("drafts: kvbuffer_fast.accept takes u-cache drafts (from kvbuffer_fast.verify or "
                                  "kvbuffer_ref.verify on a u-form buffer); got raw-form drafts")
    for name in ("k", "u", "G"):
        x = require_tensor(f"drafts.{name}", getattr(drafts, name))
        require_float(f"drafts.{name}", x)
        require_device(f"drafts.{name}", x, buffer.k.device)
    require_rank("drafts.k", drafts.k, 4, "[B, D, H, K]")
    B, D = drafts.k.shape[:2]
    if checked:
        check_parents(drafts.parents, B, D, buffer.k.device, name="drafts.parents")
        check_num_drafts(drafts.num_drafts, B, D, buffer.k.device, name="drafts.num_drafts")
    else:
        require_int_tensor("drafts.parents", drafts.parents, (B, D), "[B, D]", buffer.k.device)
        require_int_tensor("drafts.num_drafts", drafts.num_drafts, (B,), "[B]", buffer.k.device)
    if drafts.k.shape[0] != buffer.batch or drafts.k.shape[2:] != buffer.k.shape[2:]:
        raise ValueError(f"drafts: keys of shape {list(drafts.k.shape)} do not fit the buffer's "
                         f"[B, C, H, K] = {list(buffer.k.shape)}")
    B, D = drafts.k.shape[:2]
    if tuple(drafts.u.shape) != (B, D) + tuple(buffer.u.shape[2:]) or \
            tuple(drafts.G.shape) != (B, D) + tuple(buffer.G.shape[2:]):
        raise ValueError(f"drafts: u {list(drafts.u.shape)} / G {list(drafts.G.shape)} do not fit the buffer's "
                         f"u {list(buffer.u.shape)} / G {list(buffer.G.shape)}")


def _accepted_nodes(counts, nodes, drafts: Drafts, checked: bool, device) -> tuple[torch.Tensor, bool]:
    """(x, is_count): the accepted counts of a chain (is_count; the kernel takes node = count - 1) or the
    accepted nodes (-1 for none), a [B] integer tensor as given (no conversion launch); range-checked
    when ``checked``."""
    if checked:
        if counts is not None:
            return check_counts(counts, drafts.num_drafts, drafts.is_chain).contiguous(), True
        return check_nodes(nodes, drafts.num_drafts).contiguous(), False
    name, x = ("counts", counts) if counts is not None else ("nodes", nodes)
    x = check_count_arg(name, x, drafts.k.shape[0], device, "0..num_drafts[b]" if counts is not None else
                        "-1..num_drafts[b]-1")
    return x.contiguous(), counts is not None


def _require_room(buffer: KVBuffer, drafts: Drafts, nodes: torch.Tensor, is_count: bool, fold: bool = True) -> None:
    """A buffer without state storage cannot fold, and ``fold=False`` makes no fold: every request's n + m
    must fit the capacity (host side; ``nodes`` as ``_accepted_nodes`` returns them)."""
    par = drafts.parents.tolist()
    for b, (n, node) in enumerate(zip(buffer.lengths.tolist(), (nodes - int(is_count)).tolist())):
        m = 0
        while node >= 0:
            m, node = m + 1, par[b][node]
        if not fold:
            require_no_fold(f"request {b}", n, m, buffer.capacity)
        if n + m > buffer.capacity:
            raise ValueError(
                f"buffer: request {b} has {n} entries and gets {m} more, past the capacity C={buffer.capacity}, "
                f"but the buffer has no state storage to fold into (buffer.state is None); call flush() first "
                f"(it allocates the state) or use a larger capacity")
