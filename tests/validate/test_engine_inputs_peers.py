"""The engines' own preprocessing behind the engine_inputs lane (``--impl vllm-inputs``, ``--impl sglang-inputs``):
each adapter calls the engine's kernels as its GDN layer calls them (the calls bind to the real signatures, with
the layer's arguments), returns what they return (16-bit q, k, v for 16-bit inputs), and the lane's verdict on
vLLM's ``fused_post_conv_prep`` is the softplus finding of docs/peers.md, and nothing else.

vLLM's kernels come from ``$KVBUFFER_PEER_PATH``, else the checkout's ``.whl/vllm/`` or ``.whl/``; SGLang's from
``$KVBUFFER_PEER_PATH``, else ``.whl/sglang/`` or ``.whl/`` (``python3 -m pip download --no-deps vllm -d .whl/vllm``,
``... sglang -d .whl/sglang``: the wheels are read, not installed).  Without them these tests skip."""

import inspect
import os
from pathlib import Path

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer import implementations
from kvbuffer.peers import sglang as sg
from kvbuffer.peers import vllm as vl
from kvbuffer.peers.replayssm import PEER_ENV
from kvbuffer.validate.adapters import AdapterError
from kvbuffer.validate.runner import run_validation

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K, V = 2, 4, 8, 12


def _where(locate, sub):
    """The first of $KVBUFFER_PEER_PATH, .whl/<sub>, .whl that holds the engine's kernel files, or None."""
    for p in (os.environ.get(PEER_ENV), ROOT / ".whl" / sub, ROOT / ".whl"):
        try:
            if p:
                locate(str(p))
                return str(p)
        except AdapterError:
            continue
    return None


VLLM_AT, SGLANG_AT = _where(vl.locate, "vllm"), _where(sg.locate, "sglang")


@pytest.fixture
def vllm_kernels(monkeypatch):
    if not VLLM_AT:
        pytest.skip("vLLM's kernels not available: set KVBUFFER_PEER_PATH to a vllm wheel or put one in .whl/vllm")
    monkeypatch.setenv(PEER_ENV, VLLM_AT)
    try:
        return vl.load_kernels()
    except AdapterError as e:
        pytest.skip(f"vLLM's kernels not available ({e})")


@pytest.fixture
def sglang_kernels(monkeypatch):
    if not SGLANG_AT:
        pytest.skip("SGLang's kernels not available: set KVBUFFER_PEER_PATH to a sglang wheel or put one in "
                    ".whl/sglang")
    monkeypatch.setenv(PEER_ENV, SGLANG_AT)
    try:
        return sg.load_kernels(inputs=True)
    except AdapterError as e:
        pytest.skip(f"SGLang's preprocessing kernels not available ({e})")


