"""Memory held per request for speculative verification: buffered (KVBuffer) vs per-draft states.

Pure Python arithmetic (docs/speculative.md states the formulas).  Per request and per linear-attention
layer, with ``|S| = HV * K * V * state_bytes``:

* **buffered** (KVBuffer, u-cache): the one state ``|S|``; the buffer's C entries, each
  ``H*K*key_bytes + HV*V*cache_bytes + HV*Gk*cache_bytes`` (key per q/k head; u and the cumulative
  gate per value head; Gk = K for per-channel gates, else 1); its bookkeeping ``lengths`` (int64) and
  ``has_state`` (bool): 9 bytes; and, while d drafts are in flight between verify and accept, the
  ``Drafts``: d entries of the same size, plus ``parents`` (d int64) and ``num_drafts`` (1 int64).
* **per-draft-state** (SGLang ``intermediate_ssm``, vLLM 1 + num_spec blocks): the state plus one
  full intermediate state per verified draft token: ``(1 + d) |S|``.

Both are multiplied by the number of linear-attention layers.  The maximum number of concurrent
requests a budget allows is ``floor(budget / bytes_per_request)`` for each style.  Activations that
both styles share (the drafts' q, k, v, g, beta while a step runs, the output) are not counted.

The serving pool (``kvbuffer_ref.KVPool``, ``kvbuffer_fast.pool.KVPool``): ``pool_bytes(pool)`` is what a
pool holds now by kind (states in use, free state slots, buffer entries, draft room, bookkeeping), read
from ``pool.tensors()``; ``pool_layout_bytes`` the same for a layout not built;
``max_pool_requests`` / ``concurrency_table`` the most concurrent requests a budget serves for a
context-length mix (the share of requests that stay within C and never hold a state), C and draft
count, against per-draft-state serving.  ``python3 -m kvbuffer_ref.memory`` prints the table for
Qwen3-Next's shapes (docs/serving.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

__all__ = ["LayerShape", "MemoryBreakdown", "itemsize", "state_bytes", "entry_bytes", "buffered_verify_bytes",
           "per_draft_state_bytes", "max_concurrent_requests", "compare_styles", "POOL_KINDS", "PoolBytes",
           "pool_bytes", "pool_layout_bytes", "max_pool_requests", "concurrency_table", "QWEN3_NEXT",
           "QWEN3_NEXT_LINEAR_LAYERS"]

_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1,
          "float8_e4m3fn": 1, "float8_e5m2": 1}

DType = Union[str, "torch.dtype"]  # noqa: F821


def itemsize(dtype: DType) -> int:
    """Bytes per element of a dtype given as a torch.dtype or a name ('float32', 'bfloat16', ...)."""
    name = str(dtype).replace("torch.", "")
    if name not in _SIZES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; expected one of {sorted(_SIZES)}")
    return _SIZES[name]


@dataclass(frozen=True)
class LayerShape:
    """One linear-attention layer: heads, head dims and the storage dtypes.

    Defaults follow serving practice: fp32 state and u-cache (kernels accumulate in fp32), bf16 keys.
    """

    H: int
    HV: int
    K: int
    V: int
    state_dtype: DType = "float32"
    key_dtype: DType = "bfloat16"
    cache_dtype: DType = "float32"
    channel_gate: bool = False

    def __post_init__(self):
        for name in ("H", "HV", "K", "V"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"{name}: expected a positive int, got {x!r}")
        if self.HV % self.H:
            raise ValueError(f"HV: expected a multiple of H={self.H}, got {self.HV}")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per request (all layers) by component; ``total`` is their sum."""

    style: str
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _count(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {x!r}")
    return x


def state_bytes(shape: LayerShape) -> int:
    """|S| = HV * K * V * itemsize(state_dtype): one request's state in one layer."""
    return shape.HV * shape.K * shape.V * itemsize(shape.state_dtype)


def entry_bytes(shape: LayerShape) -> int:
    """One u-cache entry (k, u, G) of one request in one layer."""
    gk = shape.K if shape.channel_gate else 1
    c = itemsize(shape.cache_dtype)
    return shape.H * shape.K * itemsize(shape.key_dtype) + shape.HV * shape.V * c + shape.HV * gk * c


def buffered_verify_bytes(shape: LayerShape, *, drafts: int, capacity: int, layers: int = 1) -> MemoryBreakdown:
    """Bytes per request held by KVBuffer verification of ``drafts`` draft tokens (see the module doc)."""
    d, C, L = _count("drafts", drafts), _count("capacity", capacity), _count("layers", layers)
    e = entry_bytes(shape)
    return MemoryBreakdown("buffered", {
        "state": L * state_bytes(shape),
        "buffer_entries": L * C * e,
        "buffer_bookkeeping": L * (8 + 1),
        "draft_entries": L * d * e,
        "draft_bookkeeping": L * (8 * d + 8),
    })


def per_draft_state_bytes(shape: LayerShape, *, drafts: int, layers: int = 1) -> MemoryBreakdown:
    """Bytes per request held by per-draft-state verification: (1 + drafts) full states per layer."""
    d, L = _count("drafts", drafts), _count("layers", layers)
    return MemoryBreakdown("per_draft_state", {
        "state": L * state_bytes(shape),
        "intermediate_states": L * d * state_bytes(shape),
    })


def max_concurrent_requests(budget_bytes: int, per_request_bytes: int) -> int:
    """How many requests fit in ``budget_bytes``: floor(budget / per_request)."""
    if per_request_bytes <= 0:
        raise ValueError(f"per_request_bytes: expected a positive int, got {per_request_bytes!r}")
    return max(0, int(budget_bytes) // int(per_request_bytes))


def compare_styles(shape: LayerShape, *, drafts: int, capacity: int, layers: int, budget_bytes: int) -> dict:
    """Both styles side by side: bytes per request, requests that fit in the budget and their ratio."""
    buf = buffered_verify_bytes(shape, drafts=drafts, capacity=capacity, layers=layers)
    pds = per_draft_state_bytes(shape, drafts=drafts, layers=layers)
    n_buf = max_concurrent_requests(budget_bytes, buf.total)
    n_pds = max_concurrent_requests(budget_bytes, pds.total)
    return {
        "buffered_bytes_per_request": buf.total,
        "per_draft_state_bytes_per_request": pds.total,
        "buffered_parts": dict(buf.parts),
        "per_draft_state_parts": dict(pds.parts),
        "buffered_max_requests": n_buf,
        "per_draft_state_max_requests": n_pds,
        "ratio": (n_buf / n_pds) if n_pds else float("inf"),
    }


# ---------------------------------------------------------------------------------------------- the pool
#: the pool's tensors by kind (``pool.tensors()`` names, shared by kvbuffer_ref's and kvbuffer_fast's pools)
POOL_KINDS = {
    "buffer_entries": ("k", "u", "G"),
    "draft_room": ("dk", "du", "dG"),
    "bookkeeping": ("lengths", "has_state", "state_slot", "refs", "parents", "num_drafts", "pending", "live"),
}


@dataclass(frozen=True)
class PoolBytes:
    """The bytes a pool holds now, by kind (``parts``; ``total`` their sum: every tensor of
    ``pool.tensors()``), and the counts behind them."""

    parts: dict
    live_requests: int
    states_in_use: int      # state slots referenced by a request, summed over layers
    state_slots: int        # state slots, summed over layers

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def pool_bytes(pool) -> PoolBytes:
    """What ``pool`` (a ``kvbuffer_ref.KVPool`` or ``kvbuffer_fast.pool.KVPool``) holds now, from
    ``pool.tensors()``: ``states_in_use`` (state slots with refs > 0), ``free_state_slots`` (the other
    state slots: preallocated, holding nothing), ``buffer_entries`` (k, u, G of every buffer slot),
    ``draft_room`` (dk, du, dG) and ``bookkeeping`` (lengths, flags, slot indices, refs, parents, draft
    counts, live).  The fast pool's sink rows (one per per-slot tensor, addressed by no slot) are not
    in ``tensors()`` and not counted."""
    t = pool.tensors()
    state, refs = t["state"], t["refs"]
    if state.dim() < 2 or tuple(refs.shape) != tuple(state.shape[:2]):
        raise ValueError(f"pool: expected state [L, S, ...] and refs [L, S], got {list(state.shape)} and "
                         f"{list(refs.shape)}")
    per_slot = state[0, 0].nbytes if state.shape[1] else 0
    used = int((refs > 0).sum())
    parts = {"states_in_use": used * per_slot, "free_state_slots": state.nbytes - used * per_slot}
    for kind, names in POOL_KINDS.items():
        parts[kind] = sum(t[n].nbytes for n in names)
    return PoolBytes(parts=parts, live_requests=int(t["live"].sum()), states_in_use=used,
                     state_slots=state.shape[0] * state.shape[1])


def pool_layout_bytes(shape: LayerShape, *, layers: int, num_buffer_slots: int, num_state_slots: int,
                      capacity: int, max_drafts: int) -> dict:
    """The bytes of a pool of that layout by kind, without building it (as ``pool_bytes`` of a pool
    whose state slots are all in use): per layer, a state slot is ``|S|`` plus its refs (int64), a
    buffer slot ``(C + D) e`` (its entries and draft room) plus lengths, state_slot, num_drafts (int64),
    has_state, pending (bool) and parents (D int64); ``live`` is one bool per buffer slot."""
    L, N, S = _count("layers", layers), _count("num_buffer_slots", num_buffer_slots), \
        _count("num_state_slots", num_state_slots)
    C, D = _count("capacity", capacity), _count("max_drafts", max_drafts)
    e = entry_bytes(shape)
    return {
        "states": L * S * state_bytes(shape),
        "buffer_entries": L * N * C * e,
        "draft_room": L * N * D * e,
        "bookkeeping": L * (N * (3 * 8 + 2 * 1 + 8 * D) + S * 8) + N,
    }


def _state_slots_needed(n: int, direct_fraction: float) -> int:
    """State slots for n requests of which ``direct_fraction`` never fold (each other holds one)."""
    return math.ceil(round(n * (1.0 - direct_fraction), 9))


def max_pool_requests(shape: LayerShape, *, budget_bytes: int, layers: int, capacity: int, drafts: int,
                      direct_fraction: float = 0.0) -> int:
    """The most concurrent requests a pool of ``budget_bytes`` serves: N buffer slots (capacity C, draft
    room ``drafts``) and ``ceil((1 - direct_fraction) N)`` state slots, as laid out by
    ``pool_layout_bytes``.  ``direct_fraction``: the share of requests whose whole context (prompt and
    every token they generate) stays within C, so that they never fold and never hold a state (the
    direct-mode rule); every other request holds one state slot per layer.  Forks sharing a state would
    need fewer; they are not counted."""
    if not isinstance(direct_fraction, (int, float)) or isinstance(direct_fraction, bool) \
            or not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"direct_fraction: expected a number in 0..1, got {direct_fraction!r}")
    budget = _count("budget_bytes", budget_bytes)

    def held(n: int) -> int:
        return sum(pool_layout_bytes(shape, layers=layers, num_buffer_slots=n,
                                     num_state_slots=_state_slots_needed(n, direct_fraction), capacity=capacity,
                                     max_drafts=drafts).values())

    lo, hi = 0, 1
    while held(hi) <= budget:  # held is increasing in n: double, then bisect
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if held(mid) <= budget else (lo, mid)
    return lo


def concurrency_table(shape: LayerShape, *, budget_bytes: int, layers: int, drafts: int, capacities=(16, 32, 64),
                      direct_fractions=(0.0, 0.5)) -> list:
    """Rows {C, direct_fraction, pool_requests, per_draft_state_requests, ratio}: the pool
    (``max_pool_requests``) against per-draft-state serving (SGLang / vLLM style: every request holds
    its state and one intermediate state per draft token, ``(1 + drafts) |S|`` per layer, short or
    not), for the same budget."""
    pds = max_concurrent_requests(budget_bytes, per_draft_state_bytes(shape, drafts=drafts, layers=layers).total)
    rows = []
    for C in capacities:
        for f in direct_fractions:
            n = max_pool_requests(shape, budget_bytes=budget_bytes, layers=layers, capacity=C, drafts=drafts,
                                  direct_fraction=f)
            rows.append(dict(C=C, direct_fraction=f, pool_requests=n, per_draft_state_requests=pds,
                             ratio=n / pds if pds else float("inf")))
    return rows


#: Qwen3-Next (80B-A3B): 48 layers, three of every four Gated DeltaNet (36 linear-attention layers);
#: 16 q/k heads and 32 value heads of 128 dims
QWEN3_NEXT = dict(H=16, HV=32, K=128, V=128)
QWEN3_NEXT_LINEAR_LAYERS = 36


def _main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m kvbuffer_ref.memory",
                                 description="Concurrent requests per memory budget: the KVBuffer pool against "
                                             "per-draft-state serving, Qwen3-Next linear-attention shapes.")
    ap.add_argument("--budget-gib", type=float, default=40.0, help="memory for the linear-attention state (GiB)")
    ap.add_argument("--layers", type=int, default=QWEN3_NEXT_LINEAR_LAYERS)
    ap.add_argument("--drafts", type=int, default=5, help="draft tokens verified per step (4 drafts + the bonus: 5)")
    ap.add_argument("--capacities", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--direct-fractions", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--cache-dtype", default="bfloat16", help="the u-cache's dtype (keys are bfloat16)")
    a = ap.parse_args(argv)
    shape = LayerShape(**QWEN3_NEXT, cache_dtype=a.cache_dtype)
    budget = int(a.budget_gib * 2 ** 30)
    print(f"Qwen3-Next linear attention: H=16, HV=32, K=V=128, {a.layers} layers, fp32 state, bf16 keys, "
          f"{a.cache_dtype} u-cache; {a.drafts} draft tokens; budget {a.budget_gib:g} GiB")
    print("| C | direct fraction | pool requests | per-draft-state requests | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in concurrency_table(shape, budget_bytes=budget, layers=a.layers, drafts=a.drafts,
                               capacities=a.capacities, direct_fractions=a.direct_fractions):
        print(f"| {r['C']} | {r['direct_fraction']:g} | {r['pool_requests']} | {r['per_draft_state_requests']} | "
              f"{r['ratio']:.2f}x |")


if __name__ == "__main__":
    _main()
