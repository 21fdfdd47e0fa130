"""Adversarial probes beyond the per-argument sweep of probes.py: layouts (stride 0, transposed), mixed
dtypes, resets everywhere, non-finite values in another request, head dims that are not powers of two,
integer index tensors of other integer dtypes, long prompts into a tiny buffer, scalars of other types,
outputs that must not share memory with inputs, and in-place arguments of kvbuffer_fast that share memory
with another argument (a ValueError naming both; disjoint parts of one storage are fine).  Same machinery
and verdicts as probes.py."""

from __future__ import annotations

import numpy as np
import torch

import kvbuffer_fast as fast
import kvbuffer_fast.baselines as base
import kvbuffer_ref as ref
from kvbuffer.validate.properties import truth_and_baseline

from .probes import (B, C, F32, F64, HV, INF, K, NAN, T, TOKEN_OPS, V, Probe, Setup, _buffered, _cmp, _edit,
                     _prefill_check, _put, _set, buffer, buffer_check, copy_check, f64, own_chunk, token_probe, tokens)

#: the token operations without a buffer, whose answer is the recurrence over the tokens
PLAIN = ("ref.recurrent_gated_delta_rule", "ref.chunk_gated_delta_rule", "ref.direct_gated_delta_rule",
         "fast.recurrent_gated_delta_rule", "fast.chunk_gated_delta_rule", "fast.direct_gated_delta_rule")


def _expanded(x):
    """q, k, v, beta of every token the first token's (a stride-0 view along T), g as given."""
    return {n: (a if n == "g" else a[:, :1].expand_as(a)) for n, a in x.items()}


def _transposed(x):
    """Every input stored [T, B, ...] and viewed [B, T, ...] (no axis contiguous in the expected order)."""
    return {n: a.transpose(0, 1).contiguous().transpose(0, 1) for n, a in x.items()}


def _mixed(x):
    """k in float16 and g in float64 beside the op's own dtype (any floating mix is accepted)."""
    return dict(x, k=x["k"].half(), g=x["g"].double())


def _poison_request(name, value):
    def x_fn(x):
        x = dict(x)
        x[name] = x[name].clone()
        x[name][1] = value
        return x
    return x_fn


def _request0_check(dtype, op: str):
    """Request 0's outputs against the recurrence over request 0 alone (request 1 holds NaN / Inf); the
    baseline: the correct forms of ``op`` on request 0 in ``dtype`` (``truth_and_baseline``)."""
    def make(x, kw, pre):
        def check(result):
            o = result[0] if isinstance(result, tuple) else result
            x0 = {n: a[:1] for n, a in x.items()}
            o64, _ = ref.recurrent_gated_delta_rule(**f64(x0))
            ob = None
            if dtype != F64:
                _, (ob, _) = truth_and_baseline({n: a.to(dtype) for n, a in x0.items()}, chunk=own_chunk(op, kw, x0))
            return [_cmp(o[:1], o64, ob, dtype, name="o[request 0]")]
        return check
    return make


def layout_and_dtype_probes() -> list:
    out = []
    for op in TOKEN_OPS:
        if "baselines" in op:
            continue
        T1 = TOKEN_OPS[op][2]
        if T1 is None:  # stride 0 along T needs T > 1
            out.append(token_probe(op, "inputs/expanded-stride-0", "exact", x_fn=_expanded))
        out += [
            token_probe(op, "inputs/transposed", "exact", x_fn=_transposed),
            token_probe(op, "inputs/mixed-float16-float64", "exact", x_fn=_mixed),
            token_probe(op, "g/-inf-everywhere", "exact", x_fn=_edit("g", lambda t: torch.full_like(t, -INF))),
            token_probe(op, "g/-inf-last-token", "exact", x_fn=_edit("g", _put((slice(None), -1), -INF))),
            token_probe(op, "scale/tensor", "error", "scale", over=_set("scale", torch.tensor(0.5))),
            token_probe(op, "scale/numpy-float", "exact", over=_set("scale", np.float64(0.5))),
        ]
    return out


def _nonpow2_op(op, Kx, Vx):
    fn, dtype, _, extra, check, _ = TOKEN_OPS[op]

    def make():
        x = tokens(dtype, T=2, K=Kx, V=Vx)
        kw = dict(x, **extra(x))
        return Setup(fn, kw, check(x, kw, {}))
    return Probe(f"{op}/K={Kx},V={Vx}", make, "exact")


