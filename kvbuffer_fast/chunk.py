"""The chunkwise gated delta rule (prefill): chunks in parallel, then one sequential pass over the state.

Tokens are handled flat, ``[N_tok, heads, dim]`` (a batch of B requests of T tokens is the N = B
sequences at offsets b * T; a variable-length batch gives its ``cu_seqlens``), cut into a table of
chunks: chunk c is tokens ``start[c] .. start[c] + len[c] - 1`` of one sequence, ``len[c] <= BT``.
Per value head, with G the chunk-local cumulative gate and D_ij = exp(G_i - G_j) (per channel: inside
the inner products):

    A_ij  = beta_i D_ij (k_i . k_j)  (i > j),   T = (I + A)^-1   (unit lower triangular)
    W     = T diag(beta) (exp(G) * K),          U~ = T diag(beta) V
    U     = U~ - W S,                           O  = exp(G) S^T q + (causal D * Q K^T) U
    S'    = diag(exp(G_L)) S + sum_j (exp(G_L - G_j) * k_j) u_j^T

Three launches:

1. ``_chunk_prep_kernel``, one program per (chunk, value head), all chunks in parallel: G, A, T, W,
   U~ and the masked, decayed Q K^T (fp32 scratch).  T in 16 x 16 blocks: the diagonal blocks'
   inverses by forward substitution, all at once (15 steps), then the block rows by products, through
   an fp32 scratch (rows loaded, not selected from register tiles).
2. ``_chunk_state_kernel``, grid (V / BV, N * HV): one program per (sequence, value head, V-tile)
   walks the sequence's chunks in order with its [K, BV] state tile in registers; per chunk it stores
   the state before the chunk (h [NC, HV, K, V] fp32) and U (fp32), then folds the chunk: the
   sequential part is two products per chunk.  With ``TAIL`` (the prefill hand-off,
   kvbuffer_fast.prefill) the last chunk of every sequence is its buffered tail: its U, G and keys are
   written into the buffer's rows and it is not folded.
3. ``_chunk_output_kernel``, one program per (chunk, value head, V-tile), all in parallel:
   O = exp(G) Q h + (causal D * Q K^T) U.

Precision: for fp32 inputs on CUDA every product is "tf32x3" (three TF32 products, about fp32
accuracy; "ieee", FMA, under the interpreter).  For 16-bit inputs on CUDA the contract is 16-bit
products with fp32 accumulation, as fla's chunk kernel keeps: the scalar-gate scores of 16-bit q and k
are 16-bit products (exact), the state pass's two products take operands rounded to the keys' dtype
(W is stored in it; the state stays fp32 in registers and in h), the other products are "tf32".  The
final state of a 16-bit call is therefore about as exact as 16-bit products allow (~2e-3 relative),
not as the fp32 recurrence's: cast the inputs to fp32 for an fp32-exact state.  Gates below ``-RESET_GATE[float32]`` (-inf included) are clamped as the
reference does; decays are formed only for pairs in causal order, masked before the exp.
"""

from __future__ import annotations


from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kvbuffer_ref.checks import Dims, check_chunk_size, check_scale, check_state
from kvbuffer_ref.recurrent import check_cu_seqlens

from ._common import as_input, block, checked_tokens, device_guard, new_output, on_device, sixteen_bit_paths
from .launch import SIXTEEN_BIT, ChunkConfig, check_config, chunk_smem_bytes, config_for, fit_chunk_tiles, key_of

__all__ = ["chunk_gated_delta_rule", "chunk_launches_for", "chunk_table", "precision_for"]


@triton.jit
def _row(x, o_r, i):
    """Row i of the [R, n] tile x as an [n] vector (zero if i is not a row)."""
    return tl.sum(tl.where(o_r[:, None] == i, x, 0.0), 0)


