"""What the tensor core's way of summing (contracts.TC_WAY) does to tf32x3 budgets on the CPU: per case, the
per-head baseline (the worst correct form) with and without it, and the time the forms take.

    PYTHONPATH=. python bench/results/h100-2026-12-07-tensor-core/tc_way_cost.py
"""
import time

import torch

from kvbuffer.validate import contracts as C
from kvbuffer.validate.cases import Case


def rel(o, ex):
    return (o.double() - ex).pow(2).sum((1, 3)).sqrt() / ex.pow(2).sum((1, 3)).sqrt()


torch.manual_seed(0)
print(f"{'case':58s} {'chunk':>5s} {'median':>7s} {'max':>7s} {'forms s':>8s} {'tc s':>6s}")
for T, K, gate, norm, scale in [(64, 128, "mild", "unit", None), (64, 128, "mild", "any", 0.37),
                                 (256, 128, "strong", "unit", None), (256, 128, "mixed", "any", None),
                                 (200, 64, "mild", "any", 0.37), (1024, 128, "mild", "unit", None)]:
    case = Case(B=1, T=T, H=2, HV=4, K=K, V=K, gate=gate, norm=norm, scale=scale, seed=1)
    x = case.inputs(torch.float32)
    x64 = {n: t.double() for n, t in x.items()}
    import kvbuffer_ref as ref
    ex = ref.recurrent_gated_delta_rule(**x64, scale=scale)[0]
    t0 = time.perf_counter()
    forms = C.correct_forms(**x, scale=scale, chunks=(64,), contract="tf32x3")
    t1 = time.perf_counter()
    errs = torch.stack([rel(o, ex) for o, _ in forms])
    old, new = errs[:-1].amax(0), errs.amax(0)
    r = (new / old).flatten()
    t2 = time.perf_counter()
    C._segmented_batch(**x, scale=scale, initial_state=None, starts=range(0, T, 64), sums=[("rounded", (), "k")],
                       contract="tf32x3", exp=None, products="tf32x3-tc")  # the tensor core's way alone
    t3 = time.perf_counter()
    print(f"T={T:5d} K={K:3d} {gate:7s} {norm:4s} scale={scale}".ljust(58),
          f"{64:5d} {r.median():7.2f} {r.max():7.2f} {t1 - t0:8.2f} {t3 - t2:6.2f}")
