"""kvbuffer_ref.KVPool: drawn schedules against each request run alone through the float64 recurrence,
pads that read and write nothing, the head layout of tensor-parallel shards, and bad input (an error
naming the argument, the pool bit-identical after the rejected call)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbuffer_ref.pool import KVPool, head_layout

from .schedule import assert_untouched, run_schedule, sharers_fold_in_one_call, snapshot

SHAPES = dict(layers=2, N=5, C=3, D=3, H=1, HV=2, K=4, V=4)


def _pool(layers, N, C, D, H, HV, K, V, S=None, dtype=torch.float64, **kw):
    return KVPool(layers=layers, num_state_slots=N if S is None else S, num_buffer_slots=N, capacity=C,
                  max_drafts=D, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=dtype, **kw)


@settings(deadline=None)
@given(data=st.data(), C=st.sampled_from([1, 3, 4]), group=st.sampled_from([1, 2]))
def test_schedules_match_each_request_alone(data, C, group):
    """Any schedule of admit / decode / verify / accept / flush / fork / release, with pads and int32 or
    int64 indices: every request's outputs and final state are the float64 recurrence over its own tokens."""
    shapes = dict(SHAPES, C=C, HV=group)
    chk = run_schedule(lambda: _pool(**shapes), data, dtype=torch.float64, device="cpu", steps=12, **shapes)
    assert chk.compared > 0  # the first step admits: its outputs at least were compared


@settings(deadline=None, max_examples=4)
@given(data=st.data())
def test_shard_pool_runs_the_shard_heads(data):
    """A pool for the head range (2, 4) of a model with 2 q/k heads and 4 value heads holds 1 q/k head and
    2 value heads and computes them as any pool of those heads."""
    p = _pool(**dict(SHAPES, H=2, HV=4), head_range=(2, 4))
    assert (p.num_heads, p.num_value_heads, p.key_head_start) == (1, 2, 1)
    run_schedule(lambda: p, data, dtype=torch.float64, device="cpu", steps=6, **SHAPES)


def test_head_layout():
    assert head_layout(16, 32) == (0, 16, 32)
    assert head_layout(16, 32, (16, 32)) == (8, 8, 16)        # tp = 2
    assert head_layout(16, 32, (3, 4)) == (1, 1, 1)           # one value head: its group's q/k head
    assert head_layout(2, 8, (2, 6)) == (0, 2, 4)             # two half groups: 2 value heads per q/k head
    with pytest.raises(ValueError, match="head_range.*unevenly"):
        head_layout(2, 4, (1, 4))                             # 1 value head of group 0, 2 of group 1
    with pytest.raises(ValueError, match="head_range"):
        head_layout(2, 4, (0, 5))
    with pytest.raises(TypeError, match="head_range"):
        head_layout(2, 4, (0.0, 2))


@pytest.mark.parametrize("op", ["decode", "accept", "flush", "verify"])
def test_sharers_fold_in_one_call(op):
    """A request and its fork fold their shared state slot in one call: each ends in a slot of its own,
    both exact."""
    sharers_fold_in_one_call(_pool(**dict(SHAPES, layers=1, C=1)), op, dtype=torch.float64, device="cpu")


def _same_pools(a: KVPool, b: KVPool, what: str) -> None:
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        same = bool(((x == y) | (x.isnan() & y.isnan())).all()) if x.dtype.is_floating_point else torch.equal(x, y)
        assert same, f"{what}: the pools' {name} differ"


