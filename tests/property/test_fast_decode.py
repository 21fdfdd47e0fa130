"""kvbuffer_fast.buffered_decode / flush / materialize_state against the float64 oracle, judged by the
error table (``compare``: the calibrated budget over the plain float32 recurrence).

On a CPU these run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when
there is no CUDA device), in float32 with small shapes; bfloat16 runs on CUDA only.  Every library
output is NaN-poisoned (``KVBUFFER_POISON=1``), and so is all buffer memory a kernel must not read
(``fast_adapter.Poisoned``: slots past each request's length, the state of requests in direct mode).
The launch table's paths (kvbuffer_fast.launch.TABLES["decode"]) are covered by one parametrized test.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_fast.decode as dec  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.launch import DecodeConfig, FlushConfig, Key, config_for, key_of  # noqa: E402

from kvbuffer.validate import Case, assert_matches, compare  # noqa: E402
from kvbuffer.validate import properties as P, strategies as kst  # noqa: E402

from .fast_adapter import Poisoned, assert_all as _assert_all  # noqa: E402
from .strategies_local import Calling, counted, fast_drawn, informative  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter is slow: the ci profile runs 6 examples of each drawn test here (every run draws new ones)
FEW = settings(max_examples=6) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else (lambda f: f)




def _token(B=1, H=1, HV=1, K=8, V=8):
    """One random token per request (q, k, v, g, beta) on DEVICE."""
    x = dict(q=torch.randn(B, 1, H, K), k=torch.randn(B, 1, H, K), v=torch.randn(B, 1, HV, V),
             g=-torch.rand(B, 1, HV), beta=torch.rand(B, 1, HV))
    return {n: t.to(DEVICE) for n, t in x.items()}


@st.composite
def buffered(draw, *, capacities=(4, 8, 17, 1, 2, 20), max_history=20, max_new=3, budget=20, **case_kw):
    """(drawn, capacity, history P, ragged lengths 0..min(P, C)) with T = P + new tokens: capacities past
    one 16-row tile, every region of ``strategies_local.drawn``, kvbuffer_fast sizes (``fast_drawn``)."""
    C = draw(st.sampled_from(capacities), label="capacity")
    hist = draw(st.one_of(st.just(C), st.integers(0, max_history)), label="history")
    new = draw(st.integers(1, max_new), label="new tokens")
    d = draw(fast_drawn(T=hist + new, steps=lambda d: new + (C > 16), budget=budget, **case_kw), label="drawn")
    lengths = draw(st.lists(st.one_of(st.just(min(hist, C)), st.integers(0, min(hist, C))), min_size=d.B,
                            max_size=d.B), label="lengths")
    return d, C, hist, lengths


# ----------------------------------------------------------------------------- behaviour
@FEW
@counted()
@given(setup=buffered())
def test_decode_matches_oracle(setup):
    """Ragged lengths 0..C (full ones fold first), direct and stateful requests, scalar and per-channel
    gates, grouped heads, buffers past 16 rows, K and V up to 64, an explicit scale, non-contiguous
    tokens: outputs and the final state against the float64 recurrence."""
    d, C, hist, lengths = setup
    informative(d.inputs())
    _assert_all(P.check_decode(Calling(Poisoned, d), d, torch.float32, capacity=C, history=hist, lengths=lengths,
                               device=DEVICE))


@FEW
@counted()
@given(setup=buffered(capacities=(4, 8, 17), max_new=2, budget=12), data=st.data())
def test_decode_with_flushes_matches_oracle(setup, data):
    """Flushes of 0, all and partial per-request counts between decode steps (the kept entries' gates
    rebased), then more decodes."""
    d, C, hist, lengths = setup
    informative(d.inputs())
    flushes = data.draw(kst.flush_schedules(d.B, d.T - hist, C, lengths=lengths, min_flushes=1), label="flushes")
    _assert_all(P.check_decode(Calling(Poisoned, d), d, torch.float32, capacity=C, history=hist, lengths=lengths,
                               flushes=flushes, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic")
@counted()
@given(setup=buffered(max_new=2))
def test_decode_bf16_matches_oracle(setup):
    case, C, hist, lengths = setup
    informative(case.inputs())
    _assert_all(P.check_decode(Calling(Poisoned, case), case, torch.bfloat16, capacity=C, history=hist, lengths=lengths,
                               device=DEVICE))


def test_long_run_with_flushes_matches_oracle():
    """3C+1 steps: every request folds at least twice, with flushes of prefixes and of everything."""
    C, hist = 4, 3
    case = Case(B=3, T=hist + 3 * C + 1, H=1, HV=2, K=8, V=8, gate="mixed", beta="uniform", seed=5)
    _assert_all(P.check_decode(Poisoned, case, torch.float32, capacity=C, history=hist, lengths=[3, 0, 1],
                               flushes={2: [1, 0, 2], 7: None}, device=DEVICE))


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_decode_state_large_gates(channel):
    """The new token's decays are differences of its G as stored and the entries' G, the decays the fold
    then uses (docs/math.md, "Numerics").  K = 1, beta = 1 and unit keys: each write replaces the state, so
    the state after flush is the last token's write alone and every older term must cancel in the fold.
    Gates of -107..-115 put G near -340; decays taken from the tail's gap plus the new gate (more accurate
    by themselves) missed the stored G by its rounding, and the state came out 314x the error of the
    oracle's float32 forms."""
    case = Case(B=1, T=11, H=1, HV=1, K=1, V=8, channel_gate=channel, gate="mixed", beta="one", seed=187316)
    _assert_all(P.check_decode(Poisoned, case, torch.float32, capacity=8, history=6, lengths=[1], device=DEVICE))


