"""accept: commit the accepted drafts of each request IN PLACE, appending their cached (k, u, G).

Grid (V / BV, B * HV).  Per request the accepted node's root-to-node path (m entries, found by walking
``parents`` in registers) is appended from the drafts' cached (k, u, G): nothing is recomputed.  When
n + m > C the reference's rule applies (``kvbuffer_ref.entries.fold_count``): all n old entries plus the
oldest max(0, m - C) path entries are folded into the state first, by a separate launch whose programs
return at once for every other request (rank-1 updates, ``_fold.fold_rows``; kept apart so that its
registers do not slow the common case).  Then the copy: u columns (every program), G rows (V-tile 0,
rebased on the last folded entry) and keys (one program per q/k head); the request's last program
(atomic ticket) advances ``lengths`` / ``has_state``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvbuffer_ref.buffer import Drafts, KVBuffer
from kvbuffer_ref.checks import (check_count_arg, check_counts, check_nodes, check_num_drafts, check_parents,
                                 require_device, require_float, require_int_tensor, require_rank, require_tensor)

from ._common import (_program_ids, as_input, block, checked_buffer, device_guard, flag_view, ticket_counters)
from ._fold import fold_rows
from .launch import AcceptConfig, check_config, config_for, key_of

__all__ = ["accept"]


@triton.jit
def _accept_path(par_ptr, node_ptr, len_ptr, i_b, c_b, D, C: tl.constexpr, BD: tl.constexpr):
    """The accepted node's root-to-node path (walked up ``parents`` in registers) and the overflow rule:
    returns (n, node, on_path [BD], pos [BD] index along the path, m, fold, nf = path entries folded).
    The node is call row i_b's, the length and the parents buffer row c_b's (i_b outside a pool)."""
    node = tl.load(node_ptr + i_b).to(tl.int32)
    n = tl.load(len_ptr + c_b).to(tl.int32)
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
    _accept_fold_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr,
                         D, i_v, i_bhv, i_b, i_hv, i_h, i_b, i_b, i_b, C, H, HV, K, V, BD, BK, BV, CHANNEL, False)


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
def _accept_fold_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D, bslot_ptr, sread_ptr, swrite_ptr, NR, SR, B,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """``_accept_fold_kernel`` on a pool, grid (V / BV, B * HV, layers): call row i_b (its node node[i_b])
    on buffer row and draft room ``bslot[i_b]`` of layer ``program_id(2)``, the state read from slot
    ``sread[layer, i_b]`` (-1: none) and written to ``swrite[layer, i_b]`` ([layers, B]), int64 offsets; a
    pad (-1) does nothing."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, i_l = _pool_layer(
        ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, NR, SR, D,
        C, H, HV, K, V, CHANNEL)
    sread_ptr += i_l * B
    swrite_ptr += i_l * B
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        s_r = tl.maximum(tl.load(sread_ptr + i_b).to(tl.int64), 0)
        s_w = tl.load(swrite_ptr + i_b).to(tl.int64)
        _accept_fold_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr,
                             node_ptr, D, i_v, i_bhv, i_b, i_hv, i_h, c_b, s_r, s_w, C, H, HV, K, V, BD, BK, BV,
                             CHANNEL, True)