def _inputs(dtype, B=3, T=2, seed=0, z=None):
    """mixed_qkv [B, T, 2 H K + HV V], a, b [B, T, HV], A_log, dt_bias [HV] in ``dtype``; ``z``: a + dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, T, 2 * H * K + HV * V, generator=gen, dtype=torch.float64)
    a = torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 6 - 3 if z is None else z.double().expand(B, T, HV)
    b = torch.randn(B, T, HV, generator=gen, dtype=torch.float64) * 4
    A_log = torch.rand(HV, generator=gen, dtype=torch.float64) - 0.5
    dt_bias = torch.zeros(HV, dtype=torch.float64) if z is not None else torch.rand(HV, generator=gen,
                                                                                        dtype=torch.float64)
    return [t.to(dtype).to(DEVICE) for t in (mixed, a, b, A_log, dt_bias)]


def _truth(x, qk_l2norm=True):
    mixed, a, b, A_log, dt_bias = (t.double().cpu() for t in x)
    return ref.engine_inputs(mixed, a, b, A_log=A_log, dt_bias=dt_bias, num_heads=H, head_k_dim=K, qk_l2norm=qk_l2norm)


def _call(adapter, x, qk_l2norm=True):
    mixed, a, b, A_log, dt_bias = x
    return adapter.engine_inputs(mixed, a, b, A_log=A_log, dt_bias=dt_bias, num_heads=H, head_k_dim=K,
                                 qk_l2norm=qk_l2norm)


def _binding(real, calls):
    sig = inspect.signature(real)

    def fn(*args, **kw):
        bound = sig.bind(*args, **kw)
        calls.append(dict(bound.arguments))
        return real(*bound.args, **bound.kwargs)
    return fn


# ----------------------------------------------------------------------------- vllm-inputs
def test_vllm_inputs_calls_fused_post_conv_prep_as_the_layer_does(vllm_kernels):
    impl = implementations.resolve("vllm-inputs")
    assert not impl.unavailable, impl.unavailable
    assert impl.obj._k.fused_post_conv_prep.__module__.endswith(".fused_gdn_prefill_post_conv")
    calls = []
    impl.obj._k = type(vllm_kernels)(**dict(vars(vllm_kernels), fused_post_conv_prep=_binding(
        vllm_kernels.fused_post_conv_prep, calls)))
    x = _inputs(torch.float16)
    q, k, v, g, beta = _call(impl.obj, x)
    (c,) = calls
    assert c["apply_l2norm"] is True and c["output_g_exp"] is False
    assert (c["num_k_heads"], c["head_k_dim"], c["head_v_dim"]) == (H, K, V)
    assert c["conv_output"].shape == (6, 2 * H * K + HV * V) and c["a"].shape == c["b"].shape == (6, HV)
    assert c["A_log"].dtype == torch.float32 and c["dt_bias"].dtype == torch.float16
    # what the kernel returns: q, k, v in mixed_qkv's dtype, g and beta in float32, shaped [B, T, ..]
    assert [t.dtype for t in (q, k, v, g, beta)] == [torch.float16] * 3 + [torch.float32] * 2
    assert q.shape == k.shape == (3, 2, H, K) and v.shape == (3, 2, HV, V) and g.shape == beta.shape == (3, 2, HV)


def test_vllm_inputs_match_the_map_where_a_plus_dt_bias_is_positive(vllm_kernels):
    adapter = implementations.resolve("vllm-inputs").obj
    for qk_l2norm in (True, False):
        x = _inputs(torch.float32, z=torch.tensor(2.5))
        got, truth = _call(adapter, x, qk_l2norm), _truth(x, qk_l2norm)
        for name, o, t in zip("qkvgb", got, truth):
            assert float((o.double().cpu() - t).abs().max() / t.abs().max()) < 3e-7, name


def test_vllm_softplus_loses_g_where_a_plus_dt_bias_is_negative(vllm_kernels):
    """The finding: log(1 + exp(x)) in float32 for x <= 0, so g loses its relative precision as exp(x) nears
    float32's epsilon (g = -0.0 from x = -17); float32's log1p keeps it to 1e-7."""
    adapter = implementations.resolve("vllm-inputs").obj
    for z, worst in ((-20.0, 1.0), (-10.0, 1e-4)):
        x = _inputs(torch.float32, B=1, T=1, z=torch.tensor(z))
        g, g64 = _call(adapter, x)[3].double().cpu(), _truth(x)[3]
        rel = float(((g - g64).abs() / g64.abs()).max())
        assert rel >= worst * 0.99, (z, rel)


def test_the_vllm_inputs_lane_fails_on_g_alone(vllm_kernels, monkeypatch):
    monkeypatch.setenv(PEER_ENV, VLLM_AT)
    impl = implementations.resolve("vllm-inputs")
    rep = run_validation([impl], ops=[("engine_inputs", None)], dtypes=[torch.float32], seed=3, max_examples=1,
                         progress=None, explain=False, device=DEVICE)
    (lane,) = [r for r in rep.lanes if r.operation == "engine_inputs"]
    assert lane.status == "FAIL" and lane.klass == "wrong-result", lane.failure
    failed = [c for c in lane.failure["comparisons"] if c.startswith("FAIL")]
    assert failed and all(".g [float32]" in c for c in failed), lane.failure["comparisons"]


# ----------------------------------------------------------------------------- sglang-inputs
def test_sglang_inputs_resolve(sglang_kernels):
    """The lane runs wherever the kernels load (the interpreter too: l2norm_fwd's block pointers are served by
    ``kvbuffer.peers._block_ptr``)."""
    impl = implementations.resolve("sglang-inputs")
    assert not impl.unavailable and impl.has("engine_inputs")


def test_sglang_inputs_call_split_gating_and_norm_as_the_backend_does(sglang_kernels):
    """The split, the gating and the norm run (the interpreter too), each call bound to its real signature."""
    calls = {"split": [], "gating": [], "l2norm": []}
    kernels = type(sglang_kernels)(**dict(
        vars(sglang_kernels),
        fused_qkv_split_gdn_prefill=_binding(sglang_kernels.fused_qkv_split_gdn_prefill, calls["split"]),
        fused_gdn_gating=_binding(sglang_kernels.fused_gdn_gating, calls["gating"]),
        l2norm_fwd=_binding(sglang_kernels.l2norm_fwd, calls["l2norm"])))
    adapter = sg.SGLangInputs(kernels)
    x = _inputs(torch.float16, z=torch.tensor(2.5))
    q, k, v, g, beta = _call(adapter, x)
    (s,), (gt,) = calls["split"], calls["gating"]
    assert s["mixed_qkv"].shape == (6, 2 * H * K + HV * V)
    assert (s["num_q_heads"], s["num_k_heads"], s["num_v_heads"], s["head_q"], s["head_k"], s["head_v"]) == \
        (H, H, HV, K, K, V)
    assert gt["A_log"].dtype == torch.float32 and gt["a"].shape == (6, HV) and "threshold" not in gt
    assert [c["x"].shape for c in calls["l2norm"]] == [(1, 6, H, K)] * 2
    assert all(set(c) == {"x"} for c in calls["l2norm"])  # eps: its default, 1e-6, as fla.chunk calls it
    assert [t.dtype for t in (q, k, v, g, beta)] == [torch.float16] * 3 + [torch.float32] * 2
    truth = _truth(x, qk_l2norm=True)
    for name, o, t in zip("qkvg", (q, k, v, g), truth):
        assert float((o.double().cpu() - t).abs().max() / t.abs().max()) < (1e-3 if name in "qk" else 3e-7), name


def test_sglang_gating_rounds_beta_to_the_dtype_of_b(sglang_kernels):
    """The finding: fused_gdn_gating stores sigmoid(b) rounded to b's dtype into its float32 beta."""
    b = torch.linspace(-8, 8, 33, dtype=torch.float16, device=DEVICE).view(33, 1)
    zeros = torch.zeros(33, 1, dtype=torch.float16, device=DEVICE)
    _, beta = sglang_kernels.fused_gdn_gating(torch.zeros(1, device=DEVICE), zeros, b,
                                              torch.zeros(1, dtype=torch.float16, device=DEVICE))
    assert beta.dtype == torch.float32
    assert torch.equal(beta.flatten(), torch.sigmoid(b.float()).to(torch.float16).float().flatten())
    rel = ((beta.double().flatten() - torch.sigmoid(b.double()).flatten()).abs() / torch.sigmoid(b.double()).flatten())
    assert float(rel.max()) > 1e-4


