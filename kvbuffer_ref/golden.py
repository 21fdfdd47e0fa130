"""Golden vectors: frozen float64 cases any implementation (in any language) can be checked against.

Where the files live
--------------------
The vectors are plain files, not package data: ``tests/golden/index.json`` plus one ``.npz`` per case
under ``tests/golden/cases/`` (DESIGN.md §7).  ``load_cases(path)`` reads them from any directory
holding an ``index.json``; with no ``path`` it uses, in order, the environment variable
``KVBUFFER_GOLDEN_DIR`` and then ``tests/golden`` of the source checkout this module sits in.
A pip-installed user (no checkout) copies the ``tests/golden`` directory (< 5 MB, numpy + JSON only)
and passes its path.  The format is described field by field in docs/golden.md.

What a case holds
-----------------
Inputs in float64 (tokens ``q, k, v, g, beta``; for buffered operations a ``buffer_*`` state given in
BOTH forms, u-cache and raw) and expected outputs ``expected_*``, every one of them computed by the
plain RECURRENT reference over the case's token history (``truth`` below), never by the buffered
forms; the generator (scripts/make_golden.py) additionally asserts that the buffered reference agrees.

Checking an implementation
--------------------------
``check(impl)`` runs every case through ``impl``, an object with the ``kvbuffer_ref`` function names
(``kvbuffer_ref`` itself, ``kvbuffer_fast``, or a ``types.SimpleNamespace`` with just the functions
you have; restrict ``ops=`` accordingly), and returns one ``CaseReport`` per case and buffer form:
worst-slice relative RMS error, max-abs error and pass/fail of every expected tensor under the one
tolerance table (``kvbuffer_ref.testing.TOLERANCES``).  At ``dtype=torch.float64`` only the float64
floor counts; at a narrower dtype the budget is calibrated on the recurrent reference run in that
dtype over the same history (the baseline of DESIGN.md §5).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from .buffer import KVBuffer
from .recurrent import recurrent_gated_delta_rule
from .testing.tolerances import Comparison, compare

__all__ = [
    "FORMAT",
    "VERSION",
    "OPS",
    "ENV_VAR",
    "GoldenCase",
    "CaseReport",
    "default_dir",
    "load_index",
    "load_cases",
    "read_npz",
    "write_npz",
    "fold_count",
    "truth",
    "derive_buffer",
    "run_case",
    "check_case",
    "check",
]

FORMAT = "kvbuffer-golden"
VERSION = 1
ENV_VAR = "KVBUFFER_GOLDEN_DIR"

#: Every operation a case can exercise (the ``op`` field of the index).
OPS = ("recurrent", "chunk", "direct", "decode", "flush", "verify_chain", "verify_tree", "prefill")
#: Operations whose inputs include a buffer (given in both forms; checked in both).
BUFFER_OPS = ("decode", "flush", "verify_chain", "verify_tree")
#: Tensor names of the buffer, in both forms (``buffer_<field>`` as input, ``expected_buffer_<field>`` after).
BUFFER_FIELDS = ("k", "lengths", "state", "has_state", "u", "G", "v", "g", "beta")
_FORM_FIELDS = {"u": ("u", "G"), "raw": ("v", "g", "beta")}


# ----------------------------------------------------------------------------------------- files
def default_dir() -> Path:
    """``$KVBUFFER_GOLDEN_DIR`` if set, else ``tests/golden`` of the source checkout holding this module."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "tests" / "golden"


def _resolve(path) -> Path:
    d = default_dir() if path is None else Path(path)
    if d.is_file():
        d = d.parent
    if not (d / "index.json").is_file():
        how = (f"set {ENV_VAR} or pass path= (the directory holding index.json; in the source tree it is "
               f"tests/golden)") if path is None else "pass the directory that holds index.json"
        raise FileNotFoundError(f"golden vectors: no index.json in {d}; {how}")
    return d


