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

from . import parallel
from . import properties as P
from .adapters import ContractViolation, Guarded, Implementation, interpreter_active, returned_changed
from .cases import GPU
from .lanes import ANCHORS, GATES, INTERPRETED_EXAMPLES, Lane, ValidationError, dtype_name, edge_params, op_params, plan
from .lanes import _with_layout as with_layout
from .profiles import PROFILES, register_profiles
from .contracts import CONTRACTS, CONTRACT_TEXT, raw_gating
from .report import LaneResult, Report, _ratio, severity
from .tolerances import active_contract

__all__ = ["lane_seed", "run_lane", "run_validation", "NothingToRun", "CLASSES", "call_sequence", "attribute",
           "lane_sizes", "Progress"]

#: The classes of bug a failure is attributed to (the report's ``[class]``), each with what finds it.
#: The first seven are issue classes the validator draws for on purpose; ``wrong-result`` is a failure no
#: single simplification explains, ``raised`` an exception from the implementation, ``vacuous`` a lane
#: whose every truth was zero or constant (it checked nothing).
CLASSES = {
    "inputs-changed": "an input tensor (or a buffer / drafts field not updated in place by contract) differs "
                      "bit for bit after the call",
    "arguments": "fails with an explicit scale, an initial state, output_final_state=False or accept by counts, "
                 "and passes with the default",
    "tile-boundary": "fails on a boundary case (a dimension past a usual tile size) that no simpler change explains",
    "state-leak": "the first call passes, and a later call's result on the same implementation (same shape, other "
                  "contents, initial_state=None; then another shape) differs, or an earlier call's result changes",
    "domain": "fails with q/k of any norm, beta past 1, reset gates (-inf, -1e30), the (-104, -8) band or a "
              "scaled v, and passes inside the narrow domain",
    "memory-layout": "fails with strided / transposed-back / sliced / storage-offset inputs and passes with "
                     "contiguous ones",
    "partial-flush": "fails with flushes of part of the buffer and passes when each flush takes all of it",
    "pool-slots": "an engine kernel changed a state-pool slot that no request of the batch owns (a pad's, a "
                  "neighbour's)",
    "wrong-result": "differs from the float64 truth",
    "raised": "the implementation raised (on any call of an example: the case reported is the call that raised)",
    "vacuous": "no example had an informative comparison",
    "validator": "the validator's own truth or budget computation raised on the case (out of memory, say): an ERROR "
                 "of the validator, no verdict on the implementation",
}


#: The gate regimes drawn for an implementation that declares ``gates = "finite"`` (and for the rest of a
#: lane after a failure on reset gates): every regime but "reset" (-inf, -1e30, -300); "wide" still reaches -200.
FINITE_GATES = tuple(g for g in GATES if g != "reset")

#: Where an adapter author reads how to declare the gate domain.
GATES_DOC = "docs/validate-your-kernel.md, \"Declare the gate domain\""


def lane_sizes(impl: Implementation, profile: str):
    """The size budget of a lane: the implementation's declared one, or production shapes for ``gpu``."""
    return GPU if profile == "gpu" and not impl.interpreted else impl.sizes


def _reseed(p: dict, salt: int) -> dict:
    return dict(p, case=replace(p["case"], seed=(p["case"].seed * 31 + salt) % (2**31 - 1)))


def _shape(p: dict):
    c = p["case"]
    return (c.B, c.T, c.H, c.HV, c.K, c.V, c.channel_gate)


def call_sequence(params: dict, anchors: list) -> list[tuple[str, dict]]:
    """The calls of one example, all on one implementation object: the example itself; the same shape
    again with other contents (and ``initial_state=None`` when the example had one); then another shape
    (the lane's smallest anchor of a different shape, other contents).  A result or workspace cached on
    the shape (or part of it), or a state kept from the previous call, fails the second or the third."""
    second = _reseed(params, 7)
    what = "the second call with the same shape (other contents"
    if params.get("initial"):
        second["initial"] = False
        what += ", initial_state=None after a call that had one"
    seq = [("the first call", params), (what + ")", second)]
    others = [a for a in anchors if _shape(a) != _shape(params)]
    if others:
        size = lambda a: a["case"].B * a["case"].T * a["case"].HV * a["case"].K * a["case"].V  # noqa: E731
        seq.append(("a third call with another shape", dict(_reseed(min(others, key=size), 11), layout=False)))
    return seq


#: The lowest gate each wide regime draws (``cases._gates``), for the [domain] text.
_GATE_FLOOR = {"band": "-104", "underflow": "-120", "mixed": "-120", "wide": "-200", "reset": "-inf"}


