"""Properties 1-5, 7 and 9 of docs/testing.md for every reference form, in float64 (tight: the float64
floor of the tolerance table) and in float32 against float64 (the calibrated budget).

Every example is drawn over the regions of ``strategies_local.drawn`` (q, k of any norm, beta in [0, 2],
gate bands down to -1e30, scaled v, an explicit scale, non-contiguous inputs) and must be informative
(its truth neither zero nor constant): ``counted`` fails a test whose examples are mostly vacuous.
"""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import kvbuffer_ref as ref
from kvbuffer.validate import Case
from kvbuffer.validate import properties as P
from kvbuffer.validate import strategies as kst
from kvbuffer.validate.tolerances import compare

from .fast_adapter import assert_all as _assert_all
from .strategies_local import BETAS_WITH_STATE, Calling, Drawn, buffered, counted, drawn, informative, is_informative

DTYPES = [torch.float64, torch.float32]


def _s0(d):
    return torch.ones(d.B, d.HV, d.K, d.V, dtype=torch.float64)


@st.composite
def _chunked(draw):
    """A chunk size and a T that crosses its chunk boundaries most of the time (T up to 2.2 chunks + 2)."""
    cs = draw(st.sampled_from([16, 32, 64, 1, 2, 3, 5, 8]), label="chunk_size")
    T = draw(st.one_of(st.integers(cs + 1, min(2 * cs + cs // 5 + 2, 150)), st.integers(1, 20)), label="T")
    return cs, draw(drawn(T=T, betas=BETAS_WITH_STATE), label="drawn")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@counted()
@given(setup=_chunked())
@example(setup=(16, Drawn(Case(B=2, T=37, H=1, HV=2, K=5, V=3, gate="mixed", beta="mixed", seed=3), band="tiny")))
# a state the chunk nearly erases (K = 1, beta in [0, 1], no decay, v 1e-3): the chunk's one subtraction
# leaves eps x the state it entered with, 5,000 times the final state (the budget's reorder term)
@example(setup=(16, Drawn(Case(B=1, T=17, H=1, HV=1, K=1, V=1, gate="zero", beta="uniform", seed=0), k_norm=True,
                          v_decades=-3.0)))
def test_chunk_equals_recurrent(dtype, setup):
    chunk_size, d = setup
    informative(d.inputs(), _s0(d))
    _assert_all(P.check_chunk(Calling(ref, d), d, dtype, chunk_size=chunk_size))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@counted()
@given(d=drawn(max_T=16))
def test_direct_equals_recurrent_from_zero(dtype, d):
    informative(d.inputs())
    _assert_all(P.check_direct(Calling(ref, d), d, dtype))


# the raw form in float64 only (float32 raw doubles the cost and follows the same code as float64 raw)
FORMS = [(torch.float64, "u"), (torch.float64, "raw"), (torch.float32, "u")]


@pytest.mark.parametrize("dtype,form", FORMS, ids=lambda p: str(p))
@counted()
@given(setup=buffered())
def test_buffered_decode_equals_recurrent(dtype, form, setup):
    d, C, hist, lengths = setup
    informative(d.inputs())
    _assert_all(P.check_decode(Calling(ref, d), d, dtype, capacity=C, history=hist, lengths=lengths, form=form))


@pytest.mark.parametrize("form", ["u", "raw"])
@counted()
@given(setup=buffered(min_new=1, max_new=10), data=st.data())
def test_flush_schedule_is_invisible(form, setup, data):
    d, C, hist, lengths = setup
    steps = d.T - hist
    informative(d.inputs())
    flushes = data.draw(kst.flush_schedules(d.B, steps, C, lengths=lengths), label="flushes")
    _assert_all(P.check_decode(Calling(ref, d), d, torch.float64, capacity=C, history=hist, lengths=lengths,
                               form=form, flushes=flushes))


@pytest.mark.parametrize("dtype,form", FORMS, ids=lambda p: str(p))
@counted()
@given(data=st.data())
def test_chain_verify_then_accept(dtype, form, data):
    C = data.draw(st.integers(1, 6), label="capacity")
    B = data.draw(st.integers(1, 3), label="B")
    parents, counts = data.draw(kst.draft_batch(B, max_drafts=6, chain=True), label="drafts")
    D = len(parents[0])
    hist = data.draw(st.integers(0, 8), label="history")
    after = data.draw(st.integers(0, 3), label="after")
    d = data.draw(drawn(B=B, T=hist + D + after), label="drawn")
    informative(d.inputs())
    lengths = data.draw(st.lists(st.integers(0, min(hist, C)), min_size=B, max_size=B), label="lengths")
    accepted = [data.draw(st.integers(0, c)) for c in counts]
    _assert_all(P.check_verify_accept(Calling(ref, d), d, dtype, capacity=C, history=hist, lengths=lengths,
                                      parents=parents, num_drafts=counts, nodes=[m - 1 for m in accepted],
                                      after=after, form=form, use_counts=True))


def _equal_fields(a, b, what: str) -> None:
    """Every field of two KVBuffers or two Drafts is the same tensor value (or both None)."""
    for name, x in a.tensors().items():
        y = getattr(b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"{what}.{name} differs"


def _path_truths(x: dict, hist: int, parents: list, counts: list, nodes: list) -> tuple:
    """The float64 recurrence over each request's history and then a root-to-node path: every draft's output
    [B, D, HV, V] (0 past the counts) and the state after the accepted node's path [B, HV, K, V]."""
    B, D = len(parents), len(parents[0])
    o = torch.zeros(B, D, *x["v"].shape[2:], dtype=torch.float64)
    states = []
    for b in range(B):
        par = torch.tensor(parents[b])
        for i in range(counts[b]):
            o[b, i] = ref.recurrent_gated_delta_rule(**P.along_path(x, b, ref.path_to(par, i), hist))[0][0, -1]
        path = P.along_path(x, b, ref.path_to(par, int(nodes[b])), hist)
        states.append(ref.recurrent_gated_delta_rule(**path, output_final_state=True)[1])
    return o, torch.cat(states)


@pytest.mark.parametrize("form", ["u", "raw"])
@counted()
@given(data=st.data())
def test_verify_fold_is_flush_then_verify(form, data):
    """verify(fold=...) (True or per-request flags) then accept is, exactly in float64, flush of the folding
    requests' whole buffers, verify and accept: o, the Drafts, the buffer after verify and after accept.  Its
    o is verify(fold=False)'s and the state after accept (materialised) is that of verify(fold=False) +
    accept, as close to the float64 recurrence (over the history and each draft's path) as those are: the
    error table with them as the baseline, since the two differ by float64 rounding that grows with the
    folded tail's |G| (exp(G_i - G_tail) from G_i = G_tail + g_i carries |G_tail| eps; a reset gate's
    G_tail = -2000 puts it past the floor).  Chains and trees, ragged draft counts, empty / partial / full
    buffers, buffers without state storage."""
    C = data.draw(st.integers(1, 6), label="capacity")
    B = data.draw(st.integers(1, 3), label="B")
    parents, counts = data.draw(kst.draft_batch(B, max_drafts=6, chain=data.draw(st.booleans(), label="chain")),
                                label="drafts")
    hist = data.draw(st.one_of(st.just(C), st.integers(0, 8)), label="history")
    d = data.draw(drawn(B=B, T=hist + len(parents[0])), label="drawn")
    informative(d.inputs())
    lengths = data.draw(st.lists(st.one_of(st.just(min(hist, C)), st.integers(0, min(hist, C))), min_size=B,
                                 max_size=B), label="lengths")
    flags = data.draw(st.one_of(st.just(True), st.lists(st.booleans(), min_size=B, max_size=B)), label="fold")
    nodes = torch.tensor(data.draw(kst.acceptances(counts), label="nodes"))
    x = d.inputs()
    buf = P.ragged_buffer({n: t[:, :hist] for n, t in x.items()}, lengths, C, form=form)
    if not bool(buf.has_state.any()) and data.draw(st.booleans(), label="no state storage"):
        buf = buf.replace(state=None)
    toks = {n: t[:, hist:] for n, t in x.items()}
    drafts_kw = dict(parents=torch.tensor(parents), num_drafts=torch.tensor(counts))
    fold = flags if flags is True else torch.tensor(flags)
    o, drafts, folded = ref.verify(**toks, buffer=buf, fold=fold, **drafts_kw)
    flushed = ref.flush(buf, count=None if fold is True else torch.where(fold, buf.lengths, 0))
    o_f, drafts_f = ref.verify(**toks, buffer=flushed, **drafts_kw)
    assert torch.equal(o, o_f), "verify(fold).o"
    _equal_fields(drafts, drafts_f, "verify(fold).drafts")
    _equal_fields(folded, flushed, "verify(fold).buffer")
    _equal_fields(ref.accept(folded, drafts, nodes=nodes), ref.accept(flushed, drafts_f, nodes=nodes), "accept")
    # against no fold: the same outputs, and the same state once accepted
    o0, drafts0 = ref.verify(**toks, buffer=buf, **drafts_kw)
    valid = (torch.arange(len(parents[0]))[None, :] < torch.tensor(counts)[:, None])[:, :, None, None]
    after = ref.materialize_state(ref.accept(folded, drafts, nodes=nodes))
    stored = buf if buf.state is not None else ref.flush(buf, count=0)  # the storage accept may fold into
    after0 = ref.materialize_state(ref.accept(stored, drafts0, nodes=nodes))
    o_true, after_true = _path_truths(x, hist, parents, counts, nodes.tolist())
    _assert_all([compare(o, o_true, o0, name="verify(fold).o", valid=valid),
                 compare(after, after_true, after0, name="verify(fold) + accept: state", head_axis=1)])


@pytest.mark.parametrize("dtype,form", FORMS, ids=lambda p: str(p))
@counted()
@given(setup=buffered(max_history=20, max_new=4), tail=st.integers(0, 6),
       chunk_size=st.sampled_from([16, 32, 1, 3, 4, 64]))
def test_prefill_handoff_at_any_split(dtype, form, setup, tail, chunk_size):
    d, C, prompt, _ = setup
    tail = min(tail, C, prompt)
    informative(d.inputs())
    _assert_all(P.check_prefill(Calling(ref, d), d, dtype, capacity=C, prompt=prompt, tail=tail, form=form,
                                chunk_size=chunk_size))


@counted()
@given(setup=buffered(max_history=12, max_new=4))
def test_prefill_default_tail(setup):
    d, C, prompt, _ = setup
    informative(d.inputs())
    _assert_all(P.check_prefill(Calling(ref, d), d, torch.float64, capacity=C, prompt=prompt, tail=None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@counted()
@given(d=drawn(max_T=12, betas=BETAS_WITH_STATE))
def test_recurrent_from_initial_state(dtype, d):
    informative(d.inputs(), _s0(d))
    _assert_all(P.check_recurrent(Calling(ref, d), d, dtype))


def test_vacuous_examples_are_detected():
    """The vacuity check itself: beta = 0 without an initial state has a zero truth (an implementation
    returning zeros would pass); with an initial state it does not."""
    d = Drawn(Case(B=2, T=5, H=1, HV=2, K=4, V=3, beta="zero", seed=1))
    assert not is_informative(d.inputs())
    assert is_informative(d.inputs(), _s0(d))
    assert is_informative(Drawn(Case(B=2, T=5, H=1, HV=2, K=4, V=3, beta="uniform", seed=1)).inputs())
