"""The low-precision error report (``kvbuffer validate --report precision``): error growth over decode length.

An implementation's decode path is driven token by token over one long sequence with 16-bit inputs
(float16 on the CPU, where the Triton interpreter computes bfloat16 wrongly; bfloat16 on CUDA), and its
outputs and state are compared with the float64 recurrence on the same (rounded) inputs after 1, 2, 4,
... steps.  Beside it, on the same inputs, the reference points an engine decides by:

    fp32 recurrence         the plain recurrence in float32 with a float32 state (the baseline every
                            budget of the tolerance table is relative to)
    bf16-state recurrence   the same with the state rounded to bfloat16 after every token (the
                            ``bf16-state`` contract's emulation, ``contracts.recurrent_bf16_state``)

and each implementation's decode operations that it provides:

    recurrent_decode        the in-place step, its state handed over in ``state_dtype`` (float32 by default;
                            a 16-bit state is what an engine storing bf16 states runs).  A peer in an engine
                            convention that keeps a state dtype of its own (``peers.engine.Convention``'s
                            ``state_dtype``: flashinfer-bf16's bfloat16 pool) rounds the state into it on
                            every step whatever it is handed: the report states the dtype the state is
                            really stored in (``stored_state_dtype``)
    buffered_decode         decode into a buffer of ``capacity`` rows (its u / v cache in ``cache_dtype``)
                            that folds into the state whenever it is full, as serving runs it; its state
                            after n steps is ``materialize_state`` when provided

The error of step n is the relative RMS error of the outputs of steps (n/2, n] (the tokens since the
previous checkpoint; step 1 alone) and of the state after step n, worst over the (request, head) slices.
No pass or fail: the report states measured growth, the verdicts stay with ``kvbuffer validate``.
"""

from __future__ import annotations

import json
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import kvbuffer_ref as ref
from kvbuffer_ref.buffer import KVBuffer

from .cases import l2norm_qk, snap_to_raw_gates
from .contracts import recurrent_bf16_state
from .lanes import dtype_name
from .tolerances import rel_rms_slices

__all__ = ["checkpoints", "decode_inputs", "precision_report", "precision_markdown", "plot_precision",
           "write_precision_json", "own_state_dtype", "stored_state_dtype"]


def own_state_dtype(impl) -> Optional[torch.dtype]:
    """The dtype an implementation stores its recurrent state in by itself, whatever state it is handed: the
    engine convention's ``state_dtype`` (``peers.engine.engine_adapter``: its ``recurrent_decode`` converts the
    state it is handed into that dtype for the kernel and copies the kernel's state back, so it is rounded into
    it every step; flashinfer-bf16: bfloat16), or None where the implementation keeps the state it is handed
    (``recurrent_decode`` updates the caller's tensor in its dtype)."""
    conv = getattr(getattr(impl, "obj", impl), "conv", None)
    dt = getattr(conv, "state_dtype", None)
    return dt if isinstance(dt, torch.dtype) else None


def stored_state_dtype(impl, handed: torch.dtype) -> torch.dtype:
    """The coarsest precision the state goes through per decode step: the ``handed`` state's dtype, or the
    implementation's own (``own_state_dtype``) where that is coarser (a bfloat16 pool handed a float32 state
    stores bfloat16).  Two different 16-bit dtypes: the implementation's own (both roundings happen; the
    report names both)."""
    own = own_state_dtype(impl)
    if own is None or own.itemsize > handed.itemsize:
        return handed
    return own


def checkpoints(steps: int) -> list[int]:
    """1, 2, 4, ... up to ``steps`` (``steps`` itself last when it is not a power of two)."""
    if steps < 1:
        raise ValueError(f"steps: expected a positive integer, got {steps}")
    out = [1 << i for i in range(int(math.log2(steps)) + 1)]
    return out + ([steps] if out[-1] != steps else [])


