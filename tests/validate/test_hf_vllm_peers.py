"""The built-in ``hf`` (transformers' torch fallbacks) and ``vllm`` family (vLLM's fla copy) adapters: each maps
one small case onto the float64 recurrence (kvbuffer_ref), calls the code it names (transformers' own torch
functions even where fla is installed; vLLM's kernel files, never vLLM's package), and says clearly what is
missing when transformers or the vLLM kernels are absent.

transformers comes from the ``hf`` extra; vLLM's kernels from ``$KVBUFFER_PEER_PATH``, else the checkout's
``.whl/vllm/`` (``python3 -m pip download --no-deps vllm -d .whl/vllm``: the wheel is read, not installed),
else an installed vllm.  The tests that need them skip without them."""

import importlib.util
import inspect
import os
import sys
import types
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
    h0 = torch.randn(3, 2, 5, 7, dtype=torch.float64).float().double()  # values a float32 holds
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
    # the chunk kernel loads and runs everywhere (under the interpreter with its autotuners on their first config)
    impl = implementations.resolve("vllm-chunk")
    assert not impl.unavailable and impl.contract_for("chunk", torch.float16) == "fp16" \
        and impl.contract_for("chunk_varlen", torch.bfloat16) == "bf16" and torch.float32 not in impl.dtypes
    assert impl.varlen == ("chunk_gated_delta_rule",) and impl.channel_gate is False


# ----------------------------------------------------------------------------- vllm-chunk
@pytest.fixture
def chunk_kernels(kernels):
    """vLLM's kernels with chunk.py and everything it imports (chunk_delta_h, chunk_o, chunk_scaled_dot_kkt, cumsum,
    solve_tril, wy_fast, l2norm, index, op, utils), through the shims."""
    return vl.load_kernels(chunk=True)


def test_vllm_chunk_imports_through_the_shims_alone(chunk_kernels):
    """Every vLLM import of the chunk chain is served by a shim (the load fails otherwise, naming the module), no
    ``vllm`` module is left behind, and the one shim that stands in for vLLM machinery, the l2norm launcher
    (``vllm.model_executor.warmup``), refuses to launch rather than compute without vLLM's dispatcher."""
    fn = inspect.unwrap(chunk_kernels.chunk_gated_delta_rule)  # under torch.compiler.disable
    assert fn.__module__.endswith("flash_linear_attention.ops.chunk") or fn.__module__.endswith("fla.ops.chunk")
    assert not any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)
    l2norm_fwd = fn.__globals__["l2norm_fwd"]
    with pytest.raises(NotImplementedError, match="use_qk_l2norm_in_kernel=False"):
        l2norm_fwd(torch.ones(2, 4, dtype=torch.float16))


def _as_chunk_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     chunk_indices=None, chunk_offsets=None, use_qk_l2norm_in_kernel=False, core_attn_out=None):
    """What vLLM's ``chunk_gated_delta_rule`` returns, from the float64 recurrence: its documented convention
    (``chunk.py``), states [N, HV, V, K] (``chunk_delta_h.py`` reads h0 and writes ht [V, K] per head), the final
    state float32, o in q's dtype, one sequence per batch row or per ``cu_seqlens`` segment (B = 1)."""
    assert q.dtype == k.dtype == v.dtype and q.dtype != torch.float32 and beta.dim() == 3
    assert not use_qk_l2norm_in_kernel and chunk_indices is None and chunk_offsets is None and core_attn_out is None
    B, T = q.shape[:2]
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    S = torch.zeros(len(bounds), HV, V, K, dtype=torch.float64)
    d = lambda t: t.detach().double().cpu()  # noqa: E731
    for n, (b, s, e) in enumerate(bounds):
        h0 = None if initial_state is None else d(initial_state[n:n + 1]).transpose(-1, -2)
        o_n, S_n = ref.recurrent_gated_delta_rule(*(d(t[b:b + 1, s:e]) for t in (q, k, v)), g=d(g[b:b + 1, s:e]),
                                                  beta=d(beta[b:b + 1, s:e]), scale=scale, initial_state=h0,
                                                  output_final_state=True)
        o[b:b + 1, s:e], S[n] = o_n, S_n[0].transpose(-1, -2)
    return o.to(q.dtype).to(q.device), (S.float().to(q.device) if output_final_state else None)


