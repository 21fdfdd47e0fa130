"""Reduced-precision state and u-cache on the GPU: decode time and error growth, in one run.

    python3 scripts/gpu_lowp.py [--out PATH] [--batches 64,128,256,512] [--layers 4] [--steps 4096] [--smoke]
    python3 scripts/gpu_lowp.py --sweep [--candidates NAME,...] [--storages state,state+u] [--budget-s 150]
                                [--check-all] [--smoke]

``--sweep`` replaces (a) and (b) by the choice of the 16-bit storages' launch: (a) for each launch of
``CANDIDATES`` (``sweep``; default output ``bench/results/lowp/gpu_lowp_sweep.json``), a table of the
times and the fastest correct launch per storage and batch.

(a) **Decode time** per token and layer of ``kvbuffer_fast.buffered_decode`` at Qwen3-Next heads
    (H = 16, HV = 32, K = V = 128), C = 16, bf16 q/k/v and cached keys, for four storages: fp32 state
    and u-cache (today's default), bf16 state, bf16 u-cache, both bf16 (G is always fp32).  As
    ``bench/gpu.py`` times decode: ``--layers`` layers of distinct states and buffers run in turn, a
    whole cycle of C steps from full buffers (the fold included) captured in one CUDA graph, its replay
    timed by ``triton.testing.do_bench`` with the L2 cleared before each replay (``bench.gpu.device_ms``),
    divided by C x layers.  Each row gives the ratio to the fp32 storage at the same batch and to the
    read-once floor: the bytes a step must move (below) at the copy bandwidth measured in the same run
    (``bench.gpu.copy_bandwidth``).  Before it is timed, every storage is checked: one eager cycle of
    4 requests of layer 0 against the float64 oracle that rounds where the kernels store
    (``kvbuffer_ref`` on a buffer whose 16-bit fields keep their dtype), outputs by ``compare`` with the
    reference's same calls in float32 on the same storage as the baseline, stored 16-bit states within one
    ulp of the oracle's (float32 states by ``compare`` too); a failing storage
    is reported and not timed.
(b) **Error growth**: B = 4 requests, fp32 q/k/v, decoded for ``--steps`` tokens from an empty buffer;
    the relative RMS error of the outputs (over requests, heads and columns) at steps 1, 2, 4, ...,
    ``--steps`` against the float64 recurrence on the GPU, for the plain fp32 recurrence
    (``kvbuffer_fast.baselines.recurrent_decode``), the recurrence with its state rounded to bf16 after
    every token (what an engine with a bf16 recurrent cache computes), and ours with each storage of
    (a).  Also the state's error at the last step.  A table, and a plot (matplotlib; skipped if missing).

Bytes per decode step and layer (the read-once floor's numerator), per request, averaged over a cycle
of C steps from a full buffer: ``|S| (1 + 1/C) + E ((C + 1) / 2 + 1)`` with ``|S| = HV K V s`` (s = 4
for fp32, 2 for bf16) and ``E = H K 2 + HV V u + HV 4`` (the entry: bf16 key, u in u bytes, fp32 G).

Prints one JSON object (device, versions, copy bandwidth, results) and writes it to ``--out`` (default
``bench/results/lowp/gpu_lowp.json``; the plot beside it).  ``--smoke`` runs tiny shapes on the CPU
under the Triton interpreter with float16 in place of bfloat16 (the interpreter's bfloat16 is wrong):
it proves the script and its checks, and measures nothing.  The default run takes about a minute on an
H200.
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

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from bench.gpu import copy_bandwidth, device_ms, versions  # noqa: E402
from kvbuffer_fast.baselines import recurrent_decode  # noqa: E402
from kvbuffer_ref.buffer import KVBuffer  # noqa: E402
from kvbuffer.validate import compare
from kvbuffer.validate.tolerances import tolerance_for  # noqa: E402

F32 = torch.float32


@dataclasses.dataclass(frozen=True)
class Plan:
    H: int
    HV: int
    K: int
    V: int
    C: int
    batches: tuple
    layers: int
    steps: int
    error_batch: int
    low: torch.dtype       # the 16-bit storage dtype (bf16; fp16 in the smoke run)
    token_dtype: torch.dtype
    device: str


def storages(low: torch.dtype) -> dict:
    """name -> (state dtype, u dtype)."""
    n = "bf16" if low == torch.bfloat16 else "fp16"
    return {"fp32": (F32, F32), f"{n}-state": (low, F32), f"{n}-u": (F32, low), f"{n}-state+u": (low, low)}


def step_bytes(p: Plan, state_dtype, u_dtype) -> float:
    """Bytes per request, step and layer averaged over a cycle (the module docstring's formula)."""
    s, u = torch.finfo(state_dtype).bits // 8, torch.finfo(u_dtype).bits // 8
    S = p.HV * p.K * p.V * s
    E = p.H * p.K * 2 + p.HV * p.V * u + p.HV * 4
    return S * (1 + 1 / p.C) + E * ((p.C + 1) / 2 + 1)


def tokens(p: Plan, B: int, T: int, gen: torch.Generator, dtype) -> dict:
    """Unit q and k, v ~ N(0, 1), gates in [-0.1, 0] (a memory of tens of tokens), betas in [0, 1]."""
    q = torch.nn.functional.normalize(torch.randn(B, T, p.H, p.K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, p.H, p.K, generator=gen), dim=-1)
    v = torch.randn(B, T, p.HV, p.V, generator=gen)
    g = -0.1 * torch.rand(B, T, p.HV, generator=gen)
    beta = torch.rand(B, T, p.HV, generator=gen)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta)
    return {n: t.to(p.device) for n, t in x.items()}