@triton.jit
def _accept_fold_program(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, state_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D, i_v, i_bhv, i_b, i_hv, i_h, c_b, s_r, s_w,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr, SLOTS: tl.constexpr,
):
    """The body of the accept fold kernels: call row i_b on buffer row (and draft rows) c_b; SLOTS: the
    state slots s_r (read) and s_w (written), else the program's own row i_bhv."""
    n, node, on_path, pos, m, fold, nf = _accept_path(par_ptr, node_ptr, len_ptr, i_b, c_b, D, C, BD)
    if fold:
        owns = tl.load(own_ptr + c_b) != 0
        o_d = tl.arange(0, BD)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        if SLOTS:  # the state slot read (none: nothing read) and the one written
            p_s = state_ptr + ((s_r * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
            s = tl.load(p_s, mask=(o_k < tl.where(owns, K, 0))[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            p_s = state_ptr + ((s_w * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
        else:
            p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
            s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        s = tl.where(owns, s, 0.0)  # direct mode: S0 = 0 (the storage row is garbage)
        last = tl.maximum(n - 1, 0)
        j_end = tl.sum(tl.where(on_path & (pos == nf - 1), o_d, 0), 0)  # the last folded path entry, if any
        if CHANNEL:
            g_old = tl.load(cg_ptr + ((c_b * C + last) * HV + i_hv) * K + o_k, mask=o_k < tl.where(n > 0, K, 0),
                            other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + ((c_b * D + j_end) * HV + i_hv) * K + o_k, mask=o_k < tl.where(nf > 0, K, 0),
                            other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)  # [BK]
            s = s * tl.exp(g_end)[:, None]
        else:
            g_old = tl.load(cg_ptr + (c_b * C + last) * HV + i_hv, mask=n > 0, other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + (c_b * D + j_end) * HV + i_hv, mask=nf > 0, other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)
            s = s * tl.exp(g_end)
        s = fold_rows(s, ck_ptr, cu_ptr, cg_ptr, c_b, i_h, i_hv, n, g_end, o_k, o_v, m_k, m_v,
                       C, H, HV, K, V, CHANNEL)
        for j in range(0, tl.where(nf > 0, node + 1, 0)):  # drafts <= node: real rows written by verify
            take = tl.sum(tl.where((o_d == j) & (pos < nf), on_path.to(tl.int32), 0), 0) > 0
            k_j = tl.load(dk_ptr + ((c_b * D + j) * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            u_j = tl.load(du_ptr + ((c_b * D + j) * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            if CHANNEL:
                G_j = tl.load(dg_ptr + ((c_b * D + j) * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            else:
                G_j = tl.load(dg_ptr + (c_b * D + j) * HV + i_hv).to(tl.float32)
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
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    _accept_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D,
                    i_v, i_b, i_hv, i_h, i_b, C, H, HV, K, V, BD, BK, BV, NV, CHANNEL)


@triton.jit
def _accept_slots_kernel(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D, bslot_ptr, NR, B,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """``_accept_kernel`` on a pool, grid (V / BV, B * HV, layers): call row i_b on buffer row and draft
    room ``bslot[i_b]`` of layer ``program_id(2)`` (int64 offsets; tickets [layers, B]); a pad (-1) does
    nothing."""
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, _, dk_ptr, du_ptr, dg_ptr, par_ptr, i_l = _pool_layer(
        ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, len_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr, NR, 0, D,
        C, H, HV, K, V, CHANNEL)
    ticket_ptr += i_l * B
    c_b = tl.load(bslot_ptr + i_b).to(tl.int64)
    if c_b >= 0:
        _accept_program(ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr, dk_ptr, du_ptr, dg_ptr, par_ptr,
                        node_ptr, D, i_v, i_b, i_hv, i_h, c_b, C, H, HV, K, V, BD, BK, BV, NV, CHANNEL)


@triton.jit
def _accept_program(
    ck_ptr, cu_ptr, cg_ptr, len_ptr, own_ptr, ticket_ptr,
    dk_ptr, du_ptr, dg_ptr, par_ptr, node_ptr, D, i_v, i_b, i_hv, i_h, c_b,
    C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, CHANNEL: tl.constexpr,
):
    """The body of the accept copy kernels: call row i_b (its node and ticket) on buffer row and draft
    rows c_b (i_b outside a pool)."""
    GROUP: tl.constexpr = HV // H
    n, node, on_path, pos, m, fold, nf = _accept_path(par_ptr, node_ptr, len_ptr, i_b, c_b, D, C, BD)
    o_d = tl.arange(0, BD)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_keep = on_path & (pos >= nf)  # path entries that stay buffered ...
    dest = tl.where(fold, pos - nf, n + pos)  # ... at these rows
    p_dt = (c_b * D + o_d) * HV + i_hv
    ud = tl.load(du_ptr + p_dt[:, None] * V + o_v[None, :], mask=m_keep[:, None] & m_v[None, :], other=0.0)
    tl.store(cu_ptr + ((c_b * C + dest[:, None]) * HV + i_hv) * V + o_v[None, :],
             ud.to(cu_ptr.dtype.element_ty), mask=m_keep[:, None] & m_v[None, :])
    if i_v == 0:
        last = tl.maximum(n - 1, 0)
        j_end = tl.sum(tl.where(on_path & (pos == nf - 1), o_d, 0), 0)
        m_ko = o_k < tl.where(fold, K, 0)
        if CHANNEL:
            Gd = tl.load(dg_ptr + p_dt[:, None] * K + o_k[None, :], mask=m_keep[:, None] & m_k[None, :],
                         other=0.0).to(tl.float32)
            g_old = tl.load(cg_ptr + ((c_b * C + last) * HV + i_hv) * K + o_k,
                            mask=m_ko & (o_k < tl.where(n > 0, K, 0)), other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + ((c_b * D + j_end) * HV + i_hv) * K + o_k,
                            mask=m_ko & (o_k < tl.where(nf > 0, K, 0)), other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)  # 0 without a fold
            tl.store(cg_ptr + ((c_b * C + dest[:, None]) * HV + i_hv) * K + o_k[None, :],
                     (Gd - g_end[None, :]).to(cg_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
        else:
            Gd = tl.load(dg_ptr + p_dt, mask=m_keep, other=0.0).to(tl.float32)
            g_old = tl.load(cg_ptr + (c_b * C + last) * HV + i_hv, mask=tl.where(fold, n, 0) > 0,
                            other=0.0).to(tl.float32)
            g_new = tl.load(dg_ptr + (c_b * D + j_end) * HV + i_hv, mask=nf > 0, other=0.0).to(tl.float32)
            g_end = tl.where(nf > 0, g_new, g_old)
            tl.store(cg_ptr + (c_b * C + dest) * HV + i_hv, (Gd - g_end).to(cg_ptr.dtype.element_ty), mask=m_keep)
        if i_hv % GROUP == 0:
            p_k = ((c_b * D + o_d[:, None]) * H + i_h) * K + o_k[None, :]
            k_new = tl.load(dk_ptr + p_k, mask=m_keep[:, None] & m_k[None, :], other=0.0)
            tl.store(ck_ptr + ((c_b * C + dest[:, None]) * H + i_h) * K + o_k[None, :],
                     k_new.to(ck_ptr.dtype.element_ty), mask=m_keep[:, None] & m_k[None, :])
    # the request's last program writes what every program read: lengths and has_state
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    if ticket == HV * NV - 1:
        if fold:
            tl.store(own_ptr + c_b, 1)
        tl.store(len_ptr + c_b, tl.where(fold, m - nf, n + m).to(len_ptr.dtype.element_ty))
        tl.store(ticket_ptr + i_b, 0)




def accept(
    buffer: KVBuffer,
    drafts: Drafts,
    *,
    counts=None,
    nodes=None,
    config: Optional[AcceptConfig] = None,
) -> KVBuffer:
    """Commit accepted drafts IN PLACE: append their cached (k, u, G); return the buffer.

    Exactly one of ``counts`` ([B] int or int: the first m drafts of a chain) or ``nodes`` ([B] int
    or int: the accepted node, -1 for none; its root-to-node path is appended).  ``buffer`` must be
    the one ``verify`` saw.  Past the capacity, the reference's rule folds all old entries plus the
    oldest max(0, m - C) accepted ones into the state and keeps the rest, G rebased; a buffer without
    state storage cannot fold (ValueError).  ``config``: the launch (a
    ``kvbuffer_fast.launch.AcceptConfig``; default: the launch table's).  The checks that read device
    values (the counts or nodes, the no-storage fold) are skipped while a CUDA graph is captured.
    """
    checked = checked_buffer(buffer, "accept")
    _check_drafts(buffer, drafts, checked)
    if (counts is None) == (nodes is None):
        raise ValueError("accept: give exactly one of counts= (chain drafts) or nodes= (tree drafts)")
    B, D = drafts.k.shape[:2]
    H, HV, K, V, C = buffer.num_heads, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim, buffer.capacity
    nodes = _accepted_nodes(counts, nodes, drafts, checked, buffer.k.device)
    if checked and buffer.state is None:
        _require_room(buffer, drafts, nodes)
    if B == 0 or D == 0:
        return buffer
    if config is None:
        config = config_for("accept", key_of(buffer.k, C=C, B=B, HV=HV, V=V, channel=buffer.channel_gate))
    cfg = check_config("accept", config)
    BV, fold_BV = (max(16, min(x, block(V))) for x in (cfg.BV, cfg.fold_BV))
    NV = triton.cdiv(V, BV)
    args = (as_input(drafts.k), as_input(drafts.u), as_input(drafts.G), as_input(drafts.parents), nodes, D)
    consts = dict(C=C, H=H, HV=HV, K=K, V=V, BD=block(D), BK=block(K), CHANNEL=buffer.channel_gate)
    with device_guard(buffer.k):
        if buffer.state is not None:  # requests past the capacity fold first (the others' programs return at once)
            _accept_fold_kernel[(triton.cdiv(V, fold_BV), B * HV)](
                buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state), buffer.state, *args,
                BV=fold_BV, num_warps=cfg.fold_warps, **consts)
        _accept_kernel[(NV, B * HV)](buffer.k, buffer.u, buffer.G, buffer.lengths, flag_view(buffer.has_state),
                                     ticket_counters(B, buffer.k.device), *args, BV=BV, NV=NV,
                                     num_warps=cfg.num_warps, **consts)
    return buffer


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


def _accepted_nodes(counts, nodes, drafts: Drafts, checked: bool, device) -> torch.Tensor:
    """The accepted node per request ([B] int64, -1 for none) from ``counts`` (node = count - 1) or
    ``nodes``; range-checked when ``checked``."""
    if checked:
        if counts is not None:
            return (check_counts(counts, drafts.num_drafts, drafts.is_chain) - 1).contiguous()
        return check_nodes(nodes, drafts.num_drafts).contiguous()
    name, x = ("counts", counts) if counts is not None else ("nodes", nodes)
    x = check_count_arg(name, x, drafts.k.shape[0], device, "0..num_drafts[b]" if counts is not None else
                        "-1..num_drafts[b]-1")
    return (x.to(dtype=torch.long) - (1 if counts is not None else 0)).contiguous()


def _require_room(buffer: KVBuffer, drafts: Drafts, nodes: torch.Tensor) -> None:
    """A buffer without state storage cannot fold: every request's n + m must fit the capacity (host side)."""
    par = drafts.parents.tolist()
    for b, (n, node) in enumerate(zip(buffer.lengths.tolist(), nodes.tolist())):
        m = 0
        while node >= 0:
            m, node = m + 1, par[b][node]
        if n + m > buffer.capacity:
            raise ValueError(
                f"buffer: request {b} has {n} entries and gets {m} more, past the capacity C={buffer.capacity}, "
                f"but the buffer has no state storage to fold into (buffer.state is None); call flush() first "
                f"(it allocates the state) or use a larger capacity")
