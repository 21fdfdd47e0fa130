"""The GPU runner: every benchmarked operation as a model runs it, in device time, in one call.

    python3 -m bench.gpu [--out DIR] [--before DIR] [--batches 64,128,256,512] [--layers 4]
                         [--ops OP,...] [--peer-path REPLAYSSM_CHECKOUT] [--sglang-path WHEEL_OR_DIR]
                         [--flashinfer-path DIR] [--set OP.FIELD=VALUE ...] [--smoke]

For each batch and each operation of ``bench/workloads.py`` (a read of the state alone; decode over a
whole buffer cycle, the fold included; verify of d drafts; accept of m; a speculative round; with their
peers: the recurrent baseline, the per-draft-state baseline, fla's fused_recurrent and chunk kernels; the
serving pool ``kvbuffer_fast.pool.KVPool``; ReplaySSM's decode and speculative kernels from ``--peer-path``;
SGLang's packed decode from ``--sglang-path``, by default the checkout's ``.whl/sglang/``; FlashInfer's GDN
decode, MTP verify and round from ``--flashinfer-path``, by default the checkout's ``.fi-site/``), the runner

1. builds ``--layers`` layers of distinct states and buffers and compares layer 0's eager result,
   compiled, with the float64 oracle: a wrong result is recorded and not timed;
2. captures ``run()`` (the operation on every layer in model order) in a CUDA graph and times its
   replay with ``triton.testing.do_bench`` (the L2 cleared before every replay; the median), divided
   by the operations in it: device µs per operation and layer;
3. records the bytes the operation must move (``bench/io_model.py``), the read-once floor at the copy
   bandwidth measured in the same run, and the ratios to its peers at the same batch (every decode op's
   to ``read_state``, a kernel that only reads the states: the measured floor of a state read).

``--before DIR`` measures a second package root too: ``DIR`` holds an older ``kvbuffer_fast`` and
``kvbuffer_ref``, imported in a subprocess with ``PYTHONPATH=DIR`` and driven through its own API,
so before/after ratios come from one run on one machine.  ``--set decode.fold_FH=4`` times another
launch (``config=dataclasses.replace(config_for(op, key), ...)`` per call; nothing is written into
the package).  ``--smoke`` runs the same code on a CPU under the Triton interpreter (tiny shapes,
wall-clock, no graphs): it proves the runner, its checks and the report, and measures nothing.

Writes ``DIR/gpu.json`` (device, versions, the plan, the copy bandwidth, every row) and
``DIR/report.md`` (``bench/report.py``), and prints the JSON's path last.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench import io_model as io
from bench import report
from bench import workloads as W
from bench.timing import copy_bandwidth, device_ms

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "latest"
TIME_BUDGET_S = 420.0  # the whole run (both package roots) must fit one device call


# ----------------------------------------------------------------------------- one package root
def versions() -> dict:
    """Device, torch, triton, fla and python versions of this process."""
    import triton  # here: under --smoke the interpreter is chosen before triton is imported

    info = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(sm_count=p.multi_processor_count, memory_GiB=round(p.total_memory / 2 ** 30, 1),
                    cuda=torch.version.cuda)
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - fla is optional: its rows say why they are missing
        info["fla"] = f"unavailable ({type(e).__name__})"
    return info


def sources_digest(root: Path) -> str:
    """sha256 over the .py files of kvbuffer_fast and kvbuffer_ref under ``root`` (sorted paths): which
    code a tree's rows measured, also where a copied working tree's git HEAD is stale."""

    h = hashlib.sha256()
    for path in sorted(p for pkg in ("kvbuffer_fast", "kvbuffer_ref") for p in (root / pkg).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _row(case, ms: float, method: str, copy: dict) -> dict:

    us = ms * 1e3 / case.count
    floor = io.floor_us(case.io_bytes, copy["TBps"])
    return dict(op=case.op, group=case.group, B=case.B, **case.info, device_us=us, method=method,
                ops_per_replay=case.count, io_bytes=case.io_bytes, TBps=case.io_bytes / (us * 1e-6) / 1e12,
                floor_us=floor, vs_floor=us / floor, checks=[{k: v for k, v in c.items() if k != "text"}
                                                            for c in case.checks], note=case.note)


def measure(plan, overrides: dict, smoke: bool, deadline: float, ops=None, peer_path=None,
            sglang_path=None, flashinfer_path=None) -> dict:
    """Every case of ``plan`` against the kvbuffer_fast on ``sys.path``: rows, skips, failures.  A peer's
    case (ReplaySSM's kernels from ``peer_path``, SGLang's from ``sglang_path``) is timed even where its
    error is past the budget: its row carries the comparisons and ``within_budget: false``."""
    import kvbuffer_fast  # here: under --smoke the interpreter is chosen before triton is imported

    device = "cpu" if smoke else "cuda"
    api = W.Api(overrides, peer_path=peer_path, sglang_path=sglang_path,
                **({} if flashinfer_path is None else dict(flashinfer_path=flashinfer_path)))
    package = Path(kvbuffer_fast.__file__).resolve().parent.parent
    out = dict(versions(), package=str(package), sources_sha256=sources_digest(package), rows=[],
               skips=[], failures=[])
    out["copy"] = copy_bandwidth(device, smoke)
    print(f"[{out['package']}] copy {out['copy']['TBps']:.3g} TB/s", flush=True)
    for B in plan.batches:
        wl = W.Workload(plan, B, device)
        for op in ops or W.OPS:
            tag = dict(op=op, B=B)
            if time.time() > deadline:
                out["skips"].append(dict(tag, reason="time budget of the run spent"))
                continue
            try:
                case = W.build(op, api, wl)
            except W.Skip as e:
                out["skips"].append(dict(tag, reason=str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
                out["failures"].append(dict(tag, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=4)))
                print(f"!! {op} B={B}: {type(e).__name__}: {e}", flush=True)
                continue
            if not case.passed and not (case.peer and case.checks):
                bad = [c["text"] for c in case.checks if not c["passed"]]
                out["failures"].append(dict(tag, error="wrong result, not timed: " + "; ".join(bad)))
                print(f"!! {op} B={B}: wrong result, not timed: {bad}", flush=True)
                continue
            try:
                ms, method = device_ms(case.run, smoke)
            except Exception as e:  # noqa: BLE001
                out["failures"].append(dict(tag, error=f"timing: {type(e).__name__}: {e}"))
                continue
            row = _row(case, ms, method, out["copy"])
            row["within_budget"] = case.passed
            out["rows"].append(row)
            print(f"{op:28s} B={B:4d} {row['device_us']:10.1f} us  {row['vs_floor']:.2f}x floor", flush=True)
            del case
            if not smoke:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- two package roots, one JSON
def ratios(rows: list) -> None:
    """Each row's time over its peers' at the same batch (``vs_<peer>``, same package root)."""

    by = {(r["op"], r["B"]): r for r in rows}
    for r in rows:
        for peer in W.PEERS.get(r["op"], ()):
            p = by.get((peer, r["B"]))
            if p:
                r[f"vs_{peer}"] = r["device_us"] / p["device_us"]


def before_after(after: list, before: list) -> list:
    """after / before device time of every (op, batch) both package roots measured."""
    old = {(r["op"], r["B"]): r for r in before}
    return [dict(op=r["op"], B=r["B"], before_us=old[(r["op"], r["B"])]["device_us"], after_us=r["device_us"],
                 ratio=r["device_us"] / old[(r["op"], r["B"])]["device_us"])
            for r in after if (r["op"], r["B"]) in old]


def git_commit() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return dict(commit=head.stdout.strip() or "unknown", dirty=bool(dirty.stdout.strip()))
    except Exception:  # noqa: BLE001 - no git on the machine
        return dict(commit="unknown", dirty=None)


def measure_before(root: Path, argv: list, timeout: float) -> dict:
    """The same measurements against the packages under ``root``, in a subprocess (PYTHONPATH=root)."""
    root = root.resolve()
    if not (root / "kvbuffer_fast" / "__init__.py").exists():
        raise SystemExit(f"--before {root}: no kvbuffer_fast package there")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "before.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "bench.gpu", "--worker", str(path), "--package-root", str(root), *argv]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if not path.exists():
            return dict(package=str(root), rows=[], skips=[], failures=[dict(op="*", B=0, error=f"worker exit {rc}")])
        return json.loads(path.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for gpu.json and report.md")
    ap.add_argument("--before", metavar="DIR", help="an older package root to measure in the same run")
    ap.add_argument("--batches", help="comma list (default: the plan's, 64,128,256,512 on the GPU)")
    ap.add_argument("--layers", type=int, help="layers of distinct states (default 4)")
    ap.add_argument("--fill", type=int, help="entries buffered when verify / accept run (default 8; with the "
                    "default 3 accepted, a fill above C - 3 makes every accept fold)")
    ap.add_argument("--ops", help="comma list of operations (default: all of bench.workloads.OPS)")
    ap.add_argument("--set", action="append", default=[], metavar="OP.FIELD=VALUE",
                    help="a launch-config field for this run (config API only), e.g. decode.fold_FH=4")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: tests the runner")
    ap.add_argument("--peer-path", metavar="CHECKOUT",
                    help="a ReplaySSM checkout (github.com/Johnny-Liou/ReplaySSM): times its kernels "
                         "(replayssm_decode, replayssm_round), loaded from there; without it those ops are skipped")
    ap.add_argument("--sglang-path", metavar="WHEEL_OR_DIR", default=None,
                    help="SGLang's wheel (a sglang-*.whl, a folder holding one, or a tree with the sglang package) "
                         "for sglang_decode, its kernel files read from there, SGLang never installed (default: "
                         "the checkout's .whl/sglang/; without the wheel the op is skipped with the reason; '' "
                         "skips it)")
    ap.add_argument("--flashinfer-path", metavar="DIR", default=None,
                    help="a prefix holding FlashInfer and its CuTe-DSL dependencies (scripts/flashinfer_wheels.sh; "
                         "default: the checkout's .fi-site/ where it exists, else an installed flashinfer) for the "
                         "flashinfer_* ops; without FlashInfer they are skipped with the reason; '' skips them")
    ap.add_argument("--budget-s", type=float, default=TIME_BUDGET_S, help="time budget of the whole run")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # one package root, into JSON
    ap.add_argument("--package-root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    if args.sglang_path is None:

        args.sglang_path = W.SGLANG_PATH
    if args.package_root:  # the worker of --before: its packages first (bench/ stays this tree's)
        sys.path.insert(0, args.package_root)

    plan = W.SMOKE if args.smoke else W.GPU
    if args.batches:
        plan = dataclasses.replace(plan, batches=tuple(int(b) for b in args.batches.split(",") if b))
    if args.layers:
        plan = dataclasses.replace(plan, layers=args.layers)
    if args.fill is not None:
        plan = dataclasses.replace(plan, fill=args.fill)
    ops = [o for o in args.ops.split(",") if o] if args.ops else None
    overrides = W.parse_overrides(args.set)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("bench.gpu: no CUDA device (use --smoke on a CPU)", file=sys.stderr)
            return 2
    start = time.time()
    if args.worker:
        import kvbuffer_fast

        got = Path(kvbuffer_fast.__file__).resolve().parent.parent
        if args.package_root and got != Path(args.package_root).resolve():
            raise SystemExit(f"bench.gpu worker: kvbuffer_fast came from {got}, not {args.package_root}")
        res = measure(plan, {}, args.smoke, start + args.budget_s, ops, args.peer_path, args.sglang_path,
                      args.flashinfer_path)
        Path(args.worker).write_text(json.dumps(res))
        return 0

    result = dict(kind="kvbuffer-gpu-runner", smoke=args.smoke, started=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                     time.gmtime()),
                  plan=plan.as_dict(), overrides=overrides, peer_path=args.peer_path, sglang_path=args.sglang_path,
                  flashinfer_path=args.flashinfer_path, **git_commit())
    trees = {}
    if args.before:  # first, while this process holds no device memory
        passthru = ["--budget-s", str(args.budget_s / 2)] + (["--smoke"] if args.smoke else [])
        for flag, value in (("--batches", args.batches), ("--layers", args.layers), ("--ops", args.ops),
                            ("--peer-path", args.peer_path), ("--sglang-path", args.sglang_path),
                            ("--flashinfer-path", args.flashinfer_path), ("--fill", args.fill)):
            passthru += [flag, str(value)] if value is not None else []
        trees["before"] = measure_before(Path(args.before), passthru, timeout=args.budget_s / 2 + 120)
    remaining = args.budget_s - (time.time() - start)
    trees["after"] = measure(plan, overrides, args.smoke, time.time() + remaining, ops, args.peer_path,
                             args.sglang_path, args.flashinfer_path)
    for tree in trees.values():
        ratios(tree["rows"])
    result.update({k: v for k, v in trees["after"].items() if k in ("device", "torch", "triton", "fla", "python",
                                                                    "cuda", "sm_count", "memory_GiB")})
    result["trees"] = trees
    if "before" in trees:
        result["before_after"] = before_after(trees["after"]["rows"], trees["before"]["rows"])
    result["seconds"] = round(time.time() - start, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu.json"
    path.write_text(json.dumps(result, indent=1))

    report.write_runner_report(result, out)
    print(report.runner_summary(result))
    failures = sum(len(t["failures"]) for t in trees.values())
    print(f"bench.gpu: {sum(len(t['rows']) for t in trees.values())} rows, {failures} failures, "
          f"{result['seconds']} s")
    print(f"JSON: {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