def shape_probes() -> list:
    out = []
    for op in PLAIN + ("ref.prefill", "fast.prefill"):
        out += [_nonpow2_op(op, 80, 96), _nonpow2_op(op, 96, 80)]
    for op in PLAIN:
        dtype = TOKEN_OPS[op][1]
        out += [
            token_probe(op, "v/nan-in-another-request", "exact", x_fn=_poison_request("v", NAN)),
            token_probe(op, "k/inf-in-another-request", "exact", x_fn=_poison_request("k", INF)),
        ]
        out[-2].make, out[-1].make = _with_check(out[-2], dtype, op), _with_check(out[-1], dtype, op)
    for name, pkg, dtype in (("ref.prefill", ref, F64), ("fast.prefill", fast, F32)):
        def make(pkg=pkg, dtype=dtype):
            x = tokens(dtype, T=40)
            kw = dict(x, capacity=1)
            return Setup(pkg.prefill, kw, _prefill_check(dtype, pkg.materialize_state)(x, kw, {}))
        out.append(Probe(f"{name}/T=40,capacity=1", make, "exact"))
    return out


def _with_check(p: Probe, dtype, op: str):
    """Replace a probe's check with ``_request0_check``."""
    inner = p.make

    def make():
        s = inner()
        x = {n: s.kwargs[n] for n in ("q", "k", "v", "g", "beta")}
        return Setup(s.fn, s.kwargs, _request0_check(dtype, op)(x, s.kwargs, {}))
    return make


def _index_dtype_probes() -> list:
    t = torch.tensor
    out = []
    for op in ("ref.buffered_decode", "fast.buffered_decode", "ref.verify", "fast.verify"):
        dtype = TOKEN_OPS[op][1]
        out.append(token_probe(op, "buffer/lengths-int32", "exact",
                               over=_set("buffer", lambda _, dt=dtype: buffer(dt).replace(
                                   lengths=t([2, 1], dtype=torch.int32)))))
        if op.endswith("verify"):
            out.append(token_probe(op, "parents-and-num_drafts-int32", "exact", over=lambda x, kw: dict(
                kw, parents=t([[-1, 0, 1], [-1, -1, 0]], dtype=torch.int32), num_drafts=t([3, 2], dtype=torch.int32))))
    for name, pkg, dtype in (("ref.flush", ref, F64), ("fast.flush", fast, F32)):
        for idt in (torch.int32, torch.uint8):
            def make(pkg=pkg, dtype=dtype, idt=idt):
                buf = buffer(dtype)
                before = ref.KVBuffer(**buf.cloned())
                count = t([1, 1], dtype=idt)
                return Setup(pkg.flush, dict(buffer=buf, count=count),
                             buffer_check(None, before, "flush", dtype, count=count.long()))
            out.append(Probe(f"{name}/count-{str(idt).replace('torch.', '')}", make, "exact",
                             inplace=("buffer",) if pkg is fast else ()))
    return out


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _no_alias(getter, inputs):
    """The result's tensors (``getter(result)``: a list) share no storage with the inputs' (``inputs(kwargs)``)."""
    def make_check(kw):
        def check(result):
            ins = [t for t in inputs(kw) if isinstance(t, torch.Tensor)]
            outs = [t for t in getter(result) if isinstance(t, torch.Tensor)]
            shared = [i for i, o in enumerate(outs) if any(_shares(o, x) for x in ins)]
            assert not shared, f"results {shared} share memory with an input: an update of one changes the other"
            return []
        return check
    return make_check


def alias_probes() -> list:
    out = []
    gen = torch.Generator().manual_seed(3)
    for name, pkg, dtype in (("ref", ref, F64), ("fast", fast, F32)):
        for op, Tx in (("recurrent_gated_delta_rule", 0), ("recurrent_gated_delta_rule", 3),
                       ("chunk_gated_delta_rule", 0), ("chunk_gated_delta_rule", 3)):
            def make(pkg=pkg, op=op, Tx=Tx, dtype=dtype):
                x = tokens(dtype, T=Tx)
                kw = dict(x, initial_state=torch.randn(B, HV, K, V, generator=gen, dtype=dtype), output_final_state=True)
                chk = _no_alias(lambda r: [r[1]], lambda kw: [kw["initial_state"]])(kw)
                return Setup(getattr(pkg, op), kw, chk)
            out.append(Probe(f"{name}.{op}/T={Tx}/final-state-is-not-initial_state", make, "exact"))
        for Tx in (0, 3):
            def make(pkg=pkg, Tx=Tx, dtype=dtype):
                x = tokens(dtype, T=Tx)
                kw = dict(x, capacity=8, initial_state=torch.randn(B, HV, K, V, generator=gen, dtype=dtype))
                chk = _no_alias(lambda r: list(r[1].tensors().values()), lambda kw: list(kw.values()))(kw)
                return Setup(pkg.prefill, kw, chk)
            out.append(Probe(f"{name}.prefill/T={Tx}/buffer-is-not-its-inputs", make, "exact"))

    def flush0():
        kw = dict(buffer=buffer(F64), count=0)
        return Setup(ref.flush, kw, _no_alias(lambda r: list(r.tensors().values()),
                                              lambda kw: list(kw["buffer"].tensors().values()))(kw))

    def accept0():
        buf = buffer(F64)
        _, d = ref.verify(**tokens(F64, seed=2), buffer=buf)
        kw = dict(buffer=buf, drafts=d, counts=0)
        return Setup(ref.accept, kw, _no_alias(lambda r: list(r.tensors().values()),
                                               lambda kw: list(kw["buffer"].tensors().values())
                                               + list(kw["drafts"].tensors().values()))(kw))
    out += [Probe("ref.flush/count=0/result-is-not-the-input", flush0, "exact"),
            Probe("ref.accept/counts=0/result-is-not-the-input", accept0, "exact")]
    return out


