"""The bug classes of ``kvbuffer validate``: each planted bug is caught, and the report names its class."""

import io
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes, runner
from kvbuffer import implementations
from kvbuffer.validate.cases import GPU


def _direct(fn, **extra):
    """An adapter whose direct_gated_delta_rule is ``fn`` (float64, plain PyTorch)."""
    return adapters.describe(types.SimpleNamespace(name="planted", dtypes=(torch.float64,),
                                                   direct_gated_delta_rule=fn, **extra))


def _run(impl, ops="direct", **kw):
    rep = runner.run_validation([impl], ops=lanes.select_ops(ops), dtypes=[torch.float64], seed=11,
                                max_examples=3, shrink=False, progress=None, **kw)
    return [r for r in rep.lanes if r.status != "NOT PROVIDED"]


def _q_scaled_in_place(q, k, v, *, g, beta, scale=None):
    q.mul_(q.shape[-1] ** -0.5 if scale is None else scale)
    return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0)


def _cached_by_shape():
    cache = {}

    def fn(q, k, v, **kw):
        if q.shape not in cache:
            cache[q.shape] = ref.direct_gated_delta_rule(q, k, v, **kw)
        return cache[q.shape].clone()
    return fn


def _scale_ignored(q, k, v, *, scale=None, **kw):
    return ref.direct_gated_delta_rule(q, k, v, **kw)


def _head_tile_of_32(q, k, v, **kw):
    o = ref.direct_gated_delta_rule(q, k, v, **kw)
    o[:, :, 32:] = 0
    return o


def _normalises_qk(q, k, v, **kw):
    return ref.direct_gated_delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, **kw)


def _contiguous_strides(q, k, v, *, g, beta, scale=None):
    def fix(x):
        st, acc = [], 1
        for n in reversed(x.shape):
            st.insert(0, acc)
            acc *= max(n, 1)
        return torch.as_strided(x, x.shape, st, x.storage_offset())
    return ref.direct_gated_delta_rule(fix(q), fix(k), fix(v), g=fix(g), beta=fix(beta), scale=scale)


@pytest.mark.parametrize("fn, klass, text", [
    (_q_scaled_in_place, "inputs-changed", "[inputs-changed] input q changed by the call"),
    (_cached_by_shape(), "state-leak", "[state-leak] output differs on the second call with the same shape"),
    (_scale_ignored, "arguments", "explicit scale"),
    (_head_tile_of_32, "tile-boundary", "HV=36"),
    (_normalises_qk, "domain", "unit norm"),
    (_contiguous_strides, "memory-layout", "strided"),
])
def test_each_class_is_caught_and_named(fn, klass, text):
    (r,) = _run(_direct(fn))
    assert r.status == "FAIL" and r.klass == klass, (r.status, r.klass, r.why, r.failure)
    assert f"[{klass}]" in __import__("kvbuffer.validate.report", fromlist=["x"]).table_row(r)
    blob = (r.why or "") + " " + str((r.failure or {}).get("error")) + " " + str((r.failure or {}).get("edge"))
    assert text in blob, blob


def test_a_correct_adapter_passes_every_class():
    (r,) = _run(_direct(ref.direct_gated_delta_rule))
    assert r.status == "PASS" and r.checks > 0


def test_an_exception_in_the_validators_own_truth_is_its_error_not_the_implementations(monkeypatch):
    """The truth or the budget raising (out of memory on a large case, say) is an ERROR [validator] naming
    the case, never a FAIL [raised] of a correct implementation."""
    from kvbuffer.validate import properties, report

    def out_of_memory(*a, **kw):
        raise RuntimeError("CUDA out of memory (planted)")

    monkeypatch.setattr(properties.ref, "recurrent_gated_delta_rule", out_of_memory)
    (r,) = _run(_direct(ref.direct_gated_delta_rule))
    assert (r.status, r.klass) == ("ERROR", "validator"), (r.status, r.klass, r.failure)
    text = report.format_failure(r, "replay")
    assert "[validator] ValidatorFault: the validator's truth_and_baseline raised RuntimeError" in text, text
    assert "the implementation raised" not in text and "smallest failing case: Case(" in text, text
    assert "planted" in text and "out_of_memory" in text, text  # the validator's own frame, not the wrapper's


def test_a_float64_recurrent_decode_gets_a_float64_state():
    """A correct float64 in-place step passes (the stepwise wrapper keeps the state in the inputs' dtype)."""
    def step(q, k, v, *, g, beta, state, scale=None):
        assert state.dtype == q.dtype == torch.float64
        o, S = ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                              output_final_state=True)
        state.copy_(S)
        return o

    impl = adapters.describe(types.SimpleNamespace(name="step64", dtypes=(torch.float64,), recurrent_decode=step))
    (r,) = _run(impl, ops="recurrent_decode")
    assert r.status == "PASS", r.failure


