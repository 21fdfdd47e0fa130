"""What ``kvbuffer validate`` runs: the validated operations, their cases, and the plan of lanes.

A *lane* is one (operation, implementation, dtype).  ``OPS`` names each operation, the adapter
attributes it needs, the hypothesis strategy of its parameters, its fixed anchor cases and the
property (``properties.check_*``) that judges it; ``plan`` turns implementations into lanes (every
dtype an implementation declares, unless --dtype names some), with a NOT PROVIDED / NOT RUN row and its
reason for everything that is not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from . import properties as P
from . import strategies as kst
from .adapters import Implementation, stepwise_recurrent
from .cases import GPU, NORMAL, SMALL, Case, Sizes

__all__ = ["ValidationError", "DTYPES", "DEFAULT_DTYPES", "dtype_name", "Sizes", "NORMAL", "SMALL", "GPU",
           "edge_params",
           "INTERPRETED_EXAMPLES", "Op", "OPS", "OP_KEYS", "FORM_OPS", "ANCHORS", "select_ops", "parse_dtypes",
           "Lane", "plan", "op_params"]


class ValidationError(ValueError):
    """A bad request (unknown op or dtype, missing device, nothing to run): the CLI exits 2 on it."""


#: dtype names accepted by --dtype.
DTYPES = {"float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
          "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
#: dtypes validated when --dtype is not given: every dtype the implementation declares, in this order.  A
#: declared dtype that cannot run here (bfloat16 through the Triton interpreter) is a NOT RUN row with its
#: reason, counted as "not run" by the summary (``report.Report.summary_line``: PASSED, INCOMPLETE), never
#: left out of the plan.
DEFAULT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: Why a lane of an interpreted implementation in bfloat16 is NOT RUN.
INTERPRETER_BF16 = ("bfloat16 not run: the Triton interpreter mishandles bfloat16 arithmetic (run it compiled: "
                    "--device cuda)")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


# ----------------------------------------------------------------------------- sizes of the cases
# Sizes, NORMAL, SMALL and GPU live in ``cases`` (an implementation declares its size budget,
# ``Implementation.sizes``); re-exported here.
#: examples per lane on the interpreter, per profile, on SMALL cases, after the anchors and the boundary
#: cases.  An interpreted implementation runs each of its declared dtypes (float32 and float16: bfloat16 is
#: NOT RUN there), whose lanes share the operation's boundary cases: ci draws 2 per lane, the 4 per
#: operation it drew when only float32 ran by default.
INTERPRETED_EXAMPLES = {"ci": 2, "thorough": 300, "gpu": 4}


# ----------------------------------------------------------------------------- operations
@dataclass(frozen=True)
class Op:
    """One validated operation: the adapter attributes it needs, its cases, its property."""

    key: str
    needs: tuple
    summary: str
    strategy: Callable  # (sizes, case_kw) -> strategy of a params dict
    check: Callable  # (impl_obj, params, dtype, device, form) -> list[Comparison]
    form: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.key}[{self.form}]" if self.form else self.key

    def with_form(self, form: str) -> "Op":
        return Op(self.key, self.needs, self.summary, self.strategy, self.check, form)


#: Gate and beta regimes drawn, weighted by repetition towards the informative ones (and hypothesis
#: shrinks towards the first): with g = 0 (no decay), an underflowing decay (everything before the
#: last token vanishes) or beta = 0 (nothing written) many wrong formulas agree with the right one.
#: The degenerate regimes still come up, a quarter of the time.
GATES = ("mild", "strong", "mixed", "wide", "band", "reset", "mild", "strong", "mixed", "zero", "underflow")
BETAS = ("uniform", "mixed", "uniform", "mixed", "one", "zero")


#: q/k norms, scales of v and explicit ``scale`` values drawn (None: the default K ** -0.5).
NORMS = ("any", "unit")
V_SCALES = (1.0, 0.05, 20.0)
SCALES = (0.37, None, 1.6)


def _case_kw(s: Sizes, kw: dict) -> dict:
    out = dict(max_H=s.max_H, max_group=s.max_group, dims=s.dims, gates=GATES, betas=BETAS, norms=NORMS,
               v_scales=V_SCALES, scales=SCALES, head_shapes=s.head_shapes)
    out.update(kw)  # the implementation's restrictions (e.g. unit-norm q and k) win
    return out


def _with_layout(strategy):
    """Every example also draws ``layout``: its tensor inputs passed as strided / offset views."""
    from hypothesis import strategies as st
    return st.tuples(strategy, st.booleans()).map(lambda p: dict(p[0], layout=p[1]))


def _cases(s, kw):
    from hypothesis import strategies as st
    return st.fixed_dictionaries({"case": kst.cases(max_B=s.max_B, max_T=s.max_T, **_case_kw(s, kw)),
                                  "initial": st.booleans(), "final": st.booleans()})


#: chunk sizes drawn by the chunk lanes (the boundary cases take ``Sizes.edge_chunks``).
CHUNK_SIZES = (1, 2, 3, 5, 8, 16, 32, 64)


def _long(s: Sizes, **over) -> dict:
    """The chunk-boundary lengths of ``s`` for ``strategies.chunk_cases`` / ``prefill_setups``."""
    return dict(dict(long_T=s.long_T, long_B=s.long_B, long_HV=s.long_HV, long_dims=s.long_dims), **over)


def _direct_params(s, kw):
    """Direct mode: T around every multiple of 16, 32, 64 (a direct kernel chunks internally: 64 in
    kvbuffer_fast and fla) two thirds of the time (``strategies.chunk_cases``)."""
    from hypothesis import strategies as st
    return st.fixed_dictionaries({"case": kst.chunk_cases(max_B=s.max_B, max_T=min(s.max_T, s.direct_T),
                                                          **_long(s, long_T=min(s.long_T, s.direct_T)),
                                                          **_case_kw(s, kw))})


def _chunk_params(s, kw):
    """A chunk size, then T around its boundaries (c - 1 .. 2c + 1) and the multiples of 16, 32, 64 two thirds
    of the time (``strategies.chunk_cases``)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        cs = d(st.sampled_from(CHUNK_SIZES), label="chunk_size")
        case = d(kst.chunk_cases(max_B=s.max_B, max_T=s.max_T + 8, chunk_size=cs, **_long(s), **_case_kw(s, kw)),
                 label="case")
        return dict(case=case, chunk_size=cs, initial=d(st.booleans(), label="initial"),
                    final=d(st.booleans(), label="final"))
    return draw()


