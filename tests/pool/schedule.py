"""Drawn schedules over a serving pool, each request checked against the plain recurrence run alone.

``run_schedule(pool_factory, data, ...)`` draws a schedule of admit / decode / verify (chain or tree) /
accept / flush / fork / release over a changing set of requests, every call with its slot indices in
int32 or int64, shuffled, with -1 pads at random rows (whose token rows are NaN, as are a verified
request's draft rows past its draft count); it runs each step on
every layer (distinct tokens per layer) and checks, for every request of every call:

* its outputs against the float64 recurrence over exactly its own accepted tokens (its prefix when it
  was forked) plus the call's tokens, within the error table's budget (``compare``; for float32 pools
  over the plain float32 recurrence on the same inputs);
* that the pool's contents outside the addressed buffer slots and the state slots they reference are
  bit-identical before and after the call (pads read and write nothing; no request sees another's data);

and at the end every live request's current state (``state_of``) against the recurrence's.
Any pool with the API of ``kvbuffer_ref.pool.KVPool`` can be run (its ``tensors()`` named the same).
"""

from __future__ import annotations

from typing import Optional

import torch
from hypothesis import assume
from hypothesis import strategies as st

import kvbuffer_ref as ref
from kvbuffer.validate import compare
from kvbuffer.validate.properties import truth_and_baseline

#: the pool's tensors per buffer slot (axis 1; ``live``: axis 0) and per state slot (axis 1)
PER_BUFFER = ("k", "u", "G", "lengths", "has_state", "state_slot", "dk", "du", "dG", "parents", "num_drafts",
              "pending")
PER_STATE = ("state", "refs")
FIELDS = ("q", "k", "v", "g", "beta")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN."""
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def snapshot(pool) -> dict:
    return {n: t.clone() for n, t in pool.tensors().items()}


def copy_pool(dst, src) -> None:
    """``dst`` made the same pool as ``src`` (a kvbuffer_fast pool of the same shapes): every tensor it holds,
    sink rows and bookkeeping included, copied over."""
    for name, t in src._t.items():
        dst._t[name].copy_(t)


def assert_untouched(pool, before: dict, buffer_slots, what: str) -> None:
    """Everything outside ``buffer_slots`` (and the state slots they referenced before or after) is
    bit-identical to ``before``."""
    after = pool.tensors()
    N = after["live"].shape[0]
    keep = torch.ones(N, dtype=torch.bool)
    keep[list(buffer_slots)] = False
    S = after["state"].shape[1]
    L = after["state"].shape[0]
    for layer in range(L):
        touched = set()
        for b in buffer_slots:
            touched |= {int(before["state_slot"][layer, b]), int(after["state_slot"][layer, b])}
        keep_s = torch.ones(S, dtype=torch.bool)
        for s in touched - {-1}:
            keep_s[s] = False
        for n in PER_STATE:
            if n == "refs":  # a fold into a fresh slot changes refs of the two slots only
                continue
            assert _same(after[n][layer][keep_s.to(after[n].device)], before[n][layer][keep_s.to(after[n].device)]), \
                f"{what}: {n} of layer {layer} changed outside the addressed requests' state slots"
        for n in PER_BUFFER:
            m = keep.to(after[n].device)
            assert _same(after[n][layer][m], before[n][layer][m]), \
                f"{what}: {n} of layer {layer} changed outside the addressed slots {sorted(buffer_slots)}"
    assert torch.equal(after["live"][keep.to(after["live"].device)], before["live"][keep.to(after["live"].device)])


class Tokens:
    """Random tokens of the pool's heads: q, k L2-normalised, gates in [-1.5, 0], betas in [0, 1]."""

    def __init__(self, seed: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, device):
        self.gen = torch.Generator().manual_seed(seed)
        self.H, self.HV, self.K, self.V, self.dtype, self.device = H, HV, K, V, dtype, device

    def draw(self, B: int, T: int) -> dict:
        r = lambda *s: torch.rand(*s, generator=self.gen, dtype=torch.float64)  # noqa: E731
        n = lambda *s: torch.randn(*s, generator=self.gen, dtype=torch.float64)  # noqa: E731
        q = torch.nn.functional.normalize(n(B, T, self.H, self.K), dim=-1)
        k = torch.nn.functional.normalize(n(B, T, self.H, self.K), dim=-1)
        x = dict(q=q, k=k, v=n(B, T, self.HV, self.V), g=-1.5 * r(B, T, self.HV), beta=r(B, T, self.HV))
        return {f: t.to(self.device, self.dtype) for f, t in x.items()}


