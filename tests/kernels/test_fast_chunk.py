"""kvbuffer_fast.chunk_gated_delta_rule and direct_gated_delta_rule against the float64 recurrence, judged
by the error table (``compare``), on shapes that cross chunk boundaries (chunk_size 16, T past two chunks):
scalar and per-channel gates, grouped value heads, K and V not powers of two, initial state or none,
variable-length batches (cu_seqlens), reset gates (-inf).  On a CPU they run through the Triton interpreter
in float32; bfloat16 runs on CUDA only.  Outputs are NaN-poisoned (``KVBUFFER_POISON=1``).
"""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.launch import ChunkConfig, DirectConfig  # noqa: E402
from kvbuffer_ref.validate import Case, assert_matches  # noqa: E402
from kvbuffer_ref.validate import properties as P  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic; bf16 runs on CUDA only"))]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("KVBUFFER_POISON", "1")


def _assert_all(results):
    assert results
    for r in results:
        assert r.passed, str(r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,channel,gate,initial", [
    ((2, 37, 1, 2, 8, 12), False, "mild", True),      # B = 2, a group of 2, V not a power of two
    ((1, 40, 2, 4, 5, 16), True, "strong", False),    # per-channel gates, K = 5, no initial state
    ((1, 33, 1, 1, 16, 7), False, "mixed", True),     # every gate regime, underflowing decays included
    ((1, 35, 1, 3, 8, 8), True, "mixed", True),
], ids=["scalar-groups", "channel-K5", "scalar-mixed", "channel-mixed"])
def test_chunk_matches_oracle(dtype, shape, channel, gate, initial):
    B, T, H, HV, K, V = shape
    case = Case(B=B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel, gate=gate, seed=sum(shape))
    _assert_all(P.check_chunk(fast, case, dtype, chunk_size=16, device=DEVICE, with_initial_state=initial))


@pytest.mark.parametrize("solve", ["rows", "blocked"])
@pytest.mark.parametrize("T,chunk_size,channel", [(70, 64, False), (50, 32, True)], ids=["64-scalar", "32-channel"])
def test_chunk_solves(solve, T, chunk_size, channel):
    """Both triangular solves (forward substitution over rows; 16 x 16 blocks then block rows) at chunk sizes
    of 2 and 4 blocks, a short last chunk, from an initial state."""
    case = Case(B=1, T=T, H=1, HV=2, K=8, V=12, channel_gate=channel, gate="strong", seed=T)
    impl = type("Impl", (), {"chunk_gated_delta_rule": staticmethod(
        lambda *a, **kw: fast.chunk_gated_delta_rule(*a, **kw, config=ChunkConfig(solve=solve)))})
    _assert_all(P.check_chunk(impl, case, torch.float32, chunk_size=chunk_size, device=DEVICE))


def test_chunk_default_size_and_no_final_state():
    """The default chunk_size (64) over T = 70; output_final_state=False returns None."""
    x = Case(B=1, T=70, H=1, HV=2, K=8, V=8, seed=3).inputs(torch.float32, DEVICE)
    (o64, _), base = P.truth_and_baseline(x)
    o, S = fast.chunk_gated_delta_rule(**x)
    assert S is None
    assert_matches(o.cpu(), o64, base[0], name="chunk[64].o", g=x["g"])


def _cu_case(channel: bool, seed: int):
    lens = [5, 0, 18, 17]  # an empty sequence; sequences shorter than, and past, one chunk of 16
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    case = Case(B=1, T=cu[-1], H=1, HV=2, K=8, V=12, channel_gate=channel, gate="mixed", seed=seed)
    return case, cu


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_chunk_varlen_is_each_sequence_alone(index_dtype, channel):
    """cu_seqlens: o and the final states [N, HV, K, V] == the per-sequence float64 recurrence."""
    case, cu = _cu_case(channel, 7 + channel)
    x = case.inputs(torch.float32, DEVICE)
    cu_t = torch.tensor(cu, dtype=index_dtype, device=DEVICE)
    S0 = torch.randn(len(cu) - 1, case.HV, case.K, case.V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x64 = P.upcast_inputs(x)
    o64, S64 = ref.recurrent_gated_delta_rule(**x64, initial_state=S0.double().cpu(), output_final_state=True,
                                              cu_seqlens=torch.tensor(cu))
    ob, Sb = ref.recurrent_gated_delta_rule(**{n: t.cpu() for n, t in x.items()}, initial_state=S0.cpu(),
                                            output_final_state=True, cu_seqlens=torch.tensor(cu))
    o, S = fast.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, chunk_size=16,
                                       cu_seqlens=cu_t)
    assert S.shape == (len(cu) - 1, case.HV, case.K, case.V)
    assert_matches(o.cpu(), o64, ob, name="chunk[varlen].o", g=x["g"])
    assert_matches(S.cpu(), S64, Sb, name="chunk[varlen].state", head_axis=1, g=x["g"])


