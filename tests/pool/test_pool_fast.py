"""kvbuffer_fast.pool.KVPool on drawn schedules (the Triton interpreter on a CPU; small shapes, float32):
every request's outputs and final state against the float64 recurrence within the error table's float32
budget, pads that read and write nothing, int32 and int64 indices; the reference pool's bad-input rules."""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvbuffer.validate import compare  # noqa: E402
from kvbuffer_fast.pool import KVPool  # noqa: E402

from .launches import NoLaunch  # noqa: E402
from .schedule import _same, assert_untouched, copy_pool, run_schedule, sharers_fold_in_one_call, snapshot  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEW = settings(max_examples=4, deadline=None) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else \
    settings(deadline=None)
SHAPES = dict(layers=1, N=4, C=3, D=3, H=1, HV=2, K=4, V=4)


def _pool(layers, N, C, D, H, HV, K, V, S=None, **kw):
    return KVPool(layers=layers, num_state_slots=N if S is None else S, num_buffer_slots=N, capacity=C,
                  max_drafts=D, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=DEVICE, **kw)


@pytest.fixture(scope="module")
def prepared():
    """``prepared(key, shapes, setup)``: a new pool of ``shapes`` holding what ``setup(pool)`` left in one, and
    what ``setup`` returned.  The calls of ``setup`` (and the checks it makes) run once per module and key; the
    tests that start from the same calls each get a pool of their own (a pool's contents are its tensors,
    ``copy_pool``)."""
    made = {}

    def get(key, shapes: dict, setup):
        if key not in made:
            p = _pool(**shapes)
            made[key] = (p, setup(p))
        src, extra = made[key]
        p = _pool(**shapes)
        copy_pool(p, src)
        return p, extra
    return get


@FEW
@given(data=st.data(), C=st.sampled_from([1, 3]))
def test_fast_schedules_match_each_request_alone(data, C):
    shapes = dict(SHAPES, C=C)
    run_schedule(lambda: _pool(**shapes), data, dtype=torch.float32, device=DEVICE, steps=8, **shapes)


def test_fast_folds_take_their_own_slots():
    """Accept past the capacity from direct mode (a first fold) and on a state shared with a fork
    (copy-on-write), with a pad row: every request's state equals the recurrence over its own tokens."""
    from .schedule import Checker, Tokens, _cat, _rows
    p = _pool(**SHAPES)
    tok, chk = Tokens(3, 1, 2, 4, 4, torch.float32, "cpu"), Checker(torch.float32, p.capacity)
    s = p.acquire(2)
    x = tok.draw(2, 4)                                        # request 1: C + 1 tokens, a state; 0: 2, direct
    dev = lambda y: {n: t.to(DEVICE) for n, t in y.items()}  # noqa: E731
    p.admit(**dev(_rows(x, (slice(0, 1), slice(0, 2)))), layer=0, slots=s[:1].to(DEVICE))
    p.admit(**dev(_rows(x, slice(1, 2))), layer=0, slots=s[1:].to(DEVICE))
    f = p.acquire(1)
    p.fork(src=s[1:].to(DEVICE), dst=f.to(DEVICE), keep=0)    # shares request 1's state slot
    hist = {0: _rows(x, (0, slice(0, 2))), 1: _rows(x, 1), 2: _rows(x, (1, slice(0, 3)))}
    rows = torch.tensor([int(f), -1, int(s[0]), int(s[1])], dtype=torch.int32, device=DEVICE)
    d = tok.draw(4, 3)
    o = p.verify(**{n: t.to(DEVICE) for n, t in d.items()}, layer=0, slots=rows)
    who = {0: 2, 2: 0, 3: 1}                                  # row -> request
    for r, q in who.items():
        chk.check(o[r].cpu(), hist[q], _rows(d, r), f"verify row {r}")
    counts = torch.tensor([3, 99, 2, 3], device=DEVICE)       # every request passes C = 3: folds
    p.accept(layer=0, slots=rows, counts=counts)
    for r, q in who.items():
        hist[q] = _cat(hist[q], _rows(d, (r, slice(0, int(counts[r])))))
    slots = p.tensors()["state_slot"][0].tolist()
    assert len({slots[int(f)], slots[int(s[0])], slots[int(s[1])]}) == 3 and -1 not in slots[:3], slots
    S = p.state_of(layer=0, slots=torch.tensor([int(s[0]), int(s[1]), int(f)], device=DEVICE))
    for i, q in enumerate((0, 1, 2)):
        chk.check_state(S[i].cpu(), hist[q], f"state of request {q}")


