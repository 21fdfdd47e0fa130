"""FlashInfer's GDN peer on the CPU: the import path without FlashInfer, and the conventions the wrappers
convert once at setup (pool layouts, raw gates, the oracle's inputs, the accept copy), checked against
kvbuffer_ref in float64.  The kernels themselves are CUDA (CuTe DSL, SM90+): those tests skip here."""

import importlib.util

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.peers import flashinfer as FI
from kvbuffer.validate.adapters import AdapterError

HAVE_FI = importlib.util.find_spec("flashinfer") is not None


def _tokens(B=3, T=2, H=2, HV=4, K=8, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=g, dtype=torch.float64)
    lg = -0.5 * torch.rand(B, T, HV, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, HV, generator=g, dtype=torch.float64)
    return q, k, v, lg, beta


@pytest.mark.skipif(HAVE_FI, reason="flashinfer is installed here: the absent-package path is not reachable")
def test_absent_names_package_and_version(tmp_path):
    with pytest.raises(AdapterError, match=r"flashinfer-python 0\.7\.4"):
        FI.load()
    with pytest.raises(AdapterError, match=r"flashinfer-python 0\.7\.4.*holds no flashinfer package"):
        FI.load(str(tmp_path))


def test_bench_skips_with_reason_on_cpu():
    pytest.importorskip("triton")
    from bench import workloads as W

    api = W.Api.__new__(W.Api)  # no kvbuffer_fast import needed for the loader
    api.flashinfer_path, api._flashinfer = "", None
    with pytest.raises(W.Skip, match="CuTe-DSL"):
        api.flashinfer("cpu")
    with pytest.raises(W.Skip, match="off"):
        api.flashinfer("cuda")


@pytest.mark.parametrize("v_major", [True, False])
def test_pool_round_trip(v_major):
    S = torch.randn(3, 4, 8, 6, dtype=torch.float64)  # [B, HV, K, V], K != V to catch a wrong transpose
    slots = torch.tensor([2, 0, 4], dtype=torch.int32)
    pool = FI.to_pool(S, slots, 5, dtype=torch.float64, v_major=v_major)
    assert pool.shape == ((5, 4, 6, 8) if v_major else (5, 4, 8, 6))
    if v_major:  # FlashInfer's [slot, h, v, k] is our [b, h, k, v]
        assert pool[2, 1, 3, 5] == S[0, 1, 5, 3]
    assert pool[1].abs().sum() == 0 and pool[3].abs().sum() == 0
    assert torch.equal(FI.from_pool(pool, slots, v_major=v_major, dtype=torch.float64), S)


def test_raw_gates_give_our_gates():
    _, _, _, lg, beta = _tokens()
    HV = lg.shape[-1]
    A_log, dt_bias, a, b = FI.raw_gates(lg.reshape(-1, HV), beta.reshape(-1, HV), seed=1, dtype=torch.float32)
    assert A_log.dtype == dt_bias.dtype == torch.float32 and a.shape == (lg.numel() // HV, HV)
    # a and b are the exact inverses of g and beta (as float32 holds them) rounded once to float32, and the exact
    # inverses give g and beta back
    from kvbuffer.peers.engine import softplus_inv
    from kvbuffer.validate.tolerances import compare

    lg64, beta64 = (t.reshape(-1, HV).float().double() for t in (lg, beta))
    a64 = softplus_inv(-lg64 / A_log.double().exp()) - dt_bias.double()
    b64 = torch.log(beta64) - torch.log1p(-beta64)
    assert torch.equal(a, a64.float()) and torch.equal(b, b64.float())
    z = a64 + dt_bias.double()
    sp = torch.where(z > FI.SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z)))
    for name, got, want in (("g", -A_log.double().exp() * sp, lg64), ("beta", torch.sigmoid(b64), beta64)):
        c = compare(got[None, ..., None], want[None, ..., None], name=name, dtype=torch.float64)
        assert c.passed, str(c)
    _, _, a16, b16 = FI.raw_gates(lg.reshape(-1, HV), beta.reshape(-1, HV), seed=1)
    assert a16.dtype == b16.dtype == torch.bfloat16  # what FlashInfer's wrappers hand its kernels


