"""kvbuffer_fast decode kernels against the float64 oracle (calibrated budget, baseline = the plain
recurrent reference in float32).

On a CPU these run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when
there is no CUDA device), in float32, with small shapes; bfloat16 inputs run on CUDA only.
Outputs are NaN-poisoned (``kvbuffer_fast._common.POISON``), and so is all buffer memory a kernel
must not read: slots past each request's length, and the state of requests in direct mode.
"""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_fast._common as common  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_ref.testing import Case, assert_matches, compare  # noqa: E402
from kvbuffer_ref.testing import properties as P  # noqa: E402
from kvbuffer_ref.testing import strategies as kst  # noqa: E402

from .fast_adapter import Poisoned  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIMS = (8, 16, 24)
SMALL = dict(max_B=3, max_H=2, max_group=2, dims=DIMS)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic; bf16 runs on CUDA only"))]


@pytest.fixture(autouse=True)
def _poison_outputs():
    common.POISON = True
    yield
    common.POISON = False


def _assert_all(results):
    assert results, "no comparison was made"
    for r in results:
        assert r.passed, str(r)


@st.composite
def buffered(draw, *, capacities=(1, 2, 4, 8), max_history=10, min_new=1, max_new=6, **case_kw):
    """(case, capacity, history P, ragged lengths 0..min(P, C)) with T = P + new tokens."""
    C = draw(st.sampled_from(capacities), label="capacity")
    P_ = draw(st.integers(0, max_history), label="history")
    new = draw(st.integers(min_new, max_new), label="new tokens")
    case = draw(kst.cases(T=P_ + new, **{**SMALL, **case_kw}))
    lengths = draw(kst.buffer_lengths(case.B, min(P_, C)), label="lengths")
    return case, C, P_, lengths


# ----------------------------------------------------------------------------- recurrent decode
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(case=kst.cases(min_T=1, max_T=3, **SMALL))
def test_recurrent_decode_matches_oracle(dtype, case):
    _assert_all(P.check_recurrent(fast, case, dtype, device=DEVICE))


def test_recurrent_decode_updates_state_in_place():
    case = Case(B=2, T=1, H=1, HV=2, K=8, V=16, seed=4)
    x = case.inputs(torch.float32, DEVICE)
    S = torch.randn(2, 2, 8, 16, device=DEVICE)
    (o64, S64), base = P.truth_and_baseline(x, S)
    ptr = S.data_ptr()
    o = fast.recurrent_decode(**x, state=S)
    assert S.data_ptr() == ptr
    assert_matches(o.cpu(), o64, base[0], name="recurrent_decode.o")
    assert_matches(S.cpu(), S64, base[1], name="recurrent_decode.state", head_axis=1)


# ----------------------------------------------------------------------------- buffered decode
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(setup=buffered())
def test_buffered_decode_ragged_matches_oracle(dtype, setup):
    """Ragged lengths 0..C (full ones fold in the same launch), direct and stateful requests mixed."""
    case, C, hist, lengths = setup
    _assert_all(P.check_decode(Poisoned, case, dtype, capacity=C, history=hist, lengths=lengths, device=DEVICE))


@given(C=st.sampled_from([4, 8]), data=st.data())
def test_long_run_with_flushes_matches_oracle(C, data):
    """3C+1 decode steps (every request folds at least twice) with explicit flushes of random prefixes."""
    hist = data.draw(st.integers(0, C), label="history")
    case = data.draw(kst.cases(T=hist + 3 * C + 1, **SMALL), label="case")
    lengths = data.draw(kst.buffer_lengths(case.B, min(hist, C)), label="lengths")
    flushes = data.draw(st.dictionaries(
        st.integers(0, 3 * C), st.one_of(st.none(), st.lists(st.integers(0, C), min_size=case.B, max_size=case.B)),
        max_size=3), label="flushes")
    _assert_all(P.check_decode(Poisoned, case, torch.float32, capacity=C, history=hist, lengths=lengths,
                               flushes=flushes, device=DEVICE))


@pytest.mark.parametrize("channel_gate", [False, True])
def test_capacity_above_one_chunk(channel_gate):
    """C = 20 > the kernel's 16-row chunk: entries span two chunks; one request folds at its first step."""
    C, hist = 20, 22
    case = Case(B=3, T=hist + 4, H=1, HV=2, K=8, V=8, channel_gate=channel_gate, gate="mild", beta="uniform",
                seed=21)
    _assert_all(P.check_decode(Poisoned, case, torch.float32, capacity=C, history=hist, lengths=[20, 17, 3],
                               flushes={2: [0, 18, 1]}, device=DEVICE))


