"""A correct chunk kernel whose in-chunk cumulative gates are summed in another scan order, judged by the
validator's budget with the six ways of summing (``contracts.SEGMENT_WAYS``) and with the first three alone.

    PYTHONPATH=. python3 bench/results/cpu-2026-12-07/scan_orders.py [FIRST_SEED] [LAST_SEED]

Per gate regime and order: how many seeds fail (outputs or final state), and the worst ratio to the budget."""
import sys

import torch

import kvbuffer_ref as ref
from kvbuffer.validate import contracts as C
from kvbuffer.validate.cases import Case
from kvbuffer.validate.tolerances import compare
from tests.validate.test_contracts import _ScanOrder, _blelloch, _hillis_steele


def raking(x, per_thread=4):
    """per_thread consecutive sums in a loop, a 32-lane scan of the threads' totals, each thread adding its prefix."""
    n = x.shape[0]
    loc = x.clone()
    for t in range(0, n, per_thread):
        for i in range(t + 1, min(n, t + per_thread)):
            loc[i] = loc[i - 1] + x[i]
    ends = list(range(per_thread - 1, n, per_thread))
    if ends[-1] != n - 1:
        ends.append(n - 1)
    inc = _hillis_steele(loc[ends], 32)
    out = loc.clone()
    for j, t in enumerate(range(per_thread, n, per_thread)):
        out[t:t + per_thread] = loc[t:t + per_thread] + inc[j]
    return out


ORDERS = {"whole chunk": lambda x: _hillis_steele(x, 1 << 20), "runs of 8": lambda x: _hillis_steele(x, 8),
          "runs of 16": lambda x: _hillis_steele(x, 16), "raking 4": raking, "work-efficient": _blelloch}
WAYS = {"six ways": C.SEGMENT_WAYS, "first three": C.SEGMENT_WAYS[:3]}


def main(first=0, last=48):
    print(f"seeds {first}..{last - 1}, Case(B=1, T=128, H=2, HV=4, K=32, V=32, beta='mixed', norm='any', scale=0.37), "
          f"float32, chunk 64; torch {torch.__version__}")
    for gate in ("mild", "strong", "wide", "mixed"):
        worst = {(w, o): [0, 0.0] for w in WAYS for o in ORDERS}
        for seed in range(first, last):
            case = Case(B=1, T=128, H=2, HV=4, K=32, V=32, gate=gate, beta="mixed", seed=seed, norm="any", scale=0.37)
            x = case.inputs(torch.float32)
            o64, S64 = ref.recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()}, scale=0.37,
                                                      output_final_state=True)
            runs = {}
            for name, scan in ORDERS.items():
                with _ScanOrder(scan):
                    runs[name] = ref.chunk_gated_delta_rule(**x, scale=0.37, chunk_size=64, output_final_state=True)
            for w, ways in WAYS.items():
                C.SEGMENT_WAYS = ways
                forms = C.correct_forms(**x, scale=0.37, chunks=(64,), contract="ieee")
                for name, (o, S) in runs.items():
                    r = max(compare(o, o64, [f[0] for f in forms], dtype=torch.float32).ratio,
                            compare(S, S64, [f[1] for f in forms], dtype=torch.float32, head_axis=1).ratio)
                    cell = worst[(w, name)]
                    cell[0] += r > 1
                    cell[1] = max(cell[1], r)
            C.SEGMENT_WAYS = WAYS["six ways"]
        for w in WAYS:
            print(f"{gate:7s} {w:12s} " + "  ".join(f"{o}: {worst[(w, o)][0]} fail, worst {worst[(w, o)][1]:.2f}"
                                                     for o in ORDERS), flush=True)


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:3]])
