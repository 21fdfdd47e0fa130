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
from kvbuffer_fast.chunk import chunk_launches_for  # noqa: E402
from kvbuffer_fast.launch import (  # noqa: E402
    SM90_SHARED_BYTES, TABLES, ChunkConfig, DirectConfig, Key, chunk_smem_bytes, config_for)
from kvbuffer.validate import Case  # noqa: E402
from kvbuffer.validate import properties as P  # noqa: E402
from kvbuffer.validate.tolerances import active_contract  # noqa: E402

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


@pytest.mark.parametrize("channel,chunk_size", [(False, 32), (True, 16)], ids=["32-scalar", "16-channel"])
def test_chunk_solve_varlen(channel, chunk_size):
    """The prep launch's triangular solve through its scratch on a variable-length batch: sequences of 0,
    5, 37 and 20 tokens (short chunks next to full ones, one- and two-block tiles, neighbouring sequences'
    scratch rows), each against its own float64 recurrence."""
    case = Case(B=4, T=37, H=1, HV=2, K=8, V=12, channel_gate=channel, gate="mixed", seed=7)
    _assert_all(P.check_varlen(fast, case, torch.float32, lengths=[0, 5, 37, 20], chunk_size=chunk_size,
                               device=DEVICE))


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
    # 16-bit inputs: the chunk kernels' contract is 16-bit products with fp32 accumulation (docs/kernels.md,
    # "Precision"), so the final state is judged by the "bf16" contract, the outputs by the bf16 budget
    with active_contract("bf16" if dtype == torch.bfloat16 else "ieee"):
        _assert_all(P.check_chunk(fast, case, dtype, chunk_size=16, device=DEVICE, with_initial_state=initial))


