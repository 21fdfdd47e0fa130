"""Where the decode / verify time goes, on the GPU: one run of small, separate measurements.

    python -m bench.gpu_probe --out probe.json [--B 128] [--skip floor,decode,verify] [--cpu-smoke]
    (on the device: PROBE_ARGS="--skip floor" bash scripts/gpu_check.sh OUT probe)

(a) the floor: a kernel that only reads a [K, BV] state tile per (request, value head) and forms
    S^T k and S^T q ("read"), as one register tile or streamed in KB-row blocks through a pipelined
    loop, for several launches; bytes = the state once (reads only);
(b) buffered_decode per launch in DECODE_VARIANTS (kernel variant, fold, bookkeeping, blocks), at a
    fixed buffer length n (lengths restored before every repetition) for n = 0, 8, 15 (no fold) and
    n = C (the fold step), and over a whole cycle of C steps from full buffers, with the registers,
    spills and shared memory of every kernel it compiled;
(c) verify of 5 tokens per launch in VERIFY_VARIANTS, and the time of each of its kernels (torch.profiler);
(d) recurrent_decode and fla at the same batch, in the same run.
Each variant is checked against the float64 oracle (compiled) before it is timed.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import triton
import triton.language as tl

import bench.gpu_decode as gd
from bench._meta import run_metadata, save_json
from bench.gpu_decode import (H, HV, K, V, copy_bandwidth, fla_fn, full_buffer, queued_ms, state_bytes, tokens,
                              entry_bytes, buffered_cycle_bytes)
from kvbuffer_fast._common import _program_ids


@triton.jit
def _read_tile(state_ptr, k_ptr, q_ptr, o_ptr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BV: tl.constexpr):
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    s = tl.load(state_ptr + (i_bhv * K + o_k[:, None]) * V + o_v[None, :])
    b_k = tl.load(k_ptr + (i_b * H + i_h) * K + o_k).to(tl.float32)
    b_q = tl.load(q_ptr + (i_b * H + i_h) * K + o_k).to(tl.float32)
    o = tl.sum(s * b_k[:, None], 0) + 0.5 * tl.sum(s * b_q[:, None], 0)
    tl.store(o_ptr + i_bhv * V + o_v, o)


@triton.jit
def _read_blocks(state_ptr, k_ptr, q_ptr, o_ptr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, NS: tl.constexpr):
    i_v, i_bhv, i_b, i_hv, i_h = _program_ids(H, HV)
    o_kb = tl.arange(0, KB)
    o_v = i_v * BV + tl.arange(0, BV)
    sk = tl.zeros([BV], dtype=tl.float32)
    sq = tl.zeros([BV], dtype=tl.float32)
    for k0 in tl.range(0, K, KB, num_stages=NS):
        s = tl.load(state_ptr + (i_bhv * K + k0 + o_kb[:, None]) * V + o_v[None, :])
        b_k = tl.load(k_ptr + (i_b * H + i_h) * K + k0 + o_kb).to(tl.float32)
        b_q = tl.load(q_ptr + (i_b * H + i_h) * K + k0 + o_kb).to(tl.float32)
        sk += tl.sum(s * b_k[:, None], 0)
        sq += tl.sum(s * b_q[:, None], 0)
    tl.store(o_ptr + i_bhv * V + o_v, sk + 0.5 * sq)


def floor(B, copy_TBps) -> list:
    x = tokens(B)
    state = torch.randn(B, HV, K, V, device=gd.DEVICE)
    o = torch.empty(B, HV, V, device=gd.DEVICE)
    want = (torch.einsum("bhkv,bhk->bhv", state, x["k"][:, 0].float().repeat_interleave(HV // H, 1))
            + 0.5 * torch.einsum("bhkv,bhk->bhv", state, x["q"][:, 0].float().repeat_interleave(HV // H, 1)))
    rows = []
    configs = [("tile", dict(BV=bv, num_warps=w)) for bv, w in ((64, 2), (64, 4), (32, 1), (32, 2), (128, 4), (128, 8))]
    configs += [("blocks", dict(BV=bv, KB=kb, NS=ns, num_warps=w)) for bv, kb, ns, w in
                ((64, 32, 1, 2), (64, 32, 2, 2), (64, 32, 3, 2), (64, 32, 4, 4), (64, 16, 4, 2), (128, 32, 3, 4),
                 (128, 16, 4, 4), (32, 32, 3, 1), (128, 32, 2, 8), (64, 64, 2, 4))]
    for kind, cfg in configs:
        def f():
            grid = (V // cfg["BV"], B * HV)
            if kind == "tile":
                _read_tile[grid](state, x["k"], x["q"], o, H=H, HV=HV, K=K, V=V, **cfg)
            else:
                _read_blocks[grid](state, x["k"], x["q"], o, H=H, HV=HV, K=K, V=V, **cfg)
        try:
            o.fill_(float("nan"))
            f()
            if gd.DEVICE == "cuda":
                torch.cuda.synchronize()
            err = float((o - want).abs().max() / want.abs().max())
            ms = queued_ms(f)
            nb = state_bytes(B)
            rows.append(dict(kind=kind, **cfg, us=ms * 1e3, rel_err=err, frac_copy=nb / ms / 1e9 / copy_TBps))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(kind=kind, **cfg, error=repr(e)[:300]))
        print("floor", rows[-1], flush=True)
    return rows


_LEAN = dict(variant="lean", fold="split", KB=32, NS=1)
_BEST = dict(_LEAN, BV=64, num_warps=2, loadn=True, keyn=True)
_GROUP = dict(kernel="group", BV=64, num_warps=2, FH=8, KB=32, NS=2)
_DEF = dict(_BEST, book="launch", fold_launch=dict(_GROUP, FH="auto"), pdl="late")
DECODE_VARIANTS = [
    dict(_DEF),  # the default (session 7: with the L2 eviction hints, evict="auto")
    dict(_DEF, book="snapshot"),  # two launches per step: the serving fold launch copies the lengths, the decode
    # launch (waiting for it at its start) appends the rows and advances the lengths
    dict(_DEF, evict=False),  # session 6's default: no eviction hints
]


def compiled_info(jitfns, before=None) -> tuple[list, set]:
    """Registers / spills / shared memory of every kernel of ``jitfns`` compiled so far (those not in
    ``before``), and the set of cache keys now."""
    rows, keys = [], set()
    if gd.DEVICE == "cpu":  # the interpreter compiles nothing
        return rows, keys
    for fn in jitfns:
        try:
            for dev, entry in fn.device_caches.items():
                cache = entry[0]
                for key, kern in cache.items():
                    tag = (fn.__name__, str(key))
                    keys.add(tag)
                    if before is not None and tag in before:
                        continue
                    try:
                        kern._init_handles()
                    except Exception:  # noqa: BLE001
                        pass
                    rows.append(dict(kernel=fn.__name__, n_regs=getattr(kern, "n_regs", None),
                                     n_spills=getattr(kern, "n_spills", None),
                                     shared=getattr(kern.metadata, "shared", None),
                                     num_warps=getattr(kern.metadata, "num_warps", None)))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(kernel=getattr(fn, "__name__", "?"), error=repr(e)[:200]))
    return rows, keys


def decode_kernels() -> list:
    """The Triton kernels buffered_decode may launch (their compiled resources are recorded)."""
    import kvbuffer_fast.decode as dec

    return [dec._decode_kernel, dec._decode_lean_kernel, dec._book_kernel, dec._fold_full_kernel,
            dec._fold_group_kernel]


def verify_kernels() -> list:
    """The Triton kernels verify may launch."""
    import kvbuffer_fast.speculative as spec

    return [spec._verify_prep_kernel, spec._verify_prep_group_kernel, spec._verify_stream_kernel,
            spec._verify_fused_kernel]


def decode_ok(cfg) -> tuple[bool, str]:
    from bench.gpu_decode import _decode_config_ok

    return _decode_config_ok(cfg)


def decode_rows(B, copy_TBps, fla_us, Cs=(16,)) -> list:
    import kvbuffer_fast as fast


    x = tokens(B)
    rows = []
    import kvbuffer_fast._common as common

    kernels = decode_kernels()
    fold_default = dict(common._CONFIG["fold_full"])
    for cfg in DECODE_VARIANTS:
        cfg = dict(cfg)
        fold_cfg = dict(fold_default)
        if "fold_BV" in cfg:
            fold_cfg = dict(BV=cfg.pop("fold_BV"), num_warps=cfg.pop("fold_warps"))
        common._CONFIG["fold_full"] = fold_cfg
        _, seen = compiled_info(kernels)
        try:
            ok, why = decode_ok(cfg)
        except Exception as e:  # noqa: BLE001
            ok, why = False, repr(e)[:300]
        for C in Cs:
            row = dict(cfg, C=C, check=ok, why=why, fold_full=fold_cfg)
            if not ok:
                rows.append(row)
                print("decode", row, flush=True)
                continue
            buf = full_buffer(B, C)
            snap = (buf.k.clone(), buf.u.clone(), buf.G.clone(), buf.state.clone())

            def reset(n):
                buf.k.copy_(snap[0]); buf.u.copy_(snap[1]); buf.G.copy_(snap[2]); buf.state.copy_(snap[3])
                buf.lengths.fill_(n); buf.has_state.fill_(True)

            def step():
                fast.buffered_decode(**x, buffer=buf, validate=False, **cfg)

            for n in (0, C // 2, C - 1, C):
                row[f"n{n}_us"] = queued_ms(step, reps=9, setup=lambda n=n: reset(n)) * 1e3
            reset(C // 2)  # GPU time per kernel of a plain step (5 steps from C/2: no fold)
            row["kernels_plain_us"] = kernel_split(step, reps=4)
            row["compiled"] = compiled_info(kernels, seen)[0]

            def cycle():
                for _ in range(C):
                    step()

            row["cycle_step_us"] = queued_ms(cycle, reps=7, setup=lambda: reset(C)) / C * 1e3
            nb = buffered_cycle_bytes(B, C) / C
            row["frac_copy"] = nb / (row["cycle_step_us"] * 1e-3) / 1e9 / copy_TBps
            row["nonfold_frac_read"] = (state_bytes(B) + entry_bytes(B) * (C // 2 + 1)) / (row[f"n{C // 2}_us"] * 1e-3) / 1e9 / copy_TBps
            if fla_us:
                row["vs_fla"] = row["cycle_step_us"] / fla_us
            rows.append(row)
            print("decode", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del buf, snap
            torch.cuda.empty_cache()
    common._CONFIG["fold_full"] = fold_default
    return rows


_STREAM = dict(variant="stream", BV=128, KB=32, NS=3, num_warps=4, precision="tf32x3", prep_precision="tf32x3",
               zp=True, pdl=True, prep_group=True, prep_maxnreg=128, prep_hoist=True, prep_mma=True)
_X2 = dict(_STREAM, xprec="tf32x2", early=True)  # the default for bf16 / fp16 rows at B >= 128 since session 7
_AUTO = dict(_STREAM, KB="auto", NS="auto", xprec="auto", early="auto")  # the default (session 7)
VERIFY_VARIANTS = [
    dict(_AUTO),
    dict(_AUTO, early=False),
    dict(_AUTO, KB=32, NS=3),
    dict(_AUTO, KB=32, NS=3, early=False),
    dict(_STREAM, xprec="tf32x3"),  # session 6's default
]


def kernel_split(fn, reps=10) -> dict:
    """GPU time per kernel name (µs per call of fn), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    if gd.DEVICE == "cpu":
        return {}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if t and ev.count:
            out[ev.key[:60]] = t / reps
    return out


