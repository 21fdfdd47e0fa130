"""The fold: S = diag(exp(G_end)) S0 + sum_j (exp(G_end - G_j) k_j) u_j^T, the one update every kernel
that folds buffered entries into a state uses.

``fold_block`` is the one fold step: it folds a set of entries into a state block with one tl.dot
(fp32 FMA), decaying the block first unless told not to.  Its callers:

* the block loops, which walk a request's [K, BV] tile in [KB, BV] state blocks and fold all entries
  into each block: decode's grouped fold (``decode._fold_group_program``, C <= 32) and accept's fold
  (``accept._fold_program``: its old entries and its path entries, one tl.dot each);
* ``fold_tile``, the chunk loop over one program's whole [BK, BV] tile: it decays the tile once
  (``decay``) and folds the entries FB at a time.  Decode's tile fold (``decode._fold_tile_kernel``,
  C > 32) and flush (``flush._flush_program``) call it.

The tile callers take their tile from ``state_tile`` (or load it themselves) with o_k, o_v (its rows and
columns), m_k, m_v (their masks) and i_b, i_h, i_hv as ``_common._program_ids`` gives them.
``fold_empty`` does the tile fold's bookkeeping.
"""

import triton
import triton.language as tl

__all__ = ["state_tile", "decay", "fold_tile", "fold_block", "fold_empty"]


@triton.jit
def state_tile(state_ptr, owns, i_bhv, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr):
    """(pointers, S0) of this program's state tile in float32; S0 = 0 where the request does not
    ``owns`` a state (direct mode: a select, so its storage row may hold anything, NaN included)."""
    p_s = state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :]
    s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    return p_s, tl.where(owns, s, 0.0)


@triton.jit
def decay(s, cg_ptr, row, i_hv, o_k, m_k, HV: tl.constexpr, K: tl.constexpr, CHANNEL: tl.constexpr):
    """(diag(exp(G_end)) s, G_end) with G_end the G of value head i_hv at flat buffer row ``row``
    (i_b * C + j for entry j, the last folded one): [BK] per-channel gates, a scalar otherwise."""
    if CHANNEL:
        g_end = tl.load(cg_ptr + (row * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        s = s * tl.exp(g_end)[:, None]
    else:
        g_end = tl.load(cg_ptr + row * HV + i_hv).to(tl.float32)
        s = s * tl.exp(g_end)
    return s, g_end


@triton.jit
def fold_block(st, ge, m_k, kf, uf, gj, m_j, kd, ud, gd, m_d, CHANNEL: tl.constexpr, TWO: tl.constexpr,
               DECAY: tl.constexpr):
    """The fold step: diag(exp(G_end)) st + sum_j (exp(G_end - G_j) k_j) u_j^T over a [KB, BV] state block
    ``st`` (float32; its key rows masked by ``m_k`` [KB]) and J entries, one tl.dot of [KB, J] x [J, BV]
    per set of entries (fp32 FMA: input_precision="ieee").  kf [KB, J]: the entries' keys over the block's
    rows, uf [J, BV]: their u rows (float32, zero outside the entries).  Per-channel gates (CHANNEL): ge
    [KB] is G_end over the block's rows, ``gj`` [KB, J] the pointers of the entries' G there (read where
    m_k and ``m_j`` [J]), and the keys outside m_j are dropped by a select.  Scalar gates: ge is the scalar
    G_end and ``gj`` [J] the weights exp(G_end - G_j), 0 outside the entries (computed by the caller, out
    of its block loop where it can; m_k and m_j are not read).  TWO: a second set of entries (kd, ud, gd,
    m_d as kf, uf, gj, m_j: accept's path entries after its old entries) folds into the same block with a
    second tl.dot, the state decayed once; without TWO those arguments are not read.  DECAY: st is decayed
    here (diag(exp(ge)) st); without it st is already decayed (``fold_tile``'s chunks) and only the
    entries' products are added."""
    if CHANNEL:
        gjk = tl.load(gj, mask=m_k[:, None] & m_j[None, :], other=0.0).to(tl.float32)
        kf = tl.where(m_j[None, :], kf * tl.exp(ge[:, None] - gjk), 0.0)
        if TWO:
            gdk = tl.load(gd, mask=m_k[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            kd = tl.where(m_d[None, :], kd * tl.exp(ge[:, None] - gdk), 0.0)
        if DECAY:
            st = st * tl.exp(ge)[:, None]
    else:
        kf = kf * gj[None, :]
        if TWO:
            kd = kd * gd[None, :]
        if DECAY:
            st = st * tl.exp(ge)
    st = tl.dot(kf, uf, st, input_precision="ieee")
    if TWO:
        st = tl.dot(kd, ud, st, input_precision="ieee")
    return st


@triton.jit
def fold_tile(s, ck_ptr, cu_ptr, cg_ptr, i_b, i_h, i_hv, n_fold, o_k, o_v, m_k, m_v,
              C: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              FB: tl.constexpr, CHANNEL: tl.constexpr):
    """diag(exp(G_end)) s + sum_{j < n_fold} (exp(G_end - G_j) * k_j) u_j^T over this [BK, BV] tile, with
    G_end the G of entry n_fold - 1 of buffer row i_b (n_fold >= 1): the tile decayed once, then FB entries
    per ``fold_block`` step.  n_fold must be a runtime value: with a constant trip count ptxas unrolled
    the loop into 32 registers and kilobytes of spills (sm_90)."""
    s, g_end = decay(s, cg_ptr, i_b * C + n_fold - 1, i_hv, o_k, m_k, HV, K, CHANNEL)
    o_f = tl.arange(0, FB)
    for c0 in range(0, n_fold, FB):
        rows_f = c0 + o_f
        m_f = rows_f < n_fold
        kt = tl.load(ck_ptr + ((i_b * C + rows_f[None, :]) * H + i_h) * K + o_k[:, None],
                     mask=m_k[:, None] & m_f[None, :], other=0.0).to(tl.float32)  # [BK, FB]
        if CHANNEL:  # the entries' G (pointers, read by fold_block)
            gw = cg_ptr + ((i_b * C + rows_f[None, :]) * HV + i_hv) * K + o_k[:, None]
        else:  # the entries' weights
            gt = tl.load(cg_ptr + (i_b * C + rows_f) * HV + i_hv, mask=m_f, other=0.0).to(tl.float32)
            gw = tl.where(m_f, tl.exp(g_end - gt), 0.0)
        uf = tl.load(cu_ptr + ((i_b * C + rows_f[:, None]) * HV + i_hv) * V + o_v[None, :],
                     mask=m_f[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [FB, BV]
        s = fold_block(s, g_end, m_k, kt, uf, gw, m_f, kt, uf, gw, m_f, CHANNEL, False, False)
    return s


@triton.jit
def fold_empty(len_ptr, own_ptr, ticket_ptr, i_b, row, programs):
    """After a full request's fold: its last program (an atomic ticket ``i_b`` after a barrier, once all
    ``programs`` of the request have read its length) empties buffer row ``row`` (i_b outside a pool),
    marks the request as owning a state and resets the counter (``_common.ticket_counters``: zero between
    launches).  Returns whether this program was the last (every other one has passed its ticket, so
    whatever they read before it may be overwritten)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + i_b, 1)
    last = ticket == programs - 1
    if last:  # the request's last program: every one has read its length
        tl.store(len_ptr + row, tl.zeros([], dtype=len_ptr.dtype.element_ty))  # emptied
        tl.store(own_ptr + row, 1)  # (a direct request now owns its folded state)
        tl.store(ticket_ptr + i_b, 0)
    return last
