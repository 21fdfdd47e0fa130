"""The prefill kernels on a GPU in one go: compiled correctness, errors against fla, and timings.

    python3 scripts/gpu_prefill.py --out bench/results/h200_probe/prefill.json [--quick]

1. Correctness, compiled, against the float64 oracle computed on the GPU (kvbuffer_ref's recurrence,
   float64 inputs = the rounded inputs upcast) at Qwen3-Next heads (so fla's autotuning is shared with
   the timings): kvbuffer_fast.chunk_gated_delta_rule (fp32 and bf16 inputs, scalar and per-channel
   gates, uniform batches and cu_seqlens, an initial state), direct_gated_delta_rule, and prefill
   followed by buffered_decode; each judged by the error table (``compare``: its baseline is the correct
   forms in fp32, ``truth_and_baseline``: kvbuffer_ref's recurrence and chunkwise form, and for prefill +
   decode the same calls run by kvbuffer_ref).  Beside ours, the error of kvbuffer_fast's fp32 recurrence kernel
   (per sequence for cu_seqlens) and of fla's chunk_gated_delta_rule (if fla imports).  Each check logs
   its seconds (first calls compile).
2. Timings at Qwen3-Next heads (H = 16, HV = 32, K = V = 128), T = 1k..32k, B = 1 and 4, bf16 and fp32
   inputs, ours and fla's in the same run: a CUDA graph of one call replayed under
   triton.testing.do_bench (L2 cleared before each replay, median; bench/gpu.py's ``device_ms``), and
   TFLOP/s of the chunk algorithm's products (chunk 64) against the H200's dense peaks (bf16 989,
   TF32 494 TFLOP/s), plus the errors of both at T = 1k (and 4k without --quick).  Ours: the launch
   table's config and the candidates in ``VARIANTS``, each as the whole call and launch by launch
   (prep, state, output: where the time goes).
   Before them, short prompts (T = 4, 8, 16 <= C = 16, B = 64 and 256, bf16): the prefill that keeps
   the prompt in the buffer (direct mode) against the one that folds it into a state, and the decode
   step after each (``short_prompts``: the direct-mode / state-path choice for T <= C).

Prints one JSON object to stdout and writes it to --out.  About 4 minutes on an H200 (--budget-s stops the timings; --quick: about 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:  # before the kernels are decorated: the Triton interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


import kvbuffer_fast as fast  # noqa: E402
from kvbuffer_fast.chunk import chunk_launches_for  # noqa: E402
from kvbuffer_fast.launch import config_for, key_of  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from bench.gpu import device_ms, versions  # noqa: E402
from kvbuffer.validate import compare  # noqa: E402
from kvbuffer.validate.properties import truth_and_baseline  # noqa: E402

PEAK_TFLOPS = {"bfloat16": 989.0, "float32": 494.0}  # H200 dense: bf16 tensor cores; TF32 for fp32 inputs
QWEN = dict(H=16, HV=32, K=128, V=128)
DEV = "cuda"
SMOKE = False  # --smoke: the correctness part on the CPU (Triton interpreter), tiny shapes, no timings


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def make_inputs(B, T, H, HV, K, V, dtype, channel=False, seed=0):
    """Model-like inputs on the GPU: L2-normalised q and k, gates log(sigmoid) scaled to about -0.05 per
    token (per channel: scaled per key channel), betas sigmoid; rounded to ``dtype``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, HV, V)
    g = F.logsigmoid(r(B, T, HV, K) if channel else r(B, T, HV)) * 0.1
    beta = torch.sigmoid(r(B, T, HV))
    return {n: t.to(dtype).contiguous() for n, t in dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def up(x):
    return {n: t.double() for n, t in x.items()}


def fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        import fla
        return chunk_gated_delta_rule, getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        log(f"fla not available: {type(e).__name__}: {e}")
        return None, None


FLA_GROUPED = {"native": None}  # whether fla's chunk kernel takes HV > H itself (else q, k are expanded)


def call_fla(fn, x, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's chunk_gated_delta_rule on our inputs; q and k expanded to the value heads if fla does not take
    grouped heads (value head i reads q/k head i // (HV // H)), found out at the first call and recorded."""
    q, k = x["q"], x["k"]
    kw = dict(initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
              use_qk_l2norm_in_kernel=False)
    group = x["v"].shape[2] // q.shape[2]
    if group > 1 and FLA_GROUPED["native"] is not False:
        try:
            out = fn(q, k, x["v"], x["g"], x["beta"], **kw)
            FLA_GROUPED["native"] = True
            return out
        except Exception as e:  # noqa: BLE001
            if FLA_GROUPED["native"]:
                raise
            FLA_GROUPED["native"] = False
            FLA_GROUPED["why"] = f"{type(e).__name__}: {e}"[:300]
            log(f"fla takes no grouped heads here ({FLA_GROUPED['why']}); q and k expanded for it")
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return fn(q, k, x["v"], x["g"], x["beta"], **kw)


def judged(name, actual, truth, baseline, head_axis=2, dtype=None):
    """``compare`` as a result row; baseline: one tensor or a list of them (each slice takes the worst)."""
    if baseline is not None:
        baseline = [b.detach().cpu() for b in ([baseline] if torch.is_tensor(baseline) else baseline)]
    c = compare(actual.detach().cpu(), truth.cpu(), baseline, name=name, head_axis=head_axis, dtype=dtype)
    return dict(name=name, passed=bool(c.passed), rel=float(c.worst_rel), baseline_rel=float(c.baseline_rel), budget=float(c.budget), text=str(c))


def forms(x, S0=None, cu=None, chunk=None):
    """(o64, S64), (o, S): the float64 recurrence and the baseline (``truth_and_baseline``: the correct forms in
    float32, the chunkwise one with chunks of max(64, ``chunk``)), per sequence of the offsets ``cu`` (a list;
    None: the batch), outputs concatenated along T and states along the batch as the kernels return them."""
    if cu is None:
        return truth_and_baseline(x, S0, chunk=chunk)
    parts = [truth_and_baseline({n: t[:, a:b] for n, t in x.items()}, None if S0 is None else S0[i:i + 1], chunk=chunk)
             for i, (a, b) in enumerate(zip(cu, cu[1:]))]
    cat = lambda ts, d: torch.cat(ts, d)  # noqa: E731
    return ((cat([t[0] for t, _ in parts], 1), cat([t[1] for t, _ in parts], 0)),
            (cat([b[0] for _, b in parts], 1), cat([b[1] for _, b in parts], 0)))


def rel_err(actual, truth):
    """The worst (request, head) relative RMS error over [B, T, HV, V] outputs."""
    a, t = actual.double(), truth
    num = (a - t).pow(2).sum(dim=(1, 3)).sqrt()
    den = t.pow(2).sum(dim=(1, 3)).sqrt().clamp_min(1e-300)
    return float((num / den).max())


# ----------------------------------------------------------------------------- 1. correctness
def recurrent_kernel(x, S0, cu):
    """kvbuffer_fast's fp32 recurrence kernel on ``x``: per sequence for offsets ``cu`` (it takes no
    cu_seqlens), outputs concatenated along T."""
    if cu is None:
        return fast.recurrent_gated_delta_rule(**x, initial_state=S0)[0]
    outs = []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        if b > a:
            outs.append(fast.recurrent_gated_delta_rule(**{m: t[:, a:b] for m, t in x.items()},
                                                        initial_state=S0[n:n + 1])[0])
    return torch.cat(outs, 1)


def chunk_cases(quick):
    """(dtype, channel, varlen) of the chunk checks: all eight, or under --quick the fp32 ones and bf16 scalar."""
    dtypes = (torch.float32,) if SMOKE else (torch.float32, torch.bfloat16)
    cases = [(dt, ch, vl) for dt in dtypes for ch in (False, True) for vl in (False, True)]
    if quick:
        cases = [c for c in cases if c[0] == torch.float32 or not c[1]]
    return cases


def correctness(fla_fn, quick):
    rows = []
    shapes = dict(H=1, HV=2, K=16, V=16) if SMOKE else QWEN
    tscale = 10 if SMOKE else 1  # tokens divided by this under --smoke
    dtypes = (torch.float32,) if SMOKE else (torch.float32, torch.bfloat16)
    for dtype, channel, varlen in chunk_cases(quick):
        t0 = time.time()
        tag = f"{str(dtype)[6:]} {'channel' if channel else 'scalar'} {'varlen' if varlen else 'B=2'}"
        if varlen:
            cu = [c // tscale for c in (0, 100, 357, 357, 600)]
            x = make_inputs(1, cu[-1], **shapes, dtype=dtype, channel=channel, seed=1)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
            N = len(cu) - 1
        else:
            x = make_inputs(2, 300 // tscale, **shapes, dtype=dtype, channel=channel, seed=2)
            cu, cu_t, N = None, None, 2
        S0 = 0.5 * torch.randn(N, shapes["HV"], shapes["K"], shapes["V"], device=DEV)
        kw = dict(cu_seqlens=None if cu_t is None else cu_t.long())
        # the baseline: the recurrence and the chunkwise form (chunks of 64, the kernel's) in float32, per sequence
        (o64, S64), (ob, Sb) = forms(x, S0, cu, chunk=64)
        o, S = fast.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, cu_seqlens=cu_t)
        row = dict(case=tag, chunk_o=judged(f"chunk {tag}.o", o, o64, ob),
                   chunk_state=judged(f"chunk {tag}.state", S, S64, Sb, head_axis=1, dtype=torch.float32))
        row["recurrent_kernel_rel"] = rel_err(recurrent_kernel(x, S0, cu), o64)
        row["chunk_rel"] = rel_err(o, o64)
        if fla_fn is not None and not channel:
            try:
                of, _ = call_fla(fla_fn, x, initial_state=S0, output_final_state=True, cu_seqlens=kw["cu_seqlens"])
                row["fla_rel"] = rel_err(of, o64)
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = f"{type(e).__name__}: {e}"[:300]
        row["seconds"] = time.time() - t0
        log(f"[check] {tag}: chunk rel {row['chunk_rel']:.3g} "
            f"({'PASS' if row['chunk_o']['passed'] and row['chunk_state']['passed'] else 'FAIL'}), "
            f"recurrent {row['recurrent_kernel_rel']:.3g}, fla {row.get('fla_rel', float('nan')):.3g} "
            f"({row['seconds']:.1f} s)")
        rows.append(row)
    # direct, and prefill then buffered decode, fp32 and bf16
    for dtype in dtypes:
        t0 = time.time()
        x = make_inputs(2, 50 if not SMOKE else 30, **shapes, dtype=dtype, seed=3)
        (o64, S64), (ob, _) = forms(x, chunk=x["q"].shape[1])  # direct: one chunk of the whole sequence
        od = fast.direct_gated_delta_rule(**x)
        rows.append(dict(case=f"direct {str(dtype)[6:]} T={x['q'].shape[1]}",
                         direct_o=judged("direct.o", od, o64, ob)))
        T_all = x["q"].shape[1]
        plans = ((T_all - 10, 16), (T_all - 5, 64), (10, 16))
        for prompt, C in plans[:1] if quick else plans:
            sl = lambda a, b: {n: t[:, a:b] for n, t in x.items()}  # noqa: E731

            def run(pkg):
                o, buf = pkg.prefill(**sl(0, prompt), capacity=C)
                outs = [o]
                for t in range(prompt, T_all):
                    ot, buf = pkg.buffered_decode(**sl(t, t + 1), buffer=buf)
                    outs.append(ot)
                return torch.cat(outs, 1), pkg.materialize_state(buf)

            o, S = run(fast)
            # the baseline: the recurrence and the chunkwise form (chunks of max(64, C)) in float32, and the same
            # calls run by kvbuffer_ref (its own form)
            _, (pb_o, pb_S) = forms(x, chunk=C)
            own_o, own_S = run(ref)
            rows.append(dict(case=f"prefill {str(dtype)[6:]} prompt={prompt} C={C} + decode to {T_all}",
                             prefill_o=judged("prefill.o", o, o64, [pb_o, own_o]),
                             prefill_state=judged("prefill.state", S, S64, [pb_S, own_S], head_axis=1,
                                                  dtype=torch.float32)))
        if quick and dtype != torch.float32:
            log(f"[check] direct, prefill {str(dtype)[6:]} ({time.time() - t0:.1f} s)")
            continue
        # ragged prompts in one launch, then decode; the oracle once per prompt over all its tokens
        lens = [0, 17, 30, 21] if SMOKE else [0, 17, 100, 70]
        steps = 3
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        xr = make_inputs(len(lens), max(lens) + steps, **shapes, dtype=dtype, seed=4)
        flat = {n: torch.cat([t[b:b + 1, :lens[b]] for b in range(len(lens))], 1) for n, t in xr.items()}
        o, buf = fast.prefill(**flat, capacity=16, cu_seqlens=torch.tensor(cu, device=DEV))
        _, own = ref.prefill(**flat, capacity=16, cu_seqlens=torch.tensor(cu, device=DEV))  # the own form's buffer
        truth = []
        for b in range(len(lens)):
            xs = {n: t[b:b + 1, :lens[b] + steps] for n, t in xr.items()}
            (t64, _), (tb, _) = forms(xs, chunk=16)
            truth.append((t64, tb))
        ok, worst = True, 0.0
        for step in range(steps):
            tok = {n: torch.stack([t[b, lens[b] + step] for b in range(len(lens))])[:, None] for n, t in xr.items()}
            ot, buf = fast.buffered_decode(**tok, buffer=buf)
            own_o, own = ref.buffered_decode(**tok, buffer=own)
            for b, (t64, tb) in enumerate(truth):
                i = lens[b] + step
                j = judged("ragged prefill + decode", ot[b:b + 1], t64[:, i:i + 1], [tb[:, i:i + 1], own_o[b:b + 1]])
                ok &= j["passed"]
                worst = max(worst, j["rel"])
        rows.append(dict(case=f"ragged prefill {str(dtype)[6:]} lens={lens} C=16 + {steps} decode steps", passed=ok,
                         rel=worst))
        log(f"[check] direct, prefill, ragged prefill {str(dtype)[6:]} ({time.time() - t0:.1f} s)")
    if DEV == "cuda":
        torch.cuda.synchronize()
    return rows


# ----------------------------------------------------------------------------- 2. timings
def chunk_flops(B, T, HV, K, V, BT=64):
    """Products of the chunk algorithm (per value head and chunk of BT: K K^T, Q K^T, W = T (beta K),
    U~ = T (beta V), the inverse, W S, Q S, (QK) U, the fold)."""
    nc = math.ceil(T / BT)
    per_chunk = BT * BT * (6 * K + 4 * V) + BT ** 3 / 3 + 6 * BT * K * V
    return B * HV * nc * per_chunk


#: The launches timed: the table's config ("ours") and the candidates beside it, each changing the state
#: launch, the sequential part (None: the table's; a dict: fields replaced in the table's config for those
#: inputs; a candidate equal to the table's config is skipped).  state_bv32: half the state programs, each
#: with twice the columns (fewer loads of W and K per state column; ptxas for sm_90 reports spills of 520 B
#: per thread for fp32 and 104 B for bf16, against 200 B and none at BV = 16).  state_stages2: the chunk
#: loop software-pipelined, the next chunk's W and K loaded during this one's products (spills 872 / 344 B).
#: A candidate equal to one timed before it in the same row is skipped.
VARIANTS = (("ours", None), ("fast16_off", dict(fast16=False)), ("state_bv16", dict(BV=16)), ("state_bv32", dict(BV=32)),
            ("state_stages2", dict(stages=2)), ("state_stages3", dict(stages=3)), ("state_warps8", dict(num_warps=8)),
            ("prep_warps2", dict(prep_warps=2)), ("prep_warps8", dict(prep_warps=8)), ("out_bv128", dict(out_BV=128)),
            ("out_warps8", dict(out_warps=8)))


def variant_config(x, change):
    """The table's ChunkConfig for inputs ``x`` with ``change`` applied (None: the table's own, None)."""
    if change is None:
        return None
    d = x["v"]
    key = key_of(x["q"], B=x["q"].shape[0], HV=d.shape[2], V=d.shape[3], channel=x["g"].dim() == 4)
    return dataclasses.replace(config_for("chunk", key), **change)


def launch_us(x, cfg):
    """Microseconds of each launch of the chunk path alone (prep, state, output), each replayed as its own
    CUDA graph over scratch the launches before it filled."""
    _, _, launches = chunk_launches_for(**x, output_final_state=True, config=cfg)
    for _, launch in launches:
        launch()
    return {name: device_ms(launch, SMOKE)[0] * 1e3 for name, launch in launches}


def timings(fla_fn, quick, deadline):
    rows = []
    Ts = (1024, 4096) if quick else (1024, 4096, 16384, 32768)
    Bs = (1,) if quick else (1, 4)
    err_Ts = (1024,) if quick else (1024, 4096)
    heads, dtypes = QWEN, (torch.bfloat16, torch.float32)
    if SMOKE:  # the code paths on the interpreter: one tiny shape, fp32, wall clock
        Ts, Bs, err_Ts, heads, dtypes = (40,), (1,), (40,), dict(H=1, HV=2, K=16, V=16), (torch.float32,)
    nan = float("nan")
    for B in Bs:
        for T in Ts:
            for dtype in dtypes:
                if time.time() > deadline:
                    log("[time] deadline reached, skipping the rest")
                    return rows
                t0 = time.time()
                x = make_inputs(B, T, **heads, dtype=dtype, seed=T + B)
                row = dict(dtype=str(dtype)[6:], B=B, T=T, **heads)
                flops = chunk_flops(B, T, heads["HV"], heads["K"], heads["V"])
                peak = PEAK_TFLOPS[row["dtype"]]
                row["ours_config"] = str(variant_config(x, {}))
                timed = {}  # config -> the label it was timed under
                for label, change in VARIANTS:
                    cfg = variant_config(x, change)
                    if change is not None and (cfg == variant_config(x, {}) or
                                               ("fast16" in change and dtype == torch.float32)):
                        row[f"{label}_same_as"] = "ours"
                        continue
                    if change is not None and cfg in timed:
                        row[f"{label}_same_as"] = timed[cfg]
                        continue
                    timed.setdefault(cfg, label)
                    try:
                        ms, method = device_ms(lambda: fast.chunk_gated_delta_rule(**x, output_final_state=True,
                                                                                   config=cfg), SMOKE)
                        row[f"{label}_us"] = ms * 1e3
                        row[f"{label}_method"] = method
                        row[f"{label}_tflops"] = flops / (ms * 1e-3) / 1e12
                        row[f"{label}_of_peak"] = row[f"{label}_tflops"] / peak
                        row[f"{label}_launch_us"] = launch_us(x, cfg)
                    except Exception as e:  # noqa: BLE001
                        row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:400]
                        log(f"[time] {label}: {row[f'{label}_error']}")
                if fla_fn is not None:
                    try:
                        ms, method = device_ms(lambda: call_fla(fla_fn, x, output_final_state=True), SMOKE)
                        row.update(fla_us=ms * 1e3, fla_method=method, fla_tflops=flops / (ms * 1e-3) / 1e12)
                        row["fla_of_peak"] = row["fla_tflops"] / peak
                        for label, _ in VARIANTS:
                            if f"{label}_us" in row:
                                row[f"{label}_over_fla"] = row[f"{label}_us"] / row["fla_us"]
                    except Exception as e:  # noqa: BLE001
                        row["fla_error"] = f"{type(e).__name__}: {e}"[:300]
                if B == 1 and T in err_Ts:
                    o64, _ = ref.recurrent_gated_delta_rule(**up(x))
                    row["ours_rel"] = rel_err(fast.chunk_gated_delta_rule(**x)[0], o64)
                    row["recurrent_kernel_rel"] = rel_err(fast.recurrent_gated_delta_rule(**x)[0], o64)
                    if fla_fn is not None and "fla_error" not in row:
                        row["fla_rel"] = rel_err(call_fla(fla_fn, x)[0], o64)
                    del o64
                row["seconds"] = time.time() - t0
                parts = " ".join(
                    f"{label} {row.get(f'{label}_us', nan):.1f} us ["
                    + "/".join(f"{v:.1f}" for v in row.get(f"{label}_launch_us", {}).values()) + "]"
                    for label, _ in VARIANTS)
                log(f"[time] {row['dtype']} B={B} T={T}: {parts} (prep/state/output); fla {row.get('fla_us', nan):.1f} us, "
                    f"ours/fla {row.get('ours_over_fla', nan):.3f}; err ours {row.get('ours_rel', nan):.3g} "
                    f"fla {row.get('fla_rel', nan):.3g} rec {row.get('recurrent_kernel_rel', nan):.3g} "
                    f"({row['seconds']:.1f} s)")
                rows.append(row)
                del x
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    return rows


def short_prompts(deadline, C=16):
    """Prompts of T <= C tokens at serving batches, bf16: the prefill that keeps every token in the buffer
    (tail = T: direct mode, no state read or written) against the one that folds them all into a state
    (tail = 0), and one buffered decode step after each (direct mode reads T buffered rows and no state;
    the state path reads the state).  Bytes per request and layer: the state (fp32) a direct request
    does not need until its first fold, against its T buffered entries."""
    rows = []
    Ts, Bs, heads = (4, 8, 16), (64, 256), QWEN
    dtype = torch.bfloat16
    if SMOKE:
        Ts, Bs, heads, dtype, C = (3,), (2,), dict(H=1, HV=2, K=16, V=16), torch.float32, 4
    for B in Bs:
        for T in Ts:
            if time.time() > deadline:
                log("[time] deadline reached, skipping the rest of the short prompts")
                return rows
            x = make_inputs(B, T, **heads, dtype=dtype, seed=T + B)
            step = make_inputs(B, 1, **heads, dtype=dtype, seed=T + B + 1)
            row = dict(dtype=str(dtype)[6:], B=B, T=T, C=C, **heads)
            for label, tail in (("direct", T), ("state", 0)):
                ms, method = device_ms(lambda: fast.prefill(**x, capacity=C, tail=tail), SMOKE)
                row[f"{label}_prefill_us"], row["method"] = ms * 1e3, method
                _, buf = fast.prefill(**x, capacity=C, tail=tail)
                n0 = buf.lengths.clone()

                def decode_step():
                    buf.lengths.copy_(n0)  # the same step every replay (one tiny copy)
                    fast.buffered_decode(**step, buffer=buf)
                row[f"{label}_decode_us"] = device_ms(decode_step, SMOKE)[0] * 1e3
            HV, K, V, H = heads["HV"], heads["K"], heads["V"], heads["H"]
            row["state_bytes_per_request"] = HV * K * V * 4
            row["direct_buffer_bytes_per_request"] = T * (H * K * 2 + HV * V * 4 + HV * 4)
            log(f"[short] B={B} T={T}: prefill direct {row['direct_prefill_us']:.1f} / state "
                f"{row['state_prefill_us']:.1f} us; next decode direct {row['direct_decode_us']:.1f} / state "
                f"{row['state_decode_us']:.1f} us")
            rows.append(row)
    return rows


def main(argv=None) -> int:
    global DEV, SMOKE, VARIANTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where to write the JSON")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (T = 1k, 4k at B = 1), about 2 minutes")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script on the Triton interpreter: "
                    "tiny shapes, the timings' code on one shape by the wall clock, no fla")
    ap.add_argument("--budget-s", type=float, default=None, help="stop timing new shapes after this many seconds "
                    "from the start (default 200, --quick 100)")
    ap.add_argument("--no-short", action="store_true", help="skip the short prompts (T <= C)")
    ap.add_argument("--variants", default=None, help="a comma list of the VARIANTS to time besides 'ours' "
                    f"(default all: {', '.join(n for n, _ in VARIANTS[1:])})")
    ap.add_argument("--timings-only", action="store_true", help="skip the correctness part (the compiled tests "
                    "and the validator's gpu profile cover it); the timings still state both errors")
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 100.0 if args.quick else 200.0
    if args.variants is not None:
        names = {n for n in args.variants.split(",") if n}
        unknown = names - {n for n, _ in VARIANTS}
        if unknown:
            ap.error(f"--variants: unknown {sorted(unknown)}; known: {', '.join(n for n, _ in VARIANTS)}")
        VARIANTS = tuple((n, c) for n, c in VARIANTS if n == "ours" or n in names)
    if args.smoke:
        DEV, SMOKE = "cpu", True
    elif not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device (--smoke runs the correctness part on the CPU)"}))
        return 2
    os.environ.setdefault("KVBUFFER_POISON", "0")
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's and the baseline's products stay fp32 / fp64
    t0 = time.time()
    fla_fn, fla_version = (None, None) if SMOKE else fla_chunk()
    out = dict(script="scripts/gpu_prefill.py", quick=args.quick, versions=versions(), fla=fla_version,
               device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)",
               peaks_tflops=PEAK_TFLOPS)
    try:
        out["correctness"] = [] if args.timings_only else correctness(fla_fn, args.quick)
    except Exception:  # noqa: BLE001
        out["correctness_error"] = traceback.format_exc()[-2000:]
        log(out["correctness_error"])
    checks = out.get("correctness", [])
    out["all_passed"] = None if args.timings_only else bool(checks) and all(
        all(v["passed"] for v in r.values() if isinstance(v, dict) and "passed" in v) and r.get("passed", True)
        for r in checks)
    log(f"[check] all passed: {out['all_passed']} ({time.time() - t0:.0f} s)")
    try:
        out["short_prompts"] = [] if args.no_short else short_prompts(t0 + args.budget_s)
    except Exception:  # noqa: BLE001
        out["short_prompts_error"] = traceback.format_exc()[-2000:]
        log(out["short_prompts_error"])
    try:
        out["timings"] = timings(fla_fn, args.quick, t0 + args.budget_s)
    except Exception:  # noqa: BLE001
        out["timings_error"] = traceback.format_exc()[-2000:]
        log(out["timings_error"])
    out["fla_grouped_heads"] = dict(FLA_GROUPED)
    out["wall_s"] = time.time() - t0
    text = json.dumps(out, indent=1, default=str)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0 if out["all_passed"] is not False else 1  # None: --timings-only, nothing checked


if __name__ == "__main__":
    sys.exit(main())
