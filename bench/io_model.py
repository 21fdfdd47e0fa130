"""Bytes each benchmarked operation must move through device memory (DESIGN.md §6), and the
capacity model (concurrent requests under a memory budget) for the two speculative-verify styles.

Every count is for the whole batch of one launch (or one averaged step) of one layer, and counts
the state and the buffer only: the per-token activations (q, k, v, g, beta in, o out) are a few KiB
per request against a state of MiBs, and both sides of every comparison move the same ones.

With ``|S| = HV*K*V*4`` per request (fp32 state) and one buffered entry ``E = H*K*key_bytes +
HV*V*cache_bytes + HV*Gk*cache_bytes`` (key per q/k head, u and the cumulative gate per value head;
DESIGN.md writes it ``HV*(K+V)*4``, this is the same entry with the storage dtypes spelled out):

* recurrent decode (ours and fla's): read + write ``2|S|``;
* buffered decode, averaged over a cycle of C steps that starts from full buffers (the first step
  folds the C entries in the same launch): per step ``|S|`` read + the entries read (``(C + sum_{j<C}
  j) / C`` on average) + one entry written + the fold's state write ``|S|/C``.  DESIGN.md's model
  writes the fold as a separate flush, ``2|S|/C``; the fused fold shares the step's state read, so
  it only adds the write (``design_model_bytes`` keeps DESIGN.md's form for comparison);
* flush of full buffers: ``2|S|`` + C entries read;
* direct mode (no state), averaged over the first C-1 tokens of a request: entries only;
* per-draft-state verify of d drafts: ``|S|`` read + ``d|S|`` intermediates written; its accept
  copies one intermediate over the state: ``2|S|``;
* buffered verify of d drafts after n buffered entries: ``|S|`` + n entries read, d entries written
  (the ``Drafts``); its accept appends m entries: read m, write m (no fold in the benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shapes", "state_bytes", "entry_bytes", "recurrent_step", "buffered_cycle_step", "flush_full",
           "direct_step", "per_draft_verify", "per_draft_accept", "buffered_verify", "buffered_accept",
           "design_model_bytes", "capacity_curve", "QWEN3_NEXT"]


@dataclass(frozen=True)
class Shapes:
    """One linear-attention layer and the storage dtypes (bytes per element)."""

    H: int
    HV: int
    K: int
    V: int
    key_bytes: int = 2      # cached keys in the input dtype (bf16 in serving)
    cache_bytes: int = 4    # u-cache and cumulative gates: fp32
    state_bytes: int = 4    # fp32 state
    channel_gate: bool = False

    def as_dict(self) -> dict:
        return dict(H=self.H, HV=self.HV, K=self.K, V=self.V, key_bytes=self.key_bytes,
                    cache_bytes=self.cache_bytes, state_bytes=self.state_bytes, channel_gate=self.channel_gate)


#: Qwen3-Next's linear-attention layer (DESIGN.md §2); 36 of its 48 layers are Gated DeltaNet.
QWEN3_NEXT = Shapes(H=16, HV=32, K=128, V=128)
QWEN3_NEXT_LINEAR_LAYERS = 36


def state_bytes(s: Shapes, B: int = 1) -> int:
    """|S| of B requests."""
    return B * s.HV * s.K * s.V * s.state_bytes


def entry_bytes(s: Shapes, B: int = 1) -> int:
    """One buffered (k, u, G) entry of B requests."""
    gk = s.K if s.channel_gate else 1
    return B * (s.H * s.K * s.key_bytes + s.HV * s.V * s.cache_bytes + s.HV * gk * s.cache_bytes)


def recurrent_step(s: Shapes, B: int) -> float:
    return 2 * state_bytes(s, B)


def buffered_cycle_step(s: Shapes, B: int, C: int) -> float:
    """Per step, averaged over a C-step cycle from full buffers (fold fused into the first step)."""
    entries_read = C + sum(range(C))  # the fold reads C; step j (0-based) then reads j
    return state_bytes(s, B) + state_bytes(s, B) / C + entry_bytes(s, B) * (entries_read / C + 1)


def flush_full(s: Shapes, B: int, C: int) -> float:
    return 2 * state_bytes(s, B) + C * entry_bytes(s, B)


def direct_step(s: Shapes, B: int, C: int) -> float:
    """Per step, averaged over steps 0..C-2 of a request in direct mode (no state is read)."""
    steps = max(1, C - 1)
    return entry_bytes(s, B) * (sum(range(steps)) / steps + 1)


def per_draft_verify(s: Shapes, B: int, d: int) -> float:
    return (1 + d) * state_bytes(s, B)


def per_draft_accept(s: Shapes, B: int) -> float:
    return 2 * state_bytes(s, B)


def buffered_verify(s: Shapes, B: int, n: int, d: int) -> float:
    return state_bytes(s, B) + (n + d) * entry_bytes(s, B)


def buffered_accept(s: Shapes, B: int, m: int) -> float:
    return 2 * m * entry_bytes(s, B)


def design_model_bytes(kind: str, s: Shapes, B: int, *, C: int = 0, n: int = 0, d: int = 0) -> float:
    """DESIGN.md §6 exactly as written there (``n*HV*(K+V)*4`` per entry, a separate flush ``2|S|/C``)."""
    S = state_bytes(s, B)
    e = B * s.HV * (s.K + s.V) * 4
    if kind in ("recurrent", "fla"):
        return 2 * S
    if kind == "buffered_cycle":
        return S + ((C - 1) / 2) * e + 2 * S / C
    if kind == "per_draft_verify":
        return S + d * S
    if kind == "buffered_verify":
        return S + n * e
    raise ValueError(f"kind: no DESIGN.md formula for {kind!r}")


# ----------------------------------------------------------------------------- capacity (memory)
def _per_request_bytes(s: Shapes, d: int, C: int, layers: int) -> tuple[int, int, str]:
    """(buffered, per-draft-state) bytes per request, and where the formula came from."""
    try:
        from kvbuffer_ref import memory as m  # the speculative helper's model, when it exists

        shape = m.LayerShape(H=s.H, HV=s.HV, K=s.K, V=s.V, state_dtype=_dt(s.state_bytes),
                             key_dtype=_dt(s.key_bytes), cache_dtype=_dt(s.cache_bytes), channel_gate=s.channel_gate)
        buf = m.buffered_verify_bytes(shape, drafts=d, capacity=C, layers=layers).total
        pds = m.per_draft_state_bytes(shape, drafts=d, layers=layers).total
        return buf, pds, "kvbuffer_ref.memory"
    except ImportError:
        # fallback, same accounting: state + C buffered entries + d draft entries, vs (1 + d) states
        e = entry_bytes(s)
        buf = layers * (state_bytes(s) + (C + d) * e + 9 + 8 * d + 8)
        pds = layers * (1 + d) * state_bytes(s)
        return buf, pds, "bench.io_model (fallback: kvbuffer_ref.memory not importable)"


def _dt(nbytes: int) -> str:
    return {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32", 8: "float64"}[nbytes]


def capacity_curve(s: Shapes = QWEN3_NEXT, *, drafts=range(0, 9), capacity: int = 32,
                   layers: int = QWEN3_NEXT_LINEAR_LAYERS, budget_bytes: int = 64 * 2 ** 30) -> dict:
    """Max concurrent requests vs draft count for both verify styles under one memory budget."""
    rows = []
    source = ""
    for d in drafts:
        buf, pds, source = _per_request_bytes(s, d, capacity, layers)
        rows.append(dict(drafts=d, buffered_bytes=buf, per_draft_state_bytes=pds,
                         buffered_max_requests=budget_bytes // buf, per_draft_state_max_requests=budget_bytes // pds,
                         ratio=(budget_bytes // buf) / max(1, budget_bytes // pds)))
    return dict(shapes=s.as_dict(), capacity=capacity, layers=layers, budget_bytes=budget_bytes, source=source,
                rows=rows)