def _simplify(p: dict) -> list[tuple[str, str, dict]]:
    """(class, what, params): single simplifications of a failing example, tried in order by ``attribute``."""
    c = p["case"]
    out = []
    if p.get("layout") and p["layout"] != "compact":
        out.append(("memory-layout", "its inputs were strided / transposed-back / sliced / offset views "
                                     "(contiguous inputs pass)", dict(p, layout=False)))
    if not p.get("layout"):
        out.append(("memory-layout", "its per-token inputs were slices at a nonzero storage offset (fresh "
                                     "contiguous copies pass)", dict(p, layout="compact")))
    if c.scale is not None:
        out.append(("arguments", f"an explicit scale={c.scale:g} (the default scale passes)",
                    dict(p, case=replace(c, scale=None))))
    if p.get("final") is False:
        out.append(("arguments", "output_final_state=False (True passes)", dict(p, final=True)))
    if p.get("initial"):
        out.append(("arguments", "an initial_state (none passes)", dict(p, initial=False)))
    if p.get("defaults"):
        out.append(("arguments", "parents=None, num_drafts=None (the same chain passed explicitly passes)",
                    dict(p, defaults=False)))
    if p.get("index_dtype", "int64") != "int64":
        out.append(("arguments", f"{p['index_dtype']} index tensors (int64 ones pass)", dict(p, index_dtype="int64")))
    if p.get("scalar"):
        out.append(("arguments", "a count or node shared by every request passed as a Python int (the same as a "
                                 "tensor passes)", dict(p, scalar=False)))
    if p.get("stateless"):
        out.append(("arguments", "a buffer without state storage, state=None (with storage it passes)",
                    dict(p, stateless=False)))
    if p.get("use_counts"):
        out.append(("arguments", "accept by counts (the same acceptance by nodes passes)", dict(p, use_counts=False)))
    if c.norm != "unit":
        out.append(("domain", "q and k not of unit norm (unit norms pass)", dict(p, case=replace(c, norm="unit"))))
    if c.beta_max > 1 and c.beta in ("uniform", "mixed"):
        out.append(("domain", f"beta in [0, {c.beta_max:g}] (beta in [0, 1] passes)",
                    dict(p, case=replace(c, beta_max=1.0))))
    if c.gate in ("band", "wide", "reset", "mixed", "underflow"):
        out.append(("domain", f"gates of the {c.gate!r} regime, down to {_GATE_FLOOR[c.gate]} (mild gates pass)",
                    dict(p, case=replace(c, gate="mild"))))
    if c.v_scale != 1.0:
        out.append(("domain", f"v scaled by {c.v_scale:g} (v ~ N(0, 1) passes)", dict(p, case=replace(c, v_scale=1.0))))
    fl = p.get("flushes")
    if fl and any(x is not None and any(y > 0 for y in x) for x in fl.values()):
        out.append(("partial-flush", "flushes of part of the buffer (flushing all of it at the same steps passes)",
                    dict(p, flushes={t: None for t, x in fl.items() if x is None or any(y > 0 for y in x)})))
    return out


def attribute(impl: Implementation, op, params: dict, dt, device: str) -> tuple[str, str]:
    """(class, why) of a failing first call: the first single simplification (``_simplify``) that makes
    it pass names the class; else a boundary case is a tile boundary, anything else a wrong result."""
    for klass, why, q in _simplify(params):
        try:
            comps = _checked(impl, op, q, dt, device)
        except Exception:
            continue
        if all(c.passed for c in comps):
            return klass, why
    if params.get("edge"):
        return "tile-boundary", f"the boundary case {params['edge']} (past a usual tile size)"
    return "wrong-result", "the output differs from the float64 truth"


def _checked(impl: Implementation, op, params: dict, dt, device: str, returned: Optional[list] = None):
    """One property check of ``params`` through ``Guarded`` (inputs compared bit for bit after each call;
    strided / offset views when ``params['layout']``); ``returned`` collects the tensors the calls return
    (``Guarded.returned``)."""
    layout = params.get("layout") or None
    if layout is True:
        layout = random.Random(params["case"].seed)
    return op.check(Guarded(impl.obj, impl.in_place, layout, returned), params, dt, device, op.form)


def _tagged(e: BaseException) -> Optional[str]:
    """The class of a message that starts with one in brackets ("[inputs-changed] ...")."""
    m = re.match(r"\[([a-z-]+)\]", str(e))
    return m.group(1) if m and m.group(1) in CLASSES else None


_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def lane_seed(seed: int, impl: str, op: str, dtype: str) -> int:
    return zlib.crc32(f"{seed}|{impl}|{op}|{dtype}".encode()) & 0x7FFFFFFF


