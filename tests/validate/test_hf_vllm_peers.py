"""The built-in ``hf`` (transformers' torch fallbacks) and ``vllm`` family (vLLM's fla copy) adapters: each maps
one small case onto the float64 recurrence (kvbuffer_ref), calls the code it names (transformers' own torch
functions even where fla is installed; vLLM's kernel files, never vLLM's package), and says clearly what is
missing when transformers or the vLLM kernels are absent.

transformers comes from the ``hf`` extra; vLLM's kernels from ``$KVBUFFER_PEER_PATH``, else the checkout's
``.whl/vllm/`` (``python3 -m pip download --no-deps vllm -d .whl/vllm``: the wheel is read, not installed),
else an installed vllm.  The tests that need them skip without them."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer import implementations
from kvbuffer.peers import hf as hfp
from kvbuffer.peers import vllm as vl
from kvbuffer.peers.replayssm import PEER_ENV
from kvbuffer.validate.adapters import AdapterError

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _case(B=2, T=5, H=1, HV=2, K=5, V=7, channel=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(B, T, H, K), torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v, h0 = r(B, T, HV, V), r(B, HV, K, V)
    g = -torch.rand(B, T, HV, *((K,) if channel else ()), generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, h0


def _rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


def _check(fn, case, scale, tol=2e-6, **kw):
    q, k, v, g, beta, h0 = case
    o_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                              output_final_state=True)
    f = lambda t: t.float().to(DEVICE)  # noqa: E731
    o, S = fn(f(q), f(k), f(v), g=f(g), beta=f(beta), scale=scale, initial_state=f(h0), output_final_state=True, **kw)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert _rel(o, o_r) < tol and _rel(S, S_r) < tol, (_rel(o, o_r), _rel(S, S_r))


# ----------------------------------------------------------------------------- hf
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'kvbuffer[hf]')")
@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("scale", [None, 0.6])
def test_hf_maps_onto_the_recurrence(channel, scale):
    impl = implementations.resolve("hf")
    a = impl.obj
    for fn in a._f.values():  # transformers' own torch code, not the fla kernel its dispatcher would pick
        assert fn.__module__.startswith("transformers.models."), fn
    assert impl.varlen == () and impl.channel_gate is True
    case = _case(T=70, channel=channel)  # T > 64: two chunks
    _check(a.recurrent_gated_delta_rule, case, scale)
    _check(a.chunk_gated_delta_rule, case, scale, chunk_size=64)
    q, k, v, g, beta = (t[:, :1] for t in case[:5])
    h0 = case[5]
    state = h0.float().to(DEVICE)
    o = a.recurrent_decode(q.float().to(DEVICE), k.float().to(DEVICE), v.float().to(DEVICE), g=g.float().to(DEVICE),
                           beta=beta.float().to(DEVICE), state=state, scale=scale)
    o_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                              output_final_state=True)
    assert _rel(o, o_r) < 2e-6 and _rel(state, S_r) < 2e-6


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'kvbuffer[hf]')")
def test_hf_16bit_inputs_come_back_in_their_dtype():
    a = implementations.resolve("hf").obj
    q, k, v, g, beta, h0 = (t.to(torch.float16) for t in _case())
    o, S = a.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=0.6, initial_state=h0.float(),
                                        output_final_state=True)
    assert o.dtype == torch.float16 and S.dtype == torch.float32


def test_hf_without_transformers_names_the_package_and_range(monkeypatch):
    from kvbuffer.integrations import transformers as integ

    def missing():
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(integ, "_transformers", missing)
    with pytest.raises(AdapterError, match=r"transformers>=5\.17\.0,<5\.26 .*kvbuffer\[hf\]"):
        implementations.resolve("hf")


# ----------------------------------------------------------------------------- vllm
def _where():
    for p in (os.environ.get(PEER_ENV), ROOT / ".whl" / "vllm", ROOT / ".whl"):
        if p and vl._tree(Path(p)):
            return str(p)
    return None


@pytest.fixture
def kernels(monkeypatch):
    where = _where()
    if where:
        monkeypatch.setenv(PEER_ENV, where)
    try:
        return vl.load_kernels()
    except AdapterError as e:
        pytest.skip(f"vLLM's kernels not available ({e})")


@pytest.mark.parametrize("scale", [None, 0.6])
def test_vllm_recurrent_maps_onto_the_recurrence(kernels, scale):
    a = vl.VLLMRecurrent(kernels)
    case = _case(B=2, T=4)
    _check(a.recurrent_gated_delta_rule, case, scale)
    # varlen: [3, 0, 2] tokens flattened, int32 offsets; the empty sequence keeps its initial state
    q, k, v, g, beta, _ = _case(B=1, T=5, seed=1)
    h0 = torch.randn(3, 2, 5, 7, dtype=torch.float64)
    cu = torch.tensor([0, 3, 3, 5])
    o, S = a.recurrent_gated_delta_rule(*(t.float().to(DEVICE) for t in (q, k, v)), g=g.float().to(DEVICE),
                                        beta=beta.float().to(DEVICE), scale=scale, initial_state=h0.float().to(DEVICE),
                                        output_final_state=True, cu_seqlens=cu.to(DEVICE))
    for n, (s, e) in enumerate([(0, 3), (3, 3), (3, 5)]):
        o_r, S_r = ref.recurrent_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                                  scale=scale, initial_state=h0[n:n + 1], output_final_state=True)
        assert _rel(S[n:n + 1], S_r) < 2e-6
        if e > s:
            assert _rel(o[:, s:e], o_r) < 2e-6


def test_vllm_engine_adapters_build(kernels):
    for name in ("vllm", "vllm-decode", "vllm-packed", "vllm-inputs"):
        impl = implementations.resolve(name)
        assert not getattr(impl, "unavailable", None), impl.unavailable
        assert "vllm" in impl.name


def test_vllm_without_kernels_says_where_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setenv(PEER_ENV, str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else _find(name, *a))
    with pytest.raises(AdapterError, match=r"vLLM's kernels not found.*pip download --no-deps vllm"):
        vl.locate()
    impl = implementations.resolve("vllm")
    assert "vLLM's kernels not found" in impl.unavailable


_find = importlib.util.find_spec


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_hf_hands_the_functions_one_head_count(channel):
    """transformers' layers repeat q and k to the value heads before calling these functions, whose code
    takes one head count (transformers 5.17.0's GDN functions raise on H = 2, HV = 4): so does the adapter."""
    seen = []

    def fake(query, key, value, g, beta, *a, initial_state=None, output_final_state=False, **kw):
        seen.append((query.shape[2], key.shape[2], value.shape[2]))
        B, T, HV, V = value.shape
        return torch.zeros_like(value), torch.zeros(B, HV, key.shape[-1], V)

    fns = {f"{kind}_{form}": fake for kind in ("gdn", "kda") for form in ("chunk", "recurrent")}
    a = hfp.HFAdapter("test", fns)
    q, k, v, g, beta, h0 = _case(H=2, HV=4, channel=channel)
    a.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0)
    a.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0)
    assert seen == [(4, 4, 4)] * 2