def decode_inputs(*, steps: int, B: int = 2, H: int = 1, HV: int = 2, K: int = 32, V: int = 32, seed: int = 0,
                  gate_min: float = -0.05) -> dict:
    """float64 inputs of one long decode: unit-norm q and k, v ~ N(0, 1), beta ~ U(0, 1), log-gates ~
    U(gate_min, 0) (the default -0.05: a memory of about 40 tokens, as the slow heads of served models keep;
    0: no decay, the worst growth)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=F.normalize(r(B, steps, H, K), dim=-1), k=F.normalize(r(B, steps, H, K), dim=-1),
                v=r(B, steps, HV, V), g=gate_min * torch.rand(B, steps, HV, generator=gen, dtype=torch.float64),
                beta=torch.rand(B, steps, HV, generator=gen, dtype=torch.float64))


def _tok(x: dict, t: int) -> dict:
    return {n: v[:, t:t + 1] for n, v in x.items()}


def _errors(outs: list, states: dict, o64: torch.Tensor, S64: dict, marks: Sequence[int]) -> dict:
    """{"o": [...], "state": [...]} per checkpoint: worst-slice rel-RMS of the outputs of the steps since the
    previous checkpoint (1, 2, 3-4, 5-8, ...) and
    of the state after step n (None where there is no state)."""
    o = torch.cat([t.detach().to("cpu", torch.float64) for t in outs], dim=1)
    res = {"o": [], "state": []}
    prev = 0
    for n in marks:
        lo = prev
        res["o"].append(float(rel_rms_slices(o[:, lo:n], o64[:, lo:n], 2).max()))
        S = states.get(n)
        res["state"].append(None if S is None else float(rel_rms_slices(S.detach().to("cpu", torch.float64), S64[n], 1).max()))
        prev = n
    return res


def _recurrence(x: dict, dtype: torch.dtype, marks: Sequence[int], S0: Optional[torch.Tensor] = None):
    """Outputs and checkpoint states of the plain recurrence in ``dtype`` (chunked between checkpoints)."""
    xd = {n: t.to(dtype) for n, t in x.items()}
    outs, states, S, t0 = [], {}, S0, 0
    for n in marks:
        o, S = ref.recurrent_gated_delta_rule(**{k: v[:, t0:n] for k, v in xd.items()}, initial_state=S,
                                              output_final_state=True)
        outs.append(o)
        states[n] = S
        t0 = n
    return outs, states


def precision_report(impl, *, steps: int = 256, dtype: torch.dtype = torch.float16, device="cpu",
                     state_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype = torch.float32,
                     capacity: int = 16, B: int = 2, H: int = 1, HV: int = 2, K: int = 32, V: int = 32,
                     seed: int = 0, gate_min: float = -0.05) -> dict:
    """The error of ``impl``'s decode operations (an ``adapters.Implementation``; None: the reference rows
    only) against the float64 recurrence after 1, 2, 4, ... ``steps`` decode steps, with ``dtype`` inputs,
    beside the fp32 and bf16-state recurrences' on the same inputs.  A JSON-ready dict (``precision_markdown``
    renders it)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected float16, bfloat16 or float32 inputs, got {dtype}")
    marks = checkpoints(steps)
    x64 = decode_inputs(steps=steps, B=B, H=H, HV=HV, K=K, V=V, seed=seed, gate_min=gate_min)
    if impl is not None and impl.raw_gate_dtype:  # its raw gates are rounded: g and beta those of the rounded ones
        x64["g"], x64["beta"] = snap_to_raw_gates(x64["g"], x64["beta"], impl.raw_gate_dtype)
    gate_dtype = torch.float32
    xin = {n: t.to(device=device, dtype=gate_dtype if n in ("g", "beta") else dtype) for n, t in x64.items()}
    xr = {n: t.detach().to("cpu", torch.float64) for n, t in xin.items()}  # the rounded inputs, as the truth sees
    normalised = impl is not None and impl.qk_l2norm
    if normalised:  # the kernel L2-normalises q and k itself: every row runs on those normalised inputs
        xr = l2norm_qk(xr, torch.float64)
    o64s, S64 = _recurrence(xr, torch.float64, marks)
    o64 = torch.cat(o64s, dim=1)
    series = {}
    out_dtype = dtype  # outputs come in the inputs' dtype (docs/conventions.md): the reference rows' too
    outs, states = _recurrence(xr, torch.float32, marks)
    outs = [o.to(out_dtype) for o in outs]
    series["fp32 recurrence"] = _errors(outs, states, o64, S64, marks)
    outs, states, S = [], {}, None
    for i, n in enumerate(marks):  # segment by segment: the state after step n
        t0 = marks[i - 1] if i else 0
        o, S = recurrent_bf16_state(**{k: v[:, t0:n].float() for k, v in xr.items()}, initial_state=S)
        outs.append(o.to(out_dtype))
        states[n] = S
    series["bf16-state recurrence"] = _errors(outs, states, o64, S64, marks)
    notes = ["q and k L2-normalised as the implementation does in its kernel: the truth and the reference rows "
             "run on the normalised inputs"] if normalised else []
    if impl is not None:
        impl.prepare()
        obj = impl.obj
        own = own_state_dtype(impl)
        if impl.has("recurrent_decode") and own is not None and own != state_dtype:
            notes.append(f"{impl.name} stores its recurrent state in {dtype_name(own)} itself (its engine "
                         f"convention's state_dtype): the {dtype_name(state_dtype)} state it is handed is rounded "
                         f"into {dtype_name(own)} at every step, so its state is stored in "
                         f"{dtype_name(stored_state_dtype(impl, state_dtype))}")
        if impl.has("recurrent_decode"):
            state = torch.zeros(B, HV, K, V, dtype=state_dtype, device=device)
            outs, states = [], {}
            try:
                for t in range(steps):
                    outs.append(obj.recurrent_decode(**_tok(xin, t), state=state))
                    if t + 1 in marks:
                        states[t + 1] = state.clone()
            except (TypeError, ValueError, NotImplementedError) as e:  # it refuses the state (or inputs) it is handed
                notes.append(f"{impl.name}: recurrent_decode NOT RUN on a {dtype_name(state_dtype)} state: it raised "
                             f"at step {t + 1}: {type(e).__name__}: {e}")
            else:
                series[f"{impl.name} recurrent_decode"] = _errors(outs, states, o64, S64, marks)
        else:
            notes.append(f"{impl.name}: no recurrent_decode")
        if impl.has("buffered_decode"):
            buf = KVBuffer.empty(B, H, HV, K, V, capacity, dtype=cache_dtype, key_dtype=dtype,
                                 state_dtype=torch.float32, device=device)
            outs, states = [], {}
            mat = impl.has("materialize_state")
            for t in range(steps):
                o, buf = obj.buffered_decode(**_tok(xin, t), buffer=buf)
                outs.append(o)
                if mat and t + 1 in marks:
                    states[t + 1] = obj.materialize_state(buf).clone()
            series[f"{impl.name} buffered_decode[C={capacity}]"] = _errors(outs, states, o64, S64, marks)
            if not mat:
                notes.append(f"{impl.name}: no materialize_state, so no state error of buffered_decode")
        else:
            notes.append(f"{impl.name}: no buffered_decode")
    base = series["fp32 recurrence"]
    return dict(tool="kvbuffer validate --report precision", implementation=None if impl is None else impl.name,
                steps=marks, device=str(device), dtype=dtype_name(dtype),
                state_dtype=dtype_name(state_dtype), cache_dtype=dtype_name(cache_dtype),
                stored_state_dtype=dtype_name(state_dtype if impl is None else stored_state_dtype(impl, state_dtype)),
                capacity=capacity, shape=dict(B=B, H=H, HV=HV, K=K, V=V), seed=seed, gate_min=gate_min,
                series=series, notes=notes,
                ratio_to_fp32={key: {name: [None if b in (None, 0) or a is None else a / b
                                            for a, b in zip(s[key], base[key])]
                                     for name, s in series.items() if name != "fp32 recurrence"}
                               for key in ("o", "state")})


