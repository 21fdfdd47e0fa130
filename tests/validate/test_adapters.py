"""The adapter protocol: discovery, declared capabilities, the ready adapters."""

import os
import types

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes
from kvbuffer import implementations
from kvbuffer.validate import Case


def test_discovery_lists_every_operation_as_run_or_not_provided():
    impl = adapters.describe(types.SimpleNamespace(direct_gated_delta_rule=ref.direct_gated_delta_rule, dtypes=("float64",),
                                                   not_provided={"verify": "no speculative decoding yet"}))
    planned = lanes.plan([impl])
    keys = {l.op.key for l in planned}
    assert keys == set(lanes.OP_KEYS)
    run = [l for l in planned if l.status == "RUN"]
    assert [(l.op.key, l.dtype) for l in run] == [("direct", torch.float64)]
    reasons = {l.op.key: l.reason for l in planned if l.status == "NOT PROVIDED"}
    assert reasons["verify_chain"] == "no speculative decoding yet"
    assert "has no chunk_gated_delta_rule" in reasons["chunk"]


def test_forms_and_dtypes_the_adapter_does_not_declare_are_reported():
    impl = adapters.describe(types.SimpleNamespace(buffered_decode=ref.buffered_decode, flush=ref.flush, forms=("u",)))
    planned = lanes.plan([impl], lanes.select_ops("decode"), [torch.float64, torch.float32])
    got = {(l.op.name, l.dtype, l.status) for l in planned}
    assert ("decode[u]", torch.float32, "RUN") in got
    assert ("decode[u]", torch.float64, "NOT PROVIDED") in got
    assert ("decode[raw]", None, "NOT PROVIDED") in got


def test_the_reference_is_not_validated_against_itself():
    planned = lanes.plan([implementations.reference()], lanes.select_ops("recurrent,chunk"))
    st = {l.op.key: l.status for l in planned}
    assert st == {"recurrent": "NOT PROVIDED", "chunk": "RUN"}
    mutant_like = implementations.reference_from("kvbuffer_ref", as_truth=False)
    assert {l.op.key: l.status for l in lanes.plan([mutant_like], lanes.select_ops("recurrent"))} == \
        {"recurrent": "RUN"}


def test_stepwise_recurrent_runs_one_token_at_a_time():
    calls = []

    def step(q, k, v, *, g, beta, state, scale=None):
        calls.append(q.shape[1])
        o, S = ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                              output_final_state=True)
        state.copy_(S)
        return o

    x = Case(B=2, T=4, H=1, HV=2, K=3, V=5, channel_gate=True, gate="mild").inputs(torch.float32)
    o, S = adapters.stepwise_recurrent(step).recurrent_gated_delta_rule(**x, output_final_state=True)
    o_ref, S_ref = ref.recurrent_gated_delta_rule(**x, output_final_state=True)
    assert calls == [1, 1, 1, 1]
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)


def test_resolve_errors_are_adapter_errors():
    with pytest.raises(adapters.AdapterError, match="no module named"):
        implementations.resolve("no_such_module_xyz:thing")
    with pytest.raises(adapters.AdapterError, match="forms must be"):
        adapters.describe(types.SimpleNamespace(flush=ref.flush, forms=("v",)))


def test_fast_adapter_calls_the_public_api_and_turns_on_nan_outputs(monkeypatch):
    pytest.importorskip("triton", reason="kvbuffer_fast needs triton")
    import kvbuffer_fast

    monkeypatch.delenv(adapters.POISON_ENV, raising=False)
    impl = implementations.fast()
    for name in ("recurrent_gated_delta_rule", "buffered_decode", "flush", "materialize_state", "verify", "accept"):
        assert getattr(impl.obj, name) is getattr(kvbuffer_fast, name), name
    assert impl.has("recurrent_decode")  # the in-place step of kvbuffer_fast.baselines, validated stepwise
    impl.prepare()
    assert os.environ[adapters.POISON_ENV] == "1"


def test_declines_may_name_the_lane_operation_and_the_runner_passes_it():
    """``declines(case, op)``: a kernel that cannot take a shape in one operation only (fla's chunk_kda, K <= 256)
    declines it there and still runs it in the others; ``declines(case)`` answers the same in every lane."""
    seen = []

    class Recurrent:
        name = "declines-by-op"

        def recurrent_gated_delta_rule(self, q, k, v, **kw):
            return ref.recurrent_gated_delta_rule(q, k, v, **kw)

        def declines(self, case, op=""):
            seen.append(op)
            return "K above 16 (a test's limit)" if op == "recurrent" and case.K > 16 else ""

    from kvbuffer.validate.runner import run_validation
    rep = run_validation([adapters.describe(Recurrent())], ops=[("recurrent", None)], dtypes=[torch.float32], seed=3,
                         max_examples=3, progress=None, explain=False)
    (lane,) = rep.lanes
    assert set(seen) == {"recurrent"} and lane.status == "PASS" and lane.declined, (seen, lane.declined)
    one = adapters.describe(types.SimpleNamespace(name="x", recurrent_gated_delta_rule=ref.recurrent_gated_delta_rule,
                                                  declines=lambda case: "never"))
    assert one.declines(Case(B=1, T=1, H=1, HV=1, K=4, V=4), op="chunk") == "never"


def test_fla_declines_chunk_kda_above_k_256_only_in_the_chunk_lanes():
    pytest.importorskip("fla")
    from kvbuffer.peers.fla import FlaAdapter
    big = Case(B=1, T=3, H=1, HV=2, K=264, V=8, channel_gate=True)
    assert "K <= 256" in FlaAdapter.declines(big, op="chunk") and FlaAdapter.declines(big, op="chunk_varlen")
    assert FlaAdapter.declines(big, op="recurrent") == ""  # its recurrent KDA kernel takes any K
    assert FlaAdapter.declines(Case(B=1, T=3, H=1, HV=2, K=264, V=8), op="chunk") == ""  # gated delta rule
