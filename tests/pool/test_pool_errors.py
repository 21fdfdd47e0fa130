"""Bad input to either pool (kvbuffer_ref.KVPool, kvbuffer_fast.pool.KVPool on the interpreter): unknown,
released and out-of-range slots for every operation, index and argument dtypes and devices, decode or
flush with drafts pending, accept without verify, counts / nodes / keep / count out of range, a full pool
(buffer slots and state slots), tokens that are not the pool's.  Each must raise a ValueError or TypeError
whose message starts with the name of the offending argument, and leave every tensor of the pool
(``tensors()``, refs included) bit-identical to before the call.

The pool of every case (``_busy``): 2 layers, N = 5 buffer slots, C = 3, D = 3.  Slots 0..3 were
acquired and admitted (layer 0: 4 tokens, a state and one entry; layer 1: 2 tokens, direct mode), then 1
and 3 were released: live {0, 2}, released {1, 3} (a case that needs a fresh slot acquires 1 first),
never acquired {4}.  Another device is the ``meta`` device (no second device is needed to be wrong).
"""

import copy
import functools
import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvbuffer_fast.pool import KVPool as FastPool  # noqa: E402
from kvbuffer_ref.pool import KVPool as RefPool  # noqa: E402

from .schedule import Tokens, snapshot  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OTHER = "meta"  # a device that is not the pool's
LIVE, RELEASED, NEVER, N = (0, 2), 3, 4, 5


@functools.lru_cache(maxsize=None)
def _template(kind: str, S: int):
    P, dtype = (RefPool, torch.float64) if kind == "ref" else (FastPool, torch.float32)
    p = P(layers=2, num_state_slots=S, num_buffer_slots=N, capacity=3, max_drafts=3, num_heads=1, num_value_heads=2,
          head_k_dim=4, head_v_dim=4, dtype=dtype, device=DEVICE)
    tok = Tokens(0, 1, 2, 4, 4, dtype, "cpu")
    s = p.acquire(4)
    p.admit(**_dev(tok.draw(4, 4)), layer=0, slots=s)
    p.admit(**_dev(tok.draw(4, 2)), layer=1, slots=s)
    p.release(torch.tensor([1, RELEASED], device=DEVICE))
    return p, dtype


def _busy(kind: str, S: int = 4):
    """A copy of the busy pool (module docstring) and a token source of its dtype."""
    p, dtype = _template(kind, S)
    return copy.deepcopy(p), Tokens(1, 1, 2, 4, 4, dtype, "cpu")


def _dev(x: dict, device=DEVICE) -> dict:
    return {f: t.to(device) for f, t in x.items()}


def _t(*x, **kw) -> torch.Tensor:
    return torch.tensor(x, device=DEVICE, **kw)


def assert_identical(pool, before: dict, what: str) -> None:
    """Every tensor of the pool bit-identical to ``before`` (NaN equal to NaN)."""
    for name, t in pool.tensors().items():
        b = before[name]
        same = bool(((t == b) | (t.isnan() & b.isnan())).all()) if t.dtype.is_floating_point else torch.equal(t, b)
        assert same, f"{what}: the rejected call changed the pool's {name}"


def _rejects(p, call, arg: str, what: str) -> None:
    before = snapshot(p)
    with pytest.raises((ValueError, TypeError)) as e:
        call()
    assert str(e.value).startswith(f"{arg}:") or str(e.value).startswith(f"{arg} "), \
        f"{what}: the error does not name {arg!r} first: {type(e.value).__name__}: {e.value}"
    assert_identical(p, before, what)


# ---------------------------------------------------------------------------------------------- slots
BAD_SLOTS = {  # name: (a function of the call's valid entries -> slots, the error)
    "released": lambda ok: _t(ok[0], RELEASED),
    "never acquired": lambda ok: _t(NEVER, ok[0]),
    "past the pool": lambda ok: _t(ok[0], N),
    "below -1": lambda ok: _t(-2, ok[0]),
    "duplicate": lambda ok: _t(ok[0], -1, ok[0]),
    "float": lambda ok: _t(*ok, dtype=torch.float32),
    "int16": lambda ok: _t(*ok, dtype=torch.int16),
    "uint8": lambda ok: _t(*ok, dtype=torch.uint8),
    "rank 2": lambda ok: _t(ok)[None],
    "a list": lambda ok: list(ok),
    "another device": lambda ok: _t(*ok).to(OTHER),
}
OPS = ("admit", "decode", "verify", "accept", "flush", "state_of", "release", "fork src", "fork dst")


