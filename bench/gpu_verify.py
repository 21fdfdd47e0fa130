"""GPU speculative-verification benchmark: buffered verify (no per-draft states) vs the per-draft-state
baseline vs flash-linear-attention, plus a memory cross-check.

    python -m bench.gpu_verify --out results.json [--batches 64,128,256,512] [--quick] [--no-tune] [--cpu-smoke]

(0) tunes first (unless --no-tune): times every verify launch in kvbuffer_fast.speculative.LAUNCH_CANDIDATES
    (two phases: BV / warps / dot precision), checks the fastest against the float64 oracle (the next one
    if it fails), makes it the default, then the accept copy's BV and the baseline's (BV, warps);

(a) checks kvbuffer_fast.verify / accept at the tuned launch, then decode / flush (chains with counts, trees with nodes, ragged, folds on accept;
    both dot precisions) and per_draft_state_verify / accept, compiled, against the float64 oracle at
    Qwen3-Next shapes (H=16, HV=32, K=V=128) in fp32 and bf16;
(b) times (median GPU time behind a sleep, L2 cleared: bench_ms) at B = 64..512: verifying 4 drafts, i.e. 5 new tokens per
    request (the bonus token accepted last step, not yet through the layer, plus 4 drafts: ONE call
    with D = 5), by buffered verify (buffer of C=16 holding 8 entries, every request owning a state),
    by the per-draft-state baseline (writes 5 intermediate states) and by fla 0.6.0
    fused_recurrent_gated_delta_rule over the same 5 tokens (reads the state, writes the final one);
    then buffered verify time vs draft count 1..8 (chains and binary trees);
(c) allocates both styles for a few batch sizes and compares torch.cuda memory with kvbuffer_ref.memory;
(d) writes everything to --out as JSON (device, versions, every timing), saving after each section.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import types

import torch
import torch.nn.functional as F

from bench._meta import record_checks, run_metadata, save_json

H, HV, K, V = 16, 32, 128, 128  # Qwen3-Next linear-attention layer
C, N_BUF = 16, 8  # capacity and entries held by every request while timing
DEVICE = "cuda"


def bench_ms(fn) -> float:
    """Median GPU time of ``fn`` enqueued behind a GPU sleep with the L2 cleared first
    (bench.gpu_decode.queued_ms): the host's launch overhead is hidden, as in a CUDA graph.  (Plain
    do_bench timed the host instead whenever a call's Python overhead exceeded its GPU time.)"""
    if DEVICE == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from bench.gpu_decode import queued_ms

    return queued_ms(fn, reps=15)