def full_buffer(p: Plan, B: int, state_dtype, u_dtype, gen: torch.Generator) -> KVBuffer:
    """A buffer of B requests, each with a state and C entries (full: the next step folds); drawn on
    ``gen``'s device (the sweep draws on the GPU: its buffers are gigabytes)."""
    buf = KVBuffer.empty(B, p.H, p.HV, p.K, p.V, p.C, dtype=u_dtype, gate_dtype=F32, key_dtype=p.token_dtype,
                         state_dtype=state_dtype, device=p.device)
    r = dict(generator=gen, device=gen.device)
    k = torch.nn.functional.normalize(torch.randn(B, p.C, p.H, p.K, **r), dim=-1)
    G = (-0.1 * torch.rand(B, p.C, p.HV, **r)).cumsum(1)
    buf.k.copy_(k)
    buf.u.copy_(0.3 * torch.randn(B, p.C, p.HV, p.V, **r))
    buf.G.copy_(G)
    buf.state.copy_(0.05 * torch.randn(B, p.HV, p.K, p.V, **r))
    buf.lengths.fill_(p.C)
    buf.has_state.fill_(True)
    return buf


def oracle_copy(buf: KVBuffer, wide) -> KVBuffer:
    """The reference's copy: 16-bit fields keep their dtype (rounded where the reference writes them),
    the others in ``wide`` (float64: the oracle; float32: the baseline)."""
    def cv(x):
        if x is None or not x.dtype.is_floating_point:
            return None if x is None else x.clone()
        return x.clone() if torch.finfo(x.dtype).bits == 16 else x.to(wide)
    return KVBuffer(**{n: cv(x) for n, x in buf.tensors().items()})