def _rows(slots) -> int:
    return slots.shape[-1] if isinstance(slots, torch.Tensor) else len(slots)


def _slot_call(p, tok, op: str, make):
    """(the call of ``op`` with the bad slots ``make(valid entries)``, the argument's name)."""
    if op == "admit":
        fresh = int(p.acquire(1))
        slots = make((fresh,))
        return lambda: p.admit(**_dev(tok.draw(_rows(slots), 2)), layer=0, slots=slots), "slots"
    if op == "fork dst":
        fresh = int(p.acquire(1))
        dst = make((fresh,))
        src = _t(*([LIVE[0]] + [-1] * (_rows(dst) - 1)))
        return lambda: p.fork(src=src, dst=dst, keep=0), "dst"
    slots = make(LIVE)
    B = _rows(slots)
    if op == "fork src":
        fresh = p.acquire(1).tolist()
        dst = _t(*(fresh + [-1] * (B - 1)))
        return lambda: p.fork(src=slots, dst=dst, keep=0), "src"
    if op == "accept":
        p.verify(**_dev(tok.draw(2, 2)), layer=0, slots=_t(*LIVE))
        return lambda: p.accept(layer=0, slots=slots, counts=0), "slots"
    calls = {"decode": lambda: p.decode(**_dev(tok.draw(B, 1)), layer=0, slots=slots),
             "verify": lambda: p.verify(**_dev(tok.draw(B, 2)), layer=0, slots=slots),
             "flush": lambda: p.flush(layer=0, slots=slots),
             "state_of": lambda: p.state_of(layer=0, slots=slots),
             "release": lambda: p.release(slots)}
    return calls[op], "slots"


@pytest.mark.parametrize("bad", list(BAD_SLOTS))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_bad_slots(kind, op, bad):
    """Every operation rejects every kind of bad slot index tensor, naming it, and changes nothing."""
    p, tok = _busy(kind)
    call, arg = _slot_call(p, tok, op, BAD_SLOTS[bad])
    _rejects(p, call, arg, f"{kind} {op} with {bad} slots")


@pytest.mark.parametrize("op", ["admit", "decode", "verify", "accept", "flush", "state_of"])
@pytest.mark.parametrize("layer", [-1, 2, True, 0.0, None])
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_bad_layer(kind, op, layer):
    p, tok = _busy(kind)
    s = _t(*LIVE)
    calls = {"admit": lambda: p.admit(**_dev(tok.draw(1, 2)), layer=layer, slots=p.acquire(1)),
             "decode": lambda: p.decode(**_dev(tok.draw(2, 1)), layer=layer, slots=s),
             "verify": lambda: p.verify(**_dev(tok.draw(2, 2)), layer=layer, slots=s),
             "accept": lambda: p.accept(layer=layer, slots=s, counts=0),
             "flush": lambda: p.flush(layer=layer, slots=s),
             "state_of": lambda: p.state_of(layer=layer, slots=s)}
    if op == "admit":
        fresh = p.acquire(1)
        calls["admit"] = lambda: p.admit(**_dev(tok.draw(1, 2)), layer=layer, slots=fresh)
    if op == "accept":
        p.verify(**_dev(tok.draw(2, 2)), layer=0, slots=s)
        if layer is None:  # every layer: layer 1 has no drafts pending, so nothing is written in layer 0 either
            _rejects(p, calls[op], "slots", f"{kind} accept of every layer with drafts pending in layer 0 only")
            return
    _rejects(p, calls[op], "layer", f"{kind} {op} at layer {layer!r}")


# ---------------------------------------------------------------------------------------------- tokens
def _bad_tokens(tok, B: int, T: int, how: str) -> tuple[dict, str]:
    """Tokens for B rows of T tokens broken in one way, and the argument the error must name."""
    x = tok.draw(B, T)
    dtype = x["q"].dtype
    if how == "q/k heads":
        return Tokens(0, 2, 2, 4, 4, dtype, "cpu").draw(B, T), "q"
    if how == "value heads":
        return Tokens(0, 1, 4, 4, 4, dtype, "cpu").draw(B, T), "v"
    if how == "K":
        return Tokens(0, 1, 2, 8, 4, dtype, "cpu").draw(B, T), "q"
    if how == "V":
        return Tokens(0, 1, 2, 4, 8, dtype, "cpu").draw(B, T), "v"
    if how == "per-channel gate":
        return dict(x, g=-torch.rand(B, T, 2, 4, dtype=dtype)), "g"
    if how == "integer q":
        return dict(x, q=torch.zeros(B, T, 1, 4, dtype=torch.int64)), "q"
    if how == "rows":
        return dict(x, v=tok.draw(B + 1, T)["v"]), "v"
    if how == "NaN gate":
        g = x["g"].clone()
        g[0, 0, 0] = float("nan")
        return dict(x, g=g), "g"
    raise AssertionError(how)