# The launch table's paths: capacity, history, lengths, steps, value heads, per-channel gates, the
# config's change from the table, and the fold kernel that must run.  C <= 32 takes the grouped fold
# launch, serving the tokens it folds; FH (value heads per fold program) is 4 below the table's
# columns bound and 8 above it (here HV = 8 with FH 4 and 8: a request's heads in two programs or
# one); C > 32 takes the tile fold launch, not serving.  K = V = 24 stream in partial 16-row blocks
# and 16-column tiles where the change says so.  history == C: requests 0 and 1 start full in direct
# mode (they fold into S0 = 0); history > C: every request owns a state.
PATHS = {
    "group-FH4": (4, 4, [4, 4, 1], 5, 8, False, dict(), "_fold_group_kernel"),
    "group-FH8-channel": (4, 4, [4, 4, 1], 5, 8, True, dict(fold_FH=8), "_fold_group_kernel"),
    "group-C32-tiles": (32, 33, [32, 5, 0], 2, 2, False, dict(BV=16, KB=16, fold_BV=16, fold_KB=16),
                        "_fold_group_kernel"),
    "tile-C34-direct": (34, 34, [34, 34, 1], 2, 2, False, dict(), "_fold_tile_kernel"),
    "tile-C34-channel-tiles": (34, 35, [34, 3, 0], 2, 2, True, dict(BV=16, KB=16, fold_BV=16),
                               "_fold_tile_kernel"),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_launch_table_paths(monkeypatch, path):
    """Each launch the table can pick folds full buffers and decodes the others correctly (a flush of
    prefixes between steps), through the fold kernel the table names."""
    C, hist, lengths, steps, HV, channel, change, kernel = PATHS[path]
    case = Case(B=3, T=hist + steps, H=2 if HV > 2 else 1, HV=HV, K=24, V=24, channel_gate=channel,
                gate="mild" if channel else "mixed", beta="uniform", seed=33)
    config = dataclasses.replace(config_for("decode", Key(C=C, columns=3 * HV * 24, channel=channel)), **change)
    assert config.fold == ("tile" if C > 32 else "group")
    used = []
    for name in ("_fold_group_kernel", "_fold_tile_kernel"):
        jit = getattr(dec, name)

        class Spy:
            def __getitem__(self, grid, jit=jit, name=name):
                used.append(name)
                return jit[grid]

        monkeypatch.setattr(dec, name, Spy())

    class Configured(Poisoned):
        @staticmethod
        def buffered_decode(*args, buffer, **kw):
            return Poisoned.buffered_decode(*args, buffer=buffer, config=config, **kw)

    _assert_all(P.check_decode(Configured, case, torch.float32, capacity=C, history=hist, lengths=lengths,
                               flushes={1: [0, 1, 0]}, device=DEVICE))
    assert used and set(used) == {kernel}, used


@pytest.mark.parametrize("C,columns,fold,FH", [
    (32, 8 * 1024 * 64 - 1, "group", 4), (32, 8 * 1024 * 64, "group", 8), (33, 8 * 1024 * 64, "tile", 8),
])
def test_launch_table_rows(C, columns, fold, FH):
    """The decode table's rows at their bounds: the tile fold past C = 32; 4 value heads per grouped
    fold program below 1024 eight-head programs at V = 128 (B * HV * V < 8 * 1024 * 64), 8 from there."""
    config = config_for("decode", Key(C=C, columns=columns))
    assert (config.fold, config.fold_FH) == (fold, FH)


@pytest.mark.parametrize("state,capability,BV", [
    (torch.bfloat16, (9, 0), 128), (torch.float16, (9, 0), 128), (torch.float32, (9, 0), 64),
    (torch.bfloat16, None, 64),
])
def test_a_16_bit_state_streams_whole_value_rows_on_sm90(state, capability, BV):
    """The decode table keys on the stored state's dtype: 128 state columns per program and the state sums by
    tl.dot for a 16-bit state on sm_90 (the interpreter keeps the default), and ``key_of`` passes the dtype
    through."""
    cfg = config_for("decode", Key(C=16, columns=64 * 32 * 128, state=state, capability=capability))
    assert (cfg.BV, cfg.dot) == (BV, BV == 128)
    assert key_of(torch.empty(1, 1, 1, 8), B=1, HV=1, V=8, state=state).state == state
    assert key_of(torch.empty(1, 1, 1, 8), B=1, HV=1, V=8).state == torch.float32


def _own_decode(x: dict, buf) -> tuple:
    """kvbuffer_ref's buffered_decode of every token of ``x`` (on the CPU) from ``buf``: (outputs, buffer), the
    own form of a sequence of decode steps."""
    outs = []
    for t in range(x["q"].shape[1]):
        o, buf = ref.buffered_decode(**{n: v[:, t:t + 1].cpu() for n, v in x.items()}, buffer=buf)
        outs.append(o)
    return torch.cat(outs, 1), buf


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
    # the baseline: the recurrence and the chunkwise form (chunks of max(64, C)) in float32, and the same calls
    # run by kvbuffer_ref on a float32 copy of the same (empty) buffer (its own form)
    (o64, S64), base = P.truth_and_baseline(x, chunk=C)
    own_o, own = _own_decode(x, ref.KVBuffer.empty(2, 1, 2, 8, 8, C, dtype=torch.float32))
    assert_matches(torch.cat(outs, 1).cpu(), o64, [base[0], own_o], name="direct.o")
    assert_matches(fast.materialize_state(buf).cpu(), S64, [base[1], ref.materialize_state(own)], name="direct.state",
                   head_axis=1)


def test_without_state_storage_decodes_then_refuses_to_fold():
    """A buffer without state storage decodes correctly until a request is full; then buffered_decode
    is a ValueError (as in the reference), and flush allocates the state."""
    C = 2
    case = Case(B=1, T=C + 1, H=1, HV=1, K=8, V=8, seed=3)
    x = case.inputs(torch.float32, DEVICE)
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, C, with_state=False, dtype=torch.float32, device=DEVICE)
    outs = []
    for t in range(C):
        o, buf = Poisoned.buffered_decode(**{n: v[:, t:t + 1] for n, v in x.items()}, buffer=buf)
        outs.append(o)
    (o64, _), base = P.truth_and_baseline(x, chunk=C)
    own_o, _ = _own_decode({n: v[:, :C] for n, v in x.items()},
                           ref.KVBuffer.empty(1, 1, 1, 8, 8, C, with_state=False, dtype=torch.float32))
    assert_matches(torch.cat(outs, 1).cpu(), o64[:, :C], [base[0][:, :C], own_o], name="no-storage.o")
    last = {n: v[:, C:] for n, v in x.items()}
    with pytest.raises(ValueError, match="no state storage"):
        fast.buffered_decode(**last, buffer=buf)
    with pytest.raises(ValueError, match="no state storage"):
        ref.buffered_decode(**last, buffer=buf)
    flushed = fast.flush(buf, count=1)
    assert flushed.state is not None and flushed.lengths.tolist() == [1] and flushed.has_state.tolist() == [True]