def check_storage(p: Plan, buf: KVBuffer, x: dict, config=None) -> dict:
    """One eager cycle of C steps on a copy of ``buf`` (all B requests: the launch the timing runs, with
    ``config``, None for the launch table's), its first min(4, B) requests against the float64 oracle
    that rounds where the kernels store: the outputs by ``compare`` (the float32 reference's same calls on
    the same storage as the baseline: the own form), the final stored states within one ulp of
    the oracle's, on at most 5 % apart."""
    n = min(4, buf.batch)
    mine = KVBuffer(**buf.cloned())
    sub = KVBuffer(**{f: None if t is None else t[:n].clone() for f, t in buf.tensors().items()})
    r64, r32 = oracle_copy(sub, torch.float64), oracle_copy(sub, F32)
    for t in range(p.C):
        xt = {k: v[:, t:t + 1] for k, v in x.items()}
        o, mine = fast.buffered_decode(**xt, buffer=mine, config=config)
        xn = {k: v[:n] for k, v in xt.items()}
        o64, r64 = ref.buffered_decode(**{k: v.double() for k, v in xn.items()}, buffer=r64)
        o32, r32 = ref.buffered_decode(**{k: v.float() for k, v in xn.items()}, buffer=r32)
        # the baseline: the reference's same calls in float32 on the same 16-bit storage (the own form)
        c = compare(o[:n].cpu(), o64.cpu(), o32.to(o.dtype).cpu(), name=f"decode step {t}.o")
        if not c.passed:
            return dict(passed=False, what=str(c))
    got, want = mine.state[:n], r64.state
    a, w = got.double(), want.double()
    if torch.finfo(got.dtype).bits == 16:
        inf = torch.tensor(float("inf"), dtype=want.dtype, device=want.device)
        ulp = (torch.nextafter(want.abs(), inf) - want.abs()).double()
        # plus the fp32 rounding of the sums behind each element (the table's fp32 floor x eps at the
        # slice's scale): an element that came out small by cancellation has an ulp below that
        slack = tolerance_for(F32).floor * torch.finfo(F32).eps * w.pow(2).mean(dim=(-1, -2), keepdim=True).sqrt()
        far = int(((a - w).abs() > ulp * 1.0001 + slack).sum())
        apart = float(((a - w).abs() > 0).double().mean())
        if far or apart > 0.05:
            return dict(passed=False, what=f"state: {far} elements more than one ulp from the oracle's rounding, "
                                           f"{apart:.2%} apart")
    else:
        owned = r64.has_state.cpu()
        c = compare(got.cpu()[owned], want.cpu()[owned], r32.state.cpu()[owned], name="state", head_axis=1)
        if not c.passed:
            return dict(passed=False, what=str(c))
    return dict(passed=True, what=f"{p.C} steps of B = {buf.batch}, requests 0..{n - 1} against the float64 "
                                  f"oracle (the float32 reference on the same storage as the baseline)")


def time_decode(p: Plan, copy: dict, log) -> list:
    rows = []
    for B in p.batches:
        base = None
        for name, (sd, ud) in storages(p.low).items():
            gen = torch.Generator().manual_seed(B)
            row = dict(B=B, storage=name, state_dtype=str(sd).replace("torch.", ""),
                       u_dtype=str(ud).replace("torch.", ""))
            try:
                bufs = [full_buffer(p, B, sd, ud, gen) for _ in range(p.layers)]
                xs = [tokens(p, B, p.C, gen, p.token_dtype) for _ in range(p.layers)]
                chk = check_storage(p, bufs[0], xs[0])
                row["check"] = chk
                if not chk["passed"]:
                    log(f"B={B} {name}: WRONG, not timed: {chk['what']}")
                    rows.append(row)
                    continue
                steps = [[{k: v[:, t:t + 1].contiguous() for k, v in x.items()} for t in range(p.C)] for x in xs]

                def run():
                    for t in range(p.C):
                        for layer in range(p.layers):
                            fast.buffered_decode(**steps[layer][t], buffer=bufs[layer])
                ms, method = device_ms(run, p.device == "cpu")
                us = ms * 1e3 / (p.C * p.layers)
                nbytes = B * step_bytes(p, sd, ud)
                floor = nbytes / (copy["TBps"] * 1e12) * 1e6
                row.update(us_per_token_layer=us, bytes_per_step=nbytes, floor_us=floor, over_floor=us / floor,
                           method=method)
                if name == "fp32":
                    base = us
                row["vs_fp32"] = None if base is None else us / base
                log(f"B={B} {name}: {us:.2f} us/token/layer, {us / floor:.3f}x floor"
                    + ("" if base is None else f", {us / base:.3f}x fp32"))
            except Exception as e:  # noqa: BLE001 - a failing storage is reported, the rest still run
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc(limit=6)
                log(f"B={B} {name}: ERROR {row['error']}")
            finally:
                bufs = xs = steps = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows


#: The sweep's launches of the decode step for a 16-bit state: name -> DecodeConfig fields set on top of
#: the launch table's choice (``config_for("decode", key)``, keyed on the storage's state dtype: ``[32, 128]``
#: blocks for a 16-bit state on sm_90, ``[32, 64]`` for a float32 one); the candidates put more bytes in
#: flight per SM (more blocks pipelined, larger blocks, wider tiles).
CANDIDATES: dict[str, dict] = {
    "table": {},
    "NS=2": dict(NS=2),
    "KB=64": dict(KB=64),
    "KB=64 w4": dict(KB=64, num_warps=4),
    "KB=128 w4": dict(KB=128, num_warps=4),
    "BV=128 w4": dict(BV=128, num_warps=4),
    "NS=3": dict(NS=3),
    "KB=128 w8": dict(KB=128, num_warps=8),
    "BV=128 w4 NS=2": dict(BV=128, num_warps=4, NS=2),
    "fold_NS=3": dict(fold_NS=3),
    "fold_KB=64": dict(fold_KB=64),
}
#: What each candidate is for (printed beside it in the JSON).
WHY = {
    "table": "the launch table's choice for the storage's state dtype",
    "NS=2": "two [32, 64] state blocks in flight per program (the loop software-pipelined through shared memory)",
    "NS=3": "three blocks in flight per program",
    "KB=64": "[64, 64] bf16 blocks: the fp32 launch's 8 KB per round trip, two round trips per program",
    "KB=64 w4": "the same on 4 warps (the fp32 launch's registers per thread)",
    "KB=128 w4": "the whole [128, 64] tile in one round trip, 4 warps",
    "KB=128 w8": "the whole tile in one round trip, 8 warps",
    "BV=128 w4": "[32, 128] blocks (8 KB), half the programs: the per-program key scores amortised over 2x columns",
    "BV=128 w4 NS=2": "the same with two blocks in flight",
    "fold_NS=3": "the fold launch (1/C of the steps, ~15 % of the cycle) with three blocks in flight",
    "fold_KB=64": "the fold launch on [64, 64] blocks",
}


