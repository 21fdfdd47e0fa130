"""Running a golden case through an implementation and judging it against the stored float64 truth.

``check(impl)`` runs every case through ``impl``, an object with the ``kvbuffer_ref`` function names
(``kvbuffer_ref`` itself, ``kvbuffer_fast``, or a ``types.SimpleNamespace`` with just the functions
you have; restrict ``ops=`` accordingly), and returns one ``CaseReport`` per case and buffer form:
worst-slice relative RMS error, max-abs error and pass/fail of every expected tensor under the one
tolerance table (``kvbuffer.validate.TOLERANCES``).  At ``dtype=torch.float64`` only the float64
floor counts; at a narrower dtype the baseline of the error policy (docs/testing.md) is, output by output,
the worst of the correct forms in that dtype on the same inputs (``baselines``): the recurrent oracle over
the same history (``truth.truth``); for the operations that form cumulative gates (all but recurrent) the
operation itself run by ``kvbuffer_ref`` on the same inputs and buffer (its own form); for chunk, direct and
prefill also the chunkwise forms with chunks of 64 and of the operation's own chunk
(``properties.truth_and_baseline``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

import kvbuffer_ref
from kvbuffer_ref.buffer import KVBuffer

from ..validate.contracts import emulate
from ..validate.properties import truth_and_baseline
from ..validate.tolerances import Comparison, compare, current_contract
from .files import BUFFER_OPS, GoldenCase, load_cases
from .truth import torch_arrays, truth

__all__ = ["CaseReport", "run_case", "check_case", "check", "stored_mismatch", "baselines"]

def stored_mismatch(name: str, got: np.ndarray, stored: np.ndarray) -> Optional[str]:
    """None when a rebuilt array reproduces the stored one, else why not.  Bit for bit where this
    machine's float64 products sum in the stored files' order (integer arrays always); elsewhere
    (another CPU's vector width or BLAS kernel orders a product's sum differently) the floating arrays
    the oracle computed (expected outputs, buffers built from a history) within the error table's
    float64 row, the oracle's own rounding, NaN where the file has NaN (seeded draws are bit for bit
    anyway: a changed draw is far past that budget)."""
    if np.array_equal(got, stored, equal_nan=True):
        return None
    if not np.issubdtype(np.asarray(got).dtype, np.floating) or np.shape(got) != np.shape(stored):
        return f"{name} differs from the stored file"
    g, e = (torch.from_numpy(np.ascontiguousarray(x)) for x in (got, stored))
    if not torch.equal(g.isnan(), e.isnan()):
        return f"{name}: NaN elsewhere than in the stored file"
    g, e = (torch.where(e.isnan(), 0.0, x) for x in (g, e))
    while g.dim() < 3:  # compare's slices: (request, head) of [B, ..., H, ...]
        g, e = g[None], e[None]
    c = compare(g, e, None, name=name, dtype=torch.float64)
    return None if c.passed else f"{name}: not bit for bit, and past the float64 budget: {c}"


#: Operations checked once per buffer form.
_FORM_OPS = BUFFER_OPS + ("prefill",)


def _other_form(form: str) -> str:
    return "raw" if form == "u" else "u"


def _make_buffer(t: dict, form: str, impl) -> KVBuffer:
    """The case's input buffer in ``form``; no ``buffer_state`` tensor: a buffer without state storage."""
    cls = getattr(impl, "KVBuffer", KVBuffer)
    unused = set(KVBuffer.form_fields(_other_form(form))) | {"state"}
    return cls(state=t.get("buffer_state"), **{f: t["buffer_" + f] for f in KVBuffer.fields() if f not in unused})


def _buffer_out(buf, state) -> dict[str, torch.Tensor]:
    out = {f"buffer_{f}": getattr(buf, f) for f in KVBuffer.fields() if getattr(buf, f, None) is not None}
    out["state"] = state
    return out