@pytest.mark.parametrize("book", ["ticket", "launch"])
@pytest.mark.parametrize("BV", [16, None], ids=["BV16", "BVdefault"])
@pytest.mark.parametrize("channel_gate", [False, True])
def test_launch_configs(book, BV, channel_gate):
    """Every launch option the GPU tune may pick: the shared rows appended by the last program (ticket)
    or by a second launch; V split over several column tiles (BV=16 < V=24, the last one partial)."""
    C, hist = 4, 6
    case = Case(B=3, T=hist + 2 * C + 1, H=1, HV=2, K=8, V=24, channel_gate=channel_gate, gate="mixed",
                beta="uniform", seed=31)

    class Cfg(Poisoned):
        @staticmethod
        def buffered_decode(*args, buffer, **kw):
            return Poisoned.buffered_decode(*args, buffer=buffer, BV=BV, book=book, **kw)

    _assert_all(P.check_decode(Cfg, case, torch.float32, capacity=C, history=hist, lengths=[C, 0, 2],
                               flushes={3: [1, 0, 2]}, device=DEVICE))


OPTIONS = {
    "tile-fused": dict(variant="tile", fold="fused", book="ticket"),
    "tile-split": dict(variant="tile", fold="split", book="launch", fold_launch=dict(kernel="tile", BV=16)),
    "lean-tilefold": dict(variant="lean", fold="split", book="snapshot", fold_launch=dict(kernel="tile", BV=16)),
    "lean-ticket": dict(variant="lean", fold="split", book="ticket", loadn=False, keyn=False, NS=2),
    "lean-launch": dict(variant="lean", fold="split", book="launch",  # the default (serving fold; PDL on a GPU)
                        fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2)),
    "lean-snapshot-kt": dict(variant="lean", fold="split", book="snapshot", kt=True),
    "lean-fused-launch": dict(variant="lean", fold="fused", book="launch"),
    "lean-fused-ticket-kt": dict(variant="lean", fold="fused", book="ticket", kt=True),
    "lean-fused-early": dict(variant="lean", fold="fused", book="early", loadn=False, keyn=False),
    "lean-fused-early-pf": dict(variant="lean", fold="fused", book="early", pf=True),
    "lean-split-launch-pf-kt": dict(variant="lean", fold="split", book="launch", pf=True, kt=True),
    "lean-early-group": dict(variant="lean", fold="split", book="early",
                             fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2)),
    "lean-launch-noserve": dict(variant="lean", fold="split", book="launch",  # session 3's default: the decode
                                fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2, serve=False)),  # serves all
    "lean-serve-group-tf32x3": dict(variant="lean", fold="split", book="launch",
                                    fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=1, serve=True,
                                                     prec="tf32x3", num_warps=4)),
    "lean-group-tf32x3": dict(variant="lean", fold="split", book="launch",
                              fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2, prec="tf32x3", num_warps=4,
                                               serve=False)),
    "lean-serve-late": dict(variant="lean", fold="split", book="launch", pdl="late",  # waits at its end (GPU)
                            fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2, serve=True)),
    "lean-serve-tile": dict(variant="lean", fold="split", book="launch",
                            fold_launch=dict(kernel="tile", BV=16, serve=True)),
    "lean-snapshot-group": dict(variant="lean", fold="split", book="snapshot",
                                fold_launch=dict(kernel="group", FH=1, KB=16, BV=16, NS=1)),
    "lean-serve-late-fh8": dict(variant="lean", fold="split", book="launch", pdl="late",  # FH="auto" takes 4 here
                                fold_launch=dict(kernel="group", FH=8, KB=16, BV=16, NS=2, serve=True)),
    "lean-snapshot-serve": dict(variant="lean", fold="split", book="snapshot",  # two launches, the fold serving
                                fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2, serve=True)),
    "lean-snapshot-noserve": dict(variant="lean", fold="split", book="snapshot",
                                  fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2, serve=False)),
    "lean-snapshot-tile-serve": dict(variant="lean", fold="split", book="snapshot",
                                     fold_launch=dict(kernel="tile", BV=16, serve=True)),
    # the L2 eviction hints are the default (evict='auto'; they act on the GPU only): without them
    "lean-no-evict": dict(variant="lean", fold="split", book="launch", evict=False,
                          fold_launch=dict(kernel="group", FH=2, KB=16, BV=16, NS=2)),
}