def verify_check_bf16() -> bool:
    """The launch now set, on bf16 inputs (the timed dtype), trees, Qwen3-Next heads, against float64."""
    import bench.gpu_verify as gv
    from kvbuffer_ref.testing import Case
    from kvbuffer_ref.testing import properties as P

    if gd.DEVICE == "cpu":
        return True
    case = Case(B=2, T=6 + 5 + 1, H=H, HV=HV, K=K, V=V, gate="mild", beta="uniform", seed=4)
    res = P.check_verify_accept(gv.impl_with(None), case, torch.bfloat16, capacity=16, history=6, lengths=[6, 3],
                                parents=[[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]], num_drafts=[5, 4], nodes=[3, 3],
                                after=1, device=gd.DEVICE, use_counts=False)
    for c in res:
        if not c.passed:
            print("   !! bf16 " + str(c), flush=True)
    return all(c.passed for c in res)


def verify_rows(B, copy_TBps, fla5_us) -> list:
    import bench.gpu_verify as gv
    import kvbuffer_fast.speculative as spec

    rows = []
    D = 5
    x = gv.tokens(B, D)
    buf = gv.buffer_with(B, n=gv.N_BUF)
    kernels = verify_kernels()
    for cfg in VERIFY_VARIANTS:
        row = dict(cfg)
        _, seen = compiled_info(kernels)
        old = spec.set_launch("verify", **cfg)
        try:
            # an explicit xprec split needs 16-bit rows (a ValueError in fp32): checked in bf16 only
            row["check"] = gv.candidate_check() if cfg.get("xprec", "auto") == "auto" else verify_check_bf16()
            if True:  # timed even when the fp32 check fails (plain tf32 is expected to)
                f = gv.verify_fn(x, buf)
                row["us"] = gv.bench_ms(f) * 1e3
                row["kernels_us"] = kernel_split(f)
                if fla5_us:
                    row["vs_fla5"] = row["us"] / fla5_us
            row["compiled"] = compiled_info(kernels, seen)[0]
            row["check_bf16"] = verify_check_bf16()
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        finally:
            spec.set_launch("verify", **old)
        rows.append(row)
        print("verify", row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--skip", default="")
    ap.add_argument("--cpu-smoke", action="store_true", help="interpreter, B=1: only that the script runs")
    ap.add_argument("--verify-buffer", default="", metavar="C,N",
                    help="verify over buffers of capacity C holding N entries (bench.gpu_verify's 16,8 otherwise)")
    a = ap.parse_args(argv)
    if a.verify_buffer:
        import bench.gpu_verify as gv

        gv.C, gv.N_BUF = (int(x) for x in a.verify_buffer.split(","))
    if a.cpu_smoke:
        import os

        import bench.gpu_verify as gv

        os.environ["TRITON_INTERPRET"] = "1"
        gd.DEVICE = gv.DEVICE = "cpu"
        a.B = 1
        del DECODE_VARIANTS[2:], VERIFY_VARIANTS[2:]
    res = run_metadata(gd.DEVICE, B=a.B, shapes=dict(H=H, HV=HV, K=K, V=V))
    import bench.gpu_verify as gv

    res["verify_buffer"] = dict(C=gv.C, n=gv.N_BUF)
    res["copy"] = copy_bandwidth()
    bw = res["copy"]["queued_TBps"]
    print("copy", res["copy"], flush=True)
    x = tokens(a.B)
    st = 0.1 * torch.randn(a.B, HV, K, V, device=gd.DEVICE)
    import kvbuffer_fast as fast

    res["recurrent_us"] = queued_ms(lambda: fast.recurrent_decode(**x, state=st)) * 1e3
    try:
        res["fla_us"] = queued_ms(fla_fn(x, st)) * 1e3
    except Exception as e:  # noqa: BLE001
        res["fla_us"] = None
        res["fla_error"] = repr(e)
    print("recurrent", res["recurrent_us"], "fla", res["fla_us"], flush=True)
    try:
        import bench.gpu_verify as gv

        x5 = gv.tokens(a.B, 5)
        res["fla5_us"] = gv.bench_ms(gv.fla_fn(x5, st)) * 1e3
    except Exception as e:  # noqa: BLE001
        res["fla5_us"] = None
        res["fla5_error"] = repr(e)
    del st
    failed = 0
    for name, fn in (("floor", lambda: floor(a.B, bw)),
                     ("decode", lambda: decode_rows(a.B, bw, res["fla_us"])),
                     ("verify", lambda: verify_rows(a.B, bw, res["fla5_us"]))):
        if name in a.skip.split(","):
            continue
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001
            failed += 1
            res[name + "_error"] = traceback.format_exc()
            print(res[name + "_error"], flush=True)
        save_json(a.out, res)
    save_json(a.out, res)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