TOKEN_FAULTS = ["q/k heads", "value heads", "K", "V", "per-channel gate", "integer q", "rows", "NaN gate"]


@pytest.mark.parametrize("how", TOKEN_FAULTS)
@pytest.mark.parametrize("op", ["admit", "decode", "verify"])
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_tokens_that_are_not_the_pools(kind, op, how):
    p, tok = _busy(kind)
    if op == "admit":
        s, T = p.acquire(1), 5        # T > C: the prompt would fold into a state slot
    else:
        s, T = _t(*LIVE), (1 if op == "decode" else 2)
    x, arg = _bad_tokens(tok, _rows(s), T, how)
    fn = getattr(p, op)
    _rejects(p, lambda: fn(**_dev(x), layer=0, slots=s), arg, f"{kind} {op} with {how}")


@pytest.mark.parametrize("op", ["admit", "decode", "verify"])
@pytest.mark.parametrize("kind, field", [("ref", "q"), ("ref", "v"), ("ref", "g"),
                                         ("fast", "q"),
                                         ("fast", "v"), ("fast", "g")])
def test_tokens_on_another_device(kind, op, field):
    """Tokens on a device that is not the pool's (all of them: field q, or one field)."""
    p, tok = _busy(kind)
    s = p.acquire(1) if op == "admit" else _t(*LIVE)
    T = {"admit": 5, "decode": 1, "verify": 2}[op]
    x = _dev(tok.draw(_rows(s), T))
    x = _dev(x, OTHER) if field == "q" else dict(x, **{field: x[field].to(OTHER)})
    fn = getattr(p, op)
    _rejects(p, lambda: fn(**x, layer=0, slots=s), field, f"{kind} {op} with {field} on {OTHER}")


def test_decode_takes_one_token():
    for kind in ("ref", "fast"):
        p, tok = _busy(kind)
        _rejects(p, lambda: p.decode(**_dev(tok.draw(2, 2)), layer=0, slots=_t(*LIVE)), "q", f"{kind} decode T=2")


# ---------------------------------------------------------------------------------------------- admit
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_admit_rules(kind):
    p, tok = _busy(kind)
    fresh = p.acquire(1)
    cases = [
        (lambda: p.admit(**_dev(tok.draw(2, 2)), layer=0, slots=_t(int(fresh), LIVE[0])), "slots"),  # not fresh
        (lambda: p.admit(**_dev(tok.draw(1, 5)), layer=0, slots=fresh, tail=4), "tail"),            # tail > C
        (lambda: p.admit(**_dev(tok.draw(1, 5)), layer=0, slots=fresh, tail=-1), "tail"),
        (lambda: p.admit(**_dev(tok.draw(1, 5)), layer=0, slots=fresh,
                         initial_state=torch.zeros(1, 3, 4, 4, dtype=p.u.dtype, device=DEVICE)), "initial_state"),
        (lambda: p.admit(**_dev(tok.draw(1, 5)), layer=0, slots=fresh,                            # 2 rows, B = 1
                         initial_state=torch.zeros(2, 2, 4, 4, dtype=p.u.dtype, device=DEVICE)), "initial_state"),
        (lambda: p.admit(**_dev(tok.draw(2, 5)), layer=0, slots=_t(int(fresh), -1),              # 1 row, B = 2
                         initial_state=torch.zeros(1, 2, 4, 4, dtype=p.u.dtype, device=DEVICE)), "initial_state"),
        (lambda: p.admit(**_dev(dict(tok.draw(1, 5), v=tok.draw(1, 4)["v"])), layer=0, slots=fresh,  # packed v short
                         cu_seqlens=_t(0, 5)), "v"),
        (lambda: p.admit(**_dev(dict(tok.draw(1, 5), g=tok.draw(1, 7)["g"])), layer=0, slots=fresh,  # packed g long
                         cu_seqlens=_t(0, 5)), "g"),
    ]
    for i, (call, arg) in enumerate(cases):
        _rejects(p, call, arg, f"{kind} admit case {i}")


