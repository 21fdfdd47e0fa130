"""What a budget is worth: per lane, how much room the budget leaves a correct kernel and how far past it a
kernel off by 1 % lands, at Qwen3-Next's heads and real lengths.

    python3 scripts/budget_table.py                        # CPU: kvbuffer_ref in float32 and bfloat16
    python3 scripts/budget_table.py --impl reference-bf16 --dtypes bfloat16   # bfloat16 products, emulated
    python3 scripts/budget_table.py --device cuda --impl reference,fast --T 64,1024,4096 --json out.json

For every lane (recurrent, chunk, direct, decode, verify + accept, prefill), dtype, gate kind (scalar,
per-channel) and length T it runs the validator's own property (``kvbuffer.validate.properties``) on
one case, under the arithmetic contract the implementation's adapter declares for that lane (kvbuffer_fast's
compiled chunk kernels: bfloat16 products for 16-bit inputs), for the correct implementations and for three
wrong ones built from each: q scaled by 1.01 (a 1 %
wrong scale), g scaled by 1.01 and beta scaled by 1.01.  It prints budget / error for the correct ones
(how loose the RMS budget is; the rule wants it small), their mean gain over its budget (the gain check's
room: well below 1), and error / budget for the wrong ones (the larger of the RMS and the gain check's
ratios; above 1: the wrong kernel FAILs), each the worst over the lane's comparisons.  ``reference-bf16`` is
kvbuffer_ref with every product rounded to bfloat16 (``contracts.emulate``), declaring bfloat16 products: a
correct kernel in that arithmetic on a CPU.  Exit status 1 when a correct kernel fails,
a wrong one passes, or a correct kernel's budget is more than 20x its error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvbuffer.implementations import resolve  # noqa: E402
from kvbuffer.validate import Case  # noqa: E402
from kvbuffer.validate import properties as P  # noqa: E402
from kvbuffer.validate.contracts import under_contract  # noqa: E402
from kvbuffer.validate.tolerances import active_contract  # noqa: E402

LOOSEST = 20.0  # a correct kernel's budget over its error must stay below this
#: the validator's operation behind each lane here (whose declared arithmetic contract the lane is judged by)
OPS = {"recurrent": "recurrent", "chunk": "chunk", "direct": "direct", "decode": "decode[u]",
       "verify+accept": "verify_chain[u]", "prefill": "prefill[u]"}


def wrong(impl, name: str, factor: float = 1.01):
    """``impl`` with every token input of one kind off by ``factor``: "scale" (q), "gate" (g) or "beta"."""
    key = {"scale": "q", "gate": "g", "beta": "beta"}[name]

    def wrap(fn):
        def call(*args, **kw):
            if key in kw and torch.is_tensor(kw[key]):
                kw[key] = kw[key] * factor
            return fn(*args, **kw)
        return call

    ops = ("recurrent_gated_delta_rule", "chunk_gated_delta_rule", "direct_gated_delta_rule", "buffered_decode",
           "verify", "prefill")
    ns = types.SimpleNamespace(**{n: getattr(impl, n) for n in dir(impl) if not n.startswith("_")})
    for op in ops:
        if hasattr(impl, op):
            setattr(ns, op, wrap(getattr(impl, op)))
    return ns


def emulated(impl, contract: str):
    """``impl`` with each public operation computed under ``contract``'s products (``contracts.under_contract``)."""
    return types.SimpleNamespace(**{n: under_contract(getattr(impl, n), contract)
                                    if callable(getattr(impl, n)) and not n.startswith("_")
                                    else getattr(impl, n) for n in dir(impl) if not n.startswith("__")})


def lanes(T: int):
    """(lane, property, keywords) at length T: the buffer lanes keep a buffer of 64 and decode their last tokens."""
    C = 64
    return [
        ("recurrent", P.check_recurrent, {}),
        ("chunk", P.check_chunk, dict(chunk_size=64)),
        ("direct", P.check_direct, {}) if T <= 256 else None,
        ("decode", P.check_decode, dict(capacity=C, history=T - 8, lengths=None)),
        ("verify+accept", P.check_verify_accept, dict(capacity=C, history=T - 6, lengths=None, after=1)),
        ("prefill", P.check_prefill, dict(capacity=C, prompt=T - 8, tail=None)),
    ]


