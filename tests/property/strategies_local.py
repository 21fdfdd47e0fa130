"""Composite strategies shared by the property tests (buffer setups, drafts)."""

from hypothesis import strategies as st

from kvbuffer_ref.validate import strategies as kst


@st.composite
def buffered(draw, *, max_capacity=6, max_history=10, max_new=6, min_new=0, **case_kw):
    """(case, capacity, history P, ragged lengths) with T = P + new tokens."""
    C = draw(st.integers(1, max_capacity))
    P = draw(st.integers(0, max_history))
    new = draw(st.integers(min_new, max_new))
    case = draw(kst.cases(T=P + new, **case_kw))
    lengths = draw(st.lists(st.integers(0, min(P, C)), min_size=case.B, max_size=case.B))
    return case, C, P, lengths