@FEW
@given(setup=buffered(capacities=(2, 4, 8, 17), max_new=1), data=st.data())
def test_flush_prefix_matches_reference_flush(setup, data):
    """flush of any per-request prefix == the reference's: same entries moved down, G rebased, state folded."""
    case, C, hist, lengths = setup
    x64 = P.upcast_inputs(case.inputs(torch.float64))
    buf64 = P.ragged_buffer({n: t[:, :hist] for n, t in x64.items()}, lengths, C, compute=torch.float32)
    counts = torch.tensor([data.draw(st.integers(0, n), label=f"count[{b}]") for b, n in enumerate(lengths)])
    want = ref.flush(buf64, count=counts)
    base = ref.flush(P.buffer_to(buf64, dtype=torch.float32), count=counts)
    got = Poisoned.flush(P.buffer_to(buf64, dtype=torch.float32, device=DEVICE), count=counts.to(DEVICE))
    assert torch.equal(got.lengths.cpu(), want.lengths) and torch.equal(got.has_state.cpu(), want.has_state)
    for b, n in enumerate(want.lengths.tolist()):
        assert torch.equal(got.u[b, :n].cpu(), base.u[b, :n]), "remaining u must move unchanged"
        assert torch.equal(got.k[b, :n].cpu(), base.k[b, :n]), "remaining keys must move unchanged"
    live = (torch.arange(C)[None, :] < want.lengths[:, None])[:, :, None]
    assert_matches(got.G.cpu(), want.G, base.G, name="flush.G", head_axis=2,
                   valid=live[..., None] if case.channel_gate else live)
    if want.state is not None:
        owned = want.has_state[:, None, None, None]
        assert_matches(got.state.cpu(), want.state, base.state, name="flush.state", head_axis=1, valid=owned)


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_flush_and_the_tile_fold_store_the_same_state(channel):
    """flush and decode's tile fold run one fold loop (``_fold.fold_tile``): a full buffer flushed, and the
    same buffer folded by a decode step's tile fold, store the same state bit for bit (the same column
    tile; a stateful request and a direct one, partial 32-row blocks)."""
    C, HV, K, V = 34, 2, 24, 24
    case = Case(B=2, T=C + 3, H=1, HV=HV, K=K, V=V, channel_gate=channel, gate="mild" if channel else "mixed",
                beta="uniform", seed=21)
    x64 = P.upcast_inputs(case.inputs(torch.float64))
    buf = P.buffer_to(P.ragged_buffer(x64, [C, C], C, compute=torch.float32), dtype=torch.float32, device=DEVICE)
    buf.has_state[1] = False  # request 1 in direct mode: both fold its entries into S0 = 0
    config = config_for("decode", Key(C=C, columns=2 * HV * V, channel=channel))
    assert config.fold == "tile"
    folded, flushed = ref.KVBuffer(**buf.cloned()), ref.KVBuffer(**buf.cloned())
    token = _token(2, 1, HV, K, V)
    if channel:
        token["g"] = -torch.rand(2, 1, HV, K, device=DEVICE)
    Poisoned.buffered_decode(**token, buffer=folded, config=config)
    Poisoned.flush(flushed, config=FlushConfig(BV=config.fold_BV))
    assert folded.lengths.tolist() == [1, 1] and flushed.lengths.tolist() == [0, 0]
    assert torch.equal(folded.state, flushed.state), "flush and the tile fold stored different states"