def run_lane(impl, fn, case: Case, dtype, kw: dict, device: str):
    kw = dict(kw)
    if "lengths" in kw:
        h = kw["history"]
        kw["lengths"] = [min(h, 64 - 1), h % 64][: case.B] + [min(h, 40)] * max(0, case.B - 2)
    if fn is P.check_verify_accept:
        D = 5
        kw.update(parents=[list(range(-1, D - 1))] * case.B, num_drafts=[D] * case.B, nodes=[D - 1, 2][: case.B])
    return fn(impl, case, dtype, device=device, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", default="reference", help="comma list: reference, fast")
    ap.add_argument("--T", default="64,1024", help="comma list of lengths")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--gates", default="scalar,channel", help="comma list: scalar, channel")
    ap.add_argument("--heads", default="16,32,128,128", help="H,HV,K,V (default Qwen3-Next's)")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    H, HV, K, V = (int(t) for t in a.heads.split(","))
    impls, contracts = {}, {}
    for name in a.impl.split(","):
        if name in ("reference", "reference-bf16"):
            import kvbuffer_ref
            impls[name.replace("reference", "kvbuffer_ref")] = (kvbuffer_ref if name == "reference"
                                                                else emulated(kvbuffer_ref, "bf16"))
        elif name == "fast":
            import kvbuffer_fast
            impls["kvbuffer_fast"] = kvbuffer_fast
        else:
            raise SystemExit(f"--impl: expected reference, reference-bf16 or fast, got {name!r}")
    declared = {n: resolve("fast" if n == "kvbuffer_fast" else "reference") for n in impls}
    rows, bad = [], 0
    print(f"{'impl':<19} {'lane':<14} {'dtype':<9} {'gate':<8} {'arith':<5} {'T':>5}  {'budget/err':>10} "
          f"{'gain/budget':>11}  {'scale x1.01':>11} {'gate x1.01':>10} {'beta x1.01':>10}  "
          f"(wrong: error/budget, FAIL above 1)", flush=True)
    for T in (int(t) for t in a.T.split(",")):
        for dname in a.dtypes.split(","):
            dtype = getattr(torch, dname)
            for channel in [g == "channel" for g in a.gates.split(",")]:
                case = Case(B=a.B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel, gate="mild", beta="uniform",
                            seed=7, norm="unit")
                for iname, impl in impls.items():
                    if iname == "kvbuffer_fast" and a.device == "cpu" and dtype == torch.bfloat16:
                        continue  # the Triton interpreter mishandles bf16
                    for lane in lanes(T):
                        if lane is None:
                            continue
                        lname, fn, kw = lane
                        t0 = time.perf_counter()
                        contract = ("bf16" if iname.endswith("-bf16")
                                    else declared[iname].contract_for(OPS[lname], dtype))
                        with active_contract(contract):
                            good = run_lane(impl, fn, case, dtype, kw, a.device)
                            res = {w: run_lane(wrong(impl, w), fn, case, dtype, kw, a.device)
                                   for w in ("scale", "gate", "beta")}
                        loose = min(c.budget / max(c.worst_rel, 1e-300) for c in good)
                        gain = max((abs(c.gain) / c.gain_budget for c in good if c.gain_judged), default=None)
                        ok = all(c.passed for c in good)
                        past = {w: max(c.ratio for c in cs) for w, cs in res.items()}
                        row = dict(impl=iname, lane=lname, dtype=dname, gate="channel" if channel else "scalar", T=T,
                                   contract=contract, gain_over_budget=gain,
                                   budget_over_error=loose, correct_passed=ok, device=a.device,
                                   **{f"{w}_error_over_budget": v for w, v in past.items()},
                                   seconds=time.perf_counter() - t0)
                        rows.append(row)
                        flag = ""
                        if not ok or loose > LOOSEST or min(past.values()) <= 1.0:
                            bad += 1
                            flag = "  <-- " + ("correct FAILS" if not ok else "budget too loose" if loose > LOOSEST
                                              else "a wrong kernel PASSES")
                        gtxt = "-" if gain is None else f"{gain:.3f}"
                        print(f"{iname:<19} {lname:<14} {dname:<9} {row['gate']:<8} {contract:<5} {T:>5}  {loose:>10.2f} "
                              f"{gtxt:>11}  "
                              f"{past['scale']:>11.2f} {past['gate']:>10.2f} {past['beta']:>10.2f}{flag}", flush=True)
    if a.json:
        meta = dict(torch=torch.__version__, device=a.device, heads=a.heads, B=a.B,
                    gpu=torch.cuda.get_device_name() if a.device == "cuda" else None)
        Path(a.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{len(rows)} rows, {bad} flagged")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
