#!/usr/bin/env python3
"""Mutation testing of the validation suite: plant realistic bugs, check that `kvbuffer validate` finds each.

Every mutant is one textual change to a COPY of this project's code (kvbuffer_fast's Triton kernels
or kvbuffer_ref's forms), made in a temporary directory under a package name of its own
(mut_fast_f01, mut_ref_r03, ...), so the real files, and the float64 truth the validator compares
against, are never touched; or a plain-PyTorch adapter over the reference with one bug (mut_pt_p01).
The mutants of the seven bug classes (``Mutant.klass``: inputs-changed, arguments, tile-boundary,
state-leak, domain, memory-layout, partial-flush) are written as those bugs appear in real kernels.
L01-L12 put q's scale, the gate or beta 1 % off in one of the reference's forms, H01-H14 round to 16 bits
where fp32 arithmetic is declared (and 1 % errors) with bfloat16 / float16 inputs (``Mutant.dtype``); their
copies declare the size budget ``SIZES["long"]`` (``Mutant.sizes``: boundary cases at T = 256, small heads).
Each mutant is validated like

    kvbuffer validate --impl <the mutant's adapter> --ops <the operations it affects> --profile ci
                      --seed SEED --no-shrink --fail-fast

(``run_validation`` called in a worker process: ``--jobs`` workers, each importing torch and triton
once and validating one mutant after another; a worker that crashes or times out is replaced) and
counts as killed when a lane fails.  The unmutated copies are validated the same way (one copy per
package, size budget and dtype the chosen mutants declare), one task per operation, and must pass
(else the score would mean nothing).  Prints, per mutant, the class that
killed it, then the score per planted class and in all; exits 1 if any mutant survives (a gap in the
properties or strategies, to close there; a mutant listed as below a contract's rounding, ``below_rounding``,
may survive under that contract: it is printed as a genuine limit), 2 if a mutant no longer applies (the code it patches
changed) or the unmutated copies fail.

    python scripts/mutate.py            # all mutants, 2 worker processes
    python scripts/mutate.py --quick    # 33 of them (about one per idea)
    python scripts/mutate.py --list     # what is planted where
    python scripts/mutate.py --only F07 R03 --seed 5 -v
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The copies' package names and the adapter factory each is validated through.
PACKAGES = {
    "kvbuffer_fast": ("mut_fast", "from kvbuffer.implementations import fast_from\n\n\n"
                                  "def impl():\n    return fast_from('{name}')\n"),
    "kvbuffer_ref": ("mut_ref", "from kvbuffer.implementations import reference_from\n\n\n"
                                "def impl():\n    return reference_from('{name}', as_truth=False)\n"),
}
#: Modules of the reference copy that stay the real ones (the shared classes and argument checks).
_SHARED = {"buffer.py": "kvbuffer_ref.buffer", "checks.py": "kvbuffer_ref.checks"}
#: The reference's tooling, not the math under test: not copied.
_TOOLS = ("validate",)


@dataclass(frozen=True)
class Mutant:
    id: str
    package: str  # kvbuffer_fast or kvbuffer_ref
    file: str  # path inside the package
    old: str
    new: str
    ops: str  # --ops for the validation
    what: str
    quick: bool = False  # part of the --quick selection
    dtype: str = "float32"
    klass: str = ""  # the class of bug it plants (runner.CLASSES); the report names the class that killed it
    #: the contracts under which its error is below the contract's rounding allowance (docs/testing.md): it
    #: may survive there without failing the run (it is still validated and listed, as a genuine limit)
    below_rounding: tuple = ()
    #: the size budget its copy declares (a key of ``SIZES``; "" = the adapter's own): the validator's hook
    #: for case sizes (``Implementation.sizes``), e.g. "long" for the boundary cases at T = 256
    sizes: str = ""


#: Size budgets a copy may declare (``Mutant.sizes``), as ``cases.Sizes`` keyword arguments.  "long": the
#: boundary cases at T = 256 (a history of 256 tokens for the buffer operations; chunks of 16 and 64 across
#: it), with few and small heads (K, V <= 16, HV <= 4) and no batch or wide-K/V case, so a reference copy
#: validates a lane in seconds; drawn cases as small as the plain ones.
SIZES = {
    "long": dict(name="long (scripts/mutate.py: T = 256, small heads)", max_B=2, max_T=12, max_H=2, max_group=2,
                 dims=(1, 2, 3, 5, 8, 16), max_capacity=5, max_history=8, max_new=4, max_chain=4, max_tree=6,
                 max_after=2, max_prompt=8, big_capacity=18, edge_base=(1, 1, 2, 8, 8), edge_B=0, edge_HV=(2, 4),
                 edge_T=256, edge_rows=18, edge_dims=((16, 12),), edge_chunks=(16, 64), edge_tree=8),
}


def _m(id, package, file, old, new, ops, what, quick=False):
    dtype = "float32" if package == "kvbuffer_fast" else "float64"
    return Mutant(id, package, file, old, new, ops, what, quick, dtype)


F, R = "kvbuffer_fast", "kvbuffer_ref"
REC = "recurrent,recurrent_decode"
DEC = "decode,flush"
FL = "flush,materialize"

MUTANTS = [
    # ------------------------------------------------------------------ kvbuffer_fast: recurrent kernel
    _m("F01", F, "recurrent.py",
       "    else:\n        s = s * tl.exp(tl.load(g_ptr + i_bt * HV + i_hv).to(tl.float32))\n"
       "    b_u = b_beta * (b_v - tl.sum(s * b_k[:, None], 0))\n    s = s + b_k[:, None] * b_u[None, :]\n",
       "    else:\n        b_decay = tl.exp(tl.load(g_ptr + i_bt * HV + i_hv).to(tl.float32))\n"
       "    b_u = b_beta * (b_v - tl.sum(s * b_k[:, None], 0))\n    s = s + b_k[:, None] * b_u[None, :]\n"
       "    if not CHANNEL:\n        s = s * b_decay\n",
       REC, "recurrent: the decay applied after the write (scalar gate)", True),
    _m("F02", F, "recurrent.py", "b_u = b_beta * (b_v - tl.sum(s * b_k[:, None], 0))",
       "b_u = (b_v - tl.sum(s * b_k[:, None], 0))", REC, "recurrent: beta dropped from the write", True),
    _m("F03", F, "_common.py", "i_h = i_hv // (HV // H)", "i_h = i_hv % H", REC,
       "recurrent: wrong q/k head for grouped value heads (i % H instead of i // (HV/H))", True),
    _m("F04", F, "recurrent.py",
       "    s = s + b_k[:, None] * b_u[None, :]\n    b_o = tl.sum(s * b_q[:, None], 0)\n",
       "    b_o = tl.sum(s * b_q[:, None], 0)\n    s = s + b_k[:, None] * b_u[None, :]\n",
       REC, "recurrent: output read from the state before the write"),
    _m("F05", F, "recurrent.py", "    tl.store(p_s, s.to(state_ptr.dtype.element_ty), mask=m_s)\n", "", REC,
       "recurrent: the final state write lost", True),
    _m("F06", F, "recurrent.py",
       "b_q = tl.load(q_ptr + (i_bt * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale",
       "b_q = tl.load(q_ptr + (i_bt * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)", REC,
       "recurrent: q not scaled"),
    # ------------------------------------------------------------------ kvbuffer_fast: buffered decode (the fold
    # launch of full buffers, the decode kernel, the bookkeeping launch)
    _m("F07", F, "decode.py", "    m_r = rows < n\n    uc = tl.load(", "    m_r = rows < n - 1\n    uc = tl.load(", DEC,
       "decode: off-by-one in the buffer length (the newest entry is not attended to)", True),
    _m("F08", F, "decode.py",
       '        dec = tl.exp(tl.where(m_r, g_new - gc, float("-inf")))',
       '        dec = tl.exp(tl.where(m_r, tl.where(rows == 0, 0.0, g_new - gc), float("-inf")))', DEC,
       "decode: the oldest buffered entry is not decayed (scalar gate)", True),
    _m("F09", F, "decode.py", "        e_new = tl.exp(g_new)\n        sk = sk * e_new",
       "        e_new = 1.0 + 0.0 * g_new\n        sk = sk * e_new", DEC,
       "decode: the stale-state read is not decayed", True),
    _m("F10", F, "_fold.py", "        st = st * tl.exp(ge)\n    st = tl.dot(kf, uf, st",
       "        st = st\n    st = tl.dot(kf, uf, st", DEC,
       "decode: folding a full buffer forgets the state's decay (scalar gate; the block step accept's fold shares)",
       True),
    _m("F11", F, "decode.py", "        m_c = rows < C\n        for hh in range(FH):",
       "        m_c = rows < C - 1\n        for hh in range(FH):", DEC,
       "decode: folding a full buffer drops its newest entry (a masked lane too many)", True),
    _m("F12", F, "decode.py",
       "        sk = tl.where(owns, sk, 0.0)  # a select: a direct request's storage (maybe NaN) never propagates\n",
       "", DEC, "decode: direct-mode requests read the state storage (a reused slot's garbage)", True),
    _m("F13", F, "decode.py", "b_o = sq + acc_q + tl.sum(qk, 0) * scale * b_u", "b_o = sq + acc_q", DEC,
       "decode: the token's own (q.k) u term dropped"),
    _m("F14", F, "decode.py", "gl = tl.load(cg_ptr + ((i_b * C + last) * HV + i_hv) * K + k0 + o_kb,",
       "gl = tl.load(cg_ptr + ((i_b * C + 0) * HV + i_hv) * K + k0 + o_kb,", DEC,
       "decode (per-channel gate): the tail's G read from the first row, not the last", True),
    _m("F15", F, "decode.py",
       "tl.store(cg_ptr + (i_b * C + keep) * HV + o_hv,\n                 (tl.where(has_last, g_prev, 0.0) + g_tok)",
       "tl.store(cg_ptr + (i_b * C + keep) * HV + o_hv,\n                 (g_tok)", DEC,
       "decode: the token's own gate cached instead of the cumulative G (scalar gate)"),
    _m("F16", F, "decode.py",
       "    tl.store(ck_ptr + ((i_b * C + keep) * H + o_h[:, None]) * K + o_k[None, :], k_all.to(ck_ptr.dtype.element_ty),\n"
       "             mask=m_hk)\n",
       "", DEC, "decode: the new key is never written to the buffer (a lost write)", True),
    _m("F17", F, "decode.py", "tl.store(len_ptr + i_b, (keep + 1).to(len_ptr.dtype.element_ty))",
       "tl.store(len_ptr + i_b, keep.to(len_ptr.dtype.element_ty))", DEC,
       "decode: the buffer length not advanced"),
    _m("F18", F, "decode.py",
       "    if full:\n        tl.store(own_ptr + i_b, 1)\n",
       "", DEC,
       "decode: a direct request whose full buffer was folded is not marked as owning a state", True),
    _m("F25", F, "decode.py",
       "tl.store(cu_ptr + (i_b * C * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty), mask=m_v)",
       "tl.store(cu_ptr + ((i_b * C + 1) * HV + i_hv) * V + o_v, b_u.to(cu_ptr.dtype.element_ty), mask=m_v)", DEC,
       "decode: the fold launch serving a folded request writes the token's u to row 1 instead of row 0", True),
    _m("F27", F, "decode.py", "    m_key = rows < n\n", "    m_key = rows < n - 1\n",
       DEC, "decode: the newest buffered key is masked out of the scores (a lane masked too early)", True),
    _m("F31", F, "decode.py", "        unserved = n < C\n", "        unserved = n < C - 1\n",
       DEC, "decode: a request one entry short of full skips the block loop as if the fold launch had served it"),
    _m("F29", F, "decode.py", "w = tl.where(m_c, tl.exp(g_end - gj), 0.0)",
       "w = tl.where(m_c, tl.exp(gj - g_end), 0.0)", DEC,
       "decode: wrong sign of the decay when folding a full buffer (scalar gate)"),
    _m("F30", F, "decode.py", "                st = tl.where(owns, st, 0.0)  # direct mode: S0 = 0 (the storage row may hold anything)\n",
       "", DEC, "decode: a direct request's full buffer folded onto its storage's garbage", True),
    _m("F28", F, "_fold.py", "        m_f = rows_f < n_fold\n", "        m_f = rows_f <= n_fold\n", FL,
       "fold: the entry after the last folded one is folded too (a masked lane not masked)", True),
    # ------------------------------------------------------------------ kvbuffer_fast: flush and the fold
    _m("F19", F, "flush.py", "G.copy_(G.gather(1, g_rows) - g_end.unsqueeze(1).to(G.dtype))",
       "G.copy_(G.gather(1, g_rows))", FL, "flush: the remaining entries' G not rebased (G not reset)", True),
    _m("F20", F, "flush.py", "m_rest = (o_c >= m) & (o_c < n)", "m_rest = (o_c > m) & (o_c < n)", FL,
       "flush: the first remaining entry's u not moved (a skipped lane)", True),
    _m("F21", F, "_fold.py", "gw = tl.where(m_f, tl.exp(g_end - gt), 0.0)",
       "gw = tl.where(m_f, tl.exp(gt - g_end), 0.0)", FL, "fold: wrong sign of the decay (scalar gate)", True),
    _m("F22", F, "flush.py", "    buffer.lengths.sub_(count)\n", "", FL, "flush: lengths not reduced (a stale tail)"),
    _m("F23", F, "flush.py", "    buffer.has_state.logical_or_(count > 0)\n", "", FL,
       "flush: folded direct requests not marked as owning a state"),
    _m("F24", F, "_fold.py", "        s = s * tl.exp(g_end)\n    return s, g_end", "        s = s\n    return s, g_end", FL,
       "flush: the state's decay over the folded prefix dropped (scalar gate)"),
    _m("F26", F, "flush.py", "tail = (count - 1).clamp(min=0)", "tail = torch.zeros_like(count)", FL,
       "flush: G rebased on the first folded entry instead of the last"),
    # ------------------------------------------------------------------ kvbuffer_ref: the reference's forms
    _m("R01", R, "chunk.py", "causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()",
       "causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)", "chunk",
       "chunk: the output mask drops the diagonal"),
    _m("R02", R, "chunk.py", "S = fold_state(S, x.k[:, sl], u, G, G[:, -1])", "S = fold_state(S, x.k[:, sl], u, G, G[:, 0])",
       "chunk", "chunk: the state between chunks decayed by the chunk's first gate", True),
    _m("R03", R, "direct.py", "G = x.g.cumsum(dim=1)", "G = x.g", "direct", "direct: the gates not accumulated", True),
    _m("R04", R, "core.py", "return _solve_unit_lower(A, beta.unsqueeze(-1) * rhs)", "return _solve_unit_lower(A, rhs)",
       "direct,decode", "innovations: beta dropped from the right-hand side"),
    _m("R05", R, "core.py", "own = anc | torch.eye(anc.shape[0], dtype=torch.bool, device=anc.device)", "own = anc",
       "direct,decode", "outputs: the token's own contribution dropped"),
    _m("R06", R, "core.py", "rhs = rhs - read_state(S0, k, G)", "rhs = rhs + read_state(S0, k, G)", "decode",
       "innovations: wrong sign of the stale-state term", True),
    _m("R07", R, "entries.py", "rest = rest._replace(G=rest.G - G_end)", "rest = rest._replace(G=rest.G)", "flush",
       "flush: the remaining entries' G not rebased"),
    _m("R08", R, "speculative.py", "G = cumulative_gates(x.g[b, :t], par, tail_gate(old, x.g[b, 0]))",
       "G = cumulative_gates(x.g[b, :t], par, torch.zeros_like(x.g[b, 0]))", "verify_chain,verify_tree",
       "verify: the drafts' G starts at 0 instead of the buffer tail's G", True),
    _m("R09", R, "speculative.py", "drafts.slot(b, torch.tensor(path, dtype=torch.long",
       "drafts.slot(b, torch.tensor(path[-1:], dtype=torch.long", "verify_tree",
       "accept (tree): only the accepted node appended, not its root-to-node path", True),
    _m("R10", R, "entries.py",
       "store(fields, b, concat_entries(old, new), S0, fold, buffer.num_value_heads)",
       "store(fields, b, new, S0, min(fold, new.n), buffer.num_value_heads)",
       "verify_chain", "accept: the accepted drafts overwrite the buffer from slot 0 (old entries lost)"),
    _m("R11", R, "entries.py", "return Memory(k, innovations(k, e.v, e.beta, G, chain, S0), G)",
       "return Memory(k, innovations(k, e.v, e.beta, G, chain), G)", "decode[raw]",
       "raw form: u recomputed without the stale state", True),
    _m("R12", R, "prefill.py", "buffer = buffer.replace(state=S, has_state=",
       "buffer = buffer.replace(state=torch.zeros_like(S), has_state=", "prefill",
       "prefill: the folded prompt's state lost at the hand-off", True),
    _m("R13", R, "recurrent.py",
       "        S = decay * S\n        u = x.beta[:, t, :, None] * (x.v[:, t] - torch.einsum(\"bhk,bhkv->bhv\", x.k[:, t], S))\n"
       "        S = S + torch.einsum(\"bhk,bhv->bhkv\", x.k[:, t], u)\n",
       "        u = x.beta[:, t, :, None] * (x.v[:, t] - torch.einsum(\"bhk,bhkv->bhv\", x.k[:, t], S))\n"
       "        S = S + torch.einsum(\"bhk,bhv->bhkv\", x.k[:, t], u)\n        S = decay * S\n",
       "recurrent", "recurrent (reference copy): the decay applied after the write"),
    _m("R14", R, "core.py", 'return repeat(x, "... h d -> ... (h r) d", r=group)',
       'return repeat(x, "... h d -> ... (r h) d", r=group)', "direct,chunk",
       "grouped heads: value head i mapped to q/k head i % H", True),
    _m("R15", R, "entries.py", "return n_old + max(0, n_new - capacity)", "return n_old + max(0, n_new - capacity - 1)",
       "verify_chain", "accept: the overflow rule off by one (keeps C + 1 entries)"),
]


# ----------------------------------------------------------------------------- plain-PyTorch mutants
# Adapters over kvbuffer_ref's forms with one bug each, written as the bug appears in real kernels: the
# shape-heavy classes (tile boundaries, leaks) run at real shapes in plain PyTorch, in seconds.
PT = "plain_pytorch"
PT_HEADER = '''import types
import torch
import torch.nn.functional as F
import kvbuffer_ref as ref
from kvbuffer.validate.adapters import Implementation

_rec, _chunk, _direct = ref.recurrent_gated_delta_rule, ref.chunk_gated_delta_rule, ref.direct_gated_delta_rule
_dec, _flush, _mat = ref.buffered_decode, ref.flush, ref.materialize_state
_verify, _accept, _prefill = ref.verify, ref.accept, ref.prefill
CACHE = {}


def make(beta_max=1.0, **ops):
    base = dict(recurrent_gated_delta_rule=_rec, chunk_gated_delta_rule=_chunk, direct_gated_delta_rule=_direct,
                buffered_decode=_dec, flush=_flush, materialize_state=_mat, verify=_verify, accept=_accept,
                prefill=_prefill)
    base.update(ops)
    return Implementation(name="mutant", obj=types.SimpleNamespace(**base), dtypes=(torch.float64,), forms=("u",),
                          beta_max=beta_max)


def contiguous_strides(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.insert(0, acc)
        acc *= max(n, 1)
    return st
'''


def _p(id, klass, ops, what, code, below_rounding=()):
    return Mutant(id, PT, "", "", code, ops, what, False, "float64", klass, tuple(below_rounding))


PT_MUTANTS = [
    # inputs changed
    _p("P01", "inputs-changed", "recurrent", "recurrent: the final state written into the caller's initial_state",
       "def rec(q, k, v, *, initial_state=None, **kw):\n    o, S = _rec(q, k, v, initial_state=initial_state, **kw)\n"
       "    if initial_state is not None and S is not None:\n        initial_state.copy_(S)\n    return o, S\n"
       "def impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P02", "inputs-changed", "direct", "direct: q scaled in place",
       "def d(q, k, v, *, g, beta, scale=None):\n    q.mul_(q.shape[-1] ** -0.5 if scale is None else scale)\n"
       "    return _direct(q, k, v, g=g, beta=beta, scale=1.0)\ndef impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P03", "inputs-changed", "chunk", "chunk: the cumulative gates computed in place into g",
       "def c(q, k, v, *, g, beta, **kw):\n    gc = g.cumsum(1)\n    g0 = torch.diff(gc, dim=1, prepend=torch.zeros_like(gc[:, :1]))\n"
       "    g.copy_(gc)\n    return _chunk(q, k, v, g=g0, beta=beta, **kw)\ndef impl():\n    return make(chunk_gated_delta_rule=c)\n"),
    _p("P04", "inputs-changed", "materialize", "materialize_state resets the buffer's lengths (a flush in place)",
       "def m(buffer):\n    S = _mat(buffer)\n    buffer.lengths.zero_()\n    return S\n"
       "def impl():\n    return make(materialize_state=m)\n"),
    _p("P05", "inputs-changed", "decode", "buffered_decode writes the token's key into the caller's k (a scratch reuse)",
       "def dec(q, k, v, *, buffer, **kw):\n    o, b = _dec(q, k, v, buffer=buffer, **kw)\n    k.zero_()\n    return o, b\n"
       "def impl():\n    return make(buffered_decode=dec)\n"),
    # arguments left at defaults
    _p("P06", "arguments", "recurrent", "recurrent: an explicit scale ignored",
       "def rec(q, k, v, *, scale=None, **kw):\n    return _rec(q, k, v, **kw)\ndef impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P07", "arguments", "recurrent", "recurrent: initial_state dropped when output_final_state=False",
       "def rec(q, k, v, *, initial_state=None, output_final_state=False, **kw):\n"
       "    return _rec(q, k, v, initial_state=initial_state if output_final_state else None, "
       "output_final_state=output_final_state, **kw)\ndef impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P08", "arguments", "prefill", "prefill ignores its initial state",
       "def pf(q, k, v, *, initial_state=None, **kw):\n    return _prefill(q, k, v, **kw)\ndef impl():\n    return make(prefill=pf)\n"),
    _p("P09", "arguments", "chunk", "chunk: initial_state dropped when output_final_state=False",
       "def c(q, k, v, *, initial_state=None, output_final_state=False, **kw):\n"
       "    return _chunk(q, k, v, initial_state=initial_state if output_final_state else None, "
       "output_final_state=output_final_state, **kw)\ndef impl():\n    return make(chunk_gated_delta_rule=c)\n"),
    _p("P10", "arguments", "verify_chain", "accept: counts taken as node indices (off by one)",
       "def acc(buffer, drafts, *, counts=None, nodes=None):\n    if counts is not None:\n        return _accept(buffer, drafts, nodes=counts.clamp(max=drafts.num_drafts.max() - 1) if hasattr(drafts, 'num_drafts') else counts)\n"
       "    return _accept(buffer, drafts, nodes=nodes)\ndef impl():\n    return make(accept=acc)\n"),
    _p("P11", "arguments", "decode", "buffered_decode: an explicit scale ignored",
       "def dec(q, k, v, *, scale=None, **kw):\n    return _dec(q, k, v, **kw)\ndef impl():\n    return make(buffered_decode=dec)\n"),
    _p("P12", "arguments", "verify_tree", "verify: an explicit scale ignored",
       "def ver(q, k, v, *, scale=None, **kw):\n    return _verify(q, k, v, **kw)\ndef impl():\n    return make(verify=ver)\n"),
    # tile boundaries
    _p("P13", "tile-boundary", "recurrent", "recurrent: a batch tile of 64 drops requests >= 64",
       "def rec(q, k, v, **kw):\n    o, S = _rec(q, k, v, **kw)\n    o[64:] = 0\n    return o, S\n"
       "def impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P14", "tile-boundary", "direct", "direct: a head tile of 32 drops value heads >= 32",
       "def d(q, k, v, **kw):\n    o = _direct(q, k, v, **kw)\n    o[:, :, 32:] = 0\n    return o\n"
       "def impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P15", "tile-boundary", "recurrent", "recurrent: a V tile of 256 drops the columns past it",
       "def rec(q, k, v, **kw):\n    o, S = _rec(q, k, v, **kw)\n    o[..., 256:] = 0\n    return o, S\n"
       "def impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P16", "tile-boundary", "direct", "direct: a K tile of 256 drops the key dimensions past it",
       "def d(q, k, v, **kw):\n    if q.shape[-1] > 256:\n        q, k = q.clone(), k.clone()\n        q[..., 256:] = 0\n        k[..., 256:] = 0\n"
       "    return _direct(q, k, v, **kw)\ndef impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P17", "tile-boundary", "direct", "direct: a time block of 128 restarts from a zero state",
       "def d(q, k, v, *, g, beta, scale=None):\n    if q.shape[1] <= 128:\n        return _direct(q, k, v, g=g, beta=beta, scale=scale)\n"
       "    a = _direct(q[:, :128], k[:, :128], v[:, :128], g=g[:, :128], beta=beta[:, :128], scale=scale)\n"
       "    b = _direct(q[:, 128:], k[:, 128:], v[:, 128:], g=g[:, 128:], beta=beta[:, 128:], scale=scale)\n"
       "    return torch.cat([a, b], 1)\ndef impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P18", "tile-boundary", "materialize", "materialize_state: a row tile of 64 drops buffered rows >= 64",
       "def m(buffer):\n    return _mat(buffer.replace(lengths=buffer.lengths.clamp(max=64)))\n"
       "def impl():\n    return make(materialize_state=m)\n"),
    _p("P19", "tile-boundary", "chunk", "chunk: the state is not carried past the first 64 tokens",
       "def c(q, k, v, *, g, beta, initial_state=None, output_final_state=False, chunk_size=64, scale=None):\n"
       "    if q.shape[1] <= 64:\n        return _chunk(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size, scale=scale)\n"
       "    a, _ = _chunk(q[:, :64], k[:, :64], v[:, :64], g=g[:, :64], beta=beta[:, :64], initial_state=initial_state, chunk_size=chunk_size, scale=scale)\n"
       "    b, S = _chunk(q[:, 64:], k[:, 64:], v[:, 64:], g=g[:, 64:], beta=beta[:, 64:], initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size, scale=scale)\n"
       "    return torch.cat([a, b], 1), S\ndef impl():\n    return make(chunk_gated_delta_rule=c)\n"),
    _p("P20", "tile-boundary", "verify_tree", "verify: a draft tile of 8 leaves nodes >= 8 unverified",
       "def ver(q, k, v, **kw):\n    o, d = _verify(q, k, v, **kw)\n    o[:, 8:] = 0\n    return o, d\n"
       "def impl():\n    return make(verify=ver)\n"),
    # state leaking between calls
    _p("P21", "state-leak", "recurrent", "recurrent: a zero-state workspace reused (it holds the last final state)",
       "def rec(q, k, v, *, initial_state=None, output_final_state=False, **kw):\n"
       "    key = (q.shape[0], v.shape[2], q.shape[3], v.shape[3])\n"
       "    if initial_state is None and key in CACHE:\n        initial_state = CACHE[key]\n"
       "    o, S = _rec(q, k, v, initial_state=initial_state, output_final_state=True, **kw)\n"
       "    CACHE[key] = S\n    return o, (S if output_final_state else None)\n"
       "def impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P22", "state-leak", "direct", "direct: the result cached by the shape of q",
       "def d(q, k, v, **kw):\n    key = tuple(q.shape)\n    if key not in CACHE:\n        CACHE[key] = _direct(q, k, v, **kw)\n"
       "    return CACHE[key].clone()\ndef impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P23", "state-leak", "materialize", "materialize_state cached by (B, capacity)",
       "def m(buffer):\n    key = (buffer.lengths.shape[0], buffer.capacity)\n    if key not in CACHE:\n        CACHE[key] = _mat(buffer)\n"
       "    return CACHE[key].clone()\ndef impl():\n    return make(materialize_state=m)\n"),
    _p("P24", "state-leak", "direct", "direct: the default scale computed once, from the first call's K",
       "def d(q, k, v, *, scale=None, **kw):\n    if scale is None:\n        scale = CACHE.setdefault('scale', q.shape[-1] ** -0.5)\n"
       "    return _direct(q, k, v, scale=scale, **kw)\ndef impl():\n    return make(direct_gated_delta_rule=d)\n"),
    # the whole declared domain
    _p("P25", "domain", "direct", "direct: q and k L2-normalised by the kernel itself",
       "def d(q, k, v, **kw):\n    return _direct(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, **kw)\n"
       "def impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P26", "domain", "recurrent", "recurrent: beta clamped to 1 (the adapter declares beta in [0, 2])",
       "def rec(q, k, v, *, beta, **kw):\n    return _rec(q, k, v, beta=beta.clamp(max=1.0), **kw)\n"
       "def impl():\n    return make(beta_max=2.0, recurrent_gated_delta_rule=rec)\n"),
    _p("P27", "domain", "direct", "direct: v clamped to [-8, 8] (a half-precision overflow guard)",
       "def d(q, k, v, **kw):\n    return _direct(q, k, v.clamp(-8, 8), **kw)\ndef impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P28", "domain", "recurrent", "recurrent: k L2-normalised by the kernel (q left alone)",
       "def rec(q, k, v, **kw):\n    return _rec(q, F.normalize(k, dim=-1), v, **kw)\ndef impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
    _p("P29", "domain", "direct", "direct: per-token gates clamped at -20 (an exp underflow guard)",
       "def d(q, k, v, *, g, **kw):\n    return _direct(q, k, v, g=g.clamp(min=-20.0), **kw)\n"
       "def impl():\n    return make(direct_gated_delta_rule=d)\n",
       # exp(-20) = 2e-9 of the history leaks through: an error of about 1e-6, far below 16-bit rounding
       below_rounding=("tf32", "bf16", "bf16-state")),
    # memory layout
    _p("P30", "memory-layout", "direct", "direct: assumes contiguous inputs (reads the storage with contiguous strides)",
       "def fix(x):\n    return torch.as_strided(x, x.shape, contiguous_strides(x.shape), x.storage_offset())\n"
       "def d(q, k, v, *, g, beta, **kw):\n    return _direct(fix(q), fix(k), fix(v), g=fix(g), beta=fix(beta), **kw)\n"
       "def impl():\n    return make(direct_gated_delta_rule=d)\n"),
    _p("P31", "memory-layout", "decode", "buffered_decode: ignores the storage offset of v",
       "def dec(q, k, v, **kw):\n    v = torch.as_strided(v, v.shape, v.stride(), 0)\n    return _dec(q, k, v, **kw)\n"
       "def impl():\n    return make(buffered_decode=dec)\n"),
    _p("P32", "memory-layout", "recurrent", "recurrent: assumes a contiguous initial_state",
       "def rec(q, k, v, *, initial_state=None, **kw):\n    if initial_state is not None:\n"
       "        initial_state = torch.as_strided(initial_state, initial_state.shape, contiguous_strides(initial_state.shape), initial_state.storage_offset())\n"
       "    return _rec(q, k, v, initial_state=initial_state, **kw)\ndef impl():\n    return make(recurrent_gated_delta_rule=rec)\n"),
]
# ----------------------------------------------------------------------------- small errors at long T, 16-bit inputs
# Copies of kvbuffer_ref off by 1 % in one input of one form (L: float32), or rounding to 16 bits where the
# declared arithmetic keeps float32 (H: bfloat16 and float16 inputs, the IEEE contract = float32 arithmetic),
# validated at the "long" size budget: every lane's boundary cases at T = 256 with small heads.  The
# tolerance table promises that a 1 % error in scale, gate or beta fails (kvbuffer/validate/tolerances.py);
# these hold it to that on long sequences, where a gate's error accumulates and the budget's gate term grows.
def _r(id, file, old, new, ops, what, dtype="float32", quick=False, below_rounding=()):
    return Mutant(id, R, file, old, new, ops, what, quick, dtype, "", tuple(below_rounding), "long")


_Q = dict(recurrent=('o[:, t] = torch.einsum("bhk,bhkv->bhv", x.q[:, t], S)',
                     'o[:, t] = torch.einsum("bhk,bhkv->bhv", 1.01 * x.q[:, t], S)'),
          chunk=("o, u = _wy_chunk(x.q[:, sl], ", "o, u = _wy_chunk(1.01 * x.q[:, sl], "),
          decode=("o[b] = outputs(x.q[b], ", "o[b] = outputs(1.01 * x.q[b], "),
          verify=("o[b, :t] = outputs(x.q[b, :t], ", "o[b, :t] = outputs(1.01 * x.q[b, :t], "))
_G = dict(recurrent=("decay = x.g[:, t].exp()", "decay = (1.01 * x.g[:, t]).exp()"),
          chunk=("G = x.g[:, sl].cumsum(dim=1)", "G = (1.01 * x.g[:, sl]).cumsum(dim=1)"),
          decode=("G = tail_gate(old, x.g[b, 0]) + x.g[b]", "G = tail_gate(old, x.g[b, 0]) + 1.01 * x.g[b]"),
          verify=("G = cumulative_gates(x.g[b, :t], par,", "G = cumulative_gates(1.01 * x.g[b, :t], par,"))
_B = dict(recurrent=("u = x.beta[:, t, :, None] * (", "u = 1.01 * x.beta[:, t, :, None] * ("),
          chunk=("x.v[:, sl], x.beta[:, sl], G, S)", "x.v[:, sl], 1.01 * x.beta[:, sl], G, S)"),
          decode=("u = innovations(x.k[b], x.v[b], x.beta[b], G,",
                  "u = innovations(x.k[b], x.v[b], 1.01 * x.beta[b], G,"),
          verify=("u = innovations(x.k[b, :t], x.v[b, :t], x.beta[b, :t], G,",
                  "u = innovations(x.k[b, :t], x.v[b, :t], 1.01 * x.beta[b, :t], G,"))
_FORMS = dict(recurrent=("recurrent.py", "recurrent"), chunk=("chunk.py", "chunk"), decode=("decode.py", "decode"),
              verify=("speculative.py", "verify_chain"))
LONG_MUTANTS = [
    _r(f"L{3 * i + j + 1:02d}", _FORMS[form][0], *table[form], _FORMS[form][1], f"{form}: {what} x 1.01 (T = 256)",
       quick=form == "chunk")
    for i, form in enumerate(("recurrent", "chunk", "decode", "verify"))
    for j, (table, what) in enumerate(((_Q, "q scale"), (_G, "gate g"), (_B, "beta")))
]
_STATE16 = ('        S = S + torch.einsum("bhk,bhv->bhkv", x.k[:, t], u)\n',
            '        S = S + torch.einsum("bhk,bhv->bhkv", x.k[:, t], u)\n'
            '        if t % 16 == 15:  # a bfloat16 state store every 16 tokens\n'
            '            S = S.to(torch.bfloat16).to(S.dtype)\n')
_GATE16 = ("        G = x.g[:, sl].cumsum(dim=1)\n",
           "        G = x.g[:, sl].to(torch.bfloat16)  # the cumulative gate summed in bfloat16\n"
           "        for i in range(1, G.shape[1]):\n            G[:, i] = G[:, i - 1] + G[:, i]\n"
           "        G = G.to(x.g.dtype)\n")
_Q16 = ('o[:, t] = torch.einsum("bhk,bhkv->bhv", x.q[:, t], S)',
        'o[:, t] = torch.einsum("bhk,bhkv->bhv", x.q[:, t].to(torch.bfloat16).to(S.dtype), S)')
#: (file, (old, new), ops, what, quick, {dtype: contracts whose own rounding is that bug: below_rounding})
_HALF = (
    # a bfloat16 state store is what bf16-state declares, and below bf16's product term (docs/testing.md)
    ("recurrent.py", _STATE16, "recurrent", "recurrent: the state rounded to bfloat16 every 16 tokens", True,
     {"bfloat16": ("bf16", "bf16-state"), "float16": ("bf16", "bf16-state")}),
    ("chunk.py", _GATE16, "chunk", "chunk: the cumulative gate summed in bfloat16", True, {}),
    # q rounded to bfloat16 before a product is what the bf16 contract declares
    ("recurrent.py", _Q16, "recurrent", "recurrent: the output computed from a bfloat16-rounded q", False,
     {"float16": ("bf16",)}),
    ("recurrent.py", _Q["recurrent"], "recurrent", "recurrent: q scale x 1.01", False, {}),
    ("chunk.py", _Q["chunk"], "chunk", "chunk: q scale x 1.01", False, {}),
    ("chunk.py", _G["chunk"], "chunk", "chunk: gate g x 1.01", False, {}),
    ("chunk.py", _B["chunk"], "chunk", "chunk: beta x 1.01", False, {}),
)
HALF_MUTANTS = [
    _r(f"H{2 * i + j + 1:02d}", file, old, new, ops, f"{what} ({dt} inputs, declared fp32 arithmetic)", dt,
       quick=quick and dt == "bfloat16", below_rounding=limits.get(dt, ()))
    for i, (file, (old, new), ops, what, quick, limits) in enumerate(_HALF)
    for j, dt in enumerate(("bfloat16", "float16"))
]
MUTANTS += LONG_MUTANTS + HALF_MUTANTS


#: The original mutants that belong to one of the classes (the rest plant a wrong formula: "wrong-result").
_CLASS_OF = {"F19": "partial-flush", "F20": "partial-flush", "F26": "partial-flush", "R07": "partial-flush"}
MUTANTS = [Mutant(**{**m.__dict__, "klass": _CLASS_OF.get(m.id, m.klass)}) for m in MUTANTS]
MUTANTS += PT_MUTANTS


def _k(id, klass, file, old, new, ops, what):
    return Mutant(id, F, file, old, new, ops, what, False, "float32", klass)


# ----------------------------------------------------------------------------- kernel mutants of the classes
# Patched copies of kvbuffer_fast with one bug each, as they appear in real kernels.
KERNEL_MUTANTS = [
    _k("K01", "inputs-changed", "recurrent.py",
       "        state = initial_state.to(torch.float32, copy=True).contiguous()\n",
       "        state = initial_state if initial_state.dtype == torch.float32 and initial_state.is_contiguous() \\\n"
       "            else initial_state.to(torch.float32, copy=True).contiguous()\n",
       "recurrent", "recurrent: a float32 initial_state updated in place (the copy skipped when none is needed)"),
    _k("K02", "arguments", "recurrent.py", "    s = check_scale(scale, d.K)\n",
       "    s = check_scale(None, d.K)\n", "recurrent", "recurrent kernel: an explicit scale ignored"),
    _k("K03", "arguments", "decode.py", "    s = check_scale(scale, d.K)\n", "    s = check_scale(None, d.K)\n",
       "decode", "buffered_decode: an explicit scale ignored"),
    _k("K04", "arguments", "verify.py", "    s = check_scale(scale, d.K)\n    cfg = check_config(",
       "    s = check_scale(None, d.K)\n    cfg = check_config(",
       "verify_tree", "verify: an explicit scale ignored"),
    _k("K05", "arguments", "recurrent.py",
       "    return o, (state if output_final_state else None)\n",
       "    return o, state\n", "recurrent", "recurrent: the final state returned although output_final_state=False"),
    _k("K06", "tile-boundary", "recurrent.py", "_recurrent_kernel[(triton.cdiv(d.V, BV), N * d.HV)](",
       "_recurrent_kernel[(1, N * d.HV)](", "recurrent",
       "recurrent: one V tile launched (columns past the 64-column tile never computed)"),
    _k("K07", "tile-boundary", "flush.py", "_flush_kernel[(triton.cdiv(V, BV), B * HV)](",
       "_flush_kernel[(min(triton.cdiv(V, BV), 2), B * HV)](", "flush",
       "flush: at most two V tiles launched (a V tile that drops columns past 256)"),
    _k("K08", "tile-boundary", "decode.py", "_decode_kernel[(triton.cdiv(d.V, BV), d.B * d.HV)](",
       "_decode_kernel[(min(triton.cdiv(d.V, BV), 2), d.B * d.HV)](", "decode",
       "decode: at most two V tiles of 64 (columns past 128 dropped)"),
    _k("K09", "domain", "_common.py", "            g = g.clamp(min=low)\n", "            g = g\n", "decode",
       "decode: a reset gate (-inf) used as is: its cumulative gate turns to NaN"),
    _k("K10", "domain", "_common.py", "            g = g.clamp(min=low)\n",
       "            g = torch.where(g < low, torch.zeros_like(g), g)\n",
       "recurrent", "a reset gate (-inf, -1e30) masked to 0: no decay instead of a full reset"),
    _k("K11", "memory-layout", "_common.py", "    return x if x.is_contiguous() else x.contiguous()\n",
       "    return x\n", "recurrent", "read-only inputs assumed contiguous (no copy of a strided view)"),
    _k("K12", "memory-layout", "_common.py", "    return x if x.is_contiguous() else x.contiguous()\n",
       "    return x if x.is_contiguous() else torch.as_strided(x.contiguous(), x.shape, x.stride())\n", "decode",
       "read-only inputs: the copy keeps the view's strides (data_ptr arithmetic on the old layout)"),
    _k("K13", "partial-flush", "flush.py", "    buffer.k.copy_(buffer.k.gather(1, k_rows))\n",
       "    buffer.k.copy_(torch.where((count == buffer.lengths).view(-1, *([1] * (buffer.k.dim() - 1))),\n"
       "                               buffer.k.gather(1, k_rows), buffer.k))\n",
       "flush", "flush: the kept entries' keys not moved down on a partial flush"),
    _k("K14", "partial-flush", "flush.py", "    buffer.lengths.sub_(count)\n",
       "    buffer.lengths.sub_(torch.where(count < buffer.lengths, 0, count))\n", "flush",
       "flush: a partial count leaves the length unchanged (only a full flush empties)"),
]
MUTANTS += KERNEL_MUTANTS


# ----------------------------------------------------------------------------- copies
#: Where the packages are copied from: the working tree, or a tree exported from a git revision (--rev).
SOURCE = ROOT


def _export(rev: str, dest: Path) -> Path:
    """The packages as of git revision ``rev``, exported under ``dest``."""
    import io
    import tarfile

    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, *PACKAGES],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest)
    return dest


def copy_name(m: "Mutant") -> str:
    """The package name of ``m``'s copy: unique per mutant, so one worker process imports many copies."""
    prefix = "mut_pt" if m.package == PT else PACKAGES[m.package][0]
    return f"{prefix}_{m.id.lower()}"