@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("C,hist,lengths", [(4, 6, [4, 0, 2]), (20, 22, [20, 17, 3])], ids=["C4", "C20"])
@pytest.mark.parametrize("channel_gate", [False, True])
def test_variants(opts, C, hist, lengths, channel_gate):
    """Every launch variant: the default (lean kernel, grouped fold launch, bookkeeping launch; PDL
    when compiled on a GPU) and the options it was measured against: the register-tile kernel with
    its fold fused or split, the tile fold launch, the lean kernel with each bookkeeping (ticket,
    early, snapshot: with the fold launch serving or not) and its fold fused, all entries loaded or only the live ones, pipelined,
    prefetched and transposed blocks, the fold launch serving the tokens of the requests it folds
    (grouped or tile kernel; with pdl="late" the decode launch waits for it only at its end, a race
    the compiled run checks), the grouped fold in tf32x3 (compiled only: the interpreter multiplies in
    fp32).  K=24 streams in two KB=16 blocks (the last partial), V in
    partial BV=16 tiles, C=20 spans two 16-row chunks of the tile kernel, a direct request folds
    into its first state."""
    # per-channel 'mixed' gates underflow most channels of the state within a few steps, which would hide
    # the state term; those regimes are drawn by the hypothesis tests above
    case = Case(B=3, T=hist + 2 * C + 1, H=1, HV=2, K=24, V=24, channel_gate=channel_gate,
                gate="mild" if channel_gate else "mixed",
                beta="uniform", seed=33)

    class Cfg(Poisoned):
        @staticmethod
        def buffered_decode(*args, buffer, **kw):
            return Poisoned.buffered_decode(*args, buffer=buffer, **{"KB": 16, "BV": 16, **OPTIONS[opts]}, **kw)

    _assert_all(P.check_decode(Cfg, case, torch.float32, capacity=C, history=hist, lengths=lengths,
                               flushes={3: [1, 0, 2]}, device=DEVICE))


@pytest.mark.parametrize("C,kernel", [(4, "_fold_group_kernel"), (34, "_fold_full_kernel")])
def test_auto_fold_kernel_by_capacity(monkeypatch, C, kernel):
    """The default fold launch ("auto") takes the grouped kernel up to C = 32 and the tile kernel past it
    (measured 2x faster at C = 64 on the H200); both fold full buffers and a direct request correctly."""
    import kvbuffer_fast.decode as dec

    used = []
    for name in ("_fold_group_kernel", "_fold_full_kernel"):
        jit = getattr(dec, name)

        class Spy:
            def __getitem__(self, grid, jit=jit, name=name):
                used.append(name)
                return jit[grid]

        monkeypatch.setattr(dec, name, Spy())
    case = Case(B=2, T=C + 3, H=1, HV=2, K=8, V=8, gate="mild", beta="uniform", seed=37)
    _assert_all(P.check_decode(Poisoned, case, torch.float32, capacity=C, history=C, lengths=[C, 1],
                               device=DEVICE))
    assert used and set(used) == {kernel}, used


@pytest.mark.parametrize("opts,match", [
    (dict(book="atomic"), "book: expected"),
    (dict(variant="tiles"), "variant: expected"),
    (dict(fold="later"), "fold: expected"),
    (dict(variant="lean", fold="fused", book="snapshot"), "book: 'snapshot' is only for"),
    (dict(variant="tile", book="snapshot"), "book: 'snapshot' is only for"),
    (dict(variant="tile", fold="split", book="early"), "book: 'early' is only for"),
    (dict(book="early", fold_launch=dict(serve=True)), "serve=True needs"),
    (dict(fold_launch=dict(kernel="group", prec="tf32")), "prec expected"),
    (dict(pdl="early"), "pdl: expected"),
    (dict(fold_launch=dict(serve_dot=True)), r"fold_launch: unknown option\(s\) \['serve_dot'\]"),
    (dict(fold_launch=dict(kernel="group", FH=0)), "FH expected"),
    (dict(fold_launch=dict(kernel="tile", FH=2.5)), "FH expected"),
    (dict(evict="first"), "evict: expected"),
    (dict(variant="tile", fold="fused", book="ticket", evict=True), "evict: the eviction hints"),
], ids=["book", "variant", "fold", "lean-fused-snapshot", "tile-snapshot", "tile-early", "serve-early", "prec",
        "pdl", "fold-key", "fh", "fh-tile", "evict", "tile-evict"])