# ---------------------------------------------------------------------------------------------- drafts
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_pending_drafts_block_decode_and_flush(kind):
    p, tok = _busy(kind)
    s = _t(*LIVE)
    p.verify(**_dev(tok.draw(2, 2)), layer=0, slots=s)
    _rejects(p, lambda: p.decode(**_dev(tok.draw(2, 1)), layer=0, slots=s), "slots", f"{kind} decode, pending")
    _rejects(p, lambda: p.flush(layer=0, slots=s), "slots", f"{kind} flush, pending")
    _rejects(p, lambda: p.flush(layer=0, slots=s, count=0), "slots", f"{kind} flush 0, pending")
    # one pending request among idle ones, behind a pad
    p.accept(layer=0, slots=s[1:], counts=0)
    _rejects(p, lambda: p.decode(**_dev(tok.draw(3, 1)), layer=0, slots=_t(LIVE[1], -1, LIVE[0])), "slots",
             f"{kind} decode, one pending")


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_accept_without_verify(kind):
    p, tok = _busy(kind)
    s = _t(*LIVE)
    _rejects(p, lambda: p.accept(layer=0, slots=s, counts=0), "slots", f"{kind} accept, no verify")
    p.verify(**_dev(tok.draw(1, 2)), layer=0, slots=s[:1])
    _rejects(p, lambda: p.accept(layer=0, slots=s, counts=0), "slots", f"{kind} accept, one not verified")
    _rejects(p, lambda: p.accept(layer=1, slots=s[:1], counts=0), "slots", f"{kind} accept, verified elsewhere")
    p.accept(layer=0, slots=s[:1], counts=1)
    _rejects(p, lambda: p.accept(layer=0, slots=s[:1], counts=0), "slots", f"{kind} accept twice")


ACCEPT_FAULTS = {  # name: (accept kwargs for rows [LIVE[0], -1, LIVE[1]] after a chain of 2 drafts, the argument)
    "count past the drafts": (dict(counts=_t(0, 0, 3)), "counts"),
    "count past num_drafts": (dict(counts=_t(2, 0, 0)), "counts"),   # row 0 verified 1 draft
    "negative count": (dict(counts=-1), "counts"),
    "float counts": (dict(counts=_t(0, 0, 1, dtype=torch.float32)), "counts"),
    "bool count": (dict(counts=True), "counts"),
    "counts of 2 rows": (dict(counts=_t(0, 0)), "counts"),
    "counts on another device": (dict(counts=_t(0, 0, 0).to(OTHER)), "counts"),
    "node past the drafts": (dict(nodes=_t(0, 0, 2)), "nodes"),
    "node past num_drafts": (dict(nodes=_t(1, 0, 0)), "nodes"),
    "node below -1": (dict(nodes=-2), "nodes"),
    "float nodes": (dict(nodes=_t(0, 0, 0, dtype=torch.float64)), "nodes"),
    "nodes on another device": (dict(nodes=_t(0, 0, 0).to(OTHER)), "nodes"),
    "counts and nodes": (dict(counts=0, nodes=0), "accept"),
    "neither": (dict(), "accept"),
}


@pytest.mark.parametrize("fault", list(ACCEPT_FAULTS))
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_accept_out_of_range(kind, fault):
    p, tok = _busy(kind)
    s = _t(LIVE[0], -1, LIVE[1])
    p.verify(**_dev(tok.draw(3, 2)), layer=0, slots=s, num_drafts=_t(1, 0, 2))
    kw, arg = ACCEPT_FAULTS[fault]
    _rejects(p, lambda: p.accept(layer=0, slots=s, **kw), arg, f"{kind} accept with {fault}")


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_counts_on_tree_drafts(kind):
    """counts take the first m drafts of a chain; a tree's accepted path is a node."""
    p, tok = _busy(kind)
    s = _t(*LIVE)
    p.verify(**_dev(tok.draw(2, 3)), layer=0, slots=s, parents=_t([-1, -1, 0], [-1, 0, 1]))
    _rejects(p, lambda: p.accept(layer=0, slots=s, counts=_t(2, 0)), "counts", f"{kind} counts on a tree")


