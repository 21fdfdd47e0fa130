"""The built-in SGLang adapters (``kvbuffer.peers.sglang``): each call they make binds to the real
kernel's signature; the recurrent kernels' lanes pass under the Triton interpreter; the chunk kernel through
its real signature with SGLang's pooled recurrent kernel behind it, and itself (the interpreter too); a
wrong state layout fails; without SGLang the lanes are NOT RUN with how to get it.

SGLang's kernels come from ``$KVBUFFER_PEER_PATH``, else a ``sglang-*.whl`` in the checkout's ``.whl/sglang/``,
else an installed ``sglang``; without any of them these tests skip.  To run them:
``python3 -m pip download --no-deps sglang -d .whl/sglang`` (a 39 MB wheel; nothing of it is installed)."""

import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

from kvbuffer.validate import adapters, Case

from kvbuffer import implementations
from kvbuffer.peers import sglang as sg
from kvbuffer.validate.adapters import AdapterError
from kvbuffer.peers.engine import engine_adapter
from kvbuffer.peers.replayssm import PEER_ENV
from kvbuffer.validate.runner import run_validation

from .adapters_for_tests import agrees_with_recurrence

ROOT = Path(__file__).resolve().parents[2]
#: The suite's device: CUDA where there is one (Triton compiles for it; no interpreter), else the CPU under the
#: Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _where():
    for p in (os.environ.get(PEER_ENV), ROOT / ".whl" / "sglang", ROOT / ".whl"):
        if p and sg._tree(Path(p)):
            return str(p)
    return None


WHERE = _where()


@pytest.fixture
def kernels(monkeypatch):
    if WHERE:
        monkeypatch.setenv(PEER_ENV, WHERE)
    try:
        return sg.load_kernels()
    except AdapterError as e:
        pytest.skip(f"SGLang's kernels not available ({e})")


def _binding(real, calls, run=None):
    """A stand-in for ``real`` that binds every call to its signature, records it and runs ``run`` (default:
    ``real``) on the bound arguments."""
    sig = inspect.signature(real)

    def fn(*a, **kw):
        b = sig.bind(*a, **kw)
        calls.append(dict(b.arguments))
        return (run or real)(*b.args, **b.kwargs)
    return fn


def test_loading_leaves_no_sglang_module_behind(kernels):
    assert not any(n == "sglang" or n.startswith("sglang.") for n in sys.modules)
    assert kernels.version != "?" and kernels.source