def test_materialize_state_is_zero_for_requests_without_a_state():
    """A request that owns no state and has no entries: its storage row is garbage (here NaN), not a state."""
    buf = ref.KVBuffer.empty(2, 1, 2, 8, 8, 4, dtype=torch.float32, device=DEVICE)
    buf = buf.replace(state=torch.full_like(buf.state, float("nan")))
    assert torch.equal(fast.materialize_state(buf).cpu(), torch.zeros(2, 2, 8, 8))


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16; measured on CUDA")
def test_bf16_ucache_reports_its_error(record_property):
    """u cached in bfloat16 (keys and G kept): within the bfloat16 row of the table (the error is also
    recorded as a property)."""
    C, hist = 8, 10
    case = Case(B=3, T=hist + 2 * C, H=2, HV=4, K=16, V=16, seed=2)
    x = case.inputs(torch.float32, DEVICE)
    buf = P.buffer_to(P.ragged_buffer(P.upcast_inputs({n: t[:, :hist] for n, t in x.items()}), [0, 3, C], C,
                                      compute=torch.float32),
                      dtype=torch.float32, device=DEVICE)
    buf = buf.replace(u=buf.u.to(torch.bfloat16))
    own_o, _ = _own_decode({n: v[:, hist:].cpu() for n, v in x.items()}, P.buffer_to(buf, dtype=torch.float32).replace(
        u=buf.u.cpu().clone()))  # kvbuffer_ref's same calls on the same bfloat16 u-cache: the own form
    outs = []
    for t in range(hist, case.T):
        o, buf = fast.buffered_decode(**{n: v[:, t:t + 1] for n, v in x.items()}, buffer=buf)
        outs.append(o)
    (o64, _), base = P.truth_and_baseline(x, chunk=C)
    # the baseline: the correct forms in float32 and the reference's same calls on the bfloat16 u-cache
    c = compare(torch.cat(outs, 1).cpu(), o64[:, hist:], [base[0][:, hist:].cpu(), own_o], name="decode[bf16 u-cache].o")
    record_property("bf16_ucache_worst_rel", c.worst_rel)
    assert c.passed, str(c)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
