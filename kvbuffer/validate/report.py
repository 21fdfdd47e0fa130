"""The results of ``kvbuffer validate``: one ``LaneResult`` per lane, the ``Report``, the table, the
failure report and the JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Optional

import torch

import kvbuffer_ref

from .lanes import dtype_name

__all__ = ["LaneResult", "Report", "severity", "over_correct", "format_over_correct", "table_header", "table_row",
           "format_table", "replay_command", "format_failure", "write_json"]


@dataclass
class LaneResult:
    """The verdict on one lane: its status, the cases run, the comparison closest to its budget and,
    for a failure, the smallest failing case and how to replay it (``failure``)."""

    operation: str
    implementation: str
    dtype: Optional[str]
    status: str  # PASS, FAIL, ERROR, NOT PROVIDED, SKIP, NOT RUN
    cases: int = 0
    worst_rel: Optional[float] = None
    budget: Optional[float] = None
    worst_comparison: Optional[str] = None
    #: at the deciding comparison: its error / budget (the gain check's included; above 1 fails) and a correct
    #: kernel's error on the same slice in the declared arithmetic (``Comparison.baseline_rel``)
    margin: Optional[float] = None
    baseline: Optional[float] = None
    seconds: float = 0.0
    reason: str = ""
    seed: Optional[int] = None
    failure: Optional[dict] = None
    klass: Optional[str] = None  # the class of bug a failure is attributed to (runner.CLASSES)
    why: Optional[str] = None  # what made it that class
    calls: int = 0  # implementation calls (each example is a sequence of calls: the state-leak check)
    checks: int = 0  # informative comparisons made, a failing lane's too (a truth of all zeros or a constant is not one)
    vacuous: int = 0  # examples with no informative comparison
    sizes: Optional[str] = None  # the size budget the lane ran under (the implementation declares it)
    contract: str = "ieee"  # the arithmetic contract the lane was judged by (the adapter declares it)
    also: Optional[dict] = None  # a failing lane run again under the tightest looser contract: its verdict
    ratios: Optional[dict] = None  # a passing lane: {contract: worst error / budget under it}
    #: {reason: calls} the implementation declined (``Implementation.declines``: shapes its kernel cannot take):
    #: not run, counted here and named in the table and the summary
    declined: Optional[dict] = None

    def contract_note(self) -> str:
        """Both verdicts when they differ ("FAIL as fp32; PASS as tf32: error consistent with TF32
        products"), each from a complete run of the lane (``runner.run_lane``)."""
        return (self.also or {}).get("text", "")

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


def severity(c) -> tuple:
    """Order comparisons for the report's "worst" column: closest to (or past) its budget first, but a
    comparison whose own float32 baseline lost every digit (baseline rel-RMS >= 0.5: e.g. a truth of
    1e-45 from an underflowing decay, which float32 rounds to 0) only when no other exists; the
    verdict does not depend on this order."""
    return (c.baseline_rel < 0.5 or not c.passed, _ratio(c))


def _ratio(c) -> float:
    """The comparison's largest error / budget (its RMS and its gain check's)."""
    if c.nonfinite or c.worst_rel != c.worst_rel:
        return float("inf")
    if c.ratio:
        return c.ratio
    if c.budget <= 0:
        return 0.0 if c.worst_rel == 0 else float("inf")
    return c.worst_rel / c.budget


def run_environment() -> dict:
    """Where a run ran: the Python environment (``sys.prefix``), its interpreter, the working directory,
    the host and the versions of kvbuffer and torch (``kvbuffer report`` names the run by them)."""
    return dict(prefix=sys.prefix, python=sys.executable, python_version=platform.python_version(), cwd=os.getcwd(),
                host=platform.node(), kvbuffer=kvbuffer_ref.__version__, torch=torch.__version__)


@dataclass
class Report:
    """A whole run: its settings (profile, seed, device, how Triton ran), when and where it ran, and one
    result per lane."""

    profile: str
    seed: int
    device: str
    triton: str
    lanes: list = field(default_factory=list)
    seconds: float = 0.0
    argv: Optional[list] = None
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %z"))
    environment: dict = field(default_factory=run_environment)

    @property
    def implementations(self) -> list:
        """The implementations of the run, in the order of its lanes."""
        return list(dict.fromkeys(r.implementation for r in self.lanes))

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.lanes)

    @property
    def ran(self) -> int:
        return sum(r.status in ("PASS", "FAIL", "ERROR") for r in self.lanes)

    @property
    def complete(self) -> bool:
        """False when a selected implementation could not run at all here (NOT RUN rows) or declined cases
        of a lane (``LaneResult.declined``)."""
        return not any(r.status == "NOT RUN" or r.declined for r in self.lanes)

    def not_run_reasons(self) -> dict:
        """{implementation: why it was not run} for every NOT RUN implementation."""
        return {r.implementation: r.reason for r in self.lanes if r.status == "NOT RUN"}

    def summary_line(self) -> str:
        """The last line of a run: the verdict, the counts, and, for an incomplete run, what was not run
        and why (a run that skipped an implementation says so; it exits 0 when every lane run passed)."""
        c = {s: sum(r.status == s for r in self.lanes) for s in ("PASS", "FAIL", "ERROR", "SKIP", "NOT PROVIDED",
                                                                 "NOT RUN")}
        verdict = "FAILED" if not self.passed else ("PASSED" if self.complete else "PASSED, INCOMPLETE")
        line = (f"{verdict}: {c['PASS']} passed, {c['FAIL'] + c['ERROR']} failed, {c['NOT PROVIDED']} not provided, "
                f"{c['SKIP']} skipped, {c['NOT RUN']} not run in {self.seconds:.1f}s (seed {self.seed})")
        for name, why in self.not_run_reasons().items():
            line += f"\nNOT RUN: {name}: {why}"
        for r in self.lanes:
            for why, n in (r.declined or {}).items():
                line += f"\nDECLINED: {r.operation} / {r.implementation} / {r.dtype}: {n} call(s): {why}"
        return line

    def to_json(self) -> dict:
        return _jsonable(dict(
            tool="kvbuffer validate", profile=self.profile, seed=self.seed, device=self.device, triton=self.triton,
            seconds=round(self.seconds, 3), passed=self.passed, complete=self.complete, argv=self.argv,
            started=self.started, environment=self.environment, implementations=self.implementations,
            summary={s: sum(r.status == s for r in self.lanes)
                     for s in ("PASS", "FAIL", "ERROR", "SKIP", "NOT PROVIDED", "NOT RUN")},
            not_run=self.not_run_reasons(),
            results=[asdict(r) for r in self.lanes],
        ))


