"""The validation engine behind ``kvbuffer validate`` and the pytest plugin.

It runs the oracle's properties (``kvbuffer_ref.testing.properties``) over implementations
(adapters, see ``kvbuffer_ref.adapters``), one *lane* per (operation, implementation, dtype), each
driven by hypothesis: fresh random cases every run unless a seed is given, the smallest failing
case found by shrinking, and the blob that replays it.  Every verdict comes from the one tolerance
table (``kvbuffer_ref.testing.tolerances``); nothing here sets a tolerance.

    report = run_validation([resolve("fast")], profile="ci", device="cpu")
    report.passed, report.lanes, report.to_json()
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
import traceback
import warnings
import zlib
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from .adapters import Implementation, stepwise_recurrent
from .testing import properties as P
from .testing import strategies as kst
from .testing.cases import Case

__all__ = ["OPS", "OP_KEYS", "DTYPES", "Sizes", "Lane", "LaneResult", "Report", "ValidationError", "parse_dtypes",
           "select_ops", "plan", "run_validation", "format_table", "format_failure"]


class ValidationError(ValueError):
    """A bad request (unknown op or dtype, missing device, nothing to run): the CLI exits 2 on it."""


#: dtype names accepted by --dtype.
DTYPES = {"float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
          "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
#: dtypes validated when --dtype is not given (each implementation runs those it declares).
DEFAULT_DTYPES = (torch.float64, torch.float32)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


# ----------------------------------------------------------------------------- sizes of the cases
@dataclass(frozen=True)
class Sizes:
    """Bounds of the drawn cases.  ``small`` is for implementations on the Triton interpreter."""

    max_B: int = 3
    max_T: int = 12
    max_H: int = 2
    max_group: int = 3
    dims: tuple = (1, 2, 3, 5, 7, 8, 12, 16, 40, 72, 136)  # > 32, > 64, > 128: more than one tile of BV columns
    max_capacity: int = 6
    max_history: int = 10
    max_new: int = 6
    max_chain: int = 6
    max_tree: int = 10
    max_after: int = 3
    max_prompt: int = 12
    big_capacity: int = 20  # drawn now and then: more cached rows than a kernel's row tile (16)


NORMAL = Sizes()
SMALL = Sizes(max_B=3, max_T=8, max_H=2, max_group=2, max_capacity=5, max_history=6, max_new=4, max_chain=4,
              max_tree=6, max_after=2, max_prompt=8, big_capacity=18)
#: examples per lane on the interpreter, per profile: its cases are SMALL (the interpreter is ~1000x slower
#: than PyTorch), so more of them; each still covers ragged requests in several modes at once.
INTERPRETED_EXAMPLES = {"ci": 30, "thorough": 300}


# ----------------------------------------------------------------------------- operations
@dataclass(frozen=True)
class Op:
    """One validated operation: the adapter attributes it needs, its cases, its property."""

    key: str
    needs: tuple
    summary: str
    strategy: Callable  # (sizes, case_kw) -> strategy of a params dict
    check: Callable  # (impl_obj, params, dtype, device, form) -> list[Comparison]
    form: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.key}[{self.form}]" if self.form else self.key

    def with_form(self, form: str) -> "Op":
        return Op(self.key, self.needs, self.summary, self.strategy, self.check, form)


#: Gate and beta regimes drawn, weighted by repetition towards the informative ones (and hypothesis
#: shrinks towards the first): with g = 0 (no decay), an underflowing decay (everything before the
#: last token vanishes) or beta = 0 (nothing written) many wrong formulas agree with the right one.
#: The degenerate regimes still come up, a quarter of the time.
GATES = ("mild", "strong", "mixed", "mild", "strong", "mixed", "zero", "underflow")
BETAS = ("uniform", "mixed", "uniform", "mixed", "one", "zero")


def _case_kw(s: Sizes, kw: dict) -> dict:
    return dict(max_H=s.max_H, max_group=s.max_group, dims=s.dims, gates=GATES, betas=BETAS, **kw)


def _cases(s, kw):
    from hypothesis import strategies as st
    return st.fixed_dictionaries({"case": kst.cases(max_B=s.max_B, max_T=s.max_T, **_case_kw(s, kw))})


def _chunk_params(s, kw):
    from hypothesis import strategies as st
    return st.fixed_dictionaries({"case": kst.cases(max_B=s.max_B, max_T=s.max_T + 8, **_case_kw(s, kw)),
                                  "chunk_size": st.sampled_from([1, 2, 3, 5, 8, 64])})


def _buffer_params(s, kw, min_new=0):
    return kst.buffer_setups(max_capacity=s.max_capacity, max_history=s.max_history, min_new=min_new,
                             max_new=s.max_new, max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


def _flush_params(s, kw):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        p = d(_buffer_params(s, kw, min_new=1))
        steps = p["case"].T - p["history"]
        p["flushes"] = d(kst.flush_schedules(p["case"].B, steps, p["capacity"], min_flushes=1, lengths=p["lengths"]),
                         label="flushes")
        return p
    return draw()


def _materialize_params(s, kw):
    return kst.buffer_setups(max_capacity=s.max_capacity, max_history=s.max_history, min_new=0, max_new=0,
                             max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


def _chain_params(s, kw):
    return kst.chain_setups(max_capacity=s.max_capacity, max_B=s.max_B, max_drafts=s.max_chain,
                            max_history=s.max_history, max_after=s.max_after, big_capacity=s.big_capacity,
                            **_case_kw(s, kw))


def _tree_params(s, kw):
    return kst.tree_setups(max_capacity=s.max_capacity, max_B=s.max_B, max_drafts=s.max_tree,
                           max_history=s.max_history, max_after=s.max_after, big_capacity=s.big_capacity,
                           **_case_kw(s, kw))


def _prefill_params(s, kw):
    return kst.prefill_setups(max_capacity=s.max_capacity, max_prompt=s.max_prompt, max_new=s.max_new // 2 + 1,
                              max_B=s.max_B, big_capacity=s.big_capacity, **_case_kw(s, kw))


# ----------------------------------------------------------------------------- anchor cases
# A few fixed cases per operation that every run checks first (hypothesis explicit examples), before
# the fresh random ones: each hits the paths a kernel is most likely to get wrong at once, whatever
# the seed: more cached rows than a 16-row tile (C = 18), more value columns than a 128-column tile
# (V = 136), grouped heads, a direct-mode request whose full buffer folds, requests that own a state
# and fill up, partial flushes that keep entries, acceptances past the capacity, both gate kinds.
def _anchors() -> dict:
    def c(B, T, H, HV, K, V, channel, gate="mild", beta="uniform", seed=1):
        return Case(B=B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel, gate=gate, beta=beta, seed=seed)

    return {
        "recurrent": [dict(case=c(2, 3, 2, 4, 8, 136, False)), dict(case=c(1, 3, 1, 2, 5, 7, True, "strong"))],
        "recurrent_decode": [dict(case=c(2, 3, 2, 4, 8, 136, False)), dict(case=c(1, 3, 1, 2, 5, 7, True, "strong"))],
        "chunk": [dict(case=c(2, 11, 2, 4, 7, 5, False), chunk_size=4),
                  dict(case=c(1, 9, 1, 2, 5, 6, True, "strong"), chunk_size=3)],
        "direct": [dict(case=c(2, 7, 2, 4, 7, 5, False)), dict(case=c(1, 6, 1, 2, 5, 6, True, "strong"))],
        "decode": [dict(case=c(3, 21, 2, 4, 8, 136, False), capacity=18, history=18, lengths=[18, 17, 5]),
                   dict(case=c(2, 11, 1, 2, 5, 7, True, "strong"), capacity=3, history=7, lengths=[3, 1])],
        "flush": [dict(case=c(2, 12, 2, 4, 6, 136, False), capacity=5, history=9, lengths=[5, 4],
                       flushes={0: [3, 2], 1: None, 2: [1, 0]}),
                  dict(case=c(2, 7, 1, 2, 3, 5, True, "strong"), capacity=4, history=4, lengths=[4, 2],
                       flushes={0: [2, 1], 2: [1, 2]})],
        "materialize": [dict(case=c(2, 18, 2, 4, 8, 136, False), capacity=18, lengths=[18, 3]),
                        dict(case=c(2, 6, 1, 2, 5, 6, True, "strong"), capacity=4, lengths=[4, 2])],
        "verify_chain": [dict(case=c(2, 13, 2, 4, 6, 136, False), capacity=4, history=6, lengths=[4, 2],
                              parents=[[-1, 0, 1, 2, 3]] * 2, num_drafts=[5, 3], nodes=[4, 1], after=2,
                              use_counts=True)],
        "verify_tree": [dict(case=c(2, 13, 1, 2, 5, 7, True, "strong"), capacity=3, history=5, lengths=[3, 1],
                             parents=[[-1, 0, 0, 1, 3, -1], [-1, 0, -1, 2, 3, 4]], num_drafts=[6, 4],
                             nodes=[4, 3], after=2, use_counts=False)],
        "prefill": [dict(case=c(2, 13, 2, 4, 6, 7, False), capacity=4, prompt=10, tail=None, chunk_size=3),
                    dict(case=c(1, 8, 1, 2, 5, 6, True, "strong"), capacity=3, prompt=6, tail=3, chunk_size=4)],
    }


ANCHORS = _anchors()


def _no_case(p: dict) -> dict:
    return {k: v for k, v in p.items() if k != "case"}


OPS: tuple[Op, ...] = (
    Op("recurrent", ("recurrent_gated_delta_rule",), "recurrent form (output and final state) from a random state",
       _cases, lambda o, p, dt, dev, f: P.check_recurrent(o, p["case"], dt, device=dev)),
    Op("recurrent_decode", ("recurrent_decode",), "in-place single-token step, run once per token",
       _cases, lambda o, p, dt, dev, f: P.check_recurrent(stepwise_recurrent(o.recurrent_decode), p["case"], dt,
                                                          device=dev)),
    Op("chunk", ("chunk_gated_delta_rule",), "chunkwise form, any T and chunk size",
       _chunk_params, lambda o, p, dt, dev, f: P.check_chunk(o, p["case"], dt, chunk_size=p["chunk_size"], device=dev)),
    Op("direct", ("direct_gated_delta_rule",), "direct mode (no state) == recurrence from zero",
       _cases, lambda o, p, dt, dev, f: P.check_direct(o, p["case"], dt, device=dev)),
    Op("decode", ("buffered_decode", "flush"), "buffered decode after ragged buffers (unused slots poisoned)",
       _buffer_params, lambda o, p, dt, dev, f: P.check_decode(o, p["case"], dt, form=f, device=dev, poison=True,
                                                               **_no_case(p))),
    Op("flush", ("buffered_decode", "flush"), "flush schedules (partial, repeated) are invisible",
       _flush_params, lambda o, p, dt, dev, f: P.check_decode(o, p["case"], dt, form=f, device=dev, poison=True,
                                                              **_no_case(p))),
    Op("materialize", ("materialize_state",), "materialize_state == the recurrence's state, buffer unchanged",
       _materialize_params, lambda o, p, dt, dev, f: P.check_materialize(
           o, p["case"], dt, capacity=p["capacity"], lengths=p["lengths"], form=f, device=dev, poison=True)),
    Op("verify_chain", ("verify", "accept", "buffered_decode", "flush"),
       "chain verify of ragged drafts, accept counts, decode on",
       _chain_params, lambda o, p, dt, dev, f: P.check_verify_accept(o, p["case"], dt, form=f, device=dev,
                                                                     poison=True, **_no_case(p))),
    Op("verify_tree", ("verify", "accept", "buffered_decode", "flush"),
       "tree verify (per-path recurrence), accept a node, decode on",
       _tree_params, lambda o, p, dt, dev, f: P.check_verify_accept(o, p["case"], dt, form=f, device=dev,
                                                                    poison=True, **_no_case(p))),
    Op("prefill", ("prefill", "buffered_decode", "flush"), "prefill hand-off at any split, then decode",
       _prefill_params, lambda o, p, dt, dev, f: P.check_prefill(o, p["case"], dt, form=f, device=dev, **_no_case(p))),
)
#: Operations whose lanes exist once per buffer form.
FORM_OPS = {"decode", "flush", "materialize", "verify_chain", "verify_tree", "prefill"}
OP_KEYS = tuple(o.key for o in OPS)


def _expand_forms(op: Op, forms: Sequence[str]) -> list[Op]:
    return [op.with_form(f) for f in ("u", "raw") if f in forms] if op.key in FORM_OPS else [op]


def select_ops(spec: Optional[str]) -> list[tuple[str, Optional[str]]]:
    """--ops 'decode,verify_tree[u]' -> [(key, form or None)]; None = every operation."""
    if spec is None or not spec.strip():
        return [(k, None) for k in OP_KEYS]
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"([a-z_]+)(?:\[(u|raw)\])?", item)
        if not m or m.group(1) not in OP_KEYS:
            raise ValidationError(f"--ops: unknown operation {item!r}; known: {', '.join(OP_KEYS)} "
                                  f"(a buffer operation may name its form, e.g. decode[u])")
        if m.group(2) and m.group(1) not in FORM_OPS:
            raise ValidationError(f"--ops: {m.group(1)} has no buffer form, got {item!r}")
        out.append((m.group(1), m.group(2)))
    if not out:
        raise ValidationError("--ops: no operation given")
    return out


def parse_dtypes(spec: Optional[str]) -> Optional[list[torch.dtype]]:
    if spec is None or not spec.strip():
        return None
    out = []
    for name in (x.strip().lower().replace("torch.", "") for x in spec.split(",")):
        if name not in DTYPES:
            raise ValidationError(f"--dtype: unknown dtype {name!r}; known: float64, float32, float16, bfloat16")
        if DTYPES[name] not in out:
            out.append(DTYPES[name])
    return out


# ----------------------------------------------------------------------------- plan
@dataclass
class Lane:
    """One (operation, implementation, dtype) to run, or a row saying why it is not run."""

    op: Op
    impl: Implementation
    dtype: Optional[torch.dtype]
    status: str = "RUN"  # RUN, or NOT PROVIDED / SKIP with a reason
    reason: str = ""


def plan(impls: Sequence[Implementation], ops=None, dtypes: Optional[Sequence[torch.dtype]] = None,
         device: str = "cpu") -> list[Lane]:
    """Every lane: what runs, and for everything else a NOT PROVIDED / SKIP row with its reason."""
    selected = ops or [(k, None) for k in OP_KEYS]
    lanes = []
    for impl in impls:
        for op in OPS:
            wanted = [f for k, f in selected if k == op.key]
            if not wanted:
                continue
            missing = [a for a in op.needs if not impl.has(a) or a in impl.not_provided]
            if missing:
                reasons = [impl.not_provided[a] for a in missing if a in impl.not_provided]
                why = reasons[0] if reasons else f"the adapter has no {', '.join(missing)}"
                lanes.append(Lane(op, impl, None, "NOT PROVIDED", why))
                continue
            if op.key in FORM_OPS:
                forms = sorted({f for f in wanted if f} or {"u", "raw"}, key=["u", "raw"].index)
                variants = [op.with_form(f) for f in forms if f in impl.forms]
                absent = [op.with_form(f) for f in forms if f not in impl.forms]
            else:
                variants, absent = [op], []
            if dtypes is None:
                use = [d for d in DEFAULT_DTYPES if d in impl.dtypes] or [impl.dtypes[0]]
            else:
                use = list(dtypes)
            for v in variants:
                for dt in use:
                    if dt not in impl.dtypes:
                        lanes.append(Lane(v, impl, dt, "NOT PROVIDED",
                                          f"the adapter declares dtypes {[dtype_name(d) for d in impl.dtypes]}"))
                    elif dt == torch.bfloat16 and impl.interpreted:
                        lanes.append(Lane(v, impl, dt, "SKIP", "the Triton interpreter mishandles bfloat16 "
                                                               "(run --device cuda)"))
                    else:
                        lanes.append(Lane(v, impl, dt))
            for v in absent:
                lanes.append(Lane(v, impl, None, "NOT PROVIDED", f"the adapter declares buffer forms {list(impl.forms)}"))
    return lanes


# ----------------------------------------------------------------------------- running one lane
@dataclass
class LaneResult:
    operation: str
    implementation: str
    dtype: Optional[str]
    status: str  # PASS, FAIL, ERROR, NOT PROVIDED, SKIP
    cases: int = 0
    worst_rel: Optional[float] = None
    budget: Optional[float] = None
    worst_comparison: Optional[str] = None
    seconds: float = 0.0
    reason: str = ""
    seed: Optional[int] = None
    failure: Optional[dict] = None

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "ERROR")


def _jsonable(x):
    if isinstance(x, torch.dtype):
        return dtype_name(x)
    if is_dataclass(x) and not isinstance(x, type):
        return {k: _jsonable(v) for k, v in asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    return x


def _severity(c) -> tuple:
    """Order comparisons for the report's "worst" column: closest to (or past) its budget first, but a
    comparison whose own float32 baseline lost every digit (baseline rel-RMS >= 0.5: e.g. a truth of
    1e-45 from an underflowing decay, which float32 rounds to 0) only when no other exists; the
    verdict does not depend on this order."""
    return (c.baseline_rel < 0.5 or not c.passed, _ratio(c))


def _ratio(c) -> float:
    if c.nonfinite or c.worst_rel != c.worst_rel:
        return float("inf")
    if c.budget <= 0:
        return 0.0 if c.worst_rel == 0 else float("inf")
    return c.worst_rel / c.budget


_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def lane_seed(seed: int, impl: str, op: str, dtype: str) -> int:
    return zlib.crc32(f"{seed}|{impl}|{op}|{dtype}".encode()) & 0x7FFFFFFF


def _run_lane(lane: Lane, *, device: str, profile: str, seed: int, max_examples: Optional[int], shrink: bool,
              replay: Optional[str]) -> LaneResult:
    from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings
    from hypothesis import reproduce_failure as _repro
    from hypothesis import seed as _seed

    impl, op, dt = lane.impl, lane.op, lane.dtype
    sizes = SMALL if impl.interpreted else NORMAL
    case_kw = {} if impl.supports_channel_gate(op.needs) else {"channel_gate": False}
    base = settings.get_profile(profile)
    n = max_examples or (INTERPRETED_EXAMPLES.get(profile, base.max_examples) if impl.interpreted
                         else base.max_examples)
    phases = [p for p in base.phases if shrink or p != Phase.shrink]
    cfg = settings(base, max_examples=n, database=None, derandomize=False, deadline=None, print_blob=True,
                   report_multiple_bugs=False, phases=phases, suppress_health_check=list(HealthCheck),
                   verbosity=Verbosity.quiet)
    lseed = lane_seed(seed, impl.name, op.name, dtype_name(dt))
    state: dict[str, Any] = dict(cases=0, worst=None, failure=None)

    def body(params):
        state["cases"] += 1
        try:
            comps = op.check(impl.obj, params, dt, device, op.form)
        except Exception as e:
            state["failure"] = dict(params=params, error=f"{type(e).__name__}: {e}", traceback=_where(e),
                                    comparisons=[])
            raise
        bad = [c for c in comps if not c.passed]
        if bad:
            state["failure"] = dict(params=params, error=None, comparisons=comps,
                                    worst=max(bad, key=_severity))
            raise AssertionError("; ".join(str(c) for c in bad))
        for c in comps:
            if state["worst"] is None or _severity(c) > _severity(state["worst"]):
                state["worst"] = c

    test = given(params=op.strategy(sizes, case_kw))(body)
    anchors = []
    for a in ANCHORS.get(op.key, []):
        if case_kw.get("channel_gate") is False and a["case"].channel_gate:
            a = dict(a, case=replace(a["case"], channel_gate=False))
        anchors.append(a)
    if not replay:
        for a in reversed(anchors):
            test = example(params=a)(test)
    test = cfg(test)
    test = _seed(lseed)(test)
    if replay:
        test = _repro(_hypothesis_version(), replay.encode())(test)
    t0 = time.perf_counter()
    res = LaneResult(op.name, impl.name, dtype_name(dt), "PASS", seed=lseed)
    try:
        with warnings.catch_warnings():
            # numpy overflow notes from the Triton interpreter (exp of a large difference, then masked)
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton(\.|$)")
            test()
    except Exception as e:  # a failing property, an exception in the implementation, or hypothesis itself
        notes = [str(x) for x in getattr(e, "__notes__", [])]
        fail = state["failure"]
        m = next((_BLOB.search(x) for x in notes if _BLOB.search(x)), None)
        if fail is None:
            res.status = "ERROR"
            res.failure = dict(error=f"{type(e).__name__}: {e}", notes=notes, traceback=_where(e))
        else:
            res.status = "FAIL"
            worst = fail.get("worst")
            if worst is not None:
                res.worst_rel, res.budget, res.worst_comparison = worst.worst_rel, worst.budget, worst.name
            res.failure = dict(
                case=fail["params"].get("case"),
                params=_no_case(fail["params"]),
                error=fail.get("error"),
                traceback=fail.get("traceback"),
                comparisons=[str(c) for c in fail["comparisons"]],
                blob=m.group(2) if m else None,
                hypothesis_version=m.group(1) if m else None,
                anchor=next((i for i, a in enumerate(anchors) if a == fail["params"]), None),
                notes=notes,
            )
    res.cases = state["cases"]
    if res.status == "PASS" and state["worst"] is not None:
        w = state["worst"]
        res.worst_rel, res.budget, res.worst_comparison = w.worst_rel, w.budget, w.name
    res.seconds = time.perf_counter() - t0
    return res


def _where(e: BaseException) -> str:
    """The innermost frames of an exception, one line each (file:line in function)."""
    frames = traceback.extract_tb(e.__traceback__)[-3:]
    return "\n".join(f"{f.filename}:{f.lineno} in {f.name}" for f in frames)


def _hypothesis_version() -> str:
    import hypothesis
    return hypothesis.__version__


# ----------------------------------------------------------------------------- report
@dataclass
class Report:
    profile: str
    seed: int
    device: str
    triton: str
    lanes: list = field(default_factory=list)
    seconds: float = 0.0
    argv: Optional[list] = None

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.lanes)

    @property
    def ran(self) -> int:
        return sum(r.status in ("PASS", "FAIL", "ERROR") for r in self.lanes)

    def to_json(self) -> dict:
        return _jsonable(dict(
            tool="kvbuffer validate", profile=self.profile, seed=self.seed, device=self.device, triton=self.triton,
            seconds=round(self.seconds, 3), passed=self.passed, argv=self.argv,
            summary={s: sum(r.status == s for r in self.lanes) for s in ("PASS", "FAIL", "ERROR", "SKIP", "NOT PROVIDED")},
            results=[asdict(r) for r in self.lanes],
        ))


_COLS = ("operation", "implementation", "dtype", "cases", "worst rel-RMS", "budget", "result", "time")
_WIDTHS = (18, 16, 9, 6, 14, 10, 13, 7)


def _fmt_row(cells) -> str:
    return "  ".join(str(c).ljust(w) if i < 3 or i == 6 else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(cells, _WIDTHS))).rstrip()


def table_header() -> str:
    return _fmt_row(_COLS) + "\n" + _fmt_row(["-" * w for w in _WIDTHS])


def table_row(r: LaneResult) -> str:
    if r.status in ("NOT PROVIDED", "SKIP"):
        return _fmt_row([r.operation, r.implementation, r.dtype or "-", "-", "-", "-", r.status, "-"]) + \
            f"   ({r.reason})"
    f = (lambda x: "-" if x is None else (f"{x:.2e}" if x == x and x != float("inf") else str(x)))
    return _fmt_row([r.operation, r.implementation, r.dtype, r.cases, f(r.worst_rel), f(r.budget), r.status,
                     f"{r.seconds:.1f}s"])


def format_table(report: Report) -> str:
    return "\n".join([table_header()] + [table_row(r) for r in report.lanes])


def replay_command(r: LaneResult, impl_spec: Optional[str], seed: int, profile: str, device: str) -> str:
    parts = ["kvbuffer validate"]
    if impl_spec:
        parts.append(f"--impl {impl_spec}")
    parts += [f"--ops {r.operation}", f"--dtype {r.dtype}", f"--profile {profile}", f"--device {device}",
              f"--seed {seed}"]
    return " ".join(parts)


def format_failure(r: LaneResult, replay_cmd: str) -> str:
    f = r.failure or {}
    lines = [f"{r.status}: {r.operation} / {r.implementation} / {r.dtype}"]
    if f.get("case") is not None:
        lines.append(f"  smallest failing case: {f['case']!r}")
        if f.get("params"):
            lines.append("  with: " + ", ".join(f"{k}={v!r}" for k, v in f["params"].items()))
    if f.get("error"):
        lines.append(f"  the implementation raised {f['error']}")
        if f.get("traceback"):
            lines += ["    at " + x for x in f["traceback"].rstrip().splitlines()]
    for c in f.get("comparisons") or []:
        lines.append(f"  {c}")
    lines.append(f"  replay: {replay_cmd}")
    if f.get("anchor") is not None:
        lines.append(f"  (anchor case {f['anchor']} of {r.operation.split('[')[0]}: a fixed case every run checks "
                     f"first, so the replay fails the same way with any seed)")
    elif f.get("blob"):
        lines.append(f"  or add @reproduce_failure('{f['hypothesis_version']}', b'{f['blob']}') to a test of it, "
                     f"or: {replay_cmd} --replay {f['blob']}")
    if r.status == "ERROR":
        for n in f.get("notes") or []:
            lines.append(f"  {n.strip()}")
    return "\n".join(lines)


def run_validation(impls: Sequence[Implementation], *, ops=None, dtypes=None, profile: str = "ci",
                   device: str = "cpu", seed: Optional[int] = None, max_examples: Optional[int] = None,
                   shrink: bool = True, fail_fast: bool = False, replay: Optional[str] = None,
                   on_result: Optional[Callable[[LaneResult], None]] = None) -> Report:
    """Run every lane of ``plan(impls, ops, dtypes)``; return the ``Report``.

    seed: None draws a fresh one (printed in the report; pass it back to replay the run).
    on_result: called with each ``LaneResult`` as soon as it is known (the CLI prints rows with it).
    """
    from .testing.profiles import PROFILES, register_profiles

    if profile not in PROFILES:
        raise ValidationError(f"--profile: expected one of {PROFILES}, got {profile!r}")
    register_profiles()  # the lanes read the profile's settings; the globally loaded profile is left alone
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValidationError("--device cuda: CUDA is not available on this machine")
    from .adapters import interpreter_active
    triton = "interpreter (TRITON_INTERPRET=1)" if interpreter_active() else ("compiled" if device == "cuda" else "-")
    report = Report(profile=profile, seed=seed, device=device, triton=triton, argv=list(sys.argv))
    lanes = plan(impls, ops, dtypes, device)
    if replay and sum(l.status == "RUN" for l in lanes) != 1:
        raise ValidationError("--replay: select exactly one lane (one --impl, one --ops operation with its form, "
                              "one --dtype)")
    if not any(l.status == "RUN" for l in lanes):
        report.lanes = [LaneResult(l.op.name, l.impl.name, l.dtype and dtype_name(l.dtype), l.status, reason=l.reason)
                        for l in lanes]
        raise _NothingToRun(report)
    prepared = set()
    t0 = time.perf_counter()
    stop = False
    for lane in lanes:
        if lane.status != "RUN":
            r = LaneResult(lane.op.name, lane.impl.name, lane.dtype and dtype_name(lane.dtype), lane.status,
                           reason=lane.reason)
        elif stop:
            r = LaneResult(lane.op.name, lane.impl.name, dtype_name(lane.dtype), "SKIP",
                           reason="--fail-fast: an earlier lane failed")
        else:
            if id(lane.impl) not in prepared:
                lane.impl.prepare()
                prepared.add(id(lane.impl))
            r = _run_lane(lane, device=device, profile=profile, seed=seed, max_examples=max_examples, shrink=shrink,
                          replay=replay)
            stop = fail_fast and r.failed
        report.lanes.append(r)
        if on_result:
            on_result(r)
    report.seconds = time.perf_counter() - t0
    return report


class _NothingToRun(ValidationError):
    def __init__(self, report: Report):
        super().__init__("nothing to validate: the selected implementations provide none of the selected "
                         "operations / dtypes")
        self.report = report


NothingToRun = _NothingToRun


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report.to_json(), fh, indent=2)
        fh.write("\n")
