"""The validator's false-failure rate: correct implementations through ``kvbuffer validate``'s lanes, many seeds.

    python3 scripts/false_failures.py                 # 200 seeds, every bundled implementation
    python3 scripts/false_failures.py --quick         # 20 seeds, fewer examples: a smoke run of a few minutes
    python3 scripts/false_failures.py --impl reference,stepwise --seeds 200 --json ff.json
    python3 scripts/false_failures.py --seeds 50 --contracts tf32,bf16,bf16-state   # as if each were declared
    python3 scripts/false_failures.py --profile gpu --device cuda --impl fast,fla --seeds 20   # production shapes
    FLA_CACHE_MODE=default FLA_CONFIG_DIR=DIR python3 scripts/false_failures.py --device cuda --impl fla \
        --ops chunk,chunk_varlen --head-shapes "2,4,16,16;1,1,8,24;2,2,40,72"   # fla's chunk lanes (fla_fixed_configs.py)

The implementations are correct by construction, so every FAIL or ERROR is a false verdict of the
validator (a budget too tight, or a bug of the harness): ``reference`` (kvbuffer_ref's forms in float64
and float32, both buffer forms), ``fast`` (kvbuffer_fast: compiled on CUDA, the Triton interpreter on a
CPU) and ``stepwise`` (kvbuffer_ref's recurrence called one token at a time as an in-place decode step,
in float64 and float32, through the ``recurrent_decode`` lane) and ``emulated`` (kvbuffer_ref's forms
computed with TF32 or bf16 products, emulated, declaring that contract: only under ``--contracts`` tf32
and bf16) and ``fla`` (flash-linear-attention where it is installed, its chunk kernels declaring TF32; a peer
presumed correct, so a FAIL is a false verdict or a finding to reproduce) and ``engine`` (a correct
float32 decode step in an engine's convention, in PyTorch, ``tests/validate/engine_kernels.py``: raw gates it
turns into g and beta itself, q and k L2-normalised in the kernel, a state pool with pads; not in the
default list).

Each seed runs one operation in turn (seed s: operation s mod the number of operations), so a run of N
seeds covers every operation N / 10 times at the cost of N lanes per implementation, with fresh random
cases each seed (the anchor cases repeat).  ``--contracts`` judges every implementation as if it declared
each contract in turn (default ``ieee``): a correct IEEE implementation must pass under every looser
contract too, since each contract's baseline is its own emulated recurrence.  Prints, per operation and implementation, the lanes run, the
false failures and the worst error / budget ratio seen; exits 1 when any lane failed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMPLS = ("reference", "fast", "stepwise", "emulated", "fla", "engine")


def emulated_reference(contract: str):
    """kvbuffer_ref's forms (float32, both buffer forms) computed under the emulated product contract
    ``contract`` ("tf32", "fp16" or "bf16": every einsum's operands rounded) and declaring it: an implementation
    that keeps that contract exactly, so every failure under it is a false one.  Inputs in float32, and in
    float16 under "fp16" (its products' dtype)."""
    import torch

    import kvbuffer_ref as ref
    from kvbuffer.validate.adapters import OPERATION_ATTRS, describe
    from kvbuffer.validate.contracts import under_contract

    # the contracts are of the gated delta rule's products: the engines' preprocessing (q/k norms, gates) is
    # judged on its own float32 arithmetic, so the emulated reference leaves it out
    ops = {a: under_contract(getattr(ref, a), contract) for a in OPERATION_ATTRS
           if callable(getattr(ref, a, None)) and a != "engine_inputs"}
    dtypes = (torch.float32, torch.float16) if contract == "fp16" else (torch.float32,)
    return describe(types.SimpleNamespace(name=f"kvbuffer_ref {contract}-emulated", dtypes=dtypes,
                                          forms=("u", "raw"), contract=contract, **ops))


def stepwise_reference():
    """kvbuffer_ref's recurrence as an in-place single-token step (float64 and float32): the
    ``recurrent_decode`` lane's correct implementation."""
    import torch

    import kvbuffer_ref as ref
    from kvbuffer.validate.adapters import describe

    def recurrent_decode(q, k, v, *, g, beta, state, scale=None):
        o, new = ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                                output_final_state=True)
        state.copy_(new)
        return o

    return describe(types.SimpleNamespace(name="stepwise kvbuffer_ref", dtypes=(torch.float64, torch.float32),
                                          recurrent_decode=recurrent_decode))


def _impl(name: str):
    import torch

    from kvbuffer import implementations

    if name == "engine":  # the tests' correct engine-convention decode step, in PyTorch
        return implementations.resolve("tests.validate.engine_kernels:correct")
    impl = {"reference": implementations.reference, "fast": implementations.fast, "stepwise": stepwise_reference,
            "fla": implementations.fla}[name]()
    if name == "fla":
        # fla's chunk kernels multiply 16-bit operands in 16-bit products and, compiled, float32 ones in TF32
        # (tl.dot's default; the interpreter multiplies float32 exactly): judged as declaring what they keep
        f32 = "ieee" if impl.interpreted else "tf32"
        impl.lane_contracts = {(op, dt): {torch.float32: f32, torch.float16: "fp16"}.get(dt, "bf16")
                               for op in ("chunk", "chunk_varlen") for dt in (torch.float32, torch.float16, torch.bfloat16)}
    return impl


def _version(dist: str):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _ratio(r) -> float:
    """The lane's largest error / budget: the RMS and the gain checks' (``ratios``), else its worst comparison's."""
    if r.ratios:
        return max(r.ratios.values())
    if r.worst_rel is None or r.budget is None:
        return 0.0
    if r.budget <= 0:
        return 0.0 if r.worst_rel == 0 else float("inf")
    return r.worst_rel / r.budget


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="number of seeds (default 200; --quick: 20)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--impl", default=",".join(IMPLS[:-1]),
                    help=f"comma list of {', '.join(IMPLS)} (default all but engine)")
    ap.add_argument("--ops", help="comma list of operations (default all, one per seed in turn)")
    ap.add_argument("--dtype", help="comma list of input dtypes (default: every dtype each implementation declares)")
    ap.add_argument("--examples", type=int, default=None,
                    help="examples per lane (default: the ci profile's, 30 on the interpreter; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="20 seeds, 3 examples per lane")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--profile", default="ci", help="the validator's profile (ci, thorough, gpu; default ci)")
    ap.add_argument("--contracts", default="ieee",
                    help="comma list of the arithmetic contracts each implementation is judged as declaring "
                         "(default ieee; e.g. ieee,tf32,bf16,bf16-state)")
    ap.add_argument("--json", metavar="PATH", help="write every lane's verdict and the summary as JSON")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="start no seed after S seconds; the summary counts the seeds that ran")
    ap.add_argument("--head-shapes", metavar="H,HV,K,V;...",
                    help="draw (H, HV, K, V) from this list only (the ci profile's sizes otherwise): a compiled "
                         "kernel that compiles every new head shape (fla's chunk kernels) then compiles a few "
                         "times per run, while lengths, batches, gates and the boundary cases vary as drawn")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every lane")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds = 20 if args.seeds == 200 else args.seeds
        args.examples = args.examples or 3
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    from kvbuffer.validate import lanes, runner

    names = [x.strip() for x in args.impl.split(",") if x.strip()]
    bad = [n for n in names if n not in IMPLS]
    if bad:
        ap.error(f"--impl: unknown {bad}; known: {', '.join(IMPLS)}")
    from kvbuffer.validate.contracts import check_contract

    try:
        contracts = [check_contract(c.strip(), "--contracts") for c in args.contracts.split(",") if c.strip()]
    except ValueError as e:
        ap.error(str(e))
    impls = {}
    for n in names:
        for c in contracts:
            if n == "emulated":
                if c in ("tf32", "fp16", "bf16"):
                    impls[f"{n}@{c}"] = emulated_reference(c)
                continue
            impl = copy.copy(_impl(n))
            impl.contract = c
            impls[n if c == "ieee" else f"{n}@{c}"] = impl
    if args.head_shapes:
        try:
            shapes = tuple(tuple(int(x) for x in item.split(",")) for item in args.head_shapes.split(";") if item)
        except ValueError:
            shapes = ()
        if not shapes or not all(len(t) == 4 and min(t) > 0 and t[1] % t[0] == 0 for t in shapes):
            ap.error(f"--head-shapes: expected H,HV,K,V;... with HV a multiple of H, got {args.head_shapes!r}")
        for impl in impls.values():
            impl.sizes = dataclasses.replace(impl.sizes, head_shapes=shapes,
                                             name=f"{impl.sizes.name}, head shapes {args.head_shapes}")
    ops = [k for k, _ in lanes.select_ops(args.ops)]
    if "fla" in impls and (not impls["fla"].interpreted or set(ops) <= {"chunk", "chunk_varlen"}):
        # fla's chunk kernels zero a reset token's own update (docs/peers.md, the fla finding): compiled (where its
        # chunk lanes are the ones to run; its recurrent ones run on the CPU) and in a run of its chunk lanes alone,
        # judged on the gates fla's callers give them, finite (-exp(A_log) softplus(...)), so that a failure here
        # is a false one
        impls["fla"].gates = "finite"
    dtypes = lanes.parse_dtypes(args.dtype)
    stats = defaultdict(lambda: dict(lanes=0, failed=0, worst=0.0, worst_seed=None, worst_name=None))
    rows, t0 = [], time.perf_counter()
    ran = 0

    def write_json():  # after every seed, so a run stopped from outside keeps the seeds that finished
        if not args.json:
            return
        total = sum(s["lanes"] for s in stats.values())
        failed = sum(s["failed"] for s in stats.values())
        Path(args.json).write_text(json.dumps(dict(
            seeds=ran, first_seed=args.first_seed, examples=args.examples, device=device, profile=args.profile,
            gpu=torch.cuda.get_device_name() if device == "cuda" else None, torch=torch.__version__,
            triton=_version("triton"), fla=_version("fla-core"),
            fla_cache_mode=os.environ.get("FLA_CACHE_MODE"), lanes=total,
            false_failures=failed, rate=failed / total if total else 0.0, rows=rows,
            seconds=round(time.perf_counter() - t0, 1),
            summary=[dict(operation=k[0], implementation=k[1], dtype=k[2], **v) for k, v in sorted(stats.items())],
        ), indent=1, default=str) + "\n")
    for i in range(args.seeds):
        if args.time_limit is not None and time.perf_counter() - t0 > args.time_limit:
            print(f"time limit: {args.time_limit:g} s passed, {i} of {args.seeds} seeds ran", flush=True)
            break
        ran = i + 1
        seed = args.first_seed + i
        op = ops[seed % len(ops)]
        for name, impl in impls.items():
            try:
                rep = runner.run_validation([impl], ops=[(op, None)], dtypes=dtypes, seed=seed, device=device, profile=args.profile,
                                            max_examples=args.examples, shrink=False, explain=False)
            except runner.NothingToRun:
                continue
            for r in rep.lanes:
                if r.status not in ("PASS", "FAIL", "ERROR"):
                    continue
                key = (r.operation, r.implementation if impl.contract == "ieee" else f"{r.implementation} [{impl.contract}]",
                       r.dtype)
                s = stats[key]
                s["lanes"] += 1
                ratio = float("inf") if r.status == "ERROR" else _ratio(r)
                if r.failed:
                    s["failed"] += 1
                    print(f"FALSE FAILURE seed {seed}: {key[0]} / {key[1]} / {key[2]}: {r.status}",
                          flush=True)
                    for c in (r.failure or {}).get("comparisons") or [(r.failure or {}).get("error")]:
                        print(f"    {c}", flush=True)
                    if (r.failure or {}).get("case") is not None:
                        print(f"    case {r.failure['case']!r} {r.failure.get('params')}", flush=True)
                if ratio >= s["worst"]:
                    s.update(worst=ratio, worst_seed=seed, worst_name=r.worst_comparison)
                rows.append(dict(seed=seed, operation=r.operation, implementation=r.implementation, dtype=r.dtype,
                                 contract=r.contract,
                                 status=r.status, cases=r.cases, ratio=ratio, worst=r.worst_comparison))
                if args.verbose:
                    print(f"seed {seed} {r.operation} {r.implementation} {r.dtype} {r.status} {r.cases} cases "
                          f"ratio {ratio:.3g}", flush=True)
        if not args.verbose:
            print(f"seed {seed} ({op}) done, {time.perf_counter() - t0:.0f} s", flush=True)
        write_json()
    total = sum(s["lanes"] for s in stats.values())
    failed = sum(s["failed"] for s in stats.values())
    print()
    print(f"{'operation':18s}  {'implementation':34s}  {'dtype':8s}  {'lanes':>5s}  {'false':>5s}  {'worst ratio':>11s}  "
          f"worst at")
    for (op, impl, dt), s in sorted(stats.items()):
        print(f"{op:18s}  {impl:34s}  {dt:8s}  {s['lanes']:5d}  {s['failed']:5d}  {s['worst']:11.3g}  "
              f"seed {s['worst_seed']} {s['worst_name'] or ''}")
    rate = failed / total if total else 0.0
    print(f"\n{ran} seeds (first {args.first_seed}), {total} lanes, {failed} false failures "
          f"(rate {rate:.4f}); worst ratio {max((s['worst'] for s in stats.values()), default=0.0):.3g}; "
          f"{time.perf_counter() - t0:.0f} s, device {device}, profile {args.profile}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
