"""Bad and edge inputs for every public entry point of kvbuffer_ref and kvbuffer_fast, as probes.

A probe builds its inputs, calls one function and passes when

* the call raises ``ValueError`` or ``TypeError`` whose message names the argument (``expect="error"``;
  ``NotImplementedError`` only where a probe allows it: kvbuffer_fast and the raw buffer form), or
* the call returns the exact answer (``expect="exact"``): the float64 oracle's, through the error
  table's ``compare`` (``kvbuffer.validate``), and
* no input was modified: every tensor reachable from the arguments is cloned before the call and
  compared after it (bit for bit, NaN equal to NaN).  kvbuffer_fast's in-place arguments (its
  buffers, ``recurrent_decode``'s and ``per_draft_state_accept``'s state) may change only when the
  call succeeds.

Library outputs start as NaN (``KVBUFFER_POISON=1``, tests/conftest.py) and so does the buffer memory
no kernel may read (``poison_unused_``).  Probes marked ``crashy`` (values that would index out of
bounds if unchecked) run in a subprocess (``run_batch``), so a crash counts as a failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from dataclasses import dataclass, fields, is_dataclass
from typing import Callable, Optional

import numpy as np
import torch

if not torch.cuda.is_available():  # before triton is imported (tests/conftest.py does this too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVBUFFER_POISON", "1")

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_fast.baselines as base  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_ref import Drafts, KVBuffer  # noqa: E402
from kvbuffer_ref.checks import RESET_GATE  # noqa: E402
from kvbuffer.validate import Case, compare, upcast_inputs  # noqa: E402
from kvbuffer.validate.tolerances import compute_dtype  # noqa: E402
from kvbuffer.validate.properties import (FORM_CHUNK, buffer_to, poison_unused_, ragged_buffer,  # noqa: E402
                                              truth_and_baseline)

F32, F64 = torch.float32, torch.float64
NAN, INF = float("nan"), float("inf")
B, T, H, HV, K, V = 2, 3, 1, 2, 5, 3  # small, odd sizes; HV / H = 2
C, P = 2, 3  # buffer capacity and history: lengths [2, 1], both requests own a state


# ------------------------------------------------------------------------------------------ inputs
def tokens(dtype=F32, *, B=B, T=T, H=H, HV=HV, K=K, V=V, channel=False, seed=0) -> dict:
    return Case(B=B, T=T, H=H, HV=HV, K=K, V=V, seed=seed, channel_gate=channel).inputs(dtype)


def buffer(dtype=F32, *, lengths=(2, 1), form="u", channel=False, with_state=True) -> KVBuffer:
    """A buffer after a history of P tokens per request (its own inputs: seed 1), NaN where unused."""
    hist = tokens(F64, B=len(lengths), T=P, channel=channel, seed=1)
    buf = buffer_to(ragged_buffer(hist, list(lengths), C, form, compute_dtype(dtype)), dtype=dtype)
    if not with_state:
        buf = buf.replace(state=None, has_state=torch.zeros_like(buf.has_state))
    return poison_unused_(buf)


def one(x: dict, t: int = 0) -> dict:
    return {n: a[:, t:t + 1] for n, a in x.items()}


def f64(x: dict) -> dict:
    return upcast_inputs(x)


# ------------------------------------------------------------------------------------ the machinery
@dataclass
class Setup:
    fn: Callable
    kwargs: dict
    check: Optional[Callable] = None  # result -> list of Comparison (or raises AssertionError)


@dataclass
class Probe:
    id: str
    make: Callable[[], Setup]
    expect: str  # "error" or "exact"
    arg: Optional[str | tuple] = None  # the argument (or all of the arguments) an error must name
    inplace: tuple = ()  # kwargs a successful call may modify (kvbuffer_fast's in-place arguments)
    crashy: bool = False
    not_implemented: bool = False  # NotImplementedError (naming ``arg``) is a pass


def _tensors(obj, path="") -> dict:
    """{path: tensor} of every tensor reachable from obj (dicts, lists, tuples, dataclasses)."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{path}[{i}]"))
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            out.update(_tensors(getattr(obj, f.name), f"{path}.{f.name}"))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta":
        return a.shape == b.shape and a.dtype == b.dtype
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _snapshot(kwargs: dict) -> dict:
    return {p: (t, t.clone()) for p, t in _tensors(kwargs).items()}


def _modified(snap: dict, allowed: tuple) -> list:
    return [p for p, (t, c) in snap.items() if not _same(t, c) and p.split(".")[0].split("[")[0] not in allowed]


def names_argument(msg: str, arg: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(arg)}(?![\w])", msg) is not None