def _with_stand_in(kernels, calls):
    """``kernels`` with ``_as_chunk_kernel`` as ``chunk_gated_delta_rule``, every call bound to the real kernel's
    signature first and its arguments recorded in ``calls``."""
    sig = inspect.signature(kernels.chunk_gated_delta_rule)

    def bound(*a, **kw):
        b = sig.bind(*a, **kw)
        calls.append(dict(b.arguments))
        return _as_chunk_kernel(*b.args, **b.kwargs)
    return types.SimpleNamespace(**dict(vars(kernels), chunk_gated_delta_rule=bound))


@pytest.mark.parametrize("scale", [None, 0.6])
def test_vllm_chunk_call_binds_to_the_real_signature_and_maps_onto_the_recurrence(chunk_kernels, scale):
    """The adapter's call, bound to the real kernel's signature, run through the kernel's documented convention
    (``_as_chunk_kernel``): float16 q, k, v, float32 g and beta, the state transposed to [N, HV, V, K] float32
    and back, int32 ``cu_seqlens``, the in-kernel L2 norm off; it maps onto the recurrence (grouped value heads,
    K != V, a ragged batch with an empty sequence).  The kernel itself runs only compiled (the next test)."""
    calls = []
    a = vl.VLLMChunk(_with_stand_in(chunk_kernels, calls))
    half = lambda t: t.to(torch.float16).to(DEVICE)  # noqa: E731
    q, k, v, g, beta, h0 = (t.to(torch.float16).double() for t in _case(B=2, T=5))  # values a float16 holds
    o, S = a.chunk_gated_delta_rule(half(q), half(k), half(v), g=half(g), beta=half(beta), scale=scale,
                                    initial_state=h0.float().to(DEVICE), output_final_state=True, chunk_size=16)
    (args,) = calls
    assert args["q"].dtype == torch.float16 and args["g"].dtype == args["beta"].dtype == torch.float32
    assert args["initial_state"].shape == (2, 2, 7, 5) and args["initial_state"].dtype == torch.float32
    assert args["initial_state"].is_contiguous() and args["use_qk_l2norm_in_kernel"] is False
    assert args["output_final_state"] is True and args.get("scale") == scale and "cu_seqlens" not in args
    o_r, S_r = ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                              output_final_state=True)
    assert o.dtype == torch.float16 and S.shape == h0.shape and S.dtype == torch.float32
    # the stand-in is the float64 recurrence rounded once, on the same values: the mapping is exact
    assert torch.equal(o.cpu(), o_r.to(torch.float16)) and torch.equal(S.cpu(), S_r.float())
    # varlen: [3, 0, 2] tokens, int64 offsets handed over as int32; no final state asked for
    q, k, v, g, beta, _ = (t.to(torch.float16).double() for t in _case(B=1, T=5, seed=1))
    h0 = torch.randn(3, 2, 5, 7, dtype=torch.float64).float().double()  # values a float32 holds
    cu = torch.tensor([0, 3, 3, 5])
    o, S = a.chunk_gated_delta_rule(half(q), half(k), half(v), g=half(g), beta=half(beta), scale=scale,
                                    initial_state=h0.float().to(DEVICE), output_final_state=True,
                                    cu_seqlens=cu.to(DEVICE))
    assert calls[-1]["cu_seqlens"].dtype == torch.int32 and calls[-1]["cu_seqlens"].tolist() == cu.tolist()
    for n, (s, e) in enumerate([(0, 3), (3, 3), (3, 5)]):
        o_r, S_r = ref.recurrent_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                                  scale=scale, initial_state=h0[n:n + 1], output_final_state=True)
        assert torch.equal(S[n:n + 1].cpu(), S_r.float())
        if e > s:
            assert torch.equal(o[:, s:e].cpu(), o_r.to(torch.float16))
    _, S = a.chunk_gated_delta_rule(half(q), half(k), half(v), g=half(g), beta=half(beta), cu_seqlens=cu.to(DEVICE))
    assert S is None and calls[-1]["initial_state"] is None and calls[-1]["output_final_state"] is False


