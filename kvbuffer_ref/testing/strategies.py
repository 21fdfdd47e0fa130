"""Hypothesis strategies for gated-delta-rule inputs, buffers and drafts.

Everything drawn is small and shrinks well: shapes (non-power-of-two K and V, grouped heads
H < HV, T not a multiple of the chunk size), gate and beta regimes (g exactly 0 up to underflowing
decays; beta 0, 1 and in between), zero keys, ragged buffer lengths 0..C, draft trees and
acceptances.  Tensors are built from a drawn seed (``Case.inputs``).
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cases import BETA_REGIMES, GATE_REGIMES, Case

__all__ = ["head_dims", "cases", "buffer_lengths", "draft_tree", "draft_batch", "acceptances"]

#: Head dimensions drawn by default: tiny, non-powers of two and powers of two.
HEAD_DIMS = (1, 2, 3, 5, 7, 8, 12, 16)


def head_dims(choices=HEAD_DIMS):
    return st.sampled_from(choices)


@st.composite
def cases(draw, *, max_B: int = 3, min_T: int = 1, max_T: int = 12, max_H: int = 2, max_group: int = 3,
          dims=HEAD_DIMS, channel_gate=None, gate=None, beta=None, zero_key=None, B=None, T=None) -> Case:
    """A ``Case``; pin any field by passing it (e.g. ``channel_gate=False``, ``T=1``)."""
    H = draw(st.integers(1, max_H))
    return Case(
        B=B if B is not None else draw(st.integers(1, max_B)),
        T=T if T is not None else draw(st.integers(min_T, max_T)),
        H=H,
        HV=H * draw(st.integers(1, max_group)),
        K=draw(head_dims(dims)),
        V=draw(head_dims(dims)),
        channel_gate=channel_gate if channel_gate is not None else draw(st.booleans()),
        gate=gate if gate is not None else draw(st.sampled_from(GATE_REGIMES)),
        beta=beta if beta is not None else draw(st.sampled_from(BETA_REGIMES)),
        zero_key=zero_key if zero_key is not None else draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


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