def run_probe(p: Probe) -> tuple[bool, str]:
    """(passed, what happened)."""
    try:
        s = p.make()
    except Exception as e:  # pragma: no cover - a broken probe
        return False, f"probe setup failed: {type(e).__name__}: {e}"
    snap = _snapshot(s.kwargs)
    try:
        result = s.fn(**s.kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        if isinstance(e, NotImplementedError) and not p.not_implemented:
            return False, f"raised NotImplementedError: {e}"
        changed = _modified(snap, ())
        if changed:
            return False, f"raised {type(e).__name__} but modified {changed} first: {e}"
        if p.expect != "error":
            return False, f"expected the exact answer, raised {type(e).__name__}: {e}"
        if p.arg and not all(names_argument(str(e), a) for a in ((p.arg,) if isinstance(p.arg, str) else p.arg)):
            return False, f"the {type(e).__name__} does not name {p.arg!r}: {e}"
        return True, f"{type(e).__name__}: {e}"
    except Exception as e:
        return False, f"raised {type(e).__name__} (not a ValueError / TypeError): {e}\n{traceback.format_exc(limit=3)}"
    changed = _modified(snap, p.inplace)
    if changed:
        return False, f"modified its inputs {changed}"
    if p.expect != "exact":
        return False, f"expected a ValueError / TypeError naming {p.arg!r}, got a result"
    try:
        comps = s.check(result) if s.check else []
    except AssertionError as e:
        return False, f"wrong answer: {e}"
    except Exception as e:
        return False, f"checking the answer raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    bad = [str(c) for c in comps if not c.passed]
    if bad:
        return False, "wrong answer: " + "; ".join(bad)
    return True, f"exact ({len(comps)} comparisons)"


# --------------------------------------------------------------------------------- exact answers
def _cmp(actual, truth, baseline, dtype, **kw):
    """``compare`` of ``actual`` with the float64 ``truth``; ``baseline``: one baseline form or a list of them
    (each slice takes the worst), ignored for float64."""
    assert tuple(actual.shape) == tuple(truth.shape), f"shape {list(actual.shape)}, expected {list(truth.shape)}"
    truth = truth.to(F64)  # a 16-bit stored state's truth is its float64 value
    bases = [] if baseline is None else [baseline] if isinstance(baseline, torch.Tensor) else list(baseline)
    bases = [b.float() if torch.finfo(b.dtype).bits == 16 else b for b in bases if b is not None]
    if actual.numel() == 0:  # an empty answer (B = 0 or T = 0) is exact when its shape is
        return compare(actual.new_zeros(1, 1, 1, 1).double(), truth.new_zeros(1, 1, 1, 1), dtype=F64)
    return compare(actual, truth, None if dtype == F64 or not bases else bases, dtype=dtype, **kw)


def own_chunk(op: str, kw: dict, x: dict) -> Optional[int]:
    """The chunk of ``op``'s cumulative gates (``truth_and_baseline(chunk=)``): None for the stepwise operations
    (recurrent, recurrent_decode, per_draft_state_verify), chunk_size for chunk, the whole sequence for direct."""
    if "chunk_gated_delta_rule" in op:
        return int(kw.get("chunk_size", 64))
    if "direct_gated_delta_rule" in op:
        return max(1, int(x["q"].shape[1]))
    return None


def recurrence_check(x: dict, dtype, *, initial_state=None, final=None, scale=None, chunk=None):
    """The outputs (and the final state, ``final``: result -> state) against the float64 recurrence; the
    baseline: the correct forms on the inputs in ``dtype`` (``truth_and_baseline``: the recurrence, and for
    an operation with cumulative gates over chunks of ``chunk`` tokens the chunkwise form too)."""
    def check(result):
        o = result[0] if isinstance(result, tuple) else result
        S0 = None if initial_state is None else initial_state.to(F64)
        o64, S64 = ref.recurrent_gated_delta_rule(**f64(x), initial_state=S0, output_final_state=True, scale=scale)
        ob = Sb = None
        if dtype != F64 and x["q"].shape[1] > 0:  # (no tokens: an empty answer, nothing to compare)
            xb = {n: a.to(dtype) for n, a in x.items()}
            _, (ob, Sb) = truth_and_baseline(xb, None if S0 is None else S0.to(F32), scale=scale, chunk=chunk)
        comps = [_cmp(o, o64, ob, dtype, name="o")]
        if final is not None:
            comps.append(_cmp(final(result), S64, Sb, dtype if dtype == F64 else F32, name="state", head_axis=1))
        return comps
    return check


def buffer_check(x: Optional[dict], buf_before: KVBuffer, op: str, dtype, **op_kw):
    """An output and the buffer after a buffer operation against the float64 oracle's same operation on
    float64 copies (its forms are exact: tests/property)."""
    sdt = dtype if dtype == F64 else F32  # the state's row of the table: the coarser of it and the storage's
    if buf_before.state is not None and torch.finfo(buf_before.state.dtype).eps > torch.finfo(sdt).eps:
        sdt = buf_before.state.dtype

    # a 16-bit state is a stored precision: the oracle keeps it (and so rounds it where it folds); the baseline
    # is kvbuffer_ref's same call on the same low-precision buffer (its own form), the outputs judged by their dtype
    low = None if buf_before.state is None or torch.finfo(buf_before.state.dtype).bits > 16 else buf_before.state.dtype
    odt = dtype

    def check(result):
        b64 = buffer_to(buf_before, dtype=F64, state_dtype=low)
        bb = buffer_to(buf_before, dtype=F32 if dtype != F64 else F64, state_dtype=low)
        comps = []
        if op == "materialize_state":
            want, base_ = ref.materialize_state(b64), ref.materialize_state(bb)
            return [_cmp(result, want, base_, sdt, name="state", head_axis=1)]
        if op == "flush":
            got, want, base_ = result, ref.flush(b64, **op_kw), ref.flush(bb, **op_kw)
        else:
            xs = {n: a.to(dtype) for n, a in x.items()}
            fn = getattr(ref, op)
            o, got = result
            o64, want = fn(**f64(x), buffer=b64, **op_kw)
            ob, base_ = fn(**xs, buffer=bb, **op_kw)
            valid = None
            if op == "verify":
                got = None
                nd = op_kw.get("num_drafts")
                if nd is not None:
                    valid = (torch.arange(x["q"].shape[1])[None, :] < nd[:, None])[:, :, None, None]
            comps.append(_cmp(o, o64, ob, odt, name="o", valid=valid))
        if got is not None:
            assert torch.equal(got.lengths, want.lengths), f"lengths {got.lengths.tolist()}, expected {want.lengths.tolist()}"
            # all three materialized without a final rounding to a 16-bit state's dtype (like with like)
            comps.append(_cmp(ref.materialize_state(buffer_to(got, dtype=F64)), ref.materialize_state(buffer_to(want, dtype=F64)),
                              ref.materialize_state(buffer_to(base_, dtype=base_.k.dtype)), sdt, name="state", head_axis=1))
        return comps
    return check


def accept_check(buf_before: KVBuffer, x: dict, dtype, verify_kw: dict, **accept_kw):
    def check(result):
        b64 = buffer_to(buf_before, dtype=F64)
        _, d64 = ref.verify(**f64(x), buffer=b64, **verify_kw)
        want = ref.accept(b64, d64, **accept_kw)
        bb = buffer_to(buf_before, dtype=F32)
        _, db = ref.verify(**{n: a.float() for n, a in x.items()}, buffer=bb, **verify_kw)
        base_ = ref.accept(bb, db, **accept_kw)
        assert torch.equal(result.lengths, want.lengths), f"lengths {result.lengths.tolist()}, expected {want.lengths.tolist()}"
        return [_cmp(ref.materialize_state(buffer_to(result, dtype=F64)), ref.materialize_state(want),
                     ref.materialize_state(base_), dtype if dtype == F64 else F32, name="state", head_axis=1)]
    return check


def empty_buffer_check(shape_k, shape_state):
    def check(result):
        assert tuple(result.k.shape) == shape_k, f"k {list(result.k.shape)}, expected {list(shape_k)}"
        assert result.state is None or tuple(result.state.shape) == shape_state
        result.check()
        return []
    return check


def copy_check(state_before, inter, counts):
    """per_draft_state_accept: state[b] <- intermediate[b, counts[b] - 1] (kept where counts[b] = 0), exactly."""
    def check(result):
        want = state_before.clone()
        for b, m in enumerate(counts):
            if m > 0:
                want[b] = inter[b, m - 1]
        assert torch.equal(result, want), "state differs from intermediate[b, counts[b] - 1]"
        return []
    return check


# ------------------------------------------------------------------------------------- the catalogue
def _recurrence(dtype, final=None, op: str = ""):
    return lambda x, kw, pre: recurrence_check(x, dtype, initial_state=pre.get("initial_state"), final=final,
                                               scale=kw.get("scale"), chunk=own_chunk(op, kw, x))


def _buffered(op, dtype):
    return lambda x, kw, pre: buffer_check(x, pre["buffer"], op, dtype, scale=kw.get("scale"),
                                           **{n: kw[n] for n in ("parents", "num_drafts") if n in kw})


def _prefill_check(dtype, materialize):
    """prefill's outputs and its buffer's state (``materialize``: kvbuffer_ref's or kvbuffer_fast's)
    against the float64 recurrence; for float32 the baseline is the correct forms in float32: the recurrence,
    the chunkwise form with chunks of max(64, capacity, chunk_size) (``truth_and_baseline``) and the same
    prefill call run by kvbuffer_ref on the inputs in float32 (its own form)."""
    def make(x, kw, pre):
        def check(result):
            o, buf = result
            o64, S64 = ref.recurrent_gated_delta_rule(**f64(x), output_final_state=True, scale=kw.get("scale"))
            bo, bS = [], []
            if dtype != F64 and x["q"].shape[1] > 0:  # (no tokens: an empty answer, nothing to compare)
                xb = {n: a.to(dtype) for n, a in x.items()}
                chunk = max(int(kw.get("capacity", 1)), int(kw.get("chunk_size", 64)))
                _, (ob, Sb) = truth_and_baseline(xb, scale=kw.get("scale"), chunk=chunk)
                own_o, own_buf = ref.prefill(**{**kw, **xb})
                bo, bS = [ob, own_o], [Sb, ref.materialize_state(own_buf)]
            return [_cmp(o, o64, bo, dtype, name="o"),
                    _cmp(materialize(buf), S64, bS, dtype, name="state", head_axis=1)]
        return check
    return make


#: name -> (function, dtype, tokens per request (None: any), extra kwargs (x -> dict), check, in-place kwargs)
TOKEN_OPS = {
    "ref.recurrent_gated_delta_rule": (ref.recurrent_gated_delta_rule, F64, None,
                                       lambda x: dict(output_final_state=True), _recurrence(F64, lambda r: r[1], "ref.recurrent_gated_delta_rule"), ()),
    "ref.chunk_gated_delta_rule": (ref.chunk_gated_delta_rule, F64, None,
                                   lambda x: dict(output_final_state=True, chunk_size=2),
                                   _recurrence(F64, lambda r: r[1], "ref.chunk_gated_delta_rule"), ()),
    "ref.direct_gated_delta_rule": (ref.direct_gated_delta_rule, F64, None, lambda x: {}, _recurrence(F64, None, "ref.direct_gated_delta_rule"), ()),
    "ref.buffered_decode": (ref.buffered_decode, F64, 1, lambda x: dict(buffer=buffer(F64)),
                            _buffered("buffered_decode", F64), ()),
    "ref.verify": (ref.verify, F64, None, lambda x: dict(buffer=buffer(F64)), _buffered("verify", F64), ()),
    "ref.prefill": (ref.prefill, F64, None, lambda x: dict(capacity=C), _prefill_check(F64, ref.materialize_state), ()),
    "fast.recurrent_gated_delta_rule": (fast.recurrent_gated_delta_rule, F32, None,
                                        lambda x: dict(output_final_state=True), _recurrence(F32, lambda r: r[1], "fast.recurrent_gated_delta_rule"), ()),
    "fast.baselines.recurrent_decode": (base.recurrent_decode, F32, None,
                                        lambda x: dict(state=_state(x)), None, ("state",)),
    "fast.baselines.per_draft_state_verify": (base.per_draft_state_verify, F32, None,
                                              lambda x: dict(state=_state(x)), None, ()),
    "fast.buffered_decode": (fast.buffered_decode, F32, 1, lambda x: dict(buffer=buffer(F32)),
                             _buffered("buffered_decode", F32), ("buffer",)),
    "fast.verify": (fast.verify, F32, None, lambda x: dict(buffer=buffer(F32)), _buffered("verify", F32), ()),
    "fast.chunk_gated_delta_rule": (fast.chunk_gated_delta_rule, F32, None,
                                    lambda x: dict(output_final_state=True, chunk_size=16),
                                    _recurrence(F32, lambda r: r[1], "fast.chunk_gated_delta_rule"), ()),
    "fast.direct_gated_delta_rule": (fast.direct_gated_delta_rule, F32, None, lambda x: {}, _recurrence(F32, None, "fast.direct_gated_delta_rule"), ()),
    "fast.prefill": (fast.prefill, F32, None, lambda x: dict(capacity=C),
                     _prefill_check(F32, fast.materialize_state), ()),
}


def _state(x):
    try:
        Bx, HVx, Kx, Vx = x["q"].shape[0], x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
    except (AttributeError, IndexError):  # a probe that breaks q or v: any state will do
        Bx, HVx, Kx, Vx = B, HV, K, V
    gen = torch.Generator().manual_seed(5)
    return (0.3 * torch.randn(Bx, HVx, Kx, Vx, generator=gen)).float()


def _state_check(op):
    def make(x, kw, pre):
        if op == "fast.baselines.recurrent_decode":
            return recurrence_check(x, F32, initial_state=pre["state"], final=lambda r: kw["state"], scale=kw.get("scale"))
        return recurrence_check(x, F32, initial_state=pre["state"], scale=kw.get("scale"),
                                final=(lambda r: r[1][:, -1]) if x["q"].shape[1] else None)
    return make


def token_probe(op: str, pid: str, expect: str, arg=None, *, x_fn=None, over=None, crashy=False,
                not_implemented=False, inplace=None) -> Probe:
    """A probe of token operation ``op``: inputs ``x_fn(x)`` (default: the op's own), kwargs ``over(x, kw)``."""
    fn, dtype, T1, extra, check, own_inplace = TOKEN_OPS[op]
    inplace = own_inplace if inplace is None else inplace
    if check is None:
        check = _state_check(op)

    def make():
        x = tokens(dtype, T=T1 or T)
        if x_fn is not None:
            x = x_fn(x)
        kw = dict(x)
        kw.update(extra(x))
        if over is not None:
            kw = over(x, kw)
        pre = {n: (KVBuffer(**kw[n].cloned()) if isinstance(kw[n], KVBuffer) else kw[n].clone())
               for n in ("buffer", "state", "initial_state") if isinstance(kw.get(n), (KVBuffer, torch.Tensor))}
        return Setup(fn, kw, check(x, kw, pre) if expect == "exact" else None)

    return Probe(f"{op}/{pid}", make, expect, arg, inplace=inplace, crashy=crashy, not_implemented=not_implemented)


def _set(name, value):
    def over(x, kw):
        kw = dict(kw)
        kw[name] = value(kw[name]) if callable(value) else value
        return kw
    return over


def _edit(name, f):
    def x_fn(x):
        x = dict(x)
        x[name] = f(x[name].clone())
        return x
    return x_fn


def _put(idx, value):
    def f(a):
        a[idx] = value
        return a
    return f


def _dims(**cut):
    """Inputs with some sizes cut: K=0, H=0, HV=0, V=0, HV=3 over H=2, B=0, T=0."""
    def x_fn(x):
        x = dict(x)
        if "K" in cut:
            x["q"], x["k"] = x["q"][..., :0], x["k"][..., :0]
            if x["g"].dim() == 4:
                x["g"] = x["g"][..., :0]
        if "H" in cut:
            x["q"], x["k"] = x["q"][:, :, :0], x["k"][:, :, :0]
        if "HV" in cut:
            n = cut["HV"]
            x["v"], x["g"], x["beta"] = x["v"][:, :, :n], x["g"][:, :, :n], x["beta"][:, :, :n]
        if "V" in cut:
            x["v"] = x["v"][..., :0]
        if "B" in cut:
            x = {n: a[:0] for n, a in x.items()}
        if "T" in cut:
            x = {n: a[:, :0] for n, a in x.items()}
        return x
    return x_fn


def _two_heads(x):
    """H = 2 q/k heads with HV = 3 value heads (not a multiple)."""
    x = dict(x)
    x["q"], x["k"] = torch.cat([x["q"], x["q"]], 2), torch.cat([x["k"], x["k"]], 2)
    x["v"], x["g"], x["beta"] = (torch.cat([a, a[:, :, :1]], 2) for a in (x["v"], x["g"], x["beta"]))
    return x


def _per_channel_reset(dtype, Tx):
    """Per-channel (KDA) gates with a full reset (-inf) in some channels of the first token."""
    def x_fn(_):
        x = tokens(dtype, T=Tx, channel=True)
        x["g"][:, 0, :, ::2] = -INF
        return x
    return x_fn


def _per_channel_buffer(dtype):
    def over(x, kw):
        kw = dict(kw)
        if "buffer" in kw:
            kw["buffer"] = buffer(dtype, channel=True)
        return kw
    return over


def _strided(a):
    """The same values, not contiguous (every other element of a wider tensor)."""
    return torch.stack([a, a], -1)[..., 0]


def _empty_buffer_over(dtype):
    def over(x, kw):
        kw = dict(kw)
        if "buffer" in kw:
            kw["buffer"] = KVBuffer.empty(0, H, HV, K, V, C, dtype=dtype)
        if "state" in kw:
            kw["state"] = _state(x)
        return kw
    return over


def token_probes() -> list:
    out = []
    for op, (fn, dtype, T1, extra, check, inplace) in TOKEN_OPS.items():
        is_fast = op.startswith("fast")
        buffered = op in ("ref.buffered_decode", "ref.verify", "fast.buffered_decode", "fast.verify")
        for a in ("q", "k", "v", "g", "beta"):
            out += [
                token_probe(op, f"{a}/not-a-tensor", "error", a, x_fn=_edit(a, lambda t: t.tolist())),
                token_probe(op, f"{a}/rank", "error", a, x_fn=_edit(a, lambda t: t[..., 0])),
                token_probe(op, f"{a}/batch+1", "error", a, x_fn=_edit(a, lambda t: torch.cat([t, t[:1]], 0))),
                token_probe(op, f"{a}/int64", "error", a, x_fn=_edit(a, lambda t: (3 * t).to(torch.int64))),
                token_probe(op, f"{a}/bool", "error", a, x_fn=_edit(a, lambda t: t > 0)),
                token_probe(op, f"{a}/device", "error", a, x_fn=_edit(a, lambda t: t.to("meta"))),
            ]
        out += [
            token_probe(op, "q/noncontiguous", "exact", x_fn=_edit("q", _strided)),
            token_probe(op, "K=0", "error", "q", x_fn=_dims(K=0)),
            token_probe(op, "H=0", "error", "q", x_fn=_dims(H=0)),
            token_probe(op, "HV=0", "error", "v", x_fn=_dims(HV=0)),
            token_probe(op, "V=0", "error", "v", x_fn=_dims(V=0)),
            token_probe(op, "HV=3,H=2", "error", "v", x_fn=_two_heads),
            token_probe(op, "B=0", "exact", x_fn=_dims(B=0),
                        over=_empty_buffer_over(dtype) if buffered or "baselines" in op else None),
            token_probe(op, "g/nan", "error", "g", x_fn=_edit("g", _put((0, 0, 1), NAN))),
            token_probe(op, "g/+inf", "error", "g", x_fn=_edit("g", _put((0, 0, 1), INF))),
            token_probe(op, "g/-inf", "exact", x_fn=_edit("g", _put((slice(None), 0), -INF))),
            token_probe(op, "g/-1e30", "exact", x_fn=_edit("g", _put((slice(None), 0), -1e30))),
            token_probe(op, "g/positive", "exact", x_fn=_edit("g", lambda t: t.abs().clamp(max=0.3))),
            token_probe(op, "g/-inf-per-channel", "exact", x_fn=_per_channel_reset(dtype, T1 or T),
                        over=_per_channel_buffer(dtype)),
            token_probe(op, "beta/1.7", "exact", x_fn=_edit("beta", lambda t: torch.full_like(t, 1.7))),
            token_probe(op, "beta/-0.4", "exact", x_fn=_edit("beta", lambda t: torch.full_like(t, -0.4))),
            token_probe(op, "beta/nan", "error", "beta", x_fn=_edit("beta", _put((1, 0, 0), NAN))),
            token_probe(op, "beta/inf", "error", "beta", x_fn=_edit("beta", _put((1, 0, 0), INF))),
            token_probe(op, "scale/0", "error", "scale", over=_set("scale", 0.0)),
            token_probe(op, "scale/-1", "error", "scale", over=_set("scale", -1.0)),
            token_probe(op, "scale/nan", "error", "scale", over=_set("scale", NAN)),
            token_probe(op, "scale/inf", "error", "scale", over=_set("scale", INF)),
            token_probe(op, "scale/bool", "error", "scale", over=_set("scale", True)),
            token_probe(op, "scale/str", "error", "scale", over=_set("scale", "0.5")),
            token_probe(op, "scale/0.7", "exact", over=_set("scale", 0.7)),
        ]
        if T1 == 1:
            out.append(token_probe(op, "T=2", "error", "q", x_fn=lambda x: {n: torch.cat([a, a], 1) for n, a in x.items()}))
            out.append(token_probe(op, "T=0", "error", "q", x_fn=_dims(T=0)))
        else:
            out.append(token_probe(op, "T=0", "exact", x_fn=_dims(T=0)))
        if not op.endswith((".direct_gated_delta_rule", ".prefill")) and not buffered and "baselines" not in op:
            out += [
                token_probe(op, "initial_state/shape", "error", "initial_state",
                            over=_set("initial_state", torch.zeros(B, HV, V, K))),
                token_probe(op, "initial_state/int64", "error", "initial_state",
                            over=_set("initial_state", torch.zeros(B, HV, K, V, dtype=torch.int64))),
                token_probe(op, "initial_state/list", "error", "initial_state",
                            over=_set("initial_state", [[0.0]])),
                token_probe(op, "initial_state/float16", "exact",
                            over=_set("initial_state", (0.3 * torch.randn(B, HV, K, V)).half())),
                token_probe(op, "initial_state/noncontiguous", "exact",
                            over=_set("initial_state", _strided(0.3 * torch.randn(B, HV, K, V, dtype=dtype)))),
            ]
        if "baselines" in op:
            out += [
                token_probe(op, "state/None", "error", "state", over=_set("state", None)),
                token_probe(op, "state/shape", "error", "state", over=_set("state", lambda s: s.transpose(2, 3).contiguous())),
                token_probe(op, "state/int64", "error", "state", over=_set("state", lambda s: s.long())),
                token_probe(op, "state/float16", "error", "state", over=_set("state", lambda s: s.half())),
                token_probe(op, "state/bfloat16", "error", "state", over=_set("state", lambda s: s.bfloat16())),
                token_probe(op, "state/float64", "error", "state", over=_set("state", lambda s: s.double())),
                token_probe(op, "state/noncontiguous", "error", "state", over=_set("state", _strided)),
            ]
        if op == "fast.baselines.per_draft_state_verify":
            out += [
                token_probe(op, "intermediate/shape", "error", "intermediate", crashy=True,
                            over=_set("intermediate", torch.zeros(B, T - 1, HV, K, V))),
                token_probe(op, "intermediate/float16", "error", "intermediate",
                            over=_set("intermediate", torch.zeros(B, T, HV, K, V, dtype=torch.float16))),
                token_probe(op, "intermediate/noncontiguous", "error", "intermediate",
                            over=_set("intermediate", _strided(torch.zeros(B, T, HV, K, V)))),
                token_probe(op, "intermediate/given", "exact", over=_set("intermediate", torch.zeros(B, T, HV, K, V)),
                            inplace=("intermediate",)),
            ]
        if buffered:
            out += buffer_probes(op, is_fast, dtype)
            if op.endswith("verify"):
                out += draft_arg_probes(op, is_fast)
    return out


# ------------------------------------------------------------------------------------------ buffers
def _hand_buffer(dtype, Cx):
    """A u-form buffer of capacity Cx built field by field (KVBuffer.empty refuses Cx < 1)."""
    return KVBuffer(k=torch.zeros(B, Cx, H, K, dtype=dtype), lengths=torch.zeros(B, dtype=torch.long),
                    state=torch.zeros(B, HV, K, V, dtype=dtype), has_state=torch.zeros(B, dtype=torch.bool),
                    u=torch.zeros(B, Cx, HV, V, dtype=dtype), G=torch.zeros(B, Cx, HV, dtype=dtype))


def _buf_edit(dtype, f, **kw):
    def make_buffer():
        return f(buffer(dtype, **kw))
    return make_buffer


def _raw_both(b):
    raw = buffer(b.values.dtype, form="raw")
    return b.replace(v=raw.v, g=raw.g, beta=raw.beta)


def buffer_variants(is_fast: bool, dtype) -> list:
    """(id, make_buffer, expect, arg, crashy, not_implemented) for a buffer argument."""
    exact_ref = "error" if is_fast else "exact"
    return [
        ("buffer/not-a-buffer", lambda: dict(buffer(dtype).tensors()), "error", "buffer", False, False),
        ("buffer/capacity-0", lambda: _hand_buffer(dtype, 0), "error", "buffer.k", True, False),
        ("buffer/lengths>C", _buf_edit(dtype, lambda b: b.replace(lengths=torch.tensor([C + 1, 1]))), "error",
         "buffer.lengths", True, False),
        ("buffer/lengths<0", _buf_edit(dtype, lambda b: b.replace(lengths=torch.tensor([-1, 1]))), "error",
         "buffer.lengths", True, False),
        ("buffer/lengths-float", _buf_edit(dtype, lambda b: b.replace(lengths=b.lengths.float())), "error",
         "buffer.lengths", False, False),
        ("buffer/has_state-int", _buf_edit(dtype, lambda b: b.replace(has_state=b.has_state.long())), "error",
         "buffer.has_state", False, False),
        ("buffer/k-int64", _buf_edit(dtype, lambda b: b.replace(k=(4 * b.k.nan_to_num()).long())), "error",
         "buffer.k", False, False),
        # a 16-bit state is stored precision in both packages (docs/kernels.md, "Reduced-precision state and
        # cache"); kvbuffer_fast's bfloat16 is checked only compiled (the Triton interpreter's bfloat16 is wrong)
        ("buffer/state-float16", _buf_edit(dtype, lambda b: b.replace(state=b.state.half())), "exact",
         "buffer.state", False, False),
    ] + ([] if is_fast and os.environ.get("TRITON_INTERPRET") == "1" else [
        ("buffer/state-bfloat16", _buf_edit(dtype, lambda b: b.replace(state=b.state.bfloat16())), "exact",
         "buffer.state", False, False),
    ]) + [
        ("buffer/state-float64", _buf_edit(dtype, lambda b: b.replace(state=b.state.double())), exact_ref,
         "buffer.state", False, False),
        ("buffer/state-noncontiguous", _buf_edit(dtype, lambda b: b.replace(state=_strided(b.state))), exact_ref,
         "buffer.state", False, False),
        ("buffer/u-noncontiguous", _buf_edit(dtype, lambda b: b.replace(u=_strided(b.u))), exact_ref,
         "buffer.u", False, False),
        ("buffer/raw-form", lambda: buffer(dtype, form="raw"), exact_ref, "buffer", False, is_fast),
        ("buffer/partial-form", _buf_edit(dtype, lambda b: b.replace(G=None)), "error", "buffer", False, False),
        ("buffer/both-forms", _buf_edit(dtype, _raw_both), "error", "buffer", False, False),
    ] + ([("buffer/G-float16", _buf_edit(dtype, lambda b: b.replace(G=b.G.half())), "error", "buffer.G", False,
           False)] if is_fast else [])  # kvbuffer_fast keeps cumulative gates in float32


def buffer_probes(op: str, is_fast: bool, dtype) -> list:
    out = []
    for pid, mk, expect, arg, crashy, ni in buffer_variants(is_fast, dtype):
        out.append(token_probe(op, pid, expect, arg, over=_set("buffer", lambda _, mk=mk: mk()), crashy=crashy and is_fast,
                               not_implemented=ni))
    other = lambda _: KVBuffer.empty(B, H, HV, K + 1, V, C, dtype=dtype)  # noqa: E731
    out.append(token_probe(op, "buffer/other-K", "error", "buffer", over=_set("buffer", other)))
    other_gate = lambda _: KVBuffer.empty(B, H, HV, K, V, C, dtype=dtype, channel_gate=True)  # noqa: E731
    out.append(token_probe(op, "buffer/per-channel-gates", "error", "g", over=_set("buffer", other_gate)))
    no_storage = lambda _: buffer(dtype, with_state=False)  # noqa: E731
    if op.endswith("buffered_decode"):  # request 0 is full and must fold
        out.append(token_probe(op, "buffer/no-state-storage-full", "error", "buffer", over=_set("buffer", no_storage)))
    else:
        out.append(token_probe(op, "buffer/no-state-storage", "exact", over=_set("buffer", no_storage)))
    return out


def draft_arg_probes(op: str, is_fast: bool) -> list:
    t = torch.tensor
    bad = [
        ("parents/out-of-range", "parents", t([[-1, 1, 0], [-1, 0, 1]]), True),
        ("parents/below-minus-1", "parents", t([[-1, -2, 0], [-1, 0, 1]]), True),
        ("parents/float", "parents", t([[-1.0, 0.0, 1.0]] * 2), False),
        ("parents/bool", "parents", t([[True, False, False]] * 2), False),
        ("parents/shape", "parents", t([-1, 0, 1]), False),
        ("num_drafts/above-D", "num_drafts", t([4, 1]), True),
        ("num_drafts/negative", "num_drafts", t([-1, 1]), True),
        ("num_drafts/float", "num_drafts", t([1.0, 1.0]), False),
        ("num_drafts/bool", "num_drafts", t([True, True]), False),
        ("num_drafts/int", "num_drafts", 2, False),
    ]
    out = [token_probe(op, pid, "error", arg, over=_set(arg, val), crashy=crashy and is_fast)
           for pid, arg, val, crashy in bad]

    def tree(x, kw):
        kw = dict(kw, parents=t([[-1, -1, 0], [-1, 0, 1]]), num_drafts=t([2, 3]))
        return kw

    def padded(x):  # request 0's third draft is padding: NaN everywhere, never read
        x = {n: a.clone() for n, a in x.items()}
        for a in x.values():
            a[0, 2] = NAN
        return x

    out.append(token_probe(op, "tree-ragged", "exact", over=tree))
    out.append(token_probe(op, "tree-ragged-nan-padding", "exact", x_fn=padded, over=tree))
    if is_fast:
        out.append(token_probe(op, "D>MAX_DRAFTS", "error", "q",
                               x_fn=lambda x: {n: a.repeat(1, 22, *([1] * (a.dim() - 2))) for n, a in x.items()}))
    return out


# --------------------------------------------------------------------------- flush, materialize_state
def buffer_only_probe(op: str, pid: str, expect: str, arg=None, *, make_buffer=None, kw=None, crashy=False,
                      not_implemented=False) -> Probe:
    pkg, name = op.split(".")
    is_fast = pkg == "fast"
    dtype = F32 if is_fast else F64
    fn = getattr(fast if is_fast else ref, name)

    def make():
        buf = make_buffer() if make_buffer is not None else buffer(dtype)
        kwargs = dict(buffer=buf, **(kw or {}))
        check = None
        if expect == "exact":
            before = KVBuffer(**buf.cloned())
            check = buffer_check(None, before, name, dtype, **(kw or {}))
        return Setup(fn, kwargs, check)

    return Probe(f"{op}/{pid}", make, expect, arg, inplace=("buffer",) if is_fast and name == "flush" else (),
                 crashy=crashy, not_implemented=not_implemented)


def flush_probes() -> list:
    out = []
    for op in ("ref.flush", "ref.materialize_state", "fast.flush", "fast.materialize_state"):
        is_fast = op.startswith("fast")
        dtype = F32 if is_fast else F64
        for pid, mk, expect, arg, crashy, ni in buffer_variants(is_fast, dtype):
            if op == "fast.materialize_state" and pid.endswith("noncontiguous"):
                expect = "exact"  # it works on a copy of the buffer: nothing is updated in place
            out.append(buffer_only_probe(op, pid, expect, arg, make_buffer=mk, crashy=crashy and is_fast,
                                         not_implemented=ni))
        out += [
            buffer_only_probe(op, "buffer/B=0", "exact", make_buffer=lambda dt=dtype: KVBuffer.empty(0, H, HV, K, V, C, dtype=dt)),
            buffer_only_probe(op, "buffer/no-state-storage", "exact", make_buffer=lambda dt=dtype: buffer(dt, with_state=False)),
            buffer_only_probe(op, "buffer/per-channel", "exact", make_buffer=lambda dt=dtype: buffer(dt, channel=True)),
        ]
        if op.endswith("flush"):
            t = torch.tensor
            counts = [
                ("count/-1", -1, "error", True), ("count/above-length", 2, "error", True),
                ("count/bool", True, "error", False), ("count/float", 1.5, "error", False),
                ("count/huge", 2 ** 70, "error", False), ("count/huge-tensor", t([2 ** 40, 0]), "error", True),
                ("count/float-tensor", t([1.0, 0.0]), "error", False), ("count/bool-tensor", t([True, False]), "error", False),
                ("count/shape", t([1]), "error", False), ("count/list", [1, 0], "error", False),
                ("count/0", 0, "exact", False), ("count/1", 1, "exact", False), ("count/tensor", t([2, 0]), "exact", False),
            ]
            for pid, c, expect, crashy in counts:
                out.append(buffer_only_probe(op, pid, expect, "count", kw=dict(count=c), crashy=crashy and is_fast))
    return out


# -------------------------------------------------------------------------------------------- accept
def accept_probe(op: str, pid: str, expect: str, arg=None, *, counts=None, nodes=None, tree=False, drafts_fn=None,
                 make_buffer=None, crashy=False, not_implemented=False) -> Probe:
    is_fast = op.startswith("fast")
    dtype = F32 if is_fast else F64
    pkg = fast if is_fast else ref

    def make():
        buf = make_buffer() if make_buffer is not None else buffer(dtype)
        x = tokens(dtype, seed=2)
        vkw = dict(parents=torch.tensor([[-1, -1, 0], [-1, 0, 1]])) if tree else {}
        # the drafts of an exact probe come from the package's own verify; an error probe's from the oracle's
        # (the same u-cache Drafts, much faster than the Triton interpreter)
        _, drafts = (pkg if expect == "exact" else ref).verify(**x, buffer=buf, **vkw)
        if drafts_fn is not None:
            drafts = drafts_fn(drafts)
        kw = dict(buffer=buf, drafts=drafts)
        if counts is not None:
            kw["counts"] = counts
        if nodes is not None:
            kw["nodes"] = nodes
        check = None
        if expect == "exact":
            check = accept_check(KVBuffer(**buf.cloned()), x, dtype, vkw,
                                 **{n: kw[n] for n in ("counts", "nodes") if n in kw})
        return Setup(pkg.accept, kw, check)

    return Probe(f"{op}/{pid}", make, expect, arg, inplace=("buffer",) if is_fast else (), crashy=crashy,
                 not_implemented=not_implemented)


def accept_probes() -> list:
    t = torch.tensor
    out = []
    for op in ("ref.accept", "fast.accept"):
        f = op.startswith("fast")
        dtype = F32 if f else F64
        out += [
            accept_probe(op, "counts/above-num_drafts", "error", "counts", counts=4, crashy=f),
            accept_probe(op, "counts/-1", "error", "counts", counts=-1, crashy=f),
            accept_probe(op, "counts/bool", "error", "counts", counts=True),
            accept_probe(op, "counts/float", "error", "counts", counts=1.5),
            accept_probe(op, "counts/huge", "error", "counts", counts=2 ** 70),
            accept_probe(op, "counts/huge-tensor", "error", "counts", counts=t([2 ** 40, 0]), crashy=f),
            accept_probe(op, "counts/float-tensor", "error", "counts", counts=t([1.0, 1.0])),
            accept_probe(op, "counts/bool-tensor", "error", "counts", counts=t([True, False])),
            accept_probe(op, "counts/shape", "error", "counts", counts=t([1, 1, 1])),
            accept_probe(op, "counts/on-a-tree", "error", "counts", counts=2, tree=True),
            accept_probe(op, "nodes/above", "error", "nodes", nodes=3, tree=True, crashy=f),
            accept_probe(op, "nodes/-2", "error", "nodes", nodes=-2, tree=True, crashy=f),
            accept_probe(op, "nodes/bool", "error", "nodes", nodes=True, tree=True),
            accept_probe(op, "nodes/float-tensor", "error", "nodes", nodes=t([0.0, 1.0]), tree=True),
            accept_probe(op, "counts-and-nodes", "error", "counts", counts=1, nodes=0),
            accept_probe(op, "neither", "error", "counts"),
            accept_probe(op, "drafts/not-drafts", "error", "drafts", counts=1, drafts_fn=lambda d: d.tensors()),
            accept_probe(op, "drafts/other-K", "error", "drafts", counts=1,
                         drafts_fn=lambda d: d.__class__(**{**d.tensors(), "k": torch.cat([d.k, d.k[..., :1]], -1)})),
            accept_probe(op, "buffer/no-state-storage-overflow", "error", "buffer", counts=2,
                         make_buffer=lambda dt=dtype: buffer(dt, with_state=False)),
            accept_probe(op, "counts/0", "exact", counts=0),
            accept_probe(op, "counts/2", "exact", counts=2),
            accept_probe(op, "counts/tensor-fold", "exact", counts=t([3, 0])),
            accept_probe(op, "nodes/tree", "exact", nodes=t([2, -1]), tree=True),
            accept_probe(op, "nodes/-1", "exact", nodes=-1, tree=True),
        ]
        if f:
            out += [
                accept_probe(op, "drafts/num_drafts-above-D", "error", "drafts.num_drafts", nodes=t([2, 0]), tree=True,
                             drafts_fn=lambda d: d.__class__(**{**d.tensors(), "num_drafts": t([9, 9])}), crashy=True),
                accept_probe(op, "drafts/parents-out-of-range", "error", "drafts.parents", nodes=t([2, 0]), tree=True,
                             drafts_fn=lambda d: d.__class__(**{**d.tensors(), "parents": t([[-1, 5, 7], [-1, 0, 1]])}),
                             crashy=True),
                accept_probe(op, "drafts/raw-form", "error", "drafts", counts=1, not_implemented=True,
                             drafts_fn=lambda d: Drafts(parents=d.parents, num_drafts=d.num_drafts, k=d.k, v=d.u,
                                                        g=d.G, beta=d.G)),
            ]
    return [p for p in out if p is not None]


# ------------------------------------------------------------------------------ prefill, KVBuffer.empty
def call_probe(pid: str, fn, kwargs_fn, expect: str, arg=None, check=None, crashy=False, inplace=()) -> Probe:
    def make():
        kw = kwargs_fn()
        return Setup(fn, kw, check(kw) if check is not None and expect == "exact" else None)
    return Probe(pid, make, expect, arg, crashy=crashy, inplace=inplace)


def prefill_probes() -> list:
    def kw(**over):
        return lambda: {**tokens(F64), "capacity": C, **over}

    def chk(kwargs):
        x = {n: kwargs[n] for n in ("q", "k", "v", "g", "beta")}
        return _prefill_check(F64, ref.materialize_state)(x, kwargs, {})

    p = "ref.prefill"
    return [
        call_probe(f"{p}/capacity/0", ref.prefill, kw(capacity=0), "error", "capacity"),
        call_probe(f"{p}/capacity/-1", ref.prefill, kw(capacity=-1), "error", "capacity"),
        call_probe(f"{p}/capacity/bool", ref.prefill, kw(capacity=True), "error", "capacity"),
        call_probe(f"{p}/capacity/float", ref.prefill, kw(capacity=2.0), "error", "capacity"),
        call_probe(f"{p}/tail/-1", ref.prefill, kw(tail=-1), "error", "tail"),
        call_probe(f"{p}/tail/above", ref.prefill, kw(tail=3), "error", "tail"),
        call_probe(f"{p}/tail/bool", ref.prefill, kw(tail=True), "error", "tail"),
        call_probe(f"{p}/form", ref.prefill, kw(form="x"), "error", "form"),
        call_probe(f"{p}/chunk_size/0", ref.prefill, kw(chunk_size=0), "error", "chunk_size"),
        call_probe(f"{p}/initial_state/shape", ref.prefill, kw(initial_state=torch.zeros(B, HV, V, K, dtype=F64)),
                   "error", "initial_state"),
        call_probe(f"{p}/tail/0", ref.prefill, kw(tail=0), "exact", check=chk),
        call_probe(f"{p}/raw", ref.prefill, kw(form="raw"), "exact", check=chk),
    ]


def empty_probes() -> list:
    E = KVBuffer.empty
    args = dict(batch=B, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, capacity=C)

    def kw(**over):
        return lambda: {**args, **over}

    p = "KVBuffer.empty"
    bad = [("capacity/0", dict(capacity=0), "capacity"), ("capacity/-1", dict(capacity=-1), "capacity"),
           ("capacity/bool", dict(capacity=True), "capacity"), ("capacity/float", dict(capacity=2.0), "capacity"),
           ("batch/-1", dict(batch=-1), "batch"), ("batch/float", dict(batch=1.5), "batch"),
           ("num_heads/0", dict(num_heads=0), "num_heads"),
           ("num_value_heads/0", dict(num_value_heads=0), "num_value_heads"),
           ("num_value_heads/3-over-2", dict(num_heads=2, num_value_heads=3), "num_value_heads"),
           ("head_k_dim/0", dict(head_k_dim=0), "head_k_dim"), ("head_v_dim/0", dict(head_v_dim=0), "head_v_dim"),
           ("head_k_dim/bool", dict(head_k_dim=True), "head_k_dim"),
           ("dtype/int64", dict(dtype=torch.int64), "dtype"), ("key_dtype/bool", dict(key_dtype=torch.bool), "key_dtype"),
           ("state_dtype/str", dict(state_dtype="float32"), "state_dtype"), ("form", dict(form="x"), "form")]
    out = [call_probe(f"{p}/{pid}", E, kw(**o), "error", arg) for pid, o, arg in bad]
    out.append(call_probe(f"{p}/batch/0", E, kw(batch=0), "exact",
                          check=lambda _: empty_buffer_check((0, C, H, K), (0, HV, K, V))))
    out.append(call_probe(f"{p}/raw-no-state", E, kw(form="raw", with_state=False), "exact",
                          check=lambda _: empty_buffer_check((B, C, H, K), None)))
    return out


def per_draft_accept_probes() -> list:
    t = torch.tensor
    gen = torch.Generator().manual_seed(7)
    S = torch.randn(B, HV, K, V, generator=gen)
    I_ = torch.randn(B, T, HV, K, V, generator=gen)

    def kw(**over):
        return lambda: {"state": S.clone(), "intermediate": I_.clone(), "counts": t([3, 0]), **over}

    def chk(counts):
        return lambda kwargs: copy_check(S, I_, counts)

    p = "fast.baselines.per_draft_state_accept"
    fn = base.per_draft_state_accept
    st = ("state",)
    return [
        call_probe(f"{p}/counts/valid", fn, kw(), "exact", check=chk([3, 0]), inplace=st),
        call_probe(f"{p}/counts/int", fn, kw(counts=2), "exact", check=chk([2, 2]), inplace=st),
        call_probe(f"{p}/counts/-1", fn, kw(counts=t([-1, 0])), "error", "counts", crashy=True, inplace=st),
        call_probe(f"{p}/counts/above-d", fn, kw(counts=T + 1), "error", "counts", crashy=True, inplace=st),
        call_probe(f"{p}/counts/huge-tensor", fn, kw(counts=t([2 ** 40, 0])), "error", "counts", crashy=True,
                   inplace=st),
        call_probe(f"{p}/counts/huge", fn, kw(counts=2 ** 70), "error", "counts", inplace=st),
        call_probe(f"{p}/counts/bool", fn, kw(counts=True), "error", "counts", inplace=st),
        call_probe(f"{p}/counts/float", fn, kw(counts=1.5), "error", "counts", inplace=st),
        call_probe(f"{p}/counts/float-tensor", fn, kw(counts=t([1.0, 0.0])), "error", "counts", inplace=st),
        call_probe(f"{p}/counts/bool-tensor", fn, kw(counts=t([True, False])), "error", "counts", inplace=st),
        call_probe(f"{p}/counts/shape", fn, kw(counts=t([1])), "error", "counts", inplace=st),
        call_probe(f"{p}/intermediate/shape", fn, kw(intermediate=I_[..., :-1].clone()), "error", "intermediate",
                   crashy=True, inplace=st),
        call_probe(f"{p}/intermediate/float16", fn, kw(intermediate=I_.half()), "error", "intermediate", inplace=st),
        call_probe(f"{p}/intermediate/list", fn, kw(intermediate=[0.0]), "error", "intermediate", inplace=st),
        call_probe(f"{p}/state/float16", fn, kw(state=S.half()), "error", "state", inplace=st),
        call_probe(f"{p}/state/bfloat16", fn, kw(state=S.bfloat16()), "error", "state", inplace=st),
        call_probe(f"{p}/state/noncontiguous", fn, kw(state=_strided(S)), "error", "state", inplace=st),
        call_probe(f"{p}/state/list", fn, kw(state=[0.0]), "error", "state", inplace=st),
        call_probe(f"{p}/B=0", fn, lambda: {"state": S[:0].clone(), "intermediate": I_[:0].clone(),
                                            "counts": t([], dtype=torch.long)}, "exact",
                   check=lambda kwargs: _shape_check((0, HV, K, V))),
    ]


def _shape_check(shape):
    def check(result):
        assert tuple(result.shape) == shape, f"shape {list(result.shape)}, expected {list(shape)}"
        return []
    return check


def _result_check(pred, what: str):
    """A check that the result satisfies ``pred`` (no comparison with the oracle: a shape or a value)."""
    def check(result):
        assert pred(result), what
        return []
    return check


def _prefill_no_prompt(pkg, dtype):
    def make():
        x = tokens(dtype, B=1, T=0)
        kw = dict(x, capacity=C, cu_seqlens=torch.tensor([0]))
        return Setup(pkg.prefill, kw, _result_check(
            lambda r: tuple(r[0].shape) == (1, 0, HV, V) and r[1].batch == 0 and r[1].state.shape[0] == 0,
            "expected o [1, 0, HV, V] and a buffer of 0 requests"))
    return make


def _pool(pkg, dtype, **over):
    kw = dict(layers=1, num_state_slots=2, num_buffer_slots=2, capacity=C, max_drafts=T, num_heads=H,
              num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=dtype)
    return pkg.KVPool(**{**kw, **over})


def _pool_verify_nan_padding(pkg, dtype):
    """A pool's verify with NaN in the padding drafts (past num_drafts) of a request: computed, equal to the
    float64 oracle pool's on the valid drafts."""
    def make():
        pool = _pool(pkg, dtype)
        s = pool.acquire(2)
        pool.admit(**tokens(dtype, T=P, seed=1), layer=0, slots=s)
        x = {n: a.clone() for n, a in tokens(dtype, seed=2).items()}
        for a in x.values():
            a[0, 1:] = NAN
        nd = torch.tensor([1, T])

        def same_calls(pkg_, dt, x_):
            twin = _pool(pkg_, dt)
            twin.admit(**{n: a.to(dt) for n, a in tokens(dtype, T=P, seed=1).items()}, layer=0, slots=twin.acquire(2))
            return twin.verify(**{n: a.to(dt) for n, a in x_.items()}, layer=0, slots=s, num_drafts=nd)

        want = same_calls(ref, F64, x)  # the float64 oracle pool: the truth
        # the baseline: the same calls run by kvbuffer_ref's pool in the compute dtype (its own form)
        own = None if dtype == F64 else same_calls(ref, F32, x)

        def check(o):
            valid = (torch.arange(T)[None, :] < nd[:, None])[:, :, None, None]
            return [_cmp(o, want, own, dtype, name="verify.o", valid=valid)]
        return Setup(pool.verify, dict(x, layer=0, slots=s, num_drafts=nd), check)
    return make


def _pool_call(pkg, dtype, op: str, **kw):
    def make():
        pool = _pool(pkg, dtype)
        s = pool.acquire(2)
        pool.admit(**tokens(dtype, T=P, seed=1), layer=0, slots=s)
        return Setup(getattr(pool, op), dict(kw, layer=0, slots=s), _result_check(lambda r: True, ""))
    return make


def edge_call_probes() -> list:
    """Scalars of NumPy types, the helpers path_to / default_tail / tp_*, prefill of no prompt, drafts
    whose own index fields are bad, pools with bad construction arguments or per-row ints, a pool's verify
    with NaN padding drafts."""
    t = torch.tensor
    out = []
    for op in ("ref.recurrent_gated_delta_rule", "ref.verify", "fast.recurrent_gated_delta_rule", "fast.verify",
               "fast.buffered_decode", "fast.baselines.recurrent_decode"):
        out += [token_probe(op, "scale/numpy-float32", "exact", over=_set("scale", np.float32(0.5))),
                token_probe(op, "scale/numpy-int64", "exact", over=_set("scale", np.int64(1))),
                token_probe(op, "scale/huge-int", "error", "scale", over=_set("scale", 10 ** 400))]
    path = lambda parents, node, want: lambda: Setup(ref.path_to, dict(parents=parents, node=node),  # noqa: E731
                                                     _result_check(lambda r: r == want, f"expected {want}"))
    out += [
        Probe("ref.path_to/cycle", path(t([1, 0]), 0, None), "error", "parents", crashy=True),
        Probe("ref.path_to/self-loop", path(t([0]), 0, None), "error", "parents", crashy=True),
        Probe("ref.path_to/node-past-D", path(t([-1, 0, 1]), 5, None), "error", "node"),
        Probe("ref.path_to/node-below--1", path(t([-1, 0]), -2, None), "error", "node"),
        Probe("ref.path_to/parent-below--1", path(t([-1, -3]), 1, None), "error", "parents"),
        Probe("ref.path_to/parents-rank-2", path(t([[-1, 0]]), 1, None), "error", "parents"),
        Probe("ref.path_to/parents-float", path(t([-1.0, 0.0]), 1, None), "error", "parents"),
        Probe("ref.path_to/tree", path(t([-1, 0, 0]), 2, [0, 2]), "exact"),
        Probe("ref.path_to/node-0-d-tensor", path(t([-1, 0], dtype=torch.int32), t(1), [0, 1]), "exact"),
        Probe("ref.path_to/none", path(t([-1, 0]), -1, []), "exact"),
        call_probe("ref.default_tail/capacity-0", ref.default_tail, lambda: dict(T=5, capacity=0), "error", "capacity"),
        call_probe("ref.default_tail/T=-1", ref.default_tail, lambda: dict(T=-1, capacity=2), "error", "T"),
        call_probe("ref.default_tail/T-float", ref.default_tail, lambda: dict(T=5.5, capacity=2), "error", "T"),
        Probe("ref.prefill/cu_seqlens/no-prompt", _prefill_no_prompt(ref, F64), "exact"),
        Probe("fast.prefill/cu_seqlens/no-prompt", _prefill_no_prompt(fast, F32), "exact"),
        accept_probe("ref.accept", "drafts/num_drafts-float", "error", "drafts.num_drafts", counts=1,
                     drafts_fn=lambda d: d.__class__(**{**d.tensors(), "num_drafts": t([3.0, 3.0])})),
        accept_probe("ref.accept", "drafts/num_drafts-above-D", "error", "drafts.num_drafts", nodes=t([2, 0]),
                     tree=True, drafts_fn=lambda d: d.__class__(**{**d.tensors(), "num_drafts": t([9, 9])})),
        accept_probe("ref.accept", "drafts/parents-cycle", "error", "drafts.parents", nodes=t([2, 0]), tree=True,
                     drafts_fn=lambda d: d.__class__(**{**d.tensors(), "parents": t([[-1, 2, 1], [-1, 0, 1]])}),
                     crashy=True),
        accept_probe("ref.accept", "drafts/u-int", "error", "drafts.u", counts=1,
                     drafts_fn=lambda d: d.__class__(**{**d.tensors(), "u": d.u.long()})),
    ]
    shard = ref.tp_shard(2, 4, 2, 0)
    part = torch.zeros(1, 1, 2, 3)
    out += [
        call_probe("ref.shard_tokens/shard-None", ref.shard_tokens, lambda: dict(shard=None, q=torch.zeros(1, 1, 2, 4)),
                   "error", "shard"),
        call_probe("ref.gather_heads/shards-not-shards", ref.gather_heads, lambda: dict(parts=[part, part], shards=[1, 2]),
                   "error", "shards[0]"),
        call_probe("ref.gather_heads/parts-a-tensor", ref.gather_heads,
                   lambda: dict(parts=torch.zeros(2, 1, 1, 2, 3), shards=ref.tp_shards(2, 4, 2)), "error", "parts"),
        call_probe("ref.gather_heads/parts-of-other-T", ref.gather_heads,
                   lambda: dict(parts=[part, torch.zeros(1, 2, 2, 3)], shards=ref.tp_shards(2, 4, 2)), "error", "parts[1]"),
        call_probe("ref.check_pool_shard/pool-None", ref.check_pool_shard, lambda: dict(pool=None, shard=shard),
                   "error", "pool"),
        call_probe("ref.check_pool_shard/shard-None", ref.check_pool_shard,
                   lambda: dict(pool=_pool(ref, F64), shard=None), "error", "shard"),
        call_probe("KVBuffer.empty/channel_gate-str", KVBuffer.empty,
                   lambda: dict(batch=B, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, capacity=C,
                                channel_gate="no"), "error", "channel_gate"),
        call_probe("KVBuffer.empty/device-junk", KVBuffer.empty,
                   lambda: dict(batch=B, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, capacity=C,
                                device="nonsense"), "error", "device"),
    ]
    for name, pkg, dtype in (("ref", ref, F64), ("fast", fast, F32)):
        n = f"{name}.KVPool"
        mk = lambda pkg=pkg, dtype=dtype, **o: lambda: dict(  # noqa: E731
            layers=1, num_state_slots=2, num_buffer_slots=2, capacity=C, max_drafts=T, num_heads=H,
            num_value_heads=HV, head_k_dim=K, head_v_dim=V, **{"dtype": dtype, **o})
        out += [
            call_probe(f"{n}/dtype-int64", pkg.KVPool, mk(dtype=torch.int64), "error", "dtype"),
            call_probe(f"{n}/key_dtype-int32", pkg.KVPool, mk(key_dtype=torch.int32), "error", "key_dtype"),
            call_probe(f"{n}/state_dtype-int32", pkg.KVPool, mk(state_dtype=torch.int32), "error", "state_dtype"),
            call_probe(f"{n}/channel_gate-str", pkg.KVPool, mk(channel_gate="no"), "error", "channel_gate"),
            call_probe(f"{n}/device-junk", pkg.KVPool, mk(device="nonsense"), "error", "device"),
            Probe(f"{n}.flush/count-huge-int", _pool_call(pkg, dtype, "flush", count=2 ** 70), "error", "count"),
            Probe(f"{n}.flush/count-numpy-int", _pool_call(pkg, dtype, "flush", count=np.int64(1)), "exact"),
            Probe(f"{n}.verify/nan-padding-drafts", _pool_verify_nan_padding(pkg, dtype), "exact"),
        ]
        if pkg is ref:
            out.append(call_probe(f"{n}/gate_dtype-int32", pkg.KVPool, mk(gate_dtype=torch.int32), "error", "gate_dtype"))
    return out


def _engine_args(N=3, dtype=F32, **over) -> dict:
    """engine_inputs' arguments: N packed rows of H = 1, HV = 2, K = 5, V = 3 and raw gates."""
    gen = torch.Generator().manual_seed(5)
    x = dict(mixed_qkv=torch.randn(N, 2 * H * K + HV * V, generator=gen).to(dtype),
             a=torch.randn(N, HV, generator=gen), b=torch.randn(N, HV, generator=gen),
             A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV, generator=gen), num_heads=H, head_k_dim=K)
    for name, value in over.items():
        x[name] = value(x) if callable(value) else value
    return x


