"""Properties 6, 8 and 9 of docs/testing.md: trees, grouped vs expanded heads, batch vs alone, scalar vs
per-channel gates; plus: no reference function modifies its inputs."""

import copy

import pytest
import torch
from einops import repeat
from hypothesis import given
from hypothesis import strategies as st

import kvbuffer_ref as ref
from kvbuffer.validate import assert_matches
from kvbuffer.validate import properties as P
from kvbuffer.validate import strategies as kst

from .strategies_local import Calling, buffered, counted, drawn, informative


@pytest.mark.parametrize("form", ["u", "raw"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@counted()
@given(data=st.data())
def test_tree_verify_equals_per_path_recurrence(dtype, form, data):
    """Every node's output == the recurrence along its root-to-node path; accepting a node appends
    its path and rejected branches leave no trace in later outputs or the state."""
    C = data.draw(st.integers(1, 6), label="capacity")
    B = data.draw(st.integers(1, 3), label="B")
    parents, counts = data.draw(kst.draft_batch(B, max_drafts=10), label="tree")
    D = len(parents[0])
    hist = data.draw(st.integers(0, 8), label="history")
    after = data.draw(st.integers(0, 3), label="after")
    case = data.draw(drawn(B=B, T=hist + D + after, layouts=("contiguous",)), label="case")
    informative(case.inputs(), tokens=slice(hist, case.T))
    lengths = data.draw(st.lists(st.integers(0, min(hist, C)), min_size=B, max_size=B), label="lengths")
    nodes = data.draw(kst.acceptances(counts), label="nodes")
    for r in P.check_verify_accept(Calling(ref, case), case, dtype, capacity=C, history=hist, lengths=lengths,
                                   parents=parents, num_drafts=counts, nodes=nodes, after=after, form=form):
        assert r.passed, str(r)


@counted()
@given(case=drawn(max_T=10, max_H=2, max_group=3))
def test_grouped_heads_equal_expanded_heads(case):
    x = case.inputs()
    informative(x)
    grp = case.HV // case.H
    xe = dict(x, q=repeat(x["q"], "b t h d -> b t (h r) d", r=grp), k=repeat(x["k"], "b t h d -> b t (h r) d", r=grp))
    for fn in (ref.recurrent_gated_delta_rule, ref.chunk_gated_delta_rule):
        o, _ = fn(**x)
        oe, _ = ref.recurrent_gated_delta_rule(**xe)
        assert_matches(o, oe, name=f"{fn.__name__} grouped vs expanded")
    assert_matches(ref.direct_gated_delta_rule(**x), ref.direct_gated_delta_rule(**xe), name="direct grouped vs expanded")


@pytest.mark.parametrize("form", ["u", "raw"])
@counted()
@given(setup=buffered(min_new=1))
def test_ragged_batch_equals_each_request_alone(form, setup):
    case, C, hist, lengths = setup
    x = case.inputs()
    informative(x, tokens=slice(hist, case.T))
    buf = P.ragged_buffer({n: t[:, :hist] for n, t in x.items()}, lengths, C, form)
    outs = []
    for t in range(hist, case.T):
        o, buf = ref.buffered_decode(**{n: v[:, t:t + 1] for n, v in x.items()}, buffer=buf)
        outs.append(o)
    batch = torch.cat(outs, dim=1)
    for b in range(case.B):
        xb = {n: v[b:b + 1] for n, v in x.items()}
        bb = P.ragged_buffer({n: v[:, :hist] for n, v in xb.items()}, lengths[b:b + 1], C, form)
        alone = []
        for t in range(hist, case.T):
            o, bb = ref.buffered_decode(**{n: v[:, t:t + 1] for n, v in xb.items()}, buffer=bb)
            alone.append(o)
        assert_matches(batch[b:b + 1], torch.cat(alone, dim=1), name=f"request {b} in the batch vs alone")


@counted()
@given(case=drawn(max_T=10, channel_gate=False), data=st.data())
def test_scalar_gate_equals_equal_channel_gate(case, data):
    x = case.inputs()
    informative(x)
    xc = dict(x, g=repeat(x["g"], "b t h -> b t h k", k=case.K))
    C = data.draw(st.integers(1, 5))
    pairs = [
        (ref.recurrent_gated_delta_rule(**x)[0], ref.recurrent_gated_delta_rule(**xc)[0], "recurrent"),
        (ref.chunk_gated_delta_rule(**x, chunk_size=3)[0], ref.chunk_gated_delta_rule(**xc, chunk_size=3)[0], "chunk"),
        (ref.direct_gated_delta_rule(**x), ref.direct_gated_delta_rule(**xc), "direct"),
        (ref.prefill(**x, capacity=C)[0], ref.prefill(**xc, capacity=C)[0], "prefill"),
    ]
    for a, b, name in pairs:
        assert_matches(a, b, name=f"{name}: scalar vs equal-channel gate")


@given(case=drawn(max_T=8, min_T=4))
def test_reference_functions_do_not_modify_their_inputs(case):
    x = case.inputs()
    S0 = torch.randn(case.B, case.HV, case.K, case.V, dtype=torch.float64)
    hist = case.T // 2
    buf = P.ragged_buffer({n: t[:, :hist] for n, t in x.items()}, [min(hist, 2)] * case.B, 3)
    snapshot = copy.deepcopy((x, S0, buf))
    ref.recurrent_gated_delta_rule(**x, initial_state=S0, output_final_state=True)
    ref.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, chunk_size=3)
    ref.direct_gated_delta_rule(**x)
    ref.prefill(**x, capacity=3, initial_state=S0)
    tok = {n: t[:, hist:hist + 1] for n, t in x.items()}
    ref.buffered_decode(**tok, buffer=buf)
    ref.flush(buf)
    ref.materialize_state(buf)
    drafts_in = {n: t[:, hist:] for n, t in x.items()}
    _, drafts = ref.verify(**drafts_in, buffer=buf)
    dsnap = copy.deepcopy(drafts)
    ref.accept(buf, drafts, counts=1)
    for a, b in zip((x, S0, buf, drafts), snapshot + (dsnap,)):
        _same(a, b)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), "a reference function modified its input in place"
    elif isinstance(a, dict):
        for key in a:
            _same(a[key], b[key])
    elif a is None:
        assert b is None
    else:  # dataclasses
        for f in a.__dataclass_fields__:
            _same(getattr(a, f), getattr(b, f))