def _varlen_params(s, kw, chunked: bool):
    """A case of B >= 1 requests, each cut to a drawn length in 0..T (empty sequences included), for the
    cu_seqlens lanes; chunk sizes as the chunk lane's.  Chunked: T, and each sequence's length, around the
    chunk boundaries half of the time (sequences of 63, 64, 65 tokens packed one after the other: each
    starts at an offset that is no multiple of the chunk)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        cs = d(st.sampled_from(CHUNK_SIZES), label="chunk_size") if chunked else None
        if chunked:
            case = d(kst.chunk_cases(max_B=max(2, s.max_B), max_T=s.max_T + 8, chunk_size=cs,
                                     **_long(s, long_B=max(2, s.long_B)), **_case_kw(s, kw)), label="case")
        else:
            case = d(kst.cases(max_B=max(2, s.max_B), max_T=s.max_T + 8, **_case_kw(s, kw)), label="case")
        # an empty sequence a third of the time (the empty-sequence path: its state is its initial state)
        one = [st.integers(0, case.T), st.just(0), st.just(case.T)]
        if chunked:
            one.append(kst.lengths_near(case.T, cs))
        lengths = d(st.lists(st.one_of(*one), min_size=case.B, max_size=case.B), label="seq_lengths")
        p = dict(case=case, seq_lengths=lengths, initial=d(st.booleans()), final=d(st.booleans()))
        if chunked:
            p["chunk_size"] = cs
        return p
    return draw()


def _buffer_params(s, kw, min_new=0):
    return kst.buffer_setups(max_capacity=s.max_capacity, max_history=s.max_history, min_new=min_new,
                             max_new=s.max_new, max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


def _flush_params(s, kw):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        p = d(_buffer_params(s, kw, min_new=1))
        steps = p["case"].T - p["history"]
        p["flushes"] = d(kst.flush_schedules(p["case"].B, steps, p["capacity"], min_flushes=1, lengths=p["lengths"]),
                         label="flushes")
        p.update(d(kst.index_args(), label="index arguments"))
        return p
    return draw()


def _materialize_params(s, kw):
    return kst.buffer_setups(max_capacity=s.max_capacity, max_history=s.max_history, min_new=0, max_new=0,
                             max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


def _chain_params(s, kw):
    return kst.chain_setups(max_capacity=s.max_capacity, max_B=s.max_B, max_drafts=s.max_chain,
                            max_history=s.max_history, max_after=s.max_after, big_capacity=s.big_capacity,
                            **_case_kw(s, kw))


def _tree_params(s, kw):
    return kst.tree_setups(max_capacity=s.max_capacity, max_B=s.max_B, max_drafts=s.max_tree,
                           max_history=s.max_history, max_after=s.max_after, big_capacity=s.big_capacity,
                           **_case_kw(s, kw))


def _prefill_params(s, kw):
    return kst.prefill_setups(max_capacity=s.max_capacity, max_prompt=s.max_prompt, max_new=s.max_new // 2 + 1,
                              max_B=s.max_B, big_capacity=s.big_capacity, **_long(s), **_case_kw(s, kw))


#: The gate regimes of the engine_inputs lane (``properties.engine_case_inputs``): "wide" (a in [-30, 40] around
#: and past the softplus threshold, A_log in [-5, 3], dt_bias in [-5, 5]), "reset" (the same with a and b = +-inf
#: too) and "mild" (a in [-3, 3]); only those the implementation's gate domain allows (``gates = "finite"``: no
#: "reset").  Hypothesis shrinks towards the first.
ENGINE_GATES = ("wide", "reset", "wide", "mild")


def _engine_params(s, kw):
    """The engine_inputs lane: the decode form (mixed_qkv [N, D], N = B) half of the time, else [B, T, D];
    heads as the other lanes draw them (HV a multiple of H; the ``gpu`` profile's head shapes), norms of the q
    and k rows "any" (tiny and large rows) three times in four."""
    from hypothesis import strategies as st

    gates = [g for g in ENGINE_GATES if g in kw.get("gates", GATES)]

    @st.composite
    def draw(d):
        if s.head_shapes:
            H, HV, K, V = d(st.sampled_from(s.head_shapes), label="head shape")
        else:
            H = d(st.integers(1, s.max_H), label="H")
            HV = H * d(st.integers(1, s.max_group), label="group")
            K, V = d(st.sampled_from(s.dims), label="K"), d(st.sampled_from(s.dims), label="V")
        decode = d(st.booleans(), label="decode")
        B = d(st.integers(1, s.max_B + (3 if decode else 0)), label="B")
        T = 1 if decode else d(st.integers(1, s.max_T), label="T")
        case = Case(B=B, T=T, H=H, HV=HV, K=K, V=V, gate=d(st.sampled_from(gates), label="gate"),
                    norm=d(st.sampled_from(("any", "unit", "any", "any")), label="norm"),
                    seed=d(st.integers(0, 2 ** 31 - 2), label="seed"), beta_max=kw.get("beta_max", 1.0),
                    qk_l2norm=kw.get("qk_l2norm", False))
        return dict(case=case, decode=decode)
    return draw()


# ----------------------------------------------------------------------------- anchor cases
# A few fixed cases per operation that every run checks first (hypothesis explicit examples), before
# the fresh random ones: each hits the paths a kernel is most likely to get wrong at once, whatever
# the seed: more cached rows than a 16-row tile (C = 18), grouped heads (the boundary cases,
# ``edge_params``, cross the column, key and row tiles), a direct-mode request whose full buffer folds, requests that own a state
# and fill up, partial flushes that keep entries, acceptances past the capacity, both gate kinds.
def _anchors() -> dict:
    def c(B, T, H, HV, K, V, channel, gate="mild", beta="uniform", seed=1, scale=None):
        return Case(B=B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel, gate=gate, beta=beta, seed=seed,
                    scale=scale)

    return {
        "recurrent": [dict(case=c(2, 3, 2, 4, 8, 12, False), initial=True, final=True),
                      dict(case=c(1, 3, 1, 2, 5, 7, True, "strong", scale=0.6), initial=True, final=False)],
        "recurrent_decode": [dict(case=c(2, 3, 2, 4, 8, 12, False), initial=True, final=True),
                             dict(case=c(1, 3, 1, 2, 5, 7, True, "strong", scale=0.6), initial=True, final=False)],
        "chunk": [dict(case=c(2, 11, 2, 4, 7, 5, False), chunk_size=4, initial=True, final=True),
                  dict(case=c(1, 9, 1, 2, 5, 6, True, "strong", scale=0.6), chunk_size=3, initial=True, final=False)],
        "direct": [dict(case=c(2, 7, 2, 4, 7, 5, False)), dict(case=c(1, 6, 1, 2, 5, 6, True, "strong"))],
        # variable-length batches: an empty sequence before, between and after non-empty ones, lengths in no
        # sorted order (an initial state read by position among the non-empty sequences, or final states left
        # in a length-sorted order, fails), a sequence crossing chunks
        "recurrent_varlen": [dict(case=c(4, 7, 2, 4, 6, 5, False), seq_lengths=[3, 0, 7, 1], initial=True, final=True),
                             dict(case=c(3, 9, 1, 2, 5, 7, True, "strong", scale=0.6), seq_lengths=[0, 9, 4],
                                  initial=True, final=True)],
        "chunk_varlen": [dict(case=c(4, 11, 2, 4, 6, 5, False), seq_lengths=[5, 0, 11, 2], chunk_size=4, initial=True,
                              final=True),
                         dict(case=c(3, 9, 1, 2, 5, 7, True, "strong", scale=0.6), seq_lengths=[0, 9, 4], chunk_size=3,
                              initial=True, final=True)],
        "decode": [dict(case=c(3, 6, 2, 4, 8, 12, False), capacity=6, history=4, lengths=[4, 2, 4]),
                   dict(case=c(3, 21, 2, 4, 8, 12, False), capacity=18, history=18, lengths=[18, 17, 5]),
                   dict(case=c(2, 11, 1, 2, 5, 7, True, "strong", scale=0.6), capacity=3, history=7, lengths=[3, 1])],
        "flush": [dict(case=c(2, 12, 2, 4, 6, 12, False), capacity=5, history=9, lengths=[5, 4],
                       flushes={0: [3, 2], 1: None, 2: [1, 0]}),
                  dict(case=c(2, 7, 1, 2, 3, 5, True, "strong"), capacity=4, history=4, lengths=[4, 2],
                       flushes={0: [2, 1], 2: [1, 2]})],
        # an empty buffer over a folded state; a buffer without state storage (every request in direct mode)
        "materialize": [dict(case=c(2, 18, 2, 4, 8, 12, False), capacity=18, lengths=[18, 3]),
                        dict(case=c(2, 6, 1, 2, 5, 6, True, "strong"), capacity=4, lengths=[4, 2]),
                        dict(case=c(1, 5, 1, 2, 4, 3, False), capacity=3, lengths=[0]),
                        dict(case=c(2, 3, 1, 2, 3, 4, True), capacity=3, lengths=[3, 3], stateless=True)],
        "verify_chain": [dict(case=c(2, 13, 2, 4, 6, 12, False), capacity=4, history=6, lengths=[4, 2],
                              parents=[[-1, 0, 1, 2, 3]] * 2, num_drafts=[5, 3], nodes=[4, 1], after=2,
                              use_counts=True)],
        "verify_tree": [dict(case=c(2, 13, 1, 2, 5, 7, True, "strong"), capacity=3, history=5, lengths=[3, 1],
                             parents=[[-1, 0, 0, 1, 3, -1], [-1, 0, -1, 2, 3, 4]], num_drafts=[6, 4],
                             nodes=[4, 3], after=2, use_counts=False)],
        # engine_inputs: decode rows [N, D] with grouped heads, a [B, T, D] batch, one [1, T, D] varlen batch
        "engine_inputs": [dict(case=replace(c(3, 1, 2, 4, 8, 12, False, "wide"), norm="any"), decode=True),
                          dict(case=c(2, 5, 1, 2, 5, 7, False, "wide", seed=2), decode=False),
                          dict(case=replace(c(1, 9, 2, 6, 16, 3, False, "wide", seed=3), norm="any"), decode=False)],
        "prefill": [dict(case=c(2, 13, 2, 4, 6, 7, False), capacity=4, prompt=10, tail=None, chunk_size=3),
                    dict(case=c(1, 8, 1, 2, 5, 6, True, "strong", scale=0.6), capacity=3, prompt=6, tail=3, chunk_size=4,
                         initial=True)],
    }


ANCHORS = _anchors()


def op_params(p: dict) -> dict:
    """An operation's parameters without its ``case`` and ``layout`` (what the property takes besides)."""
    return {k: v for k, v in p.items() if k not in ("case", "layout", "edge")}


# ----------------------------------------------------------------------------- boundary cases
def edge_params(key: str, s: Sizes, seed: int = 1, channel: bool = True) -> list[dict]:
    """The boundary cases of operation ``key`` for the size budget ``s``: each crosses one usual tile size
    (``Sizes.edge_*``: requests past a batch tile, value heads past a head tile with groups, K and V past
    the column and key tiles, tokens and history past time blocks, buffered rows past a row tile, chunk
    sizes 16/32/64 with T crossing chunks), the other dimensions at ``Sizes.edge_base``.  Every lane of
    the operation checks them once per run (contents from ``seed``); ``edge`` names the boundary crossed
    (a failure on one that no simpler change explains is reported as ``tile-boundary``).

    The chunk-like operations (chunk, chunk_varlen, direct, prefill) cross every chunk boundary: for each
    c of ``Sizes.edge_chunks`` (16, 32, 64), T (a prompt's folded head; each sequence of a varlen batch) =
    c - 1, c, c + 1, 2c - 1, 2c, 2c + 1 (``chunk_lengths``), with the chunk size c (direct mode has none:
    its kernel's own chunk, 64 in kvbuffer_fast and fla, is among them).  With ``Sizes.head_shapes`` (the
    ``gpu`` profile) the operation's anchors after the first also run, at those head shapes."""
    base = dict(zip(("B", "H", "HV", "K", "V"), s.edge_base))
    H, HV = s.edge_HV
    big = []
    if s.edge_B:
        big.append((f"B={s.edge_B}", dict(B=s.edge_B)))
    big.append((f"HV={HV} (H={H})", dict(B=1, H=H, HV=HV)))
    big += [(f"K={K},V={V}", dict(B=1, H=min(base["H"], 2), HV=min(base["HV"], 2), K=K, V=V))
            for K, V in s.edge_dims]

    def c(T, gate="mixed", **kw):
        kw = {**base, **kw}
        return Case(T=T, channel_gate=channel, gate=gate, beta="uniform", norm="any", seed=seed, scale=0.7, **kw)

    T, C, B1 = s.edge_T, s.edge_rows, min(base["B"], 2)
    near = [(cs, n) for cs in s.edge_chunks for n in chunk_lengths(cs)]  # (chunk, T) around every boundary
    # edge_T far past the longest of them (the gpu profile's 4096): still its own case; else they cross it
    longer = T > 2 * max(n for _, n in near)

    def ragged(B, n):  # lengths cycling through full, one short, and empty-ish
        return [(n, max(n - 2, 0), 1)[b % 3] for b in range(B)]

    out = []
    if key in ("recurrent", "recurrent_decode", "direct"):
        extra = {} if key == "direct" else dict(initial=True, final=True)
        out = [dict(case=c(3, **d), edge=e, **extra) for e, d in big]
        if key != "direct":
            out.append(dict(case=c(T, B=B1), edge=f"T={T}", **extra))
        else:  # every length around a multiple of 16, 32 and 64 (a kernel's own chunk), up to Sizes.direct_T
            out += [dict(case=c(n, B=B1), edge=f"T={n}") for n in sorted({n for _, n in near if n <= s.direct_T})]
            T = min(T, s.direct_T)
            if T > 2 * max(n for _, n in near):
                out.append(dict(case=c(T, B=B1), edge=f"T={T}"))
        if key == "direct":  # mild gates: the history before a time block still matters at its end (the mixed
            # gates' underflows reset it, so a block restarting from zero errs by 1e-3, below 16-bit contracts);
            # K = 16 keeps the chunks well conditioned, so the bf16 budget stays below that bug's 1e-1
            out.append(dict(case=c(T, B=B1, gate="mild", K=16), edge=f"T={T}, mild gates"))
    elif key == "chunk":
        out = [dict(case=c(n, B=B1), chunk_size=cs, initial=True, final=True, edge=f"T={n},chunk={cs}")
               for cs, n in near]
        if longer:
            out += [dict(case=c(T, B=B1), chunk_size=cs, initial=True, final=True, edge=f"T={T},chunk={cs}")
                    for cs in s.edge_chunks]
        out += [dict(case=c(20, **d), chunk_size=s.edge_chunks[0], initial=True, final=True, edge=e) for e, d in big]
    elif key == "chunk_varlen":  # per chunk size: sequences of every length around its boundaries packed one after
        # the other (each starting off the chunk grid), an empty one among them
        for cs in s.edge_chunks:
            ls = chunk_lengths(cs)
            ls = [ls[0], 0, ls[-1]] + ls[1:-1]
            out.append(dict(case=c(max(ls), B=len(ls)), seq_lengths=ls, chunk_size=cs, initial=True, final=True,
                            edge=f"seq_lengths={ls},chunk={cs}"))
    elif key in ("decode", "flush"):
        out = [dict(case=c(5, **d), capacity=3, history=3, lengths=ragged(d.get("B", base["B"]), 3), edge=e)
               for e, d in big]
        out += [dict(case=c(T + 3, B=1), capacity=8, history=T, lengths=[5], edge=f"history={T}"),
                dict(case=c(C + 3, B=2), capacity=C, history=C, lengths=[C, C - 3], edge=f"rows={C}")]
        for p in out:  # a single-request case holding its whole history has no state storage (state=None)
            p["stateless"] = True
        if key == "flush":  # partial flushes across the boundary (all of them on the rows case), counts shared by
            # every request passed as a Python int, counts as int32 tensors
            for p in out:
                steps = p["case"].T - p["history"]
                p["flushes"] = {0: [1] * p["case"].B, steps - 1: [0] * p["case"].B}
                p.update(index_dtype="int32", scalar=True)
            out[-1]["flushes"] = {0: [C - 1, 0], 1: None, 2: [1, 1]}
    elif key == "materialize":
        out = [dict(case=c(4, **d), capacity=3, lengths=ragged(d.get("B", base["B"]), 3), edge=e) for e, d in big]
        out += [dict(case=c(C + 2, B=2), capacity=C, lengths=[C, 5], edge=f"rows={C}"),
                dict(case=c(T, B=1), capacity=8, lengths=[8], edge=f"history={T}")]
    elif key in ("verify_chain", "verify_tree"):
        chain = key == "verify_chain"
        n = s.edge_tree

        def dr(B, n):
            par = list(range(-1, n - 1)) if chain else [-1] + [i // 2 for i in range(n - 1)]
            # full chains passed as the defaults (parents=None, num_drafts=None); int32 parents and counts; an
            # accepted count or node every request shares passed as a Python int
            return dict(parents=[par] * B, num_drafts=[n] * B, nodes=[n - 1 - (b % 2) for b in range(B)],
                        use_counts=chain, defaults=chain, index_dtype="int32", scalar=True)
        out = [dict(case=c(3 + 3 + 1, **d), capacity=3, history=3, lengths=[3] * d.get("B", base["B"]), after=1,
                    edge=e, **dr(d.get("B", base["B"]), 3)) for e, d in big]
        out += [dict(case=c(T + 3 + 1, B=1), capacity=8, history=T, lengths=[6], after=1, edge=f"history={T}",
                     **dr(1, 3)),
                dict(case=c(C + n + 1, B=2), capacity=C, history=C, lengths=[C, C - 2], after=1,
                     edge=f"rows={C},drafts={n}", **dr(2, n))]
    elif key == "prefill":  # the folded head (prompt - tail) around every boundary of its chunk size; the prompt
        # itself too (tail 0), or 3 tokens more kept in the buffer
        out = [dict(case=c(n + 3 * (i % 2) + 2, B=1), capacity=8, prompt=n + 3 * (i % 2), tail=3 * (i % 2),
                    chunk_size=cs, initial=True, edge=f"prompt={n + 3 * (i % 2)},tail={3 * (i % 2)},chunk={cs}")
               for i, (cs, n) in enumerate(near)]
        # the default tail (None) of a prompt of two chunks, a multiple of the capacity: an empty tail
        out += [dict(case=c(2 * cs + 2, B=1), capacity=8, prompt=2 * cs, tail=None, chunk_size=cs, initial=True,
                     edge=f"prompt={2 * cs},tail=None,chunk={cs}") for cs in s.edge_chunks]
        if longer:
            out += [dict(case=c(T + 2, B=1), capacity=8, prompt=T, tail=None, chunk_size=cs, initial=True,
                         edge=f"prompt={T},chunk={cs}") for cs in s.edge_chunks]
        out += [dict(case=c(6, **d), capacity=3, prompt=5, tail=None, chunk_size=s.edge_chunks[0], initial=True,
                     edge=e) for e, d in big]
        out += [dict(case=c(C + 2, B=1), capacity=C, prompt=C, tail=None, chunk_size=s.edge_chunks[0], initial=False,
                     edge=f"rows={C}")]
    elif key == "engine_inputs":  # decode rows [N, D] past a batch tile, value heads past a head tile, K and V past
        # the column tiles; one varlen batch [1, T, D] of T tokens
        out = [dict(case=c(1, gate="wide", **d), decode=True, edge=e) for e, d in big]
        out.append(dict(case=c(T, B=1, gate="wide"), decode=False, edge=f"T={T}"))
    if s.head_shapes:  # production sizes: the operation's other anchors at the drawn head shapes
        for i, a in enumerate(ANCHORS.get(key, [])[1:]):
            H_, HV_, K_, V_ = s.head_shapes[(i + 1) % len(s.head_shapes)]
            case = replace(a["case"], H=H_, HV=HV_, K=K_, V=V_, channel_gate=a["case"].channel_gate and channel)
            out.append(dict(a, case=case, edge=f"anchor {i + 2} at H={H_},HV={HV_},K={K_},V={V_}"))
    return [dict(p, layout=False) for p in out]


def chunk_lengths(c: int) -> list[int]:
    """The lengths around the boundaries of a chunk of ``c`` tokens: c - 1, c, c + 1 (a partial chunk, a full
    one, one token past it) and 2c - 1, 2c, 2c + 1 (the same with a chunk before)."""
    return list(dict.fromkeys(n for n in (c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1) if n >= 1))


OPS: tuple[Op, ...] = (
    Op("recurrent", ("recurrent_gated_delta_rule",), "recurrent form (output and final state) from a random state",
       _cases, lambda o, p, dt, dev, f: P.check_recurrent(o, p["case"], dt, device=dev, initial=p.get("initial", True),
                                                          final=p.get("final", True))),
    Op("recurrent_decode", ("recurrent_decode",), "in-place single-token step, run once per token",
       _cases, lambda o, p, dt, dev, f: P.check_recurrent(stepwise_recurrent(o.recurrent_decode), p["case"], dt,
                                                          device=dev, initial=p.get("initial", True),
                                                          final=p.get("final", True))),
    Op("chunk", ("chunk_gated_delta_rule",), "chunkwise form, any T and chunk size",
       _chunk_params, lambda o, p, dt, dev, f: P.check_chunk(o, p["case"], dt, chunk_size=p["chunk_size"], device=dev,
                                                             with_initial_state=p.get("initial", True),
                                                             final=p.get("final", True))),
    Op("recurrent_varlen", ("recurrent_gated_delta_rule",),
       "variable-length batch by cu_seqlens (empty sequences too) == each sequence alone",
       lambda s, kw: _varlen_params(s, kw, False),
       lambda o, p, dt, dev, f: P.check_varlen(o, p["case"], dt, lengths=p["seq_lengths"], device=dev,
                                               initial=p.get("initial", True), final=p.get("final", True))),
    Op("chunk_varlen", ("chunk_gated_delta_rule",),
       "chunkwise form of a variable-length batch by cu_seqlens == each sequence alone",
       lambda s, kw: _varlen_params(s, kw, True),
       lambda o, p, dt, dev, f: P.check_varlen(o, p["case"], dt, lengths=p["seq_lengths"], device=dev,
                                               chunk_size=p["chunk_size"], initial=p.get("initial", True),
                                               final=p.get("final", True))),
    Op("direct", ("direct_gated_delta_rule",), "direct mode (no state) == recurrence from zero",
       _direct_params, lambda o, p, dt, dev, f: P.check_direct(o, p["case"], dt, device=dev)),
    Op("decode", ("buffered_decode", "flush"), "buffered decode after ragged buffers (unused slots poisoned)",
       _buffer_params, lambda o, p, dt, dev, f: P.check_decode(o, p["case"], dt, form=f, device=dev, poison=True,
                                                               **op_params(p))),
    Op("flush", ("buffered_decode", "flush"), "flush schedules (partial, repeated) are invisible",
       _flush_params, lambda o, p, dt, dev, f: P.check_decode(o, p["case"], dt, form=f, device=dev, poison=True,
                                                              **op_params(p))),
    Op("materialize", ("materialize_state",), "materialize_state == the recurrence's state, buffer unchanged",
       _materialize_params, lambda o, p, dt, dev, f: P.check_materialize(
           o, p["case"], dt, capacity=p["capacity"], lengths=p["lengths"], form=f, device=dev, poison=True)),
    Op("verify_chain", ("verify", "accept", "buffered_decode", "flush"),
       "chain verify of ragged drafts, accept counts, decode on",
       _chain_params, lambda o, p, dt, dev, f: P.check_verify_accept(o, p["case"], dt, form=f, device=dev,
                                                                     poison=True, **op_params(p))),
    Op("verify_tree", ("verify", "accept", "buffered_decode", "flush"),
       "tree verify (per-path recurrence), accept a node, decode on",
       _tree_params, lambda o, p, dt, dev, f: P.check_verify_accept(o, p["case"], dt, form=f, device=dev,
                                                                    poison=True, **op_params(p))),
    Op("prefill", ("prefill", "buffered_decode", "flush"), "prefill hand-off at any split, then decode",
       _prefill_params, lambda o, p, dt, dev, f: P.check_prefill(o, p["case"], dt, form=f, device=dev, **op_params(p))),
    Op("engine_inputs", ("engine_inputs",),
       "an engine's packed q|k|v and raw gates -> q, k, v, g, beta == the float64 map (kvbuffer_ref.engine_inputs)",
       _engine_params, lambda o, p, dt, dev, f: P.check_engine_inputs(o, p["case"], dt, device=dev,
                                                                      decode=p.get("decode", False))),
)
#: Operations that pass ``cu_seqlens``: run only for attributes the adapter lists in ``varlen``.
VARLEN_OPS = {"recurrent_varlen", "chunk_varlen"}
#: Operations whose lanes exist once per buffer form.
FORM_OPS = {"decode", "flush", "materialize", "verify_chain", "verify_tree", "prefill"}
OP_KEYS = tuple(o.key for o in OPS)



def select_ops(spec: Optional[str]) -> list[tuple[str, Optional[str]]]:
    """--ops 'decode,verify_tree[u]' -> [(key, form or None)]; None = every operation."""
    if spec is None or not spec.strip():
        return [(k, None) for k in OP_KEYS]
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"([a-z_]+)(?:\[(u|raw)\])?", item)
        if not m or m.group(1) not in OP_KEYS:
            raise ValidationError(f"--ops: unknown operation {item!r}; known: {', '.join(OP_KEYS)} "
                                  f"(a buffer operation may name its form, e.g. decode[u])")
        if m.group(2) and m.group(1) not in FORM_OPS:
            raise ValidationError(f"--ops: {m.group(1)} has no buffer form, got {item!r}")
        out.append((m.group(1), m.group(2)))
    if not out:
        raise ValidationError("--ops: no operation given")
    return out


def parse_dtypes(spec: Optional[str]) -> Optional[list[torch.dtype]]:
    if spec is None or not spec.strip():
        return None
    out = []
    for name in (x.strip().lower().replace("torch.", "") for x in spec.split(",")):
        if name not in DTYPES:
            raise ValidationError(f"--dtype: unknown dtype {name!r}; known: float64, float32, float16, bfloat16")
        if DTYPES[name] not in out:
            out.append(DTYPES[name])
    return out


# ----------------------------------------------------------------------------- plan
@dataclass
class Lane:
    """One (operation, implementation, dtype) to run, or a row saying why it is not run."""

    op: Op
    impl: Implementation
    dtype: Optional[torch.dtype]
    status: str = "RUN"  # RUN, or NOT PROVIDED / SKIP / NOT RUN (the implementation cannot run here) with a reason
    reason: str = ""


def plan(impls: Sequence[Implementation], ops=None, dtypes: Optional[Sequence[torch.dtype]] = None,
         device: str = "cpu") -> list[Lane]:
    """Every lane: what runs, and for everything else a NOT PROVIDED / NOT RUN row with its reason.  dtypes
    None: every dtype each implementation declares (bfloat16 of an interpreted one: NOT RUN)."""
    selected = ops or [(k, None) for k in OP_KEYS]
    lanes = []
    for impl in impls:
        for op in OPS:
            wanted = [f for k, f in selected if k == op.key]
            if not wanted:
                continue
            if impl.unavailable:
                lanes.append(Lane(op, impl, None, "NOT RUN", impl.unavailable))
                continue
            missing = [a for a in op.needs if not impl.has(a) or a in impl.not_provided]
            if op.name in impl.not_provided:  # the lane itself left out (e.g. verify_tree of a chain kernel)
                missing = [op.name]
            if not missing and op.key in VARLEN_OPS and not all(a in impl.varlen for a in op.needs):
                lanes.append(Lane(op, impl, None, "NOT PROVIDED", f"the adapter does not declare cu_seqlens for "
                                  f"{', '.join(op.needs)} (varlen = its attribute names)"))
                continue
            if not missing and impl.qk_l2norm and op.key in FORM_OPS:
                lanes.append(Lane(op, impl, None, "NOT PROVIDED", "the adapter normalises q and k in the kernel "
                                  "(qk_l2norm): the buffer operations take the caller's normalised keys"))
                continue
            if missing:
                reasons = [impl.not_provided[a] for a in missing if a in impl.not_provided]
                why = reasons[0] if reasons else f"the adapter has no {', '.join(missing)}"
                lanes.append(Lane(op, impl, None, "NOT PROVIDED", why))
                continue
            if op.key in FORM_OPS:
                forms = sorted({f for f in wanted if f} or {"u", "raw"}, key=["u", "raw"].index)
                variants = [op.with_form(f) for f in forms if f in impl.forms]
                absent = [op.with_form(f) for f in forms if f not in impl.forms]
            else:
                variants, absent = [op], []
            if dtypes is None:  # every declared dtype (those that cannot run here become NOT RUN rows)
                use = [d for d in DEFAULT_DTYPES if d in impl.dtypes] + [d for d in impl.dtypes
                                                                         if d not in DEFAULT_DTYPES]
            else:
                use = list(dtypes)
            for v in variants:
                for dt in use:
                    if dt not in impl.dtypes:
                        lanes.append(Lane(v, impl, dt, "NOT PROVIDED",
                                          f"the adapter declares dtypes {[dtype_name(d) for d in impl.dtypes]}"))
                    elif dt == torch.bfloat16 and impl.interpreted:
                        lanes.append(Lane(v, impl, dt, "NOT RUN", INTERPRETER_BF16))
                    else:
                        lanes.append(Lane(v, impl, dt))
            for v in absent:
                lanes.append(Lane(v, impl, None, "NOT PROVIDED", f"the adapter declares buffer forms {list(impl.forms)}"))
    return lanes