@pytest.mark.parametrize("op", ["decode", "accept", "flush", "verify"])
def test_fast_sharers_fold_in_one_call(op):
    """A request and its fork fold their shared state slot in one call: the sharer that keeps the slot
    folds it in place in the same launch as the other's fold into a fresh slot, so that fold must read a
    copy (a drawn schedule found it: C=1; admit 2 requests (prompt 2); fork 0 -> 2 keep=0; decode [0, 2];
    decode [2, 0])."""
    sharers_fold_in_one_call(_pool(**dict(SHAPES, C=1)), op, dtype=torch.float32, device=DEVICE)


def _tok(B, T=1, seed=0):
    from .schedule import Tokens
    return {n: t.to(DEVICE) for n, t in Tokens(seed, 1, 2, 4, 4, torch.float32, "cpu").draw(B, T).items()}


@pytest.mark.parametrize("slots, error, match", [
    ([0, 4], ValueError, r"slots: entry \[1\] is 4, expected a slot in 0..3 or -1"),
    ([0, 2, 0], ValueError, "slots: slot 0 appears more than once"),
    ([1], ValueError, r"slots: entry \[0\] is slot 1, which holds no live request"),
    ([0.0], TypeError, "slots: expected an int32 or int64 tensor"),
])
@pytest.mark.parametrize("op", ["decode", "verify", "flush", "accept", "release"])
def test_fast_bad_slots_name_the_argument_and_change_nothing(op, slots, error, match, prepared):
    accepted = op in ("decode", "flush")  # drafts pending block decode and flush: accepted first

    def setup(p):  # slot 1 released, drafts verified on 0 and 2
        s = p.acquire(3)
        p.admit(**_tok(3, T=2), layer=0, slots=s.to(DEVICE))
        p.release(s[1:2].to(DEVICE))
        p.verify(**_tok(2, T=2), layer=0, slots=s[[0, 2]].to(DEVICE))
        if accepted:
            p.accept(layer=0, slots=s[[0, 2]].to(DEVICE), counts=1)
    p, _ = prepared(("bad slots", accepted), SHAPES, setup)
    before = snapshot(p)
    sl = torch.tensor(slots, device=DEVICE)
    B = sl.shape[0]
    with pytest.raises(error, match=match):
        if op == "decode":
            p.decode(**_tok(B), layer=0, slots=sl)
        elif op == "verify":
            p.verify(**_tok(B, T=2), layer=0, slots=sl)
        elif op == "flush":
            p.flush(layer=0, slots=sl)
        elif op == "accept":
            p.accept(layer=0, slots=sl, counts=0)
        else:
            p.release(sl)
    assert_untouched(p, before, [], f"rejected {op}")