def _engine_check(kwargs: dict, dtype) -> Callable:
    """engine_inputs' five outputs against the reference in float64 (gates below -RESET_GATE of the output's
    dtype taken as it: the same decay); for float32 the baseline is the reference's engine_inputs on the same
    arguments in float32 (what a correct implementation computes in the compute dtype)."""
    def run_ref(dt):
        args = {n: (t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                for n, t in kwargs.items()}
        return ref.engine_inputs(args.pop("mixed_qkv"), args.pop("a"), args.pop("b"), **args)

    def g_in_float32():
        """g = -exp(A_log) softplus(a + dt_bias) with every operation in float32 (the reference rounds its
        float64 value once): a + dt_bias rounded in float32 moves exp(z) by |z| ulps below the threshold."""
        from kvbuffer_ref.engine_inputs import SOFTPLUS_THRESHOLD
        z = kwargs["a"].to(F32) + kwargs["dt_bias"].to(F32)
        sp = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z)))
        g = -torch.exp(kwargs["A_log"].to(F32)) * sp
        g = torch.where(sp == 0, torch.zeros_like(g), torch.where(torch.isinf(sp), -torch.inf, g))
        return g.clamp(min=-RESET_GATE[F32])

    def check(result):
        truth = run_ref(F64)
        bases = [[b_] for b_ in run_ref(F32)] if dtype != F64 else [None] * len(truth)
        if dtype != F64:
            bases[3].append(g_in_float32().reshape(bases[3][0].shape))
        comps = []
        for name, got, want, base_ in zip(("q", "k", "v", "g", "beta"), result, truth, bases):
            assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
            if name == "g":
                want = want.clamp(min=-RESET_GATE[F64 if dtype == F64 else F32])
            if name in ("g", "beta"):
                got, want = got[..., None], want[..., None]
                base_ = None if base_ is None else [b_[..., None] for b_ in base_]
            if got.numel():
                comps.append(compare(got.to(F64) if dtype == F64 else got, want, base_, name=name, dtype=dtype))
        return comps
    return check


