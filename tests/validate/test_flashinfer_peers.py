"""FlashInfer's GDN kernels behind the validator (``--impl flashinfer``, ``flashinfer-bf16``, ``flashinfer-mtp``),
on the CPU through a fake ``flashinfer`` package: a pure-PyTorch stand-in with the three public functions'
signatures (``flashinfer.gdn_decode``), their documented input checks (bfloat16 q, k, v, a, b; K, V >= 128;
the bfloat16-state kernel K = V = 128 with -1 redirected to slot 0; the float32 kernels skipping -1 rows) and
the arithmetic computed by kvbuffer_ref in float64.  It proves the adapters' plumbing (layouts, indices, pads,
zero padding of K and V, raw gates rounded to bfloat16, the MTP verify's frozen pool and per-token states,
the accept), that a kernel 1% off in its scale fails, and the missing-package message.  The real kernels
are CuTe-DSL CUDA kernels: not run here."""

import sys
import types

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer import implementations
from kvbuffer.peers import flashinfer as FI
from kvbuffer.peers.replayssm import PEER_ENV
from kvbuffer.validate import cases
from kvbuffer.validate.lanes import plan
from kvbuffer.validate.properties import truth_and_baseline
from kvbuffer.validate.tolerances import compare
from kvbuffer.validate.runner import NothingToRun, run_validation

#: The fake's planted errors (the test sets them): ``scale`` multiplies the scale, ``write_pool`` makes the
#: MTP verify write its final state although disable_state_update=True, ``pad`` the decode write into the
#: zero padding of the state (a K or V column past the caller's).
PLANT = {"scale": 1.0, "write_pool": False, "pad": False}
CALLS: list = []


def _prologue(q, k, v, A_log, a, dt_bias, b, scale, use_qk_l2norm):
    """float64 q, k (L2-normalised as the kernel does), v, g, beta of one batch [B, T, ...]."""
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16, (q.dtype, k.dtype, v.dtype)
    assert a.dtype == b.dtype == torch.bfloat16, (a.dtype, b.dtype)  # the raw gates as the wrapper rounds them
    assert A_log.dtype == torch.float32 and dt_bias.dtype in (torch.float32, torch.bfloat16)
    qq, kk = q.double(), k.double()
    if use_qk_l2norm:
        qq = qq / torch.sqrt((qq * qq).sum(-1, keepdim=True) + FI.NORM_EPS)
        kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + FI.NORM_EPS)
    g, beta = cases.gates_of_raw(A_log, dt_bias, a, b)
    K = q.shape[-1]
    return qq, kk, v.double(), g, beta, (K ** -0.5 if scale is None else scale) * PLANT["scale"]


def _step(qq, kk, vv, g, beta, scale, S):
    """One request's tokens [1, T, ..] from S [HV, K, V] float64: outputs [T, HV, V] and the state after every token."""
    outs, states = [], []
    for t in range(qq.shape[1]):
        sl = slice(t, t + 1)
        o, S = ref.recurrent_gated_delta_rule(qq[:, sl], kk[:, sl], vv[:, sl], g=g[:, sl], beta=beta[:, sl],
                                              scale=scale, initial_state=S[None], output_final_state=True)
        S = S[0]
        outs.append(o[0, 0])
        states.append(S)
    return torch.stack(outs), states


def gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None,
                                         use_qk_l2norm=True, initial_state=None, initial_state_indices=None,
                                         output_state_indices=None, intermediate_states_buffer=None,
                                         disable_state_update=False, backend="auto"):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    CALLS.append(("decode_pretranspose", dict(K=K, V=V, dtype=initial_state.dtype, backend=backend,
                                              slots=initial_state_indices.tolist())))
    assert T == 1 and state is None and initial_state is not None and backend == "flashinfer"
    assert initial_state.shape[1:] == (HV, V, K) and initial_state.stride(-1) == 1
    bf16 = initial_state.dtype == torch.bfloat16
    if bf16:
        assert K == V == 128, "the BF16-state kernel takes K = V = 128"
    else:
        assert initial_state.dtype == torch.float32 and K >= 128 and V >= 128 and V % 8 == 0
    qq, kk, vv, g, beta, sc = _prologue(q, k, v, A_log, a, dt_bias, b, scale, use_qk_l2norm)
    for i, s in enumerate(initial_state_indices.tolist()):
        if s < 0 and not bf16:  # the float32 kernel skips a pad row: output zero, pool untouched
            output[i] = 0
            continue
        s = max(s, 0)  # the BF16 kernel redirects -1 to slot 0, its null slot
        S = initial_state[s].double().transpose(-1, -2)
        o, states = _step(qq[i:i + 1], kk[i:i + 1], vv[i:i + 1], g[i:i + 1], beta[i:i + 1], sc, S)
        output[i] = o.to(output.dtype)
        initial_state[s] = states[-1].transpose(-1, -2).to(initial_state.dtype)
        if PLANT["pad"]:
            initial_state[s, :, -1, -1] = 1.0
    return output, initial_state


def gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None,
                         output=None, intermediate_states_buffer=None, ssm_state_indices=None,
                         disable_state_update=None, use_qk_l2norm=True, output_state_indices=None, **_):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    CALLS.append(("mtp", dict(K=K, V=V, T=T, disable=disable_state_update, slots=initial_state_indices.tolist())))
    assert initial_state.dtype == torch.float32 and K >= 128 and V >= 128 and T >= 2  # documented: T > 1
    assert intermediate_states_buffer.shape == (B, T, HV, V, K) and intermediate_states_buffer.dtype == torch.float32
    qq, kk, vv, g, beta, sc = _prologue(q, k, v, A_log, a, dt_bias, b, scale, use_qk_l2norm)
    for i, s in enumerate(initial_state_indices.tolist()):
        if s < 0:  # a pad: neither read nor written
            continue
        S = initial_state[s].double().transpose(-1, -2)
        o, states = _step(qq[i:i + 1], kk[i:i + 1], vv[i:i + 1], g[i:i + 1], beta[i:i + 1], sc, S)
        output[i] = o.to(output.dtype)
        for t, St in enumerate(states):
            intermediate_states_buffer[i, t] = St.transpose(-1, -2).float()
        if not disable_state_update or PLANT["write_pool"]:
            initial_state[s] = states[-1].transpose(-1, -2).float()
    return output, initial_state