def test_bad_launch_options_are_rejected(opts, match):
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, 2, dtype=torch.float32, device=DEVICE)
    x = {n: t.to(DEVICE) for n, t in dict(q=torch.randn(1, 1, 1, 8), k=torch.randn(1, 1, 1, 8),
                                          v=torch.randn(1, 1, 1, 8), g=-torch.rand(1, 1, 1),
                                          beta=torch.rand(1, 1, 1)).items()}
    with pytest.raises(ValueError, match=match):
        fast.buffered_decode(**x, buffer=buf, **opts)


@given(setup=buffered(capacities=(2, 4, 8), max_new=1), data=st.data())
def test_flush_prefix_matches_reference_flush(setup, data):
    """flush of any per-request prefix == the reference's: same entries moved down, G rebased, state folded."""
    case, C, hist, lengths = setup
    x64 = P.upcast_inputs(case.inputs(torch.float64))
    buf64 = P.ragged_buffer({n: t[:, :hist] for n, t in x64.items()}, lengths, C)
    counts = torch.tensor([data.draw(st.integers(0, n), label=f"count[{b}]") for b, n in enumerate(lengths)])
    want = ref.flush(buf64, count=counts)
    base = ref.flush(P.buffer_to(buf64, dtype=torch.float32), count=counts)
    got = Poisoned.flush(P.buffer_to(buf64, dtype=torch.float32, device=DEVICE), count=counts.to(DEVICE))
    assert torch.equal(got.lengths.cpu(), want.lengths) and torch.equal(got.has_state.cpu(), want.has_state)
    for b, n in enumerate(want.lengths.tolist()):
        assert torch.equal(got.u[b, :n].cpu(), base.u[b, :n]), "remaining u must move unchanged"
        assert torch.equal(got.k[b, :n].cpu(), base.k[b, :n]), "remaining keys must move unchanged"
    assert_matches(got.G.cpu(), want.G, base.G, name="flush.G", head_axis=2,
                   valid=(torch.arange(C)[None, :] < want.lengths[:, None])[:, :, None]
                   if not case.channel_gate else
                   (torch.arange(C)[None, :] < want.lengths[:, None])[:, :, None, None])
    if want.state is not None:
        owned = want.has_state[:, None, None, None]
        assert_matches(got.state.cpu(), want.state, base.state, name="flush.state", head_axis=1, valid=owned)


def test_direct_mode_never_reads_state_and_folds_into_it():
    """Direct requests read no state (it is NaN here); a full one folds into zeros and owns a state after."""
    C = 4
    case = Case(B=2, T=C + 2, H=1, HV=2, K=8, V=8, seed=9)
    x = case.inputs(torch.float32, DEVICE)
    buf = ref.KVBuffer.empty(2, 1, 2, 8, 8, C, dtype=torch.float32, device=DEVICE)
    outs = []
    for t in range(case.T):
        assert bool((~buf.has_state).all()) == (t <= C)
        o, buf = Poisoned.buffered_decode(**{n: v[:, t:t + 1] for n, v in x.items()}, buffer=buf)
        outs.append(o)
    assert bool(buf.has_state.all()) and buf.lengths.tolist() == [2, 2]
    (o64, S64), base = P.truth_and_baseline(x)
    assert_matches(torch.cat(outs, 1).cpu(), o64, base[0], name="direct.o")
    assert_matches(fast.materialize_state(buf).cpu(), S64, base[1], name="direct.state", head_axis=1)