def _adapter_text(package: str, name: str, sizes: str = "", dtype: str = "") -> str:
    """The adapter module of a copy: ``PACKAGES``' factory, with the copy declaring the size budget
    ``SIZES[sizes]`` and every dtype of ``dtype`` (a comma list) when they are not the factory's own."""
    text = PACKAGES[package][1].replace("{name}", name)
    extra = [d for d in dtype.split(",") if d and d not in ("float32", "float64")]
    if not sizes and not extra:
        return text
    text = text.replace("def impl():", "def _impl():")
    return (text + "\n\nimport dataclasses as _dc\n\nimport torch as _torch\n\n"
            "from kvbuffer.validate.cases import Sizes as _Sizes\n\n\n"
            "def impl():\n    base = _impl()\n"
            f"    dtypes = tuple(dict.fromkeys(base.dtypes + ({''.join(f'_torch.{d}, ' for d in extra)})))\n"
            f"    sizes = {f'_Sizes(**{SIZES[sizes]!r})' if sizes else 'base.sizes'}\n"
            "    return _dc.replace(base, dtypes=dtypes, sizes=sizes)\n")


def _copy_package(package: str, dest: Path, name: str = None, sizes: str = "", dtype: str = "") -> Path:
    """Copy ``package`` to ``dest/<name>`` (with ``<name>_adapter.py`` beside it, declaring ``sizes`` and
    ``dtype``: ``_adapter_text``); for the reference, share buffer/checks with the real one."""
    name = name or PACKAGES[package][0]
    src = SOURCE / package
    out = dest / name
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", *_TOOLS))
    if package == "kvbuffer_ref":
        for fname, real in _SHARED.items():
            (out / fname).write_text(f'"""Shim: the real {real} (shared classes and checks)."""\nimport sys\n'
                                     f"import {real} as _real\n\nsys.modules[__name__] = _real\n")
    (dest / f"{name}_adapter.py").write_text(_adapter_text(package, name, sizes, dtype))
    return out