@triton.jit
def _unit_lower_inverse(a_ptr, start, L, i_hv, HV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 in place of A [BT, BT] (strictly lower, zeros on and above the diagonal stored too), in an
    fp32 scratch: row r of the chunk at ``a_ptr + ((start + r) * HV + i_hv) * BT``, rows < L written,
    later rows never read.  In blocks of 16: the inverses of the BT / 16 diagonal blocks at once by forward
    substitution (row i of every block loaded, 15 steps on [BT / 16, 16, 16]), stored transposed over
    those blocks; then block row b as X_b = T_bb (E_b - A_{b,<b} X_{<b}): A_{b,<b} and T_bb loaded from
    block row b, X_{<b} from the rows before it (the block rows already stored; later rows masked to 0),
    two products, and X_b stored over block row b.  The caller stored A and put a barrier after it; on
    return rows < L hold X, behind a barrier."""
    BS: tl.constexpr = 16
    NB: tl.constexpr = BT // BS
    o_b = tl.arange(0, NB)
    o_s = tl.arange(0, BS)
    o_t = tl.arange(0, BT)
    p_t = ((start + o_t).to(tl.int64) * HV + i_hv) * BT  # [BT]: the chunk's scratch rows
    c_d = o_b[:, None] * BS + o_s[None, :]  # [NB, BS]: the diagonal blocks' columns (and rows)
    # Tt[b, c, j] = T_bb[j, c]: each step's sum runs along the last axis (within a warp in the layout the
    # loads and the store give) and its result broadcasts back into Tt without a layout conversion
    eye = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
    Tt = tl.zeros([NB, BS, BS], dtype=tl.float32) + eye[None, :, :]
    # row 0 of every diagonal block, [NB, 1, BS]: row i is i * HV * BT floats on (one base, constant offsets)
    p_d0 = a_ptr + (((start + o_b * BS).to(tl.int64) * HV + i_hv) * BT)[:, None, None] + c_d[:, None, :]
    for i in tl.static_range(1, BS):
        # row i of every diagonal block (A's zeros on and above the diagonal included)
        a_i = tl.load(p_d0 + i * HV * BT, mask=(o_b * BS + i < L)[:, None, None], other=0.0)
        new = tl.where(o_s[None, :] == i, 1.0, 0.0) - tl.sum(a_i * Tt, 2)  # [NB, BS]: row i of each T_bb
        Tt = tl.where(o_s[None, None, :] == i, new[:, :, None], Tt)
    tl.debug_barrier()  # every thread's loads of the diagonal blocks are done before they are overwritten
    r_c = c_d[:, :, None]  # [NB, BS, 1]: Tt[b, c, j] goes to row b * 16 + c, column b * 16 + j
    tl.store(a_ptr + ((start + r_c).to(tl.int64) * HV + i_hv) * BT + c_d[:, None, :], Tt,
             mask=(r_c < L) & (o_s[None, None, :] >= 0))
    tl.debug_barrier()
    for b in tl.static_range(NB):
        r = b * BS + o_s  # [BS]: the block's rows
        p_r = ((start + r).to(tl.int64) * HV + i_hv) * BT
        m_r = r < L
        if b == 0:  # X_0 = [T_00, 0]
            Xb = tl.load(a_ptr + p_t[None, :] + o_s[:, None], mask=((o_t < BS) & (o_t < L))[None, :], other=0.0)
        else:
            Ab = tl.load(a_ptr + p_r[:, None] + o_t[None, :], mask=m_r[:, None] & (o_t[None, :] < b * BS), other=0.0)
            Xp = tl.load(a_ptr + p_t[:, None] + o_t[None, :], mask=((o_t < b * BS) & (o_t < L))[:, None],
                         other=0.0)  # X_{<b}, the rest 0
            R = tl.where(r[:, None] == o_t[None, :], 1.0, 0.0) - tl.dot(Ab, Xp, input_precision=PREC)
            Tbb = tl.load(a_ptr + p_r[None, :] + r[:, None], mask=m_r[None, :], other=0.0)  # stored transposed
            Xb = tl.dot(Tbb, R, input_precision=PREC)
        tl.debug_barrier()  # block row b is read by every thread before it is overwritten
        tl.store(a_ptr + p_r[:, None] + o_t[None, :], Xb, mask=m_r[:, None])
        tl.debug_barrier()


@triton.jit
def _chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, start_ptr, len_ptr,
    w_ptr, ut_ptr, gc_ptr, aqk_ptr, ta_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, CHANNEL: tl.constexpr, PREC: tl.constexpr,
    MMA16: tl.constexpr, LOWP: tl.constexpr = False,
):
    """One (chunk, value head): G, A, T = (I + A)^-1, W, U~ and the causal decayed Q K^T, stored per token
    row (scratch: w [N_tok, HV, K], ut [N_tok, HV, V], gc [N_tok, HV]*, aqk [N_tok, HV, BT]).  LOWP: W and
    U~ are products of 16-bit operands (T diag(beta) rounded to the keys' dtype).  I + A is inverted
    through the fp32 scratch ta [N_tok, HV, BT] (``_unit_lower_inverse``)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start = tl.load(start_ptr + i_c).to(tl.int64)
    L = tl.load(len_ptr + i_c)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    m_t = o_t < L
    m_k = o_k < K
    m_v = o_v < V
    tok = start + o_t
    m_tk = m_t[:, None] & m_k[None, :]
    p_qk = (tok[:, None] * H + i_h) * K + o_k[None, :]
    b_beta = tl.load(beta_ptr + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    p_a = (tok[:, None] * HV + i_hv) * BT + o_t[None, :]  # [BT, BT] scratch rows (aqk, ta)
    lower = o_t[:, None] > o_t[None, :]
    causal = o_t[:, None] >= o_t[None, :]
    # loads sit next to their use and every result is stored as soon as it is final, so that few
    # [BT, BK] tiles are live at once (the fp32 tiles alone would fill the registers)
    if CHANNEL:
        b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0.0).to(tl.float32)
        b_q = tl.load(q_ptr + p_qk, mask=m_tk, other=0.0).to(tl.float32) * scale
        p_g = (tok[:, None] * HV + i_hv) * K + o_k[None, :]
        G = tl.cumsum(tl.load(g_ptr + p_g, mask=m_tk, other=0.0).to(tl.float32), 0)  # [BT, BK]
        tl.store(gc_ptr + p_g, G, mask=m_tk)
        tl.debug_barrier()  # G's rows are read back below
        A = tl.zeros([BT, BT], dtype=tl.float32)
        QK = tl.zeros([BT, BT], dtype=tl.float32)
        p_k0 = k_ptr + (start * H + i_h) * K + o_k  # the first token's key and G rows: row j is j rows on
        p_g0 = gc_ptr + (start * HV + i_hv) * K + o_k
        for j in range(0, L):
            k_j = tl.load(p_k0 + j * H * K, mask=m_k, other=0.0).to(tl.float32)  # rows loaded, not selected
            G_j = tl.load(p_g0 + j * HV * K, mask=m_k, other=0.0)
            dec = tl.exp(tl.where((o_t >= j)[:, None], G - G_j[None, :], float("-inf")))  # [BT, BK], <= 1
            kk = tl.sum(b_k * dec * k_j[None, :], 1)
            qk = tl.sum(b_q * dec * k_j[None, :], 1)
            A = tl.where(o_t[None, :] == j, kk[:, None], A)
            QK = tl.where(o_t[None, :] == j, qk[:, None], QK)
        A = tl.where(lower, A, 0.0) * b_beta[:, None]
        tl.store(aqk_ptr + p_a, tl.where(causal, QK, 0.0), mask=m_t[:, None])
        eg = tl.exp(G)  # [BT, BK]
    else:
        G = tl.cumsum(tl.load(g_ptr + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32), 0)  # [BT]
        tl.store(gc_ptr + tok * HV + i_hv, G, mask=m_t)
        diff = G[:, None] - G[None, :]
        # the scores first, stored before A is formed: one [BT, BT] accumulator live at a time
        if MMA16:  # the raw 16-bit rows: exact products, fp32 accumulation
            b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0.0)
            QK = tl.dot(tl.load(q_ptr + p_qk, mask=m_tk, other=0.0), tl.trans(b_k)) * scale
        else:
            b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0.0).to(tl.float32)
            QK = tl.dot(tl.load(q_ptr + p_qk, mask=m_tk, other=0.0).to(tl.float32) * scale, tl.trans(b_k),
                        input_precision=PREC)
        QK = tl.where(causal, QK * tl.exp(tl.where(causal, diff, 0.0)), 0.0)
        tl.store(aqk_ptr + p_a, QK, mask=m_t[:, None])
        if MMA16:
            A = tl.dot(b_k, tl.trans(b_k))
        else:
            A = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
        A = tl.where(lower, A * tl.exp(tl.where(lower, diff, 0.0)), 0.0) * b_beta[:, None]
        eg = tl.exp(G)[:, None]  # [BT, 1]
    tl.store(ta_ptr + p_a, A, mask=m_t[:, None])
    tl.debug_barrier()
    _unit_lower_inverse(ta_ptr, start, L, i_hv, HV, BT, PREC)
    Tb = tl.load(ta_ptr + p_a, mask=m_t[:, None], other=0.0) * b_beta[None, :]  # T diag(beta)
    b_v = tl.load(v_ptr + (tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.0)
    # each product stored before the next: one [BT, 128] fp32 accumulator live at a time
    if LOWP:
        T16 = Tb.to(k_ptr.dtype.element_ty)
        ut = tl.dot(T16, b_v.to(k_ptr.dtype.element_ty))
    else:
        ut = tl.dot(Tb, b_v.to(tl.float32), input_precision=PREC)
    tl.store(ut_ptr + (tok[:, None] * HV + i_hv) * V + o_v[None, :], ut, mask=m_t[:, None] & m_v[None, :])
    kg = tl.load(k_ptr + p_qk, mask=m_tk, other=0.0).to(tl.float32) * eg
    if LOWP:
        w = tl.dot(T16, kg.to(k_ptr.dtype.element_ty))
    else:
        w = tl.dot(Tb, kg, input_precision=PREC)
    tl.store(w_ptr + (tok[:, None] * HV + i_hv) * K + o_k[None, :], w.to(w_ptr.dtype.element_ty), mask=m_tk)


@triton.jit
def _chunk_innovations(k_ptr, w_ptr, ut_ptr, gc_ptr, u_ptr, h_ptr, s, c, start, L, o_t, o_k, o_v, m_k, m_v, p_kv,
                       i_hv, i_h, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       CHANNEL: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """Chunk c (tokens start .. start + L - 1) against the state tile s [BK, BV] before it: stores s to
    h[c] and U = U~ - W s to u; returns (U, G, the chunk's keys) for the fold or the buffer."""
    tl.store(h_ptr + (c * HV + i_hv) * K * V + p_kv, s.to(h_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    m_t = o_t < L
    tok = start + o_t
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = (tok[:, None] * HV + i_hv) * V + o_v[None, :]
    w = tl.load(w_ptr + (tok[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
    if LOWP:  # w is stored in the keys' dtype
        ws = tl.dot(w, s.to(k_ptr.dtype.element_ty))
    else:
        ws = tl.dot(w, s, input_precision=PREC)
    u = tl.load(ut_ptr + p_tv, mask=m_tv, other=0.0) - ws
    u = tl.where(m_tv, u, 0.0)
    tl.store(u_ptr + p_tv, u.to(u_ptr.dtype.element_ty), mask=m_tv)
    if CHANNEL:
        G = tl.load(gc_ptr + (tok[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
    else:
        G = tl.load(gc_ptr + tok * HV + i_hv, mask=m_t, other=0.0)
    b_k = tl.load(k_ptr + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    return u, G, b_k


@triton.jit
def _chunk_state_kernel(
    k_ptr, w_ptr, ut_ptr, gc_ptr, start_ptr, len_ptr, coff_ptr, fend_ptr,
    u_ptr, h_ptr, s0_ptr, sf_ptr, bk_ptr, bu_ptr, bg_ptr, CS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr, PREC: tl.constexpr,
    INITIAL: tl.constexpr, FINAL: tl.constexpr, TAIL: tl.constexpr, LOWP: tl.constexpr = False,
):
    """One (sequence, value head, V-tile): the sequence's chunks in order, the [K, BV] state tile in
    registers; per chunk c the state before it goes to h[c] [K, BV] and U = U~ - W S to u, then the
    state is folded.  LOWP: the two products' operands are rounded to the keys' 16-bit dtype (fp32
    accumulation, the state kept in fp32).  The folded chunks of a sequence are consecutive, ``CS``
    tokens each but the last: their addresses are arithmetic in the loop (no table load on the chain
    of a chunk's loads, so the loop's loads are software-pipelined).  Chunks from ``fend[n]`` on (the
    sequence's last one or none) are its buffered tail: not folded, and with TAIL their U, G and keys
    written into buffer request n; the final state is the state before them."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    if INITIAL:
        s = tl.load(s0_ptr + i_nh * K * V + p_kv, mask=m_s, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    c0 = tl.load(coff_ptr + i_n)
    c1 = tl.load(coff_ptr + i_n + 1)
    c_fold = tl.load(fend_ptr + i_n)
    first = tl.load(start_ptr + c0, mask=c1 > c0, other=0).to(tl.int64)  # the sequence's first token
    last = tl.maximum(c_fold - 1, c0)  # its last folded chunk (none if c_fold == c0)
    head_end = tl.load(start_ptr + last, mask=c_fold > c0, other=0).to(tl.int64) + \
        tl.load(len_ptr + last, mask=c_fold > c0, other=0)
    for j in range(0, c_fold - c0):
        start = first + j * CS
        L = tl.minimum(head_end - start, CS).to(tl.int32)
        u, G, b_k = _chunk_innovations(k_ptr, w_ptr, ut_ptr, gc_ptr, u_ptr, h_ptr, s, c0 + j, start, L, o_t, o_k,
                                       o_v, m_k, m_v, p_kv, i_hv, i_h, H, HV, K, V, CHANNEL, PREC, LOWP)
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = b_k.to(tl.float32)
        if CHANNEL:
            G_L = _row(G, o_t, L - 1)  # [BK]
            kd = tl.where(m_tk, b_k * tl.exp(tl.where(m_tk, G_L[None, :] - G, 0.0)), 0.0)
            s = s * tl.exp(G_L)[:, None]
        else:
            G_L = tl.sum(tl.where(o_t == L - 1, G, 0.0), 0)
            kd = b_k * tl.where(m_t, tl.exp(tl.where(m_t, G_L - G, 0.0)), 0.0)[:, None]
            s = s * tl.exp(G_L)
        if LOWP:
            s = tl.dot(tl.trans(kd.to(k_ptr.dtype.element_ty)), u.to(k_ptr.dtype.element_ty), s)
        else:
            s = tl.dot(tl.trans(kd), u, s, input_precision=PREC)
    for c in range(c_fold, c1):  # the tail: at most one chunk
        start = tl.load(start_ptr + c).to(tl.int64)
        L = tl.load(len_ptr + c)
        u, G, b_k = _chunk_innovations(k_ptr, w_ptr, ut_ptr, gc_ptr, u_ptr, h_ptr, s, c, start, L, o_t, o_k, o_v,
                                       m_k, m_v, p_kv, i_hv, i_h, H, HV, K, V, CHANNEL, PREC, LOWP)
        if TAIL:
            m_t = o_t < L
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            p_b = i_n * C + o_t  # buffer rows of request n
            tl.store(bu_ptr + (p_b[:, None] * HV + i_hv) * V + o_v[None, :], u.to(bu_ptr.dtype.element_ty), mask=m_tv)
            if i_v == 0:
                if CHANNEL:
                    tl.store(bg_ptr + (p_b[:, None] * HV + i_hv) * K + o_k[None, :], G.to(bg_ptr.dtype.element_ty),
                             mask=m_tk)
                else:
                    tl.store(bg_ptr + p_b * HV + i_hv, G.to(bg_ptr.dtype.element_ty), mask=m_t)
                if i_hv % (HV // H) == 0:
                    tl.store(bk_ptr + (p_b[:, None] * H + i_h) * K + o_k[None, :], b_k.to(bk_ptr.dtype.element_ty),
                             mask=m_tk)
    if FINAL:
        tl.store(sf_ptr + i_nh * K * V + p_kv, s, mask=m_s)


@triton.jit
def _chunk_output_kernel(
    q_ptr, u_ptr, h_ptr, gc_ptr, aqk_ptr, start_ptr, len_ptr, o_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHANNEL: tl.constexpr, PREC: tl.constexpr,
    LOWP: tl.constexpr = False,
):
    """One (chunk, value head, V-tile), all in parallel: O = exp(G) (Q h[c]) + (causal D * Q K^T) U, with
    h[c] the state before the chunk and U its innovations (both from the state launch).  LOWP: h and U
    are stored in the keys' 16-bit dtype and the two products take 16-bit operands."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = i_hv // (HV // H)
    start = tl.load(start_ptr + i_c).to(tl.int64)
    L = tl.load(len_ptr + i_c)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < L
    m_k = o_k < K
    m_v = o_v < V
    tok = start + o_t
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = (tok[:, None] * HV + i_hv) * V + o_v[None, :]
    h = tl.load(h_ptr + (i_c * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_q = tl.load(q_ptr + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    if CHANNEL:
        G = tl.load(gc_ptr + (tok[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
        qg = b_q.to(tl.float32) * tl.exp(G)
        if LOWP:
            o = tl.dot(qg.to(h_ptr.dtype.element_ty), h) * scale
        else:
            o = tl.dot(qg, h, input_precision=PREC) * scale
    else:
        G = tl.load(gc_ptr + tok * HV + i_hv, mask=m_t, other=0.0)
        if LOWP:  # the raw 16-bit rows of q
            o = tl.dot(b_q, h) * (scale * tl.exp(G))[:, None]
        else:
            o = tl.dot(b_q.to(tl.float32), h, input_precision=PREC) * (scale * tl.exp(G))[:, None]
    u = tl.load(u_ptr + p_tv, mask=m_tv, other=0.0)
    aqk = tl.load(aqk_ptr + (tok[:, None] * HV + i_hv) * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    if LOWP:
        o = tl.dot(aqk.to(u_ptr.dtype.element_ty), u, o)
    else:
        o = tl.dot(aqk, u, o, input_precision=PREC)
    tl.store(o_ptr + p_tv, o.to(o_ptr.dtype.element_ty), mask=m_tv)


def precision_for(x: torch.Tensor) -> str:
    """The products' precision for inputs like ``x``: "ieee" under the interpreter, "tf32x3" for fp32
    inputs on CUDA (fp32 accuracy), "tf32" for 16-bit inputs on CUDA."""
    if not x.is_cuda:
        return "ieee"
    return "tf32" if x.dtype in SIXTEEN_BIT else "tf32x3"


def _shared_budget(q: torch.Tensor) -> Optional[tuple[int, torch.dtype]]:
    """On CUDA, the device's shared memory per block and the dtype ``chunk_smem_bytes`` sizes q's launches
    by (float32 for fp32 inputs' split products, else bfloat16); None elsewhere or when the device does not
    say."""
    if not q.is_cuda:
        return None
    limit = getattr(torch.cuda.get_device_properties(q.device), "shared_memory_per_block_optin", None)
    return None if limit is None else (limit, torch.float32 if precision_for(q) == "tf32x3" else torch.bfloat16)


def fitted_chunk_size(chunk_size: int, cfg, *, dtype: torch.dtype, K: int, V: int, limit: int) -> int:
    """``chunk_size``, halved (down to 16) while the prep launch of a chunk that long would not fit ``limit``
    bytes of shared memory per block (``launch.chunk_smem_bytes``, exact for the prep launch at chunk 64).
    Only fp32 inputs with K above 128 need it: their split operands take 262144 B at K = 136 or 256 and
    chunk 64 (Triton's sm_90 build) against the H200's 232448, so they run in chunks of 32 tokens.  The
    chunkwise form is exact for any chunk size: this changes the rounding, not the result (the
    reference's ``chunk_size`` is the same kind of choice).  ``dtype``: as for ``chunk_smem_bytes``."""
    while chunk_size > 16 and chunk_smem_bytes("prep", cfg, dtype=dtype, K=K, V=V, BT=block(chunk_size)) > limit:
        chunk_size = block(chunk_size) // 2
    return chunk_size


def chunk_table(cu: list[int], chunk_size: int, tails: Optional[list[int]] = None, device=None):
    """The chunks of sequences at offsets ``cu`` [N + 1]: (start [NC] int32, len [NC] int32, offsets
    [N + 1] int32 of each sequence's first chunk, fold ends [N] int32: each sequence's first chunk that
    is not folded, the longest chunk).  ``tails`` [N]: the last ``tails[n]`` tokens of sequence n form
    one chunk of their own (the prefill tail; 0 for none), which is not folded.  Cached per device
    (``_common.on_device``)."""
    key = ("chunks", tuple(cu), chunk_size, None if tails is None else tuple(tails))
    return on_device(key, device, lambda: _make_table(cu, chunk_size, tails, device))


def _make_table(cu: list[int], chunk_size: int, tails: Optional[list[int]], device):
    """``chunk_table``'s tensors, made on the host and copied to ``device``."""
    starts, lens, offs = [], [], [0]
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        t = 0 if tails is None else tails[n]
        for s in range(a, b - t, chunk_size):
            starts.append(s)
            lens.append(min(chunk_size, b - t - s))
        if t > 0:
            starts.append(b - t)
            lens.append(t)
        offs.append(len(starts))
    fend = [offs[n + 1] - (0 if tails is None else int(tails[n] > 0)) for n in range(len(cu) - 1)]
    longest = max(lens, default=1)
    mk = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return mk(starts), mk(lens), mk(offs), mk(fend), longest


def run_chunks(q, k, v, g, beta, d: Dims, cu: list[int], s: float, chunk_size: int, initial_state, final,
               cfg: ChunkConfig, tails: Optional[list[int]] = None, buffer=None):
    """The three launches over the flat tokens of ``q`` .. ``beta`` ([B, T, ...], the sequences at offsets
    ``cu``).  Returns (o [B, T, HV, V] in v's dtype, the final states [N, HV, K, V] fp32 or None); with
    ``tails``, the tails' U, G and keys go into ``buffer`` (KVBuffer of N requests) and are not folded."""
    o, S, launches = chunk_launches(q, k, v, g, beta, d, cu, s, chunk_size, initial_state, final, cfg, tails, buffer)
    for _, launch in launches:
        launch()
    return o, S


def chunk_launches(q, k, v, g, beta, d: Dims, cu: list[int], s: float, chunk_size: int, initial_state, final,
                   cfg: ChunkConfig, tails: Optional[list[int]] = None, buffer=None):
    """``run_chunks``'s outputs (allocated, not yet written) and its launches, in order, as
    [("prep" | "state" | "output", callable)] over scratch allocated here (a benchmark times each
    alone; each reads only what the ones before it wrote).  Shared-memory overflows are reported as
    ValueError naming the launch and the config field to lower."""
    N = len(cu) - 1
    o = new_output((d.B, d.T, d.HV, d.V), v.dtype, q.device)
    S = new_output((N, d.HV, d.K, d.V), torch.float32, q.device) if final else None
    if N == 0 or d.T == 0:
        if final:
            S.copy_(torch.zeros_like(S) if initial_state is None else initial_state)
        return o, S, []
    budget = _shared_budget(q)
    if budget is not None:
        chunk_size = fitted_chunk_size(chunk_size, cfg, dtype=budget[1], K=d.K, V=d.V, limit=budget[0])
    starts, lens, offs, fend, longest = chunk_table(cu, chunk_size, tails, q.device)
    BT = block(longest)
    BK, BVF = block(d.K), block(d.V)
    BV = max(16, min(cfg.BV, BVF))
    BVO = max(16, min(cfg.out_BV, BVF))
    stages = cfg.stages
    prec = precision_for(q)
    NT, NC = d.B * d.T, starts.numel()
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    lowp = sixteen_bit_paths(k) and k.dtype in SIXTEEN_BIT  # the state pass's products in the keys' dtype
    fast16 = lowp and cfg.fast16 and q.dtype == k.dtype == v.dtype  # and the prep's and output's
    w = torch.empty(NT, d.HV, d.K, dtype=k.dtype if lowp else torch.float32, device=dev)
    ut = torch.empty(NT, d.HV, d.V, **f32)
    u = torch.empty(NT, d.HV, d.V, dtype=k.dtype if fast16 else torch.float32, device=dev)
    h = torch.empty(NC, d.HV, d.K, d.V, dtype=k.dtype if fast16 else torch.float32, device=dev)
    gc = torch.empty((NT, d.HV, d.K) if d.channel_gate else (NT, d.HV), **f32)
    aqk = torch.empty(NT, d.HV, BT, **f32)
    ta = torch.empty(NT, d.HV, BT, **f32)  # the triangular solve's scratch
    q, k, v, g, beta = (as_input(x) for x in (q, k, v, g, beta))
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    tail = buffer is not None
    dummy = ut  # fp32
    mma16 = sixteen_bit_paths(q) and q.dtype == k.dtype and q.dtype in SIXTEEN_BIT
    common = dict(H=d.H, HV=d.HV, K=d.K, V=d.V, BT=BT, BK=BK, CHANNEL=d.channel_gate, PREC=prec)

    def prep():
        _chunk_prep_kernel[(NC, d.HV)](
            q, k, v, g, beta, starts, lens, w, ut, gc, aqk, ta, s, **common, BVF=BVF, MMA16=mma16, LOWP=fast16,
            num_warps=cfg.prep_warps)

    def state():
        _chunk_state_kernel[(triton.cdiv(d.V, BV), N * d.HV)](
            k, w, ut, gc, starts, lens, offs, fend, u, h,
            dummy if s0 is None else s0, dummy if S is None else S,
            buffer.k if tail else dummy, buffer.u if tail else dummy, buffer.G if tail else dummy, chunk_size,
            **common, C=buffer.capacity if tail else 1, BV=BV, INITIAL=s0 is not None, FINAL=S is not None,
            TAIL=tail, LOWP=lowp, num_warps=cfg.num_warps, num_stages=stages)

    def output():
        _chunk_output_kernel[(NC, d.HV, triton.cdiv(d.V, BVO))](
            q, u, h, gc, aqk, starts, lens, o, s, **common, BV=BVO, LOWP=fast16, num_warps=cfg.out_warps)

    # The state and output launches are checked before anything runs, so a call that cannot run writes
    # nothing; wide heads (K or V above 128) take fewer stages and narrower tiles than the table's rows
    # (``fit_chunk_tiles``), as they take shorter chunks for the prep launch (``fitted_chunk_size``, above).
    # An OutOfResources from any launch is still re-raised as a ValueError naming its fields (``guarded``).
    if budget is not None:
        fit = fit_chunk_tiles(cfg, dtype=budget[1], K=d.K, V=d.V, BT=BT, limit=budget[0])
        BV, BVO, stages = fit.BV, fit.out_BV, fit.stages

    def guarded(name, fields, launch):
        def run():
            try:
                with device_guard(q):
                    launch()
            except OutOfResources as e:
                raise ValueError(f"config: the chunk {name} launch ({fields}) does not fit the device: {e}; "
                                 f"lower those fields") from None
        return run

    return o, S, [
        ("prep", guarded("prep", f"prep_warps={cfg.prep_warps}", prep)),
        ("state", guarded("state", f"BV={BV}, num_warps={cfg.num_warps}, stages={stages}", state)),
        ("output", guarded("output", f"out_BV={BVO}, out_warps={cfg.out_warps}", output)),
    ]


def _chunk_args(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, cu_seqlens, config):
    """``chunk_gated_delta_rule``'s checks; returns ``run_chunks``'s arguments."""
    d, g = checked_tokens(q, k, v, g, beta)
    check_chunk_size(chunk_size)
    s = check_scale(scale, d.K)
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, q, initial_state)
        N = len(cu) - 1
        check_state("initial_state", initial_state, Dims(**{**d.__dict__, "B": N}), q.device)
    else:
        check_state("initial_state", initial_state, d, q.device)
        cu = [b * d.T for b in range(d.B + 1)]
    cfg = check_config("chunk", config) if config is not None else config_for(
        "chunk", key_of(q, B=len(cu) - 1, HV=d.HV, V=d.V, channel=d.channel_gate))
    return (q, k, v, g, beta, d, cu, s, chunk_size, initial_state, output_final_state, cfg)


def chunk_launches_for(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                       chunk_size: int = 64, cu_seqlens=None, config: Optional[ChunkConfig] = None):
    """``chunk_gated_delta_rule``'s launches, not run: (o, final state or None, [(name, callable)]) as
    :func:`chunk_launches` (for timing each launch alone; running them in order fills o and the state)."""
    return chunk_launches(*_chunk_args(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size,
                                       cu_seqlens, config))


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    config: Optional[ChunkConfig] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``kvbuffer_ref.chunk_gated_delta_rule`` on the chunk kernels (module docstring); inputs are not modified.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K]; beta: [B, T, HV];
    initial_state: [B, HV, K, V] or None (zeros).  ``cu_seqlens`` (int32 / int64 [N + 1], B = 1): N
    sequences concatenated along T, each computed alone; states are then [N, HV, K, V].
    Returns o [B, T, HV, V] in v's dtype and, if ``output_final_state``, the final fp32 state.
    ``chunk_size``: tokens per chunk at most (on CUDA a chunk whose prep launch would not fit the shared
    memory is halved: fp32 inputs with K above 128 take 32; ``fitted_chunk_size``).  ``config``: a
    :class:`kvbuffer_fast.launch.ChunkConfig`, None for the table's.
    """
    return run_chunks(*_chunk_args(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size,
                                   cu_seqlens, config))