@settings(deadline=None, max_examples=10)
@given(data=st.data(), C=st.sampled_from([1, 3, 4]), channel=st.booleans())
def test_verify_fold_is_flush_then_verify(data, C, channel):
    """verify(fold=...) (True or per-row flags, pads' flags junk) is flush of the folding rows then verify,
    bit for bit: every tensor of the pool after it, and after the same accept.  Requests in direct mode and
    with states, with entries or none, forks sharing a state slot with a request outside the call or inside
    it; chains and trees, ragged draft counts, pad rows."""
    from .schedule import Tokens, _padded
    L = 2
    pools = [KVPool(layers=L, num_state_slots=10, num_buffer_slots=8, capacity=C, max_drafts=3, num_heads=1,
                    num_value_heads=2, head_k_dim=4, head_v_dim=4, channel_gate=channel) for _ in range(2)]
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    T = [data.draw(st.integers(1, 2 * C + 1), label="prompt") for _ in range(4)]
    keep = [data.draw(st.integers(0, min(T[i], C) if T[i] <= C else T[i] % C), label="keep") for i in range(2)]
    chosen = data.draw(st.lists(st.sampled_from(range(6)), min_size=1, unique=True), label="rows")
    pads = data.draw(st.integers(0, 2), label="pads")
    entries = list(chosen)
    for _ in range(pads):
        entries.insert(data.draw(st.integers(0, len(entries)), label="pad row"), -1)
    B, Dn = len(entries), data.draw(st.integers(1, 3), label="drafts")
    tree = data.draw(st.booleans(), label="tree")
    parents = torch.tensor([[data.draw(st.integers(-1, i - 1), label="parent") if tree else i - 1 for i in range(Dn)]
                            for _ in range(B)])
    num_drafts = torch.tensor([data.draw(st.integers(0, Dn), label="num_drafts") for _ in range(B)])
    flags = data.draw(st.one_of(st.just(True), st.lists(st.booleans(), min_size=B, max_size=B)), label="fold")
    fold = flags if flags is True else torch.tensor(flags)
    nodes = torch.tensor([data.draw(st.integers(-1, int(n) - 1), label="node") for n in num_drafts])
    spread = torch.linspace(0.5, 1.5, 4, dtype=torch.float64)
    outs = []
    for p in pools:
        tok = Tokens(seed, 1, 2, 4, 4, torch.float64, "cpu")

        def draw(n, t):
            x = tok.draw(n, t)
            return dict(x, g=x["g"][..., None] * spread) if channel else x
        s = p.acquire(4)
        for layer in range(L):
            for i in range(4):
                p.admit(**draw(1, T[i]), layer=layer, slots=s[i:i + 1])
        p.fork(src=s[:2], dst=p.acquire(2), keep=torch.tensor(keep))  # slots 4, 5 share 0's and 1's states
        rows = torch.tensor(entries)
        xs = [_padded(draw(len(chosen), Dn), entries) for _ in range(L)]
        if p is pools[0]:
            outs.append([p.verify(**xs[layer], layer=layer, slots=rows, parents=parents, num_drafts=num_drafts,
                                  fold=fold) for layer in range(L)])
        else:
            folding = torch.where((rows >= 0) & (torch.ones(B, dtype=torch.bool) if flags is True else fold), rows, -1)
            outs.append([])
            for layer in range(L):
                p.flush(layer=layer, slots=folding)
                outs[-1].append(p.verify(**xs[layer], layer=layer, slots=rows, parents=parents,
                                         num_drafts=num_drafts))
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "verify(fold) vs flush + verify: the outputs differ"
    _same_pools(*pools, "verify(fold) vs flush + verify")
    for p in pools:
        p.accept(slots=torch.tensor(entries), nodes=nodes)
    _same_pools(*pools, "then accept")


def _token(B, T=1, H=1, HV=2, K=4, V=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
                k=torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1),
                v=torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64),
                g=-torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
                beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64))


def _busy_pool(S=None):
    p = _pool(**SHAPES, S=S)
    s = p.acquire(3)
    p.admit(**_token(3, T=4), layer=0, slots=s)
    p.admit(**_token(3, T=2), layer=1, slots=s)
    p.release(s[1:2])
    return p, s


@pytest.mark.parametrize("slots, error, match", [
    (torch.tensor([0, 5]), ValueError, r"slots: entry \[1\] is 5, expected a slot in 0..4 or -1"),
    (torch.tensor([-2]), ValueError, r"slots: entry \[0\] is -2"),
    (torch.tensor([0, 2, 0]), ValueError, "slots: slot 0 appears more than once"),
    (torch.tensor([1]), ValueError, r"slots: entry \[0\] is slot 1, which holds no live request"),
    (torch.tensor([3]), ValueError, "holds no live request"),
    (torch.tensor([0.0]), TypeError, "slots: expected an int32 or int64 tensor"),
    (torch.tensor([0], dtype=torch.int16), TypeError, "slots: expected an int32 or int64"),
    (torch.tensor([[0]]), ValueError, r"slots: expected a \[B\] tensor"),
    ([0], TypeError, "slots: expected a torch.Tensor"),
])
@pytest.mark.parametrize("op", ["decode", "flush", "release", "state_of", "verify"])
def test_bad_slots_name_the_argument_and_change_nothing(op, slots, error, match):
    p, _ = _busy_pool()
    before = snapshot(p)
    B = slots.shape[0] if isinstance(slots, torch.Tensor) and slots.dim() == 1 else 1
    with pytest.raises(error, match=match):
        if op == "decode":
            p.decode(**_token(B), layer=0, slots=slots)
        elif op == "verify":
            p.verify(**_token(B, T=2), layer=0, slots=slots)
        elif op == "flush":
            p.flush(layer=0, slots=slots)
        elif op == "release":
            p.release(slots)
        else:
            p.state_of(layer=0, slots=slots)
    assert_untouched(p, before, [], f"rejected {op}")