def test_fast_state_rules():
    """Decode with drafts pending, accept without verify, counts out of range, no free state slot: errors
    before anything is written."""
    p = _pool(**SHAPES, S=1)
    s = p.acquire(2).to(DEVICE)
    p.admit(**_tok(2, T=3), layer=0, slots=s)                # C = 3: both full, no state yet
    p.decode(**_tok(1), layer=0, slots=s[:1])                 # takes the one state slot
    before = snapshot(p)
    for call, match in [(lambda: p.decode(**_tok(1), layer=0, slots=s[1:]), "only 0 of 1 state slots are free"),
                        (lambda: p.accept(layer=0, slots=s, counts=0), "no verified drafts pending"),
                        (lambda: p.decode(**_tok(3), layer=0, slots=s), "q: expected 2 rows"),
                        (lambda: p.decode(**{n: t.to("meta") for n, t in _tok(1).items()}, layer=0, slots=s[:1]),
                         "q: expected a tensor on the pool's device")]:
        with pytest.raises(ValueError, match=match):
            call()
        assert_untouched(p, before, [], f"rejected call ({match})")
    p.verify(**_tok(2, T=2), layer=0, slots=s)
    before = snapshot(p)
    for call, match in [(lambda: p.decode(**_tok(2), layer=0, slots=s), "pending.*before decode"),
                        (lambda: p.accept(layer=0, slots=s, counts=torch.tensor([0, 3], device=DEVICE)), "counts"),
                        (lambda: p.accept(layer=0, slots=s, nodes=torch.tensor([2, 0], device=DEVICE)), "nodes")]:
        with pytest.raises(ValueError, match=match):
            call()
        assert_untouched(p, before, [], f"rejected call ({match})")


@pytest.mark.parametrize("how", ["counts", "nodes"])
def test_fast_accept_of_every_layer_is_each_layer_alone(how, prepared):
    """accept(layer=None) (one fold and one copy launch over all layers) leaves the pool bit-identical to
    accepts layer by layer: requests that fold (a first fold from direct mode, one out of a slot shared
    with a fork: copy-on-write) and requests that do not, a pad row, per-layer tokens."""
    shapes = dict(SHAPES, layers=3, N=5)

    def setup(a):
        s = a.acquire(3).to(DEVICE)
        for layer in range(3):
            a.admit(**_tok(1, T=2, seed=layer), layer=layer, slots=s[:1])        # direct, 2 entries
            a.admit(**_tok(2, T=4, seed=10 + layer), layer=layer, slots=s[1:])   # a state each, 1 entry
        f = a.acquire(1).to(DEVICE)
        a.fork(src=s[1:2], dst=f, keep=1)                                       # shares request 1's slot
        rows = torch.cat([s, torch.tensor([-1], device=DEVICE), f]).to(torch.int32)
        for layer in range(3):
            a.verify(**_tok(5, T=3, seed=20 + layer), layer=layer, slots=rows)
        return s, f, rows
    a, (s, f, rows) = prepared("every layer", shapes, setup)
    b, _ = prepared("every layer", shapes, setup)  # the same pool
    pick = torch.tensor([3, 1, 0, 99, 3], device=DEVICE)                        # C = 3: rows 0, 4 fold
    arg = {"counts": pick} if how == "counts" else {"nodes": torch.where(pick == 99, pick, pick - 1)}
    a.accept(slots=rows, **arg)
    for layer in range(3):
        b.accept(layer=layer, slots=rows, **arg)
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        same = (x == y) | (x.isnan() & y.isnan()) if x.dtype.is_floating_point else x == y
        assert bool(same.all()), f"{name} differs between accept(layer=None) and accepts layer by layer"
    assert not bool(a.tensors()["pending"].any())
    slots = a.tensors()["state_slot"]
    assert bool((slots[:, int(s[0])] >= 0).all()) and bool((slots[:, int(f)] != slots[:, int(s[1])]).all())


def test_fast_calls_are_few_launches():
    """A pool decode, verify, verify(fold=...) and accept (folds and copy-on-write included), as captured in
    a CUDA graph: only Triton launches, no torch kernels and no host reads (tests/pool/launches.py counts
    them): decode's three plus the state-slot bookkeeping's two, verify's two (the pool addressed in
    place), plus the bookkeeping's two with a fold, accept's two plus the bookkeeping's two, and
    accept(fold=False) the copy alone plus the bookkeeping's two (no fold launch)."""
    from .launches import steady_counts
    most = {"decode": 5, "verify": 2, "verify_fold": 4, "accept": 4, "verify_fold_all": 8, "accept_nofold": 3}
    counts = steady_counts(DEVICE)
    assert set(counts) == set(most)
    for op, c in counts.items():
        assert not c["torch"] and not c["host"], f"{op}: torch kernels {dict(c['torch'])}, host {dict(c['host'])}"
        assert sum(c["triton"].values()) <= most[op], f"{op}: {dict(c['triton'])}"
    assert "_accept_fold_slots_kernel" in counts["accept"]["triton"]
    assert "_accept_fold_slots_kernel" not in counts["accept_nofold"]["triton"]


