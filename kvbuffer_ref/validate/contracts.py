"""Arithmetic contracts: the precision a kernel declares it keeps, and a plain-PyTorch emulation of each.

A kernel of this family rarely computes float32 inputs in IEEE float32 throughout: on a GPU, Triton's
``tl.dot`` of float32 operands multiplies in TF32 by default (10-bit mantissa), bf16 kernels multiply
bf16 operands and accumulate in float32, and some engines keep the recurrent state in bf16.  An
adapter states which of these it keeps (``contract = "tf32"``); the budget of every comparison then
gains the contract's term from the one tolerance table (``tolerances.CONTRACT_TERMS``).

The contracts, and the emulation used to calibrate them (``emulate``):

    ieee        every product and sum in the compute dtype (float32): today's budgets, the default
    tf32        the operands of every matrix / vector product rounded to TF32 (10-bit mantissa,
                round to nearest even), accumulated in float32
    bf16        the operands of every product rounded to bfloat16 (8-bit mantissa), float32 accumulation
    bf16-state  IEEE float32 products, the recurrent state rounded to bfloat16 after every token

``emulate(contract)`` is a torch function mode: inside it, every ``torch.einsum`` (the reference's
forms take all their products through einsum) rounds its operands as the contract says and
``kvbuffer_ref.recurrent_gated_delta_rule`` can be run token by token with a bf16 state
(``recurrent_bf16_state``).  ``python3 -m kvbuffer_ref.validate.contracts`` re-runs the calibration
(docs/testing.md, "Calibration"): the reference's recurrent and chunked forms under each emulated
contract over many random cases, the coefficient each slice needs, and the worst.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CONTRACTS", "CONTRACT_TEXT", "round_tf32", "round_bf16", "emulate", "recurrent_bf16_state",
           "run_emulated", "check_contract", "baseline_recurrent"]

#: The contracts an adapter may declare, tightest first (``ieee`` is the default).
CONTRACTS = ("ieee", "tf32", "bf16", "bf16-state")
#: How the report names a contract ("FAIL as fp32; PASS as tf32: error consistent with TF32 products").
CONTRACT_TEXT = {
    "ieee": ("fp32", "IEEE float32 arithmetic"),
    "tf32": ("tf32", "TF32 products"),
    "bf16": ("bf16", "bfloat16 products with float32 accumulation"),
    "bf16-state": ("bf16-state", "a bfloat16 recurrent state"),
}


def check_contract(name, label: str = "contract") -> str:
    """``name`` if it is a known contract (also accepts 'fp32' for 'ieee'); ValueError naming the argument."""
    if name in ("fp32", "float32", None):
        return "ieee"
    if name not in CONTRACTS:
        raise ValueError(f"{label}: expected one of {', '.join(CONTRACTS)}, got {name!r}")
    return name


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32 (10 explicit mantissa bits, round to nearest even), kept in its dtype (float64
    through float32: TF32 has float32's range)."""
    if x.dtype == torch.float64:
        return round_tf32(x.float()).double()
    if x.dtype != torch.float32:
        return x
    b = x.contiguous().view(torch.int32)
    lsb = (b >> 13) & 1
    r = (b + 0xFFF + lsb) & ~0x1FFF
    out = r.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 (round to nearest even), kept in its dtype."""
    if not x.is_floating_point() or x.dtype == torch.bfloat16:
        return x
    return x.to(torch.bfloat16).to(x.dtype)


_ROUND = {"tf32": round_tf32, "bf16": round_bf16}


class _Products(TorchFunctionMode):
    """Every ``torch.einsum`` with its operands rounded by ``fn`` (the products of the reference's forms)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.einsum and args and isinstance(args[0], str):
            args = (args[0], *[self.fn(a) if isinstance(a, torch.Tensor) else a for a in args[1:]])
        return func(*args, **kwargs)


def emulate(contract: str):
    """A context in which the reference's products follow ``contract`` ("tf32" or "bf16"; "ieee" and
    "bf16-state" change no product: a no-op)."""
    contract = check_contract(contract)
    if contract in _ROUND:
        return _Products(_ROUND[contract])
    return contextlib.nullcontext()


def recurrent_bf16_state(q, k, v, *, g, beta, scale=None, initial_state=None):
    """The plain recurrence (in the inputs' compute dtype) with its state rounded to bfloat16 after every
    token: (o, S)."""
    import kvbuffer_ref as ref

    B, T, HV, V = v.shape
    K = k.shape[-1]
    dt = torch.promote_types(q.dtype, torch.float32)
    S = (torch.zeros(B, HV, K, V, dtype=dt, device=q.device) if initial_state is None
         else round_bf16(initial_state.to(dt)))
    outs = []
    for t in range(T):
        sl = slice(t, t + 1)
        o, S = ref.recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl],
                                              scale=scale, initial_state=S, output_final_state=True)
        S = round_bf16(S)
        outs.append(o)
    return torch.cat(outs, 1) if outs else v.new_zeros(B, 0, HV, V), S