def test_other_bad_input_changes_nothing():
    p, s = _busy_pool()
    before = snapshot(p)
    live = s[[0, 2]]
    cases = [
        (lambda: p.decode(**_token(2), layer=2, slots=live), ValueError, "layer: expected an int in 0..1"),
        (lambda: p.decode(**_token(3), layer=0, slots=live), ValueError, "q: expected 2 rows"),
        (lambda: p.accept(layer=0, slots=live, counts=0), ValueError, "no verified drafts pending"),
        (lambda: p.verify(**_token(2, T=4), layer=0, slots=live), ValueError, "max_drafts=3"),
        (lambda: p.admit(**_token(2, T=2), layer=0, slots=live), ValueError, "already holds entries"),
        (lambda: p.acquire(4), ValueError, "only 3 of 5 are free"),
        (lambda: p.fork(src=live, dst=live[:1], keep=0), ValueError, "dst: expected 2 entries"),
        (lambda: p.fork(src=live[:1], dst=torch.tensor([1]), keep=0), ValueError, "dst.*no live request"),
        (lambda: p.flush(layer=0, slots=live, count=torch.tensor([0, 9])), ValueError, "count"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
        assert_untouched(p, before, [], f"rejected call ({match})")
    p.verify(**_token(2, T=2), layer=0, slots=live)
    before = snapshot(p)
    for call, match in [(lambda: p.decode(**_token(2), layer=0, slots=live), "pending.*before decode"),
                        (lambda: p.accept(layer=0, slots=live, counts=torch.tensor([0, 3])), "counts"),
                        (lambda: p.accept(layer=0, slots=live, nodes=torch.tensor([2, 0])), "nodes")]:
        with pytest.raises(ValueError, match=match):
            call()
        assert_untouched(p, before, [], f"rejected call ({match})")


def test_full_state_pool_is_an_error_before_anything_is_written():
    """One state slot: the second request to fold is rejected and the pool is unchanged."""
    p = _pool(**SHAPES, S=1)
    s = p.acquire(2)
    p.admit(**_token(2, T=3), layer=0, slots=s)     # C = 3: both full, no state yet
    p.decode(**_token(1), layer=0, slots=s[:1])      # the first folds: takes the one state slot
    before = snapshot(p)
    with pytest.raises(ValueError, match="only 0 of 1 state slots are free"):
        p.decode(**_token(1), layer=0, slots=s[1:])
    assert_untouched(p, before, [], "rejected decode")


def test_direct_requests_hold_no_state_slot_and_release_frees_them():
    p = _pool(**SHAPES, S=2)
    s = p.acquire(2)
    p.admit(**_token(2, T=2), layer=0, slots=s)      # T <= C: direct mode
    assert p.state_slot[0, s].tolist() == [-1, -1] and int(p.refs.sum()) == 0
    p.admit(**_token(2, T=5), layer=1, slots=s)      # T > C: a state slot each
    assert sorted(p.state_slot[1, s].tolist()) == [0, 1] and p.refs[1].tolist() == [1, 1]
    p.fork(src=s[:1], dst=p.acquire(1), keep=1)     # shares the source's state slot
    assert sorted(p.refs[1].tolist()) == [1, 2]
    p.release(s)
    assert int(p.refs.sum()) == 1 and int(p.live.sum()) == 1


def test_fork_is_copy_on_write():
    """A request forked from one with a state shares its state slot; each then folds its own tokens into
    a slot of its own, and neither sees the other's: both equal the recurrence over their own tokens."""
    from .schedule import Checker, Tokens, _cat, _rows
    C = SHAPES["C"]
    p = _pool(**dict(SHAPES, layers=1))
    tok = Tokens(1, 1, 2, 4, 4, torch.float64, "cpu")
    chk = Checker(torch.float64, C)
    a = p.acquire(1)
    x = tok.draw(1, C + 2)
    p.admit(**x, layer=0, slots=a)                  # a state of C tokens + 2 buffered
    b = p.acquire(1)
    p.fork(src=a, dst=b, keep=1)                    # b: the state + the first buffered token
    hist = {int(a): _rows(x, 0), int(b): _rows(x, (0, slice(0, C + 1)))}
    assert p.state_slot[0, a] == p.state_slot[0, b]
    for _ in range(2 * C):
        for s in (a, b):                            # one at a time: the first fold is into the shared slot
            t = tok.draw(1, 1)
            o = p.decode(**t, layer=0, slots=s)
            new = _rows(t, 0)
            chk.check(o[0], hist[int(s)], new, f"decode slot {int(s)}")
            hist[int(s)] = _cat(hist[int(s)], new)
    assert p.state_slot[0, a] != p.state_slot[0, b]
    S = p.state_of(layer=0, slots=torch.cat([a, b]))
    chk.check_state(S[0], hist[int(a)], "state a")
    chk.check_state(S[1], hist[int(b)], "state b")


def test_pool_joins_no_autograd_graph():
    """Tokens that require grad (a caller outside torch.no_grad): the pool stores their results as values,
    so none of its tensors requires grad after admit, decode, verify and accept (a tracked pool would hold
    every call's graph alive, step after step)."""
    from .schedule import Tokens
    p = _pool(layers=1, N=2, C=2, D=2, H=1, HV=2, K=4, V=4)
    tok = Tokens(0, 1, 2, 4, 4, torch.float64, "cpu")
    grad = lambda x: {n: t.requires_grad_() for n, t in x.items()}  # noqa: E731
    s = p.acquire(2)
    p.admit(**grad(tok.draw(2, 3)), layer=0, slots=s)                # T > C: a fold into a state slot
    o = p.decode(**grad(tok.draw(2, 1)), layer=0, slots=s)
    p.verify(**grad(tok.draw(2, 2)), layer=0, slots=s)
    p.accept(slots=s, counts=2)
    assert o.requires_grad
    tracked = [n for n, t in p.tensors().items() if t.requires_grad]
    assert not tracked, f"the pool's {tracked} require grad"
