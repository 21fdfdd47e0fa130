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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

__all__ = ["LayerShape", "MemoryBreakdown", "itemsize", "state_bytes", "entry_bytes", "buffered_verify_bytes",
           "per_draft_state_bytes", "max_concurrent_requests", "compare_styles"]

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