def baseline_recurrent(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=True,
                       contract=None):
    """The plain recurrence under ``contract`` (default: the active one, ``tolerances.current_contract``):
    the baseline every comparison's budget is relative to (``ieee``: the plain recurrence itself)."""
    import kvbuffer_ref as ref

    from .tolerances import current_contract

    contract = check_contract(current_contract() if contract is None else contract)
    if contract == "bf16-state":
        o, S = recurrent_bf16_state(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state)
        return o, (S if output_final_state else None)
    with emulate(contract):
        return ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                              output_final_state=output_final_state)


def run_emulated(form: str, contract: str, x: dict, S0=None, chunk_size: int = 16, scale=None):
    """(o, S) of the reference's ``form`` ("recurrent" or "chunk") on float32 inputs ``x`` under ``contract``."""
    import kvbuffer_ref as ref

    if contract == "bf16-state":
        if form != "recurrent":
            raise ValueError("form: the bf16-state emulation is the token-by-token recurrence")
        return recurrent_bf16_state(**x, scale=scale, initial_state=S0)
    with emulate(contract):
        if form == "recurrent":
            return ref.recurrent_gated_delta_rule(**x, initial_state=S0, output_final_state=True, scale=scale)
        return ref.chunk_gated_delta_rule(**x, initial_state=S0, output_final_state=True, chunk_size=chunk_size,
                                          scale=scale)


# ----------------------------------------------------------------------------- calibration
def _kernels(contract: str, x: dict, S0, rng):
    """(name, (o, S)) of the "kernels" a contract is calibrated on: the reference's other forms under the
    emulated contract, which sum in other orders than the baseline (the recurrence under the contract)."""
    if contract == "bf16-state":  # products in float64, the state rounded to bf16 every token
        x64 = {n: t.double() for n, t in x.items()}
        o, S = recurrent_bf16_state(**x64, initial_state=None if S0 is None else S0.double())
        yield "recurrent[float64 products, bf16 state]", (o.float(), S.float())
        return
    for cs in (4, 16, 64):
        yield f"chunk[{cs}]", run_emulated("chunk", contract, x, S0, chunk_size=cs)
    x64 = {n: t.double() for n, t in x.items()}
    with emulate(contract):  # the same roundings, float64 accumulation
        o, S = __import__("kvbuffer_ref").recurrent_gated_delta_rule(
            **x64, initial_state=None if S0 is None else S0.double(), output_final_state=True)
    yield "recurrent[float64 accumulation]", (o.float(), S.float())


