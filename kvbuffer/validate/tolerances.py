"""The error policy (docs/testing.md): metrics, the ONE tolerance table, and the pass/fail decision.

An implementation's output is compared with the float64 recurrent truth.  Its error is the relative
RMS error ``||x - ref|| / ||ref||`` of each (request, head) slice.  It passes when, for every slice s,

    rel(actual)[s] <= kappa * rel(baseline)[s] + floor * eps(compute) + tiny(dtype) / rms(ref[s])

(kappa: ``Tolerance.multiple``, 4, or 2 for a 16-bit output of IEEE float32 arithmetic).

*baseline* is what a correct implementation in the declared arithmetic computes on the same inputs:
the oracle's own forms run in the implementation's compute dtype (float32 for float32, float16 and
bfloat16 inputs; the outputs rounded to the output dtype), with the products, or the state, rounded as
the lane's arithmetic contract says (``contracts``: IEEE float32 by default; TF32 products, bfloat16
products, a bfloat16 state: emulated exactly).  Which forms depends on what the operation computes
(``properties.baseline_forms``): the plain recurrence for the stepwise operations (they form no
cumulative gate), and the worst of the recurrence and the chunkwise form for the others (cumulative
gates local to chunks of ``max(64, the operation's own chunk)`` tokens: the buffer's capacity, the
``chunk_size`` argument, the whole sequence for direct mode).  ``baseline`` may be one tensor or a
sequence of them; each slice takes the worst.  Nothing analytical is added on top: the budget is a
small multiple of an error measured on that very case.

Each slice is held to the baseline's error on that same slice (a slice the baseline itself gets badly
wrong, e.g. one whose exact value is a float32-underflowing 1e-48, does not loosen the budget of the
others).  ``eps(compute)`` is the machine epsilon of the dtype the implementation computes in (float64
for float64 outputs, float32 for everything narrower): a floor of a few of its ulps covers a slice that
the baseline happens to get exactly.  ``tiny(dtype) / rms(ref)`` is the range limit of the output dtype:
below its smallest normal number (float32: 1.2e-38) a value has no relative precision left, so an error
that small per element is no error of the implementation; it only matters for slices whose exact value
is itself that small.  NaN or Inf never passes.

A second check sees what the RMS error cannot tell from rounding when the arithmetic is coarse (bfloat16
products: there a scale, gate or beta off by 1 % moves the output by about 2.5 times a correct kernel's
error).  The **gain** of a slice is its error's component along the truth, ``<x - ref, ref> / <ref, ref>``:
a wrong scale, gate or beta shifts every slice the same way, rounding goes either way.  Over the n
(request, head) slices of one comparison (those with an informative truth, at least ``GAIN_MIN_SLICES``),
the mean gain passes when

    |mean gain(actual)| <= kappa * |mean gain(baseline)| + GAIN_Z * sd(gain(actual)) / sqrt(n) + floor * eps(compute)

the baseline's mean gain being what the declared arithmetic itself shifts (a correct kernel's), the second
term the spread of a mean of n slice gains (GAIN_Z standard errors), the floor the same as above.  With
fewer slices the gain is not judged (the RMS check alone decides).

``TOLERANCES`` below is the only place kappa and the floor are written; no test loosens them.  What a
budget is worth is measured, not argued: ``python3 scripts/budget_table.py`` prints, per lane, the budget
of correct kernels over their error and the error of kernels off by 1 % over their budget
(docs/testing.md, "What a budget is worth (measured)").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .contracts import CONTRACTS as CONTRACT_NAMES  # noqa: F401
from .contracts import active_contract, current_contract

__all__ = ["Tolerance", "TOLERANCES", "GAIN_MIN_SLICES", "GAIN_Z", "gain_slices", "active_contract", "current_contract", "tolerance_for", "compute_dtype",
           "Comparison", "rel_rms_slices", "compare", "assert_matches", "CONTRACT_NAMES"]

@dataclass(frozen=True)
class Tolerance:
    """kappa: allowed multiple of the baseline's slice error; floor: allowed error in units of
    eps(compute) whatever the baseline's; kappa_rounding: the multiple instead where the baseline's error
    is the rounding of the output itself (16-bit outputs of IEEE float32 arithmetic; None: kappa)."""

    kappa: float
    floor: float
    kappa_rounding: Optional[float] = None

    def multiple(self, contract: str) -> float:
        """The allowed multiple of the baseline's error under ``contract``."""
        return self.kappa_rounding if self.kappa_rounding is not None and contract == "ieee" else self.kappa


