"""Bytes each benchmarked operation must move through device memory, and the read-once floor.

Every count is for the whole batch of one launch (or one averaged decode step) of one layer and
counts the state and the buffer only: the per-token activations (q, k, v, g, beta in, o out) are a
few KiB per request against a state of MiBs, and both sides of every comparison move the same ones.
The engine's packed decode step is the exception: its count adds its token rows, as it reads them.

With ``|S| = HV*K*V*state_bytes`` per request and one buffered entry
``E = H*K*key_bytes + HV*V*cache_bytes + HV*Gk*cache_bytes`` (the key per q/k head; u and the
cumulative gate per value head; Gk = K for per-channel gates, else 1):

==========================================  ================================================
operation                                   bytes
==========================================  ================================================
a state read (``read_state``, one fp32      ``|S| + 4*HV*V/BV`` (the state read, one fp32 sum
sum written per [K, BV] tile)               written per tile)
recurrent step (ours, fla's)                ``2|S|`` (read + write)
buffered decode, per step of a C-step       ``|S| + |S|/C + E*((C + sum_{j<C} j)/C + 1)``: the
cycle from full buffers (fold fused into    state read every step, the fold's state write once
its first step)                             per cycle, the entries read, one entry written
per-draft-state verify of d tokens          ``(1 + d)|S|`` (the state read, d states written)
per-draft-state accept                      ``2|S|`` (one intermediate copied over the state)
buffered verify of d tokens over n entries  ``|S| + (n + d)E`` (nothing written but the drafts)
buffered accept of m drafts                 ``2mE`` (m draft entries read and appended)
an engine's packed decode step (SGLang's    ``2|S|`` plus its token rows: ``mixed_qkv`` in and
fused_recurrent_gated_delta_rule_packed_    o out (token dtype), a and b (fp32), one int32 slot
decode)                                     index per request
==========================================  ================================================

The *read-once floor* of an operation is its bytes at the copy bandwidth measured in the same run:
the time it would take if every byte it must move crossed device memory exactly once, as fast as
a device-to-device copy moves bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Shapes", "state_bytes", "entry_bytes", "read_state", "recurrent_step", "packed_decode_step",
           "engine_inputs_step", "buffered_cycle_step",
           "per_draft_verify", "per_draft_accept", "buffered_verify", "buffered_accept", "floor_us"]


@dataclass(frozen=True)
class Shapes:
    """One linear-attention layer and its storage dtypes (bytes per element)."""

    H: int
    HV: int
    K: int
    V: int
    key_bytes: int = 2      # cached keys in the token dtype (bf16 in serving)
    cache_bytes: int = 4    # u-cache and cumulative gates: fp32
    state_bytes: int = 4    # fp32 state
    channel_gate: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def state_bytes(s: Shapes, B: int = 1) -> int:
    """|S| of B requests."""
    return B * s.HV * s.K * s.V * s.state_bytes


def entry_bytes(s: Shapes, B: int = 1) -> int:
    """One buffered (k, u, G) entry of B requests."""
    gk = s.K if s.channel_gate else 1
    return B * (s.H * s.K * s.key_bytes + s.HV * s.V * s.cache_bytes + s.HV * gk * s.cache_bytes)


def read_state(s: Shapes, B: int, BV: int) -> float:
    """``bench/read_state.py``: the state read once, one fp32 sum written per [K, BV] tile."""
    return state_bytes(s, B) + B * s.HV * (s.V // BV) * 4


def recurrent_step(s: Shapes, B: int) -> float:
    return 2 * state_bytes(s, B)


def packed_decode_step(s: Shapes, B: int, token_bytes: int = 2, gate_bytes: int = 4) -> float:
    """An engine's packed decode step: the state read and written in place, and the token rows of the
    batch (``mixed_qkv`` [B, 2 H K + HV V] in and o [B, HV, V] out in the token dtype, a and b [B, HV] of
    ``gate_bytes``, one int32 slot index per request)."""
    row = (2 * s.H * s.K + 2 * s.HV * s.V) * token_bytes + 2 * s.HV * gate_bytes + 4
    return 2 * state_bytes(s, B) + B * row


def split_decode_step(s: Shapes, B: int, state_elem_bytes: int = 4, token_bytes: int = 2, gate_bytes: int = 2,
                      indexed: bool = True) -> float:
    """A decode step on separate q, k, v (FlashInfer's): the state read and written in place at
    ``state_elem_bytes`` per element, q, k, v in and o out in the token dtype, a and b [B, HV] of
    ``gate_bytes``, one int32 slot index per request where the state is a pool (``indexed``)."""
    row = (2 * s.H * s.K + 2 * s.HV * s.V) * token_bytes + 2 * s.HV * gate_bytes + (4 if indexed else 0)
    return 2 * B * s.HV * s.K * s.V * state_elem_bytes + B * row


def engine_inputs_step(s: Shapes, B: int, token_bytes: int = 2) -> float:
    """``engine_inputs`` of one token per request: the packed row and a, b read; q, k (float32), v (the
    token dtype), g and beta (float32) written."""
    read = (2 * s.H * s.K + s.HV * s.V) * token_bytes + 2 * s.HV * 4
    written = 2 * s.H * s.K * 4 + s.HV * s.V * token_bytes + 2 * s.HV * 4
    return B * (read + written)


def buffered_cycle_step(s: Shapes, B: int, C: int) -> float:
    """Per step, averaged over a C-step cycle from full buffers (fold fused into the first step)."""
    entries_read = C + sum(range(C))  # the fold reads C; step j (0-based) then reads j
    return state_bytes(s, B) * (1 + 1 / C) + entry_bytes(s, B) * (entries_read / C + 1)


def per_draft_verify(s: Shapes, B: int, d: int) -> float:
    return (1 + d) * state_bytes(s, B)


def per_draft_tree_verify(s: Shapes, B: int, parents: list) -> float:
    """One state per node of a draft tree (``parents``: -1 = the state): the state read once, each node's
    state written, and a parent's state read back for every node whose parent is not the node before it."""
    reloads = sum(1 for i, p in enumerate(parents) if i > 0 and p != i - 1)
    return (1 + len(parents) + reloads) * state_bytes(s, B)


def per_draft_accept(s: Shapes, B: int) -> float:
    return 2 * state_bytes(s, B)


def buffered_verify(s: Shapes, B: int, n: int, d: int) -> float:
    return state_bytes(s, B) + (n + d) * entry_bytes(s, B)


def buffered_accept(s: Shapes, B: int, m: int) -> float:
    return 2 * m * entry_bytes(s, B)


def buffered_flush(s: Shapes, B: int, n: int) -> float:
    """A flush of n entries: the state read and written, the n entries read."""
    return 2 * state_bytes(s, B) + n * entry_bytes(s, B)


def floor_us(nbytes: float, copy_TBps: float) -> float:
    """The read-once floor: ``nbytes`` at the measured copy bandwidth, in microseconds."""
    return nbytes / (copy_TBps * 1e12) * 1e6