def test_without_the_engines_the_inputs_lanes_are_not_run_with_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv(PEER_ENV, str(tmp_path))
    monkeypatch.delenv("KVBUFFER_PEER_INTERPRET", raising=False)
    find = sg.importlib.util.find_spec
    monkeypatch.setattr(sg.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("vllm", "sglang") else find(name, *a))
    assert "vLLM's kernels not found" in implementations.resolve("vllm-inputs").unavailable
    assert "SGLang's kernels not found" in implementations.resolve("sglang-inputs").unavailable


def test_vllm_inputs_declines_k_and_v_of_different_blocks_when_compiled(monkeypatch):
    """Compiled (Triton 3.6), vLLM's fused_post_conv_prep does not compile when K and V round up to different
    powers of two ('Mismatched type for mask_2d'): such cases are declined by name; the interpreter takes them."""
    from kvbuffer.peers import vllm
    from kvbuffer.validate.cases import Case

    case = Case(B=3, T=1, H=2, HV=4, K=8, V=12)
    assert vllm.VLLMInputs.declines(case) == ""  # the interpreter (this machine) compiles nothing
    monkeypatch.setattr(vllm, "interpreter_active", lambda: False)
    why = vllm.VLLMInputs.declines(case)
    assert "K = 8, V = 12" in why and "[BLOCK_T, 8]" in why and "[BLOCK_T, 16]" in why
    assert vllm.VLLMInputs.declines(Case(B=3, T=1, H=2, HV=4, K=9, V=16)) == ""