def test_every_call_binds_to_the_real_kernel_signature(kernels):
    """The four recurrent entry points, each called the way its adapter calls it, through its real signature."""
    calls = {}
    ns = dict(vars(kernels))
    for name in ("fused_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule_update",
                 "fused_recurrent_gated_delta_rule_packed_decode", "fused_sigmoid_gating_delta_rule_update"):
        ns[name] = _binding(getattr(kernels, name), calls.setdefault(name, []))
    k = type(kernels)(**ns)
    # the oracle's convention, grouped heads, an initial state, an explicit scale
    x = Case(B=2, T=3, H=1, HV=2, K=8, V=5, gate="mild", seed=4).inputs(torch.float32, DEVICE)
    S0 = torch.randn(2, 2, 8, 5, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = sg.SGLangRecurrent(k).recurrent_gated_delta_rule(**x, initial_state=S0, output_final_state=True)
    agrees_with_recurrence(got, x, initial_state=S0)
    (kw,) = calls["fused_recurrent_gated_delta_rule"]
    assert kw["use_qk_l2norm_in_kernel"] is False and kw["initial_state"].shape == (2, 2, 5, 8)  # [N, HV, V, K]
    assert torch.equal(kw["g"], x["g"]) and torch.equal(kw["beta"], x["beta"])
    # the engine steps: what engine_adapter hands them, bound to the kernels' signatures
    N, H, HV, K, V = 3, 1, 2, 8, 5
    g = torch.Generator().manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    pool = rnd(5, HV, V, K)
    slots = torch.tensor([3, -1, 1], dtype=torch.int32, device=DEVICE)
    raw = dict(A_log=rnd(HV), dt_bias=rnd(HV))
    q, kk, v = rnd(1, N, H, K), rnd(1, N, H, K), rnd(1, N, HV, V)
    a, b = rnd(1, N, HV), rnd(1, N, HV)
    cu = torch.arange(N + 1, dtype=torch.int32, device=DEVICE)
    o = sg.decode_step(k)(q=q, k=kk, v=v, a=a, b=b, state=pool, slots=slots, cu_seqlens=cu, scale=K ** -0.5, **raw)
    assert o.shape == (1, N, HV, V)
    (kw,) = calls["fused_sigmoid_gating_delta_rule_update"]
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["initial_state_indices"] is slots
    assert kw["softplus_beta"] == 1.0 and kw["softplus_threshold"] == 20.0
    mixed = torch.cat([q[0].flatten(1), kk[0].flatten(1), v[0].flatten(1)], 1)
    o = sg.packed_step(k)(mixed_qkv=mixed, a=a[0], b=b[0], state=pool, slots=slots, scale=K ** -0.5, **raw)
    assert o.shape == (N, 1, HV, V) and torch.equal(o[1], torch.zeros_like(o[1]))  # a pad row: zero output
    (kw,) = calls["fused_recurrent_gated_delta_rule_packed_decode"]
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["ssm_state_indices"] is slots
    o = sg.pool_step(k)(q=q, k=kk, v=v, g=-torch.rand(1, N, HV, generator=g).to(DEVICE),
                        beta=torch.rand(1, N, HV, generator=g).to(DEVICE), state=pool, slots=slots, cu_seqlens=cu,
                        scale=K ** -0.5, has_initial_state=torch.tensor([False] * N))
    (kw,) = calls["fused_recurrent_gated_delta_rule_update"]
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["initial_state_source"] is pool


def test_chunk_calls_bind_to_the_real_signature_and_compute_the_recurrence(kernels, monkeypatch):
    """The adapter's call to the chunk kernel binds to its real signature, and the bound arguments (its pool,
    slots written in place) run through SGLang's pooled recurrent kernel,
    which keeps the same pool semantics, against the float64 truth.  The stand-in returns what the wheel's
    ``chunk_gated_delta_rule`` returns (``fla/chunk.py``: ``return o, None, h``, h the per-chunk states, not the
    final state), with a NaN decoy as h: the adapter must read o from the first element and the final state
    from the pool slots it addressed (the kernel's ``INPLACE_UPDATE`` store, ``fla/chunk_delta_h.py``), exactly."""
    monkeypatch.setenv(PEER_ENV, WHERE or "")
    try:
        real = sg.load_kernels(chunk=True).chunk_gated_delta_rule
    except AdapterError as e:
        pytest.skip(f"SGLang's chunk module does not import here ({e})")
    calls, wrote = [], []

    def as_recurrent(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
                     cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, inplace_update=True):
        assert inplace_update and not head_first
        before = initial_state.clone()
        B, T = q.shape[:2]
        flat = (lambda t: t.reshape(1, B * T, *t.shape[2:])) if cu_seqlens is None else (lambda t: t)
        cu = cu_seqlens if cu_seqlens is not None else torch.arange(0, B * T + 1, T, device=q.device)
        o = kernels.fused_recurrent_gated_delta_rule_update(
            flat(q), flat(k), flat(v), g=flat(g), beta=flat(beta), scale=scale, initial_state_source=initial_state,
            initial_state_indices=initial_state_indices, cu_seqlens=cu, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        o = o.reshape(*v.shape)
        h_decoy = torch.full((B, 1, *initial_state.shape[1:]), float("nan"), device=q.device)
        wrote.append((o, before, initial_state.clone()))
        return o, None, h_decoy

    k = type(kernels)(**dict(vars(kernels), chunk_gated_delta_rule=_binding(real, calls, as_recurrent)))
    adapter = sg.SGLangChunk(k)
    x = Case(B=2, T=5, H=1, HV=2, K=8, V=3, gate="mild", seed=9).inputs(torch.float32, DEVICE)
    S0 = torch.randn(2, 2, 8, 3, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = adapter.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, chunk_size=16)
    agrees_with_recurrence(got, x, initial_state=S0)
    (args,) = calls
    assert args["use_qk_l2norm_in_kernel"] is False and args["inplace_update"] is True and args["scale"] is None
    assert "head_first" not in args and "cu_seqlens" not in args  # defaults: False, None
    pool, idx = args["initial_state"], args["initial_state_indices"]
    assert pool.shape == (3, 2, 3, 8) and pool.dtype == torch.float32 and pool.is_contiguous()  # [N + 1, HV, V, K]
    assert idx.dtype == torch.int32 and idx.tolist() == [1, 2]
    assert torch.equal(args["g"], x["g"].float()) and torch.equal(args["beta"], x["beta"])
    # what the adapter read back: o the first returned element, the state the slots written in place
    (o_kernel, pool_before, pool_after), = wrote
    assert torch.equal(pool_before[1:], S0.transpose(-1, -2)) and torch.isnan(pool_before[0]).all()  # [V, K] per slot
    assert got[0] is o_kernel
    assert torch.equal(got[1], pool_after[1:].transpose(-1, -2)) and torch.isnan(pool_after[0]).all()
    # ragged sequences, int64 offsets, no initial state: the slots start at zero
    flat = {n: torch.cat([t[0, :4], t[1, :1]]).unsqueeze(0) for n, t in x.items()}
    o, S = adapter.chunk_gated_delta_rule(**flat, output_final_state=True,
                                          cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32, device=DEVICE))
    assert calls[-1]["cu_seqlens"].dtype == torch.int64 and calls[-1]["initial_state_indices"].tolist() == [1, 2]
    assert torch.equal(wrote[-1][1][1:], torch.zeros_like(wrote[-1][1][1:]))
    assert torch.equal(S, wrote[-1][2][1:].transpose(-1, -2))
    for i, sl in enumerate((slice(0, 4), slice(4, 5))):
        agrees_with_recurrence((o[:, sl], S[i:i + 1]), {n: t[:, sl] for n, t in flat.items()})


@pytest.mark.parametrize("name,ops", [
    ("sglang", ["recurrent", "recurrent_decode", "recurrent_varlen"]),
    ("sglang-decode", ["recurrent_decode"]),
    ("sglang-packed", ["recurrent_decode"]),
    ("sglang-pool", ["recurrent"]),
])
def test_lanes_pass(name, ops, kernels, monkeypatch):
    monkeypatch.setenv(PEER_ENV, WHERE or "")
    impl = implementations.resolve(name)
    assert not impl.unavailable and impl.contract == "ieee"
    rep = run_validation([impl], ops=[(o, None) for o in ops], dtypes=[torch.float32], seed=3, max_examples=2,
                         progress=None, explain=False, device=DEVICE)
    ran = [r for r in rep.lanes if r.status not in ("NOT PROVIDED",)]
    assert sorted(r.operation for r in ran) == sorted(ops)
    for lane in ran:
        assert lane.status == "PASS", lane.failure
        assert lane.checks > 0


def test_a_state_read_in_the_wrong_layout_fails(kernels):
    """The decode step declared with the oracle's [K, V] layout: SGLang's pool is [V, K], so it fails."""
    impl = adapters.describe(engine_adapter(sg.decode_step(kernels), name="sglang-kv", contract="ieee",
                                            **dict(sg.CONVENTIONS["decode"], state_layout="KV")))
    impl.interpreted = True
    rep = run_validation([impl], ops=[("recurrent_decode", None)], dtypes=[torch.float32], seed=3, max_examples=1,
                         progress=None, explain=False, fail_fast=True, shrink=False, device=DEVICE)
    (lane,) = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    assert lane.status == "FAIL" and lane.klass != "raised", lane.failure


def test_the_chunk_kernel_runs_varlen_under_the_interpreter_too(kernels, monkeypatch):
    """SGLang's chunk kernel itself (on the CPU under the interpreter, with the block-pointer stand-in of
    ``kvbuffer.peers._block_ptr``): two sequences, the second crossing its 64-token chunk, with initial states,
    against the float64 recurrence; and its ``prepare_chunk_indices`` (vLLM's) numbering the chunks after an
    empty sequence as the empty one's, the finding of docs/peers.md."""
    import kvbuffer_ref as ref

    monkeypatch.setenv(PEER_ENV, WHERE or "")
    try:
        k = sg.load_kernels(chunk=True)
    except AdapterError as e:
        pytest.skip(f"SGLang's chunk module does not import here ({e})")
    assert not implementations.resolve("sglang-chunk").unavailable
    lens, H, K, V = [7, 66], 1, 16, 8
    cu = torch.tensor([0, 7, 73], device=DEVICE)
    g = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    q, kk, v = unit(rnd(1, 73, H, K)).half(), unit(rnd(1, 73, H, K)).half(), rnd(1, 73, H, V).half()
    gate, beta, S0 = -rnd(1, 73, H).abs() * 0.1, torch.rand(1, 73, H, generator=g).to(DEVICE).half(), rnd(2, H, K, V)
    o, S = sg.SGLangChunk(k).chunk_gated_delta_rule(q, kk, v, g=gate, beta=beta, initial_state=S0,
                                                    output_final_state=True, cu_seqlens=cu)
    to64 = lambda t: t.double().cpu()  # noqa: E731
    to, tS = ref.recurrent_gated_delta_rule(to64(q), to64(kk), to64(v), g=to64(gate), beta=to64(beta),
                                            initial_state=to64(S0), output_final_state=True, cu_seqlens=cu.cpu())
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert float((to64(o[:, a:b]) - to[:, a:b]).norm() / to[:, a:b].norm()) < 3e-3, f"o of sequence {i}"
        assert float((to64(S[i]) - tS[i]).norm() / tS[i].norm()) < 3e-3, f"state of sequence {i}"
    chunks = inspect.unwrap(k.chunk_gated_delta_rule).__globals__["prepare_chunk_indices"]
    seq = chunks(torch.tensor([0, 5, 5, 16, 18]), 4)[:, 0].tolist()  # chunks per sequence: 2, 0, 3, 1
    assert seq == [0, 0, 1, 1, 1, 2]  # the truth: [0, 0, 2, 2, 2, 3]


def test_without_sglang_every_lane_is_not_run_with_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv(PEER_ENV, str(tmp_path))
    monkeypatch.setattr(sg.importlib.util, "find_spec", lambda name, *a: None)
    for name in ("sglang", "sglang-decode", "sglang-packed", "sglang-pool", "sglang-chunk", "sglang-inputs"):
        impl = implementations.resolve(name)
        assert "SGLang's kernels not found" in impl.unavailable and str(tmp_path) in impl.unavailable
        assert "pip download --no-deps sglang" in impl.unavailable
