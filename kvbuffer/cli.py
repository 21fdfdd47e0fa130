"""``kvbuffer``: the command line.  ``kvbuffer validate --help`` and ``kvbuffer report --help`` say what
they do.

Exit status of ``kvbuffer validate``: 0 when every lane passes (NOT PROVIDED and SKIP rows are
listed, never hidden), 1 when any lane fails, 2 on a bad argument (with a message, no traceback).
``--json PATH`` writes the run's JSON report to PATH, which ``kvbuffer report PATH`` renders.  Every run
also keeps its report as the last run of its environment and working directory (``last_report_path``:
a folder of the cache named by a hash of ``sys.prefix`` and the checkout), which ``kvbuffer report``
without a file renders: another virtual environment or checkout keeps its own.

Exit status of ``kvbuffer report``: 0 when it rendered every file, 2 when a file is missing or is
not a validation report (benchmark JSON is rendered by ``python3 -m bench.report`` in a checkout).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import random
import sys
import tempfile
import types
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

import torch

import kvbuffer_ref

from . import implementations
from .integrations import precision as mprec
from .validate import adapters, lanes, parallel, precision as prec, report as rep, runner
from .validate.contracts import check_contract
from .validate.profiles import PROFILES
from .validate.report import case_label

USAGE_EXAMPLES = """\
examples:
  kvbuffer validate                                   # the reference's forms and the bundled Triton kernels
  kvbuffer validate --impl fla --ops recurrent        # flash-linear-attention's fused_recurrent kernel
  kvbuffer validate --impl mypkg.kvb:adapter --json report.json
  kvbuffer report report.json                         # that run as Markdown
  kvbuffer validate --impl fast --ops decode --seed 123 --profile thorough
  kvbuffer report                                     # the last run of this environment and checkout
  kvbuffer validate --report precision --impl fast --json prec.json --plot prec.png
                                                      # error growth over decode length, 16-bit inputs
  kvbuffer validate --report precision --impl reference --models all
                                                      # and the models' next-token KL / top-1 with a bf16
                                                      # state or u-cache (needs transformers)
  kvbuffer validate --report precision --impl reference --impl fla --state-dtype float32,bfloat16 \
      --models qwen3_5                                # and rows of each --impl's own decode step on a
                                                      # float32 and a bfloat16 state

An adapter (module:attr) is an object or module with some of the attributes recurrent_gated_delta_rule,
recurrent_decode, chunk_gated_delta_rule, direct_gated_delta_rule, buffered_decode, flush,
materialize_state, verify, accept, prefill (docs/validate-your-kernel.md, kvbuffer/validate/adapters.py).
"""


REPORT_EXAMPLES = """\
examples:
  kvbuffer report report.json                         # the run `kvbuffer validate --json report.json` wrote
  kvbuffer report report.json --out results/          # results/report.md and results/report-lanes.png
  kvbuffer report                                     # the last run of this environment and checkout
  python3 -m bench.report bench/results/latest/gpu.json   # a benchmark run: bench/ renders it, in a checkout
