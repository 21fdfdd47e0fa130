"""SGLang's packed decode as a benchmark peer (``sglang_decode``): the case built on SGLang's own kernel file,
read from the wheel in the checkout's .whl/sglang/ (never installed; under the Triton interpreter here, in
float32 and float16), matches the float64 oracle on the inputs the kernel gets; a wrong state layout fails
that check; without the wheel the op is skipped with how to get it.  (The runner's --smoke run of the row is
in test_bench_peers.py.)"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton not installed: the benchmarks time the Triton kernels")

from bench import workloads as W  # noqa: E402
from kvbuffer.peers import sglang as sg  # noqa: E402

DEVICE = "cpu"  # tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA


@pytest.fixture(scope="module")
def kernels():
    if not sg._tree(Path(W.SGLANG_PATH)):
        pytest.skip(f"no SGLang wheel in {W.SGLANG_PATH} (python3 -m pip download --no-deps sglang -d .whl/sglang)")
    return W.Api().sglang(DEVICE)


def _api(packed_decode, real):
    api = W.Api()
    api.sglang = lambda device: types.SimpleNamespace(version=real.version, source=real.source,
                                                      fused_recurrent_gated_delta_rule_packed_decode=packed_decode)
    return api


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sglang_decode_matches_the_oracle(kernels, dtype):
    calls = []

    def packed_decode(**kw):  # SGLang's kernel itself, its arguments recorded
        calls.append(kw)
        return kernels.fused_recurrent_gated_delta_rule_packed_decode(**kw)
    plan = dataclasses.replace(W.SMOKE, dtype=dtype)
    case = W.build("sglang_decode", _api(packed_decode, kernels), W.Workload(plan, 3, DEVICE))
    assert case.peer and case.passed, [c["text"] for c in case.checks]
    assert [c["name"] for c in case.checks] == ["sglang_decode.o", "sglang_decode.state"]
    kw = calls[0]
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["ssm_state_indices"].dtype.is_signed
    assert kw["initial_state"].shape[1:] == (plan.shapes.HV, plan.shapes.V, plan.shapes.K)  # [slots, HV, V, K]
    assert str(kw["mixed_qkv"].dtype) == f"torch.{dtype}" and str(kw["initial_state"].dtype) == "torch.float32"
    s = plan.shapes
    assert case.io_bytes > 2 * 3 * s.HV * s.K * s.V * 4  # the state read and written, plus the token rows
    case.run()  # a replay: one step on every layer
    assert len(calls) == 1 + plan.layers and len({id(c["initial_state"]) for c in calls}) == plan.layers


def test_a_state_read_as_k_by_v_fails_the_check(kernels):
    def kv_read(**kw):  # the pool's states transposed around the call: the kernel reads and writes [K, V]
        pool = kw["initial_state"]
        pool.copy_(pool.transpose(-1, -2).clone())
        out = kernels.fused_recurrent_gated_delta_rule_packed_decode(**kw)
        pool.copy_(pool.transpose(-1, -2).clone())
        return out
    case = W.build("sglang_decode", _api(kv_read, kernels), W.Workload(W.SMOKE, 3, DEVICE))
    failed = [c["name"] for c in case.checks if not c["passed"]]
    assert failed == ["sglang_decode.o", "sglang_decode.state"], [c["text"] for c in case.checks]


@pytest.mark.parametrize("path, match", [(None, "no --sglang-path"), ("/nonexistent", "holds no sglang-")])
def test_without_the_wheel_the_op_is_skipped_with_how_to_get_it(path, match):
    api = W.Api(sglang_path=path)
    for _ in range(2):  # the reason is kept: every batch skips with it
        with pytest.raises(W.Skip, match=match) as e:
            W.build("sglang_decode", api, W.Workload(W.SMOKE, 2, DEVICE))
        assert "pip download --no-deps sglang" in str(e.value)