def run_case(case: GoldenCase, impl=None, *, dtype: torch.dtype = torch.float64, form: str = "u"
             ) -> dict[str, torch.Tensor]:
    """Run ``case`` through ``impl`` (default ``kvbuffer_ref``) with its floating inputs in ``dtype``.

    Buffered operations start from the case's buffer in ``form`` ("u" or "raw").  Returns the
    outputs under the names of the expected tensors (``expected_o`` -> ``o``, ...), without the prefix.
    """
    if impl is None:
        impl = kvbuffer_ref
    KVBuffer.form_fields(form)  # ValueError for an unknown form
    t = torch_arrays(case.inputs, dtype)
    p = case.params
    op = case.op
    if op == "flush":
        buf = impl.flush(_make_buffer(t, form, impl), count=t.get("count"))
        return _buffer_out(buf, impl.materialize_state(buf))
    tok = dict(g=t["g"], beta=t["beta"], scale=float(p["scale"]))
    q, k, v = t["q"], t["k"], t["v"]
    if op == "recurrent":
        o, S = impl.recurrent_gated_delta_rule(q, k, v, **tok, initial_state=t.get("initial_state"),
                                               output_final_state=True)
        return {"o": o, "final_state": S}
    if op == "chunk":
        o, S = impl.chunk_gated_delta_rule(q, k, v, **tok, initial_state=t.get("initial_state"),
                                           output_final_state=True, chunk_size=int(p["chunk_size"]))
        return {"o": o, "final_state": S}
    if op == "direct":
        return {"o": impl.direct_gated_delta_rule(q, k, v, **tok)}
    if op == "prefill":
        o, buf = impl.prefill(q, k, v, **tok, capacity=int(p["capacity"]), tail=p["tail"],
                              initial_state=t.get("initial_state"), form=form, chunk_size=int(p["chunk_size"]))
        return {"o": o} | _buffer_out(buf, impl.materialize_state(buf))
    buf = _make_buffer(t, form, impl)
    if op == "decode":
        outs = []
        for j in range(q.shape[1]):
            sl = slice(j, j + 1)
            o, buf = impl.buffered_decode(q[:, sl], k[:, sl], v[:, sl], g=t["g"][:, sl], beta=t["beta"][:, sl],
                                          scale=tok["scale"], buffer=buf)
            outs.append(o)
        return {"o": torch.cat(outs, dim=1)} | _buffer_out(buf, impl.materialize_state(buf))
    if op in ("verify_chain", "verify_tree"):
        o, drafts = impl.verify(q, k, v, **tok, buffer=buf, parents=t["parents"], num_drafts=t["num_drafts"])
        if op == "verify_chain":
            buf = impl.accept(buf, drafts, counts=t["counts"])
        else:
            buf = impl.accept(buf, drafts, nodes=t["nodes"])
        return {"o": o} | _buffer_out(buf, impl.materialize_state(buf))
    raise ValueError(f"case {case.id}: unknown operation {op!r}")