def calibrate(n: int = 300, seed: int = 0, max_T: int = 136, contracts=("tf32", "bf16", "bf16-state"),
              verbose: bool = False) -> dict:
    """The coefficient of each contract's term that the emulated kernels need over ``n`` random cases, with
    the budget's other terms as the table has them (kappa x the contract baseline's error, floor, gate
    span): {contract: (worst coefficient, where, worst error / kappa x baseline)}.  Per slice, the need is
    ``(rel - kappa x rel(baseline) - floor x eps - gate term) / (unit x growth x amp x cond ** power)``
    with ``cond`` the slice's chunk conditioning (``tolerances.chunk_conditioning``) and ``power`` the table's."""
    import random

    import kvbuffer_ref as ref

    from .cases import Case
    from .tolerances import (CONTRACT_TERMS, TOLERANCES, _contract_growth, _range_terms, chunk_conditioning, gate_spans,
                             magnitudes, rel_rms_slices)

    tol = TOLERANCES[torch.float32]
    eps = torch.finfo(torch.float32).eps
    rng = random.Random(seed)
    worst = {c: [0.0, None, 0.0] for c in contracts}
    gates = ("mild", "strong", "mixed", "zero", "wide", "reset", "band")
    dims = (1, 2, 3, 5, 8, 16, 32, 64, 128)
    for i in range(n):
        T = rng.choice((1, 2, 3, 8, 17, 40, 64, max_T))
        K, V = rng.choice(dims), rng.choice(dims)
        if K * V * T > 200_000:
            K, V = min(K, 32), min(V, 32)
        case = Case(B=rng.randint(1, 2), T=T, H=1, HV=rng.choice((1, 2)), K=K, V=V,
                    channel_gate=rng.random() < 0.3, gate=rng.choice(gates),
                    beta=rng.choice(("uniform", "mixed", "one")), seed=rng.randrange(2**31),
                    norm=rng.choice(("unit", "any")), v_scale=rng.choice((1.0, 0.05, 20.0)))
        x = case.inputs(torch.float32)
        x64 = {k: t.double() for k, t in x.items()}
        S0 = torch.randn(case.B, case.HV, K, V, generator=torch.Generator().manual_seed(case.seed), dtype=torch.float64)
        S0 = (0.5 * S0).float() if rng.random() < 0.7 else None
        o64, S64 = ref.recurrent_gated_delta_rule(**x64, initial_state=None if S0 is None else S0.double(),
                                                  output_final_state=True)
        cond = chunk_conditioning(x["k"], x["beta"], x["g"])
        mo, mS = magnitudes(**x, initial_state=S0)
        for c in contracts:
            term = CONTRACT_TERMS[c]
            ob, Sb = baseline_recurrent(**x, initial_state=S0, contract=c)
            for kname, (o, S) in _kernels(c, x, S0, rng):
                for name, a, e, b, ax, m in (("o", o, o64, ob, 2, mo), ("state", S, S64, Sb, 1, mS)):
                    rel = rel_rms_slices(a, e, ax)
                    base = rel_rms_slices(b, e, ax)
                    ranges, amp = _range_terms(e, ax, None, torch.float32, m)
                    spans = gate_spans(x["g"], torch.float32)
                    rest = tol.kappa * base + tol.floor * eps + (tol.gate_floor * spans + tol.reorder_floor) * eps * amp + ranges
                    shape = cond ** term.power  # the term's conditioning factor
                    need = float(((rel - rest) / (term.unit * _contract_growth(c, T) * amp * shape)).max())
                    ratio = float((rel / (tol.kappa * base).clamp_min(1e-300)).max())
                    worst[c][2] = max(worst[c][2], ratio)
                    if need > worst[c][0]:
                        worst[c][:2] = need, f"{kname}.{name} {case} (conditioning {float(cond.max()):.3g})"
                        if verbose:
                            print(f"  {c}: {need:.3f} at {worst[c][1]} (rel {float(rel.max()):.2e})", flush=True)
        if verbose and (i + 1) % 100 == 0:
            print(f"{i + 1}/{n} cases: " + ", ".join(f"{c} {w[0]:.3f}" for c, w in worst.items()), flush=True)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="calibrate the contract terms of the tolerance table")
    ap.add_argument("-n", type=int, default=300, help="random cases (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-T", type=int, default=136)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from .tolerances import CONTRACT_TERMS
    worst = calibrate(args.n, args.seed, args.max_T, verbose=args.verbose)
    print(f"{args.n} cases in {time.perf_counter() - t0:.0f}s (seed {args.seed}, T up to {args.max_T})")
    for c, (w, where, ratio) in worst.items():
        coef = CONTRACT_TERMS[c].coef
        margin = f"margin {coef / w:.1f}x" if w > 0 else "kappa x the baseline covers every slice"
        print(f"{c:<11} needs coef {w:.3f} (the table has {coef:g}: {margin}) at {where}; "
              f"largest error / (kappa x contract baseline) {ratio:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
