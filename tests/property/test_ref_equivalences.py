"""Properties 1-5, 7 and 9 of docs/testing.md for every reference form, in float64 (tight: the float64
floor of the tolerance table) and in float32 against float64 (the calibrated budget)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvbuffer_ref as ref
from kvbuffer_ref.validate import properties as P
from kvbuffer_ref.validate import strategies as kst

from .strategies_local import buffered

DTYPES = [torch.float64, torch.float32]


def _assert_all(results):
    assert results, "no comparison was made"
    for r in results:
        assert r.passed, str(r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(case=kst.cases(max_T=20), chunk_size=st.sampled_from([1, 2, 3, 5, 8, 64]))
def test_chunk_equals_recurrent(dtype, case, chunk_size):
    _assert_all(P.check_chunk(ref, case, dtype, chunk_size=chunk_size))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(case=kst.cases(max_T=16))
def test_direct_equals_recurrent_from_zero(dtype, case):
    _assert_all(P.check_direct(ref, case, dtype))


@pytest.mark.parametrize("form", ["u", "raw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(setup=buffered())
def test_buffered_decode_equals_recurrent(dtype, form, setup):
    case, C, hist, lengths = setup
    _assert_all(P.check_decode(ref, case, dtype, capacity=C, history=hist, lengths=lengths, form=form))


@pytest.mark.parametrize("form", ["u", "raw"])
@given(setup=buffered(min_new=1, max_new=10), data=st.data())
def test_flush_schedule_is_invisible(form, setup, data):
    case, C, hist, lengths = setup
    steps = case.T - hist
    flushes = data.draw(st.dictionaries(
        st.integers(0, steps - 1),
        st.one_of(st.none(), st.lists(st.integers(0, C), min_size=case.B, max_size=case.B)), max_size=4))
    _assert_all(P.check_decode(ref, case, torch.float64, capacity=C, history=hist, lengths=lengths, form=form,
                               flushes=flushes))


@pytest.mark.parametrize("form", ["u", "raw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_chain_verify_then_accept(dtype, form, data):
    C = data.draw(st.integers(1, 6), label="capacity")
    B = data.draw(st.integers(1, 3), label="B")
    parents, counts = data.draw(kst.draft_batch(B, max_drafts=6, chain=True), label="drafts")
    D = len(parents[0])
    hist = data.draw(st.integers(0, 8), label="history")
    after = data.draw(st.integers(0, 3), label="after")
    case = data.draw(kst.cases(B=B, T=hist + D + after), label="case")
    lengths = data.draw(st.lists(st.integers(0, min(hist, C)), min_size=B, max_size=B), label="lengths")
    accepted = [data.draw(st.integers(0, c)) for c in counts]
    _assert_all(P.check_verify_accept(ref, case, dtype, capacity=C, history=hist, lengths=lengths, parents=parents,
                                      num_drafts=counts, nodes=[m - 1 for m in accepted], after=after, form=form,
                                      use_counts=True))


@pytest.mark.parametrize("form", ["u", "raw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(setup=buffered(max_history=12, max_new=4), tail=st.integers(0, 6), chunk_size=st.sampled_from([1, 3, 4, 64]))
def test_prefill_handoff_at_any_split(dtype, form, setup, tail, chunk_size):
    case, C, prompt, _ = setup
    tail = min(tail, C, prompt)
    _assert_all(P.check_prefill(ref, case, dtype, capacity=C, prompt=prompt, tail=tail, form=form,
                                chunk_size=chunk_size))


@given(setup=buffered(max_history=12, max_new=4))
def test_prefill_default_tail(setup):
    case, C, prompt, _ = setup
    _assert_all(P.check_prefill(ref, case, torch.float64, capacity=C, prompt=prompt, tail=None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(case=kst.cases(max_T=12))
def test_recurrent_from_initial_state(dtype, case):
    _assert_all(P.check_recurrent(ref, case, dtype))