@dataclass
class CaseReport:
    """The verdict on one case (one buffer form, one dtype)."""

    id: str
    op: str
    form: str
    dtype: torch.dtype
    comparisons: list[Comparison] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.error is None and not self.mismatches and all(c.passed for c in self.comparisons)

    def __str__(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'} {self.id} ({self.op}, form={self.form}, " \
               f"{str(self.dtype).replace('torch.', '')})"
        lines = [head]
        if self.error:
            lines.append(f"  raised: {self.error}")
        lines += [f"  {m}" for m in self.mismatches]
        lines += [f"  {c}" for c in self.comparisons if not c.passed]
        return "\n".join(lines)

    def table(self) -> str:
        """Every comparison, one per line (worst-slice rel-RMS, max-abs, budget)."""
        return "\n".join([str(self).splitlines()[0]] + [f"  {c}" for c in self.comparisons])


def _head_axis(name: str) -> int:
    return 1 if name.endswith("state") else 2


def baselines(case: GoldenCase, dtype: torch.dtype, form: str = "u") -> dict[str, list[torch.Tensor]]:
    """The baseline forms of ``case``'s outputs at ``dtype`` (narrower than float64), keyed like the outputs
    (``o``, ``state``, ``buffer_u``, ...): the recurrent oracle over the same history in ``dtype``, the
    operation's own form (``kvbuffer_ref`` on the same inputs and buffer in ``form``, under the active
    arithmetic contract; not for recurrent, which forms no cumulative gate) and, for chunk, direct and prefill,
    the chunkwise forms with chunks of 64 and of the operation's own chunk (chunk_size, T, capacity)."""

    out: dict[str, list[torch.Tensor]] = {}

    def add(name, x):
        if x is not None:
            out.setdefault(name, []).append(x.detach().cpu())

    for n, x in truth(case.op, case.params, case.inputs, dtype).items():
        add(n[len("expected_"):], x)
    if case.op != "recurrent" and current_contract() != "bf16-state":
        with emulate(current_contract()):
            for n, x in run_case(case, kvbuffer_ref, dtype=dtype, form=form).items():
                if x is not None and x.is_floating_point():
                    add(n, x)
    p = case.params
    own_chunk = {"chunk": lambda: int(p["chunk_size"]), "direct": lambda: int(p["T"]),
                 "prefill": lambda: max(int(p["capacity"]), int(p["chunk_size"]))}.get(case.op)
    if own_chunk is not None:
        t = torch_arrays(case.inputs, dtype)
        x = {n: t[n] for n in ("q", "k", "v", "g", "beta")}
        h0 = None if case.op == "direct" else t.get("initial_state")
        _, base = truth_and_baseline(x, h0, scale=float(p["scale"]), chunk=own_chunk())
        add("o", base[0])
        add("final_state" if case.op == "chunk" else "state", None if case.op == "direct" else base[1])
    return out


def check_case(case: GoldenCase, impl=None, *, dtype: torch.dtype = torch.float64, form: str = "u",
               raise_errors: bool = False) -> CaseReport:
    """Run ``case`` through ``impl`` and compare every output with the stored float64 truth.

    Exact fields (buffer lengths, has_state) must match exactly; floating fields pass under the
    tolerance table (``kvbuffer.validate.TOLERANCES``) for ``dtype``; buffer entries are compared
    only in used slots (slot < expected length), the stale state only where a state is owned.
    Exceptions are reported (``error``) unless ``raise_errors``.
    """
    rep = CaseReport(case.id, case.op, form if case.op in _FORM_OPS else "-", dtype)
    try:
        actual = run_case(case, impl, dtype=dtype, form=form)
    except Exception as e:  # reported, not swallowed: the report fails
        if raise_errors:
            raise
        rep.error = f"{type(e).__name__}: {e}"
        return rep
    exp = {n[len("expected_"):]: torch.from_numpy(np.array(a)) for n, a in case.expected.items()}
    base = None
    if dtype != torch.float64:
        base = baselines(case, dtype, form)
    skip = KVBuffer.form_fields(_other_form(form))
    slots = None
    if "buffer_lengths" in exp:
        C = exp["buffer_k"].shape[1]
        slots = torch.arange(C)[None, :] < exp["buffer_lengths"][:, None]  # [B, C]
    for name, e in exp.items():
        if name.startswith("buffer_") and name[len("buffer_"):] in skip:
            continue
        if name == "buffer_state" and actual.get(name) is None and not bool(exp["buffer_has_state"].any()):
            continue  # no request owns a state, and the implementation allocated no storage: fine
        if name not in actual or actual[name] is None:
            rep.mismatches.append(f"{name}: missing from the implementation's outputs")
            continue
        a = actual[name]
        if not e.dtype.is_floating_point:
            if tuple(a.shape) != tuple(e.shape) or not torch.equal(a.cpu().to(e.dtype), e):
                rep.mismatches.append(f"{name}: expected {e.tolist()}, got {a.tolist()}")
            continue
        valid = None
        if name == "buffer_state":
            valid = exp["buffer_has_state"][:, None, None, None]
        elif name.startswith("buffer_"):
            valid = slots.reshape(slots.shape + (1,) * (e.dim() - 2))
        if tuple(a.shape) != tuple(e.shape):
            rep.mismatches.append(f"{name}: expected shape {list(e.shape)}, got {list(a.shape)}")
            continue
        rep.comparisons.append(compare(a.detach().cpu(), e, None if base is None else base[name], name=name,
                                       dtype=dtype, head_axis=_head_axis(name), valid=valid))
    return rep


def check(impl=None, *, path=None, cases: Optional[Sequence[GoldenCase]] = None,
          ops: Optional[Iterable[str]] = None, dtype: torch.dtype = torch.float64,
          forms: Sequence[str] = ("u", "raw")) -> list[CaseReport]:
    """Check ``impl`` (default ``kvbuffer_ref``) on the golden cases; one report per case and buffer form.

    ``forms`` applies to the buffered operations and prefill (non-buffered ops run once).  Example::

        from kvbuffer import golden
        reports = golden.check(my_impl, ops=["recurrent", "chunk"], dtype=torch.float32)
        assert all(r.passed for r in reports), "\\n".join(str(r) for r in reports if not r.passed)
    """
    if cases is None:
        cases = load_cases(path, ops=ops)
    elif ops is not None:
        cases = [c for c in cases if c.op in set(ops)]
    reports = []
    for c in cases:
        for form in (forms if c.op in _FORM_OPS else ("u",)):
            reports.append(check_case(c, impl, dtype=dtype, form=form))
    return reports
