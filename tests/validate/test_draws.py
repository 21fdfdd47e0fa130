"""What ``kvbuffer validate`` draws: every declared dtype (a dtype that cannot run here is a NOT RUN row the
summary counts), lengths around every chunk boundary in the chunk-like lanes, every gate regime at every
position in every dtype, and the ``gpu`` profile's head groups.  Cheap: plans, case lists and strategy
draws (no kernel runs), plus one tiny run that shows the NOT RUN row in the table and the summary."""

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes, runner
from kvbuffer import implementations
from kvbuffer.validate import strategies as kst
from kvbuffer.validate.cases import GPU, NORMAL, SMALL, Case, reset_positions
from kvbuffer.validate.report import table_row

CHUNK_LIKE = ("chunk", "chunk_varlen", "direct", "prefill")
QUICK = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _impl(**kw):
    obj = types.SimpleNamespace(name="x", recurrent_gated_delta_rule=ref.recurrent_gated_delta_rule, **kw)
    return adapters.describe(obj)


# ----------------------------------------------------------------------------- every declared dtype
def test_every_declared_dtype_is_planned_by_default():
    impl = _impl(dtypes=(torch.float32, torch.float16, torch.bfloat16))
    got = [(l.dtype, l.status) for l in lanes.plan([impl], lanes.select_ops("recurrent"))]
    assert got == [(torch.float32, "RUN"), (torch.float16, "RUN"), (torch.bfloat16, "RUN")]


def test_declared_bf16_on_the_interpreter_is_a_not_run_row_with_its_reason():
    impl = _impl(dtypes=(torch.float32, torch.bfloat16), interpreted=True)
    for dtypes in (None, [torch.bfloat16]):  # by default, and when --dtype names it
        rows = {l.dtype: l for l in lanes.plan([impl], lanes.select_ops("recurrent"), dtypes)}
        assert rows[torch.bfloat16].status == "NOT RUN" and "interpreter" in rows[torch.bfloat16].reason
    assert rows[torch.bfloat16].reason == lanes.INTERPRETER_BF16


def test_a_dtype_not_run_is_counted_by_the_summary(monkeypatch):
    """A declared bfloat16 that cannot run: its row says NOT RUN and why, the summary counts it and does not
    say PASSED as if everything ran.  (float32 only runs: the bfloat16 lane is the one planned NOT RUN.)"""
    impl = _impl(dtypes=(torch.float32, torch.bfloat16), interpreted=True)
    rep = runner.run_validation([impl], ops=lanes.select_ops("recurrent"), seed=5, max_examples=1, shrink=False,
                                progress=None, explain=False)
    rows = {r.dtype: r for r in rep.lanes}
    assert rows["float32"].status == "PASS" and rows["bfloat16"].status == "NOT RUN"
    assert "NOT RUN" in table_row(rows["bfloat16"]) and "interpreter" in table_row(rows["bfloat16"])
    line = rep.summary_line()
    assert line.startswith("PASSED, INCOMPLETE") and "1 not run" in line and "bfloat16" in line, line
    assert rep.passed and not rep.complete  # exits 0 (every lane run passed), but says what did not run


def test_the_bundled_kernels_plan_every_dtype_they_declare():
    for impl in implementations.default_implementations():
        if impl.unavailable:
            continue
        planned = {l.dtype for l in lanes.plan([impl]) if l.dtype is not None}
        assert planned == set(impl.dtypes), (impl.name, planned, impl.dtypes)


# ----------------------------------------------------------------------------- lengths around chunk boundaries
@pytest.mark.parametrize("sizes", [SMALL, NORMAL, GPU], ids=lambda s: s.name.split()[0])
def test_the_boundary_cases_cross_every_chunk_boundary(sizes):
    for key in ("chunk", "direct", "prefill", "chunk_varlen"):
        edges = lanes.edge_params(key, sizes)
        for c in sizes.edge_chunks:
            want = {c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1}
            if key == "chunk":
                got = {p["case"].T for p in edges if p.get("chunk_size") == c}
            elif key == "direct":
                got = {p["case"].T for p in edges}
            elif key == "prefill":  # the folded head (prompt - tail) with the chunk size c
                got = {p["prompt"] - p["tail"] for p in edges if p.get("chunk_size") == c and p["tail"] is not None}
            else:
                got = {n for p in edges if p["chunk_size"] == c for n in p["seq_lengths"]}
            assert want <= got, (key, c, sorted(want - got))
    assert {63, 64, 65} <= {p["case"].T for p in lanes.edge_params("chunk", sizes)}


def test_a_varlen_boundary_case_packs_sequences_off_the_chunk_grid():
    (p, *_) = [p for p in lanes.edge_params("chunk_varlen", SMALL) if p["chunk_size"] == 64]
    ls = p["seq_lengths"]
    assert 0 in ls and p["case"].B == len(ls) and p["case"].T == max(ls)
    starts = [sum(ls[:i]) for i in range(len(ls))]
    assert any(s % 64 for s in starts)