def engine_inputs_probes() -> list:
    """engine_inputs (packed rows, raw gates) of both packages: named errors for bad shapes, dtypes and values;
    the exact answer over the gating domain (a, b = +-inf, 0 x inf), strided and expanded rows, no rows."""
    out = []
    for pkg, mod, dtype in (("ref", ref, F64), ("fast", fast, F32)):
        fn = mod.engine_inputs

        def probe(name, expect, arg=None, dt=dtype, fn=fn, pkg=pkg, **over):
            def make():
                kw = _engine_args(dtype=dt, **over)
                return Setup(lambda **k: fn(k.pop("mixed_qkv"), k.pop("a"), k.pop("b"), **k), kw,
                             _engine_check(kw, dt) if expect == "exact" else None)
            return Probe(f"{pkg}.engine_inputs/{name}", make, expect, arg)

        def poke(name, index, value):
            def f(x):
                t = x[name].clone()
                t[index] = value
                return t
            return f

        out += [
            probe("mixed_qkv/last-dim", "error", "mixed_qkv", mixed_qkv=lambda x: x["mixed_qkv"][:, :-1]),
            probe("mixed_qkv/rank-4", "error", "mixed_qkv", mixed_qkv=lambda x: x["mixed_qkv"][None, None]),
            probe("mixed_qkv/int", "error", "mixed_qkv", mixed_qkv=lambda x: x["mixed_qkv"].to(torch.int32)),
            probe("mixed_qkv/not-a-tensor", "error", "mixed_qkv", mixed_qkv=[[1.0]]),
            probe("a/rows", "error", "a", a=lambda x: x["a"][:2]),
            probe("b/heads", "error", "b", b=lambda x: x["b"][:, :1]),
            probe("a/nan", "error", "a", a=poke("a", (1, 0), NAN)),
            probe("b/nan", "error", "b", b=poke("b", (2, 1), NAN)),
            probe("A_log/inf", "error", "A_log", A_log=poke("A_log", 0, INF)),
            probe("dt_bias/nan", "error", "dt_bias", dt_bias=poke("dt_bias", 1, NAN)),
            probe("A_log/rank-2", "error", "A_log", A_log=lambda x: x["A_log"][None]),
            probe("dt_bias/length", "error", "dt_bias", dt_bias=lambda x: x["dt_bias"][:1]),
            probe("num_heads/0", "error", "num_heads", num_heads=0),
            probe("head_k_dim/bool", "error", "head_k_dim", head_k_dim=True),
            probe("num_heads/not-a-divisor", "error", "num_heads", num_heads=3,
                  mixed_qkv=lambda x: torch.zeros(3, 2 * 3 * K + HV * V, dtype=x["mixed_qkv"].dtype)),
            probe("a/other-device", "error", ("mixed_qkv", "a"), a=lambda x: x["a"].to("meta")),
            probe("a/+-inf", "exact", a=lambda x: poke("a", (0, 1), -INF)({"a": poke("a", (0, 0), INF)(x)})),
            probe("b/+-inf", "exact", b=lambda x: poke("b", (0, 1), -INF)({"b": poke("b", (2, 0), INF)(x)})),
            probe("A_log/large-with-a=-inf", "exact", A_log=lambda x: torch.full_like(x["A_log"], 80.0),
                  a=poke("a", (1, 1), -INF)),
            probe("a/past-threshold", "exact", a=lambda x: x["a"] * 30),
            probe("mixed_qkv/zero-rows", "exact", mixed_qkv=poke("mixed_qkv", 0, 0.0)),
            probe("mixed_qkv/strided-rows", "exact",
                  mixed_qkv=lambda x: torch.cat([x["mixed_qkv"], x["mixed_qkv"][:, :4]], 1)[:, :x["mixed_qkv"].shape[1]]),
            probe("mixed_qkv/expanded", "exact", mixed_qkv=lambda x: x["mixed_qkv"][:1].expand(3, -1)),
            probe("varlen-3d", "exact", mixed_qkv=lambda x: x["mixed_qkv"][None], a=lambda x: x["a"][None],
                  b=lambda x: x["b"][None]),
            probe("no-rows", "exact", mixed_qkv=lambda x: x["mixed_qkv"][:0], a=lambda x: x["a"][:0],
                  b=lambda x: x["b"][:0]),
        ]
    out.append(Probe("fast.engine_inputs/float64", lambda: Setup(
        lambda **k: fast.engine_inputs(k.pop("mixed_qkv"), k.pop("a"), k.pop("b"), **k), _engine_args(dtype=F64)),
        "error", "mixed_qkv"))
    return out