def test_the_runner_drives_vllm_chunk_through_both_lanes(chunk_kernels):
    """``kvbuffer validate``'s runner through the adapter (the stand-in behind it): strided input views, poisoned
    allocations, ragged batches with empty sequences; both lanes run and pass."""
    from kvbuffer.validate.adapters import describe
    from kvbuffer.validate.runner import run_validation

    calls = []
    impl = describe(vl.VLLMChunk(_with_stand_in(chunk_kernels, calls)))
    rep = run_validation([impl], ops=[("chunk", None), ("chunk_varlen", None)], dtypes=[torch.float16], seed=3,
                         max_examples=2, progress=None, explain=False, device=DEVICE)
    assert sorted((r.operation, r.status) for r in rep.lanes) == [("chunk", "PASS"), ("chunk_varlen", "PASS")], \
        [(r.operation, r.status, r.failure) for r in rep.lanes]
    assert calls and all(c["use_qk_l2norm_in_kernel"] is False for c in calls)


_CHUNK_DTYPES = [torch.float16, torch.bfloat16] if torch.cuda.is_available() and not vl.interpreter_active() \
    else [torch.float16]


def _vllm_chunk_results(chunk_kernels, dtype, lengths):
    from kvbuffer.validate import Case
    from kvbuffer.validate import properties as P
    from kvbuffer.validate.adapters import describe
    from kvbuffer.validate.contracts import active_contract

    impl = describe(vl.VLLMChunk(chunk_kernels))
    case = Case(B=len(lengths), T=max(lengths), H=2, HV=4, K=16, V=16, gate="mixed", beta="mixed", seed=5)
    with active_contract(impl.contract_for("chunk", dtype)):
        return P.check_varlen(impl.obj, case, dtype, lengths=lengths, chunk_size=64, device=DEVICE)


@pytest.mark.parametrize("dtype", _CHUNK_DTYPES)
def test_vllm_chunk_kernel_maps_onto_the_recurrence(chunk_kernels, dtype):
    """The real kernel (compiled on CUDA, else under the interpreter): a ragged batch across its 64-token chunk
    (65, 70 and 3 tokens, each with an initial state), judged by the error policy under the contract the adapter
    declares."""
    res = _vllm_chunk_results(chunk_kernels, dtype, [65, 70, 3])
    assert res and all(c.passed for c in res), "\n".join(map(str, res))


@pytest.mark.parametrize("dtype", _CHUNK_DTYPES)
def test_vllm_chunk_breaks_every_sequence_after_an_empty_one(chunk_kernels, dtype):
    """vLLM 0.34.0's finding (docs/peers.md): with a sequence of 0 tokens before others in ``cu_seqlens``, the
    sequences after it come back wrong (its ``prepare_chunk_indices`` numbers a chunk's sequence by counting
    first chunks, and an empty sequence has none); the one before it is right.  When vLLM fixes it, this test
    fails: the matrix's row is then out of date."""
    res = _vllm_chunk_results(chunk_kernels, dtype, [5, 0, 11])
    first = [c for c in res if "[sequence 0]" in c.name]
    later = [c for c in res if "[sequence 2]" in c.name]
    assert first and all(c.passed for c in first), "\n".join(map(str, first))
    assert later and not any(c.passed for c in later), "\n".join(map(str, later))


def test_vllm_chunk_declines_key_heads_past_256():
    from kvbuffer.validate import Case
    assert vl.VLLMChunk.declines(Case(B=1, T=3, H=1, HV=1, K=256, V=8), "chunk") == ""
    assert "K <= 256" in vl.VLLMChunk.declines(Case(B=1, T=3, H=1, HV=1, K=264, V=8), "chunk_varlen")


def test_vllm_without_kernels_says_where_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setenv(PEER_ENV, str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else _find(name, *a))
    with pytest.raises(AdapterError, match=r"vLLM's kernels not found.*pip download --no-deps vllm"):
        vl.locate()
    for name in ("vllm", "vllm-chunk"):
        assert "vLLM's kernels not found" in implementations.resolve(name).unavailable


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