#: Seconds a lane may spend shrinking a failure, counted from the first failing example: past them every
#: new candidate the shrinker tries is answered as passing without being run (the examples that failed
#: still run and fail), so hypothesis stops at the smallest failing case found so far and replays it.  On
#: a GPU every candidate of another shape is a Triton compile: unbounded, a shrink ran past its stage
#: (H200, SGLang's chunk_varlen: 84 shrink tries in 176 s, 2 examples drawn).
SHRINK_SECONDS = 60.0


class Progress:
    """Cases done / total of a long lane, to stderr, at most every ``every`` seconds (a lane that ends
    sooner prints nothing), so no lane is silent for longer.  While a failure is shrunk, the shrink tries
    and the time left of ``SHRINK_SECONDS`` (the cases count every try: past the total while shrinking)."""

    def __init__(self, label: str, total: int, every: float = 2.0, stream=None):
        self.label, self.total, self.every, self.stream = label, total, every, stream
        self.t0 = self.last = time.perf_counter()
        self.printed = False

    def tick(self, done: int, shrinking: Optional[tuple] = None) -> None:
        """shrinking: (tries, seconds spent) of the shrink of a failure, None before one is found."""
        now = time.perf_counter()
        if self.stream is not None and now - self.last >= self.every:
            self.last, self.printed = now, True
            what = f"{done}/{self.total} cases"
            if shrinking is not None:
                what = (f"failure found, shrinking it: {shrinking[0]} tries, {shrinking[1]:.0f} of "
                        f"{SHRINK_SECONDS:.0f}s")
            print(f"  ... {self.label}: {what}, {now - self.t0:.0f}s", file=self.stream, flush=True)


def run_lane(lane: Lane, *, device: str, profile: str, seed: int, max_examples: Optional[int], shrink: bool,
             replay: Optional[str], progress=None, edge_part: tuple = (0, 1), explain: bool = True) -> LaneResult:
    """One lane under the implementation's declared arithmetic contract (``_run_lane``), and, with
    ``explain``, the verdicts under the other contracts that tell the kernel author what the error is
    consistent with, each a complete run of the lane: a lane that fails its comparisons is run again
    under each looser contract in turn until one passes ("FAIL as fp32; PASS as tf32: error consistent
    with TF32 products", or "not explained by a looser arithmetic contract" when none does); a lane that
    passes under a declared contract other than IEEE is run again as fp32 ("FAIL as fp32; PASS as tf32").  The lane's
    status, and the exit code, stay the declared contract's."""
    from dataclasses import replace as _replace

    def under(contract, ex):
        with active_contract(contract):
            r = _run_lane(Lane(lane.op, _replace(lane.impl, contract=contract), lane.dtype), device=device,
                          profile=profile, seed=seed, max_examples=max_examples, shrink=shrink and not ex,
                          replay=replay, progress=progress, edge_part=edge_part)
        r.contract = contract
        if r.failure:
            r.failure.pop("_comparisons", None)
        return r

    declared = lane.impl.contract_for(lane.op.name, lane.dtype)
    res = under(declared, False)
    if not explain:
        return res
    name = lambda c: CONTRACT_TEXT[c][0]  # noqa: E731
    if res.status == "PASS" and declared != "ieee":
        strict = under("ieee", True)
        verdict = "PASS" if strict.status == "PASS" else f"{strict.status} [{strict.klass}]"
        res.also = dict(contract="ieee", status=strict.status, klass=strict.klass, worst_rel=strict.worst_rel,
                        budget=strict.budget, text=f"{verdict} as fp32; PASS as {name(declared)}"
                        + ("" if strict.status == "PASS" else f": error consistent with {CONTRACT_TEXT[declared][1]}"))
        return res
    # an [arguments] failure is a comparison too (an explicit argument's results): a looser contract that
    # passes it explains it as precision; an ignored argument fails every contract ("not explained by a looser
    # arithmetic contract")
    # a failure on reset gates (non-finite, or raised) is the gate domain, not precision: no looser contract
    # explains it, and each such run would repeat the rest of the lane too
    if res.status != "FAIL" or res.klass in ("inputs-changed", "raised", "vacuous", "state-leak") \
            or not (res.failure or {}).get("comparisons") or (res.failure or {}).get("resets"):
        return res
    tried = []
    for c in CONTRACTS[CONTRACTS.index(declared) + 1:]:
        if c == "fp16" and lane.dtype != torch.float16:  # float16 products explain float16 inputs only
            continue
        again = under(c, True)
        tried.append(c)
        # under c the lane may fail on reset gates alone ([domain]) and pass the rest: the gate domain is no
        # precision, so c still explains the declared failure (which was on other gates: resets return above)
        rest = ((again.failure or {}).get("rest") or {}) if (again.status, again.klass) == ("FAIL", "domain") else {}
        if again.status == "PASS" or rest.get("status") == "PASS":
            worst, budget = (again.worst_rel, again.budget) if again.status == "PASS" else (rest.get("worst_rel"),
                                                                                          rest.get("budget"))
            gates = "" if again.status == "PASS" else f" without reset gates (on them it fails as {name(c)} too: [domain])"
            res.also = dict(contract=c, status="PASS", worst_rel=worst, budget=budget,
                            text=f"FAIL as {name(declared)}; PASS as {name(c)}{gates}: error consistent with "
                                 f"{CONTRACT_TEXT[c][1]}")
            return res
    if tried:
        res.also = dict(contract=None, text=f"FAIL as {name(declared)}; FAIL as {', '.join(map(name, tried))} too: "
                                            f"not explained by a looser arithmetic contract")
    return res