def _cat(a: dict, b: dict) -> dict:
    return {f: torch.cat([a[f], b[f]], dim=0) for f in FIELDS}


def _rows(x: dict, idx) -> dict:
    return {f: t[idx] for f, t in x.items()}


class Checker:
    """The truth of one request's outputs: the float64 recurrence over its history plus new tokens, and as
    the error table's baseline the correct forms in the pool's compute dtype (``truth_and_baseline``: the
    recurrence, and the chunkwise form with chunks of max(64, the pool's capacity ``C``), as a pool's buffer
    and its admit keep cumulative gates; None for float64)."""

    def __init__(self, dtype: torch.dtype, C: Optional[int] = None):
        self.dtype, self.C = dtype, C
        self.compared = 0

    def _forms(self, x: dict):
        """(truth (o, S), baseline (o, S) or None) over the tokens ``x`` [T, ...] of one request."""
        xb = {f: t[None].to(self.dtype) for f, t in x.items()}
        truth, base = truth_and_baseline(xb, chunk=self.C)
        return truth, (None if self.dtype == torch.float64 else base)

    def outputs(self, hist: dict, new: dict):
        x = _cat(hist, new)
        T, n = x["q"].shape[0], new["q"].shape[0]
        (o64, _), base = self._forms(x)
        return o64[:, T - n:], None if base is None else base[0][:, T - n:]

    def check(self, actual: torch.Tensor, hist: dict, new: dict, what: str) -> None:
        """actual: [n, HV, V] outputs of the last n tokens of ``new`` after ``hist``."""
        exp, base = self.outputs(hist, new)
        n = actual.shape[0]  # the last n tokens' outputs (a tree node: the last of its path)
        exp, base = exp[:, -n:], None if base is None else base[:, -n:]
        c = compare(actual[None].cpu(), exp.cpu(), None if base is None else base.cpu(), name=what,
                    dtype=self.dtype)
        assert c.passed, str(c)
        self.compared += 1

    def check_state(self, actual: torch.Tensor, hist: dict, what: str) -> None:
        if hist["q"].shape[0] == 0:
            assert bool((actual == 0).all()), f"{what}: a request without tokens has a non-zero state"
            return
        (_, S), base = self._forms(hist)
        c = compare(actual[None].cpu(), S.cpu(), None if base is None else base[1].cpu(), name=what,
                    dtype=self.dtype, head_axis=1)
        assert c.passed, str(c)


def _empty(like: Tokens) -> dict:
    """No tokens: per-request tensors [0, ...]."""
    return {f: t[0] for f, t in like.draw(1, 0).items()}


def _addressing(data, chosen: list, label: str):
    """(slot index tensor [B] with -1 pads at random rows, rows of the chosen slots in it, dtype)."""
    order = data.draw(st.permutations(chosen), label=f"{label} order")
    pads = data.draw(st.integers(0, 2), label=f"{label} pads")
    entries = list(order)
    for _ in range(pads):
        entries.insert(data.draw(st.integers(0, len(entries)), label="pad row"), -1)
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label=f"{label} index dtype")
    return entries, dtype


def _padded(x: dict, entries: list) -> dict:
    """Token rows for ``entries``: the chosen requests' rows in order, NaN rows at the pads."""
    out = {}
    it = [i for i, s in enumerate(entries) if s >= 0]
    for f, t in x.items():
        full = torch.full((len(entries),) + tuple(t.shape[1:]), float("nan"), dtype=t.dtype)
        full[it] = t
        out[f] = full
    return out