def plant(m: Mutant, dest: Path) -> None:
    """Write the copy of ``m.package`` with the mutation into ``dest``; ValueError if it no longer applies."""
    name = copy_name(m)
    if m.package == PT:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"{name}_adapter.py").write_text(PT_HEADER + "\n\n" + m.new)
        return
    out = _copy_package(m.package, dest, name, m.sizes, m.dtype)
    path = out / m.file
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise ValueError(f"{m.id}: the text to mutate occurs {n} times in {m.package}/{m.file} (expected once); "
                         f"update the mutant to the current code")
    path.write_text(text.replace(m.old, m.new))


# ----------------------------------------------------------------------------- workers
# Each worker is one process (torch, triton and hypothesis imported once) that validates one task after
# another in-process: a task is one JSON line on its stdin, its result one JSON line on its stdout.
def _worker() -> int:
    """The worker loop: {id, dest, module, ops, dtype, seed} in, {id, passed, klass, lane, why} out."""
    import importlib
    import json

    import torch

    from kvbuffer.validate import lanes, runner

    torch.set_num_threads(1)
    for line in sys.stdin:
        t = json.loads(line)
        t0 = time.perf_counter()
        out = dict(id=t["id"])
        try:
            sys.path.insert(0, t["dest"])
            impl = importlib.import_module(t["module"]).impl()
            impl.contract = t.get("contract", "ieee")
            dtypes = [lanes.DTYPES[d] for d in t["dtype"].split(",")]
            rep = runner.run_validation([impl], ops=lanes.select_ops(t["ops"]), dtypes=dtypes,
                                        profile="ci", device="cpu", seed=t["seed"], shrink=False, fail_fast=True,
                                        progress=None, explain=False)
            bad = [r for r in rep.lanes if r.failed]
            out.update(passed=not bad, klass=bad[0].klass if bad else None, lane=bad[0].operation if bad else None,
                       why=(bad[0].why or "") if bad else "", ran=rep.ran)
        except Exception as e:  # a copy that does not import, a bad task: reported, the worker goes on
            out.update(passed=None, klass=None, lane=None, why=f"{type(e).__name__}: {e}", ran=0)
        out["seconds"] = time.perf_counter() - t0
        print(json.dumps(out), flush=True)
    return 0