def test_fast_verify_ignores_a_pads_parents_and_counts():
    """verify addresses the pool in place: a pad row (slot -1) with out-of-range parents and draft count is
    neither checked nor read, and writes nothing (every tensor outside the valid row's slot bit-identical);
    the valid row's outputs are the recurrence's, and its draft room holds its parents and count."""
    from .schedule import Checker, Tokens, _rows
    p = _pool(**SHAPES)
    tok, chk = Tokens(3, 1, 2, 4, 4, torch.float32, "cpu"), Checker(torch.float32, p.capacity)
    s = p.acquire(1)
    x = tok.draw(1, 2)
    p.admit(**{n: t.to(DEVICE) for n, t in x.items()}, layer=0, slots=s.to(DEVICE))
    before = snapshot(p)
    rows = torch.tensor([-1, int(s[0])], dtype=torch.int64, device=DEVICE)
    d = tok.draw(2, 3)
    parents = torch.tensor([[7, -5, 99], [-1, 0, 0]], device=DEVICE)  # row 1: a tree (draft 2's parent is 0)
    num_drafts = torch.tensor([99, 3], device=DEVICE)
    o = p.verify(**{n: t.to(DEVICE) for n, t in d.items()}, layer=0, slots=rows, parents=parents,
                 num_drafts=num_drafts)
    assert_untouched(p, before, [int(s[0])], "verify with a pad row")
    t = p.tensors()
    assert t["parents"][0, int(s[0])].tolist() == [-1, 0, 0] and int(t["num_drafts"][0, int(s[0])]) == 3
    assert bool(t["pending"][0, int(s[0])])
    hist = _rows(x, 0)
    for j, path in ((0, [0]), (1, [0, 1]), (2, [0, 2])):  # each draft after its root-to-node path
        chk.check(o[1, j:j + 1].cpu(), hist, _rows(d, (1, path)), f"verify draft {j}")


@pytest.mark.parametrize("fold", [False, "flags"])
def test_fast_verify_of_no_drafts_leaves_empty_rooms_pending(fold):
    """verify with D = 0 (a pad among the rows) leaves each valid slot's room empty and pending, as the
    reference pool does, so that accept(counts=0) follows and then decode.  With fold flags (the first row
    and the pad's), the fold alone: the first request's two entries go to a state slot of its own, the
    second keeps them; the states after the decode are the recurrence's."""
    from kvbuffer_ref.pool import KVPool as RefPool

    from .schedule import Checker, Tokens, _cat, _rows
    tok = Tokens(3, 1, 2, 4, 4, torch.float32, "cpu")
    x, d, step = tok.draw(2, 2), tok.draw(3, 0), tok.draw(3, 1)
    dev = lambda y: {n: t.to(DEVICE) for n, t in y.items()}  # noqa: E731
    kw = {} if fold is False else dict(fold=torch.tensor([True, True, False]))
    seen = []
    for pool, to in ((_pool(**SHAPES), dev), (RefPool(layers=1, num_state_slots=4, num_buffer_slots=4, capacity=3,
                                                        max_drafts=3, num_heads=1, num_value_heads=2, head_k_dim=4,
                                                        head_v_dim=4), lambda y: y)):
        s = pool.acquire(2)
        pool.admit(**to(x), layer=0, slots=s.to(DEVICE) if to is dev else s)
        rows = torch.tensor([int(s[0]), -1, int(s[1])])
        rows = rows.to(DEVICE) if to is dev else rows
        assert pool.verify(**to(d), layer=0, slots=rows, **to(kw)).shape == (3, 0, 2, 4)
        t = pool.tensors()
        seen.append([t[n][0].cpu().tolist() for n in ("pending", "num_drafts", "parents", "lengths", "has_state",
                                                       "state_slot")])
        pool.accept(layer=0, slots=rows, counts=0)
        pool.decode(**to(step), layer=0, slots=rows)
        if to is dev:  # the fast pool's states: the recurrence over each request's tokens
            S, chk = pool.state_of(layer=0, slots=s.to(DEVICE)), Checker(torch.float32, 3)
            for i, r in enumerate((0, 2)):
                chk.check_state(S[i].cpu(), _cat(_rows(x, i), _rows(step, r)), f"state of request {i}")
    assert seen[0] == seen[1] and seen[0][0][:2] == [True, True]
    assert seen[0][3][:2] == ([2, 2] if fold is False else [0, 2])