"""

#: The environment variable that sets ``kvbuffer validate``'s default ``--jobs``.
JOBS_ENV = "KVBUFFER_JOBS"

#: The file name, in this environment's folder of ``cache_dir()`` (``last_report_path``), that every
#: ``kvbuffer validate`` run writes its JSON report to.
LAST_REPORT = "last-validate.json"


def cache_dir() -> Path:
    """Where ``kvbuffer validate`` keeps its last report: $KVBUFFER_CACHE_DIR, else $XDG_CACHE_HOME/kvbuffer,
    else ~/.cache/kvbuffer."""
    if os.environ.get("KVBUFFER_CACHE_DIR"):
        return Path(os.environ["KVBUFFER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbuffer"


def checkout_dir(cwd: Optional[Path] = None) -> Path:
    """The checkout a command runs in: the nearest folder from the working directory up that holds
    ``.git``, else the working directory itself."""
    cwd = Path(cwd or os.getcwd()).resolve()
    for folder in [cwd, *cwd.parents]:
        if (folder / ".git").exists():
            return folder
    return cwd


def run_key() -> str:
    """A short hash of this Python environment (``sys.prefix``) and checkout (``checkout_dir``): the
    folder under ``cache_dir()`` where this environment's last run is kept."""
    text = f"{os.path.realpath(sys.prefix)}\0{checkout_dir()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def last_report_path() -> Path:
    """Where ``kvbuffer validate`` keeps its last report for this environment and checkout, and where
    ``kvbuffer report`` without a file reads it: ``cache_dir()/runs/<run_key()>/last-validate.json``."""
    return cache_dir() / "runs" / run_key() / LAST_REPORT


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
                   help="an adapter to validate (repeatable); also the ready ones: reference, fast, fla, fla-pool. "
                        "Default: reference and fast")
    v.add_argument("--profile", choices=PROFILES, default=None,
                   help="hypothesis profile: ci (bounded, default), thorough (many examples) or gpu "
                        "(production-sized cases, few examples; with --device cuda)")
    v.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where inputs are created (default: cuda when available, else cpu with the Triton interpreter)")
    v.add_argument("--dtype", metavar="DTYPES",
                   help="comma list of float64, float32, float16, bfloat16 (default: float64 and float32, "
                        "those each implementation declares)")
    v.add_argument("--ops", metavar="OPS",
                   help="comma list of operations (default all): recurrent, recurrent_decode, recurrent_varlen, "
                        "chunk, chunk_varlen, direct, decode, flush, materialize, verify_chain, verify_tree, prefill; "
                        "a form may be named: decode[u]")
    v.add_argument("--contract", metavar="CONTRACT",
                   help="judge every --impl by this arithmetic contract instead of the one its adapter declares: "
                        "ieee (IEEE float32, the default), tf32x3 (three TF32 products), tf32 (TF32 products), bf16 (bfloat16 products, float32 "
                        "accumulation), bf16-state (a bfloat16 recurrent state); the exit status follows it")
    v.add_argument("--peer-path", metavar="CHECKOUT",
                   help="the checkout a peer adapter loads its kernels from (--impl replayssm, sglang*, vllm*), or the "
                        "prefix scripts/flashinfer_wheels.sh prepares (--impl flashinfer*); also $KVBUFFER_PEER_PATH")
    v.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    v.add_argument("--seed", type=int, help="seed of the random cases (default: a fresh one each run, printed)")
    v.add_argument("--max-examples", type=int, metavar="N", help="examples per lane (overrides the profile)")
    v.add_argument("--no-shrink", action="store_true", help="report the first failing case without shrinking it")
    v.add_argument("--fail-fast", action="store_true", help="stop after the first failing lane")
    v.add_argument("-j", "--jobs", type=int, metavar="N",
                   help="lanes run at once, each in a worker process (default: $KVBUFFER_JOBS, else the usable "
                        f"CPUs, at most {parallel.MAX_JOBS}, on the CPU; 1 with --device cuda); 1 runs them in this "
                        "process.  Rows, seeds and verdicts are the same for any N")
    v.add_argument("--replay", metavar="BLOB", help="replay one failure from its @reproduce_failure blob "
                                                    "(select its single lane with --impl/--ops/--dtype)")
    v.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")
    v.add_argument("--report", choices=("precision",),
                   help="instead of the lanes: 'precision', the error growth of each --impl's recurrent_decode and "
                        "buffered_decode (decode + folds) over 1, 2, 4, ... --steps decode steps with 16-bit inputs "
                        "(--dtype: float16 by default on the CPU, bfloat16 on CUDA) against the float64 recurrence, "
                        "beside the fp32 and bf16-state recurrences' (Markdown on stdout; --json, --plot)")
    v.add_argument("--steps", type=int, metavar="N",
                   help="--report precision: decode steps (default 256 on the CPU, 4096 on CUDA)")
    v.add_argument("--state-dtype", metavar="DTYPE", default="float32",
                   help="--report precision: the dtype of the state handed to recurrent_decode, or a comma list "
                        "(a report, and with --models a row per model, for each); default float32.  A peer that "
                        "keeps a state dtype of its own (flashinfer-bf16: bfloat16) stores that: the report says so")
    v.add_argument("--cache-dtype", metavar="DTYPE", default="float32",
                   help="--report precision: the dtype of buffered_decode's u / v cache (default float32)")
    v.add_argument("--plot", metavar="PNG", help="--report precision: also plot the errors to PNG (needs matplotlib)")
    v.add_argument("--models", metavar="MODELS",
                   help="--report precision: also each model's next-token KL, top-1 agreement and state error of "
                        "bf16 state / u-cache against the fp32 and float64 pools over a generation (tiny configs, "
                        "random weights; needs transformers): 'all' (qwen3_next, qwen3_5, kimi_linear) or a comma "
                        "list; --steps (default 64 on the CPU, 256 on CUDA).  Each --impl with a decode step adds a "
                        "row per --state-dtype: every linear layer's decode steps run by its recurrent_decode (the "
                        "reference: its recurrence one token at a time) after the fp32 pool's prefill; one not "
                        "installed is NOT RUN, one without recurrent_decode NOT PROVIDED")
    r = sub.add_parser(
        "report", help="render validation runs' JSON as Markdown (and plots, with matplotlib)",
        description="Render JSON reports as Markdown: the files given (`kvbuffer validate --json PATH` writes "
                    "one), else the last `kvbuffer validate` run of this Python environment (sys.prefix) and "
                    "checkout (kept under the cache folder: $KVBUFFER_CACHE_DIR, else $XDG_CACHE_HOME/kvbuffer, "
                    "else ~/.cache/kvbuffer, in runs/<hash of both>/). The report names its run (command, implementations, seed, time, "
                    "environment) first. Plots need matplotlib and --out.",
        epilog=REPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("json", nargs="*", metavar="JSON",
                   help="files to render: `kvbuffer validate --json` reports (default: the last validation report "
                        "of this environment and checkout)")
    r.add_argument("--out", metavar="DIR", help="write DIR/report.md and the plots (PNG) instead of printing the Markdown")
    r.add_argument("--no-plot", action="store_true", help="no plots, even with matplotlib installed")
    return p


def version_text() -> str:
    """``kvbuffer <version> (torch <version>, triton <version or 'not installed'>)``, without importing triton
    (which would fix the interpreter setting before a command could choose it)."""
    torch_v = torch.__version__
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


def _cwd_on_path() -> None:
    """Put the working directory first on sys.path, as ``python -m`` does, so that ``--impl mymodule``
    finds a module of the current folder without PYTHONPATH=."""
    cwd = os.getcwd()
    if not any(p in ("", ".") or (os.path.isdir(p) and os.path.samefile(p, cwd)) for p in sys.path):
        sys.path.insert(0, cwd)


def _looks_like_adapter(name: str, obj) -> bool:
    """An attribute of a module that ``--impl module:attr`` could mean: an adapter object or
    ``Implementation``, or a factory / class named like one."""
    if name.startswith("_") or isinstance(obj, types.ModuleType):
        return False
    if isinstance(obj, adapters.Implementation):
        return True
    if not isinstance(obj, type) and any(callable(getattr(obj, a, None)) for a in adapters.OPERATION_ATTRS):
        return True
    low = name.lower()
    return callable(obj) and any(w in low for w in ("adapter", "impl", "factory", "kernel"))


def _module_not_adapter(spec: str) -> Optional[str]:
    """For ``--impl module`` (no ``:attr``) of a module that is no adapter itself (none of the operation
    attributes): the message that suggests its attributes that look like adapters; None otherwise (a
    ready adapter's short name, ``module:attr``, an adapter module, or a module that does not import:
    ``implementations.resolve`` says why)."""
    if ":" in spec or spec.strip() in implementations.builtin_names() or spec.strip() in implementations._BUILTIN:
        return None
    try:
        mod = importlib.import_module(spec.strip())
    except Exception:
        return None
    if any(callable(getattr(mod, a, None)) for a in adapters.OPERATION_ATTRS):
        return None
    found = [n for n, o in sorted(vars(mod).items()) if _looks_like_adapter(n, o)
             and getattr(o, "__module__", mod.__name__) in (mod.__name__, None, "types")]
    found = found or [n for n, o in sorted(vars(mod).items()) if _looks_like_adapter(n, o)]
    msg = (f"--impl {spec}: the module {spec!r} is not itself an adapter (it defines none of the operations "
           f"{', '.join(adapters.OPERATION_ATTRS[:4])}, ...)")
    if len(found) == 1:
        return msg + f"; did you mean --impl {spec}:{found[0]}?"
    if found:
        return msg + f"; name one of its adapters: --impl {spec}:ATTR, ATTR one of {', '.join(found)}"
    return msg + f"; name the adapter object or factory in it: --impl {spec}:ATTR"


def _validate(args) -> int:
    # Decide the device before anything imports triton (kvbuffer_fast, a peer's kernels): the interpreter
    # must be chosen first.  Nothing this module imports at its top imports triton.
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
    jobs = args.jobs
    if jobs is None and os.environ.get(JOBS_ENV, "").strip():
        try:
            jobs = int(os.environ[JOBS_ENV])
        except ValueError:
            return _bad(f"${JOBS_ENV}: expected a positive integer, got {os.environ[JOBS_ENV]!r}")
        if jobs < 1:
            return _bad(f"${JOBS_ENV}: expected a positive integer, got {jobs}")
    elif jobs is not None and jobs < 1:
        return _bad(f"--jobs: expected a positive integer, got {jobs}")
    if jobs is None:
        jobs = parallel.default_jobs(device)

    _cwd_on_path()
    try:
        ops = lanes.select_ops(args.ops)
        dtypes = lanes.parse_dtypes(args.dtype)
        impls, specs = [], {}
        if args.peer_path:
            os.environ["KVBUFFER_PEER_PATH"] = args.peer_path
        if args.impl:
            for spec in args.impl:
                hint = _module_not_adapter(spec)
                if hint:
                    return _bad(hint)
                impl = implementations.resolve(spec)
                impls.append(impl)
                specs[impl.name] = spec
        else:
            impls = implementations.default_implementations()
            specs.update({impls[0].name: "reference", impls[1].name: "fast"})
    except (adapters.AdapterError, lanes.ValidationError) as e:
        return _bad(str(e))
    if args.contract is not None:
        try:
            contract = check_contract(args.contract, "--contract")
        except ValueError as e:
            return _bad(str(e))
        for impl in impls:
            impl.contract, impl.lane_contracts = contract, {}

    if args.report == "precision":
        return _precision(args, impls, device)
    for opt in ("steps", "plot", "models"):
        if getattr(args, opt) is not None:
            return _bad(f"--{opt}: only with --report precision")

    profile = args.profile or os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if profile not in PROFILES:
        return _bad(f"HYPOTHESIS_PROFILE: expected one of {', '.join(PROFILES)}, got {profile!r}")

    widths = rep.column_widths([i.name for i in impls])

    def show(r):
        if not args.quiet or r.failed:
            print(rep.table_row(r, widths), flush=True)

    names = ", ".join(f"{i.name}{' (Triton interpreter)' if i.interpreted else ''}"
                      f"{'' if i.contract == 'ieee' else f' [contract {i.contract}]'}" for i in impls)
    seed = args.seed
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    if not args.quiet:
        print(f"kvbuffer validate: profile {profile}, seed {seed}, device {device}; implementations: {names}")
        print(rep.table_header(widths), flush=True)
    try:
        report = runner.run_validation(impls, ops=ops, dtypes=dtypes, profile=profile, device=device, seed=seed,
                                         max_examples=args.max_examples, shrink=not args.no_shrink,
                                         fail_fast=args.fail_fast, replay=args.replay, on_result=show, jobs=jobs)
    except runner.NothingToRun as e:
        for r in e.report.lanes:
            print(rep.table_row(r, widths))
        return _bad(str(e))
    except lanes.ValidationError as e:
        return _bad(str(e))

    report.argv = ["kvbuffer", *getattr(args, "argv", sys.argv[1:])]
    failures = [r for r in report.lanes if r.failed]
    for r in failures:
        cmd = rep.replay_command(r, specs.get(r.implementation), report.seed, profile, device)
        if args.contract is not None:
            cmd += f" --contract {args.contract}"
        if args.peer_path:
            cmd += f" --peer-path {args.peer_path}"
        print()
        print(rep.format_failure(r, cmd))
    print()
    print(report.summary_line())
    _keep_last(report)
    if args.json:
        try:
            rep.write_json(report, args.json)
        except OSError as e:
            print(f"kvbuffer validate: error: --json {args.json}: {e}", file=sys.stderr)
            return 2
        print(f"report: {args.json} (render it: kvbuffer report {args.json})")
    return 1 if failures else 0


_DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float32": "float32", "fp32": "float32"}


def _precision(args, impls, device: str) -> int:
    """``kvbuffer validate --report precision``: the error growth table of every implementation."""

    def dtype_of(text, label, allowed):
        name = _DTYPES.get(str(text).strip())
        if name not in allowed:
            raise ValueError(f"{label}: expected one of {', '.join(allowed)}, got {text!r}")
        return getattr(torch, name)

    try:
        dtype = dtype_of(args.dtype or ("bfloat16" if device == "cuda" else "float16"), "--dtype",
                         ("float16", "bfloat16", "float32"))
        state_dtypes = [dtype_of(t, "--state-dtype", ("float32", "float16", "bfloat16"))
                        for t in str(args.state_dtype).split(",")]
        state_dtypes = list(dict.fromkeys(state_dtypes))
        cache_dtype = dtype_of(args.cache_dtype, "--cache-dtype", ("float32", "float16", "bfloat16"))
    except ValueError as e:
        return _bad(str(e))
    steps = args.steps if args.steps is not None else (4096 if device == "cuda" else 256)
    if steps < 1:
        return _bad(f"--steps: expected a positive integer, got {steps}")
    interpreted = [i.name for i in impls if i.interpreted]
    if interpreted and torch.bfloat16 in (dtype, cache_dtype, *state_dtypes):
        return _bad(f"bfloat16 under the Triton interpreter ({', '.join(interpreted)}) is computed wrongly on the "
                    f"CPU: use float16 here, bfloat16 with --device cuda")
    models = []
    if args.models is not None:
        try:
            models = mprec.parse_models(args.models)
        except ValueError as e:
            return _bad(str(e))
    reports, texts = [], []
    for impl in impls:
        if impl.unavailable:
            texts.append(f"# Precision report: {impl.name}\n\nNOT RUN: {impl.unavailable}\n")
            continue
        if not (impl.has("recurrent_decode") or impl.has("buffered_decode")):
            texts.append(f"# Precision report: {impl.name}\n\nNOT PROVIDED: neither recurrent_decode nor "
                         f"buffered_decode\n")
            continue
        for state_dtype in state_dtypes:
            rep = prec.precision_report(impl, steps=steps, dtype=dtype, device=device, state_dtype=state_dtype,
                                        cache_dtype=cache_dtype, seed=0 if args.seed is None else args.seed)
            if dtype not in impl.dtypes:
                rep["notes"].append(f"{impl.name} does not declare {lanes.dtype_name(dtype)} inputs "
                                    f"(it declares {', '.join(lanes.dtype_name(d) for d in impl.dtypes)}): "
                                    f"measured anyway")
            reports.append(rep)
            single = args.plot and len(impls) == 1 and len(state_dtypes) == 1
            texts.append(prec.precision_markdown(rep, args.plot if single else None))
    model_reports = []
    if models:
        text, model_reports = mprec.models_section(models, steps=args.steps, device=device,
                                                   seed=0 if args.seed is None else args.seed, impls=impls,
                                                   state_dtypes=state_dtypes)
        texts.append(text)
    print("\n".join(texts))
    if args.plot and reports:
        for i, rep in enumerate(reports):
            path = args.plot if len(reports) == 1 else str(Path(args.plot).with_suffix("")) + f"-{i}.png"
            if not prec.plot_precision(rep, path):
                print("kvbuffer validate: no plot: matplotlib is not installed (pip install matplotlib)",
                      file=sys.stderr)
                break
            print(f"kvbuffer validate: wrote {path}", file=sys.stderr)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(dict(tool="kvbuffer validate --report precision", reports=reports, models=model_reports),
                          f, indent=1)
                f.write("\n")
        except OSError as e:
            return _bad(f"--json {args.json}: {e}")
    return 0


def _keep_last(report) -> None:
    """Write ``report`` to ``last_report_path()``, this environment's and checkout's own (atomically:
    parallel runs never leave half a file); a folder that cannot be written costs a note, not the run."""

    path = last_report_path()
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".last-validate.", suffix=".json", dir=folder)
        os.close(fd)
        try:
            rep.write_json(report, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        print(f"note: the report was not kept for `kvbuffer report` ({folder}: {e})", file=sys.stderr)


# ----------------------------------------------------------------------------- kvbuffer report
def _num(x) -> Optional[float]:
    """A JSON number (infinities are written as strings) as a float; None for null."""
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _sci(x) -> str:
    x = _num(x)
    return "–" if x is None else (f"{x:.2e}" if math.isfinite(x) else str(x))


def lane_ratio(r: dict) -> Optional[float]:
    """A lane's worst error / budget from its JSON row (None when it ran no comparison)."""
    w, b = _num(r.get("worst_rel")), _num(r.get("budget"))
    if w is None or b is None:
        return None
    if b <= 0:
        return 0.0 if w == 0 else math.inf
    return w / b


def run_lines(data: dict) -> list:
    """The lines that name a validation run: its command, implementations, seed, time and environment
    (a report written before these were kept says which are unknown)."""
    impls = data.get("implementations") or list(dict.fromkeys(r.get("implementation") for r in data.get("results", [])))
    env = data.get("environment") or {}
    cmd = " ".join(["kvbuffer"] + list(data["argv"][1:])) if data.get("argv") else "unknown"
    lines = [f"- Command: `{cmd}`",
             f"- Implementations: {', '.join(map(str, impls)) or 'none'}; seed {data.get('seed')}; started "
             f"{data.get('started') or 'unknown'}"]
    if env:
        lines.append(f"- Environment: `{env.get('prefix')}` (python {env.get('python_version')}, kvbuffer "
                     f"{env.get('kvbuffer')}, torch {env.get('torch')}), in `{env.get('cwd')}` on {env.get('host')}")
    else:
        lines.append("- Environment: unknown (the report does not record it)")
    return lines


def validation_markdown(data: dict, plot: Optional[str] = None, notes: Sequence[str] = ()) -> str:
    """A ``kvbuffer validate`` JSON report as Markdown: which run it is (``run_lines``), the settings,
    one table row per lane (error, budget and their ratio; the reason of every lane not run), each
    failure with its class, case and comparisons, ``plot`` (an image path) when given and ``notes``
    (e.g. why a plot is missing)."""
    s = data.get("summary", {})
    md = [f"# kvbuffer validate: {'PASSED' if data.get('passed') else 'FAILED'}", ""] + run_lines(data) + [
          f"- Profile {data.get('profile')}, device {data.get('device')}, Triton {data.get('triton')}; "
          f"{data.get('seconds')} s",
          f"- {s.get('PASS', 0)} passed, {s.get('FAIL', 0) + s.get('ERROR', 0)} failed, "
          f"{s.get('NOT PROVIDED', 0)} not provided, {s.get('SKIP', 0)} skipped"]
    md += ["", "| operation | implementation | dtype | cases | worst rel-RMS | budget | error / budget | "
               "error / a correct kernel's | result | time |",
           "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in data.get("results", []):
        ran = r.get("status") in ("PASS", "FAIL", "ERROR")
        ratio = lane_ratio(r)
        status = r.get("status", "?") if ran or not r.get("reason") else f"{r['status']}: {r['reason']}"
        if ran and r.get("status") != "PASS" and r.get("klass"):
            status = f"{r['status']} [{r['klass']}]"
        md.append("| " + " | ".join([
            str(r.get("operation")), str(r.get("implementation")), str(r.get("dtype") or "–"),
            str(r.get("cases")) if ran else "–", _sci(r.get("worst_rel")), _sci(r.get("budget")),
            "–" if ratio is None else f"{ratio:.3g}",
            rep.format_over_correct(rep.over_correct(_num(r.get("worst_rel")), _num(r.get("baseline"))), "–"),
            status.replace("|", "\\|"),
            f"{_num(r.get('seconds')) or 0:.1f} s" if ran else "–"]) + " |")
    failures = [r for r in data.get("results", []) if r.get("status") in ("FAIL", "ERROR")]
    if failures:
        md += ["", "## Failures"]
    for r in failures:
        f = r.get("failure") or {}
        klass = r.get("klass")
        md += ["", f"### {r.get('status')}{f' [{klass}]' if klass else ''}: {r.get('operation')} / "
                   f"{r.get('implementation')} / {r.get('dtype')}", ""]
        if r.get("why"):
            md.append(f"- Caught by [{klass}]: {r['why']}")
        if f.get("case") is not None:

            case = f["case"]
            if isinstance(case, dict):
                case = "Case(" + ", ".join(f"{k}={v!r}" for k, v in case.items()) + ")"
            label = case_label(klass, f)
            md.append(f"- {label[0].upper() + label[1:]}: `{case}`" + (
                f" with {', '.join(f'{k}={v!r}' for k, v in f['params'].items())}" if f.get("params") else ""))
        err = f.get("error")
        if err and err.startswith("["):  # a finding of the lane itself ("[state-leak] output differs ...")
            md.append(f"- {err}")
        elif err:
            md.append(f"- The implementation raised `{err}`")
        if f.get("blob"):
            md.append(f"- Replay: `--replay {f['blob']}` (with this lane's --impl/--ops/--dtype and seed "
                      f"{data.get('seed')})")
        if f.get("comparisons"):
            md += ["", "```"] + [str(c) for c in f["comparisons"]] + ["```"]
    if plot:
        md += ["", f"![error / budget per lane]({plot})"]
    for note in notes:
        md += ["", f"> {note}"]
    return "\n".join(md) + "\n"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_lanes(data: dict, path: Path) -> bool:
    """A bar per lane that ran: its worst error / budget on a log axis, the budget at 1; PASS blue, FAIL
    red, each bar labelled with its ratio.  An error of exactly zero has no bar: a marker at the axis'
    left edge labelled "0 (exact)"; a failure with no comparison (an exception) is labelled with its
    class there.  False without matplotlib or without a lane that ran."""
    rows = [(f"{r['operation']} / {r['implementation']} / {r['dtype']}", lane_ratio(r), r.get("status"),
             r.get("klass")) for r in data.get("results", []) if r.get("status") in ("PASS", "FAIL", "ERROR")]
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return False
    finite = [x for _, x, _, _ in rows if x is not None and 0 < x < math.inf]
    lo = 10 ** math.floor(math.log10(min(finite + [1.0]) / 3))
    hi = 10 ** math.ceil(math.log10(max(finite + [1.0]) * 3))
    colour = {"PASS": "tab:blue", "FAIL": "tab:red", "ERROR": "tab:red"}
    height = max(2.4, 0.32 * len(rows) + 1.4)
    fig, ax = plt.subplots(figsize=(9, height))
    for i, (_, x, st, klass) in enumerate(rows):
        c = colour.get(st, "tab:gray")
        if x is None:
            ax.plot([lo], [i], marker="x", color=c, ms=7, clip_on=False)
            ax.annotate(f"{st} [{klass or 'raised'}]: no comparison", (lo, i), xytext=(8, 0),
                        textcoords="offset points", va="center", fontsize=7, color=c)
        elif x == 0:
            ax.plot([lo], [i], marker="o", color=c, ms=6, clip_on=False)
            ax.annotate("0 (exact)", (lo, i), xytext=(8, 0), textcoords="offset points", va="center", fontsize=7,
                        color=c)
        else:
            v = min(x, hi)
            ax.barh(i, v - lo, left=lo, color=c, height=0.7)
            ax.annotate("inf" if x == math.inf else f"{x:.3g}", (v, i), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(rows)), [n for n, _, _, _ in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi * 3)
    ax.set_xlabel("worst rel-RMS error / budget (1 = the budget; left of it passes)")
    ax.grid(True, axis="x", which="major", alpha=0.3)
    ax.set_title(f"kvbuffer validate, seed {data.get('seed')}, {data.get('device')}: "
                 f"{'PASSED' if data.get('passed') else 'FAILED'}", fontsize=9)
    handles = [Patch(color="tab:blue", label="PASS"), Patch(color="tab:red", label="FAIL"),
               Line2D([], [], color="k", lw=1, label="budget")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


#: The warning ``kvbuffer report --out`` gives (stderr, and a line of the report) without matplotlib.
NO_MATPLOTLIB = "no plots: matplotlib is not installed (pip install matplotlib, or the `test` extra)"


def _render(path: Path, data: dict, out: Optional[Path], plot: bool) -> str:
    """The Markdown of one JSON file (its plots written under ``out``; without matplotlib the report
    says so); ValueError for an unknown file."""
    stem = path.stem
    missing = out is not None and plot and not have_matplotlib()
    if data.get("tool") == "kvbuffer validate":
        img = None
        if out is not None and plot and plot_lanes(data, out / f"{stem}-lanes.png"):
            img = f"{stem}-lanes.png"
        return validation_markdown(data, img, [f"No plot: {NO_MATPLOTLIB}."] if missing else ())
    if data.get("kind") == "kvbuffer-gpu-runner" or "benchmarks" in data:
        raise ValueError(f"{path}: a benchmark JSON; bench/ renders it in a kvbuffer checkout "
                         f"(`python3 -m bench.report {path}`); kvbuffer report renders validation runs")
    raise ValueError(f"{path}: not a `kvbuffer validate --json` report, nor bench/gpu.py's or pytest-benchmark's "
                     f"JSON")


def default_report_files() -> list[Path]:
    """The last validation report of this environment and checkout (``last_report_path``, if a run kept
    one)."""
    last = last_report_path()
    return [last] if last.is_file() else []


def _report(args) -> int:
    def bad(msg):
        print(f"kvbuffer report: error: {msg}", file=sys.stderr)
        return 2

    files = [Path(p) for p in args.json] or default_report_files()
    if not files:
        return bad(f"nothing to render: no file given, no {last_report_path()} (the last run of this environment "
                   f"{sys.prefix} and checkout {checkout_dir()}: run `kvbuffer validate` first, or `kvbuffer report "
                   f"PATH` on the file of `kvbuffer validate --json PATH`)")
    out = None
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return bad(f"--out {out}: {e}")
    if out is not None and not args.no_plot and not have_matplotlib():
        print(f"kvbuffer report: warning: {NO_MATPLOTLIB}", file=sys.stderr)
    parts = []
    for path in files:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return bad(f"{path}: no such file")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return bad(f"{path}: not readable JSON ({e})")
        if not isinstance(data, dict):
            return bad(f"{path}: expected a JSON object, got {type(data).__name__}")
        try:
            parts.append(f"<!-- from {path} -->\n" + _render(path, data, out, not args.no_plot))
        except ValueError as e:
            return bad(str(e))
    text = "\n".join(parts)
    if out is None:
        sys.stdout.write(text)
    else:
        (out / "report.md").write_text(text)
        print(f"kvbuffer report: wrote {out / 'report.md'}" + "".join(
            f", {p}" for p in sorted(out.glob("*.png"))))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the report names its run by this command line
    if args.version:
        print(version_text())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "validate":
        return _validate(args)
    if args.command == "report":
        return _report(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