def test_progress_reports_cases_done_to_its_stream():
    out = io.StringIO()
    p = runner.Progress("decode[u] / x / float32", 10, every=0.0, stream=out)
    p.tick(3)
    assert "decode[u] / x / float32: 3/10 cases" in out.getvalue()


def test_progress_while_shrinking_says_so_instead_of_counting_past_the_total():
    out = io.StringIO()
    p = runner.Progress("chunk_varlen / x / bfloat16", 2, every=0.0, stream=out)
    p.tick(84, (82, 150.0))
    assert "84/2" not in out.getvalue() and "shrinking it: 82 tries, 150 of" in out.getvalue()


def test_a_shrink_stops_at_its_time_budget(monkeypatch):
    """Past SHRINK_SECONDS the shrinker's new candidates go unrun: the failure found is still reported,
    replayed, and the lane ends after a few calls (an unbounded shrink of a compiled lane outlasted its stage)."""
    tried = []

    def wrong_when(q, k, v, *, g, beta, scale=None):  # no anchor or boundary case has these shapes: drawn, shrunk
        tried.append(q.shape)
        B, T, _, K = q.shape
        return ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale) + float(B > 1 and T > 2 and 8 < K < 64)

    impl = _direct(wrong_when)
    monkeypatch.setattr(runner, "SHRINK_SECONDS", 0.0)
    rep = runner.run_validation([impl], ops=lanes.select_ops("direct"), dtypes=[torch.float64], seed=11,
                                max_examples=40, shrink=True, progress=None, explain=False)
    (r,) = [x for x in rep.lanes if x.status != "NOT PROVIDED"]
    assert r.status == "FAIL" and r.failure["case"] is not None
    bounded = len(tried)
    monkeypatch.setattr(runner, "SHRINK_SECONDS", 600.0)
    tried.clear()
    runner.run_validation([impl], ops=lanes.select_ops("direct"), dtypes=[torch.float64], seed=11,
                          max_examples=40, shrink=True, progress=None, explain=False)
    assert bounded < len(tried)


def test_without_triton_the_fast_rows_are_listed_as_not_run(monkeypatch):
    def no_triton():
        raise adapters.AdapterError("kvbuffer_fast needs triton, which is not installed")

    monkeypatch.setattr(implementations, "fast", no_triton)
    impls = implementations.default_implementations()
    assert [i.name for i in impls] == ["kvbuffer_ref", "kvbuffer_fast"]
    rep = runner.run_validation(impls, ops=lanes.select_ops("direct"), dtypes=[torch.float64], seed=1,
                                max_examples=1, progress=None)
    row = next(r for r in rep.lanes if r.implementation == "kvbuffer_fast")
    assert row.status == "NOT RUN" and "triton" in row.reason
    assert rep.passed and not rep.complete
    assert rep.summary_line().startswith("PASSED, INCOMPLETE") and "NOT RUN: kvbuffer_fast" in rep.summary_line()
    assert rep.to_json()["summary"]["NOT RUN"] == 1


#: The gpu profile's logic (production-shaped boundary cases, the oracle on the inputs' device, the
#: first anchor only) at sizes a CPU runs in seconds.
TINY_GPU = replace(GPU, name="gpu (tiny, for the CPU test)", max_B=2, max_T=6, max_H=2, dims=(4, 8), max_capacity=4,
                   max_history=5, max_new=2, max_chain=3, max_tree=4, max_after=1, max_prompt=6, big_capacity=0,
                   edge_base=(2, 2, 4, 8, 8), edge_B=3, edge_HV=(2, 6), edge_T=20, edge_rows=6,
                   edge_dims=((8, 12),), edge_tree=5, edge_chunks=(4,), long_T=20, long_B=1, long_HV=4, long_dims=(4,),
                   head_shapes=((2, 4, 8, 8), (1, 2, 4, 8), (1, 8, 8, 8)))


def test_the_gpu_profile_runs_its_lanes(monkeypatch):
    monkeypatch.setattr(runner, "GPU", TINY_GPU)
    impl = implementations.reference_from("kvbuffer_ref", as_truth=False)
    rep = runner.run_validation([impl], ops=lanes.select_ops("recurrent,chunk,decode[u],verify_tree[u],prefill[u]"),
                                dtypes=[torch.float32], profile="gpu", seed=3, max_examples=1, progress=None)
    ran = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    assert len(ran) == 5 and all(r.status == "PASS" for r in ran), [(r.operation, r.status, r.failure) for r in ran]
    assert {r.sizes for r in ran} == {TINY_GPU.name}