def test_fast_verify_checks_the_gates_growth_across_calls():
    """Positive gates whose sum in one verify call is within kvbuffer_fast's limit but, on top of the slot's
    buffered gates, grow past it: a ValueError naming the growth (the buffered G is read by slot), and a pad
    row's slot (the sink) is not part of it."""
    p = _pool(**SHAPES)
    s = p.acquire(1)
    g = torch.Generator().manual_seed(0)

    def tok(B, T, gate):
        return dict(q=torch.randn(B, T, 1, 4, generator=g), k=torch.nn.functional.normalize(
            torch.randn(B, T, 1, 4, generator=g), dim=-1), v=torch.randn(B, T, 2, 4, generator=g),
            g=torch.full((B, T, 2), gate), beta=torch.rand(B, T, 2, generator=g))

    dev = lambda y: {n: t.to(DEVICE) for n, t in y.items()}  # noqa: E731
    p.admit(**dev(tok(1, 2, 30.0)), layer=0, slots=s.to(DEVICE))  # G = 30, 60
    rows = torch.tensor([int(s[0]), -1], device=DEVICE)
    with pytest.raises(ValueError, match="grows by 84 in log space since its buffer's last flush"):
        p.verify(**dev(tok(2, 3, 8.0)), layer=0, slots=rows)
    p.verify(**dev(tok(2, 3, -1.0)), layer=0, slots=rows)  # decaying drafts: fine


@pytest.mark.parametrize("view", ["strided", "expanded"])
@pytest.mark.parametrize("how", ["counts", "nodes"])
def test_fast_accept_reads_per_row_views(how, view, prepared):
    """accept's counts / nodes as an int64 view that is not contiguous (every other entry of a longer
    tensor, or one entry expanded to B rows: stride 0) leave the pool bit-identical to the same values
    passed contiguous: the state-slot bookkeeping reads them at unit stride, so the view is copied."""
    rows = torch.tensor([0, 1, 2], device=DEVICE)

    def setup(p):
        s = p.acquire(3).to(DEVICE)
        p.admit(**_tok(3, T=2), layer=0, slots=s)                  # 2 entries each: accepting 2 folds (C = 3)
        p.verify(**_tok(3, T=2, seed=1), layer=0, slots=rows)
    (a, _), (b, _) = (prepared("per row views", dict(SHAPES, N=5), setup) for _ in range(2))
    base = torch.tensor([2, 99, 0, 99, 1] if view == "strided" else [2], device=DEVICE)
    if how == "nodes":
        base = base - 1
    arg = base[::2] if view == "strided" else base.expand(3)
    a.accept(layer=0, slots=rows, **{how: arg})
    b.accept(layer=0, slots=rows, **{how: arg.contiguous()})
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        same = (x == y) | (x.isnan() & y.isnan()) if x.dtype.is_floating_point else x == y
        assert bool(same.all()), f"{name} differs between {how} as a {view} view and as a contiguous tensor"