# ----------------------------------------------------------------------------- inputs
def tokens(B, D, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = F.normalize(torch.randn(B, D, H, K, device=DEVICE, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, D, H, K, device=DEVICE, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, D, HV, V, device=DEVICE, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, D, HV, device=DEVICE, generator=gen) + 4.0)
    beta = torch.rand(B, D, HV, device=DEVICE, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def buffer_with(B, n=N_BUF, seed=1):
    from kvbuffer_ref.buffer import KVBuffer

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    kk = F.normalize(torch.randn(B, C, H, K, device=DEVICE, generator=gen), dim=-1).to(torch.bfloat16)
    u = 0.1 * torch.randn(B, C, HV, V, device=DEVICE, generator=gen)
    G = -0.02 * torch.arange(1, C + 1, device=DEVICE, dtype=torch.float32)[None, :, None].expand(B, C, HV).contiguous()
    state = 0.1 * torch.randn(B, HV, K, V, device=DEVICE, generator=gen)
    return KVBuffer(k=kk, lengths=torch.full((B,), n, dtype=torch.long, device=DEVICE), state=state,
                    has_state=torch.ones(B, dtype=torch.bool, device=DEVICE), u=u, G=G)


def tree_parents(D):
    """A binary tree in breadth-first order: node i's parent is (i - 1) // 2, the root's is -1."""
    return [-1] + [(i - 1) // 2 for i in range(1, D)]


def impl_with(precision):
    import kvbuffer_fast as fast
    import kvbuffer_ref as ref

    # the tokens after accept are decoded and flushed by kvbuffer_fast too (the whole serving loop)
    return types.SimpleNamespace(
        verify=functools.partial(fast.verify, precision=precision),
        accept=functools.partial(fast.accept, precision=precision),
        buffered_decode=fast.buffered_decode, flush=fast.flush)


# ----------------------------------------------------------------------------- correctness
def run_checks(quick: bool) -> list[dict]:
    import kvbuffer_fast as fast
    import kvbuffer_fast._common as common
    from kvbuffer_ref.testing import Case, compare
    from kvbuffer_ref.testing import properties as P

    common.POISON = True
    out = []

    def record(label, fn):
        record_checks(out, label, fn)

    B, hist, after = 4, 20, 2
    plans = [  # (label, parents per request, num_drafts, accepted nodes, use_counts, capacity, lengths)
        ("chain D=5 counts", [list(range(-1, 4))] * B, [5, 5, 3, 0], [4, 1, 2, -1], True, 16, [8, 0, 15, 3]),
        ("chain D=5 fold on accept", [list(range(-1, 4))] * B, [5, 4, 5, 2], [4, 3, 0, 1], True, 4, [4, 3, 0, 2]),
        ("tree D=7", [tree_parents(7), [-1, -1, 0, 0, 1, 2, 5], tree_parents(7), [-1, 0, 1, 2, 3, 4, 5]],
         [7, 7, 4, 6], [6, 6, -1, 5], False, 16, [8, 16, 0, 5]),
    ]
    if quick:
        plans = plans[:1] + plans[2:]
    for prec in ("tf32x3", "ieee"):
        impl = impl_with(prec)  # dot precision of both verify phases (the launch's BV / warps stay)
        for ch in (False, True):
            for dt in (torch.float32, torch.bfloat16):
                if prec == "ieee" and (ch or dt == torch.bfloat16):
                    continue  # ieee: one configuration is enough to compare the precisions
                for label, par, nd, nodes, counts, cap, lengths in plans:
                    D = len(par[0])
                    case = Case(B=B, T=hist + D + after, H=H, HV=HV, K=K, V=V, channel_gate=ch, gate="mild",
                                beta="uniform", seed=5)
                    record(f"verify/accept {label} C={cap} ch={ch} {dt} {prec}",
                           lambda: P.check_verify_accept(impl, case, dt, capacity=cap, history=hist, lengths=lengths,
                                                         parents=par, num_drafts=nd, nodes=nodes, after=after,
                                                         device=DEVICE, use_counts=counts))

    def baseline(dt):
        case = Case(B=B, T=5, H=H, HV=HV, K=K, V=V, gate="mild", beta="uniform", seed=9)
        x = case.inputs(dt, DEVICE)
        gen = torch.Generator().manual_seed(1)
        state = (0.5 * torch.randn(B, HV, K, V, generator=gen)).to(DEVICE)
        o, inter = fast.per_draft_state_verify(**x, state=state)
        (o64, _), base = P.truth_and_baseline(x, state)
        res = [compare(o.cpu(), o64, base[0], name="per_draft_state.o", dtype=dt)]
        for t in (0, 4):
            xt = {n: v[:, : t + 1] for n, v in x.items()}
            (_, S64), bt = P.truth_and_baseline(xt, state)
            res.append(compare(inter[:, t].cpu(), S64, bt[1], name=f"per_draft_state.intermediate[{t}]",
                               dtype=torch.float32, head_axis=1))
        keep = state.clone()
        fast.per_draft_state_accept(state, inter, torch.tensor([0, 1, 5, 3], device=DEVICE))
        ok = torch.equal(state[0], keep[0]) and torch.equal(state[1], inter[1, 0]) and torch.equal(state[2], inter[2, 4])
        if not ok:
            raise AssertionError("per_draft_state_accept copied the wrong intermediate state")
        return res

    for dt in (torch.float32, torch.bfloat16):
        record(f"per-draft-state baseline {dt}", lambda: baseline(dt))
    common.POISON = False
    return out


# ----------------------------------------------------------------------------- timing
def fla_fn(x, state):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    def f():
        return fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=False)
    return f


def verify_fn(x, buf, parents=None, **kw):
    import kvbuffer_fast as fast

    B, D = x["q"].shape[:2]
    o = torch.empty(B, D, HV, V, device=DEVICE, dtype=x["v"].dtype)
    par = None if parents is None else torch.tensor([parents] * B, device=DEVICE)
    return lambda: fast.verify(**x, buffer=buf, parents=par, validate=False, out=o, **kw)


def baseline_fn(x, state, **kw):
    import kvbuffer_fast as fast

    B, D = x["q"].shape[:2]
    inter = torch.empty(B, D, HV, K, V, device=DEVICE, dtype=torch.float32)
    o = torch.empty(B, D, HV, V, device=DEVICE, dtype=x["v"].dtype)
    return lambda: fast.per_draft_state_verify(**x, state=state, intermediate=inter, out=o, **kw)


def candidate_check() -> bool:
    """A small fp32 check of the launch now set (trees, Qwen3-Next heads) against the float64 oracle."""
    from kvbuffer_ref.testing import Case
    from kvbuffer_ref.testing import properties as P

    case = Case(B=2, T=6 + 5 + 1, H=H, HV=HV, K=K, V=V, gate="mild", beta="uniform", seed=3)
    res = P.check_verify_accept(impl_with(None), case, torch.float32, capacity=16, history=6, lengths=[6, 3],
                                parents=[[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]], num_drafts=[5, 4], nodes=[3, 3],
                                after=1, device=DEVICE, use_counts=False)
    for c in res:
        if not c.passed:
            print("   !! " + str(c), flush=True)
    return all(c.passed for c in res)


def tune(B=128) -> dict:
    """Time every kvbuffer_fast.speculative.LAUNCH_CANDIDATES of verify at B=128, D=5, then check the
    fastest against the oracle (next fastest if it fails) and make it the default (set_launch); also the
    accept copy's BV and the baseline's (BV, num_warps)."""
    import kvbuffer_fast as fast
    import kvbuffer_fast.speculative as spec

    x, buf = tokens(B, 5), buffer_with(B)
    default = dict(spec._CONFIG["verify"])
    res = dict(verify=[], accept=[], baseline=[])
    for cand in spec.LAUNCH_CANDIDATES:
        spec.set_launch("verify", **{**default, **cand})
        row = dict(cand)
        try:
            row["ms"] = bench_ms(verify_fn(x, buf))
        except Exception as e:  # noqa: BLE001 - e.g. out of resources: record and go on
            row["ms"], row["error"] = None, repr(e)[:300]
        print(f"   verify {cand}: {row['ms'] if row['ms'] is None else round(row['ms'] * 1e3, 1)} us", flush=True)
        res["verify"].append(row)
    best = None
    for row in sorted([r for r in res["verify"] if r["ms"] is not None], key=lambda r: r["ms"]):
        spec.set_launch("verify", **{k: row.get(k, default[k]) for k in default})
        try:
            row["check_passed"] = candidate_check()
        except Exception as e:  # noqa: BLE001
            row["check_passed"], row["check_error"] = False, repr(e)[:300]
        if row["check_passed"]:
            best = row
            break
    chosen = {k: best.get(k, default[k]) for k in default} if best else default
    spec.set_launch("verify", **chosen)
    res["best_verify"] = dict(best or default)
    _, drafts = verify_fn(x, buf)()
    counts = torch.full((B,), 3, dtype=torch.long, device=DEVICE)
    for bv in (32, 64, 128):
        def acc():
            buf.lengths.fill_(N_BUF)
            fast.accept(buf, drafts, counts=counts, validate=False, BV=bv)
        try:
            res["accept"].append(dict(BV=bv, ms=bench_ms(acc)))
        except Exception as e:  # noqa: BLE001
            res["accept"].append(dict(BV=bv, ms=None, error=repr(e)[:300]))
    ok_a = [r for r in res["accept"] if r["ms"] is not None]
    if ok_a:
        res["best_accept"] = min(ok_a, key=lambda r: r["ms"])
        spec.set_launch("accept", BV=res["best_accept"]["BV"])
    buf.lengths.fill_(N_BUF)
    for bv, w in ((16, 2), (32, 2), (64, 2), (32, 4), (64, 4)):
        try:
            ms = bench_ms(baseline_fn(x, buf.state, BV=bv, num_warps=w))
        except Exception:  # noqa: BLE001
            ms = None
        res["baseline"].append(dict(BV=bv, num_warps=w, ms=ms))
    res["best_baseline"] = min([r for r in res["baseline"] if r["ms"] is not None], key=lambda r: r["ms"])
    return res


def time_batches(batches, cfg_v, cfg_b) -> list:
    rows = []
    S = HV * K * V * 4
    for B in batches:
        x, buf = tokens(B, 5), buffer_with(B)
        row = dict(B=B, D=5, state_MiB=B * S / 2 ** 20)
        row["buffered_verify_ms"] = bench_ms(verify_fn(x, buf, **cfg_v))
        row["per_draft_state_verify_ms"] = bench_ms(baseline_fn(x, buf.state, **cfg_b))
        try:
            row["fla_fused_recurrent_5tok_ms"] = bench_ms(fla_fn(x, buf.state.clone()))
        except Exception as e:  # noqa: BLE001
            row["fla_error"] = repr(e)
        # accept: buffered (append 3 entries; a tiny lengths reset rides along) vs the baseline's copy-back
        import kvbuffer_fast as fast

        _, drafts = verify_fn(x, buf, **cfg_v)()
        counts = torch.full((B,), 3, dtype=torch.long, device=DEVICE)

        def acc():
            buf.lengths.fill_(N_BUF)
            fast.accept(buf, drafts, counts=counts, validate=False)
        row["buffered_accept_ms"] = bench_ms(acc)
        inter = torch.empty(B, 5, HV, K, V, device=DEVICE)
        st = buf.state.clone()
        row["per_draft_state_accept_ms"] = bench_ms(lambda: fast.per_draft_state_accept(st, inter, counts))
        del inter, st
        # IO model (bytes that must move): state read (+ intermediates written) + buffer + tokens
        tok = B * 5 * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4)
        ent = B * (H * K * 2 + HV * V * 4 + HV * 4)
        row["bytes_buffered"] = B * S + N_BUF * ent + 5 * ent + tok
        row["bytes_per_draft_state"] = B * S + 5 * B * S + tok
        row["bytes_fla"] = 2 * B * S + tok
        row["TBps_buffered"] = row["bytes_buffered"] / row["buffered_verify_ms"] / 1e9
        row["TBps_per_draft_state"] = row["bytes_per_draft_state"] / row["per_draft_state_verify_ms"] / 1e9
        row["buffered_vs_per_draft_state"] = row["buffered_verify_ms"] / row["per_draft_state_verify_ms"]
        if "fla_fused_recurrent_5tok_ms" in row:
            row["buffered_vs_fla"] = row["buffered_verify_ms"] / row["fla_fused_recurrent_5tok_ms"]
            row["TBps_fla"] = row["bytes_fla"] / row["fla_fused_recurrent_5tok_ms"] / 1e9
        print(f"B={B:4d}  buffered {row['buffered_verify_ms'] * 1e3:8.1f} us  per-draft-state "
              f"{row['per_draft_state_verify_ms'] * 1e3:8.1f} us  fla(5 tok) "
              f"{row.get('fla_fused_recurrent_5tok_ms', float('nan')) * 1e3:8.1f} us  ratios "
              f"{row['buffered_vs_per_draft_state']:.3f} / {row.get('buffered_vs_fla', float('nan')):.3f}", flush=True)
        rows.append(row)
        del x, buf, drafts
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return rows


def draft_sweep(B, cfg_v, cfg_b) -> list:
    rows = []
    buf = buffer_with(B)
    for D in range(1, 9):
        x = tokens(B, D)
        row = dict(B=B, D=D)
        row["chain_ms"] = bench_ms(verify_fn(x, buf, **cfg_v))
        row["tree_ms"] = bench_ms(verify_fn(x, buf, parents=tree_parents(D), **cfg_v))
        row["per_draft_state_chain_ms"] = bench_ms(baseline_fn(x, buf.state, **cfg_b))
        print(f"D={D}  chain {row['chain_ms'] * 1e3:7.1f} us  tree {row['tree_ms'] * 1e3:7.1f} us  "
              f"per-draft-state {row['per_draft_state_chain_ms'] * 1e3:7.1f} us", flush=True)
        rows.append(row)
    return rows


def memory_check(batches, d=5) -> list:
    """Allocate what each style holds for B requests (one layer) and compare with kvbuffer_ref.memory.
    d = the tokens verified per step: 5 = the bonus token + 4 drafts, as timed above (the per-draft-state
    baseline then holds 5 intermediate states besides the state; docs/speculative.md)."""
    import kvbuffer_fast as fast
    from kvbuffer_ref.memory import LayerShape, buffered_verify_bytes, per_draft_state_bytes

    shape = LayerShape(H=H, HV=HV, K=K, V=V)  # fp32 state, bf16 keys, fp32 u-cache
    rows = []
    for B in batches:
        x = tokens(B, d)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        buf = buffer_with(B)  # state + C entries + lengths + has_state
        o, drafts = fast.verify(**x, buffer=buf, validate=False)
        del o  # an activation, not held
        torch.cuda.synchronize()
        held_buf = torch.cuda.memory_allocated() - base
        peak_buf = torch.cuda.max_memory_allocated() - base
        del buf, drafts
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        state = torch.zeros(B, HV, K, V, device=DEVICE)
        o, inter = fast.per_draft_state_verify(**x, state=state)
        del o
        torch.cuda.synchronize()
        held_pds = torch.cuda.memory_allocated() - base
        peak_pds = torch.cuda.max_memory_allocated() - base
        del state, inter
        torch.cuda.empty_cache()
        f_buf = B * buffered_verify_bytes(shape, drafts=d, capacity=C).total
        f_pds = B * per_draft_state_bytes(shape, drafts=d).total
        row = dict(B=B, drafts=d, capacity=C, buffered_measured=held_buf, buffered_formula=f_buf,
                   buffered_peak_during_verify=peak_buf, per_draft_state_measured=held_pds,
                   per_draft_state_formula=f_pds, per_draft_state_peak_during_verify=peak_pds,
                   measured_ratio=held_pds / held_buf, formula_ratio=f_pds / f_buf)
        print(f"memory B={B}: buffered {held_buf / 2**20:.2f} MiB (formula {f_buf / 2**20:.2f}), per-draft-state "
              f"{held_pds / 2**20:.2f} MiB (formula {f_pds / 2**20:.2f}), ratio {row['measured_ratio']:.2f}",
              flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,128,256,512")
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run this script on the CPU (TRITON_INTERPRET=1, tiny shapes): tests the script, not speed")
    args = ap.parse_args(argv)
    global DEVICE, H, HV, K, V
    if args.cpu_smoke:
        DEVICE, H, HV, K, V = "cpu", 2, 4, 16, 16
    elif not torch.cuda.is_available():
        print("bench.gpu_verify needs a CUDA device (or --cpu-smoke)", file=sys.stderr)
        return 2
    result = run_metadata(
        DEVICE, shapes=dict(H=H, HV=HV, K=K, V=V), buffer=dict(capacity=C, entries_held=N_BUF),
        convention=("'verify 4 drafts' = 5 new tokens per request (the bonus token plus 4 drafts) in one call: "
                    "buffered verify D=5 (no state written), per-draft-state verify writes 5 intermediate states, "
                    "fla fused_recurrent runs the 5 tokens from the state and writes the final state"),
        timing="median GPU time of the op enqueued behind a GPU sleep, L2 cleared first (launch overhead hidden), ms",
    )

    def save():
        save_json(args.out, result)

    t0 = time.time()
    cfg_v, cfg_b = {}, {}  # verify / accept: the launch set by tune() (kvbuffer_fast.speculative.set_launch)
    if not args.no_tune:
        result["tuning"] = tune(B=2 if args.cpu_smoke else 128)
        bb = result["tuning"]["best_baseline"]
        cfg_b = dict(BV=bb["BV"], num_warps=bb["num_warps"])
        print(f"tuned: verify {result['tuning']['best_verify']}, accept {result['tuning'].get('best_accept')}, "
              f"baseline {cfg_b}  ({time.time() - t0:.0f} s)", flush=True)
        save()
    if not args.skip_check:
        result["checks"] = run_checks(args.quick)
        bad = [c for c in result["checks"] if not c.get("passed", False)]
        result["checks_failed"] = len(bad)
        print(f"checks: {len(result['checks'])} comparisons, {len(bad)} failed/errored, {time.time() - t0:.0f} s",
              flush=True)
        save()
    import kvbuffer_fast.speculative as spec

    batches = [int(b) for b in args.batches.split(",") if b]
    if args.cpu_smoke:
        batches = [2]
    result["launch"] = dict(verify=dict(spec._CONFIG["verify"]), accept=dict(spec._CONFIG["accept"]),
                            baseline=cfg_b or "default")
    result["batches"] = time_batches(batches, cfg_v, cfg_b)
    save()
    result["draft_sweep"] = draft_sweep(2 if args.cpu_smoke else 128, cfg_v, cfg_b)
    save()
    if DEVICE == "cuda":
        result["memory"] = memory_check([64, 256]) + memory_check([64], d=4)
    result["seconds"] = round(time.time() - t0, 1)
    save()
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  fla {result['fla']}  "
          f"{result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
