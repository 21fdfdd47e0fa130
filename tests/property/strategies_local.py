"""What the property tests draw beyond ``kvbuffer.validate.strategies.cases``, and the check that
their examples are not vacuous.

* ``Drawn``: a ``Case`` plus the regions its inputs cover: q and k of any norm (not only unit length),
  beta in [0, 2] (the write ``beta * ||k||^2`` kept in [0, 2], where the transition ``I - beta k k^T`` is
  non-expansive and float32 stays finite), per-token gates in the band (-104, -8) (exp(g) tiny or a
  float32 subnormal), very negative finite gates (-1e3 .. -1e30: a reset), slightly positive gates (a
  growing state), v scaled over six decades.  ``Drawn.inputs`` builds them from the case's seed, so a
  failure prints as one short line and replays exactly.
* ``Calling``: an implementation called with an explicit ``scale`` and non-contiguous inputs (last-axis
  strided, transposed back, sliced with a storage offset; the memory around each view is NaN), with the
  same values as the contiguous inputs the truth is computed from.  The explicit scale is
  ``2^j / sqrt(K)``: the truth sees ``q * 2^j`` with the default scale, the implementation ``q`` with
  ``scale``, exactly the same product in every dtype, so a scale that is ignored or applied twice is
  off by ``2^j``.
* ``Tally`` / ``informative``: an example whose truth is zero (e.g. beta = 0 and no initial state) or
  constant passes against an implementation that returns zeros; such examples are ``assume``d away,
  and ``counted`` fails a test when more than half of the examples it was given were vacuous.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
from hypothesis import assume
from hypothesis import strategies as st

import kvbuffer_ref as ref
from kvbuffer.validate import Case
from kvbuffer.validate import strategies as kst

#: the regimes drawn, informative ones first (hypothesis favours and shrinks towards the first)
GATES = ("mixed", "mild", "strong", "underflow", "zero")
BETAS = ("uniform", "mixed", "one")
#: with beta exactly 0 everywhere the truth is zero unless there is an initial state: only the properties
#: that start from one draw it (``drawn(betas=BETAS_WITH_STATE)``)
BETAS_WITH_STATE = BETAS + ("zero",)
LAYOUTS = ("contiguous", "strided", "transposed", "offset")
#: per-token gate bands mixed into a case's gates: None (the case's regime only)
BANDS = (None, "tiny", "reset", "growing")


@dataclasses.dataclass(frozen=True)
class Drawn:
    """A case and the input regions it covers (see the module docstring)."""

    case: Case
    q_norm: bool = False      # q rows of norms 10^U(-2, 2)
    k_norm: bool = False      # k rows of norms 10^U(-2, 0.5)
    wide_beta: bool = False   # beta in [0, 2]
    band: Optional[str] = None
    v_decades: float = 0.0    # v times 10^v_decades, and per (token, head) 10^U(-1, 1)
    scale_pow: int = 0        # explicit scale 2^scale_pow / sqrt(K) (0: the default, no scale passed)
    layout: str = "contiguous"

    def __getattr__(self, name):  # B, T, H, HV, K, V, seed, channel_gate, gate, beta, zero_key
        if name == "case":
            raise AttributeError(name)
        return getattr(self.case, name)

    def inputs(self, dtype: torch.dtype = torch.float64, device="cpu") -> dict:
        """The truth's inputs: q already multiplied by 2^scale_pow (see ``Calling``)."""
        c = self.case
        x = c.inputs(torch.float64)
        gen = torch.Generator().manual_seed(c.seed ^ 0x5EED)
        q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
        if self.q_norm:
            q = q * torch.pow(10.0, torch.empty(q.shape[:-1] + (1,), dtype=torch.float64).uniform_(-2, 2,
                                                                                                  generator=gen))
        if self.k_norm:
            k = k * torch.pow(10.0, torch.empty(k.shape[:-1] + (1,), dtype=torch.float64).uniform_(-2, 0.5,
                                                                                                  generator=gen))
        if self.wide_beta:
            beta = beta * 2.0
        # the write beta * ||k||^2 in [0, 2] (value head i reads q/k head i // (HV / H))
        kk = (k * k).sum(-1).repeat_interleave(c.HV // c.H, dim=2)
        beta = torch.minimum(beta, 2.0 / kk.clamp_min(1e-300))
        if self.band is not None:
            r = torch.rand(g.shape, generator=gen, dtype=torch.float64)
            pick = torch.rand(g.shape[:3] + (1,) * (g.dim() - 3), generator=gen, dtype=torch.float64) < 0.5
            band = {"tiny": -(8.0 + 96.0 * r),
                    "reset": -torch.pow(10.0, 3.0 + 27.0 * r),
                    "growing": 0.25 * r}[self.band]
            if self.band == "reset":  # one token in four, or the whole history is reset every step
                pick = pick & (torch.rand(pick.shape, generator=gen, dtype=torch.float64) < 0.5)
            pick[:, -1:] = False  # the last token keeps the case's gate: a final state that is itself
            # float32-subnormal (every term scaled by exp(-100)) has too few bits for any summation order
            g = torch.where(pick, band, g)
        if self.v_decades:
            v = v * 10.0 ** self.v_decades * torch.pow(
                10.0, torch.empty(v.shape[:-1] + (1,), dtype=torch.float64).uniform_(-1, 1, generator=gen))
        q = q * 2.0 ** self.scale_pow
        out = dict(q=q, k=k, v=v, g=g, beta=beta)
        gate_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return {n: t.to(device=device, dtype=gate_dtype if n in ("g", "beta") else dtype) for n, t in out.items()}


@st.composite
def drawn(draw, *, regions: bool = True, layouts=LAYOUTS, scale: bool = True, **case_kw) -> Drawn:
    """A ``Drawn``: the case from ``kst.cases(**case_kw)`` (informative regimes first), and (when
    ``regions``) each region drawn on or off, the band, the v scale, the explicit scale and the layout."""
    case_kw.setdefault("gates", GATES)
    case_kw.setdefault("betas", BETAS)
    case = draw(kst.cases(**case_kw), label="case")
    if not regions:
        return Drawn(case)
    return Drawn(
        case,
        q_norm=draw(st.booleans(), label="q of any norm"),
        k_norm=draw(st.booleans(), label="k of any norm"),
        wide_beta=draw(st.booleans(), label="beta in [0, 2]"),
        band=draw(st.sampled_from(BANDS), label="gate band"),
        v_decades=draw(st.sampled_from([0.0, -3.0, 3.0, 1.5]), label="v decades"),
        scale_pow=draw(st.sampled_from([0, -2, 3]) if scale else st.just(0), label="scale 2^j/sqrt(K)"),
        layout=draw(st.sampled_from(layouts), label="layout"),
    )


# ----------------------------------------------------------------------------- calling an implementation
def strided_like(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in a non-contiguous (or offset) view; the memory around the view is NaN (or -1 for
    integers), so an implementation that reads past it fails."""
    if layout == "contiguous" or x.dim() == 0:
        return x
    fill = float("nan") if x.dtype.is_floating_point else -1
    if layout == "strided":  # every other element of the last axis
        base = torch.full(x.shape[:-1] + (2 * x.shape[-1],), fill, dtype=x.dtype, device=x.device)
        view = base[..., ::2]
    elif layout == "transposed":  # tokens and heads swapped in memory, transposed back
        if x.dim() < 3:
            return strided_like(x, "offset")
        view = torch.full_like(x.transpose(1, 2), fill).contiguous().transpose(1, 2)
    elif layout == "offset":  # a slice of a larger tensor: storage offset > 0 and padded rows
        base = torch.full((x.shape[0] + 1,) + x.shape[1:-1] + (x.shape[-1] + 3,), fill, dtype=x.dtype, device=x.device)
        view = base[1:, ..., 1:x.shape[-1] + 1]
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    view.copy_(x)
    assert torch.equal(view.nan_to_num(0.0), x.nan_to_num(0.0)) or not x.dtype.is_floating_point
    return view


_TOKEN_OPS = ("recurrent_gated_delta_rule", "chunk_gated_delta_rule", "direct_gated_delta_rule", "buffered_decode",
              "verify", "prefill")
_OTHER_OPS = ("flush", "accept", "materialize_state")


class Calling:
    """``impl`` called as ``drawn`` says: q divided by 2^scale_pow and scale = 2^scale_pow / sqrt(K)
    passed explicitly (when scale_pow != 0), token tensors (and an initial state) in ``drawn.layout``."""

    def __init__(self, impl, d: Drawn, *, state_layout: bool = True):
        self._impl, self._d, self._state_layout = impl, d, state_layout
        for name in _TOKEN_OPS:
            if hasattr(impl, name):
                setattr(self, name, self._wrap(getattr(impl, name)))
        for name in _OTHER_OPS:
            if hasattr(impl, name):
                setattr(self, name, getattr(impl, name))

    def _wrap(self, fn):
        d = self._d

        @functools.wraps(fn)
        def call(q, k, v, *, g, beta, **kw):
            if d.scale_pow:
                q = q * 2.0 ** -d.scale_pow  # exact: a power of two
                kw["scale"] = 2.0 ** d.scale_pow / math.sqrt(q.shape[-1])
            q, k, v, g, beta = (strided_like(t, d.layout) for t in (q, k, v, g, beta))
            if self._state_layout and kw.get("initial_state") is not None:
                kw["initial_state"] = strided_like(kw["initial_state"], d.layout)
            return fn(q, k, v, g=g, beta=beta, **kw)

        return call


# ----------------------------------------------------------------------------- vacuous examples
class Tally:
    """Examples a test was given and how many were informative (see ``counted``)."""

    def __init__(self):
        self.total = 0
        self.informative = 0


_CURRENT: list[Tally] = []


def is_informative(x: dict, initial_state: Optional[torch.Tensor] = None, *, tokens=None) -> bool:
    """Whether the truth on ``x`` (the float64 recurrence from ``initial_state``; outputs of ``tokens``, a
    slice of T, default all) can tell a wrong implementation from a right one: at least half of its
    (request, head) output slices are nonzero and the output is not constant."""
    x64 = {n: t.detach().to("cpu", torch.float64) for n, t in x.items()}
    s0 = None if initial_state is None else initial_state.detach().to("cpu", torch.float64)
    o, _ = ref.recurrent_gated_delta_rule(**x64, initial_state=s0)
    o = o[:, tokens] if tokens is not None else o
    ok = o.numel() > 0
    if ok:
        nonzero = o.abs().amax(dim=(1, 3)) > 0  # [B, HV]
        ok = bool(nonzero.float().mean() >= 0.5) and bool((o.amax() - o.amin()) > 0)
    return ok


def informative(x: dict, initial_state: Optional[torch.Tensor] = None, *, tokens=None) -> bool:
    """``is_informative``, recorded in the running test's tally and ``assume``d (a vacuous example does
    not count as a check)."""
    ok = is_informative(x, initial_state, tokens=tokens)
    if _CURRENT:
        _CURRENT[-1].total += 1
        _CURRENT[-1].informative += int(ok)
    assume(ok)
    return ok


def counted(min_fraction: float = 0.5):
    """Decorator (outside ``@given``): the test fails if fewer than ``min_fraction`` of the examples it
    was given were informative (``informative``), or if it never called ``informative``."""

    def deco(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            tally = Tally()
            _CURRENT.append(tally)
            try:
                test(*args, **kwargs)
            finally:
                _CURRENT.pop()
            assert tally.total, f"{test.__name__}: no example went through informative()"
            frac = tally.informative / tally.total
            assert frac >= min_fraction, (
                f"{test.__name__}: only {tally.informative} of {tally.total} examples had a truth that is neither "
                f"zero nor constant (at least {min_fraction:.0%} must): the strategy draws vacuous cases")

        return run

    return deco


# ----------------------------------------------------------------------------- buffer setups
@st.composite
def buffered(draw, *, max_capacity=6, max_history=10, max_new=6, min_new=0, **case_kw):
    """(drawn, capacity, history P, ragged lengths) with T = P + new tokens."""
    C = draw(st.integers(1, max_capacity), label="capacity")
    P = draw(st.integers(0, max_history), label="history")
    new = draw(st.integers(min_new, max_new), label="new tokens")
    d = draw(drawn(T=P + new, **case_kw))
    lengths = draw(st.lists(st.integers(0, min(P, C)), min_size=d.B, max_size=d.B), label="lengths")
    return d, C, P, lengths


# ----------------------------------------------------------------------------- kvbuffer_fast sizes
#: head dims of the fast tests: non-powers of two, one 16-wide tile and several, up to 64
FAST_DIMS = (3, 8, 24, 40, 64, 16)


def programs(d, steps: int) -> int:
    """The interpreter's cost of ``steps`` tokens of ``d``: programs (requests x value heads x 16-wide V
    tiles) times steps, each program a K x 16 tile."""
    return d.B * d.HV * -(-d.V // 16) * max(steps, 1) * max(1, d.K // 32)


@st.composite
def fast_drawn(draw, *, steps=None, budget: int = 48, **case_kw):
    """``drawn`` at kvbuffer_fast sizes: B up to 5, H up to 4 with groups of up to 2 value heads, K and V
    from FAST_DIMS, kept under ``budget`` interpreter programs x steps (``steps(d)``, default d.T)."""
    for name, value in dict(max_B=5, max_H=4, max_group=2, dims=FAST_DIMS).items():
        case_kw.setdefault(name, value)
    d = draw(drawn(**case_kw))
    assume(programs(d, d.T if steps is None else steps(d)) <= budget)
    return d