@pytest.mark.parametrize("per_request", [None, 1, 3])
def test_fast_drafts_in_place_accept_moves_only_what_changes(per_request, prepared):
    """With room for all D drafts after a row's n entries (n + D <= C), verify writes the drafts to the
    buffer's own rows n.. (the draft room stays as it was) and accept moves only the path entries that are
    not yet at their row: none for a chain; for the paths 1 -> 2 and 0 -> 2 -> 3 of two trees, the entries
    off their row move within the buffer.  A fourth request (n + D > C) takes the room.  The drafts, the
    lengths after accept, a decode step after it and each state: against the float64 recurrence over the
    request's own tokens.  ``per_request``: accept's programs per request (None: the launch table's), which
    split the rows that move; program 0 advances the lengths (from the claims kernel's snapshot)."""
    from kvbuffer_fast.launch import AcceptConfig

    from .schedule import Checker, Tokens, _cat, _rows
    shapes = dict(SHAPES, N=4, C=8, D=4)
    chk = Checker(torch.float32, shapes["C"])
    dev = lambda y: {n: t.to(DEVICE) for n, t in y.items()}  # noqa: E731
    path_to = {1: {0: [0], 1: [1], 2: [1, 2], 3: [0, 3]}, 2: {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 2, 3]}}
    path_to[0] = {j: list(range(j + 1)) for j in range(4)}
    path_to[3] = path_to[2]

    def setup(p):  # admit and verify, the same for every per_request: the drafts checked once
        tok = Tokens(4, 1, 2, 4, 4, torch.float32, "cpu")
        s = p.acquire(4)
        x = tok.draw(4, 7)
        p.admit(**dev(_rows(x, slice(0, 3))), layer=0, slots=s[:3].to(DEVICE), tail=2)  # n = 2: in place
        p.admit(**dev(_rows(x, slice(3, 4))), layer=0, slots=s[3:].to(DEVICE), tail=5)  # n = 5: 5 + 4 > 8
        rows = s.to(torch.int32).to(DEVICE)
        d = tok.draw(4, 4)
        parents = torch.tensor([[-1, 0, 1, 2], [-1, -1, 1, 0], [-1, 0, 0, 2], [-1, 0, 0, 2]], dtype=torch.int32)
        o = p.verify(**dev(d), layer=0, slots=rows, parents=parents.to(DEVICE))
        t = p.tensors()
        assert not bool(t["du"][0, s[:3].long()].any()) and bool(t["du"][0, int(s[3])].any())
        for r in range(4):
            for j in range(4):
                chk.check(o[r, j:j + 1].cpu(), _rows(x, r), _rows(d, (r, path_to[r][j])), f"verify row {r} draft {j}")
        return s, rows, x, d, tok.gen.get_state()
    p, (s, rows, x, d, drawn) = prepared("drafts in place", shapes, setup)
    tok = Tokens(4, 1, 2, 4, 4, torch.float32, "cpu")
    tok.gen.set_state(drawn)  # the draws after the set-up's
    t = p.tensors()
    nodes = torch.tensor([3, 2, 3, 3], dtype=torch.int32, device=DEVICE)
    p.accept(layer=0, slots=rows, nodes=nodes, config=None if per_request is None else AcceptConfig(programs=4 * per_request))
    assert t["lengths"][0, s.long()].tolist() == [6, 4, 5, 8]
    hist = {r: _cat(_rows(x, r), _rows(d, (r, path_to[r][int(nodes[r])]))) for r in range(4)}
    step = tok.draw(4, 1)
    o2 = p.decode(**dev(step), layer=0, slots=rows)
    for r in range(4):
        chk.check(o2[r].cpu(), hist[r], _rows(step, r), f"decode row {r} after accept")
        hist[r] = _cat(hist[r], _rows(step, r))
    S = p.state_of(layer=0, slots=s.to(DEVICE))
    for r in range(4):
        chk.check_state(S[r].cpu(), hist[r], f"state of request {r}")


# ------------------------------------------------------------------ verify(fold=...) on the pool
# (channel gates, C, max_drafts): D <= C, a folding row's drafts take its emptied buffer's rows (their keys and G
# moved there by its last phase-2 program); D > C, the draft room.  Scalar gates with the drafts in the buffer
# rows: the state machine (C = 3, D = 3) and the graph harness (C = 4, D = 3)
FOLD_CASES = {"scalar-room": (False, 2, 3), "channel-in-buffer": (True, 4, 3)}


