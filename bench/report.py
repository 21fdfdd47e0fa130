"""Turn a benchmark JSON (``pytest bench/ --benchmark-json``) into a Markdown report with plots.

    python -m bench.report results.json [--before old.json] --out DIR

Writes DIR/report.md and DIR/*.png (latency vs batch, buffered/recurrent ratio vs C, verify time vs
draft count, achieved bandwidth against the copy roofline, capacity under a memory budget) and
prints a short summary table.  Every ratio is computed from rows of the SAME JSON (same run, same
machine); with ``--before`` each row also shows its change against the older run.
docs/benchmarks.md describes the fields.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Optional

from bench import io_model as io

PLOTS = ("latency_vs_batch.png", "ratio_vs_capacity.png", "verify_vs_drafts.png", "bandwidth_roofline.png",
         "capacity.png")


# ----------------------------------------------------------------------------- loading
class Run:
    """One benchmark JSON: its rows (extra_info + name + stats) and what the harness recorded."""

    def __init__(self, path: str):
        with open(path) as fh:
            data = json.load(fh)
        self.path = path
        self.meta = data.get("kvbuffer", {})
        self.machine = data.get("machine_info", {})
        self.commit = data.get("commit_info", {})
        self.datetime = data.get("datetime", "")
        self.rows = []
        for b in data.get("benchmarks", []):
            info = dict(b.get("extra_info", {}))
            if "device_us" not in info:
                continue
            info["name"] = b["name"]
            info["stats_median_s"] = b.get("stats", {}).get("median")
            self.rows.append(info)
        self.smoke = bool(self.meta.get("smoke", any(r.get("mode") == "smoke" for r in self.rows)))
        self._ratios()

    def find(self, **kw) -> Optional[dict]:
        for r in self.rows:
            if all(r.get(k) == v for k, v in kw.items()):
                return r
        return None

    def _ratios(self):
        """Per row: time over the recurrent baseline and over fla at the same batch (same JSON), and
        for verify/step rows over the per-draft-state style at the same (B, d)."""
        for r in self.rows:
            if r["kind"] in ("buffered_cycle", "flush", "direct", "recurrent", "fla"):
                for ref_kind, key in (("recurrent", "vs_recurrent"), ("fla", "vs_fla")):
                    ref = self.find(kind=ref_kind, B=r.get("B"))
                    if ref:
                        r[key] = r["device_us"] / ref["device_us"]
            if r["kind"] in ("verify", "step"):
                ref = self.find(kind=r["kind"], style="per_draft_state", B=r.get("B"), d=r.get("d"))
                if ref:
                    r["vs_per_draft_state"] = r["device_us"] / ref["device_us"]
                ref = self.find(kind="verify", style="fla", B=r.get("B"), d=r.get("d"))
                if ref and r["kind"] == "verify":
                    r["vs_fla_tokens"] = r["device_us"] / ref["device_us"]
                for ref_kind, key in (("recurrent", "vs_recurrent"), ("fla", "vs_fla")):
                    ref = self.find(kind=ref_kind, B=r.get("B"))
                    if ref:
                        r[key] = r["device_us"] / ref["device_us"]

    def machine_line(self) -> str:
        k = self.machine.get("kvbuffer", {})
        gpu = k.get("gpu", {}) or {}
        parts = [f"GPU {gpu.get('name') or 'none (CPU)'}"]
        if gpu.get("driver"):
            parts.append(f"driver {gpu['driver']}")
        if gpu.get("cuda"):
            parts.append(f"CUDA {gpu['cuda']}")
        for n in ("torch", "triton", "fla", "python"):
            if k.get(n):
                parts.append(f"{n} {k[n]}")
        return ", ".join(parts)


# ----------------------------------------------------------------------------- formatting
def _us(x) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}" if x < 1e3 else f"{x:.0f}"


def _x(x) -> str:
    return "–" if x is None else f"{x:.3f}x"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _table(header: list, rows: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _plain(header: list, rows: list) -> str:
    cols = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(c[i]) for c in cols) for i in range(len(header))]
    return "\n".join("  ".join(c[i].rjust(w[i]) for i in range(len(header))) for c in cols)


# ----------------------------------------------------------------------------- tables
def decode_table(run: Run):
    batches = sorted({r["B"] for r in run.rows if r["kind"] in ("recurrent", "fla", "buffered_cycle", "direct")})
    caps = sorted({r["C"] for r in run.rows if r["kind"] == "buffered_cycle"})
    dcaps = sorted({r["C"] for r in run.rows if r["kind"] == "direct"})
    header = ["B", "recurrent µs (% copy)", "fla µs (% copy)"]
    header += [f"buffered C={c} µs/step (x rec, x fla)" for c in caps]
    header += [f"direct C={c} µs/step (x rec)" for c in dcaps]
    rows = []
    for B in batches:
        row = [B]
        for kind in ("recurrent", "fla"):
            r = run.find(kind=kind, B=B)
            row.append(f"{_us(r['device_us'])} ({_pct(r['copy_share'])})" if r else "–")
        for c in caps:
            r = run.find(kind="buffered_cycle", B=B, C=c)
            row.append(f"{_us(r['device_us'])} ({_x(r.get('vs_recurrent'))}, {_x(r.get('vs_fla'))})" if r else "–")
        for c in dcaps:
            r = run.find(kind="direct", B=B, C=c)
            row.append(f"{_us(r['device_us'])} ({_x(r.get('vs_recurrent'))})" if r else "–")
        rows.append(row)
    return header, rows


def verify_table(run: Run):
    keys = sorted({(r["B"], r["d"]) for r in run.rows if r["kind"] in ("verify", "step")})
    header = ["B", "d", "buffered chain µs", "buffered tree µs", "per-draft-state µs", "buffered/per-draft",
              "fla over d tokens µs", "buffered/fla", "step buffered µs", "step per-draft µs", "step ratio"]
    rows = []
    for B, d in keys:
        bc = run.find(kind="verify", style="buffered", topology="chain", B=B, d=d)
        bt = run.find(kind="verify", style="buffered", topology="tree", B=B, d=d)
        pd = run.find(kind="verify", style="per_draft_state", B=B, d=d)
        sb = run.find(kind="step", style="buffered", B=B, d=d)
        sp = run.find(kind="step", style="per_draft_state", B=B, d=d)
        fl = run.find(kind="verify", style="fla", B=B, d=d)
        get = lambda r: _us(r["device_us"]) if r else "–"  # noqa: E731
        rows.append([B, d, get(bc), get(bt), get(pd), _x(bc.get("vs_per_draft_state")) if bc else "–",
                     get(fl), _x(bc.get("vs_fla_tokens")) if bc else "–",
                     get(sb), get(sp), _x(sb.get("vs_per_draft_state")) if sb else "–"])
    return header, rows


def all_rows_table(run: Run):
    header = ["benchmark", "device µs", "MB moved (IO model)", "TB/s", "% of copy", "vs recurrent", "vs fla",
              "vs per-draft", "check: worst rel / budget"]
    rows = []
    for r in run.rows:
        chk = r.get("checks") or []
        worst = max(chk, key=lambda c: c["worst_rel"] / c["budget"] if c["budget"] else 0.0) if chk else None
        rows.append([r["name"], _us(r["device_us"]), f"{r['io_bytes'] / 1e6:.3g}", f"{r['TBps']:.3g}",
                     _pct(r.get("copy_share")), _x(r.get("vs_recurrent")), _x(r.get("vs_fla")),
                     _x(r.get("vs_per_draft_state")),
                     f"{worst['worst_rel']:.2e} / {worst['budget']:.2e}" if worst else "–"])
    return header, rows


def before_after_table(run: Run, before: Run):
    old = {r["name"]: r for r in before.rows}
    header = ["benchmark", "before µs", "after µs", "change", "before TB/s", "after TB/s"]
    rows = []
    for r in run.rows:
        o = old.get(r["name"])
        if o is None:
            rows.append([r["name"], "–", _us(r["device_us"]), "new", "–", f"{r['TBps']:.3g}"])
            continue
        ch = r["device_us"] / o["device_us"] - 1
        rows.append([r["name"], _us(o["device_us"]), _us(r["device_us"]), f"{100 * ch:+.1f}%",
                     f"{o['TBps']:.3g}", f"{r['TBps']:.3g}"])
    names = {r["name"] for r in run.rows}
    rows += [[n, _us(o["device_us"]), "–", "missing", f"{o['TBps']:.3g}", "–"] for n, o in old.items()
             if n not in names]
    return header, rows


def capacity_table(cap: dict):
    header = ["drafts d", "buffered MiB/request", "per-draft-state MiB/request", "buffered max requests",
              "per-draft-state max requests", "ratio"]
    rows = [[c["drafts"], f"{c['buffered_bytes'] / 2 ** 20:.1f}", f"{c['per_draft_state_bytes'] / 2 ** 20:.1f}",
             c["buffered_max_requests"], c["per_draft_state_max_requests"], f"{c['ratio']:.2f}x"] for c in cap["rows"]]
    return header, rows


# ----------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(ax, text: str, run: Run):
    ax.set_title(text + ("\nSMOKE: interpreter on a CPU, no performance meaning" if run.smoke else ""), fontsize=9)


def plot_latency(run: Run, path: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = defaultdict(list)
    for r in run.rows:
        if r["kind"] in ("recurrent", "fla"):
            series[r["kind"] if r["kind"] == "recurrent" else "fla fused_recurrent"].append((r["B"], r["device_us"]))
        elif r["kind"] in ("buffered_cycle", "direct"):
            label = ("buffered" if r["kind"] == "buffered_cycle" else "direct") + f" C={r['C']} (per step)"
            series[label].append((r["B"], r["device_us"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linestyle="--" if label.startswith("direct") else "-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch B (requests)")
    ax.set_ylabel("device µs per decode step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _title(ax, "decode latency vs batch", run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ratio(run: Run, path: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_b = defaultdict(list)
    for r in run.rows:
        if r["kind"] == "buffered_cycle" and r.get("vs_recurrent") is not None:
            by_b[r["B"]].append(r)
    for B, rs in sorted(by_b.items()):
        rs.sort(key=lambda r: r["C"])
        line, = ax.plot([r["C"] for r in rs], [r["vs_recurrent"] for r in rs], marker="o", label=f"B={B} / recurrent")
        if all(r.get("vs_fla") is not None for r in rs):
            ax.plot([r["C"] for r in rs], [r["vs_fla"] for r in rs], marker="x", linestyle="--",
                    color=line.get_color(), label=f"B={B} / fla")
        rec = run.find(kind="recurrent", B=B)
        if rec:
            ax.plot([r["C"] for r in rs], [r["io_bytes"] / rec["io_bytes"] for r in rs], linestyle=":",
                    color=line.get_color(), alpha=0.6, label=f"B={B} IO-model bytes ratio")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer capacity C")
    ax.set_ylabel("buffered step time / baseline step time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    _title(ax, "buffered decode (per step, whole cycle) relative to recurrent decode", run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_verify(run: Run, path: str):
    plt = _plt()
    batches = sorted({r["B"] for r in run.rows if r["kind"] in ("verify", "step")}) or [None]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches) + 1, 4.5), squeeze=False)
    styles = {("buffered", "chain"): "-", ("buffered", "tree"): "-.", ("per_draft_state", "chain"): "--",
              ("fla", "chain"): ":"}
    for ax, B in zip(axes[0], batches):
        series = defaultdict(list)
        for r in run.rows:
            if r["kind"] in ("verify", "step") and r["B"] == B:
                series[(r["kind"], r["style"], r["topology"])].append((r["d"], r["device_us"]))
        for (kind, style, topo), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if kind == "verify" else "s",
                    linestyle=styles.get((style, topo), "-"), label=f"{kind}: {style} {topo}")
        ax.set_yscale("log")
        ax.set_xlabel("draft tokens d")
        ax.set_ylabel("device µs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        _title(ax, f"verify / verify+accept vs drafts, B={B}", run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bandwidth(run: Run, path: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = defaultdict(list)
    for r in run.rows:
        label = r["kind"] if r["kind"] not in ("verify", "step") else f"{r['kind']} {r['style']}"
        kinds[label].append((r["io_bytes"] / 1e6, r["TBps"]))
    for label, pts in sorted(kinds.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=label, s=18)
    copy = run.meta.get("copy", {}).get("TBps")
    if copy:
        ax.axhline(copy, color="k", linestyle="--", label=f"copy bandwidth {copy:.3g} TB/s (same run)")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved per operation (IO model), MB")
    ax.set_ylabel("achieved TB/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    _title(ax, "achieved bandwidth against the copy roofline", run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_capacity(run: Run, cap: dict, path: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    d = [c["drafts"] for c in cap["rows"]]
    ax.plot(d, [c["buffered_max_requests"] for c in cap["rows"]], marker="o", label=f"buffered (KVBuffer, C={cap['capacity']})")
    ax.plot(d, [c["per_draft_state_max_requests"] for c in cap["rows"]], marker="s", linestyle="--",
            label="per-draft state ((1 + d) states)")
    ax.set_xlabel("draft tokens d")
    ax.set_ylabel("max concurrent requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    s = cap["shapes"]
    ax.set_title(f"capacity under {cap['budget_bytes'] / 2 ** 30:.0f} GiB of linear-attention memory "
                 f"({cap['layers']} layers, H={s['H']} HV={s['HV']} K={s['K']} V={s['V']}); a formula, not a timing",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- report
def build(run: Run, out: str, before: Optional[Run] = None, budget_gib: float = 64.0) -> str:
    os.makedirs(out, exist_ok=True)
    cap = io.capacity_curve(io.QWEN3_NEXT, budget_bytes=int(budget_gib * 2 ** 30),
                            capacity=int(run.meta.get("config", {}).get("verify_capacity", 32)) if not run.smoke else 32)
    plot_latency(run, os.path.join(out, PLOTS[0]))
    plot_ratio(run, os.path.join(out, PLOTS[1]))
    plot_verify(run, os.path.join(out, PLOTS[2]))
    plot_bandwidth(run, os.path.join(out, PLOTS[3]))
    plot_capacity(run, cap, os.path.join(out, PLOTS[4]))

    md = ["# KVBuffer benchmarks", ""]
    if run.smoke:
        md += ["> **SMOKE RUN** — tiny shapes under the Triton interpreter on a CPU. It proves the suites, the "
               "oracle checks and this report work; **the numbers mean nothing about performance**.", ""]
    copy = run.meta.get("copy", {})
    cfg = run.meta.get("config", {})
    md += [f"- Source: `{os.path.basename(run.path)}` ({run.datetime}); commit "
           f"{run.commit.get('id', '?')[:12]}{' (dirty)' if run.commit.get('dirty') else ''}",
           f"- Machine: {run.machine_line()}",
           f"- Copy bandwidth (same run, bytes read + written): **{copy.get('TBps', float('nan')):.3g} TB/s** "
           f"({copy.get('method', '?')})",
           f"- Timing: {run.meta.get('timing', '?')}",
           f"- Shapes: {cfg.get('shapes')}; token dtype {cfg.get('dtype')}; fp32 state and u-cache",
           f"- Every row was checked against the float64 oracle on requests 0 and B-1 before it was timed "
           f"(kvbuffer_ref.testing.compare, the one tolerance table); the worst check is in the last column below.",
           ""]
    fails, skips = run.meta.get("failures", []), run.meta.get("skips", [])
    if fails:
        md += ["## FAILED (no time reported for these)", ""]
        md += [f"- `{f['test']}` ({f['when']}): {f['message']}" for f in fails]
        md += [""]
    if skips:
        md += ["## Skipped", ""] + [f"- `{s['test']}`: {s['message']}" for s in skips] + [""]
    h, rows = decode_table(run)
    md += ["## Decode", "", "Per decode step, device µs. Buffered rows are averaged over a whole cycle of C steps "
           "from full buffers (the fold of the C entries included); ratios are against the recurrent kernel "
           "(`x rec`) and fla's `fused_recurrent_gated_delta_rule` (`x fla`) at the same batch, in this run. "
           "Below 1 is faster.", "", _table(h, rows), "",
           f"![latency vs batch]({PLOTS[0]})", "", f"![ratio vs C]({PLOTS[1]})", ""]
    h, rows = verify_table(run)
    if rows:
        md += ["## Speculative verify", "", "Device µs per launch for d drafts; `step` = verify + accept of all d "
               "drafts. Ratios: buffered / per-draft-state and buffered / fla's fused_recurrent over the same d "
               "tokens (which keeps only the final state and cannot roll back), at the same (B, d).", "", _table(h, rows), "",
               f"![verify vs drafts]({PLOTS[2]})", ""]
    md += ["## Bandwidth", "", "Bytes from the IO model (bench/io_model.py, DESIGN.md §6); achieved TB/s = bytes / "
           "device time; share of the copy bandwidth measured in the same run.", "",
           f"![bandwidth]({PLOTS[3]})", ""]
    h, rows = capacity_table(cap)
    md += ["## Capacity", "", f"Max concurrent requests under {budget_gib:g} GiB for linear-attention state "
           f"(Qwen3-Next: {cap['layers']} Gated DeltaNet layers), buffered vs per-draft-state verify; "
           f"bytes per request from {cap['source']}.", "", _table(h, rows), "", f"![capacity]({PLOTS[4]})", ""]
    h, rows = all_rows_table(run)
    md += ["## All rows", "", _table(h, rows), ""]
    if before is not None:
        h, rows = before_after_table(run, before)
        md += ["## Change against the earlier run", "", f"Before: `{os.path.basename(before.path)}` "
               f"({before.machine_line()}); after: this run. Negative change = faster.", "", _table(h, rows), ""]
        if before.smoke != run.smoke:
            md += ["> The two runs are of different modes (smoke vs GPU): the comparison is meaningless.", ""]
    text = "\n".join(md)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(text)
    return text


def summary(run: Run) -> str:
    parts = [("SMOKE RUN (no performance meaning)\n" if run.smoke else "") + run.machine_line(),
             f"copy {run.meta.get('copy', {}).get('TBps', float('nan')):.3g} TB/s"]
    h, rows = decode_table(run)
    if rows:
        parts += ["decode (device µs per step):", _plain(h, rows)]
    h, rows = verify_table(run)
    if rows:
        parts += ["verify (device µs):", _plain(h, rows)]
    fails = run.meta.get("failures", [])
    if fails:
        parts += [f"FAILED: {len(fails)} benchmark(s): " + ", ".join(f["test"].split("::")[-1] for f in fails)]
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Markdown report + plots from a kvbuffer benchmark JSON")
    ap.add_argument("results", help="the JSON written by pytest bench/ --benchmark-json")
    ap.add_argument("--before", help="an earlier JSON to compare each row with")
    ap.add_argument("--out", required=True, help="directory for report.md and the PNG plots")
    ap.add_argument("--budget-gib", type=float, default=64.0, help="memory budget of the capacity plot")
    args = ap.parse_args(argv)
    run = Run(args.results)
    if not run.rows:
        print(f"bench.report: {args.results} holds no benchmark rows", file=sys.stderr)
        return 1
    before = Run(args.before) if args.before else None
    build(run, args.out, before, args.budget_gib)
    print(summary(run))
    print(f"\nreport: {os.path.join(args.out, 'report.md')} (+ {len(PLOTS)} plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
