"""kvbuffer_fast with a 16-bit state and u-cache: every store rounds once, every load converts to fp32.

The oracle is ``kvbuffer_ref`` on a buffer whose state (and u, when the kernel's u is 16-bit) has the
same 16-bit dtype and whose other fields are float64: it computes in float64 and rounds exactly where
the kernels store (``entries.store``: the state at each fold, flush and accept fold; each u when it is
appended), so the two differ only by the kernels' fp32 arithmetic before each rounding.

Two kinds of checks (docs/kernels.md, "Reduced-precision state and cache"):

* **stored values, op by op** (``_assert_rounded``): the reference is re-synced to the kernel's buffer
  before each operation (fields upcast exactly), both run it, and every 16-bit value written must equal
  the reference's rounding of the float64 value, except for elements within a rounding boundary of it:
  at most one ulp apart, on at most ``FLIP_FRACTION`` of the elements.  Truncation, a double rounding or
  a rounding before the last product fails on about half of the elements.
* **outputs and float32 fields** (u when it is float32, the cumulative gates G): ``compare`` against the
  same reference (op by op, and free running over several folds), the baseline the same calls run by the
  reference in float32 on the same 16-bit buffer (the operation's own form, rounding where it stores).

CPU: the Triton interpreter in float16 (its bfloat16 arithmetic is wrong); bfloat16 runs on CUDA.
Outputs are NaN-poisoned (KVBUFFER_POISON=1, tests/conftest.py) and so is every buffer element a
kernel must not read (``poison_unused_``) before each operation.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvbuffer.validate.tolerances import tolerance_for  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.launch import config_for, key_of  # noqa: E402
from kvbuffer_fast.pool import KVPool  # noqa: E402
from kvbuffer_ref.buffer import Drafts, KVBuffer  # noqa: E402
from kvbuffer_ref.entries import fold_dtype  # noqa: E402
from kvbuffer.validate import compare  # noqa: E402
from kvbuffer.validate.properties import poison_unused_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic")
LOW = [torch.float16, pytest.param(torch.bfloat16, marks=CUDA_ONLY)]
#: elements whose fp32 and float64 values round to neighbouring 16-bit numbers (measured: under 0.5 %)
FLIP_FRACTION = 0.03
B, H, HV, K, V, C = 3, 1, 2, 16, 16, 4


def _tokens(seed: int, T: int, channel: bool, Bn: int = B) -> dict:
    """fp32 tokens on DEVICE: unit q and k, v ~ N(0, 1), gates in [-0.4, 0], betas in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(Bn, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(Bn, T, H, K, generator=gen), dim=-1)
    v = torch.randn(Bn, T, HV, V, generator=gen)
    g = -0.4 * torch.rand((Bn, T, HV, K) if channel else (Bn, T, HV), generator=gen)
    beta = torch.rand(Bn, T, HV, generator=gen)
    return {n: x.to(DEVICE) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def _at(x: dict, t, dtype=None) -> dict:
    sl = slice(t, t + 1) if isinstance(t, int) else t
    return {n: y[:, sl].to(dtype or y.dtype) for n, y in x.items()}


def _oracle(buf: KVBuffer, wide=torch.float64) -> KVBuffer:
    """The reference's copy of a kernel buffer: 16-bit fields kept (so they are rounded where written),
    every other floating field in ``wide`` (float64: the oracle; float32: the baseline)."""
    def cv(x):
        if x is None or not x.dtype.is_floating_point:
            return None if x is None else x.clone()
        return x.clone() if torch.finfo(x.dtype).bits == 16 else x.to(wide)
    return KVBuffer(**{n: cv(x) for n, x in buf.tensors().items()})


def _new_buffer(state_dtype, u_dtype, channel, Bn=B, Cn=C) -> KVBuffer:
    return KVBuffer.empty(Bn, H, HV, K, V, Cn, channel_gate=channel, dtype=u_dtype, gate_dtype=torch.float32,
                          key_dtype=torch.float32, state_dtype=state_dtype, device=DEVICE)


def _assert_rounded(name: str, got: torch.Tensor, want: torch.Tensor, mask=None) -> None:
    """``got`` (the kernel's stored 16-bit values) is ``want`` rounded to its dtype: the float64
    reference's value, rounded by the reference (16-bit too) or here (``want`` wider).  Elements may be
    one ulp apart where the fp32 and float64 values straddle a rounding boundary, on at most
    FLIP_FRACTION of them."""
    low = got.dtype
    assert torch.finfo(low).bits == 16, f"{name}: expected a 16-bit tensor, got {low}"
    w = want.to(low)
    a, r = got.double(), w.double()
    if mask is not None:
        a, r, w = a[mask], r[mask], w[mask]
    assert a.numel() > 0, f"{name}: nothing compared"
    assert torch.isfinite(a).all(), f"{name}: non-finite stored values"
    ulp = (torch.nextafter(w.abs(), torch.tensor(float("inf"), dtype=low, device=w.device)) - w.abs()).double()
    diff = (a - r).abs()
    # plus the fp32 rounding of the sums behind an element (the table's fp32 floor x eps at the tensor's
    # scale): an element that came out small by cancellation has an ulp below that
    slack = tolerance_for(torch.float32).floor * torch.finfo(torch.float32).eps * float(r.pow(2).mean().sqrt())
    far = diff > ulp * 1.0001 + slack
    assert not bool(far.any()), (f"{name}: {int(far.sum())} of {a.numel()} elements more than one {low} ulp from "
                                 f"the reference's rounding (worst {float(diff.max()):.3e})")
    frac = float((diff > 0).double().mean())
    assert frac <= FLIP_FRACTION, (f"{name}: {frac:.1%} of the elements round differently from the reference "
                                   f"(at most {FLIP_FRACTION:.0%} may straddle a rounding boundary): the rounding "
                                   f"is not a single round-to-nearest-even of the fp32 value")


def _live(buf: KVBuffer) -> torch.Tensor:
    """[B, C] the entries in use."""
    return torch.arange(buf.capacity, device=buf.lengths.device)[None, :] < buf.lengths[:, None]


def _assert_field(name: str, got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, live: torch.Tensor) -> None:
    """A float32 field's live entries ([B, C, HV, ...] at ``live`` [B, C]) against the float64 oracle's, the
    float32 reference's after the same operation as the baseline; one slice per value head."""
    a, w, b = (t[live].double().cpu() for t in (got, want, base))  # [n, HV, ...]
    a, w, b = (t.reshape(1, t.shape[0], t.shape[1], -1) for t in (a, w, b))
    c = compare(a, w, b, name=name, dtype=torch.float32, head_axis=2)
    assert c.passed, str(c)


def _assert_buffer(name: str, got: KVBuffer, want: KVBuffer, base: KVBuffer) -> None:
    """A kernel buffer after an operation against the reference's after the same operation (``want``: the
    float64 oracle's, ``base``: the float32 reference's on the same 16-bit buffer, the baseline)."""
    assert torch.equal(got.lengths.cpu(), want.lengths.cpu()), f"{name}: lengths {got.lengths} != {want.lengths}"
    assert torch.equal(got.has_state.cpu(), want.has_state.cpu()), f"{name}: has_state differs"
    live = _live(got)
    if got.has_state.any():
        assert got.state.dtype == want.state.dtype
        _assert_rounded(f"{name}.state", got.state, want.state, got.has_state)
    if live.any():
        if torch.finfo(got.u.dtype).bits == 16:
            _assert_rounded(f"{name}.u", got.u, want.u, live)
        else:
            _assert_field(f"{name}.u", got.u, want.u, base.u, live)
        _assert_field(f"{name}.G", got.G, want.G, base.G, live)
        assert torch.equal(got.k[live].double(), want.k[live].double()), f"{name}: keys not copied exactly"


def _assert_outputs(name: str, o: torch.Tensor, o64: torch.Tensor, o32: torch.Tensor) -> None:
    """Outputs against the float64 oracle on the same 16-bit buffer, the float32 reference's same calls on
    that buffer as the baseline (the operation's own form, with the same stored precision)."""
    c = compare(o.detach().cpu(), o64.detach().cpu().double(), o32.detach().cpu(), name=name, dtype=o.dtype)
    assert c.passed, str(c)


def _exact(buf: KVBuffer) -> KVBuffer:
    """A float64 copy of every floating field of ``buf``: the exact math from its contents, nothing rounded
    to 16 bits where it is written (the truth an output is judged against)."""
    return KVBuffer(**{n: None if x is None else x.double() if x.is_floating_point() else x.clone()
                       for n, x in buf.tensors().items()})


def _decode_both(x_t, fb, rb64, rb32, cfg):
    """One decode step in the kernels (poisoned buffer), the float64 oracle (16-bit fields kept: the stored
    values' check) and the float32 baseline; the output's truth is the exact step from the same buffer (a
    fold's state not rounded before the token reads it)."""
    x64 = {n: y.double() for n, y in x_t.items()}
    o_exact, _ = ref.buffered_decode(**x64, buffer=_exact(fb))
    poison_unused_(fb)
    o, out = fast.buffered_decode(**x_t, buffer=fb, config=cfg)
    assert out is fb
    _, rb64 = ref.buffered_decode(**x64, buffer=rb64)
    o32, rb32 = ref.buffered_decode(**x_t, buffer=rb32)
    return o, o_exact, o32, rb64, rb32


@pytest.mark.parametrize("low", LOW)
@pytest.mark.parametrize("u16", [False, True], ids=["u32", "u16"])
@pytest.mark.parametrize("fold,channel,dot", [("group", False, False), ("tile", False, False), ("group", True, False),
                                               ("group", False, True)], ids=["group", "tile", "channel", "dot"])
def test_decode_cycles_round_like_the_reference(low, u16, fold, channel, dot):
    """3C + 2 decode steps from an empty buffer (three folds per request, the first from direct mode)
    with a ragged flush after step 2: after every operation the stored state and u are the float64
    oracle's rounding; the outputs step by step (re-synced) and free running within the 16-bit budget.
    ``dot``: q, k, v in the state's dtype and the state sums by tl.dot (``DecodeConfig.dot``)."""
    T = 3 * C + 2
    x = _tokens(1 + fold.startswith("t") + 2 * channel + 4 * u16 + 8 * dot, T, channel)
    if dot:
        x.update({n: x[n].to(low) for n in ("q", "k", "v")})
    fb = _new_buffer(low, low if u16 else torch.float32, channel)
    cfg = dataclasses.replace(config_for("decode", key_of(x["q"], C=C, B=B, HV=HV, V=V, channel=channel)),
                              fold=fold, dot=dot)
    assert fast.decode.state_dot(cfg, x["q"], fb.state, channel) == dot
    # free running: the exact float64 math (every field float64, nothing rounded to 16 bits) is the truth, the
    # float32 reference storing the same 16-bit fields the baseline, so both carry the 16-bit stores' rounding
    free64 = _exact(fb)
    free32 = _oracle(fb, torch.float32)
    outs, outs64, outs32 = [], [], []
    for t in range(T):
        if t == 2:  # a ragged flush: request 0 keeps everything, 1 folds one entry, 2 both
            counts = torch.tensor([0, 1, 2], device=DEVICE)
            r64, r32 = ref.flush(_oracle(fb), count=counts), ref.flush(_oracle(fb, torch.float32), count=counts)
            poison_unused_(fb)
            fb = fast.flush(fb, count=counts)
            _assert_buffer(f"flush before step {t}", fb, r64, r32)
            free64, free32 = ref.flush(free64, count=counts), ref.flush(free32, count=counts)
        r64, r32 = _oracle(fb), _oracle(fb, torch.float32)
        full = bool((fb.lengths == C).any())
        o, o64, o32, r64, r32 = _decode_both(_at(x, t), fb, r64, r32, cfg)
        _assert_buffer(f"decode step {t}" + (" (a fold)" if full else ""), fb, r64, r32)
        _assert_outputs(f"decode step {t}.o", o, o64, o32)
        of64, free64 = ref.buffered_decode(**{n: y.double() for n, y in _at(x, t).items()}, buffer=free64)
        of32, free32 = ref.buffered_decode(**_at(x, t), buffer=free32)
        outs.append(o), outs64.append(of64), outs32.append(of32)
    assert bool(fb.has_state.all())
    _assert_outputs("free-running decode.o", torch.cat(outs, 1), torch.cat(outs64, 1), torch.cat(outs32, 1))
    _assert_rounded("materialize_state", fast.materialize_state(fb), ref.materialize_state(_oracle(fb)))


@pytest.mark.parametrize("low", LOW)
@pytest.mark.parametrize("u16", [False, True], ids=["u32", "u16"])
@pytest.mark.parametrize("tree,qk16", [(False, False), (True, False), (False, True)], ids=["chain", "tree", "qk16"])
def test_verify_accept_round_like_the_reference(low, u16, tree, qk16):
    """After C + 2 decode steps (a fold) and a ragged flush, verify 3 drafts (a chain, or a tree) and
    accept a path per request so that one or two requests pass the capacity (accept's fold): the drafts' u are
    the oracle's rounded, the outputs within the 16-bit budget, the buffer after accept the oracle's.
    ``qk16``: q, k, v in the state's dtype, so phase 2's X S0 is one TF32 product (a 16-bit state has no low
    TF32 piece)."""
    channel = tree
    x = _tokens(11 + tree + 2 * u16 + 4 * qk16, C + 2 + 3, channel)
    if qk16:
        x.update({n: x[n].to(low) for n in ("q", "k", "v")})
    fb = _new_buffer(low, low if u16 else torch.float32, channel)
    for t in range(C + 2):
        poison_unused_(fb)
        fast.buffered_decode(**_at(x, t), buffer=fb)
    fb = fast.flush(fb, count=torch.tensor([2, 0, 0], device=DEVICE))   # lengths 0, 2, 2
    d = _at(x, slice(C + 2, C + 5))
    parents = (torch.tensor([[-1, 0, 0], [-1, 0, 1], [-1, -1, 1]], device=DEVICE) if tree else None)
    r64, r32 = _oracle(fb), _oracle(fb, torch.float32)
    poison_unused_(fb)
    o, drafts = fast.verify(**d, buffer=fb, parents=parents)
    o64, dr64 = ref.verify(**{n: y.double() for n, y in d.items()}, buffer=r64, parents=parents)
    o32, dr32 = ref.verify(**d, buffer=r32, parents=parents)
    _assert_outputs("verify.o", o, o64, o32)
    if u16:
        assert drafts.u.dtype == low
        _assert_rounded("drafts.u", drafts.u, dr64.u)
    assert drafts.G.dtype == torch.float32
    # accept (C = 4): request 0 (length 0) takes 3 (tree: 2), request 1 (length 2) takes 3 and folds,
    # request 2 (length 2) takes 3 and folds (tree: 2, no fold)
    sel = dict(nodes=torch.tensor([2, 2, 2], device=DEVICE)) if tree else dict(counts=torch.tensor([3, 3, 3],
                                                                                                 device=DEVICE))
    want = ref.accept(_oracle(fb), Drafts(parents=drafts.parents, num_drafts=drafts.num_drafts, k=drafts.k.double(),
                                          u=drafts.u if u16 else drafts.u.double(), G=drafts.G.double()), **sel)
    base = ref.accept(_oracle(fb, torch.float32), drafts, **sel)
    poison_unused_(fb)
    out = fast.accept(fb, drafts, **sel)
    assert out is fb
    assert bool(fb.has_state[1]) and int(fb.lengths[1]) == 3, "request 1's accept did not fold"
    _assert_buffer("accept", fb, want, base)
    # and the drafts the reference's verify produced, accepted by the reference, round the same way
    again = ref.accept(r64, dr64, **sel)
    _assert_buffer("accept of the oracle's own drafts", fb, again, ref.accept(r32, dr32, **sel))


@pytest.mark.parametrize("low", LOW)
@pytest.mark.parametrize("dot", [False, True], ids=["sums", "dot"])
def test_pool_ops_round_like_the_reference(low, dot):
    """KVPool(state_dtype=16-bit, dtype=16-bit u): admit (direct mode), decode across folds, verify and
    accept with a fold, flush, state_of: after each, the addressed rows (gathered) are the float64
    oracle's after the same operation on the rows gathered before it.  ``dot``: q, k, v in the state's
    dtype and decode's state sums by tl.dot (``DecodeConfig.dot``)."""
    N, D = 3, 3
    p = KVPool(layers=1, num_state_slots=N, num_buffer_slots=N, capacity=C, max_drafts=D, num_heads=H,
               num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=low, key_dtype=torch.float32, state_dtype=low,
               device=DEVICE)
    t = p.tensors()
    assert t["state"].dtype == low and t["u"].dtype == low and t["G"].dtype == torch.float32
    s = p.acquire(N).to(DEVICE)
    x = _tokens(21 + dot, 12, False)
    if dot:
        x.update({n: x[n].to(low) for n in ("q", "k", "v")})
    cfg = dataclasses.replace(config_for("decode", key_of(x["q"], C=C, B=N, HV=HV, V=V, state=low)), dot=dot)
    assert fast.decode.state_dot(cfg, x["q"], t["state"], False) == dot
    gather = lambda: p._gather(0, s)  # noqa: E731
    r64 = None
    o = p.admit(**_at(x, slice(0, 2)), layer=0, slots=s)
    assert torch.isfinite(o).all()
    for step in range(2, 2 + C + 1):  # every request folds once (from direct mode)
        r64, r32 = _oracle(gather()), _oracle(gather(), torch.float32)
        x64 = {n: y.double() for n, y in _at(x, step).items()}
        o64, _ = ref.buffered_decode(**x64, buffer=_exact(gather()))  # the output's truth: nothing rounded
        o = p.decode(**_at(x, step), layer=0, slots=s, config=cfg)
        _, r64 = ref.buffered_decode(**x64, buffer=r64)
        o32, r32 = ref.buffered_decode(**_at(x, step), buffer=r32)
        _assert_buffer(f"pool decode step {step}", gather(), r64, r32)
        _assert_outputs(f"pool decode step {step}.o", o, o64, o32)
    assert bool(gather().has_state.all())
    d = _at(x, slice(7, 10))
    r64, r32 = _oracle(gather()), _oracle(gather(), torch.float32)
    o = p.verify(**d, layer=0, slots=s)
    o64, dr64 = ref.verify(**{n: y.double() for n, y in d.items()}, buffer=r64)
    o32, dr32 = ref.verify(**d, buffer=r32)
    _assert_outputs("pool verify.o", o, o64, o32)
    _assert_rounded("pool du", p.tensors()["du"][0, s], dr64.u)
    counts = torch.tensor([3, 2, 0], device=DEVICE)  # lengths 3: requests 0 and 1 pass C and fold
    p.accept(layer=0, slots=s, counts=counts)
    _assert_buffer("pool accept", gather(), ref.accept(r64, dr64, counts=counts), ref.accept(r32, dr32, counts=counts))
    r64, r32 = _oracle(gather()), _oracle(gather(), torch.float32)
    count = torch.tensor([1, 2, 0], device=DEVICE)
    p.flush(layer=0, slots=s, count=count)
    _assert_buffer("pool flush", gather(), ref.flush(r64, count=count), ref.flush(r32, count=count))
    S = p.state_of(layer=0, slots=s)
    assert S.dtype == low
    _assert_rounded("pool state_of", S, ref.materialize_state(_oracle(gather())))


def test_the_reference_computes_wide_and_rounds_where_it_writes():
    """kvbuffer_ref on 16-bit fields: the fold dtype is the widest field's (16-bit fields are a stored
    precision), and a flush's state is the float64 fold rounded once."""
    fb = _new_buffer(torch.float16, torch.float16, False)
    x = _tokens(31, C, False)
    for t in range(C):
        fast.buffered_decode(**_at(x, t), buffer=fb)
    r = _oracle(fb)
    assert fold_dtype(r) == torch.float64 and fold_dtype(fb) == torch.float32
    wide = r.replace(state=r.state.double(), u=r.u.double())
    assert torch.equal(ref.flush(r).state, ref.flush(wide).state.to(torch.float16))
    assert ref.flush(r).u.dtype == torch.float16


def test_dtype_errors_name_the_argument():
    fb = _new_buffer(torch.float16, torch.float32, False)
    x = _at(_tokens(41, 1, False), 0)
    with pytest.raises(TypeError, match=r"buffer\.G: .*float32"):
        fast.buffered_decode(**x, buffer=fb.replace(G=fb.G.half()))
    with pytest.raises(TypeError, match=r"buffer\.state: .*float32, bfloat16 or float16.*float64"):
        fast.flush(fb.replace(state=fb.state.double()))
    with pytest.raises(TypeError, match=r"buffer\.u: .*float64"):
        fast.verify(**x, buffer=fb.replace(u=fb.u.double()))
    kw = dict(layers=1, num_state_slots=1, num_buffer_slots=1, capacity=C, max_drafts=1, num_heads=H,
              num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=DEVICE)
    with pytest.raises(TypeError, match=r"state_dtype: .*float64"):
        KVPool(state_dtype=torch.float64, **kw)
    with pytest.raises(TypeError, match=r"dtype: .*float64"):
        KVPool(dtype=torch.float64, **kw)