def _fold_scenario(pool, draw, C: int):
    """Requests in ``pool`` (one layer) for verify(fold=...): returns (rows, fold flags, the slot of a sibling
    outside the call whose state slot a folding row shares).  Rows [f, pad, r, b, e, c, h]: f a fork of the
    sibling a (its state slot, one entry), folding (copy-on-write); r direct mode, C - 1 entries, folding
    (a first state slot); b a state and an entry, not folding; e a state and no entries, flagged (nothing
    to fold); c a state and entries and h its fork (all of them), both folding (one keeps the slot)."""
    a, r, b, e, c = pool.acquire(5).tolist()
    for slot, T, tail in ((a, C + 2, 1), (r, C - 1, C - 1), (b, C + 1, 1), (e, C + 1, 0), (c, C + 2, min(2, C))):
        pool.admit(**draw(1, T), layer=0, slots=torch.tensor([slot], device=pool.device), tail=tail)
    f, h = pool.acquire(2).tolist()
    pool.fork(src=torch.tensor([a, c], device=pool.device), dst=torch.tensor([f, h], device=pool.device),
              keep=torch.tensor([1, min(2, C)], device=pool.device))
    rows = torch.tensor([f, -1, r, b, e, c, h], device=pool.device)
    fold = torch.tensor([True, True, True, False, True, True, True], device=pool.device)
    return rows, fold, a


@pytest.mark.parametrize("name,accept_fold", [(n, True) for n in FOLD_CASES] + [("channel-in-buffer", False)],
                         ids=[*FOLD_CASES, "channel-in-buffer-accept-nofold"])