def test_reference_chunk_varlen_is_the_per_sequence_recurrence():
    """kvbuffer_ref's chunk form with cu_seqlens == its recurrence, sequence by sequence, in float64."""
    case, cu = _cu_case(True, 11)
    x = case.inputs(torch.float64)
    cu_t = torch.tensor(cu)
    o, S = ref.chunk_gated_delta_rule(**x, output_final_state=True, chunk_size=4, cu_seqlens=cu_t)
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        xs = {k: t[:, a:b] for k, t in x.items()}
        on, Sn = ref.recurrent_gated_delta_rule(**xs, output_final_state=True)
        assert_matches(o[:, a:b], on, name=f"ref.chunk[varlen][{n}].o")
        assert_matches(S[n:n + 1], Sn, name=f"ref.chunk[varlen][{n}].state", head_axis=1)


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_chunk_reset_gates(channel):
    """g = -inf (an exact reset) mid-chunk and on a chunk boundary: finite, equal to the recurrence."""
    case = Case(B=1, T=36, H=1, HV=2, K=8, V=8, channel_gate=channel, seed=5)
    x = case.inputs(torch.float32, DEVICE)
    x["g"][:, 7] = float("-inf")
    x["g"][:, 16, 1] = float("-inf")
    (o64, S64), base = P.truth_and_baseline(x)
    o, S = fast.chunk_gated_delta_rule(**x, output_final_state=True, chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_matches(o.cpu(), o64, base[0], name="chunk[reset].o", g=x["g"].clamp(min=-200.0))
    assert_matches(S.cpu(), S64, base[1], name="chunk[reset].state", head_axis=1, g=x["g"].clamp(min=-200.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,channel", [(11, False), (20, True)], ids=["one-chunk", "two-chunks-channel"])
def test_direct_matches_oracle(dtype, T, channel):
    case = Case(B=2, T=T, H=1, HV=2, K=8, V=12, channel_gate=channel, gate="mixed", seed=T)
    x = case.inputs(dtype, DEVICE)
    (o64, _), base = P.truth_and_baseline(x)
    o = fast.direct_gated_delta_rule(**x, chunk_size=16)
    assert_matches(o.cpu(), o64, base[0], name="direct.o", dtype=dtype, g=x["g"])
    _assert_all(P.check_direct(fast, case, dtype, device=DEVICE))


def test_bad_arguments_are_named():
    x = Case(B=2, T=8, H=1, HV=2, K=8, V=8, seed=1).inputs(torch.float32, DEVICE)
    x1 = {n: t[:1] for n, t in x.items()}
    with pytest.raises(ValueError, match="q: with cu_seqlens"):
        fast.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing"):
        fast.chunk_gated_delta_rule(**x1, cu_seqlens=torch.tensor([0, 5, 4, 8], device=DEVICE))
    with pytest.raises(TypeError, match="cu_seqlens"):
        fast.chunk_gated_delta_rule(**x1, cu_seqlens=torch.tensor([0.0, 8.0], device=DEVICE))
    with pytest.raises(ValueError, match="initial_state"):
        fast.chunk_gated_delta_rule(**x1, cu_seqlens=torch.tensor([0, 3, 8], device=DEVICE),
                                    initial_state=torch.zeros(1, 2, 8, 8, device=DEVICE))
    with pytest.raises(ValueError, match="chunk_size"):
        fast.chunk_gated_delta_rule(**x, chunk_size=0)
    with pytest.raises(TypeError, match="ChunkConfig"):
        fast.chunk_gated_delta_rule(**x, config=DirectConfig())
    with pytest.raises(ValueError, match="config.solve"):
        fast.chunk_gated_delta_rule(**x, config=ChunkConfig(solve="lu"))
    with pytest.raises(TypeError, match="DirectConfig"):
        fast.direct_gated_delta_rule(**x, config=ChunkConfig())
    bad = dict(x, g=x["g"].clone())
    bad["g"][0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="g: entry"):
        fast.chunk_gated_delta_rule(**bad)