@pytest.mark.parametrize("T,chunk_size,channel", [(70, 64, False), (50, 32, True)], ids=["64-scalar", "32-channel"])
def test_chunk_tiles(T, chunk_size, channel):
    """Chunks of 4 and 2 inverse blocks, a short last chunk, from an initial state, with V = 40 cut into
    16-column tiles by the state and the output launches (three state tiles, the last one partly masked)."""
    case = Case(B=1, T=T, H=1, HV=2, K=8, V=40, channel_gate=channel, gate="strong", seed=T)
    cfg = ChunkConfig(BV=16, out_BV=16)
    impl = type("Impl", (), {"chunk_gated_delta_rule": staticmethod(
        lambda *a, **kw: fast.chunk_gated_delta_rule(*a, **kw, config=cfg))})
    _assert_all(P.check_chunk(impl, case, torch.float32, chunk_size=chunk_size, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cpu", reason="compiled only: the launches' shared-memory fits")
@pytest.mark.parametrize("dtype,K,V,channel", [(torch.float32, 256, 128, False), (torch.float32, 136, 264, True),
                                               (torch.bfloat16, 136, 128, True), (torch.bfloat16, 256, 264, False)],
                         ids=["fp32-256", "fp32-136-channel", "bf16-136-channel", "bf16-256"])
def test_wide_heads_compiled(dtype, K, V, channel):
    """Heads past the table's K = V = 128 at chunk 64, T past one chunk, compiled: fp32 at K = 136 / 256 takes
    32-token chunks (its prep launch at 64 needs 262144 B), bf16 a state launch with fewer stages (3 stages
    needed about 393 KB at K = 136); chunk, direct and prefill against the float64 recurrence."""
    case = Case(B=2, T=70, H=1, HV=2, K=K, V=V, channel_gate=channel, gate="mild", norm="any", seed=K + V)
    with active_contract("bf16" if dtype == torch.bfloat16 else "ieee"):
        _assert_all(P.check_chunk(fast, case, dtype, chunk_size=64, device=DEVICE))
        _assert_all(P.check_direct(fast, case, dtype, device=DEVICE))
        _assert_all(P.check_prefill(fast, case, dtype, capacity=8, prompt=66, tail=None, chunk_size=64,
                                    device=DEVICE))


def test_chunk_launches_run_in_order_are_the_call():
    """The launches a benchmark times one by one, run in order, give the call's outputs exactly."""
    x = Case(B=2, T=40, H=1, HV=2, K=8, V=8, seed=5).inputs(torch.float32, DEVICE)
    S0 = torch.randn(2, 2, 8, 8, device=DEVICE)
    o, S = fast.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, chunk_size=16)
    o2, S2, launches = chunk_launches_for(**x, initial_state=S0, output_final_state=True, chunk_size=16)
    assert [n for n, _ in launches] == ["prep", "state", "output"]
    for _, launch in launches:
        launch()
    assert torch.equal(o, o2) and torch.equal(S, S2)


@pytest.mark.parametrize("op", ["chunk", "direct", "prefill"])
def test_chunk_launch_table_fits_sm90_shared_memory(op):
    """Every launch the table picks at Qwen3-Next heads (K = V = 128, chunk 64) on sm_90, and every row
    applied alone to the defaults (for the dtypes it names), fits the 227 KB of shared memory per block by the fitted estimate."""
    cls = type(config_for(op, Key()))
    both = (torch.float32, torch.bfloat16)
    configs = [(cls(**row.set), [dt for dt in both if row.dtypes is None or dt in row.dtypes]) for row in TABLES[op]]
    configs += [(config_for(op, Key(columns=B * 32 * 128, dtype=dt, channel=ch, capability=(9, 0))), [dt])
                for B in (1, 4, 64) for dt in both for ch in (False, True)]
    for cfg, dtypes in configs:
        for dt in dtypes:
            for launch in ("prep", "state", "output"):
                need = chunk_smem_bytes(launch, cfg, dtype=dt)
                assert 0 < need <= SM90_SHARED_BYTES, (launch, cfg, dt, need)


@pytest.mark.parametrize("op", ["chunk", "direct", "prefill"])
@pytest.mark.parametrize("K,V", [(64, 64), (136, 128), (128, 256), (256, 264)])
def test_chunk_tiles_fit_wide_heads(op, K, V):
    """Heads wider than the table's K = V = 128 (a 3-stage 16-bit state launch at K = 136 needs about
    393 KB): every launch the table picks on sm_90 is lowered until it fits (stages, then the tiles), and
    a config that already fits is left as it is."""
    from kvbuffer_fast.launch import fit_chunk_tiles
    both = (torch.float32, torch.bfloat16)
    for dt in both:
        for B in (1, 4, 64):
            for ch in (False, True):
                cfg = config_for(op, Key(columns=B * 32 * 128, dtype=dt, channel=ch, capability=(9, 0)))
                fit = fit_chunk_tiles(cfg, dtype=dt, K=K, V=V, BT=64, limit=SM90_SHARED_BYTES)
                for launch in ("state", "output"):
                    assert chunk_smem_bytes(launch, fit, dtype=dt, K=K, V=V) <= SM90_SHARED_BYTES, (launch, fit)
                if K <= 128 and V <= 128:  # fits as it is: only the tiles clamped to the head
                    assert (fit.stages, fit.BV, fit.out_BV) == (cfg.stages, min(cfg.BV, V), min(cfg.out_BV, V))
                assert fit.stages <= cfg.stages and fit.BV <= cfg.BV and fit.out_BV <= cfg.out_BV
    wide = config_for(op, Key(columns=32 * 128, dtype=torch.bfloat16, capability=(9, 0)))
    if K > 128:
        assert chunk_smem_bytes("state", wide, dtype=torch.bfloat16, K=K, V=V) > SM90_SHARED_BYTES
    with pytest.raises(ValueError, match=r"chunk (state|output) launch needs about \d+ B .* K = %d, V = %d" % (K, V)):
        fit_chunk_tiles(wide, dtype=torch.float32, K=K, V=V, BT=64, limit=20_000)


def test_wide_fp32_heads_take_shorter_chunks():
    """fp32 inputs at K = 136 / 256: the prep launch of a 64-token chunk needs 262144 B (Triton's sm_90
    build), past the H200's 232448, so the launches take chunks of 32; 16-bit inputs and K = 128 keep 64,
    and a chunk size already short enough is kept."""
    from kvbuffer_fast.chunk import fitted_chunk_size
    cfg = config_for("chunk", Key(columns=32 * 128, dtype=torch.float32, capability=(9, 0)))
    fit = lambda cs, dt, K: fitted_chunk_size(cs, cfg, dtype=dt, K=K, V=128, limit=SM90_SHARED_BYTES)  # noqa: E731
    assert chunk_smem_bytes("prep", cfg, dtype=torch.float32, K=256, BT=64) == 262144 > SM90_SHARED_BYTES
    assert fit(64, torch.float32, 256) == 32 and fit(64, torch.float32, 136) == 32 and fit(48, torch.float32, 256) == 32
    assert fit(64, torch.float32, 128) == 64 and fit(64, torch.bfloat16, 256) == 64
    assert fit(16, torch.float32, 256) == 16 and fit(3, torch.float32, 256) == 3
    assert chunk_smem_bytes("prep", cfg, dtype=torch.float32, K=256, BT=32) <= SM90_SHARED_BYTES


def test_chunk_smem_estimate_rejects_what_cannot_fit():
    """The estimate grows with the tiles: 256-wide heads with a 256-column output tile cannot fit."""
    big = chunk_smem_bytes("output", ChunkConfig(out_BV=256), dtype=torch.float32, K=256, V=256)
    assert big > SM90_SHARED_BYTES
    assert chunk_smem_bytes("state", ChunkConfig(BV=64), dtype=torch.float32) > chunk_smem_bytes(
        "state", ChunkConfig(BV=16), dtype=torch.float32)
    with pytest.raises(ValueError, match="launch"):
        chunk_smem_bytes("fold", ChunkConfig(), dtype=torch.float32)


def test_launch_out_of_resources_names_the_launch(monkeypatch):
    """A launch that does not fit the device raises a ValueError naming the launch and its fields, not
    Triton's OutOfResources from inside the launch."""
    from triton.runtime.errors import OutOfResources

    import kvbuffer_fast.chunk as chunk

    class TooBig:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                raise OutOfResources(262164, 232448, "shared memory")
            return launch

    monkeypatch.setattr(chunk, "_chunk_output_kernel", TooBig())
    x = Case(B=1, T=8, H=1, HV=2, K=8, V=8, seed=1).inputs(torch.float32, DEVICE)
    with pytest.raises(ValueError, match="output launch .*out_BV"):
        fast.chunk_gated_delta_rule(**x)


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
    with pytest.raises(TypeError, match="DirectConfig"):
        fast.direct_gated_delta_rule(**x, config=ChunkConfig())
    bad = dict(x, g=x["g"].clone())
    bad["g"][0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="g: entry"):
        fast.chunk_gated_delta_rule(**bad)


def test_chunk_launches_compiled_for_sm90_fit_its_shared_memory():
    """Triton's own build for sm_90, on the CPU (no GPU needed, ``sm90_smem.py`` in a subprocess without the
    interpreter): at K = V = 128 and at wide heads, in fp32 and bf16, every launch the table, the tile fit
    and the chunk-size fit pick takes at most the H100 / H200's 232448 B per block, and the estimate they
    decide by is an upper bound on it (so a launch judged to fit does)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    specs = ["float32:128:128", "float32:256:264", "bfloat16:136:128", "bfloat16:256:264"]
    script = Path(__file__).with_name("sm90_smem.py")
    run = subprocess.run([sys.executable, str(script), *specs], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    if run.returncode != 0 and ("ptxas" in run.stderr or "GPUTarget" in run.stderr):
        pytest.skip(f"Triton cannot build for sm_90 here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    for row in json.loads(run.stdout.strip().splitlines()[-1]):
        for launch, (got, est) in row["launches"].items():
            assert got <= SM90_SHARED_BYTES, (row, launch)
            assert got <= est, (row, launch)


# ----------------------------------------------------------------------------- cases the gpu profile found
def test_direct_reset_gates_on_small_heads():
    """Reset gates, K = 7, V = 5: compiled, 3.1e-6, 14x the error of the baseline's loop-summed cumulative
    gates; ``tl.cumsum`` sums in a scan's tree order, which the baseline's scan form makes (2.9e-6)."""
    c = Case(B=2, T=7, H=2, HV=4, K=7, V=5, gate="reset", beta="uniform", seed=1, norm="any")
    with active_contract("tf32x3" if DEVICE == "cuda" else "ieee"):
        _assert_all(P.check_direct(fast, c, torch.float32, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cpu", reason="compiled only: the interpreter (with KVBUFFER_FAST_16BIT_PATHS=1) "
                                            "computes 4.8e-4 here, in about a minute")
@pytest.mark.parametrize("dtype,channel,seed", [(torch.float16, True, 1530978543), (torch.bfloat16, True, 1788814887),
                                                (torch.float16, False, 1530978543)], ids=["fp16-channel", "bf16-channel",
                                                                                          "fp16-scalar"])
def test_direct_in_16_bits_past_two_chunks_at_k16(dtype, channel, seed):
    """T = 129 (two chunks of 64 and one token), K = 16, HV = 32: the per-chunk launch on 4 warps computed
    8.3e-2 / 5.9e-2 / 6.8e-2 here against 4.8e-4 on 8 warps (docs/kernels.md, Known defects); the table
    launches 16-bit inputs on 8 warps."""
    c = Case(B=2, T=129, H=16, HV=32, K=16, V=128, channel_gate=channel, gate="mild", beta="uniform",
             seed=seed, norm="any", scale=0.7)
    with active_contract("bf16"):
        _assert_all(P.check_direct(fast, c, dtype, device=DEVICE))


# ----------------------------------------------------------------------------- the compiled 16-bit paths
@pytest.mark.skipif(DEVICE == "cuda", reason="compiled, 16-bit inputs take these paths in every test above")
@pytest.mark.parametrize("channel,T", [(False, 37), (True, 40)], ids=["scalar", "channel"])
def test_the_16_bit_paths_under_the_interpreter(monkeypatch, channel, T):
    """With ``KVBUFFER_FAST_16BIT_PATHS=1`` the interpreter takes the paths compiled CUDA takes for 16-bit
    inputs (the 16-bit scores, W, U~, state-pass and output products, h and U stored in 16 bits), in float16:
    chunk (from an initial state, chunks of 16) and direct against the float64 recurrence under the 16-bit
    products contract."""
    monkeypatch.setenv("KVBUFFER_FAST_16BIT_PATHS", "1")
    case = Case(B=2, T=T, H=1, HV=2, K=8, V=12, channel_gate=channel, gate="mixed", seed=T)
    with active_contract("bf16"):
        _assert_all(P.check_chunk(fast, case, torch.float16, chunk_size=16, device=DEVICE, with_initial_state=True))
        _assert_all(P.check_direct(fast, case, torch.float16, device=DEVICE))
    # the flag is read at every call: off, the same call takes the float32 paths and differs
    x = case.inputs(torch.float16)
    on = fast.direct_gated_delta_rule(**x)
    monkeypatch.setenv("KVBUFFER_FAST_16BIT_PATHS", "0")
    assert not torch.equal(on, fast.direct_gated_delta_rule(**x))
