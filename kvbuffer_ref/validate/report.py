"""The results of ``kvbuffer validate``: one ``LaneResult`` per lane, the ``Report``, the table, the
failure report and the JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Optional

import torch

from .lanes import dtype_name

__all__ = ["LaneResult", "Report", "severity", "table_header", "table_row", "format_table", "replay_command",
           "format_failure", "write_json"]


@dataclass
class LaneResult:
    """The verdict on one lane: its status, the cases run, the comparison closest to its budget and,
    for a failure, the smallest failing case and how to replay it (``failure``)."""

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


def severity(c) -> tuple:
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


@dataclass
class Report:
    """A whole run: its settings (profile, seed, device, how Triton ran) and one result per lane."""

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


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report.to_json(), fh, indent=2)
        fh.write("\n")