def _varlen_args(cu, B=1, T=6, initial=True, **over) -> dict:
    x = tokens(F32, B=B, T=T, seed=3)
    kw = dict(x, cu_seqlens=cu, output_final_state=True)
    n = (len(cu) - 1) if isinstance(cu, (list, torch.Tensor)) and torch.as_tensor(cu).dim() == 1 else 1
    if initial:
        kw["initial_state"] = torch.randn(max(n, 0), HV, K, V, generator=torch.Generator().manual_seed(4))
    kw.update(over)
    return kw


def _varlen_check(kw: dict) -> Callable:
    """Outputs and final states against the float64 reference of each sequence alone."""
    def check(result):
        o, S = result
        x = {n: kw[n] for n in ("q", "k", "v", "g", "beta")}
        S0 = kw.get("initial_state")
        o64, S64 = ref.recurrent_gated_delta_rule(**f64(x), cu_seqlens=kw["cu_seqlens"], output_final_state=True,
                                                  initial_state=None if S0 is None else S0.to(F64))
        ob, Sb = ref.recurrent_gated_delta_rule(**x, cu_seqlens=kw["cu_seqlens"], output_final_state=True,
                                                initial_state=S0)
        bo, bS = [ob], [Sb]
        if "chunk_size" in kw:  # the chunkwise form, each sequence chunked alone, with chunks of max(64, chunk_size)
            oc, Sc = ref.chunk_gated_delta_rule(**x, cu_seqlens=kw["cu_seqlens"], output_final_state=True,
                                                initial_state=S0, chunk_size=max(FORM_CHUNK, int(kw["chunk_size"])))
            bo.append(oc)
            bS.append(Sc)
        return [_cmp(o, o64, bo, F32, name="o"), _cmp(S, S64, bS, F32, name="state", head_axis=1)]
    return check