#: The one tolerance table, keyed by the dtype of the output under test.
#: kappa = 4: a correct kernel sums in another order (chunks, tiles, a buffer) than the baseline's forms,
#: so its rounding differs from theirs in detail but not in size; at Qwen3-Next's heads on the H200 the bundled
#: correct kernels reached at most 3.5x the worst baseline form on a slice (kvbuffer_fast's float32 chunk at
#: T = 1024 judged as IEEE; its products are three TF32 ones, docs/testing.md).  A wrong scale, gate or beta
#: by 1 % is thousands of times a float32 kernel's error and 2-4 times a bfloat16 kernel's.
#: kappa_rounding = 2 for 16-bit outputs under IEEE float32 arithmetic: there the baseline's error is the
#: rounding of the output to 8 or 11 mantissa bits, thousands of times the float32 arithmetic's, and two
#: kernels that compute to float32 accuracy round to the same neighbours but near midpoints, where either
#: neighbour is half an ulp away: their errors agree to a few percent, so 2 leaves room and no more (a 1 %
#: wrong gate moves a bfloat16 output by about as much as its rounding does).
#: floor = 8 ulps of the compute dtype: a slice the baseline gets exactly (a single token, an exact sum).
#: float64 compares the oracle's forms with each other: the floor, 4096 eps ~ 9.1e-13 relative, covers the
#: float64 recurrence (the truth itself, no error) and the oracle's other forms where they are exact.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(kappa=4.0, floor=4096.0),
    torch.float32: Tolerance(kappa=4.0, floor=8.0),
    torch.float16: Tolerance(kappa=4.0, floor=8.0, kappa_rounding=2.0),
    torch.bfloat16: Tolerance(kappa=4.0, floor=8.0, kappa_rounding=2.0),
}