def _record_worst(res: LaneResult, c, op) -> None:
    """The lane's deciding comparison ``c`` into ``res``: its error, budget, name, margin (error / budget, the
    gain check's included) and a correct kernel's error on its slice."""
    res.worst_rel, res.budget, res.worst_comparison = c.worst_rel, c.budget, _lane_named(c.name, op)
    res.margin, res.baseline = _ratio(c), c.baseline_rel


def _run_lane(lane: Lane, *, device: str, profile: str, seed: int, max_examples: Optional[int], shrink: bool,
              replay: Optional[str], progress=None, edge_part: tuple = (0, 1), finite: bool = False,
              done: frozenset = frozenset()) -> LaneResult:
    """One lane as a hypothesis run: its anchors (each a sequence of calls, ``call_sequence``), its
    boundary cases (``edge_params``; part ``edge_part = (i, n)`` of them: interpreted implementations share
    them between the dtypes of an operation), then fresh examples.  progress: a stream for ``Progress``.

    Gates: every regime, resets included, unless the implementation declares ``gates = "finite"`` or
    ``finite`` is set (``FINITE_GATES``: the wide-domain anchor then draws the "wide" regime).  A lane that
    fails on reset gates ([domain]: non-finite, raised or wrong there, mild gates pass) is not over: the
    rest of it (the fixed cases not yet passed, ``done``, then fresh examples) runs again with the resets
    excluded (``_rest_without_resets``), and the report carries both verdicts."""
    from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings
    from hypothesis import reproduce_failure as _repro
    from hypothesis import seed as _seed

    impl, op, dt = lane.impl, lane.op, lane.dtype
    sizes = lane_sizes(impl, profile)
    case_kw = {} if impl.supports_channel_gate(op.needs) else {"channel_gate": False}
    case_kw["beta_max"] = impl.beta_max
    case_kw["qk_l2norm"] = impl.qk_l2norm
    if impl.raw_gate_dtype:  # its lanes are scalar-gated recurrent ones: ``strategies.cases`` takes it
        case_kw["raw_gate_dtype"] = impl.raw_gate_dtype
    finite = finite or impl.gates == "finite"
    if finite:  # cases.py draws the regimes the strategy is given (``strategies.cases(gates=...)``)
        case_kw["gates"] = FINITE_GATES
    base = settings.get_profile(profile)
    n = max_examples or (INTERPRETED_EXAMPLES.get(profile, base.max_examples) if impl.interpreted
                         else base.max_examples)
    phases = [p for p in base.phases if shrink or p != Phase.shrink]
    cfg = settings(base, max_examples=n, database=None, derandomize=False, deadline=None, print_blob=True,
                   report_multiple_bugs=False, phases=phases, suppress_health_check=list(HealthCheck),
                   verbosity=Verbosity.quiet)
    lseed = lane_seed(seed, impl.name, op.name, dtype_name(dt))
    state: dict[str, Any] = dict(cases=0, calls=0, checks=0, vacuous=0, worst=None, failure=None, ratios={},
                                 declined={},
                                 found=None, found_at=0, failed=set(), passed=set())
    channel_ok = case_kw.get("channel_gate") is not False
    anchors = []
    for a in ANCHORS.get(op.key, []):
        if not channel_ok and a["case"].channel_gate:
            a = dict(a, case=replace(a["case"], channel_gate=False))
        anchors.append(dict(a, layout=False, case=replace(a["case"], beta_max=impl.beta_max, qk_l2norm=impl.qk_l2norm,
                                                                raw_gate_dtype=impl.raw_gate_dtype)))
    if profile == "gpu":  # production shapes: every new shape is a compile; the small anchors are the CI's job
        anchors = anchors[:1]
    i_part, n_part = edge_part
    # an interpreted implementation's dtype lanes share the anchors past the first as they share the boundary
    # cases: each runs in one of them
    anchors = anchors[:1] + anchors[1:][i_part::n_part]
    if anchors:  # every lane: the first anchor with every read-only input a strided view, and in the wide domain
        a0 = anchors[0]
        anchors.append(dict(a0, layout="strided"))
        anchors.append(dict(a0, case=replace(a0["case"], gate="wide" if finite else "reset", norm="any",
                                             beta="uniform" if impl.beta_max > 1 else a0["case"].beta)))
    edges = edge_params(op.key, sizes, seed=lseed, channel=channel_ok)[i_part::n_part]
    edges = [dict(e, case=replace(e["case"], beta_max=impl.beta_max, qk_l2norm=impl.qk_l2norm,
                                  raw_gate_dtype=impl.raw_gate_dtype)) for e in edges]
    prog = Progress(f"{op.name} / {impl.name} / {dtype_name(dt)}", len(anchors) + len(edges) + n, stream=progress)

    def fail(params, what, i, klass=None, error=None, comps=(), worst=None, exc=None, example=None):
        """Keep the failure: ``params`` the case reported (the call that failed, or the whole example for a
        state leak), ``example`` the hypothesis example it came from (anchors are matched on it)."""
        state["failure"] = dict(params=params, error=error, klass=klass, call=what, index=i, comparisons=list(comps),
                                worst=worst, traceback=_where(exc) if exc is not None else None,
                                example=params if example is None else example)

    def body(params):
        state["cases"] += 1
        informative = 0
        single = params.get("edge") or (not sizes.sequences and bool(anchors) and params != anchors[0])
        calls = [("the call", params)] if single else call_sequence(params, anchors)
        kept: list = []  # what the calls returned: a later call must not change an earlier call's results
        ran = 0  # calls not declined
        for i, (what, p) in enumerate(calls):
            declined = impl.declines(p["case"], op=op.key) if impl.declines is not None else ""
            if declined:  # shapes the kernel cannot take: not run, counted and named in the report
                state["declined"][declined] = state["declined"].get(declined, 0) + 1
                continue
            P.LEDGER.clear()
            state["calls"] += 1
            ran += 1
            earlier = len(kept)
            try:
                comps = _checked(impl, op, p, dt, device, kept)
                made = sum(1 for _, inf in P.LEDGER if inf)  # this call's informative comparisons
                state["checks"] += made
                informative += made
                changed = returned_changed(kept[:earlier])
                if changed:
                    raise ContractViolation("state-leak", f"{changed} changed when {what} ran (a workspace or output "
                                            f"buffer returned without a copy: the caller's earlier result is "
                                            f"overwritten)")
            except AssertionError as e:
                klass = _tagged(e)
                if klass is None:
                    raise
                fail(params, what, i, klass=klass, error=str(e), exc=e)
                raise
            except P.ValidatorFault:  # the validator's own truth or budget: not the implementation's failure
                state["fault"] = dict(case=p.get("case"), params=op_params(p), call=what)
                raise
            except Exception as e:  # an exception is [raised], reported with the call that raised it (a state
                # leak is a later call's result that differs, above and below)
                fail(p, what, i, klass="raised", error=f"{type(e).__name__}: {e}", exc=e, example=params)
                raise
            bad = [c for c in comps if not c.passed]
            if bad:
                worst = max(bad, key=severity)
                own = None if not i or _leaks(calls[0][1], p) else attribute(impl, op, p, dt, device)
                if i and (own is None or own[0] in ("wrong-result", "tile-boundary")):
                    msg = (f"[state-leak] output differs on {what} (the first call passed): "
                           + "; ".join(str(c) for c in bad))
                    fail(params, what, i, klass="state-leak", error=msg, comps=comps, worst=worst)
                elif i:  # the later call's own inputs explain it (an explicit scale, a flag, ...)
                    fail(p, what, i, klass=own[0], comps=comps, worst=worst, example=params)
                    state["failure"]["why"] = f"{own[1]}, on {what}"
                else:
                    fail(p, what, i, comps=comps, worst=worst)
                raise AssertionError("; ".join(str(c) for c in bad))
            for c in comps:
                if state["worst"] is None or severity(c) > severity(state["worst"]):
                    state["worst"] = c
                for k, r in (c.ratios or {}).items():
                    state["ratios"][k] = max(state["ratios"].get(k, 0.0), r)
        state["vacuous"] += ran > 0 and informative == 0
        state["passed"].add(repr(params))
        if state["found"] is None:
            prog.tick(state["cases"])

    def _leaks(first: dict, later: dict) -> bool:
        """A later call failed: is it the order of calls?  Yes when that call, run again, passes, or when the
        first call (which passed) now fails."""
        def ok(p):
            try:
                return all(c.passed for c in _checked(impl, op, p, dt, device))
            except Exception:
                return False
        return ok(later) or not ok(first)

    def bounded(params):
        """``body``, with the shrink of a failure bounded by ``SHRINK_SECONDS`` (see there)."""
        key = repr(params)
        found = state["found"]
        if found is not None and key not in state["failed"] and time.perf_counter() - found > SHRINK_SECONDS:
            return
        try:
            body(params)
        except BaseException:
            state["failed"].add(key)
            if state["found"] is None:
                state["found"], state["found_at"] = time.perf_counter(), state["cases"]
            raise
        finally:
            if state["found"] is not None:
                prog.tick(state["cases"], (state["cases"] - state["found_at"],
                                           time.perf_counter() - state["found"]))

    test = given(params=with_layout(op.strategy(sizes, case_kw)))(bounded)
    fixed = anchors + edges
    if not replay:
        for a in reversed(fixed):
            if repr(a) not in done:  # the rest of a lane after a reset failure: the fixed cases not yet passed
                test = example(params=a)(test)
    test = cfg(test)
    test = _seed(lseed)(test)
    if replay:
        test = _repro(_hypothesis_version(), replay.encode())(test)
    t0 = time.perf_counter()
    res = LaneResult(op.name, impl.name, dtype_name(dt), "PASS", seed=lseed)
    try:
        with warnings.catch_warnings(), raw_gating(impl.raw_gate_dtype):
            # numpy overflow notes from the Triton interpreter (exp of a large difference, then masked)
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton(\.|$)")
            test()
    except Exception as e:  # a failing property, an exception in the implementation, or hypothesis itself
        notes = [str(x) for x in getattr(e, "__notes__", [])]
        f = state["failure"]
        m = next((_BLOB.search(x) for x in notes if _BLOB.search(x)), None)
        if f is None and replay and type(e).__name__ == "DidNotReproduce":  # the replayed case passed
            res.why = ("the replayed case passes: hypothesis could not reproduce the failure its blob records "
                       "(fixed since, or recorded by another version of the implementation)")
        elif f is None:
            res.status, res.klass = "ERROR", "validator" if isinstance(e, P.ValidatorFault) else "raised"
            res.failure = dict(error=f"{type(e).__name__}: {e}", notes=notes, traceback=_where(e.__cause__ or e))
            if res.klass == "validator":
                res.why = "the validator's truth or budget raised, not the implementation: no verdict on it"
                res.failure.update(state.get("fault") or {})
        else:
            res.status = "FAIL"
            klass, why = f.get("klass"), f.get("why") or f"on {f['call']}"
            if klass is None:
                klass, why = attribute(impl, op, f["params"], dt, device)
            elif klass == "raised":  # an exception a simpler input avoids is that input's class (e.g. strides)
                klass, why = attribute(impl, op, f["params"], dt, device)
                if klass in ("wrong-result", "tile-boundary"):
                    klass, why = "raised", f"{op.name} raised on {f['call']}"
            res.klass, res.why = klass, why
            worst = f.get("worst")
            if worst is not None:
                _record_worst(res, worst, op)
            res.failure = dict(
                case=f["params"].get("case"),
                params=op_params(f["params"]),
                call=f.get("call"),
                error=_lane_named(f.get("error"), op),
                traceback=f.get("traceback"),
                comparisons=[_lane_named(str(c), op) for c in f["comparisons"]],
                blob=m.group(2) if m else None,
                hypothesis_version=m.group(1) if m else None,
                anchor=next((i for i, a in enumerate(fixed) if a == f.get("example", f["params"])), None),
                edge=f["params"].get("edge"),
                layout=bool(f["params"].get("layout")),
                notes=notes,
                _comparisons=list(f["comparisons"]),
            )
    res.cases = state["cases"]
    res.calls, res.checks, res.vacuous, res.sizes = state["calls"], state["checks"], state["vacuous"], sizes.name
    res.declined = dict(state["declined"]) or None
    if res.status == "PASS" and res.declined and not res.calls:
        res.status = "NOT RUN"
        res.reason = "every call declined: " + "; ".join(res.declined)
    if res.status == "PASS" and res.checks == 0 and res.cases:
        res.status, res.klass = "FAIL", "vacuous"
        res.failure = dict(error="[vacuous] no example had an informative comparison (every truth was zero or "
                                 "constant): the lane checked nothing", comparisons=[])
    if res.status == "PASS" and state["worst"] is not None:
        _record_worst(res, state["worst"], op)
    res.ratios = dict(state["ratios"]) if res.status == "PASS" else None
    if res.status == "FAIL" and not finite and not replay and _on_resets(res):
        _rest_without_resets(res, lambda: _run_lane(
            lane, device=device, profile=profile, seed=seed, max_examples=max_examples, shrink=shrink,
            replay=None, progress=progress, edge_part=edge_part, finite=True,
            done=frozenset(state["passed"])))
    res.seconds = time.perf_counter() - t0
    return res


