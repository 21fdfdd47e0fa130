"""One line per probe row of bench/gpu_probe.py's JSON (the device tool returns only an output tail).

    python scripts/probe_summary.py probe.json [...]
"""

from __future__ import annotations

import json
import sys


def _opts(row: dict, keys) -> str:
    return " ".join(f"{k}={row[k]}" for k in keys if k in row)


def main(paths) -> int:
    for p in paths:
        r = json.load(open(p))
        print(f"== {p}: B={r.get('B')} copy={r.get('copy', {}).get('queued_TBps')} "
              f"recurrent={r.get('recurrent_us')} fla={r.get('fla_us')} fla5={r.get('fla5_us')}")
        for row in r.get("decode", []):
            fl = row.get("fold_launch", {})
            ks = {k[:28]: round(v, 1) for k, v in (row.get("kernels_plain_us") or {}).items()}
            print("decode", _opts(row, ("book", "pdl", "evict")), "fold", fl, "check", row.get("check"),
                  "n0/8/15/C", [round(row.get(f"n{n}_us", -1), 1) for n in (0, 8, 15, 16)],
                  "cycle", round(row.get("cycle_step_us", -1), 1), "vs_fla", round(row.get("vs_fla", -1), 4),
                  "plain", ks, "regs", [(c.get("kernel"), c.get("n_regs")) for c in row.get("compiled", [])])
        for row in r.get("verify", []):
            ks = {k[:28]: round(v, 1) for k, v in (row.get("kernels_us") or {}).items()}
            print("verify", _opts(row, ("variant", "side", "pdl", "BV", "num_warps", "KB", "NS", "prep_group", "prep_warps", "prep_maxnreg", "prep_solve", "xprec", "early")), "check",
                  row.get("check"), row.get("check_bf16"), "us", round(row.get("us", -1), 1), "vs_fla5",
                  round(row.get("vs_fla5", -1), 4), ks, row.get("error", ""),
                  "regs", [(c.get("kernel"), c.get("n_regs")) for c in row.get("compiled", [])])
        for k in ("decode_error", "verify_error"):
            if k in r:
                print(k, r[k][-1500:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