class _Pool:
    """``jobs`` worker processes fed from one queue of tasks; a worker that dies (a crash) or runs past
    ``timeout`` on a task is replaced, and that task reported as an error."""

    def __init__(self, jobs: int, timeout: float):
        self.jobs, self.timeout = jobs, timeout

    def _start(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        env.pop("HYPOTHESIS_PROFILE", None)
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, cwd=str(ROOT),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def run(self, tasks: list, on_result) -> None:
        import json
        import queue
        import threading

        todo = queue.Queue()
        for t in tasks:
            todo.put(t)

        def drive():
            proc = None
            while True:
                try:
                    t = todo.get_nowait()
                except queue.Empty:
                    break
                if proc is None or proc.poll() is not None:
                    proc = self._start()
                proc.stdin.write(json.dumps(t) + "\n")
                proc.stdin.flush()
                box = {}
                reader = threading.Thread(target=lambda: box.update(line=proc.stdout.readline()), daemon=True)
                t0 = time.perf_counter()
                reader.start()
                reader.join(self.timeout)
                line = box.get("line")
                if not line:
                    why = f"timed out after {self.timeout:.0f}s" if reader.is_alive() else \
                        f"the worker died (exit {proc.poll()})"
                    proc.kill()
                    proc.wait()
                    proc = None
                    on_result(dict(id=t["id"], passed=None, klass=None, lane=None, why=why, ran=0,
                                   seconds=time.perf_counter() - t0))
                else:
                    on_result(json.loads(line))
            if proc is not None:
                proc.stdin.close()
                proc.wait()

        threads = [threading.Thread(target=drive) for _ in range(max(1, self.jobs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a quick selection (33 mutants, about one per idea)")
    ap.add_argument("--only", nargs="+", metavar="ID", help="only these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--seed", type=int, default=20260529, help="seed of the validation's cases (fixed for CI)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="mutants validated in parallel (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant before it counts as an error")
    ap.add_argument("--skip-baseline", action="store_true", help="do not validate the unmutated copies first")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every validation's output")
    ap.add_argument("--rev", metavar="REV", help="mutate the packages as of this git revision (default: the "
                                                 "working tree)")
    ap.add_argument("--contracts", default="ieee,tf32,bf16,bf16-state",
                    help="the arithmetic contracts each mutant is validated under (comma list; default all four): "
                         "a mutant must be killed under every one")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker()

    contracts = [c.strip() for c in args.contracts.split(",") if c.strip()]
    from kvbuffer.validate.contracts import CONTRACTS
    bad = [c for c in contracts if c not in CONTRACTS]
    if bad or not contracts:
        print(f"--contracts: expected a comma list of {', '.join(CONTRACTS)}, got {args.contracts!r}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if (not args.quick or m.quick) and (not args.only or m.id in args.only)]
    if args.only and len(chosen) != len(set(args.only)):
        known = {m.id for m in MUTANTS}
        print(f"unknown mutant id(s): {sorted(set(args.only) - known)}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            where = m.package if m.package == PT else f"{m.package}/{m.file}"
            print(f"{m.id}  [{m.klass or 'wrong-result'}] {where:<28} --ops {m.ops:<24} {m.what}"
                  f"{'  [quick]' if m.quick else ''}")
        return 0

    global SOURCE
    work = Path(tempfile.mkdtemp(prefix="kvbuffer-mutants-"))
    t_all = time.perf_counter()
    try:
        if args.rev:
            try:
                SOURCE = _export(args.rev, work / "source")
            except subprocess.CalledProcessError as e:
                print(f"--rev {args.rev}: git archive failed: {e.stderr.decode(errors='replace').strip()}",
                      file=sys.stderr)
                return 2
        # every mutant must apply to the current code before anything runs
        stale = []
        for m in chosen:
            try:
                plant(m, work / m.id)
            except ValueError as e:
                stale.append(str(e))
        if stale:
            print("\n".join(stale), file=sys.stderr)
            return 2
        tasks, baselines = [], {}
        if not args.skip_baseline:  # the unmutated copies, validated like the mutants (first in the queue)
            # one copy per (package, size budget, dtypes) the chosen mutants declare, one task per operation
            groups = sorted({(m.package, m.sizes, m.dtype) for m in chosen if m.package != PT})
            for package, sizes, dtype in groups:
                mine = [m for m in chosen if (m.package, m.sizes, m.dtype) == (package, sizes, dtype)]
                plain = not sizes and dtype == ("float32" if package == F else "float64")
                # the name seeds the lanes' drawn cases (runner.lane_seed): the package's own copy keeps its name
                name = f"{PACKAGES[package][0]}_baseline"
                if not plain:
                    name += f"_{sizes or 'own'}_{dtype.replace(',', '_')}"
                _copy_package(package, work / name, name, sizes, dtype)
                label = package if plain else f"{package} [{dtype}{', ' + sizes if sizes else ''}]"
                for op in sorted({o for m in mine for o in m.ops.split(",")}):
                    tid = f"baseline {label} {op}"
                    baselines[tid] = op
                    tasks.append(dict(id=tid, dest=str(work / name), module=f"{name}_adapter", ops=op,
                                      dtype=dtype, seed=args.seed))
        for c in contracts:
            for m in chosen:
                tasks.append(dict(id=m.id if c == "ieee" else f"{m.id}@{c}", dest=str(work / m.id),
                                  module=f"{copy_name(m)}_adapter", ops=m.ops, dtype=m.dtype, seed=args.seed,
                                  contract=c))
        by_id = {m.id: m for m in chosen}
        by_id.update({f"{m.id}@{c}": m for m in chosen for c in contracts})
        results, bad_base = [], []

        def on_result(r):
            if r["id"] in baselines:
                ok = r["passed"] is True
                print(f"baseline  {r['id'][9:]:<30} (the unmutated copy): {'PASS' if ok else 'FAIL'} "
                      f"in {r['seconds']:.1f}s", flush=True)
                if not ok:
                    bad_base.append(r)
                return
            m = by_id[r["id"]]
            verdict = {True: "SURVIVED", False: "killed"}.get(r["passed"], "ERROR")
            contract = r["id"].split("@")[1] if "@" in r["id"] else "ieee"
            r["contract"] = contract
            results.append((m, verdict, r))
            where = m.package if m.package == PT else f"{m.package}/{m.file}"
            by = f"[{r['klass']}]" if r["passed"] is False else "-"
            tag = m.id if contract == "ieee" else f"{m.id}@{contract}"
            print(f"{tag}  {verdict:<8} {r['seconds']:5.1f}s  by {by:<17} {where}: {m.what}", flush=True)
            if args.verbose or r["passed"] is None:
                print(f"    {r.get('lane') or ''} {r.get('why') or ''}")

        _Pool(args.jobs, args.timeout).run(tasks, on_result)
        if bad_base:
            for r in bad_base:
                print(f"{r['id']}: {r.get('lane')} [{r.get('klass')}] {r.get('why')}", file=sys.stderr)
            print("the unmutated copy does not pass: fix that first, the mutation score would mean nothing",
                  file=sys.stderr)
            return 2
        results.sort(key=lambda x: (contracts.index(x[2]["contract"]), MUTANTS.index(x[0])))
        everything = results
        results = [x for x in everything if x[2]["contract"] == "ieee"] if "ieee" in contracts else \
            [x for x in everything if x[2]["contract"] == contracts[0]]
        killed = sum(v == "killed" for _, v, _ in results)
        total = time.perf_counter() - t_all
        times = [r["seconds"] for _, _, r in results]
        print()
        print("mutation score per planted class (killed / planted; the classes that killed them):")
        for klass in sorted({m.klass or "wrong-result" for m in chosen}):
            mine = [x for x in results if (x[0].klass or "wrong-result") == klass]
            by = sorted({r["klass"] for _, v, r in mine if v == "killed"})
            print(f"  {klass:<15} {sum(v == 'killed' for _, v, _ in mine)}/{len(mine)}  "
                  f"killed by {', '.join(by) or '-'}")
        print(f"mutation score: {killed}/{len(results)} killed ({100.0 * killed / max(1, len(results)):.0f}%); "
              f"{total:.0f}s in all, {sum(times) / max(1, len(times)):.1f}s per mutant on average "
              f"(max {max(times, default=0):.1f}s), {args.jobs} worker processes, seed {args.seed}")
        print("mutation score per arithmetic contract (each mutant validated as if its code declared it):")
        for c in contracts:
            mine = [x for x in everything if x[2]["contract"] == c]
            print(f"  {c:<11} {sum(v == 'killed' for _, v, _ in mine)}/{len(mine)} killed")
        survivors = [(m, r["contract"]) for m, v, r in everything if v != "killed"]
        limits = [(m, c) for m, c in survivors if c in m.below_rounding]
        gaps = [(m, c) for m, c in survivors if c not in m.below_rounding]
        if limits:
            print("not killed, a genuine limit (the bug's error is below the contract's rounding; docs/testing.md): "
                  + ", ".join(f"{m.id}@{c} ({m.what})" for m, c in limits))
        if gaps:
            print("not killed: " + ", ".join(f"{m.id}@{c} ({m.what})" for m, c in gaps))
            return 1
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
