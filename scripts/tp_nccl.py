#!/usr/bin/env python3
"""Tensor parallelism of the serving pool on GPUs: tp shards (kvbuffer_fast.pool.KVPool with head_range),
each rank on its own GPU under torch.distributed with NCCL, against one single-GPU pool of all heads.

Every rank runs the same fixed schedule (admit, decode across a fold, verify + accept of chains, fork,
decode with a pad row, flush, state_of, release) on its shard, with full-model tokens drawn from one seed
and sliced to its heads (``kvbuffer_ref.tp.shard_tokens``); the outputs are all-gathered
(``all_gather_heads``) and rank 0 compares them with its single-GPU pool's: bit-identical or not, the
largest difference, and the error table's float32 verdict with the single pool's output as the reference.
Then the decode time per layer-step at batch B: each rank's shard (all ranks at once, CUDA events, after
warm-up, over several layers) against the single-GPU pool's (rank 0 alone).  One JSON object on stdout.

    python3 scripts/tp_nccl.py                     # tp = 2 on 2 GPUs (mp.spawn, NCCL), Qwen3-Next shapes
    torchrun --nproc-per-node 2 scripts/tp_nccl.py # the same under torchrun
    python3 scripts/tp_nccl.py --simulate          # one GPU: the tp shards as pools side by side
    python3 scripts/tp_nccl.py --cpu               # no GPU: gloo, kvbuffer_ref's float64 pool, tiny shapes
    python3 scripts/tp_nccl.py --cpu --impl fast   # the same with kvbuffer_fast under the Triton interpreter
    python3 scripts/tp_nccl.py --cpu --simulate    # one process on the CPU, the shards side by side

Fewer GPUs than needed: {"skipped": ...} and exit code 0.  Shapes (defaults: Qwen3-Next H = 16,
HV = 32, K = V = 128; tp = 2; B = 64; 4 layers; capacity 16; 4 drafts) are options (--help).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--simulate", action="store_true", help="one device, one process: the tp shards as pools side by "
                                                           "side on the same GPU (with --cpu: on the CPU)")
    p.add_argument("--cpu", action="store_true", help="no GPU: gloo on CPU (or --simulate on CPU), tiny shapes")
    p.add_argument("--impl", choices=("ref", "fast"), default=None,
                   help="the pool: kvbuffer_fast (default on GPUs; on a CPU under the Triton interpreter) or "
                        "kvbuffer_ref in float64 (default with --cpu)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--heads", type=int, default=None, help="q/k heads H (default 16; --cpu: 4)")
    p.add_argument("--value-heads", type=int, default=None, help="value heads HV (default 32; --cpu: 8)")
    p.add_argument("--dim", type=int, default=None, help="K = V (default 128; --cpu: 8)")
    p.add_argument("--batch", type=int, default=None, help="requests B (default 64; --cpu: 4)")
    p.add_argument("--layers", type=int, default=None, help="layers L (default 4; --cpu: 2)")
    p.add_argument("--capacity", type=int, default=None, help="buffer capacity C (default 16; --cpu: 4)")
    p.add_argument("--drafts", type=int, default=None, help="draft room D (default 4; --cpu: 2)")
    p.add_argument("--warmup", type=int, default=5, help="untimed decode steps before timing (default 5)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps, each over every layer "
                                                          "(default 3 C: folds included)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    small = a.cpu
    for name, big, tiny in (("heads", 16, 4), ("value_heads", 32, 8), ("dim", 128, 8), ("batch", 64, 4),
                            ("layers", 4, 2), ("capacity", 16, 4), ("drafts", 4, 2)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if small else big)
    if a.steps is None:
        a.steps = 3 * a.capacity
    if a.impl is None:
        a.impl = "ref" if a.cpu else "fast"
    if a.cpu and a.impl == "fast":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton
    return a


def versions() -> dict:
    try:
        import triton
        tv = triton.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        tv = f"unavailable ({type(e).__name__})"
    return dict(torch=torch.__version__, triton=tv)


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------- pools

def make_pool(a, dev, shard=None):
    kw = dict(layers=a.layers, num_state_slots=a.batch + a.batch // 2 + 1, num_buffer_slots=a.batch + a.batch // 2 + 1,
              capacity=a.capacity, max_drafts=a.drafts, num_heads=a.heads, num_value_heads=a.value_heads,
              head_k_dim=a.dim, head_v_dim=a.dim, device=dev)
    if shard is not None:
        kw.update(shard.pool_kwargs())
    if a.impl == "ref":
        from kvbuffer_ref.pool import KVPool
        return KVPool(dtype=torch.float64, **kw)
    from kvbuffer_fast.pool import KVPool
    return KVPool(**kw)


def pool_bytes(pool) -> int:
    return sum(t.numel() * t.element_size() for t in pool.tensors().values())


class Shards:
    """This process's shard pools and how their outputs come back whole: one shard and an all-gather
    (a rank of a process group), or every shard and a concatenation (--simulate)."""

    def __init__(self, a, dev, shards, group_gather: bool):
        self.a, self.dev, self.shards, self.group_gather = a, dev, shards, group_gather
        self.pools = [make_pool(a, dev, s) for s in shards]

    def call(self, name: str, kwargs: dict, head_axis: int):
        from kvbuffer_ref.tp import all_gather_heads, gather_heads, shard_tokens
        outs = []
        for s, pool in zip(self.shards, self.pools):
            local = dict(kwargs)
            local.update(shard_tokens(s, **{f: kwargs[f] for f in ("q", "k", "v", "g", "beta") if f in kwargs}))
            outs.append(getattr(pool, name)(**local))
        if outs[0] is None or head_axis is None:
            return outs[0]
        if self.group_gather:
            return all_gather_heads(outs[0], self.shards[0], head_axis=head_axis)
        return gather_heads(outs, self.shards, head_axis=head_axis)


# ------------------------------------------------------------------------------------------- schedule

def tokens(a, seed: int, B: int, T: int, dev, pads=()):
    """Full-model tokens (every rank draws the same from ``seed`` on the host): q, k L2-normalised, gates
    in [-1.5, 0], betas in [0, 1]; NaN in the ``pads`` rows."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64 if a.impl == "ref" else torch.float32
    n = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    r = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=torch.nn.functional.normalize(n(B, T, a.heads, a.dim), dim=-1),
             k=torch.nn.functional.normalize(n(B, T, a.heads, a.dim), dim=-1),
             v=n(B, T, a.value_heads, a.dim), g=-1.5 * r(B, T, a.value_heads), beta=r(B, T, a.value_heads))
    for f in x:
        x[f][list(pads)] = float("nan")
    return {f: t.to(dt).to(dev) for f, t in x.items()}


