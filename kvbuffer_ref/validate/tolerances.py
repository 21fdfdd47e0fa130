"""The error policy (docs/testing.md): metrics, the ONE tolerance table, and the pass/fail decision.

An implementation's output is compared with the float64 recurrent truth.  Its error is the
relative RMS error ``||x - ref|| / ||ref||`` of each (request, head) slice; the worst slice is
what counts.  It passes when

    rel(actual)[s] <= kappa * rel(baseline)[s] + floor * eps(dtype) + gate_floor * gate_span * eps(compute)

for every (request, head) slice s: each slice is held to the baseline's error on that same slice
(a slice the baseline itself gets badly wrong, e.g. one whose exact value is a float32-underflowing
1e-48, does not loosen the budget of the others).  The report names the slice closest to, or
furthest past, its budget.

where *baseline* is the plain recurrent reference run in the implementation's own compute dtype
(float32 accumulation for float32/float16/bfloat16 inputs, cast to the output dtype) on the same
inputs, ``eps(dtype)`` is the machine epsilon of the output dtype and ``eps(compute)`` that of
the dtype the decays are computed in (float64 for float64, float32 for everything narrower: the
cumulative gates live in float32 even when the output is bf16).  NaN or Inf never passes.

``gate_span`` is the conditioning of the buffered and chunked forms: they form decays as
``exp(G_i - G_j)`` from cumulative log-gates, and a difference of two cumulative sums of size |G|
carries an absolute rounding error of about |G| * eps, which the step-by-step recurrence (the
baseline) never incurs.  ``gate_span(g)`` bounds |G| by the largest total |g| of one
(request, head) over the compared tokens; it is 0 for g = 0 and small for realistic gates.
``TOLERANCES`` below is the only place kappa and the floors are written; no test loosens them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Tolerance", "TOLERANCES", "tolerance_for", "Comparison", "gate_span", "rel_rms_slices", "compare",
           "assert_matches"]


@dataclass(frozen=True)
class Tolerance:
    """kappa: allowed multiple of the baseline's worst-slice error; floor: noise floor in units of
    eps; gate_floor: eps units allowed per unit of gate span (cumulative-gate cancellation)."""

    kappa: float
    floor: float
    gate_floor: float = 1.0


#: The one tolerance table, keyed by the dtype of the output under test.
#: float64 is used to compare the oracle's own forms with each other: its baseline (the float64
#: recurrence) is the truth itself, so only the floor counts: 4096 eps ~ 9.1e-13 relative.
#: The narrower floors are a few ulps of accumulated rounding; kappa = 4 leaves room for a
#: different (chunked, tiled) summation order without admitting a wrong formula, whose error
#: is O(1).  Calibration: docs/testing.md.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(kappa=4.0, floor=4096.0, gate_floor=1.0),
    torch.float32: Tolerance(kappa=4.0, floor=64.0, gate_floor=1.0),
    torch.float16: Tolerance(kappa=4.0, floor=2.0, gate_floor=1.0),
    torch.bfloat16: Tolerance(kappa=4.0, floor=2.0, gate_floor=1.0),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance defined for {dtype}; the table covers {sorted(map(str, TOLERANCES))}")
    return TOLERANCES[dtype]


def gate_span(g: Optional[torch.Tensor]) -> float:
    """The largest total |g| of one (request, head[, channel]) over the tokens: g [B, T, HV] or [B, T, HV, K]."""
    if g is None or g.numel() == 0:
        return 0.0
    return float(g.detach().to(torch.float64).abs().sum(dim=1).max())


def _slice_view(x: torch.Tensor, head_axis: int) -> torch.Tensor:
    """[B, ..., H, ...] -> [B, H, rest] with (request, head) slices as rows."""
    x = x.movedim(head_axis, 1)
    return x.reshape(x.shape[0], x.shape[1], -1)


def rel_rms_slices(actual: torch.Tensor, expected: torch.Tensor, head_axis: int = 2,
                   valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Relative RMS error ``||a - e|| / ||e||`` per (request, head) slice, as a [B, H] float64 tensor.

    ``head_axis`` is the head dimension (2 for outputs [B, T, HV, V], 1 for states [B, HV, K, V]).
    ``valid`` (broadcastable to ``actual``) excludes padding.  0/0 counts as 0, x/0 as inf, and any
    NaN/Inf in ``actual`` makes its slice inf.
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if valid is not None:
        mask = valid.expand(a.shape) if valid.shape != a.shape else valid
        a = torch.where(mask, a, torch.zeros((), dtype=a.dtype, device=a.device))
        e = torch.where(mask, e, torch.zeros((), dtype=e.dtype, device=e.device))
    bad = _slice_view(~torch.isfinite(a), head_axis).any(dim=-1)
    a = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    diff = _slice_view(a - e, head_axis).norm(dim=-1)
    ref = _slice_view(e, head_axis).norm(dim=-1)
    rel = torch.where(ref > 0, diff / ref.clamp_min(torch.finfo(torch.float64).tiny),
                      torch.where(diff > 0, torch.full_like(diff, float("inf")), torch.zeros_like(diff)))
    return torch.where(bad, torch.full_like(rel, float("inf")), rel)


@dataclass(frozen=True)
class Comparison:
    """The verdict of one comparison against the float64 truth, reported at its deciding slice:
    the (request, head) slice with the largest ratio of error to budget."""

    name: str
    dtype: torch.dtype
    worst_rel: float
    worst_slice: tuple[int, int]
    max_abs: float
    baseline_rel: float
    budget: float
    nonfinite: int
    gate_span: float = 0.0

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.worst_rel <= self.budget

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        tol = tolerance_for(self.dtype)
        b, h = self.worst_slice
        compute = torch.float64 if self.dtype == torch.float64 else torch.float32
        extra = f", {self.nonfinite} non-finite elements" if self.nonfinite else ""
        return (
            f"{verdict} {self.name} [{str(self.dtype).replace('torch.', '')}]: worst slice (request {b}, head {h}) "
            f"rel-RMS {self.worst_rel:.3e}, max-abs {self.max_abs:.3e}{extra}; budget {self.budget:.3e} = "
            f"{tol.kappa:g} x baseline {self.baseline_rel:.3e} + {tol.floor:g} x eps {torch.finfo(self.dtype).eps:.2e} "
            f"+ {tol.gate_floor:g} x gate span {self.gate_span:.3g} x eps {torch.finfo(compute).eps:.2e}"
        )


def compare(actual: torch.Tensor, expected: torch.Tensor, baseline: Optional[torch.Tensor] = None, *,
            name: str = "output", dtype: Optional[torch.dtype] = None, head_axis: int = 2,
            valid: Optional[torch.Tensor] = None, g: Optional[torch.Tensor] = None) -> Comparison:
    """Compare ``actual`` with the float64 truth ``expected`` under the calibrated budget.

    baseline: the plain recurrent reference's output in the implementation's compute dtype (None
    when the comparison is float64 against float64: only the floor counts).  dtype: whose row of
    the table applies (default ``actual.dtype``).  g: the log-gates of the tokens behind the
    compared values (for the gate-span term; None = 0).
    """
    if expected.dtype != torch.float64:
        raise TypeError(f"expected: the truth must be float64, got {expected.dtype}")
    if actual.shape != expected.shape:
        raise ValueError(f"actual: shape {list(actual.shape)} differs from expected {list(expected.shape)}")
    dtype = dtype or actual.dtype
    tol = tolerance_for(dtype)
    span = gate_span(g)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    floor = tol.floor * torch.finfo(dtype).eps + tol.gate_floor * span * torch.finfo(compute).eps
    rel = rel_rms_slices(actual, expected, head_axis, valid)
    base = torch.zeros_like(rel) if baseline is None else rel_rms_slices(baseline, expected, head_axis, valid)
    budgets = tol.kappa * base + floor
    # the slice that comes closest to (or goes furthest past) its own budget decides
    idx = int((rel / budgets).nan_to_num(nan=float("inf")).argmax()) if rel.numel() else 0
    flat = lambda t: float(t.reshape(-1)[idx]) if t.numel() else 0.0  # noqa: E731
    worst, base_w, budget_w = flat(rel), flat(base), (flat(budgets) if rel.numel() else floor)
    a = actual.detach().to(torch.float64)
    finite = torch.isfinite(a)
    if valid is not None:
        v = valid.expand(a.shape)
        nonfinite = int((~finite & v).sum())
        diff = torch.where(v & finite, (a - expected).abs(), torch.zeros((), dtype=a.dtype))
    else:
        nonfinite = int((~finite).sum())
        diff = torch.where(finite, (a - expected).abs(), torch.zeros((), dtype=a.dtype))
    H = rel.shape[1] if rel.dim() == 2 and rel.shape[1] else 1
    return Comparison(
        name=name, dtype=dtype, worst_rel=worst, worst_slice=(idx // H, idx % H),
        max_abs=float(diff.max()) if diff.numel() else 0.0, baseline_rel=base_w,
        budget=budget_w, nonfinite=nonfinite, gate_span=span,
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, baseline: Optional[torch.Tensor] = None, *,
                   name: str = "output", dtype: Optional[torch.dtype] = None, head_axis: int = 2,
                   valid: Optional[torch.Tensor] = None, g: Optional[torch.Tensor] = None) -> Comparison:
    """``compare`` and raise AssertionError (worst slice, rel-RMS, max-abs, budget) unless it passes."""
    c = compare(actual, expected, baseline, name=name, dtype=dtype, head_axis=head_axis, valid=valid, g=g)
    if not c.passed:
        raise AssertionError(str(c))
    return c
