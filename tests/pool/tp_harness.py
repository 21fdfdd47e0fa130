"""Tensor-parallel pools in separate processes under torch.distributed (gloo on CPU), driven in lock step
with one unsharded pool.

``Workers(world_size=4)`` starts four processes once (process startup is the cost: each is a fork of one
forkserver that has imported torch and the pools) and forms one gloo process group: the whole world is a
tp = 4 group, and ranks {0, 1} and {2, 3} are two tp = 2 groups (two data-parallel replicas of a tp = 2
layer).  ``TPPool(workers, ...)`` has the API of a pool: every call
runs on an unsharded pool in this process and, on each worker, on its shard of every layout (tokens
sliced with ``kvbuffer_ref.tp.shard_tokens``); the workers all-gather their outputs within each TP group
(``all_gather_heads``) and the call's outputs must equal the unsharded pool's: float64 bit for bit per
head, float32 within the error table (``compare`` against a float64 twin of the unsharded pool fed the
same inputs, the unsharded float32 pool as the baseline).  It returns the tp = 4 output, so
``schedule.run_schedule`` also checks the sharded outputs against the float64 recurrence, and
``tensors()`` gives the per-head tensors of the unsharded pool and of every shard side by side (the
bookkeeping must be the same in all), so ``run_schedule``'s untouched-slot checks cover the shards.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import traceback

import torch

from kvbuffer_ref.tp import all_gather_heads, check_pool_shard, shard_tokens, tp_shard
from kvbuffer.validate import compare

#: (name, head axis) of the pool's per-head tensors; the rest is bookkeeping, equal on every shard
PER_HEAD = {"state": 2, "k": 3, "u": 3, "G": 3, "dk": 3, "du": 3, "dG": 3}
TOKENS = ("q", "k", "v", "g", "beta", "initial_state")
OUT_AXIS = {"admit": 2, "decode": 2, "verify": 2, "state_of": 1}
LAYOUTS = {4: (0, 1, 2, 3), 2: ((0, 1), (2, 3))}  # tp -> its groups' world ranks


def _groups(world_size: int, rank: int):
    """{tp: (process group or None for the world, rank in the group)} for this world rank; every rank
    creates every group, in the same order (torch.distributed's rule)."""
    import torch.distributed as dist

    out = {world_size: (None, rank)}
    half = world_size // 2
    if half >= 2 and world_size % half == 0:
        for ranks in (list(range(0, half)), list(range(half, world_size))):
            g = dist.new_group(ranks)
            if rank in ranks:
                out[half] = (g, ranks.index(rank))
    return out


def make_pool(impl: str, **kw):
    if impl == "fast":
        from kvbuffer_fast.pool import KVPool
    else:
        from kvbuffer_ref.pool import KVPool
    return KVPool(**kw)


def _worker(rank: int, world_size: int, init: str, inbox, outbox) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the fast pool's launches, as in the driver's process
        from ..interpreter_launches import install
        install()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    groups = _groups(world_size, rank)
    pools, shards = {}, {}
    while True:
        msg = inbox.get()
        kind = msg[0]
        if kind == "stop":
            break
        err, result = None, None
        try:
            if kind == "new":
                _, impl, H, HV, kw, breaker = msg
                pools, shards = {}, {}
                for tp, (_, r) in groups.items():
                    shards[tp] = tp_shard(H, HV, tp, r)
                    if breaker is not None:           # a deliberately wrong mapping (the tests' own check)
                        shards[tp] = breaker(shards[tp])
                    pools[tp] = make_pool(impl, **kw, **shards[tp].pool_kwargs())
                    check_pool_shard(pools[tp], shards[tp])
            elif kind == "call":
                _, name, kwargs = msg
                outs = {}
                for tp, pool in pools.items():
                    local = dict(kwargs)
                    local.update(shard_tokens(shards[tp], **{f: kwargs[f] for f in TOKENS if f in kwargs}))
                    outs[tp] = getattr(pool, name)(**local)
                result = outs
            elif kind == "tensors":
                result = {tp: {n: t.detach().cpu().clone() for n, t in pool.tensors().items()}
                          for tp, pool in pools.items()}
        except Exception:  # reported to the driver after the collective below, so no rank waits forever
            err = f"rank {rank}: {traceback.format_exc()}"
        failed = torch.tensor([0 if err is None else 1])
        dist.all_reduce(failed)                      # every rank learns whether any failed before gathering
        if int(failed) == 0 and kind == "call" and msg[1] in OUT_AXIS:
            result = {tp: all_gather_heads(out, shards[tp], group=groups[tp][0], head_axis=OUT_AXIS[msg[1]])
                      for tp, out in result.items()}
        elif int(failed) == 0 and kind == "call" and msg[1] == "acquire":
            result = {tp: out.clone() for tp, out in result.items()}
        elif kind == "call":
            result = None
        outbox.put((rank, err, result))


class Workers:
    """``world_size`` gloo ranks (forked from a forkserver), reused across examples (``close()`` ends them)."""

    def __init__(self, world_size: int = 4, timeout: float = 120.0):
        import torch.multiprocessing as mp

        # forkserver: one fresh server imports torch and the pools once, and each rank is a fork of it (a spawned
        # rank would import them again); the server has run no torch work, so no thread pool is forked
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, "kvbuffer_ref.pool", "kvbuffer_fast.pool"])
        self.world_size, self.timeout = world_size, timeout
        self._dir = tempfile.mkdtemp(prefix="kvbuffer-tp-")
        init = "file://" + os.path.join(self._dir, "pg")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, init, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.layouts = {world_size: [(r, r) for r in range(world_size)]}
        half = world_size // 2
        if half >= 2:
            self.layouts[half] = [(r, r % half) for r in range(world_size)]  # (world rank, group rank)

    def ask(self, *msg) -> dict:
        """Send ``msg`` to every rank; {rank: result}.  A rank's exception is raised here with its traceback."""
        for q in self.inboxes:
            q.put(msg)
        replies = {}
        for _ in range(self.world_size):
            try:
                rank, err, result = self.outbox.get(timeout=self.timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise RuntimeError(f"tp workers: no reply within {self.timeout} s to {msg[:2]} (dead ranks: {dead})")
            replies[rank] = (err, result)
        errs = [e for e, _ in replies.values() if e]
        if errs:
            raise RuntimeError("a tp rank failed:\n" + "\n".join(errs))
        return {r: res for r, (_, res) in replies.items()}

    def close(self) -> None:
        for q in self.inboxes:
            q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        shutil.rmtree(self._dir, ignore_errors=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _first_bad_head(a: torch.Tensor, b: torch.Tensor, axis: int) -> str:
    for h in range(b.shape[axis]):
        x, y = a.select(axis, h), b.select(axis, h)
        if not _same(x, y):
            d = (x.double() - y.double()).abs()
            return f"value head {h}: max |diff| {float(d[d == d].max()) if bool((d == d).any()) else float('nan'):.3e}"
    return "shapes differ"


class TPPool:
    """An unsharded pool in this process and its tp shards on ``workers``, called in lock step (module
    docstring).  ``pool_kw``: KVPool's arguments without the heads; ``H``, ``HV``: the model's heads."""

    def __init__(self, workers: Workers, *, impl: str, H: int, HV: int, dtype: torch.dtype, breaker=None,
                 **pool_kw):
        self.workers, self.dtype, self.H, self.HV = workers, dtype, H, HV
        kw = dict(pool_kw, dtype=dtype)
        self.full = make_pool(impl, num_heads=H, num_value_heads=HV, **kw)
        # the float64 twin: the truth of the same schedule for the float32 comparison
        self.truth = None if dtype == torch.float64 else make_pool("ref", num_heads=H, num_value_heads=HV,
                                                                  **dict(kw, dtype=torch.float64))
        self.pads_zero = impl == "ref"
        workers.ask("new", impl, H, HV, kw, breaker)
        self.compared = {tp: 0 for tp in workers.layouts}

    def _call(self, name: str, **kwargs):
        out = getattr(self.full, name)(**kwargs)
        truth = None
        if self.truth is not None:
            up = {f: (t.to(torch.float64) if f in TOKENS and t is not None else t) for f, t in kwargs.items()}
            truth = getattr(self.truth, name)(**up)
        replies = self.workers.ask("call", name, kwargs)
        if name == "acquire":
            for rank, res in replies.items():
                for tp, slots in res.items():
                    assert torch.equal(slots, out), f"acquire: rank {rank} (tp={tp}) took slots {slots.tolist()}, " \
                                                    f"the unsharded pool {out.tolist()}"
            return out
        if name not in OUT_AXIS:
            return out
        axis = OUT_AXIS[name]
        slots = kwargs["slots"].to(torch.int64)
        rows = (slots >= 0).nonzero().flatten() if not self.pads_zero else torch.arange(slots.shape[0])
        gathered = {}
        for tp, members in self.workers.layouts.items():
            for world_rank, group_rank in members:
                got = replies[world_rank][tp]
                if group_rank == 0:
                    gathered.setdefault(tp, got)
                what = f"{name} tp={tp} (world rank {world_rank}, group rank {group_rank})"
                assert got.shape == out.shape, f"{what}: gathered shape {list(got.shape)}, unsharded {list(out.shape)}"
                a, b = got[rows], out[rows]
                if self.dtype == torch.float64:
                    assert _same(a, b), \
                        f"{what}: not bit-identical to the unsharded pool at {_first_bad_head(a, b, axis)}"
                else:
                    c = compare(a, truth[rows], b, name=what, dtype=self.dtype, head_axis=axis)
                    assert c.passed, str(c)
                self.compared[tp] += 1
        return gathered[max(gathered)]

    # the pool API, as schedule.run_schedule calls it
    def acquire(self, n):
        return self._call("acquire", n=n)

    def admit(self, q, k, v, **kw):
        return self._call("admit", q=q, k=k, v=v, **kw)

    def decode(self, q, k, v, **kw):
        return self._call("decode", q=q, k=k, v=v, **kw)

    def verify(self, q, k, v, **kw):
        return self._call("verify", q=q, k=k, v=v, **kw)

    def accept(self, **kw):
        return self._call("accept", **kw)

    def flush(self, **kw):
        return self._call("flush", **kw)

    def fork(self, **kw):
        return self._call("fork", **kw)

    def release(self, slots):
        return self._call("release", slots=slots)

    def state_of(self, **kw):
        return self._call("state_of", **kw)

    def tensors(self) -> dict:
        """The unsharded pool's tensors, its per-head ones concatenated on their head axis with every
        shard's (each rank's, each layout); the shards' bookkeeping must equal the unsharded pool's."""
        mine = {n: t.detach().cpu() for n, t in self.full.tensors().items()}
        replies = self.workers.ask("tensors")
        out = dict(mine)
        for rank in sorted(replies):
            for tp, ts in sorted(replies[rank].items()):
                for n, t in ts.items():
                    if n in PER_HEAD:
                        out[n] = torch.cat([out[n], t.to(out[n].dtype)], dim=PER_HEAD[n])
                    else:
                        assert torch.equal(t, mine[n]), f"tensors: {n} of rank {rank} (tp={tp}) differs from the " \
                                                        f"unsharded pool's"
        return out