def run_schedule(make_pool, data, *, layers: int, N: int, C: int, D: int, H: int, HV: int, K: int, V: int,
                 dtype: torch.dtype, device, steps: int = 10) -> Checker:
    """Draw and run a schedule (module docstring) on ``make_pool()``; returns the Checker (its count)."""
    pool = make_pool()
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label="token seed")
    tok = Tokens(seed, H, HV, K, V, dtype, "cpu")
    chk = Checker(dtype, C)
    hist: dict = {}          # slot -> [per layer token dict]
    pending: dict = {}       # slot -> [per layer (draft tokens, parents, num_drafts)]
    dev = lambda t: t.to(device)  # noqa: E731
    ops = ["admit", "decode", "decode", "verify", "accept", "accept", "flush", "fork", "fork", "release"]
    for step in range(steps):
        live = sorted(hist)
        free = N - len(live)
        op = data.draw(st.sampled_from(ops if live else ["admit"]), label=f"step {step}")
        idle = [s for s in live if s not in pending]
        if op == "admit" or (op == "fork" and (not free or not idle)):
            if not free:
                continue
            n = data.draw(st.integers(1, min(2, free)), label="admitted")
            T = data.draw(st.sampled_from([1, C - 1, C, C + 1, 2 * C + 1]) if C > 1 else st.integers(1, 3),
                          label="prompt")
            T = max(T, 1)
            slots = pool.acquire(n).tolist()
            entries, idt = _addressing(data, slots, "admit")
            before = snapshot(pool)
            for layer in range(layers):
                x = tok.draw(n, T)
                order = [slots.index(s) for s in entries if s >= 0]
                xp = _padded(_rows(x, order), entries)
                o = pool.admit(**{f: dev(t) for f, t in xp.items()}, layer=layer,
                               slots=dev(torch.tensor(entries, dtype=idt)))
                for i, s in enumerate(entries):
                    if s >= 0:
                        new = _rows(x, slots.index(s))
                        chk.check(o[i], _empty(tok), new, f"admit layer {layer} slot {s}")
                        hist.setdefault(s, [None] * layers)[layer] = new
            assert_untouched(pool, before, slots, "admit")
        elif op == "decode" and idle:
            chosen = data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True), label="decoded")
            entries, idt = _addressing(data, chosen, "decode")
            before = snapshot(pool)
            for layer in range(layers):
                x = tok.draw(len(chosen), 1)
                xp = _padded(_rows(x, [chosen.index(s) for s in entries if s >= 0]), entries)
                o = pool.decode(**{f: dev(t) for f, t in xp.items()}, layer=layer,
                                slots=dev(torch.tensor(entries, dtype=idt)))
                for i, s in enumerate(entries):
                    if s >= 0:
                        new = _rows(x, slice(chosen.index(s), chosen.index(s) + 1))
                        new = {f: t[0] for f, t in new.items()}
                        chk.check(o[i], hist[s][layer], new, f"decode layer {layer} slot {s}")
                        hist[s][layer] = _cat(hist[s][layer], new)
            assert_untouched(pool, before, chosen, "decode")
        elif op == "verify" and D > 0:
            chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True), label="verified")
            entries, idt = _addressing(data, chosen, "verify")
            Dn = data.draw(st.integers(1, D), label="drafts")
            tree = data.draw(st.booleans(), label="tree")
            B = len(entries)
            if tree:
                par = [[data.draw(st.integers(-1, i - 1), label="parent") for i in range(Dn)] for _ in range(B)]
            else:
                par = [list(range(-1, Dn - 1)) for _ in range(B)]
            nd = [data.draw(st.integers(0, Dn), label="num_drafts") for _ in range(B)]
            parents = torch.tensor(par, dtype=torch.int64)
            num_drafts = torch.tensor(nd, dtype=torch.int64)
            before = snapshot(pool)
            for layer in range(layers):
                x = tok.draw(B, Dn)
                for i, s in enumerate(entries):
                    for f in FIELDS:  # a pad's rows, and a request's rows past its draft count: never read
                        x[f][i, 0 if s < 0 else nd[i]:] = float("nan")
                o = pool.verify(**{f: dev(t) for f, t in x.items()}, layer=layer,
                                slots=dev(torch.tensor(entries, dtype=idt)), parents=dev(parents),
                                num_drafts=dev(num_drafts))
                for i, s in enumerate(entries):
                    if s < 0:
                        continue
                    for node in range(nd[i]):
                        path = ref.path_to(parents[i], node)
                        new = {f: x[f][i, path] for f in FIELDS}
                        chk.check(o[i, node:node + 1], hist[s][layer], new, f"verify layer {layer} slot {s} node {node}")
                    pending.setdefault(s, [None] * layers)[layer] = ({f: x[f][i] for f in FIELDS}, parents[i], nd[i],
                                                                     tree)
            assert_untouched(pool, before, chosen, "verify")
        elif op == "accept" and pending:
            chosen = data.draw(st.lists(st.sampled_from(sorted(pending)), min_size=1, unique=True), label="accepted")
            entries, idt = _addressing(data, chosen, "accept")
            # one kind per call: counts when every chosen request verified a chain, else nodes
            chains = all(not pending[s][0][3] for s in chosen)
            picks = {s: (data.draw(st.integers(0, pending[s][0][2]), label="count") if chains else
                         data.draw(st.integers(-1, pending[s][0][2] - 1), label="node")) for s in chosen}
            val = torch.tensor([picks[s] if s >= 0 else 10 ** 6 for s in entries], dtype=idt)  # pads: junk, unread
            before = snapshot(pool)
            for layer in range(layers):
                kw = dict(counts=dev(val)) if chains else dict(nodes=dev(val))
                pool.accept(layer=layer, slots=dev(torch.tensor(entries, dtype=idt)), **kw)
                for s in chosen:
                    x, par, nd, _ = pending[s][layer]
                    path = list(range(picks[s])) if chains else ref.path_to(par, picks[s])
                    hist[s][layer] = _cat(hist[s][layer], {f: x[f][path] for f in FIELDS})
            for s in chosen:
                del pending[s]
            assert_untouched(pool, before, chosen, "accept")
        elif op == "flush" and idle:
            chosen = data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True), label="flushed")
            entries, idt = _addressing(data, chosen, "flush")
            before = snapshot(pool)
            for layer in range(layers):
                lengths = pool.tensors()["lengths"][layer].cpu()
                if data.draw(st.booleans(), label="flush all"):
                    count = None
                else:
                    count = dev(torch.tensor([data.draw(st.integers(0, int(lengths[s])), label="count") if s >= 0
                                              else 10 ** 6 for s in entries], dtype=idt))
                pool.flush(layer=layer, slots=dev(torch.tensor(entries, dtype=idt)), count=count)
            assert_untouched(pool, before, chosen, "flush")
        elif op == "fork" and idle and free:
            src = data.draw(st.lists(st.sampled_from(idle), min_size=1, max_size=min(2, free), unique=True),
                            label="forked")
            dst = pool.acquire(len(src)).tolist()
            lengths = pool.tensors()["lengths"].cpu()
            keep = [data.draw(st.integers(0, int(lengths[:, s].min())), label="keep") for s in src]
            pairs = list(zip(src, dst, keep))
            order = data.draw(st.permutations(pairs), label="fork order")
            rows = list(order)
            for _ in range(data.draw(st.integers(0, 2), label="fork pads")):
                rows.insert(data.draw(st.integers(0, len(rows)), label="pad row"), (-1, -1, 10 ** 6))
            idt = data.draw(st.sampled_from([torch.int32, torch.int64]), label="fork index dtype")
            before = snapshot(pool)
            pool.fork(src=dev(torch.tensor([r[0] for r in rows], dtype=idt)),
                      dst=dev(torch.tensor([r[1] for r in rows], dtype=idt)),
                      keep=dev(torch.tensor([r[2] for r in rows], dtype=idt)))
            for s, d, kp in pairs:
                hist[d] = []
                for layer in range(layers):
                    T = hist[s][layer]["q"].shape[0]
                    upto = T - int(lengths[layer, s]) + kp
                    hist[d].append(_rows(hist[s][layer], slice(0, upto)))
            assert_untouched(pool, before, src + dst, "fork")
        elif op == "release":
            chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True), label="released")
            entries, idt = _addressing(data, chosen, "release")
            before = snapshot(pool)
            pool.release(dev(torch.tensor(entries, dtype=idt)))
            for s in chosen:
                del hist[s]
                pending.pop(s, None)
            assert_untouched(pool, before, chosen, "release")
    live = sorted(hist)
    assume(live)
    for layer in range(layers):
        S = pool.state_of(layer=layer, slots=dev(torch.tensor(live)))
        for i, s in enumerate(live):
            chk.check_state(S[i], hist[s][layer], f"state_of layer {layer} slot {s}")
    return chk