VERIFY_FAULTS = {  # name: (verify kwargs for 2 rows of 2 drafts, the argument)
    "parents past the drafts": (dict(parents=_t([-1, 1], [-1, 0])), "parents"),
    "parents below -1": (dict(parents=_t([-1, 0], [-2, 0])), "parents"),
    "parents of 3 drafts": (dict(parents=_t([-1, 0, 1], [-1, 0, 1])), "parents"),
    "float parents": (dict(parents=_t([-1.0, 0.0], [-1.0, 0.0])), "parents"),
    "parents on another device": (dict(parents=_t([-1, 0], [-1, 0]).to(OTHER)), "parents"),
    "num_drafts past D'": (dict(num_drafts=_t(2, 3)), "num_drafts"),
    "negative num_drafts": (dict(num_drafts=_t(2, -1)), "num_drafts"),
    "num_drafts of 1 row": (dict(num_drafts=_t(2)), "num_drafts"),
    "float num_drafts": (dict(num_drafts=_t(2.0, 2.0)), "num_drafts"),
    "num_drafts on another device": (dict(num_drafts=_t(2, 2).to(OTHER)), "num_drafts"),
}
@pytest.mark.parametrize("fault", list(VERIFY_FAULTS))
def test_verify_out_of_range_fast(fault):
    p, tok = _busy("fast")
    kw, arg = VERIFY_FAULTS[fault]
    _rejects(p, lambda: p.verify(**_dev(tok.draw(2, 2)), layer=0, slots=_t(*LIVE), **kw), arg, f"fast verify {fault}")


@pytest.mark.parametrize("fault", list(VERIFY_FAULTS))
def test_verify_out_of_range_ref(fault):
    p, tok = _busy("ref")
    kw, arg = VERIFY_FAULTS[fault]
    _rejects(p, lambda: p.verify(**_dev(tok.draw(2, 2)), layer=0, slots=_t(*LIVE), **kw), arg, f"ref verify {fault}")


FOLD_FAULTS = {  # verify(fold=...) on 2 rows: (fold, the error's type)
    "fold of 3 rows": (_t(True, False, True), ValueError),
    "fold of rank 2": (_t([True, False]), ValueError),
    "int64 fold": (_t(1, 0), ValueError),
    "fold on another device": (_t(True, False).to(OTHER), ValueError),
    "fold a list": ([True, False], TypeError),
    "fold an int": (1, TypeError),
}


@pytest.mark.parametrize("fault", list(FOLD_FAULTS))
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_verify_fold_rules(kind, fault):
    """verify's fold: False, True or a bool tensor [B] on the pool's device; the error names fold, its
    shape and what was expected."""
    p, tok = _busy(kind)
    fold, error = FOLD_FAULTS[fault]
    before = snapshot(p)
    with pytest.raises(error, match=r"^fold: expected (a bool or a bool tensor \[B\] = \[2\]|a tensor on the pool)"):
        p.verify(**_dev(tok.draw(2, 2)), layer=0, slots=_t(*LIVE), fold=fold)
    assert_identical(p, before, f"{kind} verify with {fault}")


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_verify_past_the_draft_room(kind):
    p, tok = _busy(kind)
    _rejects(p, lambda: p.verify(**_dev(tok.draw(2, 4)), layer=0, slots=_t(*LIVE)), "q", f"{kind} verify D' > D")


# ---------------------------------------------------------------------------------------------- flush / fork
FLUSH_FAULTS = {  # rows [LIVE[0], -1, LIVE[1]]; layer 0 holds one entry each
    "count past the entries": dict(count=_t(0, 0, 2)),
    "negative count": dict(count=-1),
    "int count past the entries": dict(count=2),
    "float count": dict(count=_t(0.0, 0.0, 0.0)),
    "count of 2 rows": dict(count=_t(0, 0)),
    "count on another device": dict(count=_t(0, 0, 0).to(OTHER)),
}


@pytest.mark.parametrize("fault", list(FLUSH_FAULTS))
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_flush_out_of_range(kind, fault):
    p, _ = _busy(kind)
    _rejects(p, lambda: p.flush(layer=0, slots=_t(LIVE[0], -1, LIVE[1]), **FLUSH_FAULTS[fault]), "count",
             f"{kind} flush with {fault}")


FORK_FAULTS = {  # (src, dst (None: one fresh slot), keep, the argument); layer 0 holds 1 entry, layer 1 2
    "keep past the entries": (_t(LIVE[0]), None, 2, "keep"),        # 2 > layer 0's one entry
    "negative keep": (_t(LIVE[0]), None, -1, "keep"),
    "float keep": (_t(LIVE[0]), None, 1.0, "keep"),
    "keep tensor past": (_t(LIVE[0]), None, _t(2), "keep"),
    "float keep tensor": (_t(LIVE[0]), None, _t(0.0), "keep"),
    "keep of 2 rows": (_t(LIVE[0]), None, _t(0, 0), "keep"),
    "keep on another device": (_t(LIVE[0]), None, _t(0).to(OTHER), "keep"),
    "dst not fresh": (_t(LIVE[0]), _t(LIVE[1]), 0, "dst"),
    "dst is the src": (_t(LIVE[0]), _t(LIVE[0]), 0, "dst"),
    "dst of 2 rows": (_t(LIVE[0]), "two", 0, "dst"),
}