_COLS = ("operation", "implementation", "dtype", "cases", "worst rel-RMS", "budget", "err/budget", "err/correct",
         "result", "time", "checks")
_WIDTHS = (18, 16, 9, 6, 14, 10, 10, 11, 22, 7, 7)
_RESULT = _COLS.index("result")
#: The widest the operation and implementation columns grow (``column_widths``); longer names are cut in
#: the middle with "…" in the table (failures and the JSON keep them whole).
MAX_NAME_WIDTH = 40


def column_widths(implementations=(), operations=()) -> tuple:
    """The table's column widths, the operation and implementation columns sized to the longest name
    given (at least the default, at most ``MAX_NAME_WIDTH``): the CLI passes the names of its run before
    the first row is printed, so every row lines up under the header."""
    w = list(_WIDTHS)
    for i, names in ((0, operations), (1, implementations)):
        w[i] = min(MAX_NAME_WIDTH, max([w[i]] + [len(str(n)) for n in names]))
    return tuple(w)


def _fit(text: str, width: int) -> str:
    text = str(text)
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _fmt_row(cells, widths=None) -> str:
    widths = widths or _WIDTHS
    return "  ".join((_fit(c, w) if i < 2 else str(c)).ljust(w) if i < 3 or i == _RESULT else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(cells, widths))).rstrip()


def table_header(widths=None) -> str:
    """The header of the table (``widths``: ``column_widths`` of the run, else the defaults)."""
    widths = widths or _WIDTHS
    return _fmt_row(_COLS, widths) + "\n" + _fmt_row(["-" * w for w in widths], widths)


def table_row(r: LaneResult, widths=None) -> str:
    """One lane's row; a failed lane shows its class and the checks it made before it failed."""
    if r.status in ("NOT PROVIDED", "SKIP", "NOT RUN"):
        return _fmt_row([r.operation, r.implementation, r.dtype or "-", "-", "-", "-", "-", "-", r.status, "-"],
                        widths) + \
            f"   ({r.reason})"
    f = (lambda x: "-" if x is None else (f"{x:.2e}" if x == x and x != float("inf") else str(x)))
    status = f"{r.status} [{r.klass}]" if r.failed and r.klass else r.status
    row = _fmt_row([r.operation, r.implementation, r.dtype, r.cases, f(r.worst_rel), f(r.budget), _margin(r),
                    _over_correct(r), status, f"{r.seconds:.1f}s", r.checks], widths)
    notes = [r.contract_note()] + [f"{n} call(s) declined: {why}" for why, n in (r.declined or {}).items()]
    notes = [n for n in notes if n]
    return row + (f"   ({'; '.join(notes)})" if notes else "")


