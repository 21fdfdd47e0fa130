"""The serving pool as a hypothesis state machine: any schedule of admit / decode / verify / accept / flush /
fork / release over up to 32 requests is exact, isolated and leaves nothing behind.

Rules (each runs on every layer, distinct tokens per layer; slot index tensors int32 or int64, shuffled,
with -1 pad rows whose token rows are NaN and whose per-row arguments are junk the pool must ignore):
admit (ragged prompts, shorter and longer than C, one call per prompt length), decode, verify (chains
and trees, per-row draft counts; without a fold, or folding every row's buffer or the rows a bool tensor
flags, pads' flags junk), accept (counts or nodes, tensors or one int; fold=False where nothing passes C),
flush (full, partial per row, one int), fork (keep 0..lengths: a prefix at token granularity), release,
and a state check.

Invariants:

* every output of every request equals the float64 recurrence over exactly that request's accepted tokens
  (its own, and its source's up to the fork point) plus the call's tokens, within the error table's
  budget (``compare``: a float64 pool against the truth alone, a float32 pool beside the float32
  recurrence on the same tokens as its baseline); ``state_of`` likewise, in the check rule and at the end;
* no request sees another's data: after every call, everything outside the addressed buffer slots and
  the state slots they reference is bit-identical to before (``schedule.assert_untouched``);
* the bookkeeping is the model's: lengths, direct mode (``has_state`` iff a state slot), drafts pending,
  state slots shared exactly by the requests whose states have not diverged since a fork, ``refs`` the
  number of live requests on each slot;
* released slots leave nothing behind: a slot without a request has lengths 0, no state slot, no drafts,
  and a slot comes out of ``acquire`` empty.

The truth is kept per request and layer as the float64 state after its accepted tokens (and the float32
recurrence's state as the baseline), so a check costs the new tokens only.

Machines: ``kvbuffer_ref.KVPool`` in float64 and float32 and ``kvbuffer_fast.pool.KVPool`` (the Triton
interpreter without CUDA) on small shapes; on a CUDA device also the fast pool at Qwen3-Next's shapes
(H = 16, HV = 32, K = V = 128, C up to 64), compiled:

    python3 -m pytest tests/pool/test_pool_stateful.py
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,  # noqa: E402
                                 rule, run_state_machine_as_test)

import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_ref.entries import fold_count  # noqa: E402
from kvbuffer import implementations  # noqa: E402
from kvbuffer.validate import compare  # noqa: E402
from kvbuffer.validate.contracts import baseline_recurrent, segmented_forms  # noqa: E402
from kvbuffer.validate.properties import FORM_CHUNK  # noqa: E402

from .schedule import FIELDS, Tokens, _addressing, _padded, _same, assert_untouched, snapshot  # noqa: E402

CUDA = torch.cuda.is_available()
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
JUNK = 10 ** 6  # a pad row's per-row argument: never read

#: (examples, steps per example) per hypothesis profile: ci keeps the file near 25 s of CPU
RUNS = {"ci": (6, 25), "thorough": (60, 40), "gpu": (4, 30)}


def _settings(scale: float = 1.0):
    examples, steps = RUNS.get(PROFILE, RUNS["ci"])
    return settings(max_examples=max(1, round(examples * scale)), stateful_step_count=steps, deadline=None)


def _cat(a: dict, b: dict) -> dict:
    return {f: torch.cat([a[f], b[f]], dim=0) for f in FIELDS}


def _take(x: dict, idx) -> dict:
    return {f: t[idx] for f, t in x.items()}


class Truth:
    """One request's truth in one layer: its accepted tokens (``hist``, [T, ...] per field), the float64
    state after them and the plain recurrence's state in the pool's dtype (None for float64).  The baseline of a
    comparison: that recurrence and the chunkwise forms with chunks of 64 and of C over the whole history
    (``chunkwise``), as the pool's buffer (capacity C) and its admit keep cumulative gates.  ``marks``: per
    (contract, chunk), the forms' states at chunk boundaries within the history ([(position, [S per form])],
    ascending, the first (0, None): the zero state), from which ``chunkwise`` resumes: a chunk never spans a
    boundary, so the forms from there are the numbers of the forms over the whole history."""

    def __init__(self, hist: dict, dtype: torch.dtype, C: int, marks: dict | None = None):
        self.hist, self.dtype, self.C = hist, dtype, C
        self.marks = {} if marks is None else marks
        self.S64, self.Sb = self._from_scratch(hist)

    def _from_scratch(self, hist: dict):
        if hist["q"].shape[0] == 0:
            return None, None
        _, S64, _, Sb = self.run(hist, None, None)
        return S64, Sb

    def run(self, new: dict, S64, Sb, contract: str = "ieee"):
        """(o64, S64, o_base, S_base) of the tokens ``new`` [n, ...] from the states ``S64`` / ``Sb``; the
        baseline recurrence computed in ``contract``'s arithmetic."""
        def rec(dtype, S, contract):
            a = {f: t[None].to(dtype) for f, t in new.items()}
            o, S = baseline_recurrent(a.pop("q"), a.pop("k"), a.pop("v"), **a,
                                      initial_state=None if S is None else S[None], contract=contract)
            return o[0], S[0]
        o64, S64 = rec(torch.float64, S64, "ieee")
        ob, Sb = rec(self.dtype, Sb, contract) if self.dtype != torch.float64 else (None, None)
        return o64, S64, ob, Sb

    def chunkwise(self, new: dict, contract: str = "ieee", commit: bool = False):
        """The chunkwise baseline forms over the history and then the tokens ``new`` [n, ...]: ([o [1, t, ...]],
        [S [1, ...]]), one per chunk (64 and C) and way of summing the cumulative gates, as
        ``truth_and_baseline`` takes them (the recurrence, the other baseline form, is carried incrementally),
        the outputs those of the last t >= n tokens; none for float64.  Each form resumes from its last mark
        and marks the last boundary within the history (and ``new`` too, with ``commit``)."""
        H, n = self.hist["q"].shape[0], new["q"].shape[0]
        T = H + n
        if self.dtype == torch.float64 or T == 0:
            return [], []
        x = {f: t.to(self.dtype) for f, t in _cat(self.hist, new).items()}
        kept = T if commit else H
        outs, states = [], []
        for c in sorted({FORM_CHUNK, self.C}):
            marks = self.marks.setdefault((contract, c), [(0, None)])
            a, S = marks[-1]
            o = []
            for b in (kept // c * c, T):  # to the last boundary within the kept tokens, then to the end
                if b > a:
                    forms = segmented_forms(**{f: t[None, a:b] for f, t in x.items()}, starts=range(0, b - a, c),
                                            initial_states=S, contract=contract)
                    o.append([f[0] for f in forms])
                    S, a = [f[1] for f in forms], b
                    if b <= kept and b % c == 0:
                        marks.append((b, S))
            t = [torch.cat(parts, dim=1) for parts in zip(*o)] if o else [None] * len(S)
            assert n == 0 or t[0].shape[1] >= n, "a mark past the history"
            outs += t
            states += S
        return outs, states

    def check(self, actual: torch.Tensor, new: dict, what: str, commit: bool, contract: str = "ieee"):
        """``actual`` [n, HV, V]: the outputs of the last n of the tokens ``new`` after the history, computed by
        a kernel that keeps ``contract`` (the pool's admit: its chunk kernels' contract); with ``commit``, the
        baseline state carried on is that contract's too."""
        o64, S64, ob, Sb = self.run(new, self.S64, self.Sb, contract)
        n = actual.shape[0]
        oc, _ = self.chunkwise(new, contract, commit=commit)
        base = None if ob is None else [ob[None, -n:]] + [o[:, -n:] for o in oc]
        c = compare(actual[None].cpu(), o64[None, -n:], base, name=what, dtype=self.dtype, contract=contract)
        assert c.passed, str(c)
        if commit:
            self.hist, self.S64, self.Sb = _cat(self.hist, new), S64, Sb

    def commit(self, new: dict) -> None:
        if new["q"].shape[0]:
            _, self.S64, _, self.Sb = self.run(new, self.S64, self.Sb)
            self.hist = _cat(self.hist, new)

    def check_state(self, actual: torch.Tensor, what: str) -> None:
        if self.S64 is None:
            assert bool((actual == 0).all()), f"{what}: a request without tokens has a non-zero state"
            return
        _, Sc = self.chunkwise(_take(self.hist, slice(0, 0)))
        base = None if self.Sb is None else [self.Sb[None]] + Sc
        c = compare(actual[None].cpu(), self.S64[None], base, name=what, dtype=self.dtype, head_axis=1)
        assert c.passed, str(c)

    def prefix(self, upto: int) -> "Truth":
        marks = {key: [m for m in ms if m[0] <= upto] for key, ms in self.marks.items()}
        return Truth(_take(self.hist, slice(0, upto)), self.dtype, self.C, marks)


class Request:
    """The model of one live request: per layer its truth, buffered entries, whether it holds a state,
    the identity of that state (equal between requests exactly while they share it) and pending drafts."""

    def __init__(self, layers: int):
        self.truth = [None] * layers
        self.lengths = [0] * layers
        self.has_state = [False] * layers
        self.state_id = [None] * layers
        self.pending = None  # per layer: (draft tokens [Dn, ...], parents [Dn], num_drafts, tree)


def _tracked(fn):
    """A rule that marks the machine unclean while it runs: after a failing rule the model and the pool
    disagree, and ``teardown`` (which hypothesis runs anyway) must not raise a second, confusing error."""
    import functools

    @functools.wraps(fn)
    def run(self, *a, **kw):
        self.clean = False
        fn(self, *a, **kw)
        self.clean = True
    return run


def machine(*, make_pool, kind: str, dtype, device, layers: int, N: int, S: int, C_choices, D: int, H: int,
            HV: int, K: int, V: int, max_batch: int = 6):
    """A RuleBasedStateMachine over pools from ``make_pool(C)`` (one per example; C drawn)."""
    # the fast pool admits through kvbuffer_fast's chunk kernels: judged in the contract they keep there (three
    # TF32 products for float32 inputs, compiled), as the validator judges its prefill lane
    admit_contract = implementations.fast().lane_contracts.get(("prefill", dtype), "ieee") if kind == "fast" \
        else "ieee"

    class PoolMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.pool = None
            self.clean = True
            self.reqs: dict[int, Request] = {}
            self.ids = 0

        # -------------------------------------------------------------- helpers
        def new_id(self) -> int:
            self.ids += 1
            return self.ids

        def dev(self, t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        def idle(self) -> list:
            return sorted(s for s, r in self.reqs.items() if r.pending is None)

        def free(self) -> int:
            return N - len(self.reqs)

        def address(self, data, chosen: list, label: str):
            entries, idt = _addressing(data, chosen, label)
            return entries, self.dev(torch.tensor(entries, dtype=idt)), idt

        def check_pads(self, o: torch.Tensor, entries: list, what: str) -> None:
            if kind == "ref":  # the reference documents zeros for pad rows (the fast pool: unspecified)
                for i, s in enumerate(entries):
                    if s < 0:
                        assert bool((o[i] == 0).all()), f"{what}: pad row {i} has non-zero outputs"

        def assert_acquired_empty(self, slots: list) -> None:
            t = self.pool.tensors()
            for b in slots:
                assert bool(t["live"][b]), f"acquire: slot {b} is not live"
                for name, empty in (("lengths", 0), ("state_slot", -1), ("num_drafts", 0)):
                    assert bool((t[name][:, b] == empty).all()), f"acquire: slot {b} starts with {name} {t[name][:, b]}"
                assert not bool(t["has_state"][:, b].any() | t["pending"][:, b].any()), \
                    f"acquire: slot {b} starts with a state or drafts"

        # -------------------------------------------------------------- rules
        @initialize(C=st.sampled_from(C_choices), seed=st.integers(0, 2 ** 31 - 1))
        def build(self, C, seed):
            self.C = C
            self.pool = make_pool(C)
            self.tok = Tokens(seed, H, HV, K, V, dtype, "cpu")

        @precondition(lambda self: self.free() > 0)
        @rule(data=st.data())
        @_tracked
        def admit(self, data):
            C = self.C
            n = data.draw(st.integers(1, min(max_batch, self.free())), label="admitted")
            lengths = sorted({max(1, T) for T in (1, C - 1, C, C + 1, 2 * C + 1, 3 * C)})
            Ts = [data.draw(st.sampled_from(lengths), label="prompt length") for _ in range(n)]
            slots = self.pool.acquire(n).tolist()
            self.assert_acquired_empty(slots)
            before = snapshot(self.pool)
            for b in slots:
                self.reqs[b] = Request(layers)
            for T in sorted(set(Ts)):  # one admit call per prompt length: the pool takes one T per call
                group = [b for b, t in zip(slots, Ts) if t == T]
                entries, sl, _ = self.address(data, group, "admit")
                for layer in range(layers):
                    x = self.tok.draw(len(group), T)
                    xp = _padded(_take(x, [group.index(s) for s in entries if s >= 0]), entries)
                    o = self.pool.admit(**{f: self.dev(t) for f, t in xp.items()}, layer=layer, slots=sl)
                    self.check_pads(o, entries, "admit")
                    for i, b in enumerate(entries):
                        if b < 0:
                            continue
                        new = _take(x, group.index(b))
                        r = self.reqs[b]
                        r.truth[layer] = Truth(_take(new, slice(0, 0)), dtype, self.C)
                        r.truth[layer].check(o[i], new, f"admit T={T} layer {layer} slot {b}", commit=True,
                                             contract=admit_contract)
                        r.lengths[layer] = T if T <= C else T % C
                        r.has_state[layer] = T > C
                        r.state_id[layer] = self.new_id() if T > C else None
            assert_untouched(self.pool, before, slots, "admit")

        @precondition(lambda self: self.idle())
        @rule(data=st.data())
        @_tracked
        def decode(self, data):
            chosen = data.draw(st.lists(st.sampled_from(self.idle()), min_size=1, unique=True), label="decoded")
            entries, sl, _ = self.address(data, chosen, "decode")
            before = snapshot(self.pool)
            for layer in range(layers):
                x = self.tok.draw(len(chosen), 1)
                xp = _padded(_take(x, [chosen.index(s) for s in entries if s >= 0]), entries)
                o = self.pool.decode(**{f: self.dev(t) for f, t in xp.items()}, layer=layer, slots=sl)
                self.check_pads(o, entries, "decode")
                for i, b in enumerate(entries):
                    if b < 0:
                        continue
                    r = self.reqs[b]
                    r.truth[layer].check(o[i], _take(x, chosen.index(b)),
                                         f"decode layer {layer} slot {b}", commit=True)
                    if r.lengths[layer] == self.C:  # a full buffer folds first
                        r.lengths[layer], r.has_state[layer], r.state_id[layer] = 0, True, self.new_id()
                    r.lengths[layer] += 1
            assert_untouched(self.pool, before, chosen, "decode")

        @precondition(lambda self: self.reqs and D > 0)
        @rule(data=st.data())
        @_tracked
        def verify(self, data):
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, unique=True), label="verified")
            entries, sl, _ = self.address(data, chosen, "verify")
            Dn = data.draw(st.integers(1, D), label="drafts")
            tree = data.draw(st.booleans(), label="tree")
            par, nd = [], []
            for b in entries:
                if b < 0:
                    par.append([JUNK] * Dn)
                    nd.append(JUNK)
                else:
                    par.append([data.draw(st.integers(-1, i - 1), label="parent") if tree else i - 1
                                for i in range(Dn)])
                    nd.append(data.draw(st.integers(0, Dn), label="num_drafts"))
            parents, num_drafts = torch.tensor(par), torch.tensor(nd)
            how = data.draw(st.sampled_from(["no fold", "fold", "fold flags"]), label="verify fold")
            flags = [data.draw(st.booleans(), label="folds") for _ in entries] if how == "fold flags" else None
            fold = {} if how == "no fold" else dict(fold=True if flags is None else self.dev(torch.tensor(flags)))
            before = snapshot(self.pool)
            drafts = {b: [None] * layers for b in chosen}
            for layer in range(layers):
                x = self.tok.draw(len(entries), Dn)
                for i, b in enumerate(entries):
                    if b < 0:
                        for f in FIELDS:
                            x[f][i] = float("nan")
                o = self.pool.verify(**{f: self.dev(t) for f, t in x.items()}, layer=layer, slots=sl,
                                     parents=self.dev(parents), num_drafts=self.dev(num_drafts), **fold)
                self.check_pads(o, entries, "verify")
                for i, b in enumerate(entries):
                    if b < 0:
                        continue
                    truth = self.reqs[b].truth[layer]
                    if not tree and nd[i]:  # a chain: one recurrence gives every node's output
                        truth.check(o[i, :nd[i]], _take(_take(x, i), slice(0, nd[i])),
                                    f"verify chain layer {layer} slot {b}", commit=False)
                    else:
                        for node in range(nd[i]):
                            path = ref.path_to(parents[i], node)
                            truth.check(o[i, node:node + 1], {f: x[f][i, path] for f in FIELDS},
                                        f"verify tree layer {layer} slot {b} node {node}", commit=False)
                    drafts[b][layer] = (_take(x, i), parents[i], nd[i], tree)
                    r = self.reqs[b]
                    if fold and (flags is None or flags[i]) and r.lengths[layer]:  # its buffer folds first
                        r.lengths[layer], r.has_state[layer], r.state_id[layer] = 0, True, self.new_id()
            for b in chosen:
                self.reqs[b].pending = drafts[b]
            assert_untouched(self.pool, before, chosen, "verify")

        @precondition(lambda self: any(r.pending is not None for r in self.reqs.values()))
        @rule(data=st.data())
        @_tracked
        def accept(self, data):
            ready = sorted(s for s, r in self.reqs.items() if r.pending is not None)
            chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True), label="accepted")
            entries, sl, idt = self.address(data, chosen, "accept")
            chains = all(not self.reqs[b].pending[0][3] for b in chosen)
            by_counts = chains and data.draw(st.booleans(), label="by counts")
            nds = {b: self.reqs[b].pending[0][2] for b in chosen}
            if data.draw(st.booleans(), label="one int for all rows"):
                low = min(nds.values())
                v = data.draw(st.integers(0, low) if by_counts else st.integers(-1, low - 1), label="value")
                picks, arg = {b: v for b in chosen}, v
            else:
                picks = {b: data.draw(st.integers(0, nds[b]) if by_counts else st.integers(-1, nds[b] - 1),
                                      label="count" if by_counts else "node") for b in chosen}
                arg = self.dev(torch.tensor([picks[b] if b >= 0 else JUNK for b in entries], dtype=idt))
            def path_of(b, layer):
                return list(range(picks[b])) if by_counts else ref.path_to(self.reqs[b].pending[layer][1], picks[b])
            fits = all(self.reqs[b].lengths[layer] + len(path_of(b, layer)) <= self.C
                       for b in chosen for layer in range(layers))
            # where no accepted path passes C, the caller may say so (no fold launch)
            nofold = dict(fold=False) if fits and data.draw(st.booleans(), label="fold=False") else {}
            before = snapshot(self.pool)
            for layer in range(layers):
                self.pool.accept(layer=layer, slots=sl, **{"counts" if by_counts else "nodes": arg}, **nofold)
                for b in chosen:
                    r = self.reqs[b]
                    x = r.pending[layer][0]
                    path = path_of(b, layer)
                    f = fold_count(r.lengths[layer], len(path), self.C)
                    r.truth[layer].commit({n: x[n][path] for n in FIELDS})
                    r.lengths[layer] += len(path) - f
                    if f:
                        r.has_state[layer], r.state_id[layer] = True, self.new_id()
            for b in chosen:
                self.reqs[b].pending = None
            assert_untouched(self.pool, before, chosen, "accept")

        @precondition(lambda self: self.idle())
        @rule(data=st.data())
        @_tracked
        def flush(self, data):
            chosen = data.draw(st.lists(st.sampled_from(self.idle()), min_size=1, unique=True), label="flushed")
            entries, sl, idt = self.address(data, chosen, "flush")
            before = snapshot(self.pool)
            for layer in range(layers):
                how = data.draw(st.sampled_from(["all", "per row", "one int"]), label="flush")
                if how == "all":
                    counts, arg = {b: self.reqs[b].lengths[layer] for b in chosen}, None
                elif how == "one int":
                    c = data.draw(st.integers(0, min(self.reqs[b].lengths[layer] for b in chosen)), label="count")
                    counts, arg = {b: c for b in chosen}, c
                else:
                    counts = {b: data.draw(st.integers(0, self.reqs[b].lengths[layer]), label="count") for b in chosen}
                    arg = self.dev(torch.tensor([counts[b] if b >= 0 else JUNK for b in entries], dtype=idt))
                self.pool.flush(layer=layer, slots=sl, count=arg)
                for b in chosen:
                    r = self.reqs[b]
                    r.lengths[layer] -= counts[b]
                    if counts[b]:
                        r.has_state[layer], r.state_id[layer] = True, self.new_id()
            assert_untouched(self.pool, before, chosen, "flush")

        @precondition(lambda self: self.idle() and self.free() > 0)
        @rule(data=st.data())
        @_tracked
        def fork(self, data):
            src = data.draw(st.lists(st.sampled_from(self.idle()), min_size=1, max_size=min(4, self.free()),
                                     unique=True), label="forked")
            dst = self.pool.acquire(len(src)).tolist()
            self.assert_acquired_empty(dst)
            keep = [data.draw(st.integers(0, min(self.reqs[s].lengths)), label="keep") for s in src]
            rows = list(data.draw(st.permutations(list(zip(src, dst, keep))), label="fork order"))
            for _ in range(data.draw(st.integers(0, 2), label="fork pads")):
                rows.insert(data.draw(st.integers(0, len(rows)), label="pad row"), (-1, -1, JUNK))
            idt = data.draw(st.sampled_from([torch.int32, torch.int64]), label="fork index dtype")
            before = snapshot(self.pool)
            col = lambda j: self.dev(torch.tensor([r[j] for r in rows], dtype=idt))  # noqa: E731
            self.pool.fork(src=col(0), dst=col(1), keep=col(2))
            for s, d, kp in zip(src, dst, keep):
                a, r = self.reqs[s], Request(layers)
                for layer in range(layers):
                    T = a.truth[layer].hist["q"].shape[0]
                    upto = T - a.lengths[layer] + kp  # the source's tokens up to its last fold, plus keep
                    r.truth[layer] = a.truth[layer].prefix(upto)
                    r.lengths[layer], r.has_state[layer] = kp, a.has_state[layer]
                    r.state_id[layer] = a.state_id[layer]
                self.reqs[d] = r
            assert_untouched(self.pool, before, src + dst, "fork")

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        @_tracked
        def release(self, data):
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, unique=True),
                               label="released")
            entries, sl, _ = self.address(data, chosen, "release")
            before = snapshot(self.pool)
            self.pool.release(sl)
            for b in chosen:
                del self.reqs[b]
            assert_untouched(self.pool, before, chosen, "release")

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        @_tracked
        def check_states(self, data):
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=6, unique=True),
                               label="states read")
            entries, sl, _ = self.address(data, chosen, "state_of")
            layer = data.draw(st.integers(0, layers - 1), label="layer")
            before = snapshot(self.pool)
            S_now = self.pool.state_of(layer=layer, slots=sl)
            for i, b in enumerate(entries):
                if b >= 0:
                    self.reqs[b].truth[layer].check_state(S_now[i], f"state_of layer {layer} slot {b}")
                else:
                    assert bool((S_now[i] == 0).all()), f"state_of: pad row {i} is not zeros"
            assert_untouched(self.pool, before, [], "state_of")
            for name, t in self.pool.tensors().items():  # refs too: state_of changes nothing at all
                assert _same(t, before[name]), f"state_of changed the pool's {name}"

        # -------------------------------------------------------------- invariants
        @invariant()
        def bookkeeping_is_the_models(self):
            if self.pool is None:
                return
            t = {n: x.cpu() for n, x in self.pool.tensors().items()}
            live = set(self.reqs)
            assert t["live"].nonzero().flatten().tolist() == sorted(live), "live slots differ from the requests"
            for b in range(N):
                if b in live:
                    continue  # a slot without a request leaves nothing behind
                assert bool((t["lengths"][:, b] == 0).all() & (t["state_slot"][:, b] == -1).all()
                            & (t["num_drafts"][:, b] == 0).all()) and not bool(t["has_state"][:, b].any()
                                                                              | t["pending"][:, b].any()), \
                    f"slot {b} holds no request but keeps entries, a state slot or drafts"
            for layer in range(layers):
                held = {}
                for b, r in self.reqs.items():
                    slot = int(t["state_slot"][layer, b])
                    assert int(t["lengths"][layer, b]) == r.lengths[layer], \
                        f"layer {layer} slot {b}: lengths {int(t['lengths'][layer, b])}, the model {r.lengths[layer]}"
                    assert bool(t["has_state"][layer, b]) == r.has_state[layer] == (slot >= 0), \
                        f"layer {layer} slot {b}: has_state / state slot {slot} / the model's {r.has_state[layer]}"
                    assert bool(t["pending"][layer, b]) == (r.pending is not None), f"slot {b}: pending"
                    if r.pending is None:
                        assert int(t["num_drafts"][layer, b]) == 0, f"slot {b}: num_drafts without drafts pending"
                    if slot >= 0:
                        held.setdefault(slot, set()).add(r.state_id[layer])
                refs = torch.zeros_like(t["refs"][layer])
                for b in self.reqs:
                    slot = int(t["state_slot"][layer, b])
                    if slot >= 0:
                        refs[slot] += 1
                assert torch.equal(refs, t["refs"][layer]), \
                    f"layer {layer}: refs {t['refs'][layer].tolist()}, the requests hold {refs.tolist()}"
                ids = [i for s in held.values() for i in s]
                assert all(len(s) == 1 for s in held.values()) and len(ids) == len(set(ids)), \
                    f"layer {layer}: a state slot is shared by requests whose states diverged, or one state is in " \
                    f"two slots: {held}"

        def teardown(self):
            if self.pool is None or not self.reqs or not self.clean:
                return
            live = sorted(self.reqs)
            for layer in range(layers):
                S_now = self.pool.state_of(layer=layer, slots=self.dev(torch.tensor(live)))
                for i, b in enumerate(live):
                    self.reqs[b].truth[layer].check_state(S_now[i], f"final state layer {layer} slot {b}")

    PoolMachine.__name__ = f"PoolMachine_{kind}_{str(dtype).replace('torch.', '')}"
    return PoolMachine