class Comparer:
    """Rank 0's record of gathered tp outputs against the single pool's."""

    def __init__(self, exact: bool):
        self.exact, self.rows = exact, []

    def __call__(self, what: str, tp_out, single_out, valid, head_axis: int):
        from kvbuffer.validate import compare
        a, b = tp_out[valid], single_out[valid]
        same = bool(torch.equal(a, b))
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        c = compare(a, b.double(), None, name=what, dtype=b.dtype, head_axis=head_axis)
        self.rows.append(dict(call=what, bit_identical=same, max_abs_diff=diff, passed=bool(c.passed) and
                              (same or not self.exact), worst=str(c) if not c.passed else None))

    def summary(self) -> dict:
        bad = [r for r in self.rows if not r["passed"]]
        return dict(compared=len(self.rows), all_bit_identical=all(r["bit_identical"] for r in self.rows),
                    passed=not bad, max_abs_diff=max((r["max_abs_diff"] for r in self.rows), default=0.0),
                    failures=bad[:5], rule=("float64: bit for bit" if self.exact else
                                            "float32 row of the error table, the single-GPU pool's output as the "
                                            "reference (floors only)"))


def run_schedule(a, dev, side: Shards, single, cmp: Comparer | None) -> None:
    """The fixed schedule on ``side`` (and ``single``, rank 0 only; None elsewhere)."""
    B, L, C, D = a.batch, a.layers, a.capacity, a.drafts
    seed = iter(range(a.seed * 100003, a.seed * 100003 + 10 ** 6))

    def both(name, head_axis=None, what="", **kw):
        out = side.call(name, kw, head_axis)
        if single is not None:
            ref = getattr(single, name)(**kw)
            if head_axis is not None and cmp is not None:
                s = kw["slots"].to(torch.int64)
                cmp(what or name, out, ref, (s >= 0).nonzero().flatten(), head_axis)
            return ref
        return out

    def acquire(n):
        got = side.pools[0].acquire(n)
        for p in side.pools[1:]:
            assert torch.equal(p.acquire(n), got)
        if single is not None:
            s = single.acquire(n)
            assert torch.equal(s.cpu(), got.cpu()), "acquire: the shard and the single pool took different slots"
        return got.to(dev)

    slots = acquire(B)
    for layer in range(L):        # prompts of C + C // 2 + 1 tokens: a folded head and a buffered tail
        both("admit", 2, f"admit L{layer}", **tokens(a, next(seed), B, C + C // 2 + 1, dev), layer=layer, slots=slots)
    for step in range(C + 2):     # across a fold
        for layer in range(L):
            both("decode", 2, f"decode {step} L{layer}", **tokens(a, next(seed), B, 1, dev), layer=layer, slots=slots)
    counts = (torch.arange(B, device=dev) % (D + 1))
    for layer in range(L):
        both("verify", 2, f"verify L{layer}", **tokens(a, next(seed), B, D, dev), layer=layer, slots=slots)
        both("accept", None, layer=layer, slots=slots, counts=counts)
    nf = max(1, B // 4)
    src = slots[:nf]
    dst = acquire(nf)
    keep = side.pools[0].tensors()["lengths"][:, src.to(torch.int64)].min(0).values
    both("fork", None, src=src, dst=dst, keep=keep.to(dev))
    live = torch.cat([slots, dst])
    padded = torch.cat([live[:1], torch.tensor([-1], device=dev), live[1:]])   # a pad row (a CUDA-graph pad)
    for step in range(2):
        for layer in range(L):
            both("decode", 2, f"decode after fork {step} L{layer}",
                 **tokens(a, next(seed), padded.shape[0], 1, dev, pads=(1,)), layer=layer, slots=padded)
    half = live[: live.shape[0] // 2]
    for layer in range(L):
        both("flush", None, layer=layer, slots=half)
        both("state_of", 1, f"state_of L{layer}", layer=layer, slots=live)
    both("release", None, slots=live)


# --------------------------------------------------------------------------------------------- timing

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_decode(a, dev, pools_and_shards, barrier=None) -> list[float]:
    """ms per decode call (one layer, B requests) of each (pool, shard) in turn: fresh requests admitted
    with C // 2 tokens, ``warmup`` untimed steps, then ``steps`` steps over every layer, CUDA events."""
    from kvbuffer_ref.tp import shard_tokens
    out = []
    for pool, shard in pools_and_shards:
        slots = pool.acquire(a.batch).to(dev)
        loc = lambda x: x if shard is None else {**x, **shard_tokens(shard, **x)}  # noqa: E731
        for layer in range(a.layers):
            pool.admit(**loc(tokens(a, 7 + layer, a.batch, max(1, a.capacity // 2), dev)), layer=layer, slots=slots)
        steps = [loc(tokens(a, 1000 + i, a.batch, 1, dev)) for i in range(a.warmup + a.steps)]
        for x in steps[:a.warmup]:
            for layer in range(a.layers):
                pool.decode(**x, layer=layer, slots=slots)
        _sync(dev)
        if barrier is not None:
            barrier()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for x in steps[a.warmup:]:
            for layer in range(a.layers):
                pool.decode(**x, layer=layer, slots=slots)
        if dev.type == "cuda":
            end.record()
            end.synchronize()
            total = start.elapsed_time(end)
        else:
            total = (time.perf_counter() - t0) * 1e3
        out.append(total / (a.steps * a.layers))
        pool.release(slots)
    return out


# ----------------------------------------------------------------------------------------------- runs

def shapes_of(a) -> dict:
    return dict(H=a.heads, HV=a.value_heads, K=a.dim, V=a.dim, tp=a.tp, B=a.batch, layers=a.layers,
                capacity=a.capacity, drafts=a.drafts, timed_steps=a.steps, warmup=a.warmup)


def rank_main(rank: int, a, init: str, result_path: str, local_rank=None) -> None:
    """One rank of the process group (NCCL on GPU ``local_rank``, default ``rank``; or gloo with --cpu)."""
    import torch.distributed as dist
    from kvbuffer_ref.tp import tp_shard

    if a.cpu:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    else:
        local = rank if local_rank is None else local_rank
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    backend = "gloo" if a.cpu else "nccl"
    try:
        kw = dict(device_id=dev) if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=a.tp, **kw)
    except TypeError:  # a torch without init_process_group(device_id=)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=a.tp)
    try:
        shard = tp_shard(a.heads, a.value_heads, a.tp, rank)
        side = Shards(a, dev, [shard], group_gather=True)
        single = make_pool(a, dev) if rank == 0 else None
        cmp = Comparer(exact=a.impl == "ref") if rank == 0 else None
        run_schedule(a, dev, side, single, cmp)
        mine = time_decode(a, dev, [(side.pools[0], shard)], barrier=dist.barrier)[0]
        per_rank = [None] * a.tp
        dist.all_gather_object(per_rank, mine)
        dist.barrier()
        single_ms = time_decode(a, dev, [(single, None)])[0] if rank == 0 else None
        mem = [None] * a.tp
        dist.all_gather_object(mem, pool_bytes(side.pools[0]))
        names = [None] * a.tp
        dist.all_gather_object(names, device_name(dev))
        if rank == 0:
            res = dict(mode="cpu-gloo" if a.cpu else "nccl", backend=backend, impl=a.impl, devices=names,
                       device=names[0],
                       **versions(), shapes=shapes_of(a),
                       shards=[dict(rank=r, **{k: list(v) for k, v in (("value_heads", s.value_heads),
                                                                       ("key_heads", s.key_heads))})
                               for r, s in enumerate([tp_shard(a.heads, a.value_heads, a.tp, r)
                                                      for r in range(a.tp)])],
                       correctness=cmp.summary(),
                       decode_ms_per_layer=dict(per_rank=per_rank, single=single_ms,
                                                speedup_per_rank=[single_ms / t for t in per_rank]),
                       pool_bytes=dict(per_rank=mem, single=pool_bytes(single)))
            with open(result_path, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank, a, init, result_path):
    try:
        rank_main(rank, a, init, result_path)
    except Exception:
        if rank == 0 or not os.path.exists(result_path):
            with open(result_path + f".err{rank}", "w") as f:
                f.write(traceback.format_exc())
        raise


def simulate(a) -> dict:
    """One device: the tp shards as pools side by side, outputs concatenated."""
    from kvbuffer_ref.tp import tp_shards
    if a.cpu:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    shards = tp_shards(a.heads, a.value_heads, a.tp)
    side = Shards(a, dev, shards, group_gather=False)
    single = make_pool(a, dev)
    cmp = Comparer(exact=a.impl == "ref")
    run_schedule(a, dev, side, single, cmp)
    per_rank = time_decode(a, dev, list(zip(side.pools, shards)))
    single_ms = time_decode(a, dev, [(single, None)])[0]
    return dict(mode="simulate", impl=a.impl, device=device_name(dev), **versions(), shapes=shapes_of(a),
                correctness=cmp.summary(),
                decode_ms_per_layer=dict(per_rank=per_rank, single=single_ms,
                                         speedup_per_rank=[single_ms / t for t in per_rank],
                                         note="shards timed one after the other on the same device"),
                pool_bytes=dict(per_rank=[pool_bytes(p) for p in side.pools], single=pool_bytes(single)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    a = parse(argv)
    torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        a.tp = int(os.environ["WORLD_SIZE"])
    base = dict(script="scripts/tp_nccl.py", **versions())
    try:
        from kvbuffer_ref.tp import tp_shard
        tp_shard(a.heads, a.value_heads, a.tp, 0)          # a bad layout: its error, before any process starts
        if a.simulate:
            if not a.cpu and not torch.cuda.is_available():
                print(json.dumps(dict(base, mode="simulate", skipped="no CUDA GPU visible (--simulate needs one; "
                                                                     "--cpu runs without)")))
                return 0
            res = simulate(a)
            print(json.dumps(dict(base, **res)))
            return 0 if res["correctness"]["passed"] else 1
        import torch.distributed as dist
        if not a.cpu:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < a.tp:
                print(json.dumps(dict(base, mode="nccl", skipped=f"tp={a.tp} needs {a.tp} GPUs, {have} visible "
                                                                 f"(--simulate runs the shards on one GPU, --cpu on "
                                                                 f"none)", gpus=have)))
                return 0
            if not dist.is_nccl_available():
                print(json.dumps(dict(base, mode="nccl", skipped="torch.distributed has no NCCL backend")))
                return 0
        tmp = tempfile.mkdtemp(prefix="kvbuffer-tp-nccl-")
        result_path = os.path.join(tmp, "result.json")
        if torchrun:                          # every rank runs main(); rank 0 prints
            rank = int(os.environ["RANK"])
            port = os.environ.get("MASTER_PORT", 0)
            result_path = os.path.join(tempfile.gettempdir(), f"kvbuffer-tp-nccl-{port}.json")
            rank_main(rank, a, "env://", result_path, local_rank=int(os.environ["LOCAL_RANK"]))
            if rank != 0:
                return 0
            with open(result_path) as f:
                res = json.load(f)
            print(json.dumps(dict(base, **res)))
            return 0 if res["correctness"]["passed"] else 1
        import torch.multiprocessing as mp
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_spawned, args=(a, init, result_path), nprocs=a.tp, join=True)
        with open(result_path) as f:
            res = json.load(f)
        print(json.dumps(dict(base, **res)))
        return 0 if res["correctness"]["passed"] else 1
    except Exception as e:  # noqa: BLE001 - one JSON object, whatever happened
        errs = ""
        tmp_dir = locals().get("tmp")
        if tmp_dir and os.path.isdir(tmp_dir):
            errs = "".join(open(os.path.join(tmp_dir, n)).read() for n in sorted(os.listdir(tmp_dir)) if ".err" in n)
        print(json.dumps(dict(base, error=f"{type(e).__name__}: {e}", traceback=errs or traceback.format_exc())))
        return 1


if __name__ == "__main__":
    sys.exit(main())