def sweep(p: Plan, copy: dict, names: list, storage_names: list, budget_s: float, check_all: bool, log) -> dict:
    """Decode time per token and layer of each candidate launch (``CANDIDATES``) for each 16-bit storage
    at each batch, beside the fp32 storage at the table's launch and the read-once floor, as
    ``time_decode`` times it (layers of distinct states in turn, a whole cycle in one CUDA graph, the L2
    cleared before each replay).  Each (candidate, storage) is checked against the float64 oracle first
    (``check_storage``, at the first batch; at every batch with ``check_all``): a wrong one is flagged
    and not timed.  Storage-major, then candidate, then batch, so that a run cut by ``budget_s``
    (seconds since the start of the sweep; what is left is marked skipped) has whole candidates."""
    from kvbuffer_fast.launch import config_for, key_of

    t0 = time.perf_counter()
    table = storages(p.low)
    runs = [("fp32", "table")] + [(st, c) for st in storage_names for c in names]
    rows = []
    base = {}
    for st in dict.fromkeys(r[0] for r in runs):  # one storage's buffers at every batch, then freed
        sd, ud = table[st]
        gen = torch.Generator(device=p.device).manual_seed(1)
        bufs = {B: [full_buffer(p, B, sd, ud, gen) for _ in range(p.layers)] for B in p.batches}
        xs = {B: [tokens(p, B, p.C, torch.Generator().manual_seed(B + 10 * i), p.token_dtype)
                  for i in range(p.layers)] for B in p.batches}
        for name in [c for s_, c in runs if s_ == st]:
            bad = None
            for i, B in enumerate(p.batches):
                row = dict(storage=st, candidate=name, set=CANDIDATES[name], B=B)
                rows.append(row)
                if time.perf_counter() - t0 > budget_s:
                    row["skipped"] = f"past the sweep's budget of {budget_s:.0f} s"
                    continue
                if bad is not None:
                    row["check"] = bad
                    continue
                try:
                    x0 = xs[B][0]
                    key = key_of(x0["q"], C=p.C, B=B, HV=p.HV, V=p.V, state=sd)
                    cfg = dataclasses.replace(config_for("decode", key), **CANDIDATES[name])
                    row["config"] = dataclasses.asdict(cfg)
                    if i == 0 or check_all:
                        row["check"] = check_storage(p, bufs[B][0], x0, cfg)
                        if not row["check"]["passed"]:
                            bad = row["check"]
                            log(f"{st} {name} B={B}: WRONG, not timed: {bad['what']}")
                            continue
                    steps = [[{k: v[:, t:t + 1].contiguous() for k, v in x.items()} for t in range(p.C)]
                             for x in xs[B]]
                    lb = bufs[B]

                    def run(steps=steps, lb=lb, cfg=cfg):
                        for t in range(p.C):
                            for layer in range(p.layers):
                                fast.buffered_decode(**steps[layer][t], buffer=lb[layer], config=cfg)
                    ms, method = device_ms(run, p.device == "cpu")
                    us = ms * 1e3 / (p.C * p.layers)
                    floor = B * step_bytes(p, sd, ud) / (copy["TBps"] * 1e12) * 1e6
                    if st == "fp32":
                        base[B] = us
                    row.update(us_per_token_layer=us, floor_us=floor, over_floor=us / floor, method=method,
                               vs_fp32=us / base[B] if B in base else None)
                    log(f"{st:>14} {name:<15} B={B:<4} {us:8.2f} us  {us / floor:.3f}x floor"
                        + (f"  {us / base[B]:.3f}x fp32" if B in base else ""))
                except Exception as e:  # noqa: BLE001 - a failing candidate is reported, the rest still run
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    row["traceback"] = traceback.format_exc(limit=4)
                    log(f"{st} {name} B={B}: ERROR {row['error']}")
        bufs = xs = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if "us_per_token_layer" in r and r["storage"] != "fp32":
            k = f"{r['storage']} B={r['B']}"
            if k not in best or r["us_per_token_layer"] < best[k]["us_per_token_layer"]:
                best[k] = dict(candidate=r["candidate"], set=r["set"], us_per_token_layer=r["us_per_token_layer"],
                               vs_fp32=r["vs_fp32"], over_floor=r["over_floor"])
    return dict(candidates={n: dict(set=CANDIDATES[n], why=WHY.get(n, "")) for n in names}, rows=rows, best=best,
                seconds=time.perf_counter() - t0)