def varlen_probes() -> list:
    """cu_seqlens of the recurrent and chunk forms of both packages and of prefill: named errors for bad
    offsets (type, dtype, rank, device, range, order, a batch of two, initial states of the wrong count);
    the exact answer with empty sequences and int64 offsets."""
    t = torch.tensor
    out = []
    ops = [("ref.recurrent_gated_delta_rule", ref.recurrent_gated_delta_rule, {}),
           ("fast.recurrent_gated_delta_rule", fast.recurrent_gated_delta_rule, {}),
           ("ref.chunk_gated_delta_rule", ref.chunk_gated_delta_rule, dict(chunk_size=2)),
           ("fast.chunk_gated_delta_rule", fast.chunk_gated_delta_rule, dict(chunk_size=16))]
    for name, fn, extra in ops:
        def probe(case, expect, arg, cu, crashy=False, fn=fn, extra=extra, **over):
            def make():
                kw = dict(_varlen_args(cu, **over), **extra)
                return Setup(fn, kw, _varlen_check(kw) if expect == "exact" else None)
            return Probe(f"{name}/cu_seqlens/{case}", make, expect, arg, crashy=crashy)
        out += [
            probe("list", "error", "cu_seqlens", [0, 2, 6]),
            probe("float", "error", "cu_seqlens", t([0.0, 2.0, 6.0])),
            probe("rank-2", "error", "cu_seqlens", t([[0, 2, 6]])),
            probe("not-from-0", "error", "cu_seqlens", t([1, 2, 6])),
            probe("short-of-T", "error", "cu_seqlens", t([0, 2, 5])),
            probe("decreasing", "error", "cu_seqlens", t([0, 4, 2, 6])),
            probe("past-T", "error", "cu_seqlens", t([0, 2 ** 40, 6]), crashy=True),
            probe("negative", "error", "cu_seqlens", t([0, -3, 6]), crashy=True),
            probe("other-device", "error", "cu_seqlens", t([0, 2, 6], device="meta")),
            probe("batch-of-two", "error", "q", t([0, 2, 6]), B=2),
            probe("initial-state-count", "error", "initial_state", t([0, 2, 6]),
                  initial_state=torch.zeros(3, HV, K, V)),
            probe("empty-sequences", "exact", None, t([0, 0, 2, 2, 6, 6], dtype=torch.int32)),
            probe("int64-no-initial", "exact", None, t([0, 5, 6]), initial=False),
        ]
    for name, fn in (("ref.prefill", ref.prefill), ("fast.prefill", fast.prefill)):
        for case, cu, arg in (("decreasing", t([0, 4, 2, 6]), "cu_seqlens"), ("float", t([0.0, 6.0]), "cu_seqlens"),
                              ("batch-of-two", t([0, 6]), "q")):
            def make(cu=cu, fn=fn, B=2 if case == "batch-of-two" else 1):
                x = tokens(F32, B=B, T=6, seed=3)
                return Setup(fn, dict(x, capacity=C, cu_seqlens=cu))
            out.append(Probe(f"{name}/cu_seqlens/{case}", make, "error", arg))
    return out


def all_probes() -> list:
    from .adversarial import adversarial_probes

    probes = token_probes() + flush_probes() + accept_probes() + prefill_probes() + empty_probes() \
        + per_draft_accept_probes() + adversarial_probes() + edge_call_probes() + engine_inputs_probes() + varlen_probes()
    ids = [p.id for p in probes]
    dup = {i for i in ids if ids.count(i) > 1}
    assert not dup, f"duplicate probe ids {sorted(dup)}"
    return probes


# ------------------------------------------------------------------------------- the subprocess runner
def run_batch(ids: list) -> None:
    """Run the probes ``ids`` in order, one JSON line per probe ("start" before, the verdict after), so
    that the parent can tell which probe a crash happened in."""
    by_id = {p.id: p for p in all_probes()}
    for pid in ids:
        print(json.dumps({"start": pid}), flush=True)
        ok, what = run_probe(by_id[pid])
        print(json.dumps({"id": pid, "ok": ok, "what": what}), flush=True)


if __name__ == "__main__":
    run_batch(json.loads(sys.stdin.read()))