def _carved(*shapes, at=None):
    """Contiguous views of one fresh float32 storage, one per shape: back to back (``at`` None) or starting at
    the element offsets ``at`` (so that they overlap)."""
    sizes = [int(torch.Size(sh).numel()) for sh in shapes]
    starts = at if at is not None else [sum(sizes[:i]) for i in range(len(sizes))]
    w = torch.zeros(max(a + n for a, n in zip(starts, sizes)))
    return [w[a:a + n].view(sh) for a, n, sh in zip(starts, sizes, shapes)]


def overlap_probes() -> list:
    """kvbuffer_fast's in-place arguments (per_draft_state_verify's intermediate, per_draft_state_accept's
    state, accept's buffer) sharing memory with another argument: a ValueError naming both."""
    pdv = "fast.baselines.per_draft_state_verify"
    S_, I_ = (B, HV, K, V), (B, T, HV, K, V)

    def inter_over(at, name=None):
        def over(x, kw):
            views = _carved(I_, S_, at=at)
            if name is not None:  # an input token tensor inside intermediate's memory
                views[1] = views[0].reshape(-1)[:x[name].numel()].view(x[name].shape).copy_(x[name])
                return dict(kw, intermediate=views[0], **{name: views[1]})
            return dict(kw, intermediate=views[0], state=views[1].copy_(kw["state"]))
        return over

    out = [
        token_probe(pdv, "intermediate/shares-state", "error", ("intermediate", "state"),
                    over=inter_over([0, 30])),
        token_probe(pdv, "intermediate/shares-v", "error", ("intermediate", "v"), over=inter_over([0, 0], "v")),
        token_probe(pdv, "intermediate/shares-g", "error", ("intermediate", "g"), over=inter_over([0, 0], "g")),
        token_probe(pdv, "intermediate-and-state/one-storage", "exact", over=inter_over(None),
                    inplace=("intermediate",)),
    ]
    gen = torch.Generator().manual_seed(8)
    S0, I0 = torch.randn(*S_, generator=gen), torch.randn(*I_, generator=gen)
    pda = "fast.baselines.per_draft_state_accept"

    def accept_views(at):
        def make():
            inter, state = _carved(I_, S_, at=at)
            inter.copy_(I0)
            if at is None:  # disjoint: the state's own values
                state.copy_(S0)
            kw = dict(state=state, intermediate=inter, counts=torch.tensor([3, 0]))
            return Setup(base.per_draft_state_accept, kw, copy_check(S0, I0, [3, 0]) if at is None else None)
        return make
    out += [Probe(f"{pda}/state/shares-intermediate", accept_views([0, int(torch.Size(I_).numel()) - 30]), "error",
                  ("state", "intermediate"), inplace=("state",)),
            Probe(f"{pda}/state-and-intermediate/one-storage", accept_views(None), "exact", inplace=("state",))]

    def fast_accept(edit, counts=1):
        def make():
            buf = buffer(F32)
            _, d = ref.verify(**tokens(F32, seed=2), buffer=buf)
            buf, d, kw = edit(buf, d)
            return Setup(fast.accept, dict(buffer=buf, drafts=d, **kw), None)
        return make

    def u_in_drafts(buf, d):  # the buffer's u inside the drafts' u
        return buf.replace(u=d.u.reshape(-1)[:buf.u.numel()].view(buf.u.shape)), d, dict(counts=1)

    def k_in_drafts(buf, d):
        return buf.replace(k=d.k.reshape(-1)[:buf.k.numel()].view(buf.k.shape)), d, dict(counts=1)

    def u_in_state(buf, d):  # two buffer fields in one memory
        return buf.replace(u=buf.state.reshape(-1)[:buf.u.numel()].view(buf.u.shape)), d, dict(counts=1)

    def counts_are_lengths(buf, d):
        return buf, d, dict(counts=buf.lengths)

    out += [Probe(f"fast.accept/{pid}", fast_accept(edit), "error", arg, inplace=("buffer",))
            for pid, edit, arg in (("buffer.u/shares-drafts.u", u_in_drafts, ("buffer.u", "drafts.u")),
                                   ("buffer.k/shares-drafts.k", k_in_drafts, ("buffer.k", "drafts.k")),
                                   ("buffer.u/shares-buffer.state", u_in_state, ("buffer.u", "buffer.state")),
                                   ("counts/is-buffer.lengths", counts_are_lengths, ("buffer.lengths", "counts")))]
    return out


def adversarial_probes() -> list:
    return layout_and_dtype_probes() + shape_probes() + _index_dtype_probes() + alias_probes() + overlap_probes()
