"""The error policy (docs/testing.md): metrics, the ONE tolerance table, and the pass/fail decision.

An implementation's output is compared with the float64 recurrent truth.  Its error is the
relative RMS error ``||x - ref|| / ||ref||`` of each (request, head) slice; the worst slice is
what counts.  It passes when, for every (request, head) slice s,

    rel(actual)[s] <= kappa * rel(baseline)[s] + floor * eps(dtype)
                      + (gate_floor * span[s] + reorder_floor) * eps(compute) * amplification[s]
                      + tiny(dtype) / rms(ref[s])

Each slice is held to the baseline's error on that same slice (a slice the baseline itself gets
badly wrong, e.g. one whose exact value is a float32-underflowing 1e-48, does not loosen the
budget of the others).  The report names the slice closest to, or furthest past, its budget.

*baseline* is the plain recurrent reference run in the implementation's own compute dtype
(float32 accumulation for float32/float16/bfloat16 inputs, cast to the output dtype) on the same
inputs, under the implementation's declared arithmetic contract (``contracts``: IEEE by default; TF32
or bf16 products, a bf16 state: emulated), plus, for a contract other than IEEE, the contract term
``coef x unit x growth(T) x amplification[s]`` (``CONTRACT_TERMS``); ``eps(dtype)`` is the machine epsilon of the output dtype and ``eps(compute)`` that of the
dtype the decays are computed in (float64 for float64, float32 for everything narrower: the
cumulative gates live in float32 even when the output is bf16).  NaN or Inf never passes.

``span[s]`` (``gate_spans``) is the conditioning of the buffered and chunked forms: they form
decays as ``exp(G_i - G_j)`` from cumulative log-gates ``G`` kept in the compute dtype, which the
step-by-step recurrence (the baseline) never does.  It is the first-order bound, in eps(compute), of
the rounding of ``G_i - G_j`` under recursive summation: with ``a_t = min(|g_t|, RESET_GATE)`` and
``A_m = a_1 + ... + a_m``, ``span = (W + sum_t a_t) / 2``, ``W`` the largest ``sum A_m`` over the tokens
between two gates whose decay underflows (below ``log(tiny(compute))``; a reset gate, -inf or -1e30,
is taken as ``-RESET_GATE`` by every form, ``kvbuffer_ref.checks``): each addition rounds by
``u |G_m|``, and decays across an underflowing gate are 0.  It is 0 for g = 0 and grows with the
tokens summed after a reset.  Comparisons of forms that keep no cumulative gates (the recurrence
itself) pass ``g=None``: no gate term.

``reorder_floor`` is the rounding of a sum taken in another order than the recurrence's, relative to
the size of the rows summed: a chunked form folds a chunk's innovations into the state it entered with
in one subtraction (``S - K^T W S``), so a state that the chunk nearly erases (beta near 1 on nearly
repeated keys) keeps an absolute error of a few eps times the state it entered with, where the
recurrence, shrinking it a token at a time, keeps eps times its current size.  Like the gate term it
applies to the forms that keep cumulative gates (``g`` passed) and scales with the amplification.

``amplification[s]`` is how much larger than the slice the rows the delta rule sums are (a decay off
by d changes each row by d times its size): ``max(1, scale / ||ref[s]||, ||magnitude[s]|| / ||ref[s]||)``
with ``scale`` the RMS of the comparison's slice norms (a slice small by cancellation among siblings
of the usual size keeps their absolute allowance) and ``magnitude`` (``magnitudes``, when the caller
passes it) the same outputs summed in absolute value (the slice's own rows cancelling, e.g. across
the channels of per-channel gates).

``tiny(dtype) / rms(ref)`` is the range limit of the output dtype: below its smallest normal
number (float32: 1.2e-38) a value is subnormal and has no relative precision left, so an error
that small per element is no error of the implementation; it only matters for slices whose exact
value is itself that small (decays within a few units of exp's underflow).

``TOLERANCES`` below is the only place kappa and the floors are written; no test loosens them.
The calibration behind them (the measured worst ratios over many cases, the false-failure rate,
the planted bugs they still catch): docs/testing.md, scripts/false_failures.py, scripts/mutate.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from kvbuffer_ref.checks import RESET_GATE

__all__ = ["Tolerance", "TOLERANCES", "ContractTerm", "CONTRACT_TERMS", "active_contract", "current_contract", "tolerance_for", "compute_dtype", "Comparison", "gate_span", "gate_spans", "magnitudes",
           "gate_terms", "rel_rms_slices", "compare", "assert_matches", "chunk_conditioning", "CONDITIONING_CHUNK",
           "UNKNOWN_CONDITIONING"]


@dataclass(frozen=True)
class Tolerance:
    """kappa: allowed multiple of the baseline's slice error; floor: noise floor in units of eps;
    gate_floor: multiples of the gate span's rounding bound allowed (cumulative-gate rounding);
    reorder_floor: eps(compute) allowed per unit of amplification for a form that sums in another order
    than the recurrence (chunked, buffered, direct: the comparisons that pass ``g``)."""

    kappa: float
    floor: float
    gate_floor: float = 1.0
    reorder_floor: float = 0.0


#: The one tolerance table, keyed by the dtype of the output under test.
#: float64 is used to compare the oracle's own forms with each other: its baseline (the float64
#: recurrence) is the truth itself, so only the floors count: 4096 eps ~ 9.1e-13 relative.
#: The narrower floors are a few ulps of accumulated rounding; kappa = 4 leaves room for a
#: different (chunked, tiled) summation order without admitting a wrong formula, whose error
#: is O(1).  gate_floor = 4: the derived first-order bound of a decay's rounding is 1 x span x
#: eps(compute) (``gate_spans``); the correct forms' error, measured per slice over many random cases,
#: reached 1.3 x sum_t |g_t| x eps(float32), which is at most 2.6 x span (docs/testing.md, "Calibration").
#: reorder_floor = 8: the chunked form's error on states it nearly erases, in eps(compute) x amplification,
#: reached 2.4 over 3,000 random cases weighted to such states (docs/testing.md, "Calibration").
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(kappa=4.0, floor=4096.0, gate_floor=4.0, reorder_floor=8.0),
    torch.float32: Tolerance(kappa=4.0, floor=64.0, gate_floor=4.0, reorder_floor=8.0),
    torch.float16: Tolerance(kappa=4.0, floor=2.0, gate_floor=4.0, reorder_floor=8.0),
    torch.bfloat16: Tolerance(kappa=4.0, floor=2.0, gate_floor=4.0, reorder_floor=8.0),
}


@dataclass(frozen=True)
class ContractTerm:
    """The budget term of a declared arithmetic contract (kvbuffer_ref.validate.contracts): per slice,
    ``coef x unit x growth(T) x cond[s] ** power x max(1, scale / ||ref[s]||)``, added to the
    dtype's budget.  ``unit`` is the unit roundoff of the contract's rounding (TF32: 2^-11, bfloat16: 2^-8),
    ``growth`` how the error grows with the T tokens behind the compared values ("none", or "sqrt":
    sqrt(T), a rounding of the state at every token), ``cond[s]`` the slice's chunk conditioning
    (``chunk_conditioning``: 1 for orthogonal keys, about 200 for 64 nearly collinear ones), ``coef``
    and ``power`` the calibrated constants (docs/testing.md, "Arithmetic contracts")."""

    unit: float
    coef: float
    growth: str = "none"
    power: float = 0.0  # the exponent of the chunk conditioning (0: the term ignores the conditioning)


#: The contract terms, keyed by contract (``contracts.CONTRACTS``).  ``ieee`` adds nothing: the table
#: above is its budget.  Calibrated on the reference's recurrent and chunked forms run under each
#: emulated contract (``python3 -m kvbuffer_ref.validate.contracts -n 1000 --seed 1``, 2 and 3: 3,000
#: cases), with kappa x the contract's own baseline (the recurrence under the emulated contract) in the
#: budget.  The product rounding a slice needs beyond that grows with the chunk conditioning: at most
#: 2.15 u x sqrt(cond) for tf32 and 1.71 u x sqrt(cond) for bf16 (1.1 u where the chunks are well
#: conditioned, 32 u at 64 nearly collinear keys of K = 1..3); the table takes 6.5 u x sqrt(cond), three
#: times the worst (docs/testing.md).  bf16-state: kappa x its baseline covers it (it needed 0; the
#: largest error / (kappa x baseline) was 0.33), plus a floor of 0.25 u sqrt(T).
CONTRACT_TERMS: dict[str, ContractTerm] = {
    "ieee": ContractTerm(unit=0.0, coef=0.0),
    "tf32": ContractTerm(unit=2.0 ** -11, coef=6.5, power=0.5),
    "bf16": ContractTerm(unit=2.0 ** -8, coef=6.5, power=0.5),
    "bf16-state": ContractTerm(unit=2.0 ** -8, coef=0.25, growth="sqrt"),
}

#: The chunk length the conditioning is measured over: 64, the largest chunk of this family's chunked
#: kernels (flash-linear-attention's chunk_gated_delta_rule); a triangular matrix's diagonal blocks have
#: the inverse's diagonal blocks as inverses, so aligned chunks of 32, 16 or 8 tokens are no worse.
CONDITIONING_CHUNK = 64
#: The conditioning a comparison is judged at when its caller passes none (``compare(conditioning=None)``
#: under a contract with a power): above the largest the calibration drew (477, over 3,000 cases), so the
#: term is then 6.5 x sqrt(500) = 145 u whatever the inputs: the loosest budget, never a false failure.
UNKNOWN_CONDITIONING = 500.0


def chunk_conditioning(k: torch.Tensor, beta: torch.Tensor, g: Optional[torch.Tensor],
                       chunk: int = CONDITIONING_CHUNK) -> torch.Tensor:
    """Per (request, value head), the largest infinity-norm condition number ``||L||_inf ||L^-1||_inf``
    over the slice's aligned chunks of ``chunk`` tokens, as a [B, HV] float64 tensor (on ``k``'s device)
    with every entry >= 1.

    ``L = I + strictly_lower(beta_i (k_i . k_j) exp(G_i - G_j))`` is the unit lower triangular matrix a
    chunked (WY / UT) form inverts; its conditioning bounds how much the rounding of the products ``k_i .
    k_j`` (TF32, bf16) is amplified by the inversion: 1 for orthogonal keys, about 10 for 64 random keys
    of K = 2, about 200 for 64 nearly collinear ones with beta = 1.  k: [B, T, H, K]; beta: [B, T, HV];
    g: [B, T, HV] or per-channel [B, T, HV, K] (None: no decay); a gate below -RESET_GATE counts as one.
    """
    B, T, H, K = k.shape
    HV = beta.shape[2]
    dev = k.device
    if B * HV == 0 or T == 0:
        return torch.ones(B, HV, dtype=torch.float64, device=dev)
    kk = k.detach().to(torch.float64).nan_to_num(0.0)
    if HV != H:
        kk = kk.repeat_interleave(HV // H, dim=2)
    bb = beta.detach().to(torch.float64).nan_to_num(0.0)
    gg = (torch.zeros(B, T, HV, dtype=torch.float64, device=dev) if g is None
          else g.detach().to(torch.float64).nan_to_num(0.0).clamp(min=-RESET_GATE[torch.float64]))
    per_channel = gg.dim() == 4
    c = chunk
    N = -(-T // c)
    pad = N * c - T
    if pad:  # zero keys: identity rows, which change no norm past 1
        kk = torch.nn.functional.pad(kk, (0, 0, 0, 0, 0, pad))
        bb = torch.nn.functional.pad(bb, (0, 0, 0, pad))
        gg = torch.nn.functional.pad(gg, ((0, 0) if per_channel else ()) + (0, 0, 0, pad))
    kk = kk.reshape(B, N, c, HV, K).permute(0, 3, 1, 2, 4).reshape(-1, c, K)  # [B*HV*N, c, K]
    bb = bb.reshape(B, N, c, HV).permute(0, 3, 1, 2).reshape(-1, c)
    if per_channel:
        G = gg.reshape(B, N, c, HV, K).permute(0, 3, 1, 2, 4).reshape(-1, c, K).cumsum(1)
    else:
        G = gg.reshape(B, N, c, HV).permute(0, 3, 1, 2).reshape(-1, c).cumsum(1)
    low = torch.tril(torch.ones(c, c, dtype=torch.bool, device=dev), -1)
    eye = torch.eye(c, dtype=torch.float64, device=dev)
    n = kk.shape[0]
    step = max(1, (1 << 24) // (c * c * (K if per_channel else 1)))  # bounded memory per batch of chunks
    out = torch.empty(n, dtype=torch.float64, device=dev)
    for a in range(0, n, step):
        s = slice(a, min(n, a + step))
        if per_channel:
            d = G[s, :, None, :] - G[s, None, :, :]
            d = torch.where(low[..., None], d, torch.full_like(d, -math.inf))
            A = (kk[s, :, None, :] * kk[s, None, :, :] * d.exp()).sum(-1)
        else:
            d = G[s, :, None] - G[s, None, :]
            d = torch.where(low, d, torch.full_like(d, -math.inf))
            A = (kk[s] @ kk[s].transpose(-1, -2)) * d.exp()
        L = eye + A * bb[s, :, None]
        Li = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
        out[s] = L.abs().sum(-1).amax(-1) * Li.abs().sum(-1).amax(-1)
    out = out.nan_to_num(nan=UNKNOWN_CONDITIONING, posinf=UNKNOWN_CONDITIONING).clamp_min(1.0)
    return out.reshape(B, HV, N).amax(-1)


_ACTIVE = ["ieee"]


def current_contract() -> str:
    """The contract ``compare`` judges by when none is passed (``active_contract``; default "ieee")."""
    return _ACTIVE[-1]


class active_contract:
    """``with active_contract("tf32"):`` every ``compare`` inside judges by that contract (the runner
    sets the lane's declared contract this way)."""

    def __init__(self, contract: str):
        if contract not in CONTRACT_TERMS:
            raise ValueError(f"contract: expected one of {', '.join(CONTRACT_TERMS)}, got {contract!r}")
        self.contract = contract

    def __enter__(self):
        _ACTIVE.append(self.contract)
        return self

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return False


def _contract_growth(contract: str, T: int) -> float:
    return math.sqrt(max(1, T)) if CONTRACT_TERMS[contract].growth == "sqrt" else 1.0


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance defined for {dtype}; the table covers {sorted(map(str, TOLERANCES))}")
    return TOLERANCES[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype decays and states are computed in for outputs of ``dtype``: float64 for float64,
    float32 for every narrower dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gate_spans(g: Optional[torch.Tensor], compute: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """Per (request, value head): the first-order bound, in units of ``eps(compute)``, of the rounding of
    any decay exponent ``G_i - G_j`` a cumulative-gate form computes, as a [B, HV] float64 tensor
    (per-channel gates [B, T, HV, K]: the largest channel's).  None for ``g=None``.

    With ``a_t = min(|g_t|, RESET_GATE)`` and ``A_m = a_1 + ... + a_m`` (a bound on |G_m| from any base
    token), a recursive sum ``G_m = G_{m-1} + g_m`` in unit roundoff u = eps / 2 gives
    ``|err(G_i - G_j)| <= u (sum_{j<m<=i} A_m + |G_i - G_j|)``.  Only pairs whose decay does not underflow
    matter: a gate below ``log(tiny(compute))`` (a reset; -inf and -1e30 are taken as -RESET_GATE) makes
    every decay across it 0 in the form and below the range of the dtype in the truth.  So the bound is
    ``(W + span) / 2`` with ``W`` the largest ``sum A_m`` over the tokens between two such gates and
    ``span = sum_t a_t``.  It grows with the tokens summed after a reset (each adds a rounding of the
    size of |G|), which a span alone does not.
    """
    if g is None:
        return None
    if g.dim() not in (3, 4):
        raise ValueError(f"g: expected [B, T, HV] or [B, T, HV, K], got shape {list(g.shape)}")
    # NaN: a row no form uses (verify's padding past num_drafts; a used NaN gate is rejected by the checks)
    g = g.detach().to(torch.float64).nan_to_num(nan=0.0)
    a = g.abs().clamp(max=RESET_GATE[compute])
    span = a.sum(dim=1)
    A = a.cumsum(dim=1)
    brk = g < math.log(torch.finfo(compute).tiny)
    S = torch.where(brk, torch.zeros_like(A), A).cumsum(dim=1)
    base = torch.where(brk, S, torch.zeros_like(S))
    W = (S - base.cummax(dim=1).values).amax(dim=1) if g.shape[1] else torch.zeros_like(span)
    r = (W + span) / 2
    if r.dim() == 3:
        r = r.amax(dim=-1) if r.shape[-1] else r.sum(dim=-1)
    return r


def gate_span(g: Optional[torch.Tensor], compute: torch.dtype = torch.float32) -> float:
    """The largest ``gate_spans`` entry (0.0 for ``g=None`` or no tokens): g [B, T, HV] or [B, T, HV, K]."""
    s = gate_spans(g, compute)
    return float(s.max()) if s is not None and s.numel() else 0.0


def _slice_view(x: torch.Tensor, head_axis: int) -> torch.Tensor:
    """[B, ..., H, ...] -> [B, H, rest] with (request, head) slices as rows (any size 0 allowed)."""
    x = x.movedim(head_axis, 1)
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


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


def _range_terms(expected: torch.Tensor, head_axis: int, valid: Optional[torch.Tensor],
                 dtype: torch.dtype, magnitude: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice: ``tiny(dtype) / rms(ref)``, the relative size of an error of one smallest normal number
    per element (0 where the slice's truth is 0: there any error is infinitely relative anyway), and the
    amplification of the decays' rounding: ``max(1, scale / ||ref||, ||magnitude|| / ||ref||)`` with
    ``scale`` the RMS of the comparison's slice norms (how much smaller than its siblings a slice came
    out by cancellation of rows of the usual size) and ``magnitude`` (``magnitudes``; None: not known) the
    same outputs summed in absolute value (how much the slice's own rows cancel)."""
    e = expected.detach().to(torch.float64)
    mag = None if magnitude is None else magnitude.detach().to(torch.float64)
    if valid is not None:
        mask = valid.expand(e.shape) if valid.shape != e.shape else valid
        e = torch.where(mask, e, torch.zeros((), dtype=e.dtype, device=e.device))
        if mag is not None:
            mag = torch.where(mask, mag, torch.zeros((), dtype=mag.dtype, device=mag.device))
        n = _slice_view(mask.to(torch.float64), head_axis).sum(dim=-1)
    else:
        n = torch.full(_slice_view(e, head_axis).shape[:2], float(_slice_view(e, head_axis).shape[-1]),
                       dtype=torch.float64, device=e.device)
    norm = _slice_view(e, head_axis).norm(dim=-1)
    tiny64 = torch.finfo(torch.float64).tiny
    ranges = torch.where(norm > 0, torch.finfo(dtype).tiny * n.sqrt() / norm.clamp_min(tiny64),
                         torch.zeros_like(norm))
    size = norm.square().mean().sqrt() if norm.numel() else norm.new_zeros(())
    if mag is not None:
        size = torch.maximum(size.expand_as(norm), _slice_view(mag, head_axis).norm(dim=-1))
    amp = torch.where(norm > 0, (size / norm.clamp_min(tiny64)).clamp_min(1.0), torch.ones_like(norm))
    return ranges, amp


def magnitudes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
               scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, S) of the float64 recurrence summed in absolute value: ``|S|_t = diag(exp(g_t)) |S|_{t-1} +
    |k_t| |u_t|^T`` from ``|S_0|``, ``|o|_t = |S|_t^T |q_t|``, with the innovations ``u_t`` of the true
    recurrence.  A decay exponent off by ``d`` changes each row of the output by at most ``d`` times its
    size, so an output's error from the decays' rounding is at most ``d x ||magnitude||``: the ratio
    ``||magnitude|| / ||truth||`` of a slice is how much its rows cancel (``compare(magnitude=...)``).
    Shapes as ``kvbuffer_ref.recurrent_gated_delta_rule``; o [B, T, HV, V] and S [B, HV, K, V] in float64."""
    x = {n: t.detach().to("cpu", torch.float64) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    B, T, H, K = x["q"].shape
    HV, V = x["v"].shape[2], x["v"].shape[3]
    s = K ** -0.5 if scale is None else float(scale)
    qq, kk = (x[n].repeat_interleave(HV // H, dim=2) for n in ("q", "k"))
    gg = x["g"].nan_to_num(nan=0.0).clamp(min=-RESET_GATE[torch.float64])
    S = (torch.zeros(B, HV, K, V, dtype=torch.float64) if initial_state is None
         else initial_state.detach().to("cpu", torch.float64))
    M = S.abs()
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    for t in range(T):
        d = gg[:, t].exp()
        d = d[..., None] if d.dim() == 3 else d[..., None, None]
        S, M = d * S, d * M
        u = x["beta"][:, t, :, None] * (x["v"][:, t] - torch.einsum("bhk,bhkv->bhv", kk[:, t], S))
        S = S + torch.einsum("bhk,bhv->bhkv", kk[:, t], u)
        M = M + torch.einsum("bhk,bhv->bhkv", kk[:, t].abs(), u.abs())
        o[:, t] = torch.einsum("bhk,bhkv->bhv", (s * qq[:, t]).abs(), M)
    return o, M


def gate_terms(x: dict, *, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
               tokens: slice = slice(None)) -> tuple[dict, dict]:
    """``compare``'s keywords for a cumulative-gate form judged against the recurrence over the inputs ``x``
    (q, k, v, g, beta) from ``initial_state``: (for its outputs at ``tokens``, for its final state), each
    ``g`` (the gates of every token of ``x``) and ``magnitude`` (``magnitudes``), so that form gets the
    budget the validator's properties give it::

        ko, kS = gate_terms(x, initial_state=S0)
        compare(o, o64, base_o, name="o", **ko); compare(S, S64, base_S, name="state", head_axis=1, **kS)
    """
    mo, mS = magnitudes(**x, scale=scale, initial_state=initial_state)
    return dict(g=x["g"], magnitude=mo[:, tokens]), dict(g=x["g"], magnitude=mS)


@dataclass(frozen=True)
class Comparison:
    """The verdict of one comparison against the float64 truth, reported at its deciding slice:
    the (request, head) slice with the largest ratio of error to budget.  ``gate_span`` is that
    slice's span (None: the comparison has no gate term), ``gate_scale`` its amplification ``max(1, size of its rows / ||ref||)``
    and ``range_term`` its ``tiny / rms(ref)``."""

    name: str
    dtype: torch.dtype
    worst_rel: float
    worst_slice: tuple[int, int]
    max_abs: float
    baseline_rel: float
    budget: float
    nonfinite: int
    gate_span: Optional[float] = None
    range_term: float = 0.0
    gate_scale: float = 1.0
    contract: str = "ieee"  # the contract judged by (budget includes its term)
    contract_term: float = 0.0  # that term at the deciding slice
    conditioning: Optional[float] = None  # the chunk conditioning of the deciding slice (contracts with a power)
    ratios: Optional[dict] = None  # {contract: the largest error / budget over the slices}

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.worst_rel <= self.budget

    def budget_terms(self) -> str:
        """The budget's terms at the deciding slice, as the report prints them."""
        tol = tolerance_for(self.dtype)
        terms = f"{tol.kappa:g} x baseline {self.baseline_rel:.3e} + {tol.floor:g} x eps {torch.finfo(self.dtype).eps:.2e}"
        if self.gate_span is not None:
            eps_c = torch.finfo(compute_dtype(self.dtype)).eps
            terms += (f" + ({tol.gate_floor:g} x gate span {self.gate_span:.3g} + reorder {tol.reorder_floor:g})"
                      f" x eps {eps_c:.2e}")
            if self.gate_scale > 1.0:
                terms += f" x {self.gate_scale:.3g} (the size of the slice's rows / its norm)"
        if self.contract_term:
            ct = CONTRACT_TERMS[self.contract]
            terms += (f" + {self.contract} {ct.coef:g} x u {ct.unit:.2e}"
                      + (" x sqrt(T)" if ct.growth == "sqrt" else "")
                      + (f" x conditioning {self.conditioning:.3g} ^ {ct.power:g}"
                         if ct.power and self.conditioning is not None else "")
                      + (f" x {self.gate_scale:.3g}" if self.gate_scale > 1.0 else "") + f" = {self.contract_term:.3e}")
        if self.range_term > 1e-3 * self.budget:
            terms += f" + tiny / rms(ref) {self.range_term:.3e}"
        return terms

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        b, h = self.worst_slice
        extra = f", {self.nonfinite} non-finite elements" if self.nonfinite else ""
        return (
            f"{verdict} {self.name} [{str(self.dtype).replace('torch.', '')}]: worst slice (request {b}, head {h}) "
            f"rel-RMS {self.worst_rel:.3e}, max-abs {self.max_abs:.3e}{extra}; budget {self.budget:.3e} = "
            f"{self.budget_terms()}"
        )


def compare(actual: torch.Tensor, expected: torch.Tensor, baseline: Optional[torch.Tensor] = None, *,
            name: str = "output", dtype: Optional[torch.dtype] = None, head_axis: int = 2,
            valid: Optional[torch.Tensor] = None, g: Optional[torch.Tensor] = None,
            contract: Optional[str] = None, tokens: Optional[int] = None,
            conditioning: Optional[torch.Tensor] = None, magnitude: Optional[torch.Tensor] = None) -> Comparison:
    """Compare ``actual`` with the float64 truth ``expected`` under the calibrated budget.

    contract: the arithmetic contract judged by (default ``current_contract()``: the lane's declared
    one): its term (``CONTRACT_TERMS``) is added to every slice's budget, and ``baseline`` must then be
    the plain recurrence run under that contract (``contracts.baseline_recurrent``): the properties
    compute it so.  tokens: the T tokens behind
    the compared values, for a contract whose error grows with T (default: ``g.shape[1]``, else 1).
    conditioning: per (request, head) slice, the chunk conditioning of the inputs behind the compared
    values (``chunk_conditioning(k, beta, g)``; a float holds for every slice), which scales the term of
    a contract with a ``power``; None: ``UNKNOWN_CONDITIONING`` (the loosest budget).

    baseline: the plain recurrent reference's output in the implementation's compute dtype (None
    when the comparison is float64 against float64: only the floors count).  dtype: whose row of
    the table applies (default ``actual.dtype``).  g: the log-gates [B, T, HV(, K)] of the tokens
    behind the compared values, for the gate-span term (None: a form without cumulative gates, no
    such term).  magnitude: the compared values summed in absolute value (``magnitudes``, shaped like
    ``expected``), whose slice norms scale the gate and contract terms where a slice's rows cancel (None:
    the comparison's RMS slice norm alone).  Empty tensors (B = 0, no tokens) agree.
    """
    if expected.dtype != torch.float64:
        raise TypeError(f"expected: the truth must be float64, got {expected.dtype}")
    if actual.shape != expected.shape:
        raise ValueError(f"actual: shape {list(actual.shape)} differs from expected {list(expected.shape)}")
    if baseline is not None and baseline.shape != expected.shape:
        raise ValueError(f"baseline: shape {list(baseline.shape)} differs from expected {list(expected.shape)}")
    if magnitude is not None and magnitude.shape != expected.shape:
        raise ValueError(f"magnitude: shape {list(magnitude.shape)} differs from expected {list(expected.shape)}")
    if not -actual.dim() <= head_axis < actual.dim():
        raise ValueError(f"head_axis: {head_axis} is out of range for a {actual.dim()}-d tensor")
    head_axis %= actual.dim()
    dtype = dtype or actual.dtype
    # the budget is computed on the host in float64, whatever device the tensors are on
    cpu = lambda t: None if t is None else t.detach().to("cpu")  # noqa: E731
    actual, expected, baseline, valid, g = cpu(actual), cpu(expected), cpu(baseline), cpu(valid), cpu(g)
    magnitude = cpu(magnitude)
    tol = tolerance_for(dtype)
    compute = compute_dtype(dtype)
    rel = rel_rms_slices(actual, expected, head_axis, valid)
    base = torch.zeros_like(rel) if baseline is None else rel_rms_slices(baseline, expected, head_axis, valid)
    spans = gate_spans(g, compute)
    if spans is not None and spans.shape != rel.shape:
        # gates that do not map one-to-one onto the compared slices: the largest span holds for all
        spans = torch.full_like(rel, float(spans.max()) if spans.numel() else 0.0)
    ranges, amp = _range_terms(expected, head_axis, valid, dtype, magnitude)
    span_term = 0.0 if spans is None else (tol.gate_floor * spans + tol.reorder_floor) * torch.finfo(compute).eps * amp
    budgets = tol.kappa * base + tol.floor * torch.finfo(dtype).eps + span_term + ranges
    contract = current_contract() if contract is None else contract
    if contract not in CONTRACT_TERMS:
        raise ValueError(f"contract: expected one of {', '.join(CONTRACT_TERMS)}, got {contract!r}")
    if tokens is None:
        tokens = int(g.shape[1]) if g is not None and g.dim() >= 2 else 1
    ct = CONTRACT_TERMS[contract]
    cond = None
    if ct.power:
        if conditioning is None:
            cond = torch.full_like(rel, UNKNOWN_CONDITIONING)
        else:
            cond = torch.as_tensor(conditioning, dtype=torch.float64).detach().cpu()
            if cond.shape != rel.shape:  # inputs that do not map one-to-one onto the slices: the worst holds
                cond = torch.full_like(rel, float(cond.max()) if cond.numel() else 1.0)
            cond = cond.clamp_min(1.0)
    extra = ct.coef * ct.unit * _contract_growth(contract, tokens) * amp
    if cond is not None:
        extra = extra * cond ** ct.power
    budgets = budgets + extra
    a = actual.detach().to(torch.float64)
    finite = torch.isfinite(a)
    v = torch.ones_like(finite) if valid is None else valid.expand(a.shape)
    nonfinite = int((~finite & v).sum())
    diff = torch.where(v & finite, (a - expected.detach().to(torch.float64)).abs(), torch.zeros((), dtype=a.dtype))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    if rel.numel() == 0:  # nothing to compare (B = 0 or no heads)
        return Comparison(name=name, dtype=dtype, worst_rel=0.0, worst_slice=(0, 0), max_abs=max_abs,
                          baseline_rel=0.0, budget=tol.floor * torch.finfo(dtype).eps, nonfinite=nonfinite,
                          gate_span=None if spans is None else 0.0, contract=contract,
                          ratios={contract: 0.0})
    # the slice that comes closest to (or goes furthest past) its own budget decides
    idx = int((rel / budgets).nan_to_num(nan=float("inf")).argmax())
    H = rel.shape[1]
    at = lambda t: float(t.reshape(-1)[idx])  # noqa: E731
    ratios = {contract: float((rel / budgets).nan_to_num(nan=float("inf")).max()) if not nonfinite else float("inf")}
    return Comparison(
        name=name, dtype=dtype, worst_rel=at(rel), worst_slice=(idx // H, idx % H), max_abs=max_abs,
        baseline_rel=at(base), budget=at(budgets), nonfinite=nonfinite,
        gate_span=None if spans is None else at(spans), range_term=at(ranges), gate_scale=at(amp),
        contract=contract, contract_term=at(extra) if contract != "ieee" else 0.0, ratios=ratios,
        conditioning=None if cond is None else at(cond),
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, baseline: Optional[torch.Tensor] = None,
                   **kw) -> Comparison:
    """``compare`` (with its keywords ``kw``) and raise AssertionError (worst slice, rel-RMS, max-abs, budget)
    unless it passes."""
    c = compare(actual, expected, baseline, **kw)
    if not c.passed:
        raise AssertionError(str(c))
    return c