def _margin(r: LaneResult) -> str:
    """The lane's worst error / budget, as the table prints it ("-" when nothing was compared)."""
    if r.margin is None:
        return "-"
    return "inf" if r.margin == float("inf") else f"{r.margin:.2f}"


def over_correct(worst_rel: Optional[float], baseline: Optional[float]) -> Optional[float]:
    """A lane's deciding error over a correct kernel's error on the same slice in the declared arithmetic
    (``LaneResult.worst_rel`` / ``LaneResult.baseline``; None when nothing was compared; inf when that kernel
    was exact and this one was not)."""
    if worst_rel is None or baseline is None:
        return None
    if baseline > 0:
        return worst_rel / baseline
    return 0.0 if worst_rel == 0 else float("inf")


def format_over_correct(x: Optional[float], none: str = "-") -> str:
    """``over_correct``'s value as the table and ``kvbuffer report`` print it ("3.1x", "inf"; ``none`` for None)."""
    return none if x is None else "inf" if x == float("inf") else f"{x:.3g}x"


def _over_correct(r: LaneResult) -> str:
    return format_over_correct(over_correct(r.worst_rel, r.baseline))


def format_table(report: Report) -> str:
    w = column_widths(report.implementations, [r.operation for r in report.lanes])
    return "\n".join([table_header(w)] + [table_row(r, w) for r in report.lanes])


def replay_command(r: LaneResult, impl_spec: Optional[str], seed: int, profile: str, device: str) -> str:
    parts = ["kvbuffer validate"]
    if impl_spec:
        parts.append(f"--impl {impl_spec}")
    parts += [f"--ops {r.operation}", f"--dtype {r.dtype}", f"--profile {profile}", f"--device {device}",
              f"--seed {seed}"]
    return " ".join(parts)


def case_label(klass: Optional[str], failure: dict) -> str:
    """What a failure's case is: the smallest failing case, or, for an exception on a later call of an
    example (another shape after the first call), the call that raised."""
    if klass == "raised" and failure.get("call") not in (None, "the first call", "the call"):
        return f"the call that raised ({failure['call']}, after the example's earlier calls passed)"
    return "smallest failing case"


def format_failure(r: LaneResult, replay_cmd: str) -> str:
    """A failing lane in full: the class that caught it and why, the smallest failing case, what the
    implementation raised or which comparisons failed, and how to replay it."""
    f = r.failure or {}
    lines = [f"{r.status} [{r.klass or 'wrong-result'}]: {r.operation} / {r.implementation} / {r.dtype}"
             + (f" (size budget {r.sizes})" if r.sizes else "")]
    if r.contract != "ieee":
        lines.append(f"  judged by the declared contract {r.contract!r}")
    if r.why:
        lines.append(f"  caught by [{r.klass}]: {r.why}")
    if r.contract_note():
        lines.append(f"  {r.contract_note()}")
    if f.get("case") is not None:
        lines.append(f"  {case_label(r.klass, f)}: {f['case']!r}")
        if f.get("params"):
            lines.append("  with: " + ", ".join(f"{k}={v!r}" for k, v in f["params"].items()))
        if f.get("layout"):
            lines.append("  inputs passed as strided / transposed-back / sliced / storage-offset views")
    err = f.get("error")
    if err and err.startswith("["):
        lines.append(f"  {err}")
    elif err and r.klass == "validator":
        lines.append(f"  [validator] {err}")
    elif err:
        lines.append(f"  [{r.klass or 'raised'}] the implementation raised {err}")
    if f.get("traceback"):
        lines += ["    at " + x for x in f["traceback"].rstrip().splitlines()]
    for c in f.get("comparisons") or []:
        lines.append(f"  {c}" if (err or "").startswith("[") or c.startswith("PASS") else f"  [{r.klass}] {c}")
    lines.append(f"  replay: {replay_cmd}")
    if f.get("anchor") is not None:
        lines.append(f"  (anchor case {f['anchor']} of {r.operation.split('[')[0]}"
                     + (f", the boundary case {f['edge']}" if f.get("edge") else "")
                     + ": a fixed case every run checks first, so the replay fails the same way with any seed)")
    elif f.get("blob"):
        lines.append(f"  or add @reproduce_failure('{f['hypothesis_version']}', b'{f['blob']}') to a test of it, "
                     f"or: {replay_cmd} --replay {f['blob']}")
    if r.status == "ERROR":
        for n in f.get("notes") or []:
            lines.append(f"  {n.strip()}")
    return "\n".join(lines)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report.to_json(), fh, indent=2)
        fh.write("\n")
