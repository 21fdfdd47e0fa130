"""Running lanes: each one a hypothesis test over its operation's cases, then the whole ``Report``.

Every lane checks its fixed anchor cases first, then fresh random ones (a new seed each run unless
one is given), shrinks a failure to its smallest case and keeps the blob that replays it.  Every
verdict comes from the one tolerance table (``tolerances.TOLERANCES``); nothing here sets one.

    report = run_validation([resolve("fast")], profile="ci", device="cpu")
    report.passed, report.lanes, report.to_json()
"""

from __future__ import annotations

import random
import re
import sys
import time
import traceback
import warnings
import zlib
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from .adapters import Implementation, interpreter_active
from .lanes import ANCHORS, INTERPRETED_EXAMPLES, NORMAL, SMALL, Lane, ValidationError, dtype_name, op_params, plan
from .profiles import PROFILES, register_profiles
from .report import LaneResult, Report, severity

__all__ = ["lane_seed", "run_lane", "run_validation", "NothingToRun"]


_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def lane_seed(seed: int, impl: str, op: str, dtype: str) -> int:
    return zlib.crc32(f"{seed}|{impl}|{op}|{dtype}".encode()) & 0x7FFFFFFF


def run_lane(lane: Lane, *, device: str, profile: str, seed: int, max_examples: Optional[int], shrink: bool,
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
                                    worst=max(bad, key=severity))
            raise AssertionError("; ".join(str(c) for c in bad))
        for c in comps:
            if state["worst"] is None or severity(c) > severity(state["worst"]):
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
                params=op_params(fail["params"]),
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



def run_validation(impls: Sequence[Implementation], *, ops=None, dtypes=None, profile: str = "ci",
                   device: str = "cpu", seed: Optional[int] = None, max_examples: Optional[int] = None,
                   shrink: bool = True, fail_fast: bool = False, replay: Optional[str] = None,
                   on_result: Optional[Callable[[LaneResult], None]] = None) -> Report:
    """Run every lane of ``plan(impls, ops, dtypes)``; return the ``Report``.

    seed: None draws a fresh one (printed in the report; pass it back to replay the run).
    on_result: called with each ``LaneResult`` as soon as it is known (the CLI prints rows with it).
    """
    if profile not in PROFILES:
        raise ValidationError(f"--profile: expected one of {PROFILES}, got {profile!r}")
    register_profiles()  # the lanes read the profile's settings; the globally loaded profile is left alone
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValidationError("--device cuda: CUDA is not available on this machine")
    triton = "interpreter (TRITON_INTERPRET=1)" if interpreter_active() else ("compiled" if device == "cuda" else "-")
    report = Report(profile=profile, seed=seed, device=device, triton=triton, argv=list(sys.argv))
    lanes = plan(impls, ops, dtypes, device)
    if replay and sum(l.status == "RUN" for l in lanes) != 1:
        raise ValidationError("--replay: select exactly one lane (one --impl, one --ops operation with its form, "
                              "one --dtype)")
    if not any(l.status == "RUN" for l in lanes):
        report.lanes = [LaneResult(l.op.name, l.impl.name, l.dtype and dtype_name(l.dtype), l.status, reason=l.reason)
                        for l in lanes]
        raise NothingToRun(report)
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
            r = run_lane(lane, device=device, profile=profile, seed=seed, max_examples=max_examples, shrink=shrink,
                          replay=replay)
            stop = fail_fast and r.failed
        report.lanes.append(r)
        if on_result:
            on_result(r)
    report.seconds = time.perf_counter() - t0
    return report


class NothingToRun(ValidationError):
    def __init__(self, report: Report):
        super().__init__("nothing to validate: the selected implementations provide none of the selected "
                         "operations / dtypes")
        self.report = report