def _ref_pool(dtype, layers, N, S, D, H, HV, K, V):
    return lambda C: ref.KVPool(layers=layers, num_state_slots=S, num_buffer_slots=N, capacity=C, max_drafts=D,
                                num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=dtype)


def _fast_pool(device, layers, N, S, D, H, HV, K, V):
    from kvbuffer_fast.pool import KVPool
    return lambda C: KVPool(layers=layers, num_state_slots=S, num_buffer_slots=N, capacity=C, max_drafts=D,
                            num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, device=device)


SMALL = dict(layers=2, N=32, S=32, D=3, H=1, HV=2, K=4, V=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_pool(dtype):
    """The oracle pool: 32 buffer and state slots (a state per request at most), C in {1, 3, 4}."""
    m = machine(make_pool=_ref_pool(dtype, **SMALL), kind="ref", dtype=dtype, device="cpu", C_choices=[1, 3, 4],
                **SMALL)
    run_state_machine_as_test(m, settings=_settings())


def test_fast_pool_small():
    """The fast pool on small shapes (the interpreter without CUDA): one layer, C in {1, 3}, 8 requests."""
    shapes = dict(SMALL, layers=1, N=8, S=8)
    device = "cuda" if CUDA else "cpu"
    m = machine(make_pool=_fast_pool(device, **shapes), kind="fast", dtype=torch.float32, device=device,
                C_choices=[1, 3], max_batch=3, **shapes)
    run_state_machine_as_test(m, settings=_settings())


@pytest.mark.skipif(not CUDA, reason="production shapes run compiled on a CUDA device")
def test_fast_pool_qwen3_next_shapes():
    """Qwen3-Next's linear-attention heads (H = 16, HV = 32, K = V = 128), C in {16, 32, 64} (decode past
    C = 32 takes the tile fold), 4 drafts plus the bonus token, 32 requests over 2 layers."""
    shapes = dict(layers=2, N=32, S=32, D=5, H=16, HV=32, K=128, V=128)
    m = machine(make_pool=_fast_pool("cuda", **shapes), kind="fast", dtype=torch.float32, device="cuda",
                C_choices=[16, 32, 64], max_batch=8, **shapes)
    # each step snapshots the pool (138 MB of states) and runs the float64 truth on the host: a few
    # examples of a dozen steps fit a device call; the thorough profile runs its own count
    few = settings(max_examples=2, stateful_step_count=12, deadline=None)
    run_state_machine_as_test(m, settings=_settings() if PROFILE == "thorough" else few)