def test_decode_and_flush_capture_in_a_cuda_graph():
    """Inside a CUDA graph capture the checks that read device values are skipped (no host sync): a
    captured step replays to the same result as an eager one."""
    C = 4
    case = Case(B=2, T=1, H=1, HV=2, K=16, V=16, seed=7)
    x = case.inputs(torch.float32, DEVICE)
    hist = P.upcast_inputs(Case(B=2, T=C, H=1, HV=2, K=16, V=16, seed=8).inputs(torch.float32))
    make = lambda: P.buffer_to(P.ragged_buffer(hist, [C, 2], C, compute=torch.float32), dtype=torch.float32,
                                     device=DEVICE)  # noqa: E731
    eager, graphed = make(), make()
    o_eager, _ = fast.buffered_decode(**x, buffer=eager)
    fast.flush(eager, count=1)
    fast.buffered_decode(**x, buffer=make())  # compile outside the capture
    fast.flush(make(), count=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, _ = fast.buffered_decode(**x, buffer=graphed)
        fast.flush(graphed, count=1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager)
    for name, x in graphed.tensors().items():
        if x is not None:
            assert torch.equal(x, getattr(eager, name)), name


# ----------------------------------------------------------------------------- errors
def test_raw_form_is_not_implemented():
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, 2, form="raw", dtype=torch.float32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="u-cache"):
        fast.buffered_decode(**_token(), buffer=buf)
    with pytest.raises(NotImplementedError, match="u-cache"):
        fast.flush(buf)


def test_inputs_are_checked_like_the_reference():
    buf = ref.KVBuffer.empty(1, 1, 2, 8, 8, 2, dtype=torch.float32, device=DEVICE)
    one = _token(HV=2)
    with pytest.raises(ValueError, match="one token per request"):
        fast.buffered_decode(**{n: torch.cat([t, t], 1) for n, t in one.items()}, buffer=buf)
    with pytest.raises(ValueError, match="HV"):  # the buffer has 2 value heads, the tokens 1
        fast.buffered_decode(**_token(HV=1), buffer=buf)
    with pytest.raises(ValueError, match="count"):
        fast.flush(buf, count=torch.tensor([3], device=DEVICE))


@pytest.mark.parametrize("op", ["buffered_decode", "flush"])
def test_config_of_another_class_is_a_type_error(op):
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, 2, dtype=torch.float32, device=DEVICE)
    wrong = FlushConfig() if op == "buffered_decode" else DecodeConfig()
    call = (lambda c: fast.buffered_decode(**_token(), buffer=buf, config=c)) if op == "buffered_decode" else \
        (lambda c: fast.flush(buf, config=c))
    for bad in (wrong, dict(BV=16)):
        with pytest.raises(TypeError, match="config: expected a kvbuffer_fast.launch"):
            call(bad)


def test_unknown_fold_kernel_is_a_value_error():
    buf = ref.KVBuffer.empty(1, 1, 1, 8, 8, 2, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="config.fold"):
        fast.buffered_decode(**_token(), buffer=buf, config=DecodeConfig(fold="fused"))
