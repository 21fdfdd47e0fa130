"""Deterministic test inputs: a ``Case`` names shapes and regimes plus a seed; tensors come from the seed.

Hypothesis draws the (small, shrinkable) ``Case`` fields; the tensors are generated from them, so a
failing case prints as a short line and replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GATE_REGIMES", "BETA_REGIMES", "Case", "make_inputs", "cast_inputs", "upcast_inputs"]

#: log-gate regimes: exactly 0 (no decay), mild [-0.5, 0], strong [-8, -1], underflowing [-120, -104]
#: (exp(g) is exactly 0 in float32 and below 1e-45 in float64), and a per-element mix of the four.
GATE_REGIMES = ("zero", "mild", "strong", "underflow", "mixed")
#: write-strength regimes: exactly 0, exactly 1, uniform in [0, 1], a mix of all three.
BETA_REGIMES = ("zero", "one", "uniform", "mixed")


@dataclass(frozen=True)
class Case:
    """Shapes, regimes and a seed: everything needed to rebuild one test's inputs."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    channel_gate: bool = False
    gate: str = "mild"
    beta: str = "uniform"
    zero_key: bool = False
    seed: int = 0

    def inputs(self, dtype: torch.dtype = torch.float64, device="cpu") -> dict:
        """q, k, v, g, beta for this case (see ``make_inputs``)."""
        return make_inputs(self, dtype, device)


def _gates(shape, regime: str, gen: torch.Generator) -> torch.Tensor:
    r = torch.rand(shape, generator=gen, dtype=torch.float64)
    by = {
        "zero": torch.zeros(shape, dtype=torch.float64),
        "mild": -0.5 * r,
        "strong": -(1.0 + 7.0 * r),
        "underflow": -(104.0 + 16.0 * r),
    }
    if regime != "mixed":
        return by[regime]
    pick = torch.randint(0, 4, shape, generator=gen)
    return torch.stack([by["zero"], by["mild"], by["strong"], by["underflow"]], dim=-1).gather(
        -1, pick.unsqueeze(-1)).squeeze(-1)


def _betas(shape, regime: str, gen: torch.Generator) -> torch.Tensor:
    r = torch.rand(shape, generator=gen, dtype=torch.float64)
    by = {"zero": torch.zeros(shape, dtype=torch.float64), "one": torch.ones(shape, dtype=torch.float64), "uniform": r}
    if regime != "mixed":
        return by[regime]
    pick = torch.randint(0, 3, shape, generator=gen)
    return torch.stack([by["zero"], by["one"], by["uniform"]], dim=-1).gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def make_inputs(case: Case, dtype: torch.dtype = torch.float64, device="cpu") -> dict:
    """Inputs of ``case``: L2-normalised q and k (one zero key row if ``zero_key``), Gaussian v,
    gates and betas by regime.  Drawn in float64 on the CPU from ``case.seed``, then cast."""
    if case.gate not in GATE_REGIMES:
        raise ValueError(f"case.gate: expected one of {GATE_REGIMES}, got {case.gate!r}")
    if case.beta not in BETA_REGIMES:
        raise ValueError(f"case.beta: expected one of {BETA_REGIMES}, got {case.beta!r}")
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = _gates((B, T, HV, K) if case.channel_gate else (B, T, HV), case.gate, gen)
    beta = _betas((B, T, HV), case.beta, gen)
    if case.zero_key and T > 0:
        t = int(torch.randint(0, T, (1,), generator=gen))
        k[:, t] = 0.0
    return cast_inputs(dict(q=q, k=k, v=v, g=g, beta=beta), dtype, device)


def cast_inputs(x: dict, dtype: torch.dtype, device="cpu", gate_dtype: torch.dtype | None = None) -> dict:
    """q, k, v in ``dtype``; g and beta in ``gate_dtype`` (default: float32 for half dtypes, as serving keeps them)."""
    if gate_dtype is None:
        gate_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return {n: t.to(device=device, dtype=gate_dtype if n in ("g", "beta") else dtype) for n, t in x.items()}


def upcast_inputs(x: dict) -> dict:
    """The same (already rounded) inputs in float64 on the CPU: what the truth is computed from."""
    return {n: t.detach().to(device="cpu", dtype=torch.float64) for n, t in x.items()}