def test_boundary_cases_fit_the_interpreters_budget():
    """Long boundary cases keep the other dimensions small on the interpreter."""
    for key in CHUNK_LIKE:
        for p in lanes.edge_params(key, SMALL):
            c = p["case"]
            if c.T > 32:
                assert c.B * c.HV * c.K * c.V <= 7 * 2 * 8 * 8, (key, p["edge"], c)


def test_boundary_lengths():
    assert kst.boundary_lengths(129, chunk_size=64)[:6] == [63, 64, 65, 127, 128, 129]
    near = set(kst.boundary_lengths(70, chunk_size=5))
    assert {4, 5, 6, 9, 10, 11, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65} <= near and max(near) <= 70
    assert lanes.chunk_lengths(1) == [1, 2, 3] and lanes.chunk_lengths(64) == [63, 64, 65, 127, 128, 129]


def _draws(strategy, n=100):
    out = []

    @settings(QUICK, max_examples=n, derandomize=True)  # a fixed draw: the claims are about what it holds
    @given(strategy)
    def collect(p):
        out.append(p)

    collect()
    return out


@pytest.mark.parametrize("key", ["chunk", "chunk_varlen", "direct", "prefill"])
def test_the_strategies_draw_lengths_around_chunk_boundaries(key):
    """Every chunk-like lane draws T (a prompt's head) past the interpreter's max_T, at chunk boundaries, and
    keeps a long case within the size budget."""
    op = next(o for o in lanes.OPS if o.key == key)
    drawn = _draws(op.strategy(SMALL, {}), n=120)
    long = [p for p in drawn if p["case"].T > 32]
    assert long, key
    for p in long:
        c = p["case"]
        assert c.B <= max(2, SMALL.long_B) and c.HV <= SMALL.long_HV and {c.K, c.V} <= set(SMALL.long_dims), c
    if key == "chunk":
        assert any(p["case"].T in (p["chunk_size"] - 1, 2 * p["chunk_size"] + 1) for p in drawn)
        assert {p["case"].T for p in drawn} & {63, 64, 65, 127, 128, 129}
    if key == "prefill":
        heads = {p["prompt"] - (p["tail"] or 0) for p in drawn}
        assert heads & {15, 16, 17, 31, 32, 33, 63, 64, 65}


# ----------------------------------------------------------------------------- gates at every position
def test_a_reset_is_drawn_before_the_last_token_in_every_dtype():
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        positions = set()
        for seed in range(40):
            g = Case(B=2, T=40, H=1, HV=2, K=4, V=3, gate="reset", seed=seed).inputs(dt)["g"]
            positions |= set((g < -250).nonzero()[:, 1].tolist())
        assert min(positions) == 0 and 39 in positions and {15, 16, 31, 32} <= positions, (dt, sorted(positions))
        assert any(0 < t < 39 and t not in reset_positions(40) for t in positions)


def test_the_inputs_are_a_function_of_the_case_alone():
    """The inputs in a narrow dtype are the float64 inputs rounded (the gates kept in float32): no regime is
    drawn differently by dtype."""
    case = Case(B=2, T=21, H=1, HV=2, K=4, V=3, channel_gate=True, gate="reset", seed=7)
    x64 = case.inputs(torch.float64)
    for dt in (torch.float32, torch.bfloat16):
        x = case.inputs(dt)
        assert torch.equal(x["g"], x64["g"].float()) and torch.equal(x["q"], x64["q"].to(dt))


# ----------------------------------------------------------------------------- the gpu profile
def test_the_gpu_profile_draws_head_groups_up_to_8_and_more_than_32_value_heads():
    groups = {HV // H for H, HV, K, V in GPU.head_shapes}
    assert {1, 2, 4, 8} <= groups and any(HV > 32 and K == V == 128 for H, HV, K, V in GPU.head_shapes)
    assert len(set(GPU.head_shapes)) <= 6  # few compiles
    drawn = _draws(lanes.OPS[0].strategy(GPU, {}), n=200)
    shapes = {(p["case"].H, p["case"].HV, p["case"].K, p["case"].V) for p in drawn}
    assert shapes <= set(GPU.head_shapes) and {HV // H for H, HV, _, _ in shapes} >= {1, 2, 4, 8}
    assert len({p["case"].T for p in drawn}) > 5  # the lengths vary


def test_the_gpu_boundary_cases_share_the_drawn_head_shapes():
    H, HV = GPU.edge_HV
    assert HV // H == 8 and HV > 32
    for key in lanes.OP_KEYS:
        for p in lanes.edge_params(key, GPU):
            c = p["case"]
            assert (c.H, c.HV, c.K, c.V) in set(GPU.head_shapes) or p["edge"].startswith(("K=", "B=")) or "mild" in p["edge"], (key, p["edge"])


def test_the_gpu_profile_keeps_the_anchors_after_the_first():
    for key, anchors in lanes.ANCHORS.items():
        extra = [p for p in lanes.edge_params(key, GPU) if p["edge"].startswith("anchor")]
        assert len(extra) == len(anchors) - 1, key
        for p, a in zip(extra, anchors[1:]):
            assert (p["case"].B, p["case"].T) == (a["case"].B, a["case"].T)
            assert (p["case"].H, p["case"].HV, p["case"].K, p["case"].V) in GPU.head_shapes