def load_index(path=None) -> dict:
    """The parsed ``index.json`` (format, version, conventions, and one entry per case)."""
    d = _resolve(path)
    index = json.loads((d / "index.json").read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"golden vectors: {d / 'index.json'} is format {index.get('format')!r} version "
                         f"{index.get('version')!r}, this reader understands {FORMAT!r} version {VERSION}")
    return index


def read_npz(file) -> dict[str, np.ndarray]:
    """All arrays of one case file (no pickles)."""
    with np.load(file, allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def write_npz(file, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an uncompressed .npz, byte-for-byte reproducible.

    ``np.savez`` stamps the current time into every zip member; here members are sorted by name,
    dated 1980-01-01, stored (no compression, so the zlib version cannot matter) and little-endian.
    """
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


@dataclass(frozen=True)
class GoldenCase:
    """One case: its index entry and its arrays (inputs by plain name, expected outputs as ``expected_*``)."""

    id: str
    op: str
    description: str
    exercises: tuple[str, ...]
    params: dict
    file: Path
    arrays: dict = field(repr=False)

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        return {n: a for n, a in self.arrays.items() if not n.startswith("expected_")}

    @property
    def expected(self) -> dict[str, np.ndarray]:
        return {n: a for n, a in self.arrays.items() if n.startswith("expected_")}


def load_cases(path=None, *, ops: Optional[Iterable[str]] = None, ids: Optional[Iterable[str]] = None
               ) -> list[GoldenCase]:
    """Load the cases of the index in ``path`` (default: see ``default_dir``), optionally only some ops / ids."""
    d = _resolve(path)
    index = load_index(d)
    ops = None if ops is None else set(ops)
    ids = None if ids is None else set(ids)
    if ops is not None and not ops <= set(OPS):
        raise ValueError(f"ops: unknown operation(s) {sorted(ops - set(OPS))}, expected some of {OPS}")
    cases = []
    for e in index["cases"]:
        if (ops is not None and e["op"] not in ops) or (ids is not None and e["id"] not in ids):
            continue
        f = d / e["file"]
        cases.append(GoldenCase(id=e["id"], op=e["op"], description=e["description"],
                                exercises=tuple(e["exercises"]), params=e["params"], file=f, arrays=read_npz(f)))
    if ids is not None and len(cases) != len(ids):
        raise ValueError(f"ids: not in the index: {sorted(ids - {c.id for c in cases})}")
    return cases


# ----------------------------------------------------------------------------------------- truth
def fold_count(n_old: int, n_new: int, capacity: int) -> int:
    """The overflow rule (docs/math.md): nothing folds while ``n_old + n_new <= C``; otherwise all the
    old entries fold, plus the oldest ``n_new - C`` new ones when there are more than C of them."""
    if n_old + n_new <= capacity:
        return 0
    return n_old + max(0, n_new - capacity)


def _path_to(parents: Sequence[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


class _Request:
    """One request's history run through the recurrent reference, token by token.

    ``stale``: the state at the last fold (None = direct mode, S0 = 0); ``entries``: the tokens since
    then, each with its innovation u and the recurrent state after it; ``current``: the state now.
    """

    def __init__(self, stale: Optional[torch.Tensor], scale: float):
        self.stale = stale
        self.current = stale
        self.scale = scale
        self.entries: list[dict] = []

    def step(self, S: Optional[torch.Tensor], tok: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(o [HV, V], state after [HV, K, V], u [HV, V]) of one token on top of state S (None = 0)."""
        one = {n: tok[n][None, None] for n in ("q", "k", "v", "g", "beta")}
        o, S1 = recurrent_gated_delta_rule(one["q"], one["k"], one["v"], g=one["g"], beta=one["beta"],
                                           scale=self.scale, initial_state=None if S is None else S[None],
                                           output_final_state=True)
        # The innovation u = beta (v - S~^T k) of DESIGN.md §3 (what a u-cache stores).
        HV = tok["v"].shape[0]
        k = tok["k"].to(S1.dtype).repeat_interleave(HV // tok["k"].shape[0], dim=0)  # [HV, K]
        g = tok["g"].to(S1.dtype)
        decay = g.exp()[..., None] if g.dim() == 2 else g.exp()[:, None, None]
        S_dec = torch.zeros_like(S1[0]) if S is None else decay * S.to(S1.dtype)
        u = tok["beta"].to(S1.dtype)[:, None] * (tok["v"].to(S1.dtype) - torch.einsum("hk,hkv->hv", k, S_dec))
        return o[0, 0], S1[0], u

    def push(self, tok: dict) -> torch.Tensor:
        """Commit one token: returns its output."""
        o, S, u = self.step(self.current, tok)
        self.entries.append(dict(tok, u=u, S_after=S))
        self.current = S
        return o

    def fold(self, m: int) -> None:
        """Fold the first m entries into the stale state."""
        if m > 0:
            self.stale = self.entries[m - 1]["S_after"]
            self.entries = self.entries[m:]


def _tok(t: dict, b: int, i: int) -> dict:
    """Token i of request b: q, k [H, K]; v [HV, V]; g [HV]*; beta [HV]."""
    return {n: t[n][b, i] for n in ("q", "k", "v", "g", "beta")}


def _requests_from_buffer(t: dict, scale: float) -> list[_Request]:
    """Rebuild each request's history from the buffer input: stale state + raw entries (u recomputed)."""
    reqs = []
    for b in range(t["buffer_lengths"].shape[0]):
        owns = "buffer_state" in t and bool(t["buffer_has_state"][b])
        r = _Request(t["buffer_state"][b] if owns else None, scale)
        for i in range(int(t["buffer_lengths"][b])):
            r.push({"q": t["buffer_k"][b, i], "k": t["buffer_k"][b, i], "v": t["buffer_v"][b, i],
                    "g": t["buffer_g"][b, i], "beta": t["buffer_beta"][b, i]})
        reqs.append(r)
    return reqs


def _export(reqs: list[_Request], like: dict, capacity: int, prefix: str) -> dict[str, torch.Tensor]:
    """The buffer (both forms, NaN in unused slots) and the current state of every request."""
    B = len(reqs)
    H, K = like["k"].shape[-2:]
    HV, V = like["v"].shape[-2:]
    dt = like["v"].dtype
    gtail = tuple(like["g"].shape[3:])
    nan = float("nan")
    out = {
        "k": torch.full((B, capacity, H, K), nan, dtype=dt),
        "lengths": torch.zeros(B, dtype=torch.int64),
        "state": torch.zeros(B, HV, K, V, dtype=dt),
        "has_state": torch.zeros(B, dtype=torch.bool),
        "u": torch.full((B, capacity, HV, V), nan, dtype=dt),
        "G": torch.full((B, capacity, HV) + gtail, nan, dtype=dt),
        "v": torch.full((B, capacity, HV, V), nan, dtype=dt),
        "g": torch.full((B, capacity, HV) + gtail, nan, dtype=dt),
        "beta": torch.full((B, capacity, HV), nan, dtype=dt),
    }
    current = torch.zeros(B, HV, K, V, dtype=dt)
    for b, r in enumerate(reqs):
        n = len(r.entries)
        assert n <= capacity, f"request {b}: {n} entries exceed the capacity {capacity}"
        out["lengths"][b] = n
        if r.stale is not None:
            out["state"][b] = r.stale
            out["has_state"][b] = True
        if r.current is not None:
            current[b] = r.current
        if n:
            stack = {f: torch.stack([e[f] for e in r.entries]) for f in ("k", "u", "v", "g", "beta")}
            for f in ("k", "u", "v", "g", "beta"):
                out[f][b, :n] = stack[f]
            out["G"][b, :n] = stack["g"].cumsum(dim=0)
    res = {f"{prefix}buffer_{f}": x for f, x in out.items()}
    res[f"{prefix}state"] = current
    return res


def derive_buffer(inputs: dict[str, np.ndarray], params: dict) -> dict[str, np.ndarray]:
    """The u-cache fields ``buffer_u``, ``buffer_G`` (float64, NaN in unused slots) of a buffer given in
    raw form (``buffer_k, buffer_v, buffer_g, buffer_beta, buffer_lengths, buffer_has_state``, optional
    ``buffer_state``): each entry's u is the recurrence's own innovation for that token."""
    t = _torch_arrays(inputs, torch.float64)
    reqs = _requests_from_buffer(t, float(params["scale"]))
    like = {"k": t["buffer_k"], "v": t["buffer_v"], "g": t["buffer_g"]}
    out = _export(reqs, like, int(params["capacity"]), "")
    return {n: out[n].numpy() for n in ("buffer_u", "buffer_G")}


def _torch_arrays(arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """numpy arrays -> torch; floating ones cast to ``dtype`` (so a float32 run rounds its inputs once)."""
    out = {}
    for n, a in arrays.items():
        x = torch.from_numpy(np.array(a))
        out[n] = x.to(dtype) if x.dtype.is_floating_point else x
    return out


def truth(op: str, params: dict, inputs: dict[str, np.ndarray], dtype: torch.dtype = torch.float64
          ) -> dict[str, torch.Tensor]:
    """Expected outputs of a case from the recurrent reference over its token history, in ``dtype``.

    At float64 these are the stored ``expected_*`` tensors; at a narrower dtype they are the baseline
    of the tolerance rule (the plain recurrence in that dtype on the same, rounded, inputs).
    """
    t = _torch_arrays(inputs, dtype)
    scale = float(params["scale"])
    if op in ("recurrent", "chunk", "direct"):
        h0 = t.get("initial_state") if op != "direct" else None
        o, S = recurrent_gated_delta_rule(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], scale=scale,
                                          initial_state=h0, output_final_state=True)
        return {"expected_o": o} if op == "direct" else {"expected_o": o, "expected_final_state": S}
    if op in BUFFER_OPS:
        like = {"k": t["buffer_k"], "v": t["buffer_v"], "g": t["buffer_g"]}
    else:
        like = {"k": t["q"], "v": t["v"], "g": t["g"]}
    if op == "prefill":
        B, T = t["q"].shape[:2]
        C = int(params["capacity"])
        tail = int(params["tail_resolved"])
        h0 = t.get("initial_state")
        reqs = [_Request(None if h0 is None else h0[b], scale) for b in range(B)]
        o = torch.stack([torch.stack([r.push(_tok(t, b, i)) for i in range(T)]) for b, r in enumerate(reqs)])
        for r in reqs:
            r.fold(T - tail)
        return {"expected_o": o} | _export(reqs, like, C, "expected_")
    C = int(params["capacity"])
    reqs = _requests_from_buffer(t, scale)
    if op == "flush":
        for b, r in enumerate(reqs):
            r.fold(int(t["count"][b]) if "count" in t else len(r.entries))
        return _export(reqs, like, C, "expected_")
    if op == "decode":
        o = torch.zeros_like(t["v"])
        for j in range(t["v"].shape[1]):
            for b, r in enumerate(reqs):
                if len(r.entries) == C:
                    r.fold(C)
                o[b, j] = r.push(_tok(t, b, j))
        return {"expected_o": o} | _export(reqs, like, C, "expected_")
    if op in ("verify_chain", "verify_tree"):
        o = torch.zeros_like(t["v"])
        parents = t["parents"]
        for b, r in enumerate(reqs):
            nd = int(t["num_drafts"][b])
            after: list[torch.Tensor] = []
            for i in range(nd):  # parents precede children: one recurrence step per node
                p = int(parents[b, i])
                o[b, i], S, _ = r.step(r.current if p < 0 else after[p], _tok(t, b, i))
                after.append(S)
            node = int(t["counts"][b]) - 1 if op == "verify_chain" else int(t["nodes"][b])
            path = _path_to(parents[b].tolist(), node)
            n_old = len(r.entries)
            for i in path:
                r.push(_tok(t, b, i))
            r.fold(fold_count(n_old, len(path), C))
        return {"expected_o": o} | _export(reqs, like, C, "expected_")
    raise ValueError(f"op: unknown operation {op!r}, expected one of {OPS}")


# ------------------------------------------------------------------------------------------ runs
def _make_buffer(t: dict, form: str, impl) -> KVBuffer:
    cls = getattr(impl, "KVBuffer", KVBuffer)
    kw = {f: t["buffer_" + f] for f in ("k", "lengths", "has_state") + _FORM_FIELDS[form]}
    return cls(state=t.get("buffer_state"), **kw)  # no buffer_state tensor: a buffer without state storage


def _buffer_out(buf, state, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {f"{prefix}buffer_{f}": getattr(buf, f) for f in BUFFER_FIELDS if getattr(buf, f, None) is not None}
    out[f"{prefix}state"] = state
    return out


def run_case(case: GoldenCase, impl=None, *, dtype: torch.dtype = torch.float64, form: str = "u"
             ) -> dict[str, torch.Tensor]:
    """Run ``case`` through ``impl`` (default ``kvbuffer_ref``) with its floating inputs in ``dtype``.

    Buffered operations start from the case's buffer in ``form`` ("u" or "raw").  Returns the
    outputs under the names of the expected tensors (``expected_o`` -> ``o``, ...), without the prefix.
    """
    if impl is None:
        import kvbuffer_ref as impl
    if form not in _FORM_FIELDS:
        raise ValueError(f"form: expected 'u' or 'raw', got {form!r}")
    t = _torch_arrays(case.inputs, dtype)
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


def _history_gates(case: GoldenCase) -> torch.Tensor:
    """All log-gates behind a case's outputs ([B, n, HV]*: buffered entries then tokens; padding as 0),
    for the gate-span term of the tolerance rule."""
    parts = [case.arrays[n] for n in ("buffer_g", "g") if n in case.arrays]
    return torch.nan_to_num(torch.from_numpy(np.concatenate(parts, axis=1)), nan=0.0)


def check_case(case: GoldenCase, impl=None, *, dtype: torch.dtype = torch.float64, form: str = "u",
               raise_errors: bool = False) -> CaseReport:
    """Run ``case`` through ``impl`` and compare every output with the stored float64 truth.

    Exact fields (buffer lengths, has_state) must match exactly; floating fields pass under the
    tolerance table (``kvbuffer_ref.testing.TOLERANCES``) for ``dtype``; buffer entries are compared
    only in used slots (slot < expected length), the stale state only where a state is owned.
    Exceptions are reported (``error``) unless ``raise_errors``.
    """
    rep = CaseReport(case.id, case.op, form if case.op in BUFFER_OPS + ("prefill",) else "-", dtype)
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
        base = {n[len("expected_"):]: x for n, x in truth(case.op, case.params, case.inputs, dtype).items()}
    gates = _history_gates(case)
    skip = {"u": ("v", "g", "beta"), "raw": ("u", "G")}[form]
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
                                       dtype=dtype, head_axis=_head_axis(name), valid=valid, g=gates))
    return rep


def check(impl=None, *, path=None, cases: Optional[Sequence[GoldenCase]] = None,
          ops: Optional[Iterable[str]] = None, dtype: torch.dtype = torch.float64,
          forms: Sequence[str] = ("u", "raw")) -> list[CaseReport]:
    """Check ``impl`` (default ``kvbuffer_ref``) on the golden cases; one report per case and buffer form.

    ``forms`` applies to the buffered operations and prefill (non-buffered ops run once).  Example::

        from kvbuffer_ref import golden
        reports = golden.check(my_impl, ops=["recurrent", "chunk"], dtype=torch.float32)
        assert all(r.passed for r in reports), "\\n".join(str(r) for r in reports if not r.passed)
    """
    if cases is None:
        cases = load_cases(path, ops=ops)
    elif ops is not None:
        cases = [c for c in cases if c.op in set(ops)]
    reports = []
    for c in cases:
        for form in (forms if c.op in BUFFER_OPS + ("prefill",) else ("u",)):
            reports.append(check_case(c, impl, dtype=dtype, form=form))
    return reports
