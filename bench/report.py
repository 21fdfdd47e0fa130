"""The benchmark report: Markdown (and a plot) from the GPU runner's JSON or a pytest-benchmark JSON.

    python3 -m bench.report FILE.json [--out DIR]

``FILE.json`` is either ``bench/gpu.py``'s ``gpu.json`` (device time per operation, ratios to the peers
of the same run, before/after ratios) or the JSON of ``pytest bench/ --benchmark-json`` (the CPU
harness: wall-clock under the Triton interpreter).  Writes ``DIR/report.md`` (default: beside the JSON)
and, for the runner's JSON with matplotlib installed, ``DIR/latency.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GROUP_TITLES = {"decode": "Decode (per token and layer)", "verify": "Verify of d tokens (per layer)",
                "accept": "Accept of m drafts (per layer)", "round": "Speculative round: verify + accept (per layer)"}


def _table(header: list, rows: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _plain(header: list, rows: list) -> str:
    cols = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(c[i]) for c in cols) for i in range(len(header))]
    return "\n".join("  ".join(c[i].rjust(w[i]) for i in range(len(header))) for c in cols)


def _us(x) -> str:
    return "–" if x is None else (f"{x:.1f}" if x < 1e4 else f"{x:.0f}")


def _x(x) -> str:
    return "–" if x is None else f"{x:.3f}x"


# ----------------------------------------------------------------------------- the runner's JSON
READ = "read_state"  # the measured floor of a state read: the decode ops' "x read"


def group_table(rows: list, group: str):
    """One row per batch: every op of the group (device µs, times its floor and, where ``read_state`` ran,
    times read_state's µs: "x read"), then every ratio of an op of the group to each of its other peers present
    (``vs_<peer>``: ours to the baselines, to fla, to ReplaySSM, to SGLang)."""
    from bench.workloads import OPS, PEERS

    ops = [o for o in OPS if OPS[o] == group and any(r["op"] == o for r in rows)]
    present = {r["op"] for r in rows}

    def read(o: str) -> bool:  # o's cell carries "x read"
        return READ in ops and READ in PEERS.get(o, ())
    pairs = [(o, p) for o in ops for p in PEERS.get(o, ()) if p in present and p != READ]
    header = (["B"] + [f"{o} µs (x floor{', x read' if read(o) else ''})" for o in ops]
              + [f"{o} / {p}" for o, p in pairs])
    by = {(r["op"], r["B"]): r for r in rows}
    out = []
    for B in sorted({r["B"] for r in rows if r["op"] in ops}):
        line = [B]
        for o in ops:
            r = by.get((o, B))
            if r is None:
                line.append("–")
                continue
            vs_read = r.get(f"vs_{READ}")
            x = f"{r['vs_floor']:.2f}" + ((", –" if vs_read is None else f", {vs_read:.2f}") if read(o) else "")
            line.append(f"{_us(r['device_us'])} ({x})" + ("" if r.get("within_budget", True) else " [past budget]"))
        line += [_x(by.get((o, B), {}).get(f"vs_{p}")) for o, p in pairs]
        out.append(line)
    return header, out


def oracle_errors(rows: list) -> list:
    """[op, B, µs, comparison, worst rel, budget, within] of every timed row: its comparison nearest its
    budget (the largest worst rel-RMS / budget), so that each operation's error stands beside its time."""
    out = []
    for r in rows:
        checks = [c for c in r.get("checks", []) if c.get("budget")]
        if not checks or r.get("device_us") is None:
            continue
        c = max(checks, key=lambda c: c.get("worst_rel", float("nan")) / c["budget"])
        out.append([r["op"], r["B"], _us(r["device_us"]), c.get("name"), f"{c.get('worst_rel', float('nan')):.2e}",
                    f"{c['budget']:.2e}", "yes" if c.get("passed") else "NO"])
    return out


def peer_errors(rows: list) -> list:
    """[op, B, comparison, worst rel, budget, within] of every peer row (ReplaySSM's, SGLang's): its error
    against the float64 oracle beside its time."""
    out = []
    for r in rows:
        if r["op"].startswith(("replayssm", "sglang")):
            for c in r.get("checks", []):
                out.append([r["op"], r["B"], c.get("name"), f"{c.get('worst_rel', float('nan')):.2e}",
                            f"{c.get('budget', float('nan')):.2e}", "yes" if c.get("passed") else "NO"])
    return out


def _meta_lines(result: dict) -> list:
    plan = result.get("plan", {})
    s = plan.get("shapes", {})
    lines = [f"- Device: {result.get('device')}; torch {result.get('torch')}, triton {result.get('triton')}, "
             f"fla {result.get('fla')}, python {result.get('python')}",
             f"- Commit: {str(result.get('commit', '?'))[:12]}{' (uncommitted changes)' if result.get('dirty') else ''}; "
             f"started {result.get('started')}; {result.get('seconds')} s",
             f"- Shapes: H={s.get('H')}, HV={s.get('HV')}, K={s.get('K')}, V={s.get('V')}; {plan.get('dtype')} tokens, "
             f"fp32 state and u-cache; C={plan.get('C')}, verify over n={plan.get('fill')} entries, "
             f"d={plan.get('drafts')} tokens, m={plan.get('accepted')} accepted; {plan.get('layers')} layers of "
             f"distinct states run in turn"]
    for name, tree in result.get("trees", {}).items():
        copy = tree.get("copy", {})
        lines.append(f"- `{name}`: `{tree.get('package')}` ({tree.get('api')} API, sources sha256 "
                     f"{str(tree.get('sources_sha256', '?'))[:12]}); copy bandwidth {copy.get('TBps', float('nan')):.3g} TB/s")
    if result.get("overrides"):
        lines.append(f"- Launch overrides (`--set`): {result['overrides']}")
    return lines


def runner_markdown(result: dict) -> str:
    md = ["# KVBuffer GPU benchmarks", ""]
    if result.get("smoke"):
        md += ["> **SMOKE RUN**: tiny shapes under the Triton interpreter on a CPU. It proves the runner, its "
               "checks and this report; **its numbers mean nothing about performance**.", ""]
    md += _meta_lines(result) + [
        "", "Device µs per operation and layer: the operation on every layer captured in one CUDA graph, its replay "
        "timed by `triton.testing.do_bench` (L2 cleared before each replay, median), divided by the operations in it. "
        "In parentheses: times the read-once floor (the bytes the operation must move at the copy bandwidth of the "
        "same run) and, for a decode op, times `read_state` at the same batch (x read: a kernel that only reads "
        "the states, the measured floor of a state read). Ratios: the group's operation over its peers at the same "
        "batch, same run; below 1 is faster. "
        "Every timed operation matched the float64 oracle first.", ""]
    for name, tree in result.get("trees", {}).items():
        bad = tree.get("failures", [])
        if bad:
            md += [f"## FAILED in `{name}` (not timed)", ""] + [f"- {f['op']} B={f['B']}: {f['error']}" for f in bad] + [""]
    after = result.get("trees", {}).get("after", {})
    for group, title in GROUP_TITLES.items():
        h, rows = group_table(after.get("rows", []), group)
        if rows:
            md += [f"## {title}", "", _table(h, rows), ""]
    errs = oracle_errors(after.get("rows", []))
    if errs:
        md += ["## Time and error against the float64 oracle", "",
               "Each operation's comparison nearest its budget (layer 0, requests 0 and B - 1; the error table of the "
               "token dtype).", "",
               _table(["op", "B", "µs", "comparison", "worst rel-RMS", "budget", "within"], errs), ""]
    perr = peer_errors(after.get("rows", []))
    if perr:
        ops = {p[0] for p in perr}
        where = ([f"ReplaySSM's kernels from `{result.get('peer_path')}`"] if any(o.startswith("replayssm") for o in ops)
                 else []) + ([f"SGLang's from `{result.get('sglang_path')}`"] if any(o.startswith("sglang") for o in ops)
                             else [])
        md += ["## Peers against the float64 oracle", "",
               ", ".join(where) + "; layer 0's comparisons (requests 0 and B - 1) under the tolerance table of the "
               "token dtype; a peer is timed even past the budget.", "",
               _table(["op", "B", "comparison", "worst rel-RMS", "budget", "within"], perr), ""]
    if result.get("before_after"):
        rows = [[r["op"], r["B"], _us(r["before_us"]), _us(r["after_us"]), _x(r["ratio"])]
                for r in result["before_after"]]
        md += ["## After / before", "", f"`before`: {result['trees']['before'].get('package')}; `after`: "
               f"{after.get('package')}; same run, same device.", "",
               _table(["op", "B", "before µs", "after µs", "after / before"], rows), ""]
    skips = [f"- `{name}` {s['op']} B={s['B']}: {s['reason']}" for name, t in result.get("trees", {}).items()
             for s in t.get("skips", [])]
    if skips:
        md += ["## Skipped", ""] + skips + [""]
    if result.get("_plot"):
        md += ["![device time per operation vs batch](latency.png)", ""]
    return "\n".join(md)


def plot_latency(result: dict, path: Path) -> bool:
    """Device µs per operation vs batch, one panel per group (the ``after`` tree); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result.get("trees", {}).get("after", {}).get("rows", [])
    groups = [(g, t) for g, t in GROUP_TITLES.items() if any(r["group"] == g for r in rows)]  # panels with rows
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.2), squeeze=False)
    for ax, (group, title) in zip(axes[0], groups):
        for op in sorted({r["op"] for r in rows if r["group"] == group}):
            pts = sorted((r["B"], r["device_us"]) for r in rows if r["op"] == op)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B")
        ax.set_ylabel("device µs")
        ax.set_title(title + (" (SMOKE: no meaning)" if result.get("smoke") else ""), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_runner_report(result: dict, out: Path) -> Path:
    out = Path(out)
    result = dict(result, _plot=plot_latency(result, out / "latency.png"))
    path = out / "report.md"
    path.write_text(runner_markdown(result))
    return path


def runner_summary(result: dict) -> str:
    parts = [("SMOKE RUN (no performance meaning) " if result.get("smoke") else "") +
             f"{result.get('device')}: torch {result.get('torch')}, triton {result.get('triton')}, fla {result.get('fla')}"]
    after = result.get("trees", {}).get("after", {})
    for group in GROUP_TITLES:
        h, rows = group_table(after.get("rows", []), group)
        if rows:
            parts += [group, _plain(h, rows)]
    if result.get("before_after"):
        parts += ["after / before", _plain(["op", "B", "ratio"], [[r["op"], r["B"], _x(r["ratio"])]
                                                                for r in result["before_after"]])]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- pytest-benchmark's JSON
def pytest_markdown(data: dict) -> str:
    """The CPU harness's rows: wall-clock per call under the interpreter, and the oracle checks."""
    info = data.get("machine_info", {})
    rows = []
    for b in data.get("benchmarks", []):
        e = b.get("extra_info", {})
        worst = max(e.get("checks", []), key=lambda c: c["worst_rel"] / c["budget"] if c.get("budget") else 0,
                    default=None)
        rows.append([b["name"], f"{b['stats']['median'] * 1e3:.1f}", e.get("count", "–"),
                     f"{worst['worst_rel']:.2e} / {worst['budget']:.2e}" if worst else "–"])
    return "\n".join([
        "# KVBuffer CPU benchmarks (pytest-benchmark)", "",
        f"- Machine: {info.get('cpu', {}).get('brand_raw', '?')}, python {info.get('python_version')}; "
        f"{data.get('datetime', '')}",
        "- Wall clock per call of each case under the Triton interpreter: host cost of the interpreted kernels at "
        "tiny shapes, not device performance.", "",
        _table(["benchmark", "median ms", "operations per call", "check: worst rel / budget"], rows), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Markdown report from bench/gpu.py's or pytest-benchmark's JSON")
    ap.add_argument("json")
    ap.add_argument("--out", help="folder for report.md (default: the JSON's folder)")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    out = Path(args.out or Path(args.json).parent)
    out.mkdir(parents=True, exist_ok=True)
    if data.get("kind") == "kvbuffer-gpu-runner":
        path = write_runner_report(data, out)
        print(runner_summary(data))
    elif "benchmarks" in data:
        path = out / "report.md"
        path.write_text(pytest_markdown(data))
    else:
        print(f"bench.report: {args.json} is neither bench/gpu.py's JSON nor pytest-benchmark's", file=sys.stderr)
        return 1
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