def _on_resets(res: LaneResult) -> bool:
    """Whether a failing lane failed on reset gates: [domain], its case of the "reset" regime, and the
    simplification that passes the one to mild gates (``_simplify``)."""
    case = (res.failure or {}).get("case")
    return (res.klass == "domain" and getattr(case, "gate", None) == "reset"
            and (res.why or "").startswith("gates of the 'reset' regime"))


def _rest_without_resets(res: LaneResult, run_rest: Callable[[], LaneResult]) -> None:
    """A lane that failed on reset gates (``_on_resets``): say what the resets did and how to declare a
    finite gate domain, then run the rest of the lane with the reset regimes excluded (``run_rest``) and
    report its verdict too: in ``why`` and the table's note (``also``), and whole in ``failure["rest"]``.
    The lane stays FAIL [domain]; a failure of the rest is a second bug, reported with its own class."""
    f = res.failure
    comps = f.get("_comparisons") or []
    nonfinite = sum(c.nonfinite for c in comps)
    err = f.get("error") or ""
    if nonfinite:
        what = f"a non-finite output ({nonfinite} non-finite elements)"
    elif err and not comps:
        what = f"an exception ({err[:160]})" if not err.startswith("[") else err[:160]
    else:
        what = "a wrong result"
    f["resets"] = True
    res.why = (f"{res.why}: reset gates (-inf, -1e30, -300: exp(g) = 0, a full reset) give {what}.  A kernel "
               f"whose gates are never a reset (e.g. g = -exp(A_log) * softplus(a + dt_bias), always finite) "
               f"declares gates = \"finite\" on its adapter, and the resets are not drawn ({GATES_DOC}); a "
               f"kernel that serves resets takes a gate below -RESET_GATE as -RESET_GATE "
               f"(kvbuffer_ref.checks.RESET_GATE, docs/conventions.md \"Reset gates\")")
    rest = run_rest()
    res.cases += rest.cases
    res.calls, res.checks, res.vacuous = res.calls + rest.calls, res.checks + rest.checks, res.vacuous + rest.vacuous
    if rest.declined:
        res.declined = {w: (res.declined or {}).get(w, 0) + n for w, n in rest.declined.items()} | {
            w: n for w, n in (res.declined or {}).items() if w not in rest.declined}
    rf = dict(rest.failure or {})
    rf.pop("_comparisons", None)
    f["rest"] = dict(status=rest.status, klass=rest.klass, why=rest.why, worst_rel=rest.worst_rel,
                     budget=rest.budget, worst_comparison=rest.worst_comparison, cases=rest.cases,
                     checks=rest.checks, failure=rf or None)
    if rest.status == "PASS":
        verdict = "PASS"
        detail = f"PASS ({rest.cases} cases, worst rel-RMS {rest.worst_rel if rest.worst_rel is not None else '-'})"
    else:
        verdict = f"{rest.status} [{rest.klass}]"
        first = (rf.get("comparisons") or [None])[0]
        bad = next((c for c in rf.get("comparisons") or [] if not c.startswith("PASS")), first)
        detail = (f"{verdict}: {rest.why or 'failed'}; case {rf.get('case')!r}"
                  + (f" with {rf['params']}" if rf.get("params") else "")
                  + (f"; {rf['error']}" if rf.get("error") else "")
                  + (f"; {bad}" if bad else ""))
    res.why += f".  The rest of the lane, run with the reset regimes excluded: {detail}"
    res.also = dict(contract=None, status=rest.status, klass=rest.klass, worst_rel=rest.worst_rel,
                    budget=rest.budget, text=f"resets excluded: {verdict}")