#: The gain check (module docstring) judges a comparison of at least this many informative slices: with fewer,
#: a sample standard deviation says little about the spread of their mean.
GAIN_MIN_SLICES = 32
#: How many standard errors of the mean slice gain the budget allows: with 32 slices a correct kernel's mean
#: lies that far out with probability below 1e-6 (Student's t, 31 degrees of freedom; the slices of one head
#: group share their keys and count for fewer, which 8 still covers), while a 1 % wrong scale or beta at
#: Qwen3-Next's heads is 15 to 30 standard errors out (docs/testing.md).
GAIN_Z = 8.0


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance defined for {dtype}; the table covers {sorted(map(str, TOLERANCES))}")
    return TOLERANCES[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype states and decays are computed in for outputs of ``dtype``: float64 for float64,
    float32 for every narrower dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slice_view(x: torch.Tensor, head_axis: int) -> torch.Tensor:
    """[B, ..., H, ...] -> [B, H, rest] with (request, head) slices as rows (any size 0 allowed)."""
    x = x.movedim(head_axis, 1)
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def _slice_sums(actual: torch.Tensor, expected: torch.Tensor, head_axis: int,
                valid: Optional[torch.Tensor]) -> tuple:
    """Per (request, head) slice, in float64, one pass: (||a - e||^2, <a - e, e>, ||e||^2, bad, max |a - e|,
    the count of valid elements, the count of non-finite valid elements of ``actual``); ``bad`` where ``actual``
    holds a NaN or Inf (those elements left out of the sums); padding outside ``valid`` counts as zero."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(device=a.device, dtype=torch.float64)
    mask = None
    if valid is not None:
        mask = valid.to(a.device)
        mask = mask.expand(a.shape) if mask.shape != a.shape else mask
        a = torch.where(mask, a, torch.zeros((), dtype=a.dtype, device=a.device))
        e = torch.where(mask, e, torch.zeros((), dtype=e.dtype, device=e.device))
    fin = _slice_view(torch.isfinite(a), head_axis)
    nonfinite = (~fin).sum(dim=-1)
    e = _slice_view(e, head_axis)
    d = torch.where(fin, _slice_view(a, head_axis) - e, torch.zeros((), dtype=a.dtype, device=a.device))
    count = (torch.full(e.shape[:2], e.shape[-1], dtype=torch.float64, device=e.device) if mask is None
             else _slice_view(mask, head_axis).sum(dim=-1).to(torch.float64))
    big = d.abs().amax(dim=-1) if d.shape[-1] else torch.zeros(d.shape[:2], dtype=d.dtype, device=d.device)
    d = torch.where(fin, d, -e)  # a non-finite element counts as 0 in the sums (its slice is bad anyway)
    return (d * d).sum(-1), (d * e).sum(-1), (e * e).sum(-1), nonfinite > 0, big, count, int(nonfinite.sum())


def _rel(dd: torch.Tensor, ee: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``||a - e|| / ||e||`` from the slice sums: 0/0 counts as 0, x/0 as inf, a non-finite slice as inf."""
    rel = torch.where(ee > 0, (dd / ee.clamp_min(torch.finfo(torch.float64).tiny)).sqrt(),
                      torch.where(dd > 0, torch.full_like(dd, float("inf")), torch.zeros_like(dd)))
    return torch.where(bad, torch.full_like(rel, float("inf")), rel)


def _gain(de: torch.Tensor, ee: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``<a - e, e> / <e, e>`` from the slice sums; NaN where the truth is 0 or the slice is not finite."""
    g = de / ee.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(bad | (ee == 0), torch.full_like(g, float("nan")), g)


def rel_rms_slices(actual: torch.Tensor, expected: torch.Tensor, head_axis: int = 2,
                   valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Relative RMS error ``||a - e|| / ||e||`` per (request, head) slice, as a [B, H] float64 tensor.

    ``head_axis`` is the head dimension (2 for outputs [B, T, HV, V], 1 for states [B, HV, K, V]).
    ``valid`` (broadcastable to ``actual``) excludes padding.  0/0 counts as 0, x/0 as inf, and any
    NaN/Inf in ``actual`` makes its slice inf.
    """
    dd, _, ee, bad = _slice_sums(actual, expected, head_axis, valid)[:4]
    return _rel(dd, ee, bad)


def gain_slices(actual: torch.Tensor, expected: torch.Tensor, head_axis: int = 2,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gain of each (request, head) slice, ``<a - e, e> / <e, e>`` (a [B, H] float64 tensor; NaN where the
    truth is 0 or ``actual`` is not finite): the component of the error along the truth, as a relative scale."""
    _, de, ee, bad = _slice_sums(actual, expected, head_axis, valid)[:4]
    return _gain(de, ee, bad)


@dataclass(frozen=True)
class Comparison:
    """The verdict of one comparison against the float64 truth, reported at its deciding slice: the
    (request, head) slice with the largest ratio of error to budget.  ``baseline_rel`` is the baseline's
    error there (the worst of the correct forms in the declared arithmetic), ``range_term`` its
    ``tiny / rms(ref)``, ``contract`` the arithmetic the baseline was computed in, ``ratio`` the largest
    error / budget over the slices and ``ratios`` the same keyed by contract (the runner's aggregate), both
    counting the gain check.  ``gain`` is the mean gain over the ``gain_slices`` judged slices (module
    docstring), ``gain_budget`` its budget (inf when fewer than ``GAIN_MIN_SLICES`` slices are informative: not
    judged), ``gain_baseline`` the baseline's mean gain and ``gain_se`` the standard error of the mean."""

    name: str
    dtype: torch.dtype
    worst_rel: float
    worst_slice: tuple[int, int]
    max_abs: float
    baseline_rel: float
    budget: float
    nonfinite: int
    range_term: float = 0.0
    contract: str = "ieee"
    ratio: float = 0.0
    ratios: Optional[dict] = None
    gain: float = 0.0
    gain_budget: float = float("inf")
    gain_baseline: float = 0.0
    gain_se: float = 0.0
    gain_slices: int = 0

    @property
    def gain_judged(self) -> bool:
        return self.gain_budget != float("inf")

    @property
    def gain_passed(self) -> bool:
        return abs(self.gain) <= self.gain_budget

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.worst_rel <= self.budget and self.gain_passed

    @property
    def over_baseline(self) -> float:
        """The error at the deciding slice over a correct kernel's error there (inf when that is 0)."""
        if self.baseline_rel > 0:
            return self.worst_rel / self.baseline_rel
        return 0.0 if self.worst_rel == 0 else float("inf")

    def budget_terms(self) -> str:
        """The budget's terms at the deciding slice, as the report prints them."""
        tol = tolerance_for(self.dtype)
        eps = torch.finfo(compute_dtype(self.dtype)).eps
        terms = f"{tol.multiple(self.contract):g} x baseline {self.baseline_rel:.3e} + {tol.floor:g} x eps {eps:.2e}"
        if self.range_term > 1e-3 * self.budget:
            terms += f" + tiny / rms(ref) {self.range_term:.3e}"
        return terms

    def gain_terms(self) -> str:
        """The gain budget's terms, as the report prints them."""
        tol = tolerance_for(self.dtype)
        eps = torch.finfo(compute_dtype(self.dtype)).eps
        return (f"{tol.multiple(self.contract):g} x baseline's {abs(self.gain_baseline):.2e} + {GAIN_Z:g} x s.e. "
                f"{self.gain_se:.2e} + {tol.floor:g} x eps {eps:.2e}")

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        b, h = self.worst_slice
        extra = f", {self.nonfinite} non-finite elements" if self.nonfinite else ""
        arith = "" if self.contract == "ieee" else f" in {self.contract} arithmetic"
        text = (
            f"{verdict} {self.name} [{str(self.dtype).replace('torch.', '')}]: worst slice (request {b}, head {h}) "
            f"rel-RMS {self.worst_rel:.3e} ({self.over_baseline:.3g}x a correct kernel's error{arith}), "
            f"max-abs {self.max_abs:.3e}{extra}; budget {self.budget:.3e} = {self.budget_terms()}"
        )
        if self.gain_judged and (not self.gain_passed or self.nonfinite == 0 and self.worst_rel <= self.budget):
            text += (f"; gain (error along the truth, mean of {self.gain_slices} slices) {self.gain:+.3e}"
                     f"{'' if self.gain_passed else ' PAST'} its budget {self.gain_budget:.3e} = {self.gain_terms()}")
        return text


Baseline = Union[None, torch.Tensor, Sequence[torch.Tensor]]


def compare(actual: torch.Tensor, expected: torch.Tensor, baseline: Baseline = None, *,
            name: str = "output", dtype: Optional[torch.dtype] = None, head_axis: int = 2,
            valid: Optional[torch.Tensor] = None, contract: Optional[str] = None) -> Comparison:
    """Compare ``actual`` with the float64 truth ``expected`` under the one tolerance table.

    baseline: the outputs of the correct forms in the implementation's compute dtype and declared
    arithmetic on the same inputs (``properties.truth_and_baseline``), one tensor or a sequence of them
    (each slice takes the worst); None when the comparison is float64 against float64 (only the floor
    counts).  dtype: whose row of the table applies (default ``actual.dtype``).  head_axis: the head
    dimension (2 for outputs [B, T, HV, V], 1 for states [B, HV, K, V]).  valid: a mask broadcastable to
    ``actual`` that excludes padding.  contract: the arithmetic the baselines were computed in, for the
    report (default ``current_contract()``).  Empty tensors (B = 0, no tokens) agree.
    """
    if expected.dtype != torch.float64:
        raise TypeError(f"expected: the truth must be float64, got {expected.dtype}")
    if actual.shape != expected.shape:
        raise ValueError(f"actual: shape {list(actual.shape)} differs from expected {list(expected.shape)}")
    bases = [] if baseline is None else [baseline] if isinstance(baseline, torch.Tensor) else list(baseline)
    for i, b in enumerate(bases):
        if b.shape != expected.shape:
            raise ValueError(f"baseline{'' if len(bases) == 1 else f'[{i}]'}: shape {list(b.shape)} differs from "
                             f"expected {list(expected.shape)}")
    if not -actual.dim() <= head_axis < actual.dim():
        raise ValueError(f"head_axis: {head_axis} is out of range for a {actual.dim()}-d tensor")
    head_axis %= actual.dim()
    dtype = dtype or actual.dtype
    contract = current_contract() if contract is None else contract
    if contract not in CONTRACT_NAMES:
        raise ValueError(f"contract: expected one of {', '.join(CONTRACT_NAMES)}, got {contract!r}")
    # the budget is computed in float64 on the truth's device
    dev = expected.device
    on = lambda t: None if t is None else t.detach().to(dev)  # noqa: E731
    actual, valid = on(actual), on(valid)
    tol = tolerance_for(dtype)
    dd, de, ee, bad, big, count, nonfinite = _slice_sums(actual, expected, head_axis, valid)
    rel = _rel(dd, ee, bad)
    base = torch.zeros_like(rel)
    base_gains = []
    for b in bases:
        bdd, bde, _, bbad = _slice_sums(on(b), expected, head_axis, valid)[:4]
        # a form that overflowed on a slice (float16's range) lost it, as one that returned 0 did: error 1
        base = torch.maximum(base, torch.where(bbad, torch.ones_like(ee), _rel(bdd, ee, bbad)))
        base_gains.append(_gain(bde, ee, bbad))
    # tiny / rms(ref) per slice: an error of one smallest normal number per element, relative (0 for a zero truth)
    ranges = torch.where(ee > 0, torch.finfo(dtype).tiny * (count / ee.clamp_min(torch.finfo(torch.float64).tiny)).sqrt(),
                         torch.zeros_like(ee))
    floor = tol.floor * torch.finfo(compute_dtype(dtype)).eps
    budgets = tol.multiple(contract) * base + floor + ranges
    max_abs = float(big.max()) if big.numel() else 0.0
    if rel.numel() == 0:  # nothing to compare (B = 0 or no heads)
        return Comparison(name=name, dtype=dtype, worst_rel=0.0, worst_slice=(0, 0), max_abs=max_abs,
                          baseline_rel=0.0, budget=floor,
                          nonfinite=nonfinite, contract=contract, ratio=0.0, ratios={contract: 0.0})
    # the slice that comes closest to (or goes furthest past) its own budget decides
    r = (rel / budgets).nan_to_num(nan=float("inf"))
    idx = int(r.argmax())
    H = rel.shape[1]
    at = lambda t: float(t.reshape(-1)[idx])  # noqa: E731
    ratio = float(r.max()) if not nonfinite else float("inf")
    gain = _gain_check(_gain(de, ee, bad), base_gains, informative=(base < 0.5) & (ranges <= floor),
                       multiple=tol.multiple(contract), floor=floor)
    if gain.get("gain_budget", float("inf")) != float("inf"):
        ratio = max(ratio, abs(gain["gain"]) / gain["gain_budget"])
    return Comparison(name=name, dtype=dtype, worst_rel=at(rel), worst_slice=(idx // H, idx % H), max_abs=max_abs,
                      baseline_rel=at(base), budget=at(budgets), nonfinite=nonfinite, range_term=at(ranges),
                      contract=contract, ratio=ratio, ratios={contract: ratio}, **gain)


def _gain_check(g: torch.Tensor, base_gains: list, *, informative: torch.Tensor, multiple: float,
                floor: float) -> dict:
    """The gain check's figures (module docstring) from the slice gains ``g`` [B, H] of the actual and
    ``base_gains`` of each baseline, over the ``informative`` slices ([B, H] bool: a baseline that keeps some
    digits, a truth inside the dtype's normal range) whose gains are finite: Comparison's ``gain*`` fields, the
    budget inf when fewer than ``GAIN_MIN_SLICES`` slices count."""
    keep = informative & ~g.isnan()
    n = int(keep.sum())
    if n < GAIN_MIN_SLICES:
        return dict(gain=float(g[keep].mean()) if n else 0.0, gain_slices=n)
    gk = g[keep]
    mean, se = float(gk.mean()), float(gk.std()) / math.sqrt(n)
    gb = 0.0
    for b in base_gains:
        gb = max(gb, float(b[keep].nan_to_num(nan=0.0).mean()), key=abs)
    return dict(gain=mean, gain_budget=multiple * abs(gb) + GAIN_Z * se + floor, gain_baseline=gb, gain_se=se,
                gain_slices=n)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, baseline: Baseline = None,
                   **kw) -> Comparison:
    """``compare`` (with its keywords ``kw``) and raise AssertionError (worst slice, rel-RMS, max-abs, budget)
    unless it passes."""
    c = compare(actual, expected, baseline, **kw)
    if not c.passed:
        raise AssertionError(str(c))
    return c
