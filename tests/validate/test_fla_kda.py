"""The built-in fla adapters: scalar gates reach fla's gated-delta-rule kernels, per-channel gates its KDA
kernels, with exact argument conversions (checked against the float64 recurrence under the error-policy
table); the chunk kernels through their real signatures with the math of fla's recurrent kernels behind
them, and themselves under the Triton interpreter; the pooled KDA decode step in its engine convention."""

import inspect

import pytest
import torch

from kvbuffer.validate import adapters, Case

from kvbuffer import implementations
from kvbuffer.validate.runner import run_validation

from .adapters_for_tests import agrees_with_recurrence

pytest.importorskip("fla")


def _recording(fn, calls):
    def wrapped(*a, **kw):
        calls.append((a, kw))
        return fn(*a, **kw)
    return wrapped


@pytest.mark.parametrize("channel", [True, False])
def test_recurrent_gates_go_to_kda_or_the_gated_delta_rule_exactly(channel):
    impl = implementations.resolve("fla")
    gdn, kda = [], []
    impl.obj._fused = _recording(impl.obj._fused, gdn)
    impl.obj._fused_kda = _recording(impl.obj._fused_kda, kda)
    # grouped heads (HV = 2H), an initial state, the default scale
    x = Case(B=2, T=3, H=1, HV=2, K=4, V=6, channel_gate=channel, gate="mild", seed=4).inputs(torch.float32)
    S0 = torch.randn(2, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    agrees_with_recurrence(impl.obj.recurrent_gated_delta_rule(**x, initial_state=S0, output_final_state=True), x, initial_state=S0)
    (a, kw), = kda if channel else gdn
    assert not (gdn if channel else kda)
    assert torch.equal(kw["g"], x["g"]) and torch.equal(kw["beta"], x["beta"])
    assert kw["use_qk_l2norm_in_kernel"] is False and kw["initial_state"].dtype == torch.float32
    if channel:  # the log gate and beta as they are: no in-kernel gate activation, no sigmoid
        assert kw["use_gate_in_kernel"] is False and kw["use_beta_sigmoid_in_kernel"] is False


def test_per_channel_decode_steps_and_varlen_batches_reach_kda():
    impl = implementations.resolve("fla")
    assert impl.supports_channel_gate(("recurrent_decode",)) and "recurrent_gated_delta_rule" in impl.varlen
    x = Case(B=1, T=2, H=1, HV=2, K=4, V=5, channel_gate=True, gate="strong", seed=7).inputs(torch.float32)
    S = torch.randn(1, 2, 4, 5, generator=torch.Generator().manual_seed(1))
    S0 = S.clone()
    o = torch.cat([impl.obj.recurrent_decode(*(x[n][:, t:t + 1] for n in "qkv"), g=x["g"][:, t:t + 1],
                                             beta=x["beta"][:, t:t + 1], state=S) for t in range(2)], 1)
    agrees_with_recurrence((o, S), x, initial_state=S0)
    # two sequences of 2 and 1 tokens flattened into one row, each with its own initial state
    y = Case(B=2, T=2, H=1, HV=2, K=4, V=5, channel_gate=True, gate="mild", seed=8).inputs(torch.float32)
    flat = {n: torch.cat([t[0], t[1, :1]]).unsqueeze(0) for n, t in y.items()}
    S2 = torch.randn(2, 2, 4, 5, generator=torch.Generator().manual_seed(2))
    o, S = impl.obj.recurrent_gated_delta_rule(**flat, initial_state=S2, output_final_state=True,
                                               cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32))
    for i, sl in enumerate((slice(0, 2), slice(2, 3))):
        xi = {n: t[:, sl] for n, t in flat.items()}
        agrees_with_recurrence((o[:, sl], S[i:i + 1]), xi, initial_state=S2[i:i + 1])


@pytest.mark.parametrize("channel", [True, False])
def test_chunk_calls_bind_to_fla_signatures_exactly(channel):
    """Each call the adapter makes to chunk_kda / chunk_gated_delta_rule is bound to the real kernel's signature, and the bound arguments run through fla's recurrent kernel of
    the same recurrence (exact math), against the float64 truth."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    impl = implementations.resolve("fla")
    real, recurrent = (chunk_kda, fused_recurrent_kda) if channel else \
        (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
    bound = []

    def as_real(*a, **kw):
        b = inspect.signature(real).bind(*a, **kw)
        bound.append(b.arguments)
        args = dict(b.arguments)
        args.update(args.pop("kwargs", {}))
        for chunk_only in ("cu_seqlens_cpu", "chunk_indices", "safe_gate", "lower_bound", "disable_recompute", "cp_context"):
            args.pop(chunk_only, None)
        return recurrent(**args)

    impl.obj._chunk_kda = impl.obj._chunk = as_real
    x = Case(B=1, T=5, H=1, HV=2, K=4, V=3, channel_gate=channel, gate="mild", seed=9).inputs(torch.float32)
    S0 = torch.randn(1, 2, 4, 3, generator=torch.Generator().manual_seed(3))
    # the method itself (on the CPU the adapter hides it: not provided)
    got = type(impl.obj).chunk_gated_delta_rule(impl.obj, **x, initial_state=S0, output_final_state=True, chunk_size=3)
    agrees_with_recurrence(got, x, initial_state=S0)
    (args,) = bound
    assert torch.equal(args["g"], x["g"]) and torch.equal(args["beta"], x["beta"])
    assert args["use_qk_l2norm_in_kernel"] is False and args["initial_state"].dtype == torch.float32
    assert "chunk_size" not in args.get("kwargs", {})  # fla's own chunk size (64)
    if channel:
        assert args["use_gate_in_kernel"] is False and args["use_beta_sigmoid_in_kernel"] is False


def test_the_pooled_kda_decode_passes_in_its_engine_convention():
    impl = implementations.resolve("fla-pool")
    assert impl.dtypes == (torch.float32, torch.float16) and impl.supports_channel_gate(("recurrent_decode",))
    rep = run_validation([impl], ops=[("recurrent_decode", None)], dtypes=list(impl.dtypes), seed=3,
                         max_examples=2, progress=None, explain=False)
    lanes = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    assert [r.dtype for r in lanes] == ["float32", "float16"]
    for lane in lanes:
        assert lane.status == "PASS", lane.failure
        assert lane.checks > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of fla's chunk kernels (a CPU check)")
@pytest.mark.parametrize("channel", [False, True])
def test_chunk_kernels_run_under_the_interpreter_across_fla_chunks_and_an_empty_sequence(channel):
    """Under the Triton interpreter fla's own chunk kernels run (``_interpretable_chunk_kernels``): a varlen
    batch of 70 (past fla's chunk of 64), 0 and 5 tokens, each sequence with its initial state, agrees with
    the float64 recurrence sequence by sequence under the error table."""
    impl = implementations.resolve("fla")
    assert impl.has("chunk_gated_delta_rule") and "chunk_gated_delta_rule" not in impl.not_provided
    lens = (70, 0, 5)
    x = Case(B=1, T=sum(lens), H=1, HV=2, K=8, V=8, channel_gate=channel, gate="mild", seed=11).inputs(torch.float32)
    S0 = torch.randn(len(lens), 2, 8, 8, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 70, 70, 75])
    o, S = impl.obj.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for i in (0, 2):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        agrees_with_recurrence((o[:, sl], S[i:i + 1]), {n: t[:, sl] for n, t in x.items()}, initial_state=S0[i:i + 1],
                               chunk=64)
    assert torch.equal(S[1], S0[1])  # the empty sequence keeps its initial state