@pytest.mark.parametrize("fault", list(FORK_FAULTS))
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_fork_rules(kind, fault):
    p, _ = _busy(kind)
    src, dst, keep, arg = FORK_FAULTS[fault]
    if dst is None:
        dst = p.acquire(1).to(DEVICE)
    elif isinstance(dst, str):
        dst = p.acquire(2).to(DEVICE)
    _rejects(p, lambda: p.fork(src=src, dst=dst, keep=keep), arg, f"{kind} fork with {fault}")


# ---------------------------------------------------------------------------------------------- a full pool
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_full_buffer_pool(kind):
    p, _ = _busy(kind)
    _rejects(p, lambda: p.acquire(4), "n", f"{kind} acquire 4 of 3 free")
    for n in (-1, 1.0, True, None):
        _rejects(p, lambda: p.acquire(n), "n", f"{kind} acquire({n!r})")
    p.acquire(3)
    _rejects(p, lambda: p.acquire(1), "n", f"{kind} acquire from a full pool")


@pytest.mark.parametrize("op", ["admit", "decode", "accept", "flush", "verify fold"])
@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_no_free_state_slot(kind, op):
    """Four state slots, all held (slots 0..3 folded in layer 0): a fold of request 4 in that layer is
    rejected; a request that holds a slot of its own still folds into it."""
    p, tok = _busy(kind, S=4)
    p.admit(**_dev(tok.draw(2, 4)), layer=0, slots=p.acquire(2))   # slots 1, 3: the two free state slots
    last = p.acquire(1)                                              # slot 4, the last buffer slot
    assert int(p.refs[0].min()) == 1
    s = _t(LIVE[0], -1, int(last))
    if op == "admit":
        call = lambda: p.admit(**_dev(tok.draw(1, 4)), layer=0, slots=last)  # noqa: E731  T > C folds
    else:
        p.admit(**_dev(tok.draw(1, 3)), layer=0, slots=last)         # C = 3: full, in direct mode
        if op == "decode":
            call = lambda: p.decode(**_dev(tok.draw(3, 1)), layer=0, slots=s)  # noqa: E731  the full one folds
        elif op == "accept":
            p.verify(**_dev(tok.draw(3, 1)), layer=0, slots=s)
            call = lambda: p.accept(layer=0, slots=s, counts=1)  # noqa: E731  3 + 1 > C
        elif op == "verify fold":  # the last request's 3 entries would fold
            call = lambda: p.verify(**_dev(tok.draw(3, 1)), layer=0, slots=s, fold=_t(False, True, True))  # noqa: E731
        else:
            call = lambda: p.flush(layer=0, slots=s, count=_t(0, 0, 1))  # noqa: E731
    _rejects(p, call, "slots", f"{kind} {op} with no free state slot")
    if op == "flush":  # a request with a slot of its own folds in place: no free slot needed
        p.flush(layer=0, slots=_t(LIVE[0]))


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_accept_without_fold(kind):
    """accept(fold=False), the caller's word that no row passes the capacity: where one does (a chain of 3
    accepted onto buffered entries, C = 3), a ValueError naming fold, before anything is written; where none
    does, the pool bit-identical to accept()'s."""
    p, tok = _busy(kind)
    s = _t(*LIVE)
    assert bool((p.tensors()["lengths"][0, list(LIVE)] > 0).all()), "the rows must hold entries"
    p.verify(**_dev(tok.draw(2, 3)), layer=0, slots=s)
    q = copy.deepcopy(p)
    _rejects(p, lambda: p.accept(layer=0, slots=s, counts=3, fold=False), "fold", f"{kind} accept(fold=False)")
    _rejects(p, lambda: p.accept(layer=0, slots=s, counts=0, fold=0), "fold", f"{kind} accept(fold=0)")
    p.accept(layer=0, slots=s, counts=_t(0, 1), fold=False)
    q.accept(layer=0, slots=s, counts=_t(0, 1))
    assert_identical(p, snapshot(q), f"{kind} accept(fold=False) against accept()")