def test_bf16_ucache_reports_its_error(record_property):
    """u cached in bfloat16 (keys and G kept): the extra error is reported, not budgeted (no table row fits)."""
    if DEVICE == "cpu":
        pytest.skip("the Triton interpreter mishandles bfloat16; the bf16 u-cache is measured on CUDA "
                    "(bench/gpu_decode.py reports it at Qwen3-Next shapes)")
    C, hist = 8, 10
    case = Case(B=3, T=hist + 2 * C, H=2, HV=4, K=16, V=16, seed=2)
    x = case.inputs(torch.float32, DEVICE)
    buf = P.buffer_to(P.ragged_buffer(P.upcast_inputs({n: t[:, :hist] for n, t in x.items()}), [0, 3, C], C),
                      dtype=torch.float32, device=DEVICE)
    buf = buf.replace(u=buf.u.to(torch.bfloat16))
    outs = []
    for t in range(hist, case.T):
        o, buf = fast.buffered_decode(**{n: v[:, t:t + 1] for n, v in x.items()}, buffer=buf)
        outs.append(o)
    (o64, _), base = P.truth_and_baseline(x)
    c = compare(torch.cat(outs, 1).cpu(), o64[:, hist:], base[0][:, hist:], name="decode[bf16 u-cache].o",
                dtype=torch.float32)
    record_property("bf16_ucache_worst_rel", c.worst_rel)
    print(c)
    assert c.nonfinite == 0


# ----------------------------------------------------------------------------- errors and edges
def test_state_none_full_buffer_raises_and_flush_allocates():
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, 2, with_state=False, dtype=torch.float32, device=DEVICE)
    x = {n: t.to(DEVICE) for n, t in dict(q=torch.randn(1, 1, 1, 8), k=torch.randn(1, 1, 1, 8),
                                          v=torch.randn(1, 1, 1, 8), g=-torch.rand(1, 1, 1),
                                          beta=torch.rand(1, 1, 1)).items()}
    for _ in range(2):
        _, buf = fast.buffered_decode(**x, buffer=buf)
    with pytest.raises(ValueError, match="no state storage"):
        fast.buffered_decode(**x, buffer=buf)
    with pytest.raises(ValueError, match="no state storage"):
        ref.buffered_decode(**x, buffer=buf)
    flushed = fast.flush(buf, count=1)
    assert flushed.state is not None and flushed.lengths.tolist() == [1] and flushed.has_state.tolist() == [True]


def test_raw_form_is_not_implemented():
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, 2, form="raw", dtype=torch.float32, device=DEVICE)
    x = dict(q=torch.randn(1, 1, 1, 8), k=torch.randn(1, 1, 1, 8), v=torch.randn(1, 1, 1, 8), g=-torch.rand(1, 1, 1),
             beta=torch.rand(1, 1, 1))
    with pytest.raises(NotImplementedError, match="u-cache"):
        fast.buffered_decode(**{n: t.to(DEVICE) for n, t in x.items()}, buffer=buf)
    with pytest.raises(NotImplementedError, match="u-cache"):
        fast.flush(buf)


def test_inputs_are_validated_like_the_reference():
    buf = ref.KVBuffer.empty(1, 1, 2, 8, 8, 2, dtype=torch.float32, device=DEVICE)
    two = dict(q=torch.randn(1, 2, 1, 8), k=torch.randn(1, 2, 1, 8), v=torch.randn(1, 2, 2, 8),
               g=-torch.rand(1, 2, 2), beta=torch.rand(1, 2, 2))
    with pytest.raises(ValueError, match="one token per request"):
        fast.buffered_decode(**{n: t.to(DEVICE) for n, t in two.items()}, buffer=buf)
    one = {n: t[:, :1].to(DEVICE) for n, t in two.items()}
    with pytest.raises(ValueError, match="HV"):  # the buffer has 2 value heads, the tokens 1
        fast.buffered_decode(**{**one, "v": one["v"][:, :, :1].contiguous(), "g": one["g"][:, :, :1].contiguous(),
                                "beta": one["beta"][:, :, :1].contiguous()}, buffer=buf)
    with pytest.raises(ValueError, match="count"):
        fast.flush(buf, count=torch.tensor([3], device=DEVICE))
    with pytest.raises(ValueError, match="state"):
        fast.recurrent_decode(**one, state=torch.zeros(1, 2, 8, 4, device=DEVICE))


def test_materialize_state_is_zero_for_requests_without_a_state():
    """A request that owns no state and has no entries: its storage row is garbage (here NaN), not a state."""
    import kvbuffer_fast
    from kvbuffer_ref import KVBuffer

    buf = KVBuffer.empty(2, 1, 2, 8, 8, 4, dtype=torch.float32, device=DEVICE)
    buf = buf.replace(state=torch.full_like(buf.state, float("nan")))
    assert torch.equal(kvbuffer_fast.materialize_state(buf).cpu(), torch.zeros(2, 2, 8, 8))
