"""The benchmark report: Markdown (and a plot) from the GPU runner's JSON or a pytest-benchmark JSON.

    python3 -m bench.report FILE.json [--out DIR]

``FILE.json`` is either ``bench/gpu.py``'s ``gpu.json`` (device time per operation, ratios to the peers
of the same run, before/after ratios) or the JSON of ``pytest bench/ --benchmark-json`` (the CPU
harness: wall-clock under the Triton interpreter).  Writes ``DIR/report.md`` (default: beside the JSON)
and, for the runner's JSON with matplotlib installed, ``DIR/latency.png`` (per group: device µs, ours /
each peer, times the read-once floor; ``plot_latency``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.catalog import OPS, PEERS

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
    """[op, B, comparison, worst rel, budget, within] of every peer row (ReplaySSM's, SGLang's, FlashInfer's): its error
    against the float64 oracle beside its time."""
    out = []
    for r in rows:
        if r["op"].startswith(("replayssm", "sglang", "flashinfer")):
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
        lines.append(f"- `{name}`: `{tree.get('package')}` (sources sha256 "
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
                             else []) + (
            [f"FlashInfer {next((r.get('flashinfer') for r in after.get('rows', []) if r.get('flashinfer')), '?')}'s "
             f"GDN kernels"] if any(o.startswith("flashinfer") for o in ops) else [])
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
        md += ["![device time per operation, ours / peer and x the read-once floor, vs batch](latency.png)", ""]
    return "\n".join(md)


#: Name prefixes of the series that are not this project's: the peers and the per-draft-state baselines
#: (``read_state`` is the measured floor of a state read, drawn as a reference).
OTHERS = ("fla_", "replayssm_", "sglang_", "flashinfer_", "per_draft_state_")
_OURS_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:cyan", "#1a237e", "tab:olive")
_PEER_COLOURS = ("0.35", "tab:brown", "tab:pink", "0.6", "#8d6e63", "#9e9d24")
_PEER_STYLES = (("--", "v"), (":", "s"), ("-.", "D"), ((0, (5, 1, 1, 1, 1, 1)), "^"), ((0, (1, 3)), "P"))


def is_ours(op: str) -> bool:
    """A series of this project (not a peer's, a baseline or the state-read floor)."""
    return op != READ and not op.startswith(OTHERS)


def latency_panels(result: dict) -> list:
    """The panels of ``plot_latency``, three per group of the ``after`` tree: ``time`` (device µs of every
    op), ``ratio`` (each of our ops over each peer or baseline of it present: the ``vs_<peer>`` of the
    run) and ``floor`` (each of our ops times its read-once floor, with read_state's as the measured
    floor of a state read).  Each panel: dict(group, kind, title, series=[dict(label, ours, op, peer,
    points=[(B, value)])])."""
    rows = result.get("trees", {}).get("after", {}).get("rows", [])
    panels = []
    for group, title in GROUP_TITLES.items():
        grows = [r for r in rows if r.get("group") == group and r.get("device_us") is not None]
        if not grows:
            continue
        ops = list(dict.fromkeys(r["op"] for r in grows))
        present = set(ops)

        def pts(op, key):
            return sorted((r["B"], r[key]) for r in grows if r["op"] == op and r.get(key) is not None)
        time = [dict(label=o, op=o, peer=None, ours=is_ours(o), points=pts(o, "device_us")) for o in ops]
        ratio = []
        for o in ops:
            if not is_ours(o):
                continue
            peers = PEERS.get(o) or sorted({k[3:] for r in grows if r["op"] == o for k in r if k.startswith("vs_")}
                                           - {"floor"})
            for p in peers:
                if p in present and p != READ and not is_ours(p) and pts(o, f"vs_{p}"):
                    ratio.append(dict(label=f"{o} / {p}", op=o, peer=p, ours=True, points=pts(o, f"vs_{p}")))
        floor = [dict(label=o, op=o, peer=None, ours=True, points=pts(o, "vs_floor")) for o in ops if is_ours(o)]
        if READ in present:
            floor.append(dict(label=f"{READ} (a state read)", op=READ, peer=None, ours=False,
                              points=pts(READ, "vs_floor")))
        panels += [dict(group=group, kind="time", title=title, series=time),
                   dict(group=group, kind="ratio", title=f"{title}: ours / peer", series=ratio),
                   dict(group=group, kind="floor", title=f"{title}: x read-once floor",
                        series=[s for s in floor if s["points"]])]
    return panels


def plot_latency(result: dict, path: Path) -> bool:
    """One row of panels per group (the ``after`` tree, ``latency_panels``): device µs vs batch, our ops
    over each peer, our ops times the read-once floor.  This project's series are solid, thick and
    filled; peers and baselines dashed and hollow; legends beside the axes.  False without matplotlib or
    rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        return False
    panels = latency_panels(result)
    if not panels:
        return False
    groups = list(dict.fromkeys(p["group"] for p in panels))
    fig, axes = plt.subplots(len(groups), 3, figsize=(20, 3.6 * len(groups)), squeeze=False,
                             layout="constrained")
    smoke = " (SMOKE: no meaning)" if result.get("smoke") else ""
    number = FuncFormatter(lambda y, _: f"{y:g}")
    times = FuncFormatter(lambda y, _: f"{y:g}x")
    for row, group in zip(axes, groups):
        mine = {p["kind"]: p for p in panels if p["group"] == group}
        ours = [s["op"] for s in mine["time"]["series"] if s["ours"]]
        others = [s["op"] for s in mine["time"]["series"] if not s["ours"]]
        colour = {o: _OURS_COLOURS[i % len(_OURS_COLOURS)] for i, o in enumerate(ours)}
        colour.update({o: _PEER_COLOURS[i % len(_PEER_COLOURS)] for i, o in enumerate(others)})
        peer_style = {p: _PEER_STYLES[i % len(_PEER_STYLES)] for i, p in enumerate(
            dict.fromkeys(s["peer"] for s in mine["ratio"]["series"]))}
        batches = sorted({b for p in mine.values() for s in p["series"] for b, _ in s["points"]})
        for ax, kind in zip(row, ("time", "ratio", "floor")):
            panel = mine[kind]
            for s in panel["series"]:
                xs, ys = [b for b, _ in s["points"]], [v for _, v in s["points"]]
                if kind == "ratio":
                    ls, mk = peer_style[s["peer"]]
                    ax.plot(xs, ys, ls=ls, marker=mk, color=colour[s["op"]], lw=1.6, ms=5, label=s["label"])
                elif s["ours"]:
                    ax.plot(xs, ys, "-o", color=colour[s["op"]], lw=2.2, ms=5, label=s["label"], zorder=3)
                else:
                    ax.plot(xs, ys, "--o", color=colour.get(s["op"], "0.5"), lw=1.2, ms=5, mfc="white",
                            label=s["label"], zorder=2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("batch B")
            ax.grid(True, which="major", alpha=0.3)
            if kind == "time":
                ax.yaxis.set_major_formatter(number)
                ax.set_ylabel("device µs per layer")
            else:
                ax.yaxis.set_major_formatter(times)
                ax.axhline(1.0, color="k", lw=1, zorder=1)
                lo, hi = ax.get_ylim()
                ax.set_ylim(min(lo, 0.8), max(hi, 1.25))
                ax.set_ylabel("ours / peer (below 1: ours faster)" if kind == "ratio"
                              else "x read-once floor (1: the floor)")
            ax.set_title(panel["title"] + smoke, fontsize=9)
            if panel["series"]:
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
                          borderaxespad=0.0)
            else:
                ax.text(0.5, 0.5, "no peer of ours measured", transform=ax.transAxes, ha="center", fontsize=8)
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
