"""GPU decode benchmark: compiled correctness of every kvbuffer_fast kernel, then timings.

    python -m bench.gpu_decode --out results.json [--batches 64,128,256,512] [--capacities 16,32,64]
                               [--tune] [--skip-check] [--quick]

On a CUDA machine this
(a) checks recurrent_decode, buffered_decode (ragged, direct, folds, flushes, bf16 u-cache) and
    flush against the float64 oracle (``kvbuffer_ref.testing.properties``) at Qwen3-Next shapes
    (H=16, HV=32, K=V=128), fp32 and bf16 inputs;
(b) times, per batch B: a large device-to-device copy (the bandwidth ceiling, bytes read + written),
    kvbuffer_fast.recurrent_decode, flash-linear-attention's fused_recurrent_gated_delta_rule (the
    baseline serving systems use), and buffered decode averaged over a whole buffer cycle of C steps
    (the fold of a full buffer included), for every capacity C; each with the bytes the IO model of
    DESIGN.md §6 says it must move and the bandwidth that achieves;
(c) writes everything to ``--out`` as JSON (device, versions, every timing).

Timing: ``triton.testing.do_bench`` (median; it clears the L2 before each call) for single launches,
and for every op also a *queued* time: the op is enqueued behind a GPU sleep so that Python launch
overhead is hidden (what a CUDA graph gives), median over repetitions.  States at B >= 64 are
>= 128 MiB, more than twice the 60 MB L2, so no input rotation is needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from bench._meta import record_checks, run_metadata, save_json

H, HV, K, V = 16, 32, 128, 128  # Qwen3-Next linear-attention layer
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than any op's launch overhead here
DEVICE = "cuda"


# ----------------------------------------------------------------------------- timing
def queued_ms(fn, reps: int = 15, setup=None, warmup: bool = True) -> float:
    """Median GPU time of ``fn`` enqueued behind a GPU sleep (launch overhead hidden), L2 cleared first.

    ``setup`` (untimed) runs before every repetition, e.g. to restore what ``fn`` consumes.
    """
    if DEVICE == "cpu":  # --cpu-smoke: the interpreter, wall clock
        times = []
        for _ in range(max(1, reps // 5)):
            if setup:
                setup()
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    scratch = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=DEVICE)
    if warmup:
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        scratch.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_ms(fn) -> float:
    import triton.testing

    if DEVICE == "cpu":
        return queued_ms(fn, reps=5)

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


# ----------------------------------------------------------------------------- inputs
def tokens(B, dtype=torch.bfloat16, seed=0, channel=False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = F.normalize(torch.randn(B, 1, H, K, device=DEVICE, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, 1, H, K, device=DEVICE, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, 1, HV, V, device=DEVICE, generator=gen).to(dtype)
    gshape = (B, 1, HV, K) if channel else (B, 1, HV)
    g = F.logsigmoid(torch.randn(gshape, device=DEVICE, generator=gen) + 4.0)
    beta = torch.rand(B, 1, HV, device=DEVICE, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def full_buffer(B, C, key_dtype=torch.bfloat16, u_dtype=torch.float32, seed=1):
    """A u-cache buffer with every request full (length C) and owning a state: the start of a cycle."""
    from kvbuffer_ref.buffer import KVBuffer

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    kk = F.normalize(torch.randn(B, C, H, K, device=DEVICE, generator=gen), dim=-1).to(key_dtype)
    u = (0.1 * torch.randn(B, C, HV, V, device=DEVICE, generator=gen)).to(u_dtype)
    G = -0.02 * torch.arange(1, C + 1, device=DEVICE, dtype=torch.float32)[None, :, None].expand(B, C, HV).contiguous()
    state = 0.1 * torch.randn(B, HV, K, V, device=DEVICE, generator=gen)
    return KVBuffer(k=kk, lengths=torch.full((B,), C, dtype=torch.long, device=DEVICE), state=state,
                    has_state=torch.ones(B, dtype=torch.bool, device=DEVICE), u=u, G=G.to(torch.float32))


# ----------------------------------------------------------------------------- IO model (DESIGN.md §6)
def state_bytes(B):
    return B * HV * K * V * 4


def entry_bytes(B, key_bytes=2, u_bytes=4, g_bytes=4):
    """One buffered entry of every request: its key per q/k head, u and G per value head."""
    return B * (H * K * key_bytes + HV * V * u_bytes + HV * g_bytes)


def token_bytes(B, in_bytes=2):
    return B * (2 * H * K * in_bytes + HV * V * in_bytes + 2 * HV * 4 + HV * V * in_bytes)  # q,k,v,g,beta in; o out


def recurrent_step_bytes(B):
    return 2 * state_bytes(B) + token_bytes(B)


def buffered_cycle_bytes(B, C, key_bytes=2, u_bytes=4):
    """Bytes of one cycle of C decode steps starting from full buffers (the first step folds)."""
    S, E = state_bytes(B), entry_bytes(B, key_bytes, u_bytes)
    reads = C * S + E * C + sum(E * n for n in range(1, C))  # state every step; C entries at the fold; n after
    writes = S + C * E  # the fold's state write; one new entry per step
    return reads + writes + C * token_bytes(B)


# ----------------------------------------------------------------------------- correctness
def run_checks(quick: bool) -> list[dict]:
    import kvbuffer_fast as fast
    from kvbuffer_ref.testing import Case, compare, properties as P

    import kvbuffer_fast._common as common

    common.POISON = True
    out = []

    def record(label, fn):
        record_checks(out, label, fn)

    dtypes = (torch.float32, torch.bfloat16)
    for ch in (False, True):
        for dt in dtypes:
            case = Case(B=4, T=3, H=H, HV=HV, K=K, V=V, channel_gate=ch, gate="mixed", beta="mixed", seed=11)
            record(f"recurrent ch={ch} {dt}", lambda: P.check_recurrent(fast, case, dt, device=DEVICE))
    C = 16
    plans = [
        # (label, history P, lengths, flushes, T after history)
        ("ragged stateful", 20, [0, 3, C, 8], None, 2 * C + 2),
        ("ragged direct+stateful", 6, [6, 6, 2, 0], None, 2 * C + 2),
        ("flushes", 20, [5, C, 1, 9], {3: [1, 2, 0, 5], 10: None}, C + 4),
    ]
    if quick:
        plans = plans[:2]
    for ch in (False, True):
        for dt in dtypes:
            for label, P_, lengths, flushes, after in plans:
                case = Case(B=4, T=P_ + after, H=H, HV=HV, K=K, V=V, channel_gate=ch, gate="mild",
                            beta="uniform", seed=7)
                record(f"decode {label} C={C} ch={ch} {dt}",
                       lambda: P.check_decode(fast, case, dt, capacity=C, history=P_, lengths=lengths,
                                              flushes=flushes, device=DEVICE))
    # bf16 u-cache (keys bf16, G and state fp32): its extra error is reported, not budgeted
    def bf16_cache():
        hist = 20
        case = Case(B=4, T=hist + C + 2, H=H, HV=HV, K=K, V=V, gate="mild", beta="uniform", seed=3)
        x = case.inputs(torch.bfloat16, DEVICE)
        buf = P.buffer_to(P.ragged_buffer(P.upcast_inputs({n: t[:, :hist] for n, t in x.items()}), [0, 3, C, 8], C),
                          dtype=torch.float32, key_dtype=torch.bfloat16, device=DEVICE)
        buf = buf.replace(u=buf.u.to(torch.bfloat16))
        outs = []
        for t in range(hist, case.T):
            o, buf = fast.buffered_decode(**{n: v[:, t:t + 1] for n, v in x.items()}, buffer=buf)
            outs.append(o)
        (o64, _), base = P.truth_and_baseline(x)
        return [compare(torch.cat(outs, 1).cpu(), o64[:, hist:], base[0][:, hist:],
                        name="decode[C=16, bf16 u-cache].o", dtype=torch.bfloat16)]
    record("decode bf16 u-cache (report only)", bf16_cache)
    common.POISON = False
    return out


# ----------------------------------------------------------------------------- timings
def copy_bandwidth() -> dict:
    n = 2 * 1024 ** 3 // 4 if DEVICE == "cuda" else 1 << 20  # 2 GiB of fp32
    x = torch.randn(n, device=DEVICE)
    y = torch.empty_like(x)
    ms_b = bench_ms(lambda: y.copy_(x))
    ms_q = queued_ms(lambda: y.copy_(x), reps=10)
    nbytes = 2 * x.numel() * 4
    del x, y
    return dict(bytes=nbytes, do_bench_ms=ms_b, queued_ms=ms_q, do_bench_TBps=nbytes / ms_b / 1e9,
                queued_TBps=nbytes / ms_q / 1e9)


def fla_fn(x, state):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    def f():
        return fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=False)
    return f


def time_batch(B, capacities, copy_TBps, cfg_rec=None, cfg_dec=None) -> dict:
    import kvbuffer_fast as fast

    row = dict(B=B, state_MiB=state_bytes(B) / 2 ** 20)
    x = tokens(B)
    state = 0.1 * torch.randn(B, HV, K, V, device=DEVICE)
    rb = recurrent_step_bytes(B)

    def rec():
        fast.recurrent_decode(**x, state=state, **(cfg_rec or {}))

    ms_b, ms_q = bench_ms(rec), queued_ms(rec)
    row["recurrent_decode"] = dict(do_bench_ms=ms_b, queued_ms=ms_q, bytes=rb, TBps=rb / ms_q / 1e9,
                                   frac_copy=rb / ms_q / 1e9 / copy_TBps)
    try:
        f = fla_fn(x, state)
        ms_b, ms_q = bench_ms(f), queued_ms(f)
        row["fla_fused_recurrent"] = dict(do_bench_ms=ms_b, queued_ms=ms_q, bytes=rb, TBps=rb / ms_q / 1e9,
                                          frac_copy=rb / ms_q / 1e9 / copy_TBps)
    except Exception as e:  # noqa: BLE001
        row["fla_fused_recurrent"] = dict(error=repr(e))
    del state
    torch.cuda.empty_cache()
    row["buffered"] = {}
    for C in capacities:
        buf = full_buffer(B, C)

        def cycle(validate=False):
            for _ in range(C):
                fast.buffered_decode(**x, buffer=buf, validate=validate, **(cfg_dec or {}))

        ms_q = queued_ms(cycle, reps=7)
        ms_b = bench_ms(cycle)
        cb = buffered_cycle_bytes(B, C)
        ent = dict(cycle_queued_ms=ms_q, cycle_do_bench_ms=ms_b, per_step_us=ms_q / C * 1e3,
                   per_step_do_bench_us=ms_b / C * 1e3, bytes_per_step=cb / C, TBps=cb / ms_q / 1e9,
                   frac_copy=cb / ms_q / 1e9 / copy_TBps)
        fl = row["fla_fused_recurrent"]
        if "queued_ms" in fl:
            ent["vs_fla_queued"] = ms_q / C / fl["queued_ms"]
            ent["vs_fla_do_bench"] = ms_b / C / fl["do_bench_ms"]
            ent["io_model_ratio_vs_recurrent"] = (cb / C) / rb
        # with validation (a host sync per step): what an eager, un-graphed caller pays
        ent["per_step_validated_do_bench_us"] = bench_ms(lambda: cycle(True)) / C * 1e3
        # the same cycle with the u-cache in bfloat16 (keys bf16, G and state fp32)
        del buf
        buf = full_buffer(B, C, u_dtype=torch.bfloat16)
        ms_h = queued_ms(cycle, reps=7)
        cbh = buffered_cycle_bytes(B, C, u_bytes=2)
        ent["u_bf16"] = dict(per_step_us=ms_h / C * 1e3, bytes_per_step=cbh / C, TBps=cbh / ms_h / 1e9,
                             frac_copy=cbh / ms_h / 1e9 / copy_TBps)
        if "queued_ms" in fl:
            ent["u_bf16"]["vs_fla_queued"] = ms_h / C / fl["queued_ms"]
        # the fold alone, as a separate flush launch of full buffers (the cycle fuses it instead)
        fb = full_buffer(B, C, seed=5)
        snap = (fb.k.clone(), fb.u.clone(), fb.G.clone(), fb.state.clone())

        def reset():
            fb.k.copy_(snap[0]); fb.u.copy_(snap[1]); fb.G.copy_(snap[2]); fb.state.copy_(snap[3])
            fb.lengths.fill_(C); fb.has_state.fill_(True)

        ent["flush_full_queued_ms"] = queued_ms(lambda: fast.flush(fb, validate=False), reps=5, setup=reset,
                                                warmup=False)
        row["buffered"][str(C)] = ent
        print(f"B={B} C={C}: cycle step {ent['per_step_us']:.1f} us ({ent['frac_copy']:.0%} of copy), "
              f"vs fla {ent.get('vs_fla_queued', float('nan')):.3f}x; bf16 u: {ent['u_bf16']['per_step_us']:.1f} us "
              f"({ent['u_bf16']['frac_copy']:.0%}), vs fla {ent['u_bf16'].get('vs_fla_queued', float('nan')):.3f}x; "
              f"flush of full buffers {ent['flush_full_queued_ms'] * 1e3:.0f} us", flush=True)
        del buf, fb, snap
        torch.cuda.empty_cache()
    return row


def _decode_config_ok(cfg: dict) -> tuple[bool, str]:
    """One quick compiled check of buffered_decode under ``cfg`` against the float64 oracle: bf16 inputs
    (the timed dtype), ragged lengths with a direct request, folds at C=16 (two cycles), then a flush."""
    import types

    import kvbuffer_fast as fast
    import kvbuffer_fast._common as common
    from kvbuffer_ref.testing import Case, properties as P

    impl = types.SimpleNamespace(
        buffered_decode=lambda *a, **kw: fast.buffered_decode(*a, **kw, **cfg), flush=fast.flush)
    C = 16
    case = Case(B=3, T=20 + C + 2, H=H, HV=HV, K=K, V=V, gate="mild", beta="uniform", seed=5)
    common.POISON = True
    try:
        dt = torch.float32 if DEVICE == "cpu" else torch.bfloat16  # the interpreter mishandles bf16
        res = P.check_decode(impl, case, dt, capacity=C, history=20, lengths=[C, 0, 7], device=DEVICE)
    finally:
        common.POISON = False
    bad = [str(r) for r in res if not r.passed]
    return not bad, "; ".join(bad)


def tune(copy_TBps, B=128, C=16, deadline=None) -> dict:
    """Sweep launch configs; decode: ``kvbuffer_fast.decode.DECODE_TUNE_CONFIGS``, each timed over a whole
    cycle of C steps (the fold included) only after it passed its correctness check."""
    import kvbuffer_fast as fast
    from kvbuffer_fast.decode import DECODE_TUNE_CONFIGS

    if DEVICE == "cpu":  # --cpu-smoke
        B = 2
    res = dict(recurrent=[], decode=[], B=B, C=C)
    x = tokens(B)
    state = 0.1 * torch.randn(B, HV, K, V, device=DEVICE)
    rb = recurrent_step_bytes(B)
    for BV, nw in ((32, 1), (64, 2), (64, 4)):
        if deadline and time.time() > deadline:
            break
        try:
            ms = queued_ms(lambda: fast.recurrent_decode(**x, state=state, BV=BV, num_warps=nw), reps=7)
            res["recurrent"].append(dict(BV=BV, num_warps=nw, queued_ms=ms, frac_copy=rb / ms / 1e9 / copy_TBps))
        except Exception as e:  # noqa: BLE001
            res["recurrent"].append(dict(BV=BV, num_warps=nw, error=repr(e)))
    del state
    buf = full_buffer(B, C)
    cb = buffered_cycle_bytes(B, C)
    snap = (buf.k.clone(), buf.u.clone(), buf.G.clone(), buf.state.clone())

    def reset():  # every config times the same cycle from full buffers
        buf.k.copy_(snap[0]); buf.u.copy_(snap[1]); buf.G.copy_(snap[2]); buf.state.copy_(snap[3])
        buf.lengths.fill_(C); buf.has_state.fill_(True)

    for cfg in DECODE_TUNE_CONFIGS:
        if deadline and time.time() > deadline:
            res["decode"].append(dict(cfg, skipped="tune deadline"))
            continue
        t0 = time.time()
        try:
            ok, why = _decode_config_ok(cfg)
            if not ok:
                res["decode"].append(dict(cfg, error="correctness: " + why))
                print(f"tune decode {cfg}: FAILED its check: {why}", flush=True)
                continue

            def cycle():
                for _ in range(C):
                    fast.buffered_decode(**x, buffer=buf, validate=False, **cfg)
            ms = queued_ms(cycle, reps=5, setup=reset)
            res["decode"].append(dict(cfg, cycle_queued_ms=ms, per_step_us=ms / C * 1e3,
                                      frac_copy=cb / ms / 1e9 / copy_TBps, seconds=round(time.time() - t0, 1)))
            print(f"tune decode {cfg}: {ms / C * 1e3:.1f} us/step ({cb / ms / 1e9 / copy_TBps:.0%} of copy), "
                  f"{time.time() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. a config this Triton cannot compile
            res["decode"].append(dict(cfg, error=repr(e)))
            print(f"tune decode {cfg}: ERROR {e!r}", flush=True)
    keys = ("BV", "num_warps", "book", "maxnreg", "CB", "variant", "fold", "KB", "NS", "loadn", "keyn", "kt", "pf",
            "pdl", "fold_launch")
    for kind in ("recurrent", "decode"):
        ok = [r for r in res[kind] if "frac_copy" in r]
        if ok:
            best = max(ok, key=lambda r: r["frac_copy"])
            res["best_" + kind] = {k: best[k] for k in keys if k in best}
            print(f"tune {kind}: best {res['best_' + kind]} ({best['frac_copy']:.0%} of copy)", flush=True)
    del buf, snap
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,128,256,512")
    ap.add_argument("--capacities", default="16,32,64")
    ap.add_argument("--tune", action="store_true",
                    help="sweep launch configs (decode: each checked against the oracle first) and time with the best")
    ap.add_argument("--tune-seconds", type=float, default=50.0)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run this script itself on the CPU (TRITON_INTERPRET=1, tiny shapes): tests the script, not speed")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        global DEVICE, H, HV, K, V, SLEEP_CYCLES
        DEVICE, H, HV, K, V = "cpu", 2, 4, 16, 16
    elif not torch.cuda.is_available():
        print("bench.gpu_decode needs a CUDA device", file=sys.stderr)
        return 2
    result = run_metadata(DEVICE, shapes=dict(H=H, HV=HV, K=K, V=V))

    def save():
        save_json(args.out, result)

    t0 = time.time()
    if not args.skip_check:
        try:
            result["checks"] = run_checks(args.quick)
        except Exception as e:  # noqa: BLE001 - e.g. the testing module failing to import: still time
            result["checks"] = [dict(check="import", error=repr(e), trace=traceback.format_exc(limit=6))]
            print(f"!! checks could not run: {e!r}", flush=True)
        bad = [c for c in result["checks"] if not c.get("passed", False) and "report only" not in c["check"]]
        result["checks_failed"] = len(bad)
        print(f"checks: {len(result['checks'])} comparisons, {len(bad)} failed/errored, "
              f"{time.time() - t0:.0f} s", flush=True)
        save()
    result["copy"] = copy_bandwidth()
    copy_TBps = result["copy"]["queued_TBps"]
    print(f"copy: {copy_TBps:.2f} TB/s queued, {result['copy']['do_bench_TBps']:.2f} TB/s do_bench", flush=True)
    save()
    cfg_rec = cfg_dec = None
    if args.tune:
        result["tuning"] = tune(copy_TBps, deadline=time.time() + args.tune_seconds)
        cfg_rec = result["tuning"].get("best_recurrent")
        cfg_dec = result["tuning"].get("best_decode")
        save()
    result["launch"] = dict(recurrent=cfg_rec or "default", decode=cfg_dec or "default")
    result["batches"] = []
    for B in [int(b) for b in args.batches.split(",") if b]:
        result["batches"].append(time_batch(B, [int(c) for c in args.capacities.split(",") if c], copy_TBps,
                                            cfg_rec, cfg_dec))
        save()
    # summary table
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  fla {result['fla']}")
    print(f"copy {copy_TBps:.2f} TB/s (queued)")
    print(f"{'B':>4} {'rec us':>8} {'rec %cp':>7} {'fla us':>8} {'fla %cp':>7} " +
          " ".join(f"{'C=' + c + ' us':>9} {'xfla':>6}" for c in args.capacities.split(",")))
    for row in result["batches"]:
        r, f = row["recurrent_decode"], row["fla_fused_recurrent"]
        line = f"{row['B']:>4} {r['queued_ms'] * 1e3:>8.1f} {r['frac_copy']:>7.0%} "
        line += (f"{f['queued_ms'] * 1e3:>8.1f} {f['frac_copy']:>7.0%} " if "queued_ms" in f else f"{'n/a':>8} {'':>7} ")
        for c in args.capacities.split(","):
            e = row["buffered"][c]
            line += f"{e['per_step_us']:>9.1f} {e.get('vs_fla_queued', float('nan')):>6.3f} "
        print(line)
    result["seconds"] = round(time.time() - t0, 1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