def test_oracle_inputs_mirror_the_kernel_prologue():
    q, k, v, lg, beta = _tokens()
    B, T, H, K = q.shape
    HV = v.shape[2]
    A_log, dt_bias, a, b = FI.raw_gates(lg.reshape(-1, HV), beta.reshape(-1, HV), seed=2)
    x = FI.oracle_inputs(3 * q, 2 * k, v, a.view(B, T, HV), b.view(B, T, HV), A_log, dt_bias)
    assert x["q"].dtype == torch.float64 and x["q"].shape == q.shape and x["g"].shape == (B, T, HV)
    # q, k normalised as the kernel does: x * rsqrt(sum x^2 + 1e-6)
    qs = 3 * q
    torch.testing.assert_close(x["q"], qs / torch.sqrt((qs * qs).sum(-1, keepdim=True) + FI.NORM_EPS))
    torch.testing.assert_close(x["v"], v)
    # the gates of the bf16-rounded raw inputs, within bf16's rounding of the drawn ones
    z = a.double().view(B, T, HV) + dt_bias.double()
    sp = torch.where(z > 20, z, torch.log1p(torch.exp(z)))
    torch.testing.assert_close(x["g"], -A_log.double().exp() * sp)
    torch.testing.assert_close(x["beta"], torch.sigmoid(b.double().view(B, T, HV)))
    assert (x["g"] - lg).abs().max() < 0.05 and (x["beta"] - beta).abs().max() < 0.01


def test_accept_into_pool_is_the_recurrence_after_m_tokens():
    """The round's conversions end to end in float64: the pool in FlashInfer's layout, the per-token
    states an MTP verify writes ([B, T, HV, V, K], emulated here with kvbuffer_ref), the accept copy, and
    the read back in our layout, against kvbuffer_ref's recurrence over the first m tokens."""
    q, k, v, lg, beta = _tokens(T=4)
    B, T, H, K = q.shape
    HV, V, m = v.shape[2], v.shape[3], 2
    S0 = torch.randn(B, HV, K, V, dtype=torch.float64)
    slots = torch.tensor([1, 3, 0], dtype=torch.int32)
    pool = FI.to_pool(S0, slots, 4, dtype=torch.float64)
    def rec(n):
        return ref.recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g=lg[:, :n], beta=beta[:, :n],
                                              initial_state=S0, output_final_state=True)[1]
    inter = torch.stack([rec(t + 1).transpose(-1, -2) for t in range(T)], 1)
    FI.accept_into_pool(pool, inter, slots.long(), m)
    want = rec(m)
    torch.testing.assert_close(FI.from_pool(pool, slots, dtype=torch.float64), want)
    assert pool[2].abs().sum() == 0  # the slot no request holds is untouched


def test_decode_kwargs_shapes():
    x = dict(q=1, k=2, v=3, A_log=4, dt_bias=5, a=6, b=7, pool="P", slots="S", out="O", scale=0.5)
    kw = FI.decode_kwargs("pretranspose", **x)
    assert kw["initial_state"] == "P" and kw["initial_state_indices"] == "S" and kw["state"] is None
    assert kw["backend"] == "flashinfer" and kw["use_qk_l2norm"] is True
    kw = FI.decode_kwargs("kmajor", **x)
    assert kw["state"] == "P" and "initial_state" not in kw
    kw = FI.mtp_kwargs(intermediate="I", **x)
    assert kw["disable_state_update"] is True and kw["intermediate_states_buffer"] == "I"
    with pytest.raises(ValueError):
        FI.decode_kwargs("other", **x)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_FI,
                    reason="FlashInfer's GDN kernels are CuTe-DSL CUDA kernels (SM90+): GPU with flashinfer only")
def test_decode_matches_oracle_on_gpu():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "flashinfer_smoke.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