def _lane_named(text: Optional[str], op) -> Optional[str]:
    """A comparison's name as its lane's: ``recurrent_decode`` is checked through the recurrent property
    (its step run once per token), whose comparisons are named ``recurrent[...]``."""
    if text is None or op.key != "recurrent_decode":
        return text
    return re.sub(r"\brecurrent\[", "recurrent_decode[", text)


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
                   on_result: Optional[Callable[[LaneResult], None]] = None, progress=sys.stderr,
                   explain: bool = True, jobs: int = 1) -> Report:
    """Run every lane of ``plan(impls, ops, dtypes)``; return the ``Report``.

    seed: None draws a fresh one (printed in the report; pass it back to replay the run).
    on_result: called with each ``LaneResult`` in plan order, as soon as it and every lane before it are
    known (the CLI prints rows with it).
    progress: where a long lane reports cases done / total every few seconds (None: nowhere).
    explain: state the verdicts under the other arithmetic contracts too (``run_lane``; more lane runs).
    jobs: worker processes that run lanes at once (``parallel``; at most one per lane to run); 1 runs every
    lane in this process.  Workers rebuild each implementation with its ``rebuild`` (``implementations.resolve``
    sets it): with an implementation without one, every lane runs in this process.  The lanes' cases, seeds
    and verdicts do not depend on ``jobs``.
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
    if not isinstance(jobs, int) or jobs < 1:
        raise ValidationError(f"--jobs: expected a positive integer, got {jobs!r}")
    prepared = set()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    jobs = min(jobs, sum(l.status == "RUN" for l in lanes))
    if device == "cpu":  # the cases are small: a thread pool costs more than it saves (5-10x on 2 busy cores)
        torch.set_num_threads(1)
    lane_threads = 1 if device == "cpu" else max(1, threads // jobs)  # a worker's share of the threads
    kw = dict(device=device, profile=profile, seed=seed, max_examples=max_examples, shrink=shrink, replay=replay,
              progress=progress, explain=explain)
    try:
        if jobs > 1 and parallel.parallel_ok(lanes):
            def here(i):
                return _run_one(lanes[i], lanes, prepared, **kw)
            parallel.run_lanes_parallel(lanes, report, jobs=jobs, fail_fast=fail_fast, on_result=on_result,
                                        threads=lane_threads, run_here=here, run_lane=run_lane, lane_seed=lane_seed,
                                        edge_part=_edge_part, **kw)
        else:
            _run_lanes(lanes, report, fail_fast=fail_fast, on_result=on_result, prepared=prepared, **kw)
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - t0
    return report


def _run_one(lane: Lane, lanes: list, prepared: set, **kw) -> LaneResult:
    """One lane in this process, its implementation prepared first (once: ``prepared``)."""
    if id(lane.impl) not in prepared:
        lane.impl.prepare()
        prepared.add(id(lane.impl))
    return run_lane(lane, edge_part=_edge_part(lane, lanes), **kw)


def _cuda_lost(device: str) -> Optional[str]:
    """Why the process's CUDA context can run nothing more (a kernel's illegal address or launch failure is
    sticky: every later CUDA call raises it again), or None when it still works or the run is on the CPU."""
    if device != "cuda":
        return None
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception as e:  # torch.AcceleratorError (torch >= 2.9) or RuntimeError: the error the fault left
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _run_lanes(lanes, report, *, fail_fast, on_result, prepared, **kw):
    """Every lane in this process, in plan order.  After a lane whose kernel faulted on the GPU (the context
    lost), the lanes after it are NOT RUN, with the fault named: they would only raise the same error."""
    stop = lost = False
    for lane in lanes:
        if lane.status != "RUN":
            r = LaneResult(lane.op.name, lane.impl.name, lane.dtype and dtype_name(lane.dtype), lane.status,
                           reason=lane.reason)
        elif stop:
            r = LaneResult(lane.op.name, lane.impl.name, dtype_name(lane.dtype), "SKIP",
                           reason="--fail-fast: an earlier lane failed")
        elif lost:
            r = LaneResult(lane.op.name, lane.impl.name, dtype_name(lane.dtype), "NOT RUN", reason=lost)
        else:
            r = _run_one(lane, lanes, prepared, **kw)
            stop = fail_fast and r.failed
            why = _cuda_lost(kw.get("device", "")) if r.failed else None
            if why:
                lost = (f"the CUDA context was lost to a fault in {r.operation} / {r.implementation} / {r.dtype} "
                        f"({why}); run this lane in a process of its own (--impl, --ops, --dtype)")
        report.lanes.append(r)
        if on_result:
            on_result(r)


def _edge_part(lane: Lane, lanes: list) -> tuple:
    """(i, n): an interpreted implementation's lanes of one operation (its dtypes) share the operation's
    boundary cases and its anchors past the first, lane i taking every n-th; every other implementation
    checks all of them per lane."""
    if not lane.impl.interpreted:
        return (0, 1)
    sib = [l for l in lanes if l.status == "RUN" and l.impl is lane.impl and l.op.name == lane.op.name]
    return (sib.index(lane), len(sib))


class NothingToRun(ValidationError):
    def __init__(self, report: Report):
        super().__init__("nothing to validate: the selected implementations provide none of the selected "
                         "operations / dtypes")
        self.report = report
