"""Tensor parallelism by heads: an engine's TP layout mapped to pool shards, token tensors sliced to a
rank's heads, and per-rank outputs gathered back.

A gated-delta-rule layer with ``num_heads`` H q/k heads and ``num_value_heads`` HV value heads (value
head j reads q/k head ``j // (HV / H)``) runs under tensor parallelism of size ``world_size`` (tp) as
the serving engines do: rank r holds the value heads ``r * HV/tp .. (r + 1) * HV/tp - 1`` and the q/k
heads they read, so its pool (``KVPool(..., head_range=...)``) holds only those heads' states and
buffers, every pool operation runs on the local heads unchanged, and only the output projection
all-reduces (the engine's business, not the pool's).

* ``tp <= H``: tp must divide H; rank r holds q/k heads ``r * H/tp .. (r + 1) * H/tp - 1`` (whole
  groups).  This is the layout of vLLM's and SGLang's Qwen3-Next GDN layers, which shard
  ``num_k_heads // tp`` q/k heads and ``num_v_heads // tp`` value heads per rank.
* ``tp > H``: tp must be a multiple of H and divide HV; each rank holds HV/tp value heads of ONE
  group and that group's q/k head, replicated on the tp/H ranks that share the group (as vLLM does
  for attention KV heads when tp > num_kv_heads, and for Mamba2 B/C groups).  The GDN layers of vLLM
  and SGLang reject this case (they need num_k_heads % tp == 0); ``replicate_key_heads=False``
  rejects it here too.

docs/tensor-parallel.md describes the mapping of ranks, layers and pipeline stages to pools and the
memory per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .checks import require_tensor
from .pool import head_layout

__all__ = ["HeadShard", "tp_shard", "tp_shards", "shard_tokens", "gather_heads", "all_gather_heads",
           "check_pool_shard"]


@dataclass(frozen=True)
class HeadShard:
    """The heads a tensor-parallel rank holds.

    ``value_heads`` / ``key_heads``: (start, stop) ranges of the model's value heads and q/k heads;
    ``key_replicas``: how many ranks hold each of this rank's q/k heads (1: no replication).
    ``pool_kwargs()`` gives the KVPool arguments of the shard.
    """

    rank: int
    world_size: int
    num_heads: int
    num_value_heads: int
    value_heads: tuple[int, int]
    key_heads: tuple[int, int]
    key_replicas: int

    @property
    def local_heads(self) -> int:
        """q/k heads of the shard (the pool's ``num_heads``)."""
        return self.key_heads[1] - self.key_heads[0]

    @property
    def local_value_heads(self) -> int:
        """value heads of the shard (the pool's ``num_value_heads``)."""
        return self.value_heads[1] - self.value_heads[0]

    def pool_kwargs(self) -> dict:
        """``num_heads``, ``num_value_heads`` (the model's) and ``head_range`` for KVPool (either pool)."""
        return dict(num_heads=self.num_heads, num_value_heads=self.num_value_heads, head_range=self.value_heads)


def _positive(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: expected a positive int, got {n!r}")
    return n


def tp_shard(num_heads: int, num_value_heads: int, world_size: int, rank: int, *,
             replicate_key_heads: bool = True) -> HeadShard:
    """The head shard of tensor-parallel ``rank`` of ``world_size`` for a layer of ``num_heads`` q/k heads
    and ``num_value_heads`` value heads (module docstring).  ValueError, naming the argument and what it
    expected, for a layout that would split a head group badly."""
    H, HV, tp = _positive("num_heads", num_heads), _positive("num_value_heads", num_value_heads), \
        _positive("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank: expected an int in 0..{tp - 1} (world_size={tp}), got {rank!r}")
    if HV % H:
        raise ValueError(f"num_value_heads: expected a multiple of num_heads={H} (value head j reads q/k head "
                         f"j // (num_value_heads / num_heads)), got {HV}")
    group = HV // H
    if tp <= H:
        if H % tp:
            raise ValueError(f"world_size: {tp} ranks cannot hold equal whole groups of the {H} q/k heads; expected "
                             f"a divisor of num_heads={H}" + (f", or a multiple of it that divides num_value_heads="
                                                              f"{HV} (replicated q/k heads)" if replicate_key_heads
                                                              else ""))
        replicas = 1
    else:
        if not replicate_key_heads:
            raise ValueError(f"world_size: {tp} ranks for {H} q/k heads would give each rank a fraction of a q/k head; "
                             f"expected a divisor of num_heads={H} (vLLM's and SGLang's GDN layers need "
                             f"num_k_heads % tp == 0), or pass replicate_key_heads=True to replicate each q/k head "
                             f"on world_size / num_heads ranks")
        if tp % H or HV % tp:
            raise ValueError(f"world_size: {tp} ranks for {H} q/k heads of {group} value heads each replicate q/k "
                             f"heads "
                             f"only when world_size is a multiple of num_heads={H} and divides num_value_heads={HV} "
                             f"(each rank then holds num_value_heads / world_size value heads of one group); got {tp}")
        replicas = tp // H
    per = HV // tp
    start, stop = rank * per, (rank + 1) * per
    h0, h_local, hv_local = head_layout(H, HV, (start, stop))
    assert hv_local == per and h_local == max(1, H // tp)
    return HeadShard(rank=rank, world_size=tp, num_heads=H, num_value_heads=HV, value_heads=(start, stop),
                     key_heads=(h0, h0 + h_local), key_replicas=replicas)


def tp_shards(num_heads: int, num_value_heads: int, world_size: int, *,
              replicate_key_heads: bool = True) -> list[HeadShard]:
    """Every rank's shard, in rank order."""
    return [tp_shard(num_heads, num_value_heads, world_size, r, replicate_key_heads=replicate_key_heads)
            for r in range(_positive("world_size", world_size))]


def _shard(name: str, x) -> "HeadShard":
    if not isinstance(x, HeadShard):
        raise TypeError(f"{name}: expected a HeadShard (tp_shard / tp_shards), got {type(x).__name__}")
    return x


def _heads(name: str, x: torch.Tensor, head_axis: int, expected: int, what: str) -> int:
    require_tensor(name, x)
    if isinstance(head_axis, bool) or not isinstance(head_axis, int):
        raise TypeError(f"head_axis: expected an int, got {type(head_axis).__name__}")
    if not -x.dim() <= head_axis < x.dim():
        raise ValueError(f"{name}: head_axis {head_axis} is out of range for a {x.dim()}-d tensor "
                         f"(shape {list(x.shape)})")
    axis = head_axis % x.dim()
    if x.shape[axis] != expected:
        raise ValueError(f"{name}: expected {expected} {what} on axis {axis}, got shape {list(x.shape)}")
    return axis


def shard_tokens(shard: HeadShard, *, head_axis: int = 2, **tensors) -> dict:
    """The rank's slices of full-model token tensors, contiguous: ``q`` and ``k`` [B, T, H, K] to its q/k
    heads; ``v`` [B, T, HV, V], ``g`` [B, T, HV] or per-channel [B, T, HV, K], ``beta`` [B, T, HV] and
    ``initial_state`` [B, HV, K, V] (head axis 1) to its value heads.  Any of them may be left out or
    None (returned as None)."""
    known = {"q": "key", "k": "key", "v": "value", "g": "value", "beta": "value", "initial_state": "value"}
    _shard("shard", shard)
    out = {}
    for name, x in tensors.items():
        if name not in known:
            raise TypeError(f"{name}: not a token tensor; expected some of {', '.join(known)}")
        if x is None:
            out[name] = None
            continue
        key = known[name] == "key"
        n, (a, b) = (shard.num_heads, shard.key_heads) if key else (shard.num_value_heads, shard.value_heads)
        axis = _heads(name, x, 1 if name == "initial_state" else head_axis, n,
                      "q/k heads (the model's)" if key else "value heads (the model's)")
        out[name] = x.narrow(axis, a, b - a).contiguous()
    return out


def gather_heads(parts: Sequence[torch.Tensor], shards: Sequence[HeadShard], *, head_axis: int = 2) -> torch.Tensor:
    """The full-model tensor from per-rank value-head tensors: ``parts[i]`` holds the value heads of
    ``shards[i]`` on ``head_axis`` (outputs [B, T, HV, V]: 2; states [B, HV, K, V]: 1).  The shards must
    be one layout's ranks, each given once (any order)."""
    if not isinstance(parts, (list, tuple)) or not isinstance(shards, (list, tuple)):
        raise TypeError(f"parts, shards: expected a list of tensors and a list of HeadShards, got "
                        f"{type(parts).__name__} and {type(shards).__name__}")
    if len(parts) != len(shards) or not parts:
        raise ValueError(f"parts: expected one tensor per shard ({len(shards)}), got {len(parts)}")
    for i, sh in enumerate(shards):
        _shard(f"shards[{i}]", sh)
    first = shards[0]
    if sorted(s.rank for s in shards) != list(range(first.world_size)) or any(
            (s.world_size, s.num_heads, s.num_value_heads) != (first.world_size, first.num_heads,
                                                              first.num_value_heads) for s in shards):
        raise ValueError(f"shards: expected the {first.world_size} ranks of one layout, each once, got ranks "
                         f"{[s.rank for s in shards]}")
    order = sorted(range(len(shards)), key=lambda i: shards[i].value_heads[0])
    for i in order:
        _heads(f"parts[{i}]", parts[i], head_axis, shards[i].local_value_heads, "value heads (the shard's)")
    ref, axis = parts[order[0]], head_axis % parts[order[0]].dim()
    for i in order:
        x = parts[i]
        if (x.dim() != ref.dim() or x.shape[:axis] != ref.shape[:axis] or x.shape[axis + 1:] != ref.shape[axis + 1:]
                or x.device != ref.device):
            raise ValueError(f"parts[{i}]: expected the shape (but for the head axis {axis}) and device of "
                             f"parts[{order[0]}] {list(ref.shape)} on {ref.device}, got {list(x.shape)} on {x.device}")
    return torch.cat([parts[i] for i in order], dim=head_axis)


def all_gather_heads(local: torch.Tensor, shard: HeadShard, *, group=None, head_axis: int = 2) -> torch.Tensor:
    """``gather_heads`` over a torch.distributed process group: every rank of ``group`` (its group ranks
    are the TP ranks: ``shard.rank`` must be this process's rank in the group) passes its local tensor and
    gets the full-model tensor.  What an engine's output projection does instead is an all-reduce of the
    projected partial sums; this is for tests and checks."""
    import torch.distributed as dist

    _shard("shard", shard)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size != shard.world_size or me != shard.rank:
        raise ValueError(f"shard: rank {shard.rank} of {shard.world_size}, but this process is rank {me} of the "
                         f"{size} ranks of the process group")
    _heads("local", local, head_axis, shard.local_value_heads, "value heads (the shard's)")
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=head_axis)  # group rank r holds value heads r * HV/tp ..: rank order is head order


def check_pool_shard(pool, shard: HeadShard) -> None:
    """ValueError unless ``pool`` (either KVPool) holds exactly ``shard``'s heads."""
    _shard("shard", shard)
    if not all(hasattr(pool, n) for n in ("key_head_start", "num_heads", "num_value_heads", "head_range")):
        raise TypeError(f"pool: expected a KVPool (kvbuffer_ref.pool or kvbuffer_fast.pool), got {type(pool).__name__}")
    got = (pool.key_head_start, pool.num_heads, pool.num_value_heads, tuple(pool.head_range))
    want = (shard.key_heads[0], shard.local_heads, shard.local_value_heads, shard.value_heads)
    if got != want:
        raise ValueError(f"pool: holds (first q/k head, H, HV, head_range) {got}, but rank {shard.rank} of "
                         f"{shard.world_size} holds {want}")
