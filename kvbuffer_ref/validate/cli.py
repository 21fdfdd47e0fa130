"""``kvbuffer``: the command line.  ``kvbuffer validate --help`` says what it does.

Exit status of ``kvbuffer validate``: 0 when every lane passes (NOT PROVIDED and SKIP rows are
listed, never hidden), 1 when any lane fails, 2 on a bad argument (with a message, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

USAGE_EXAMPLES = """\
examples:
  kvbuffer validate                                   # the reference's forms and the bundled Triton kernels
  kvbuffer validate --impl fla --ops recurrent        # flash-linear-attention's fused_recurrent kernel
  kvbuffer validate --impl mypkg.kvb:adapter --json report.json
  kvbuffer validate --impl fast --ops decode --seed 123 --profile thorough

An adapter (module:attr) is an object or module with some of the attributes recurrent_gated_delta_rule,
recurrent_decode, chunk_gated_delta_rule, direct_gated_delta_rule, buffered_decode, flush,
materialize_state, verify, accept, prefill (docs/validate-your-kernel.md, kvbuffer_ref/validate/adapters.py).
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbuffer", description="KVBuffer reference oracle tools")
    p.add_argument("--version", action="store_true",
                   help="print the versions of kvbuffer, torch and triton (if installed) and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser(
        "validate", help="check implementations against the float64 oracle's properties",
        description="Run the oracle's properties (docs/testing.md) over implementations with hypothesis and print, per "
                    "operation, implementation and dtype, the worst relative RMS error against the float64 "
                    "recurrence and its budget from the tolerance table.",
        epilog=USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--impl", action="append", metavar="MODULE:ATTR",
                   help="an adapter to validate (repeatable); also the ready ones: reference, fast, fla. "
                        "Default: reference and fast")
    v.add_argument("--profile", choices=("ci", "thorough"), default=None,
                   help="hypothesis profile: ci (bounded, default) or thorough (many examples)")
    v.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where inputs are created (default: cuda when available, else cpu with the Triton interpreter)")
    v.add_argument("--dtype", metavar="DTYPES",
                   help="comma list of float64, float32, float16, bfloat16 (default: float64 and float32, "
                        "those each implementation declares)")
    v.add_argument("--ops", metavar="OPS",
                   help="comma list of operations (default all): recurrent, recurrent_decode, chunk, direct, decode, "
                        "flush, materialize, verify_chain, verify_tree, prefill; a form may be named: decode[u]")
    v.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    v.add_argument("--seed", type=int, help="seed of the random cases (default: a fresh one each run, printed)")
    v.add_argument("--max-examples", type=int, metavar="N", help="examples per lane (overrides the profile)")
    v.add_argument("--no-shrink", action="store_true", help="report the first failing case without shrinking it")
    v.add_argument("--fail-fast", action="store_true", help="stop after the first failing lane")
    v.add_argument("--replay", metavar="BLOB", help="replay one failure from its @reproduce_failure blob "
                                                    "(select its single lane with --impl/--ops/--dtype)")
    v.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")
    return p


def version_text() -> str:
    """``kvbuffer <version> (torch <version>, triton <version or 'not installed'>)``, without importing triton
    (which would fix the interpreter setting before a command could choose it)."""
    from importlib import metadata

    import kvbuffer_ref

    try:
        import torch
        torch_v = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_v = "not installed"
    triton_v = "not installed"
    for dist in ("triton", "pytorch-triton"):
        try:
            triton_v = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    return f"kvbuffer {kvbuffer_ref.__version__} (torch {torch_v}, triton {triton_v})"


def _bad(msg: str) -> int:
    print(f"kvbuffer validate: error: {msg}", file=sys.stderr)
    return 2


def _validate(args) -> int:
    # Decide the device before anything imports triton: the interpreter must be chosen first.
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return _bad(f"torch is required: {e}")
    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        return _bad("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False)")
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("note: triton was imported before the interpreter could be enabled; Triton lanes may fail on CPU",
                  file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
    if args.max_examples is not None and args.max_examples < 1:
        return _bad(f"--max-examples: expected a positive integer, got {args.max_examples}")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        return _bad(f"--seed: expected an integer in 0..2**32-1, got {args.seed}")

    from . import adapters, lanes, report as rep, runner

    try:
        ops = lanes.select_ops(args.ops)
        dtypes = lanes.parse_dtypes(args.dtype)
        impls, specs = [], {}
        if args.impl:
            for spec in args.impl:
                impl = adapters.resolve(spec)
                impls.append(impl)
                specs[impl.name] = spec
        else:
            impls.append(adapters.reference())
            specs[impls[-1].name] = "reference"
            try:
                import triton  # noqa: F401
                impls.append(adapters.fast())
                specs[impls[-1].name] = "fast"
            except ImportError as e:
                print(f"note: kvbuffer_fast (Triton kernels) skipped: triton is not installed ({e})")
    except (adapters.AdapterError, lanes.ValidationError) as e:
        return _bad(str(e))

    profile = args.profile or os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if profile not in ("ci", "thorough"):
        return _bad(f"HYPOTHESIS_PROFILE: expected ci or thorough, got {profile!r}")

    def show(r):
        if not args.quiet or r.failed:
            print(rep.table_row(r), flush=True)

    names = ", ".join(f"{i.name}{' (Triton interpreter)' if i.interpreted else ''}" for i in impls)
    seed = args.seed
    if seed is None:
        import random
        seed = random.SystemRandom().randrange(2**31)
    if not args.quiet:
        print(f"kvbuffer validate: profile {profile}, seed {seed}, device {device}; implementations: {names}")
        print(rep.table_header(), flush=True)
    try:
        report = runner.run_validation(impls, ops=ops, dtypes=dtypes, profile=profile, device=device, seed=seed,
                                         max_examples=args.max_examples, shrink=not args.no_shrink,
                                         fail_fast=args.fail_fast, replay=args.replay, on_result=show)
    except runner.NothingToRun as e:
        for r in e.report.lanes:
            print(rep.table_row(r))
        return _bad(str(e))
    except lanes.ValidationError as e:
        return _bad(str(e))

    failures = [r for r in report.lanes if r.failed]
    for r in failures:
        cmd = rep.replay_command(r, specs.get(r.implementation), report.seed, profile, device)
        print()
        print(rep.format_failure(r, cmd))
    s = report.to_json()["summary"]
    print()
    print(f"{'FAILED' if failures else 'PASSED'}: {s['PASS']} passed, {s['FAIL'] + s['ERROR']} failed, "
          f"{s['NOT PROVIDED']} not provided, {s['SKIP']} skipped in {report.seconds:.1f}s (seed {report.seed})")
    if args.json:
        try:
            rep.write_json(report, args.json)
        except OSError as e:
            print(f"kvbuffer validate: error: --json {args.json}: {e}", file=sys.stderr)
            return 2
    return 1 if failures else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        print(version_text())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "validate":
        return _validate(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