def test_fast_verify_fold_matches_reference_pool(name, accept_fold, monkeypatch):
    """verify(fold=flags) then accept (nodes) on the fast pool against the reference pool in float64 (the float32
    reference pool the baseline): the outputs, and after each call every row's lengths, has_state and drafts
    pending exactly, the requests holding and sharing state slots as the reference's, their states, and the
    buffers after accept (keys exactly, u and G) by the error table. Chains and trees, ragged draft counts (a
    folding row verifies none), NaN pad and padding draft rows, a row without entries (nothing to fold), forks
    folding out of shared state slots; the fork's source, outside the call, keeps its state slot and contents bit
    for bit, and nothing outside the call's slots changes.  ``accept_fold=False``: accept(fold=False) (at C = 4
    no accepted path passes C after the folds), with no fold launch (the kernel replaced by one that fails)."""
    from kvbuffer_ref.pool import KVPool as RefPool
    if not accept_fold:
        import importlib
        monkeypatch.setattr(importlib.import_module("kvbuffer_fast.accept"), "_accept_fold_slots_kernel",
                            NoLaunch("accept(fold=False) makes no fold launch"))

    from .schedule import Tokens
    channel, C, D = FOLD_CASES[name]
    shapes = dict(layers=1, num_state_slots=8, num_buffer_slots=8, capacity=C, max_drafts=D, num_heads=1,
                  num_value_heads=2, head_k_dim=8, head_v_dim=8, channel_gate=channel)
    pools = {"fast": (KVPool(**shapes, device=DEVICE), torch.float32, DEVICE),
             "ref64": (RefPool(**shapes, dtype=torch.float64), torch.float64, "cpu"),
             "ref32": (RefPool(**shapes, dtype=torch.float32), torch.float32, "cpu")}
    par = torch.tensor([[-1, 0, 1], [9, 9, 9], [-1, 0, 0], [-1, -1, 1], [-1, 0, 1], [-1, 0, 1], [-1, 0, 0]])
    nd = torch.tensor([3, 9, 2, 3, 3, 0, 3])
    nodes = torch.tensor([2, 9, 1, 2, -1, -1, 2])
    spread = torch.linspace(0.25, 1.75, 8, dtype=torch.float64)  # per-channel gates: g spread over the channels
    out, after = {}, {}
    for kind, (p, dtype, device) in pools.items():
        tok = Tokens(5, 1, 2, 8, 8, torch.float64, "cpu")

        def draw(B, T, dtype=dtype, device=device):
            x = tok.draw(B, T)
            if channel:
                x["g"] = x["g"][..., None] * spread
            return {n: t.to(device, dtype) for n, t in x.items()}
        rows, fold, a = _fold_scenario(p, draw, C)
        if kind == "fast":  # memory no call may read is NaN: free state slots, entries past the lengths, draft rooms
            t = p.tensors()
            t["state"][0, t["refs"][0] == 0] = float("nan")
            past = torch.arange(C, device=DEVICE)[None, :] >= t["lengths"][0][:, None]
            for n in ("k", "u", "G"):
                t[n][0][past] = float("nan")
            for n in ("dk", "du", "dG"):
                t[n].fill_(float("nan"))
        x = draw(7, 3)
        for n in x:  # the pad's rows and every row's drafts past its count: never read
            x[n][1] = float("nan")
            for i in range(7):
                x[n][i, int(nd[i]):] = float("nan")
        before = snapshot(p)
        o = p.verify(**x, layer=0, slots=rows, parents=par.to(device), num_drafts=nd.to(device), fold=fold)
        out[kind] = (o.cpu(), {n: t.cpu().clone() for n, t in p.tensors().items()})
        if kind == "fast":
            assert_untouched(p, before, [int(v) for v in rows if v >= 0], "verify(fold)")
            t = p.tensors()
            for n in ("k", "u", "G", "lengths", "has_state", "state_slot"):
                assert _same(t[n][0, a], before[n][0, a]), f"the sibling outside the call: its {n} changed"
            slot = int(t["state_slot"][0, a])
            assert _same(t["state"][0, slot], before["state"][0, slot]), "the sibling's state changed"
        p.accept(layer=0, slots=rows, nodes=nodes.to(device), fold=accept_fold)
        after[kind] = {n: t.cpu().clone() for n, t in p.tensors().items()}
    valid = torch.arange(3)[None, :] < torch.where(torch.arange(7) == 1, 0, nd)[:, None]
    res = [compare(out["fast"][0], out["ref64"][0], out["ref32"][0], name="verify(fold).o",
                   valid=valid[:, :, None, None])]
    for stage, got in (("verify(fold)", {k: v[1] for k, v in out.items()}), ("accept", after)):
        f, r64, r32 = got["fast"], got["ref64"], got["ref32"]
        for n in ("lengths", "has_state", "pending", "num_drafts"):
            assert torch.equal(f[n], r64[n]), f"{stage}: {n} {f[n].tolist()}, the reference's {r64[n].tolist()}"
        # the state slots: which requests hold one, and which share one, as the reference's (of two sharers that
        # both fold, the fast pool's first row keeps the slot, the reference's last: the slot numbers may differ)
        slots = {k: g["state_slot"][0] for k, g in got.items()}
        same = {k: (v[:, None] == v[None, :]) & (v[:, None] >= 0) for k, v in slots.items()}
        assert torch.equal(same["fast"], same["ref64"]) and torch.equal(slots["fast"] >= 0, slots["ref64"] >= 0), \
            f"{stage}: state slots {slots['fast'].tolist()}, the reference's {slots['ref64'].tolist()}"
        assert sorted(f["refs"][0].tolist()) == sorted(r64["refs"][0].tolist()), f"{stage}: refs"
        held = slots["ref64"] >= 0
        res.append(compare(f["state"][0][slots["fast"][held]], r64["state"][0][slots["ref64"][held]],
                           r32["state"][0][slots["ref32"][held]], name=f"{stage}: states", head_axis=1))
    kept = (torch.arange(C)[None, :] < after["ref64"]["lengths"][0][:, None])[None]
    f, r64, r32 = after["fast"], after["ref64"], after["ref32"]
    assert torch.equal(f["k"][kept], r64["k"][kept].float()), "accept: keys"
    res += [compare(f["u"][kept], r64["u"][kept], r32["u"][kept], name="accept: u", head_axis=1),
            compare(f["G"][kept], r64["G"][kept], r32["G"][kept], name="accept: G", head_axis=1)]
    for c in res:
        assert c.passed, str(c)