def sweep_table(res: dict, batches) -> str:
    """One line per (storage, candidate): per batch µs, x floor, x fp32; WRONG / ERROR / skipped."""
    cells = {}
    for r in res["rows"]:
        if "us_per_token_layer" in r:
            c = f"{r['us_per_token_layer']:.1f} ({r['over_floor']:.2f}f" + (
                f", {r['vs_fp32']:.3f}x)" if r.get("vs_fp32") is not None else ")")
        elif r.get("check") and not r["check"].get("passed", True):
            c = "WRONG"
        elif "error" in r:
            c = "ERROR"
        else:
            c = "skipped"
        cells.setdefault((r["storage"], r["candidate"]), {})[r["B"]] = c
    lines = ["| storage | launch | " + " | ".join(f"B = {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for (st, name), by_b in cells.items():
        lines.append(f"| {st} | {name} | " + " | ".join(by_b.get(b, "") for b in batches) + " |")
    lines.append("(µs per token and layer; f: x the read-once floor; x fp32: against the fp32 storage's table "
                 "launch at the same batch)")
    for k, b in res["best"].items():
        lines.append(f"best {k}: {b['candidate']} {b['us_per_token_layer']:.1f} us, {b['vs_fp32']:.3f}x fp32, "
                     f"{b['over_floor']:.2f}x floor")
    return "\n".join(lines)


def error_growth(p: Plan, log) -> dict:
    """Relative RMS error of the outputs at steps 1, 2, 4, ... against the float64 recurrence."""
    B, T = p.error_batch, p.steps
    gen = torch.Generator().manual_seed(7)
    x = tokens(p, B, T, gen, F32)
    o64, S64 = ref.recurrent_gated_delta_rule(**{k: v.double() for k, v in x.items()}, output_final_state=True)
    checkpoints = [2 ** i for i in range(int(math.log2(T)) + 1)]
    if checkpoints[-1] != T:
        checkpoints.append(T)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    def curve(step_fn, final_state):
        out = {}
        for t in range(T):
            o = step_fn(t)
            if t + 1 in checkpoints:
                out[t + 1] = rel(o, o64[:, t:t + 1])
        return dict(o=out, state_at_end=rel(final_state(), S64))

    res = {}
    lowname = "bf16" if p.low == torch.bfloat16 else "fp16"
    for name, rounding in (("fp32 recurrence", None), (f"{lowname}-state recurrence (rounded every token)", p.low)):
        S = torch.zeros(B, p.HV, p.K, p.V, dtype=F32, device=p.device)

        def step(t, S=S, rounding=rounding):
            o = recurrent_decode(**{k: v[:, t:t + 1] for k, v in x.items()}, state=S)
            if rounding is not None:
                S.copy_(S.to(rounding).float())
            return o
        t0 = time.perf_counter()
        res[name] = curve(step, lambda S=S: S)
        log(f"error growth {name}: o at {T} steps {res[name]['o'][T]:.3e} ({time.perf_counter() - t0:.1f} s)")
    for name, (sd, ud) in storages(p.low).items():
        buf = KVBuffer.empty(B, p.H, p.HV, p.K, p.V, p.C, dtype=ud, gate_dtype=F32, key_dtype=F32, state_dtype=sd,
                             device=p.device)
        box = [buf]

        def step(t, box=box):
            o, box[0] = fast.buffered_decode(**{k: v[:, t:t + 1] for k, v in x.items()}, buffer=box[0])
            return o
        t0 = time.perf_counter()
        res[f"ours {name}"] = curve(step, lambda box=box: fast.materialize_state(box[0]))
        log(f"error growth ours {name}: o at {T} steps {res[f'ours {name}']['o'][T]:.3e} "
            f"({time.perf_counter() - t0:.1f} s)")
    return dict(B=B, steps=checkpoints, inputs="fp32 q/k/v (unit q, k), v ~ N(0,1), g in [-0.1, 0], beta in [0, 1]",
                curves=res)


def plot(errors: dict, path: Path, log) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"no plot: matplotlib unavailable ({type(e).__name__})")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in errors["curves"].items():
        steps = sorted(c["o"])
        ax.loglog(steps, [max(c["o"][s], 1e-12) for s in steps], marker="o", ms=3, label=name)
    ax.set_xlabel("decode steps")
    ax.set_ylabel("relative RMS error of o_t vs float64")
    ax.set_title(f"error growth, B = {errors['B']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def table(errors: dict) -> str:
    names = list(errors["curves"])
    lines = ["| steps | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for s in errors["steps"]:
        lines.append(f"| {s} | " + " | ".join(f"{errors['curves'][n]['o'][s]:.2e}" for n in names) + " |")
    lines.append("| state at end | " + " | ".join(f"{errors['curves'][n]['state_at_end']:.2e}" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lowp" / "gpu_lowp.json"))
    ap.add_argument("--batches", default="64,128,256,512")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, fp16 for bf16")
    ap.add_argument("--sweep", action="store_true",
                    help="time the 16-bit storages under each candidate launch (CANDIDATES) instead of (a) and (b)")
    ap.add_argument("--candidates", help="comma list of CANDIDATES names for --sweep (default: all, in order)")
    ap.add_argument("--storages", default="state,state+u",
                    help="--sweep: the 16-bit storages, of state, u, state+u (default state,state+u)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="--sweep: no new timing starts after this many seconds of sweeping (default 150)")
    ap.add_argument("--check-all", action="store_true", help="--sweep: check every batch, not only the first")
    a = ap.parse_args(argv)
    if a.smoke:
        p = Plan(H=1, HV=2, K=16, V=16, C=4, batches=(2,), layers=2, steps=min(a.steps, 32), error_batch=2,
                 low=torch.float16, token_dtype=torch.float16, device="cpu")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
            return 2
        p = Plan(H=16, HV=32, K=128, V=128, C=16, batches=tuple(int(b) for b in a.batches.split(",")),
                 layers=a.layers, steps=a.steps, error_batch=4, low=torch.bfloat16, token_dtype=torch.bfloat16,
                 device="cuda")
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    out = Path(a.out)
    if a.sweep and a.out == ap.get_default("out"):
        out = out.with_name("gpu_lowp_sweep.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(script="scripts/gpu_lowp.py", smoke=a.smoke, versions=versions(),
                  plan={k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                        for k, v in dataclasses.asdict(p).items()})
    result["copy_bandwidth"] = copy_bandwidth(p.device, a.smoke)
    log(f"copy bandwidth {result['copy_bandwidth']['TBps']:.3f} TB/s")
    if a.sweep:
        names = [n.strip() for n in a.candidates.split(",")] if a.candidates else list(CANDIDATES)
        unknown = [n for n in names if n not in CANDIDATES]
        if unknown:
            print(f"--candidates: unknown {unknown}; known: {list(CANDIDATES)}", file=sys.stderr)
            return 2
        low = "bf16" if p.low == torch.bfloat16 else "fp16"
        sts = [f"{low}-{x.strip()}" for x in a.storages.split(",")]
        if any(x not in storages(p.low) for x in sts):
            print(f"--storages: expected state, u or state+u, got {a.storages!r}", file=sys.stderr)
            return 2
        res = sweep(p, result["copy_bandwidth"], names, sts, a.budget_s, a.check_all, log)
        result["sweep"] = res
        result["sweep_table"] = sweep_table(res, p.batches)
        bad = [r for r in res["rows"] if "error" in r or not r.get("check", {}).get("passed", True)]
        result["ok"] = not bad
        result["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps(result, default=str))
        log("\n" + result["sweep_table"])
        log(f"wrote {out}")
        return 0 if result["ok"] else 1
    result["decode"] = time_decode(p, result["copy_bandwidth"], log)
    try:
        errors = error_growth(p, log)
        result["error_growth"] = errors
        result["error_table"] = table(errors)
        result["plot"] = plot(errors, out.with_suffix(".png"), log)
    except Exception as e:  # noqa: BLE001
        result["error_growth"] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
        log(f"error growth FAILED: {result['error_growth']['error']}")
    wrong = [r for r in result["decode"] if not r.get("check", {}).get("passed", False)]
    result["ok"] = not wrong and "error" not in result["error_growth"]
    result["seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str))
    if "error_table" in result:
        log("\n" + result["error_table"])
    log(f"wrote {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
