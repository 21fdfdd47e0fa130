"""kvbuffer_fast.pool.KVPool on a CUDA GPU (skipped without one): every operation (verify also with fold flags)
captured in a CUDA graph once and replayed with new contents and new slot indices, equal bit for bit to the
same operations run eagerly on a twin pool; a pool of more than 2^31 state elements per layer (over 8 GiB),
its requests' states in slots past 2^31 elements, against the float64 recurrence; forks folding their shared slots
at a serving batch (256 rows, fresh slots past the first 4096), bit for bit against private copies.

    python3 -m pytest tests/pool/test_pool_gpu.py -q

``graph_schedule`` takes the capture as an argument, so the harness itself also runs on a CPU with an
eager stand-in (``test_graph_harness_on_eager_capture``, the interpreter): what the GPU run checks is
then only whether capture and replay change anything.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvbuffer_fast.pool import KVPool  # noqa: E402

from .schedule import Checker, Tokens, _cat, _rows, copy_pool  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs and an 8 GiB pool need a GPU")


def _pool(device, *, layers=2, N=8, S=8, C=4, D=3, H=2, HV=4, K=32, V=32, **kw):
    return KVPool(layers=layers, num_state_slots=S, num_buffer_slots=N, capacity=C, max_drafts=D, num_heads=H,
                  num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=device, **kw)


class CudaCapture:
    """Capture ``fn`` once in a CUDA graph (after a warm-up on a scratch pool: compiles, caches; the warm-up
    calls take counts and keeps of 0, valid whatever the scratch pool holds) and return a replay function."""

    warms = True

    def __call__(self, fn, warm):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        out = {}
        with torch.cuda.graph(graph):
            out["o"] = fn()
        return lambda: (graph.replay(), out["o"])[1]


class EagerCapture:
    """The stand-in: 'replaying' runs ``fn`` again (for the harness on a CPU); it runs no warm-up."""

    warms = False

    def __call__(self, fn, warm):
        return fn


def _assert_same_pools(a: KVPool, b: KVPool, what: str) -> None:
    for name, t in a.tensors().items():
        u = b.tensors()[name]
        same = (t == u) | (t.isnan() & u.isnan()) if t.dtype.is_floating_point else t == u
        assert bool(same.all()), f"{what}: pool tensor {name} differs between the replayed graph and the eager run"


def _same(x, y, what):
    if x is None:
        return
    assert bool(((x == y) | (x.isnan() & y.isnan())).all()), f"{what}: outputs differ"


def graph_schedule(capture, device, replays: int = 3, seed: int = 0) -> int:
    """Capture each operation once on pool A, replay it with new tokens and new slot indices (int32 and
    int64, -1 pads, shuffled) and run the same calls eagerly on pool B; A and B (every tensor) and the
    outputs must be equal bit for bit.  Returns the number of replays compared."""
    gen = torch.Generator().manual_seed(seed)
    dims = dict(K=32, V=32) if device != "cpu" else dict(K=16, V=16, layers=1)
    A, B, scratch = _pool(device, **dims), _pool(device, **dims), _pool(device, **dims)
    L, C, D, H, HV, K, V = A.layers, A.capacity, A.max_drafts, A.num_heads, A.num_value_heads, A.head_k_dim, \
        A.head_v_dim
    tok = Tokens(seed, H, HV, K, V, torch.float32, "cpu")
    prompts = [[tok.draw(1, T) for T in (1, C - 1, C, C + 1, 2 * C + 1, 3)] for _ in range(L)]
    # the same six requests of 1..2C+1 prompt tokens in each pool (admitted to A, copied to the others: a pool's
    # contents are its tensors); the scratch pool serves only the warm-ups
    s = A.acquire(6)
    for layer in range(L):
        for i, x in enumerate(prompts[layer]):
            A.admit(**{n: t.to(device) for n, t in x.items()}, layer=layer, slots=s[i:i + 1])
    for p in (B, scratch) if capture.warms else (B,):
        copy_pool(p, A)
    Bw = 4  # rows per call (pads included): the graphs' static batch
    live = list(range(6))

    def slots_for(dtype):
        chosen = torch.randperm(6, generator=gen)[:3].tolist()
        rows = chosen[:]
        rows.insert(int(torch.randint(0, 4, (1,), generator=gen)), -1)
        return torch.tensor([live[c] if c >= 0 else -1 for c in rows], dtype=dtype)

    static = {}

    def put(name, x):
        if name not in static:
            static[name] = x.to(device).clone()
        else:
            static[name].copy_(x)
        return static[name]

    def tokens(T):
        return {n: t.to(device) for n, t in tok.draw(Bw, T).items()}

    compared = 0
    for r in range(replays):
        dtype = (torch.int32, torch.int64)[r % 2]
        for layer in range(L):
            # decode
            sl, x = slots_for(torch.int64), tokens(1)
            sts = {n: put(f"dec.{n}", t) for n, t in x.items()}
            ss = put("dec.slots", sl)
            key = ("decode", layer)
            if key not in static:
                static[key] = capture(lambda layer=layer: A.decode(**{n: sts[n] for n in x}, layer=layer, slots=ss),
                                      lambda layer=layer: scratch.decode(**{n: sts[n] for n in x}, layer=layer,
                                                                         slots=ss))
            o = static[key]()
            _same(o[sl >= 0], B.decode(**x, layer=layer, slots=sl.to(device))[sl >= 0], f"decode {r}")
            _assert_same_pools(A, B, f"decode replay {r} layer {layer}")
            # verify (tree) then accept nodes
            sl, x = slots_for(torch.int64), tokens(D)
            par = torch.tensor([[-1, 0, 0]] * Bw)
            nd = torch.randint(0, D + 1, (Bw,), generator=gen)
            sts = {n: put(f"ver.{n}", t) for n, t in x.items()}
            ss, sp, sn = put("ver.slots", sl), put("ver.par", par), put("ver.nd", nd)
            key = ("verify", layer)
            if key not in static:
                static[key] = capture(
                    lambda layer=layer: A.verify(**{n: sts[n] for n in x}, layer=layer, slots=ss, parents=sp,
                                                 num_drafts=sn),
                    lambda layer=layer: scratch.verify(**{n: sts[n] for n in x}, layer=layer, slots=ss, parents=sp,
                                                       num_drafts=sn))
            o = static[key]()
            ob = B.verify(**x, layer=layer, slots=sl.to(device), parents=par.to(device), num_drafts=nd.to(device))
            valid = (sl >= 0)[:, None] & (torch.arange(D)[None, :] < nd[:, None])
            _same(o[valid.to(device)], ob[valid.to(device)], f"verify {r}")
            _assert_same_pools(A, B, f"verify replay {r} layer {layer}")
            nodes = torch.stack([torch.randint(-1, int(n), (1,), generator=gen)[0] if n > 0 else torch.tensor(-1)
                                 for n in nd])
            sa, sno = put("acc.slots", sl), put("acc.nodes", nodes)
            key = ("accept", layer)
            if key not in static:
                if capture.warms:  # drafts pending on the scratch pool for the accept's warm-up
                    scratch.verify(**x, layer=layer, slots=sl.to(device), parents=par.to(device),
                                   num_drafts=nd.to(device))
                static[key] = capture(lambda layer=layer: A.accept(layer=layer, slots=sa, nodes=sno),
                                      lambda layer=layer: scratch.accept(layer=layer, slots=sa, nodes=sno))
            static[key]()
            B.accept(layer=layer, slots=sl.to(device), nodes=nodes.to(device))
            _assert_same_pools(A, B, f"accept replay {r} layer {layer}")
            # verify (chain) folding the flagged rows' buffers, then the captured accept with new values
            sl, x = slots_for(torch.int64), tokens(D)
            nd = torch.randint(0, D + 1, (Bw,), generator=gen)
            flags = torch.rand(Bw, generator=gen) < 0.75
            sts = {n: put(f"vf.{n}", t) for n, t in x.items()}
            ss, sn, sfl = put("vf.slots", sl), put("vf.nd", nd), put("vf.fold", flags)
            sp = put("vf.par", torch.arange(-1, D - 1).expand(Bw, D).contiguous())
            key = ("verify fold", layer)
            if key not in static:
                static[key] = capture(
                    lambda layer=layer: A.verify(**{n: sts[n] for n in x}, layer=layer, slots=ss, parents=sp,
                                                 num_drafts=sn, fold=sfl),
                    # the warm-up rejects the drafts it verified, so the scratch pool's next warm-ups are valid
                    lambda layer=layer: (scratch.verify(**{n: sts[n] for n in x}, layer=layer, slots=ss, parents=sp,
                                                        num_drafts=sn, fold=sfl),
                                         scratch.accept(layer=layer, slots=ss, nodes=torch.full_like(ss, -1))))
            o = static[key]()
            ob = B.verify(**x, layer=layer, slots=sl.to(device), parents=sp, num_drafts=nd.to(device),
                          fold=flags.to(device))
            valid = (sl >= 0)[:, None] & (torch.arange(D)[None, :] < nd[:, None])
            _same(o[valid.to(device)], ob[valid.to(device)], f"verify(fold) {r}")
            _assert_same_pools(A, B, f"verify(fold) replay {r} layer {layer}")
            nodes = torch.stack([torch.randint(-1, int(n), (1,), generator=gen)[0] if n > 0 else torch.tensor(-1)
                                 for n in nd])
            put("acc.slots", sl), put("acc.nodes", nodes)
            static[("accept", layer)]()
            B.accept(layer=layer, slots=sl.to(device), nodes=nodes.to(device))
            _assert_same_pools(A, B, f"accept after verify(fold) replay {r} layer {layer}")
            # flush a per-request prefix
            sl = slots_for(dtype)
            lengths = A.tensors()["lengths"][layer].cpu()
            cnt = torch.tensor([int(torch.randint(0, int(lengths[s]) + 1, (1,), generator=gen)) if s >= 0 else 0
                                for s in sl.tolist()], dtype=dtype)
            sf, sc = put(f"fl.slots.{dtype}", sl), put(f"fl.count.{dtype}", cnt)
            key = ("flush", layer, dtype)
            if key not in static:
                static[key] = capture(lambda layer=layer: A.flush(layer=layer, slots=sf, count=sc),
                                      lambda layer=layer: scratch.flush(layer=layer, slots=sf,
                                                                        count=torch.zeros_like(sc)))
            static[key]()
            B.flush(layer=layer, slots=sl.to(device), count=cnt.to(device))
            _assert_same_pools(A, B, f"flush replay {r} layer {layer}")
        # fork two requests into acquired slots, then release them (state_of compared before)
        src = torch.tensor([live[i] for i in torch.randperm(6, generator=gen)[:2].tolist()] + [-1])
        dA, dB = A.acquire(2), B.acquire(2)
        assert torch.equal(dA, dB)
        lengths = A.tensors()["lengths"].cpu()
        keep = torch.tensor([int(lengths[:, s].min()) // 2 for s in src[:2].tolist()] + [0])
        dst = torch.cat([dA.cpu(), torch.tensor([-1])])
        s1, s2, s3 = put("fork.src", src), put("fork.dst", dst), put("fork.keep", keep)
        if "fork" not in static:
            dS = scratch.acquire(2)
            static["fork"] = capture(lambda: A.fork(src=s1, dst=s2, keep=s3),
                                     lambda: scratch.fork(src=s1, dst=torch.cat([dS, s2[2:]]), keep=torch.zeros_like(s3)))
        static["fork"]()
        B.fork(src=src.to(device), dst=dst.to(device), keep=keep.to(device))
        _assert_same_pools(A, B, f"fork replay {r}")
        sst = put("state.slots", dst)
        if "state_of" not in static:
            static["state_of"] = capture(lambda: A.state_of(layer=0, slots=sst),
                                         lambda: scratch.state_of(layer=0, slots=sst))
        _same(static["state_of"]()[:2], B.state_of(layer=0, slots=dst.to(device))[:2], f"state_of {r}")
        srl = put("rel.slots", dst)
        if "release" not in static:
            static["release"] = capture(lambda: A.release(srl), lambda: scratch.release(torch.full_like(srl, -1)))
        static["release"]()
        B.release(dst.to(device))
        _assert_same_pools(A, B, f"release replay {r}")
        compared += 1
    return compared


@needs_cuda
def test_every_operation_replays_in_a_cuda_graph():
    assert graph_schedule(CudaCapture(), "cuda", replays=3) == 3


def test_graph_harness_on_eager_capture():
    """The harness on the eager stand-in (CPU, interpreter): the twin pools agree call for call."""
    if CUDA:
        pytest.skip("the CUDA run covers it")
    assert graph_schedule(EagerCapture(), "cpu", replays=1) == 1


@needs_cuda
def test_state_slots_past_2_31_elements():
    """A pool of 4100 state slots of 32 x 128 x 128 float32 (2.15e9 elements, 8.6 GB, in one layer): the
    two requests' states land in the last slots, past element 2^31, and decode (folding every C steps),
    verify, accept and flush there equal the float64 recurrence."""
    S, HV, K, V, C = 4100, 32, 128, 128, 4
    assert S * HV * K * V > 2 ** 31
    p = KVPool(layers=1, num_state_slots=S, num_buffer_slots=4, capacity=C, max_drafts=3, num_heads=16,
               num_value_heads=HV, head_k_dim=K, head_v_dim=V, device="cuda")
    p._t["refs"][0, :S - 2] = 1  # every slot but the last two held (as by other requests)
    tok = Tokens(7, 16, HV, K, V, torch.float32, "cpu")
    chk = Checker(torch.float32, C)
    s = p.acquire(2)
    x = tok.draw(2, C + 2)
    p.admit(**{n: t.cuda() for n, t in x.items()}, layer=0, slots=s)
    slots = p.tensors()["state_slot"][0, s].tolist()
    assert min(slots) * HV * K * V >= 2 ** 31 - HV * K * V and max(slots) * HV * K * V > 2 ** 31, slots
    hist = {i: _rows(x, i) for i in range(2)}
    for step in range(3 * C):
        t = tok.draw(2, 1)
        o = p.decode(**{n: v.cuda() for n, v in t.items()}, layer=0, slots=s.flip(0))
        for i in range(2):  # request i is slot s[i], token row 1 - i of the flipped call
            new = _rows(t, 1 - i)
            chk.check(o[1 - i].cpu(), hist[i], new, f"decode {step} request {i}")
            hist[i] = _cat(hist[i], new)
    d = tok.draw(2, 3)
    o = p.verify(**{n: v.cuda() for n, v in d.items()}, layer=0, slots=s)
    for i in range(2):
        chk.check(o[i].cpu(), hist[i], _rows(d, i), f"verify request {i}")
    p.accept(layer=0, slots=s, counts=torch.tensor([3, 1], device="cuda"))
    hist = {0: _cat(hist[0], _rows(d, 0)), 1: _cat(hist[1], _rows(d, (1, slice(0, 1))))}
    p.flush(layer=0, slots=s)
    S_now = p.state_of(layer=0, slots=s)
    for i in range(2):
        chk.check_state(S_now[i].cpu(), hist[i], f"state request {i}")
    assert p.tensors()["state_slot"][0, s].tolist() == slots  # folded in place: no new slot was needed


def forked_twins(device, *, N: int, S: int, taken: int, C: int = 4, HV: int = 2, K: int = 16, V: int = 16,
                 seed: int = 3) -> None:
    """Pool A holds N/2 requests (a state each, one entry) and a fork of each (sharing its state slot);
    pool B the same N requests admitted apart (private copies of the same states).  The first ``taken``
    state slots are held (as by other requests), so the fresh slots lie past them.  Every request decodes
    2C tokens in one call per step (rows shuffled, a pad): each pair folds its shared slot in one call
    (its first row keeps it, the other takes a fresh slot, copied), then folds again in place.  A's and
    B's outputs and states are equal bit for bit, and A's refs count its requests' state slots."""
    gen = torch.Generator().manual_seed(seed)
    A, B = (KVPool(layers=1, num_state_slots=S, num_buffer_slots=N, capacity=C, max_drafts=1, num_heads=1,
                   num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=device) for _ in range(2))
    for p in (A, B):
        p._t["refs"][0, :taken] = 1
    tok = Tokens(seed, 1, HV, K, V, torch.float32, "cpu")
    dev = lambda x: {n: t.to(device) for n, t in x.items()}  # noqa: E731
    prompts = dev(tok.draw(N // 2, C + 1))                   # a state and one entry each
    src, fork = A.acquire(N // 2), A.acquire(N // 2)
    A.admit(**prompts, layer=0, slots=src)
    A.fork(src=src, dst=fork, keep=1)
    a_slots = torch.cat([src, fork])                         # request r: A's slot a_slots[r], B's b_slots[r]
    b_slots = B.acquire(N)
    for half in (b_slots[:N // 2], b_slots[N // 2:]):
        B.admit(**prompts, layer=0, slots=half)
    for step in range(2 * C):
        order = torch.randperm(N + 1, generator=gen).tolist()  # request N: the pad
        pick = lambda slots: torch.tensor([int(slots[r]) if r < N else -1 for r in order], device=device)  # noqa
        x = dev(tok.draw(N + 1, 1))
        oa, ob = A.decode(**x, layer=0, slots=pick(a_slots)), B.decode(**x, layer=0, slots=pick(b_slots))
        valid = torch.tensor([r < N for r in order], device=device)
        _same(oa[valid], ob[valid], f"decode step {step}")
    _same(A.state_of(layer=0, slots=a_slots), B.state_of(layer=0, slots=b_slots), "states")
    t = A.tensors()
    slot = t["state_slot"][0, a_slots]
    assert slot.unique().numel() == N and bool((slot >= taken).all()), slot.tolist()
    want = torch.bincount(slot, minlength=S)
    want[:taken] += 1
    assert torch.equal(t["refs"][0], want), "refs do not count the requests' state slots"


def test_forked_twins_past_the_first_free_slot_block():
    """``forked_twins`` on the interpreter (CPU): 4 requests, the fresh slots past the first 4096 (the
    bookkeeping scans the free slots in blocks of 4096)."""
    if CUDA:
        pytest.skip("the CUDA run covers it")
    forked_twins("cpu", N=4, S=4096 + 8, taken=4096 + 2)


@needs_cuda
def test_forked_twins_at_a_serving_batch():
    """``forked_twins`` compiled at a serving batch: 256 rows per call (128 pairs fold their shared slots in
    one call), 4608 state slots, the fresh ones past the first 4096."""
    forked_twins("cuda", N=256, S=4096 + 512, taken=4096 + 100, HV=4, K=32, V=32)