def gated_delta_rule_decode(*a, **k):
    raise AssertionError("the validator's adapters do not call the K-major decode")


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A fake ``flashinfer`` package with ``gdn_decode`` in sys.modules; no --peer-path."""
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = "0.7.4"
    pkg.__path__ = []
    gdn = types.ModuleType("flashinfer.gdn_decode")
    for f in (gated_delta_rule_decode_pretranspose, gated_delta_rule_mtp, gated_delta_rule_decode):
        setattr(gdn, f.__name__, f)
    pkg.gdn_decode = gdn
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_decode", gdn)
    monkeypatch.delenv(PEER_ENV, raising=False)
    PLANT.update(scale=1.0, write_pool=False, pad=False)
    CALLS.clear()
    yield gdn
    PLANT.update(scale=1.0, write_pool=False, pad=False)


def _run(name, ops, seed=3, n=3):
    impl = implementations.resolve(name)
    assert not impl.unavailable, impl.unavailable
    rep = run_validation([impl], ops=[(o, None) for o in ops], seed=seed, max_examples=n, progress=None,
                         explain=False, device="cpu")
    return {(r.operation, r.dtype): r for r in rep.lanes}, rep


# ----------------------------------------------------------------------------- the lanes run through the fake
def test_flashinfer_decode_passes_through_the_fake(fake_flashinfer):
    lanes, rep = _run("flashinfer", ["recurrent_decode"])
    r = lanes[("recurrent_decode", "bfloat16")]
    assert r.status == "PASS", r.failure
    assert r.contract == "ieee" and r.checks > 0
    # K or V above 128 (the boundary cases 256, 264) faulted FlashInfer's float32 kernel on an H100: declined by
    # name, the run incomplete, never silently left out
    assert r.declined and all("faulted" in why and FI.LARGE_HEADS_ENV in why for why in r.declined), r.declined
    assert "DECLINED: recurrent_decode" in rep.summary_line() and not rep.complete
    calls = [c for n, c in CALLS if n == "decode_pretranspose"]
    assert calls and all(c["dtype"] == torch.float32 and c["K"] == c["V"] == 128 for c in calls)
    assert any(-1 in c["slots"] for c in calls)  # pads reach the kernel as -1


def test_flashinfer_decode_takes_large_heads_when_asked(fake_flashinfer, monkeypatch):
    monkeypatch.setenv(FI.LARGE_HEADS_ENV, "1")
    lanes, rep = _run("flashinfer", ["recurrent_decode"])
    r = lanes[("recurrent_decode", "bfloat16")]
    assert r.status == "PASS" and not r.declined, (r.failure, r.declined)
    calls = [c for n, c in CALLS if n == "decode_pretranspose"]
    assert all(c["K"] % 128 == 0 and c["V"] % 128 == 0 for c in calls) and any(c["K"] > 128 for c in calls)


def test_flashinfer_bf16_passes_and_declines_large_heads(fake_flashinfer):
    lanes, rep = _run("flashinfer-bf16", ["recurrent_decode"])
    r = lanes[("recurrent_decode", "bfloat16")]
    assert r.status == "PASS", r.failure
    assert r.contract == "bf16-state"
    # the boundary cases of K, V = 256, 264 are declined by name, never silently left out
    assert r.declined and all("K = V = 128" in why for why in r.declined), r.declined
    assert "DECLINED: recurrent_decode" in rep.summary_line() and not rep.complete
    calls = [c for n, c in CALLS if n == "decode_pretranspose"]
    assert calls and all(c["dtype"] == torch.bfloat16 and c["K"] == c["V"] == 128 for c in calls)
    assert any(-1 in c["slots"] for c in calls) and all(0 not in [s for s in c["slots"]] for c in calls)


def test_flashinfer_mtp_passes_recurrent_and_varlen(fake_flashinfer):
    lanes, _ = _run("flashinfer-mtp", ["recurrent", "recurrent_varlen", "recurrent_decode"])
    for op in ("recurrent", "recurrent_varlen"):
        r = lanes[(op, "bfloat16")]
        assert r.status == "PASS", (op, r.failure)
    assert lanes[("recurrent_decode", None)].status == "NOT PROVIDED"
    calls = [c for n, c in CALLS if n == "mtp"]
    assert calls and all(c["disable"] is True for c in calls)


@pytest.mark.parametrize("name, ops", [("flashinfer", ["recurrent_decode"]), ("flashinfer-bf16", ["recurrent_decode"]),
                                       ("flashinfer-mtp", ["recurrent", "recurrent_varlen"])])
def test_a_scale_one_percent_off_fails(fake_flashinfer, name, ops):
    PLANT["scale"] = 1.01
    lanes, rep = _run(name, ops, n=2)
    for op in ops:
        assert lanes[(op, "bfloat16")].status == "FAIL", (name, op, lanes[(op, "bfloat16")])
    assert not rep.passed


def test_an_mtp_verify_that_writes_the_pool_fails(fake_flashinfer):
    PLANT["write_pool"] = True
    lanes, _ = _run("flashinfer-mtp", ["recurrent"], n=2)
    r = lanes[("recurrent", "bfloat16")]
    assert r.status == "FAIL" and r.klass == "pool-slots", (r.klass, r.failure)


def test_a_write_into_the_zero_padding_fails(fake_flashinfer):
    PLANT["pad"] = True
    lanes, _ = _run("flashinfer", ["recurrent_decode"], n=2)
    r = lanes[("recurrent_decode", "bfloat16")]
    assert r.status == "FAIL" and r.klass == "pool-slots", (r.klass, r.failure)


def test_the_truth_follows_the_rounded_raw_gates(fake_flashinfer):
    """The same kernel judged on gates not moved onto the bfloat16 raw gates fails: the rounding of a and b
    is what the kernel computes with, and the cases carry it."""
    impl = implementations.resolve("flashinfer-mtp")
    impl.raw_gate_dtype = ""
    rep = run_validation([impl], ops=[("recurrent", None)], seed=3, max_examples=3, progress=None, explain=False,
                         device="cpu")
    (r,) = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    assert r.status == "FAIL" and r.klass in ("wrong-result", "tile-boundary", "domain"), (r.klass, r.failure)


def test_the_varlen_verify_accepts_each_requests_own_count(fake_flashinfer):
    """A varlen batch [3, 0, 2] in one verify of 3-token rows: the accept takes 3, 0 and 2 tokens."""
    impl = implementations.resolve("flashinfer-mtp")
    g = torch.Generator().manual_seed(0)
    H, HV, K, V = 1, 2, 5, 7
    q, k = torch.randn(1, 5, H, K, generator=g), torch.randn(1, 5, H, K, generator=g)
    v = torch.randn(1, 5, HV, V, generator=g)
    lg, beta = cases.snap_to_raw_gates(-0.3 * torch.rand(1, 5, HV, generator=g, dtype=torch.float64),
                                       torch.rand(1, 5, HV, generator=g, dtype=torch.float64), "bfloat16")
    h0 = torch.randn(3, HV, K, V, generator=g)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    x = dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), g=lg.float(), beta=beta.float())
    o, S = impl.obj.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=h0,
                                               output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, 5, HV, V) and S.shape == (3, HV, K, V)
    for i, (s, e) in enumerate([(0, 3), (3, 3), (3, 5)]):  # each sequence against its own float64 recurrence
        xi = {n: t[:, s:e] for n, t in x.items()}
        (o64, S64), base = truth_and_baseline(xi, h0[i:i + 1], qk_l2norm=True)  # the kernel normalises q, k
        checks = [compare(S[i:i + 1], S64, base and base[1], name="state", dtype=torch.float32, head_axis=1)]
        if e > s:
            checks.append(compare(o[:, s:e], o64, base and base[0], name="o", dtype=torch.bfloat16))
        assert all(c.passed for c in checks), [str(c) for c in checks]


# ----------------------------------------------------------------------------- declarations and absence
def test_the_lanes_each_declares(fake_flashinfer):
    for name, contract in (("flashinfer", "ieee"), ("flashinfer-bf16", "bf16-state"), ("flashinfer-mtp", "ieee")):
        impl = implementations.resolve(name)
        assert impl.contract == contract and impl.qk_l2norm and impl.raw_gate_dtype == "bfloat16"
        assert impl.dtypes == (torch.bfloat16,) and impl.channel_gate is False and impl.name.startswith("flashinfer")
        lanes = plan([impl], dtypes=[torch.float32, torch.bfloat16])
        rows = {(l.op.name, l.status) for l in lanes}
        assert ("verify_chain", "NOT PROVIDED") in rows and ("chunk", "NOT PROVIDED") in rows
        run = {l.op.name for l in lanes if l.status == "RUN"}
        assert run == ({"recurrent", "recurrent_varlen"} if name == "flashinfer-mtp" else {"recurrent_decode"})
        # float32 inputs are not declared: FlashInfer's wrappers take bfloat16 (float16 converted to it)
        assert all(l.status == "NOT PROVIDED" for l in lanes if l.dtype == torch.float32)
    assert implementations.resolve("flashinfer-mtp").varlen == ("recurrent_gated_delta_rule",)
    assert {"flashinfer", "flashinfer-bf16", "flashinfer-mtp"} <= set(implementations.builtin_names())


def test_raw_gates_rounded_to_bfloat16_round_back():
    """The gates a case is snapped to give back, from float32 g and beta, the bfloat16 a and b they came from."""
    g0 = torch.cat([torch.zeros(1, 3), -0.5 * torch.rand(4, 3, dtype=torch.float64), -(1 + 7 * torch.rand(4, 3)),
                    -(104 + 16 * torch.rand(2, 3)), torch.full((1, 3), float("-inf"))]).double()
    b0 = torch.rand(g0.shape, dtype=torch.float64)
    b0[0], b0[1] = 0.0, 1.0
    g, beta = cases.snap_to_raw_gates(g0, b0, "bfloat16")
    A1, d1, a1, bb1 = cases.raw_gates_in(g0, b0, "bfloat16")
    A2, d2, a2, bb2 = cases.raw_gates_in(g.float(), beta.float(), "bfloat16")
    assert torch.equal(A1, A2) and torch.equal(d1, d2)
    assert torch.equal(a1, a2) and torch.equal(bb1, bb2)
    assert a1.dtype == torch.bfloat16 and torch.all(g[-1] == float("-inf"))


def test_absent_flashinfer_is_not_run_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.delitem(sys.modules, "flashinfer.gdn_decode", raising=False)
    import importlib.util
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here: the absent-package path is not reachable without --peer-path")
    monkeypatch.delenv(PEER_ENV, raising=False)
    for name in ("flashinfer", "flashinfer-bf16", "flashinfer-mtp"):
        impl = implementations.resolve(name)
        assert "flashinfer-python 0.7.4" in impl.unavailable and "--peer-path" in impl.unavailable, impl.unavailable
        assert "no installed flashinfer" in impl.unavailable
    monkeypatch.setenv(PEER_ENV, str(tmp_path))
    impl = implementations.resolve("flashinfer-mtp")
    assert f"{tmp_path} holds no flashinfer package" in impl.unavailable and "--peer-path" in impl.unavailable
    with pytest.raises(NothingToRun) as e:
        run_validation([impl], ops=[("recurrent", None)], seed=1, max_examples=1, progress=None, explain=False)
    rep = e.value.report
    assert [r.status for r in rep.lanes] == ["NOT RUN"] and "holds no flashinfer package" in rep.summary_line()


def test_the_declarations_are_checked_by_name():
    from kvbuffer.peers.engine import Convention
    from kvbuffer.validate.adapters import AdapterError, describe
    with pytest.raises(AdapterError, match=r"raw_gate_dtype.*gating='log'"):
        Convention(gating="log", raw_gate_dtype="bfloat16")
    step = types.SimpleNamespace(recurrent_decode=lambda *a, **k: None, raw_gate_dtype="float16")
    with pytest.raises(AdapterError, match=r"raw_gate_dtype must be one of \['bfloat16', 'float32'\]"):
        describe(step)
    with pytest.raises(AdapterError, match=r"declines must be a callable"):
        describe(types.SimpleNamespace(recurrent_decode=lambda *a, **k: None, declines="K > 128"))