def sharers_fold_in_one_call(pool, op: str, *, dtype: torch.dtype, device) -> Checker:
    """Request a (a state, no entries) and its fork b share a's state slot; a third request c holds a state
    of its own.  All three fold in ONE call of ``op`` (decode, accept, flush or verify with fold=True),
    addressed as rows [b, pad, a, c]: one of a and b keeps the shared slot and folds it in place while the
    other folds the same state into a fresh slot.  Every output and the three final states are checked against the
    recurrence over each request's own tokens.  ``pool``: capacity 1, max_drafts >= 2, layer 0 used."""
    assert pool.capacity == 1 and pool.max_drafts >= 2
    tok = Tokens(7, pool.num_heads, pool.num_value_heads, pool.head_k_dim, pool.head_v_dim, dtype, "cpu")
    chk = Checker(dtype, pool.capacity)
    dev = lambda x: {f: t.to(device) for f, t in x.items()}  # noqa: E731
    a, c = pool.acquire(2).tolist()
    x = tok.draw(2, 3)
    pool.admit(**dev(x), layer=0, slots=torch.tensor([a, c], device=device), tail=0)  # states, no entries
    b = int(pool.acquire(1))
    pool.fork(src=torch.tensor([a], device=device), dst=torch.tensor([b], device=device), keep=0)
    assert int(pool.tensors()["state_slot"][0, a]) == int(pool.tensors()["state_slot"][0, b]) >= 0
    hist = {a: _rows(x, 0), b: _rows(x, 0), c: _rows(x, 1)}
    rows = [b, -1, a, c]
    slots = torch.tensor(rows, device=device)

    def decode(entries):
        new = _padded(tok.draw(sum(s >= 0 for s in entries), 1), entries)
        o = pool.decode(**dev(new), layer=0, slots=torch.tensor(entries, device=device))
        for i, s in enumerate(entries):
            if s >= 0:
                chk.check(o[i], hist[s], {f: t[i] for f, t in new.items()}, f"{op}: decode row {i} (slot {s})")
                hist[s] = _cat(hist[s], {f: t[i] for f, t in new.items()})

    if op == "decode":
        decode([a, b, c])              # one entry each: full at C = 1
        decode(rows)                   # all three fold, then take the token
    elif op == "accept":
        D = 2                          # length 0 + 2 accepted > C: all three fold
        d = _padded(tok.draw(3, D), rows)
        pool.verify(**dev(d), layer=0, slots=slots)
        pool.accept(layer=0, slots=slots, counts=torch.tensor([D, 0, D, D], device=device))
        for i, s in enumerate(rows):
            if s >= 0:
                hist[s] = _cat(hist[s], _rows(d, i))
    elif op == "flush":
        decode([a, b, c])
        pool.flush(layer=0, slots=slots)
    elif op == "verify":               # verify(fold=True): all three fold their one entry, then accept
        decode([a, b, c])
        d = _padded(tok.draw(3, 2), rows)
        o = pool.verify(**dev(d), layer=0, slots=slots, fold=True)
        counts = [2, 0, 1, 0]
        for i, s in enumerate(rows):
            if s >= 0:
                chk.check(o[i], hist[s], _rows(d, i), f"{op}: verify row {i} (slot {s})")
        pool.accept(layer=0, slots=slots, counts=torch.tensor(counts, device=device))
        for i, s in enumerate(rows):
            if s >= 0:
                hist[s] = _cat(hist[s], _rows(d, (i, slice(0, counts[i]))))
    else:
        raise ValueError(f"op: expected decode, accept, flush or verify, got {op!r}")
    ids = [a, b, c]
    assert len({int(pool.tensors()["state_slot"][0, s]) for s in ids}) == 3, "each request folded into its own slot"
    S = pool.state_of(layer=0, slots=torch.tensor(ids, device=device))
    for i, s in enumerate(ids):
        chk.check_state(S[i], hist[s], f"{op}: state of slot {s}")
    return chk
