"""Hypothesis strategies for gated-delta-rule inputs, buffers and drafts.

Everything drawn is small and shrinks well: shapes (non-power-of-two K and V, grouped heads
H < HV, T not a multiple of the chunk size), gate and beta regimes (g exactly 0 up to underflowing
decays; beta 0, 1 and in between), zero keys, ragged buffer lengths 0..C, draft trees and
acceptances.  Tensors are built from a drawn seed (``Case.inputs``).
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cases import BETA_REGIMES, GATE_REGIMES, Case

__all__ = ["head_dims", "cases", "buffer_lengths", "draft_tree", "draft_batch", "acceptances", "CHUNK_MARKS",
           "boundary_lengths", "lengths_near", "chunk_cases"]

#: Head dimensions drawn by default: tiny, non-powers of two and powers of two.
HEAD_DIMS = (1, 2, 3, 5, 7, 8, 12, 16)


def head_dims(choices=HEAD_DIMS):
    return st.sampled_from(choices)


@st.composite
def cases(draw, *, max_B: int = 3, min_T: int = 1, max_T: int = 12, max_H: int = 2, max_group: int = 3,
          dims=HEAD_DIMS, channel_gate=None, gate=None, beta=None, zero_key=None, B=None, T=None,
          gates=GATE_REGIMES, betas=BETA_REGIMES, norms=("unit",), v_scales=(1.0,), scales=(None,),
          beta_max: float = 1.0, qk_l2norm: bool = False, head_shapes=(), raw_gate_dtype: str = "") -> Case:
    """A ``Case``; pin any field by passing it (e.g. ``channel_gate=False``, ``T=1``).

    gates, betas: the regimes drawn from, in order of preference (hypothesis draws and shrinks
    towards the first ones; ``kvbuffer validate`` puts the informative regimes first).  norms,
    v_scales, scales: the q/k norm regimes, the scales of v and the explicit ``scale`` values (None:
    the default) drawn from; beta_max: the top of the beta domain; qk_l2norm: the implementation
    normalises q and k itself (``Case.qk_l2norm``); raw_gate_dtype: it takes raw gates rounded to that dtype
    (``Case.raw_gate_dtype``); head_shapes: (H, HV, K, V) drawn together from this
    list instead (``Sizes.head_shapes``: few shapes, so compiled kernels share compiles)."""
    if head_shapes:
        H, HV, K, V = draw(st.sampled_from(head_shapes), label="head shape")
    else:
        H = draw(st.integers(1, max_H))
        HV, K, V = H * draw(st.integers(1, max_group)), draw(head_dims(dims)), draw(head_dims(dims))
    return Case(
        B=B if B is not None else draw(st.integers(1, max_B)),
        T=T if T is not None else draw(st.integers(min_T, max_T)),
        H=H,
        HV=HV,
        K=K,
        V=V,
        channel_gate=channel_gate if channel_gate is not None else draw(st.booleans()),
        gate=gate if gate is not None else draw(st.sampled_from(gates)),
        beta=beta if beta is not None else draw(st.sampled_from(betas)),
        zero_key=zero_key if zero_key is not None else draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        norm=draw(st.sampled_from(norms)),
        v_scale=draw(st.sampled_from(v_scales)),
        scale=draw(st.sampled_from(scales)),
        beta_max=beta_max,
        qk_l2norm=qk_l2norm,
        raw_gate_dtype=raw_gate_dtype,
    )


#: Kernels with a fixed internal chunk or time block (fla's 64, tiles of 16 and 32): lengths are drawn around
#: every multiple of these, whatever ``chunk_size`` argument the kernel is given.
CHUNK_MARKS = (16, 32, 64)


def boundary_lengths(most: int, chunk_size=None, marks=CHUNK_MARKS, least: int = 1) -> list[int]:
    """Lengths in least..most around the chunk boundaries: m - 1, m, m + 1 for every multiple m of each of
    ``marks`` (16, 32, 64: a kernel's own chunk or tile, e.g. fla's 64) and, for ``chunk_size`` c, c - 1, c,
    c + 1, 2c - 1, 2c, 2c + 1 (one chunk short of full, full, one past; two chunks the same).  Sorted, the
    ones around the chunk size first (what the strategies shrink to)."""
    own = []
    if chunk_size:
        own = [m + d for m in (chunk_size, 2 * chunk_size) for d in (-1, 0, 1)]
    rest = [m + d for b in marks for m in range(b, most + 2, b) for d in (-1, 0, 1)]
    out = []
    for n in own + sorted(set(rest)):
        if least <= n <= most and n not in out:
            out.append(n)
    return out


def lengths_near(most: int, chunk_size=None, least: int = 1):
    """One of ``boundary_lengths`` (shrinking towards the chunk size's own), or none in range: ``least``."""
    opts = boundary_lengths(most, chunk_size, least=least)
    return st.sampled_from(opts) if opts else st.just(least)


@st.composite
def chunk_cases(draw, *, max_T: int, min_T: int = 1, chunk_size=None, long_T: int = 0, long_B: int = 1,
                long_HV: int = 2, long_dims=(8,), **case_kw) -> Case:
    """A ``Case`` of a chunk-like operation (chunk, direct, prefill): T in min_T..max_T as ``cases`` draws it
    (a third of the time), or around a chunk boundary (``boundary_lengths`` up to ``long_T``, with the
    ``chunk_size`` of the example).  A case longer than ``max_T`` is kept cheap: B <= long_B, HV <= long_HV
    (H = 1, or a group of 2 when long_HV allows), K and V from ``long_dims`` (with ``head_shapes``: those
    shapes, B <= long_B)."""
    near = lengths_near(max(long_T, max_T), chunk_size, least=min_T)
    T = draw(st.one_of(near, st.integers(min_T, max_T), near), label="T")
    if T > max_T:
        case_kw = _long_kw(case_kw, long_B, long_HV, long_dims)
    return draw(cases(T=T, **case_kw), label="case")


def _long_kw(case_kw: dict, long_B: int, long_HV: int, long_dims) -> dict:
    """``case_kw`` of a long case: B <= long_B; H = 1 or a group of 2 within long_HV value heads, K and V from
    ``long_dims`` (unless the heads come from ``head_shapes``)."""
    out = dict(case_kw, max_B=min(case_kw.get("max_B", 3), long_B))
    if not out.get("head_shapes"):
        group = 2 if long_HV >= 2 else 1
        out.update(max_H=max(1, min(out.get("max_H", 2), long_HV // group)), max_group=group, dims=long_dims)
    return out


def buffer_lengths(B: int, capacity: int):
    """Ragged per-request buffer lengths, each in 0..capacity."""
    return st.lists(st.integers(0, capacity), min_size=B, max_size=B)


@st.composite
def draft_tree(draw, *, max_nodes: int = 12, max_depth: int = 8, max_branch: int = 4) -> list[int]:
    """Parent indices of one request's draft tree (-1 = the buffer's tail), in topological order.

    Depth <= max_depth, at most max_branch children per node (the root counts as a node).
    """
    n = draw(st.integers(1, max_nodes))
    parents, depth, children = [], [], {-1: 0}
    for i in range(n):
        allowed = [p for p in range(-1, i) if children.get(p, 0) < max_branch and (p < 0 or depth[p] < max_depth)]
        p = draw(st.sampled_from(allowed))
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        children[p] = children.get(p, 0) + 1
    return parents


@st.composite
def draft_batch(draw, B: int, *, max_drafts: int = 8, chain: bool = False, ragged: bool = True):
    """(parents [B][D] padded with chain values, num_drafts [B]) for B requests; D = the largest count."""
    if chain:
        counts = [draw(st.integers(0 if ragged else max_drafts, max_drafts)) for _ in range(B)]
        trees = [list(range(-1, c - 1)) for c in counts]
    else:
        trees = [draw(draft_tree(max_nodes=max_drafts)) for _ in range(B)]
        if ragged:
            trees = [t[: draw(st.integers(0, len(t)))] for t in trees]
        counts = [len(t) for t in trees]
    D = max(max(counts), 1)
    parents = [t + list(range(len(t) - 1, D - 1)) for t in trees]
    return parents, counts


def acceptances(num_drafts: list[int]):
    """One accepted node per request: -1 (none) up to num_drafts[b] - 1."""
    return st.tuples(*[st.integers(-1, d - 1) for d in num_drafts]).map(list)


# ----------------------------------------------------------------------------- operation setups
# Composite draws of one operation's parameters (for ``kvbuffer validate``; the property tests
# may use them too).  Each returns a dict of keyword arguments for the matching ``properties.check_*``
# plus ``case``; every size is bounded by the keyword arguments so a slow implementation (the Triton
# interpreter) can be given small cases.
__all__ += ["capacities", "index_args", "buffer_setups", "flush_schedules", "chain_setups", "tree_setups",
            "prefill_setups"]


def capacities(max_capacity: int = 6, big: int = 0):
    """A capacity in 1..max_capacity, or (one time in max_capacity + 1) ``big`` if given: a buffer
    longer than a kernel's row tile (e.g. 17 > 16), walked in more than one tile.  Capacities of 3
    and more come first (hypothesis favours them): they allow partial flushes that keep entries."""
    order = [c for c in range(3, max_capacity + 1)] + [c for c in (2, 1) if c <= max_capacity]
    return st.sampled_from(order + ([big] if big else []))


@st.composite
def buffer_setups(draw, *, max_capacity: int = 6, max_history: int = 10, min_new: int = 0, max_new: int = 6,
                  big_capacity: int = 0, **case_kw) -> dict:
    """case (T = history + new tokens), capacity C, history P and ragged buffer lengths (each 0..min(P, C)).

    Half of the time P = C (even past max_history): a request holding all of it is in direct mode with a full buffer (its next
    token folds and it starts owning a state) while the others own a state and fill up as they decode.
    ``stateless``: when no request owns a state, the buffer is passed without state storage (``state=None``).
    """
    C = draw(capacities(max_capacity, big_capacity), label="capacity")
    P = draw(st.one_of(st.just(C), st.integers(0, max_history)), label="history")
    new = draw(st.integers(min_new, max_new), label="new tokens")
    case = draw(cases(T=P + new, **case_kw), label="case")
    lengths = draw(st.lists(_length(min(P, C)), min_size=case.B, max_size=case.B), label="lengths")
    return dict(case=case, capacity=C, history=P, lengths=lengths, stateless=draw(st.booleans(), label="stateless"))


def _length(most: int):
    """A buffer length in 0..most, full (``most``) half of the time: a full buffer is where the next
    token folds, the path most worth exercising."""
    return st.one_of(st.just(most), st.integers(0, most))


def index_args():
    """How the integer arguments of the buffer operations are passed: ``index_dtype`` ("int64", "int32": any
    integer dtype is accepted) and ``scalar`` (a count or node every request shares as a Python int)."""
    return st.fixed_dictionaries({"index_dtype": st.sampled_from(["int64", "int32"]), "scalar": st.booleans()})


def flush_schedules(B: int, steps: int, capacity: int, *, max_flushes: int = 4, min_flushes: int = 0,
                    lengths=None):
    """{decode step: per-request flush counts ([B] ints, clipped to the lengths then) or None (all)}.

    Partial counts (some entries stay buffered, their G rebased) are drawn as often as full ones.
    With ``lengths`` (the buffer lengths before the first decode step) the lengths are followed
    through the decode steps (a full buffer folds: C -> 1) and the counts drawn against them: mostly
    partial (1..n-1 of n entries, the rebase path), else all or none.
    """
    if steps <= 0:
        return st.just({})
    if lengths is None:
        counts = st.one_of(st.lists(st.integers(1, max(1, capacity - 1)), min_size=B, max_size=B), st.none(),
                           st.lists(st.integers(0, capacity), min_size=B, max_size=B))
        return st.dictionaries(st.integers(0, steps - 1), counts, min_size=min(min_flushes, steps),
                               max_size=max(max_flushes, min(min_flushes, steps)))
    return _tracked_flushes(B, steps, capacity, list(lengths), max_flushes, min(min_flushes, steps))


@st.composite
def _tracked_flushes(draw, B, steps, capacity, lengths, max_flushes, min_flushes):
    at = draw(st.sets(st.integers(0, steps - 1), min_size=min_flushes, max_size=max(max_flushes, min_flushes)),
              label="flush steps")
    n = list(lengths)
    out = {}
    for t in range(steps):
        if t in at:
            if draw(st.sampled_from(["part", "part", "part", "all"]), label="flush") == "all":
                out[t] = None
                n = [0] * B
            else:
                # mostly "keep r of the n entries" (r small: a long folded prefix, the rebase on its last G)
                c = [draw(st.one_of(st.integers(1, x - 1).map(lambda r, x=x: x - r), st.just(x), st.just(0))
                          if x >= 2 else st.integers(0, x), label="count") for x in n]
                out[t] = c
                n = [x - y for x, y in zip(n, c)]
        n = [1 if x >= capacity else x + 1 for x in n]
    return out


@st.composite
def _draft_setup(draw, chain: bool, max_capacity: int, max_B: int, max_drafts: int, max_history: int,
                 max_after: int, case_kw: dict, big_capacity: int = 0) -> dict:
    C = draw(capacities(max_capacity, big_capacity), label="capacity")
    B = draw(st.integers(1, max_B), label="B")
    parents, counts = draw(draft_batch(B, max_drafts=max_drafts, chain=chain), label="drafts")
    D = len(parents[0])
    P = draw(st.integers(0, max(max_history, C if big_capacity else 0)), label="history")
    after = draw(st.integers(0, max_after), label="after")
    case = draw(cases(B=B, T=P + D + after, **case_kw), label="case")
    lengths = draw(st.lists(_length(min(P, C)), min_size=B, max_size=B), label="lengths")
    defaults = chain and draw(st.sampled_from((False, False, False, True)), label="default parents and num_drafts")
    if defaults:  # parents=None, num_drafts=None: the full chain of D drafts
        parents, counts = [list(range(-1, D - 1))] * B, [D] * B
    if chain:
        nodes = [draw(st.integers(0, c), label="accepted") - 1 for c in counts]
    else:
        nodes = draw(acceptances(counts), label="accepted node")
    return dict(case=case, capacity=C, history=P, lengths=lengths, parents=parents, num_drafts=counts,
                nodes=nodes, after=after, use_counts=draw(st.booleans(), label="use_counts") if chain else False,
                defaults=defaults, **draw(index_args(), label="index arguments"))


def chain_setups(*, max_capacity: int = 6, max_B: int = 3, max_drafts: int = 6, max_history: int = 8,
                 max_after: int = 3, big_capacity: int = 0, **case_kw):
    """Chain verification: ragged draft counts, accepted counts (as ``nodes`` = count - 1, use_counts=True);
    a quarter of the time the full chain of D drafts passed as the defaults (``defaults``: parents=None,
    num_drafts=None); index arguments as ``index_args``."""
    return _draft_setup(True, max_capacity, max_B, max_drafts, max_history, max_after, case_kw, big_capacity)


def tree_setups(*, max_capacity: int = 6, max_B: int = 3, max_drafts: int = 10, max_history: int = 8,
                max_after: int = 3, big_capacity: int = 0, **case_kw):
    """Tree verification: a draft tree per request (ragged), one accepted node per request (-1 = none)."""
    return _draft_setup(False, max_capacity, max_B, max_drafts, max_history, max_after, case_kw, big_capacity)


@st.composite
def prefill_setups(draw, *, max_capacity: int = 6, max_prompt: int = 12, max_new: int = 4,
                   chunk_sizes=(1, 3, 4, 16, 32, 64), big_capacity: int = 0, long_T: int = 0, long_B: int = 1,
                   long_HV: int = 2, long_dims=(8,), **case_kw) -> dict:
    """A prompt (0..max_prompt tokens) with an explicit tail (0..min(C, prompt)) or the default (None),
    a chunk size, then ``new`` decoded tokens.  Half of the time the prompt's folded head (the prompt
    without its tail) is a length around a chunk boundary (``boundary_lengths`` of the chunk size, up to
    ``long_T``; a case longer than ``max_prompt`` kept cheap as ``chunk_cases`` keeps it)."""
    C = draw(capacities(max_capacity, big_capacity), label="capacity")
    chunk_size = draw(st.sampled_from(chunk_sizes), label="chunk_size")
    most = max(max_prompt, C + 1 if big_capacity else 0)
    if long_T and draw(st.booleans(), label="head around a chunk boundary"):
        head = draw(lengths_near(max(long_T, most), chunk_size), label="head")
        tail = draw(st.one_of(st.just(0), st.integers(0, C)), label="tail")
        prompt = head + tail
    else:
        prompt = draw(st.integers(0, most), label="prompt")
        tail = draw(st.one_of(st.none(), st.integers(0, min(C, prompt))), label="tail")
    new = draw(st.integers(0, max_new), label="new tokens")
    if prompt > most:
        case_kw = _long_kw(case_kw, long_B, long_HV, long_dims)
    case = draw(cases(T=prompt + new, **case_kw), label="case")
    initial = draw(st.booleans(), label="initial_state")
    return dict(case=case, capacity=C, prompt=prompt, tail=tail, chunk_size=chunk_size, initial=initial)