def _e(x) -> str:
    return "–" if x is None else f"{x:.2e}"


def _stored(rep: dict) -> str:
    """The recurrent_decode state's dtype as stated: the stored one, and the handed one where they differ."""
    stored = rep.get("stored_state_dtype", rep["state_dtype"])
    if stored == rep["state_dtype"]:
        return stored
    return f"{stored} (stored so by the implementation itself; handed over in {rep['state_dtype']})"


def precision_markdown(rep: dict, plot: Optional[str] = None) -> str:
    """The report as Markdown: the settings, then two tables (outputs, states) of one row per checkpoint with
    each series' error and its ratio to the fp32 recurrence's."""
    s = rep["shape"]
    names = list(rep["series"])
    md = [f"# Precision report: {rep.get('implementation') or 'the reference points'}", "",
          f"- {rep['dtype']} inputs (g, beta float32), device {rep['device']}; recurrent_decode state "
          f"{_stored(rep)}, buffered_decode cache {rep['cache_dtype']} with C = {rep['capacity']}",
          f"- B = {s['B']}, H = {s['H']}, HV = {s['HV']}, K = {s['K']}, V = {s['V']}; log-gates U({rep['gate_min']}, 0), "
          f"beta U(0, 1), unit q and k; seed {rep['seed']}",
          "- Error: worst-slice relative RMS against the float64 recurrence on the same rounded inputs; `o` of the "
          "steps since the previous checkpoint (outputs in the inputs' dtype, the reference rows' too), `state` "
          "after step n", ""]
    md += [f"- {n}" for n in rep.get("notes", [])] + ([""] if rep.get("notes") else [])
    for what, key in (("Output error", "o"), ("State error", "state")):
        cols = [n for n in names if any(v is not None for v in rep["series"][n][key])]
        ratios = [n for n in cols if n != "fp32 recurrence"]
        head = ["steps"] + cols + [f"{n} / fp32" for n in ratios]
        md += [f"**{what}** (`{key}`)", "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for i, n in enumerate(rep["steps"]):
            row = [str(n)] + [_e(rep["series"][k][key][i]) for k in cols]
            row += ["–" if rep["ratio_to_fp32"][key][k][i] is None else f"{rep['ratio_to_fp32'][key][k][i]:.3g}"
                    for k in ratios]
            md.append("| " + " | ".join(row) + " |")
        md.append("")
    if plot:
        md += ["", f"![error over decode length]({plot})"]
    return "\n".join(md) + "\n"


def plot_precision(rep: dict, path) -> bool:
    """Error against steps (log-log): outputs solid, states dashed.  False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, s) in enumerate(rep["series"].items()):
        color = f"C{i}"
        ax.plot(rep["steps"], [max(v, 1e-17) for v in s["o"]], "-o", color=color, ms=3, label=f"{name} o")
        st = [(n, v) for n, v in zip(rep["steps"], s["state"]) if v is not None]
        if st:
            ax.plot([n for n, _ in st], [max(v, 1e-17) for _, v in st], "--", color=color, label=f"{name} S")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode steps")
    ax.set_ylabel("worst-slice rel-RMS vs float64")
    ax.set_title(f"{rep.get('implementation') or 'reference points'}: {rep['dtype']} inputs, {rep['device']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_precision_json(rep: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
        f.write("\n")
