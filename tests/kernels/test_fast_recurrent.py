"""kvbuffer_fast.recurrent_gated_delta_rule and the in-place recurrent decode step of
kvbuffer_fast.baselines against the float64 recurrence, judged by the error table (``compare``).

On a CPU they run through the Triton interpreter, in float32 with small shapes; bfloat16 runs on CUDA
only.  Outputs are NaN-poisoned (``KVBUFFER_POISON=1``), so an element a kernel does not write fails.
"""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
from kvbuffer_fast.baselines import recurrent_decode  # noqa: E402
from kvbuffer_fast.launch import DecodeConfig, RecurrentConfig  # noqa: E402

from kvbuffer.validate import Case, assert_matches  # noqa: E402
from kvbuffer.validate import properties as P  # noqa: E402

from tests.property.strategies_local import Calling, counted, fast_drawn, informative  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter is slow: the ci profile runs 6 examples of the drawn test here (every run draws new ones)
FEW = settings(max_examples=6) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else (lambda f: f)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic; bf16 runs on CUDA only"))]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("KVBUFFER_POISON", "1")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FEW
@counted()
@given(case=fast_drawn(min_T=1, max_T=4, budget=24))
def test_recurrent_matches_oracle(dtype, case):
    """Output and final state from a random initial state; scalar and per-channel gates, grouped heads,
    K and V up to 64, B up to 5, every region of ``strategies_local.drawn`` (an explicit scale, inputs and
    initial state non-contiguous)."""
    informative(case.inputs(), torch.ones(case.B, case.HV, case.K, case.V, dtype=torch.float64))
    results = P.check_recurrent(Calling(fast, case), case, dtype, device=DEVICE)
    assert results
    for r in results:
        assert r.passed, str(r)


def test_recurrent_with_column_tiles_and_no_initial_state():
    """V = 24 in 16-column tiles (the last one partial), from a zero state, the final state not asked for."""
    case = Case(B=2, T=3, H=1, HV=2, K=8, V=24, seed=12)
    x = case.inputs(torch.float32, DEVICE)
    (o64, _), base = P.truth_and_baseline(x)
    o, S = fast.recurrent_gated_delta_rule(**x, config=RecurrentConfig(BV=16))
    assert S is None
    assert_matches(o.cpu(), o64, base[0], name="recurrent[BV=16].o")


def test_recurrent_decode_updates_state_in_place():
    case = Case(B=2, T=1, H=1, HV=2, K=8, V=16, seed=4)
    x = case.inputs(torch.float32, DEVICE)
    S = torch.randn(2, 2, 8, 16, device=DEVICE)
    (o64, S64), base = P.truth_and_baseline(x, S)
    ptr = S.data_ptr()
    o = recurrent_decode(**x, state=S)
    assert S.data_ptr() == ptr
    assert_matches(o.cpu(), o64, base[0], name="recurrent_decode.o")
    assert_matches(S.cpu(), S64, base[1], name="recurrent_decode.state", head_axis=1)


def test_recurrent_decode_checks_its_state():
    x = Case(B=1, T=1, H=1, HV=2, K=8, V=8, seed=1).inputs(torch.float32, DEVICE)
    with pytest.raises(ValueError, match="state"):
        recurrent_decode(**x, state=None)
    with pytest.raises(ValueError, match="state"):
        recurrent_decode(**x, state=torch.zeros(1, 2, 8, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        recurrent_decode(**x, state=torch.zeros(1, 2, 8, 8, device=DEVICE).transpose(2, 3))


def test_config_of_another_class_is_a_type_error():
    x = Case(B=1, T=1, H=1, HV=1, K=8, V=8, seed=1).inputs(torch.float32, DEVICE)
    with pytest.raises(TypeError, match="config: expected a kvbuffer_fast.launch.RecurrentConfig"):
        fast.recurrent_gated_delta_rule(**x, config=DecodeConfig())


@pytest.mark.parametrize("channel,initial", [(False, True), (True, False)], ids=["scalar-S0", "channel"])
def test_recurrent_varlen(channel, initial):
    """cu_seqlens: sequences of 0, 5, 13 and 1 tokens in a batch of one (an empty one first), each from its
    own initial state (or none) to its own final state, against its own float64 recurrence; int32 offsets."""
    case = Case(B=4, T=13, H=1, HV=2, K=8, V=12, channel_gate=channel, gate="mixed", seed=11)
    for r in P.check_varlen(fast, case, torch.float32, lengths=[0, 5, 13, 1], device=DEVICE, initial=initial):
        assert r.passed, str(r)


def test_recurrent_varlen_bad_offsets_are_named():
    x = Case(B=1, T=8, H=1, HV=2, K=8, V=8, seed=1).inputs(torch.float32, DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets from 0 to T = 8"):
        fast.recurrent_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 5, 4, 8], device=DEVICE))
    with pytest.raises(ValueError, match="initial_state: with cu_seqlens expected"):
        fast.recurrent_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 3, 8], device=DEVICE),
                                        initial_state=torch.zeros(1, 2, 8, 8, device=DEVICE))
