#!/usr/bin/env python3
"""Rebuild the golden vectors in kvbuffer/golden/data/ (deterministically: same files, bit for bit).

    PYTHONPATH=. python scripts/make_golden.py [--out kvbuffer/golden/data] [--only ID ...] [--check]

Inputs come from numpy's PCG64 generator seeded per case, using only exactly rounded operations
(+, *, /, sqrt), so they do not depend on the platform's libm.  Expected outputs are computed on the
CPU in float64 by the recurrent oracle (``kvbuffer.golden.truth``), with one torch thread.
Before a case is written, the buffered reference (both buffer forms) is checked against it under the
float64 budget of the tolerance table (~9e-13 relative): a case the reference disagrees with is
never frozen.  ``--check`` writes nothing and exits non-zero if any stored file differs (bit for bit where
this machine sums float64 products in the files' order; elsewhere within the error table's float64 row).

The case list is ``SPECS`` below; each spec says which operation it exercises and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
try:  # an importable kvbuffer_ref (PYTHONPATH, installed) wins; else the checkout holding this script
    import kvbuffer_ref  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import kvbuffer_ref  # noqa: E402
from kvbuffer_ref.buffer import KVBuffer  # noqa: E402
from kvbuffer import golden  # noqa: E402
from kvbuffer_ref.prefill import default_tail  # noqa: E402

NAN = float("nan")


# ------------------------------------------------------------------------------- input generation
def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True))


def _gates(rng: np.random.Generator, shape: tuple, regime: str) -> np.ndarray:
    """Log-gates by regime: exactly 0, mild, strong, underflow (exp(g) == 0 in float64), or a mix."""
    r = rng.random(shape)
    by = {
        "zero": np.zeros(shape),
        "mild": -0.5 * r,
        "strong": -(1.0 + 7.0 * r),
        "underflow": -(750.0 + 250.0 * r),
    }
    if regime != "mixed":
        return by[regime]
    pick = rng.integers(0, 4, shape)
    return np.choose(pick, [by["zero"], by["mild"], by["strong"], by["underflow"]])


def _betas(rng: np.random.Generator, shape: tuple, regime: str) -> np.ndarray:
    """Write strengths: exactly 0, exactly 1, uniform in [0, 1), or a mix of the three."""
    r = rng.random(shape)
    by = {"zero": np.zeros(shape), "one": np.ones(shape), "uniform": r}
    if regime != "mixed":
        return by[regime]
    pick = rng.integers(0, 3, shape)
    return np.choose(pick, [by["zero"], by["one"], by["uniform"]])


def _tokens(rng, B, T, H, HV, K, V, channel, gate, beta, zero_keys=(), q_normalized=True) -> dict:
    q = rng.standard_normal((B, T, H, K))
    q = _normalize(q) if q_normalized else q
    k = _normalize(rng.standard_normal((B, T, H, K)))
    for b, t in zero_keys:
        k[b, t] = 0.0
    v = rng.standard_normal((B, T, HV, V))
    g = _gates(rng, (B, T, HV, K) if channel else (B, T, HV), gate)
    bt = _betas(rng, (B, T, HV), beta)
    return dict(q=q, k=k, v=v, g=g, beta=bt)


def _pad_rows(x: dict, counts, axis_len: int) -> None:
    """NaN in token rows past counts[b] (padding that must never be read)."""
    for name, a in x.items():
        for b, n in enumerate(counts):
            a[b, n:axis_len] = NAN


# ------------------------------------------------------------------------------------ the cases
def S(id, op, desc, exercises, seed, **kw):
    return dict(id=id, op=op, description=desc, exercises=list(exercises), seed=seed, **kw)


CHAIN = None  # marker: default chain parents

SPECS = [
    # ---------------------------------------------------------------- recurrent (the truth itself)
    S("recurrent_gdn_basic", "recurrent", "scalar gates, initial state, batch of 2", ["gdn", "initial_state", "batch"],
      101, B=2, T=9, H=2, HV=2, K=8, V=8, h0=True),
    S("recurrent_kda_basic", "recurrent", "per-channel gates, initial state", ["kda", "initial_state"],
      102, B=2, T=9, H=2, HV=2, K=8, V=8, channel=True, h0=True),
    S("recurrent_grouped_gdn_nonpow2", "recurrent", "H=2 < HV=6 (groups of 3), K=12, V=10",
      ["gdn", "grouped_heads", "non_pow2_dims"], 103, B=1, T=7, H=2, HV=6, K=12, V=10),
    S("recurrent_grouped_kda_nonpow2", "recurrent", "H=1 < HV=3, K=6, V=5, per-channel gates",
      ["kda", "grouped_heads", "non_pow2_dims", "initial_state"], 104, B=2, T=6, H=1, HV=3, K=6, V=5,
      channel=True, h0=True),
    S("recurrent_gate_zero", "recurrent", "every log-gate exactly 0 (no decay)", ["gdn", "gate_zero", "initial_state"],
      105, B=1, T=8, H=1, HV=2, K=8, V=6, gate="zero", h0=True),
    S("recurrent_gate_underflow", "recurrent", "log-gates in [-1000, -750]: every decay underflows to exactly 0",
      ["gdn", "gate_underflow", "initial_state"], 106, B=1, T=6, H=1, HV=2, K=8, V=8, gate="underflow", h0=True),
    S("recurrent_kda_gates_mixed", "recurrent", "per-channel gates mixing 0, mild, strong and underflowing channels",
      ["kda", "gate_zero", "gate_underflow", "initial_state"], 107, B=1, T=8, H=1, HV=2, K=8, V=4, channel=True,
      gate="mixed", h0=True),
    S("recurrent_beta_edges", "recurrent", "betas exactly 0, exactly 1 and uniform, mixed", ["gdn", "beta_zero",
      "beta_one", "initial_state"], 108, B=2, T=8, H=1, HV=2, K=8, V=8, beta="mixed", h0=True),
    S("recurrent_zero_key", "recurrent", "zero keys (no write, no read) at some tokens", ["gdn", "zero_key",
      "initial_state"], 109, B=2, T=6, H=2, HV=2, K=8, V=8, zero_keys=[(0, 0), (0, 3), (1, 5)], h0=True),
    S("recurrent_custom_scale", "recurrent", "explicit scale 0.37 and un-normalised queries", ["gdn", "scale"],
      110, B=1, T=5, H=1, HV=1, K=8, V=8, scale=0.37, q_normalized=False, h0=True),
    S("recurrent_large_dims", "recurrent", "K=V=64 (one larger case)", ["gdn", "large_dims", "initial_state"],
      111, B=1, T=12, H=1, HV=2, K=64, V=64, h0=True),
    S("recurrent_single_token", "recurrent", "T=1 from an initial state (the decode step of a recurrent kernel)",
      ["gdn", "single_token", "initial_state"], 112, B=3, T=1, H=1, HV=2, K=8, V=8, h0=True),
    # ---------------------------------------------------------------- chunkwise
    S("chunk_gdn_ragged_tail", "chunk", "T=23 with chunk_size 8: last chunk of 7", ["gdn", "t_not_multiple",
      "initial_state"], 201, B=2, T=23, H=1, HV=2, K=8, V=8, chunk_size=8, h0=True),
    S("chunk_kda", "chunk", "per-channel gates, T=19, chunk_size 4", ["kda", "t_not_multiple", "initial_state"],
      202, B=1, T=19, H=1, HV=2, K=8, V=6, channel=True, chunk_size=4, h0=True),
    S("chunk_grouped_nonpow2", "chunk", "H=2 < HV=4, K=7, V=9, T=13, chunk_size 5", ["gdn", "grouped_heads",
      "non_pow2_dims", "t_not_multiple"], 203, B=1, T=13, H=2, HV=4, K=7, V=9, chunk_size=5),
    S("chunk_gates_mixed", "chunk", "gates mixing 0 / mild / strong / underflow, chunk_size 6",
      ["gdn", "gate_zero", "gate_underflow", "t_not_multiple", "initial_state"], 204, B=2, T=17, H=1, HV=2, K=8,
      V=8, gate="mixed", chunk_size=6, h0=True),
    S("chunk_size_one", "chunk", "chunk_size 1 (every chunk a single token)", ["gdn", "chunk_size_1"],
      205, B=1, T=5, H=1, HV=2, K=8, V=8, chunk_size=1, h0=True),
    S("chunk_larger_than_T", "chunk", "chunk_size 64 > T=10 (one partial chunk)", ["gdn", "t_not_multiple"],
      206, B=2, T=10, H=1, HV=1, K=8, V=8, chunk_size=64),
    S("chunk_edges", "chunk", "betas 0/1, zero keys, mixed per-channel gates", ["kda", "beta_zero", "beta_one",
      "zero_key", "gate_underflow"], 207, B=1, T=11, H=1, HV=2, K=6, V=6, channel=True, gate="mixed",
      beta="mixed", zero_keys=[(0, 2), (0, 7)], chunk_size=4, h0=True),
    S("chunk_dims_32", "chunk", "K=V=32, T=40, chunk_size 16", ["gdn", "t_not_multiple", "initial_state"],
      208, B=1, T=40, H=1, HV=1, K=32, V=32, chunk_size=16, h0=True),
    # ---------------------------------------------------------------- direct (no state)
    S("direct_gdn", "direct", "stateless outputs of 7 tokens", ["gdn", "direct_mode"], 301, B=2, T=7, H=1, HV=2,
      K=8, V=8),
    S("direct_kda_grouped", "direct", "per-channel gates, H=1 < HV=2, V=5", ["kda", "grouped_heads",
      "non_pow2_dims", "direct_mode"], 302, B=1, T=6, H=1, HV=2, K=8, V=5, channel=True),
    S("direct_edges", "direct", "mixed gates (0 and underflow), betas 0/1, a zero key", ["gdn", "gate_zero",
      "gate_underflow", "beta_zero", "beta_one", "zero_key", "direct_mode"], 303, B=1, T=9, H=1, HV=2, K=8, V=8,
      gate="mixed", beta="mixed", zero_keys=[(0, 4)]),
    # ---------------------------------------------------------------- buffered decode (sequences of steps)
    S("decode_empty_direct", "decode", "empty buffer, no state: 6 steps with C=4 (the 5th step folds the full "
      "buffer into a first state)", ["gdn", "empty_buffer", "full_buffer", "direct_mode", "fold"], 401, B=1, H=1,
      HV=2, K=8, V=8, capacity=4, lengths=[0], has_state=[False], steps=6),
    S("decode_ragged_lengths", "decode", "lengths 0 / 2 / 4 (=C, full) with state F / T / F: ragged batch; the "
      "full direct-mode request folds at its first step", ["gdn", "ragged_batch", "empty_buffer", "full_buffer",
      "direct_mode", "fold"], 402, B=3, H=1, HV=2, K=8, V=8, capacity=4, lengths=[0, 2, 4],
      has_state=[False, True, False], steps=5),
    S("decode_kda_ragged", "decode", "per-channel gates, lengths 1 / 3 (=C) / 0", ["kda", "ragged_batch",
      "full_buffer", "empty_buffer", "fold"], 403, B=3, H=1, HV=2, K=8, V=6, channel=True, capacity=3,
      lengths=[1, 3, 0], has_state=[True, False, True], steps=4),
    S("decode_capacity_one", "decode", "C=1: every step after the first folds", ["gdn", "capacity_1", "fold",
      "full_buffer"], 404, B=2, H=1, HV=1, K=8, V=8, capacity=1, lengths=[0, 1], has_state=[True, True], steps=3),
    S("decode_grouped_nonpow2", "decode", "H=2 < HV=4, K=6, V=10, C=5, lengths 5 / 3, 7 steps",
      ["gdn", "grouped_heads", "non_pow2_dims", "full_buffer", "fold"], 405, B=2, H=2, HV=4, K=6, V=10,
      capacity=5, lengths=[5, 3], has_state=[True, True], steps=7),
    S("decode_edges", "decode", "mixed gates (0 / underflow) in buffer and steps, betas 0/1, zero keys",
      ["gdn", "gate_zero", "gate_underflow", "beta_zero", "beta_one", "zero_key", "fold"], 406, B=2, H=1, HV=2,
      K=8, V=8, capacity=4, lengths=[2, 4], has_state=[True, True], steps=6, gate="mixed", beta="mixed",
      zero_keys=[(0, 1), (1, 3)], buffer_zero_keys=[(1, 0)]),
    S("decode_long_buffer", "decode", "C=16, lengths 15 / 9: the first request fills up and folds at step 2",
      ["gdn", "full_buffer", "fold", "ragged_batch"], 407, B=2, H=1, HV=1, K=8, V=8, capacity=16,
      lengths=[15, 9], has_state=[True, False], steps=3),
    S("decode_kda_grouped_underflow", "decode", "per-channel gates mixing underflowing channels, H=1 < HV=2",
      ["kda", "grouped_heads", "gate_underflow", "gate_zero", "fold"], 408, B=2, H=1, HV=2, K=6, V=6,
      channel=True, gate="mixed", capacity=3, lengths=[2, 0], has_state=[True, False], steps=4),
    S("decode_no_state_storage", "decode", "a buffer with no state storage at all (buffer_state absent), staying "
      "within capacity", ["gdn", "direct_mode", "no_state_storage", "empty_buffer"], 409, B=2, H=1, HV=2, K=8,
      V=8, capacity=6, lengths=[0, 2], has_state=[False, False], steps=3, state_storage=False),
    # ---------------------------------------------------------------- flush
    S("flush_all_ragged", "flush", "flush everything (count absent): lengths 0 / 3 / 5, state F / T / T",
      ["gdn", "ragged_batch", "empty_buffer", "full_buffer", "fold"], 501, B=3, H=1, HV=2, K=8, V=8, capacity=5,
      lengths=[0, 3, 5], has_state=[False, True, True]),
    S("flush_partial_kda", "flush", "fold a prefix (counts 1 / 0 / 2): the rest keeps u, G rebased",
      ["kda", "partial_fold", "ragged_batch"], 502, B=3, H=1, HV=2, K=8, V=6, channel=True, capacity=4,
      lengths=[3, 2, 4], has_state=[True, True, False], count=[1, 0, 2]),
    S("flush_full_grouped_edges", "flush", "full buffers, H=2 < HV=4, mixed gates and betas",
      ["gdn", "grouped_heads", "non_pow2_dims", "full_buffer", "gate_underflow", "beta_zero", "beta_one", "fold"], 503, B=2, H=2,
      HV=4, K=6, V=5, capacity=3, lengths=[3, 3], has_state=[True, False], gate="mixed", beta="mixed",
      count=[3, 2]),
    # ---------------------------------------------------------------- chain verify + accept
    S("verify_chain_basic", "verify_chain", "4 drafts after buffers of 2 / 0, accept 2 / 4", ["gdn", "chain",
      "empty_buffer"], 601, B=2, H=1, HV=2, K=8, V=8, capacity=6, lengths=[2, 0], has_state=[True, True], D=4,
      num_drafts=[4, 4], counts=[2, 4]),
    S("verify_chain_ragged_overflow", "verify_chain", "num_drafts 3 / 4 / 1, counts 0 / 3 / 1, C=4: request 1 "
      "overflows (old entries fold)", ["gdn", "chain", "ragged_batch", "ragged_drafts", "full_buffer", "fold"],
      602, B=3, H=1, HV=2, K=8, V=8, capacity=4, lengths=[1, 4, 3], has_state=[True, True, False], D=4,
      num_drafts=[3, 4, 1], counts=[0, 3, 1]),
    S("verify_chain_accept_more_than_C", "verify_chain", "C=2 full, accept all 5 drafts: the old entries and the "
      "3 oldest drafts fold", ["gdn", "chain", "full_buffer", "fold"], 603, B=1, H=1, HV=2, K=8, V=8, capacity=2,
      lengths=[2], has_state=[True], D=5, num_drafts=[5], counts=[5]),
    S("verify_chain_kda_grouped", "verify_chain", "per-channel gates, H=1 < HV=3, V=7", ["kda", "chain",
      "grouped_heads", "non_pow2_dims"], 604, B=2, H=1, HV=3, K=8, V=7, channel=True, capacity=5,
      lengths=[3, 1], has_state=[False, True], D=3, num_drafts=[3, 3], counts=[1, 2]),
    S("verify_chain_edges_direct", "verify_chain", "direct mode (no state), mixed gates incl. underflow, "
      "betas 0/1, zero-key drafts", ["gdn", "chain", "direct_mode", "gate_zero", "gate_underflow", "beta_zero",
      "beta_one", "zero_key"], 605, B=2, H=1, HV=2, K=8, V=8, capacity=6, lengths=[3, 0],
      has_state=[False, False], D=4, num_drafts=[4, 4], counts=[3, 1], gate="mixed", beta="mixed",
      zero_keys=[(0, 1), (1, 0)]),
    S("verify_chain_zero_drafts", "verify_chain", "a request verifying 0 drafts (padding rows are NaN, outputs "
      "0) beside one accepting none", ["gdn", "chain", "ragged_drafts", "accept_none"], 606, B=2, H=1, HV=2, K=8,
      V=8, capacity=4, lengths=[2, 4], has_state=[True, True], D=3, num_drafts=[0, 3], counts=[0, 0]),
    # ---------------------------------------------------------------- tree verify + accept
    S("verify_tree_basic", "verify_tree", "binary tree of 6 nodes, accept nodes 3 and 5", ["gdn", "tree"],
      701, B=2, H=1, HV=2, K=8, V=8, capacity=6, lengths=[2, 1], has_state=[True, True], D=6,
      parents=[[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 1, 1, 2]], num_drafts=[6, 6], nodes=[3, 5]),
    S("verify_tree_ragged", "verify_tree", "different trees per request, num_drafts 6 / 3 / 0, nodes 4 / -1 / -1",
      ["gdn", "tree", "ragged_batch", "ragged_drafts", "accept_none"], 702, B=3, H=1, HV=2, K=8, V=8,
      capacity=5, lengths=[0, 3, 5], has_state=[False, True, True], D=6,
      parents=[[-1, 0, 1, 0, 3, 3], [-1, -1, 1, -1, -1, -1], [-1, -1, -1, -1, -1, -1]], num_drafts=[6, 3, 0],
      nodes=[4, -1, -1]),
    S("verify_tree_kda_overflow", "verify_tree", "per-channel gates, full C=3 buffer, accepted path of depth 3 "
      "folds the old entries", ["kda", "tree", "full_buffer", "fold"], 703, B=1, H=1, HV=2, K=8, V=6,
      channel=True, capacity=3, lengths=[3], has_state=[True], D=5, parents=[[-1, 0, 0, 2, 1]], num_drafts=[5],
      nodes=[3]),
    S("verify_tree_forest_grouped", "verify_tree", "several roots (children of the buffer tail), H=2 < HV=4",
      ["gdn", "tree", "grouped_heads", "non_pow2_dims"], 704, B=2, H=2, HV=4, K=6, V=6, capacity=4,
      lengths=[1, 2], has_state=[True, False], D=6, parents=[[-1, -1, 0, 1, 2, -1], [-1, 0, -1, 2, 1, 4]],
      num_drafts=[6, 6], nodes=[4, 5]),
    S("verify_tree_edges", "verify_tree", "mixed gates incl. underflow, betas 0/1, zero-key nodes, deep path "
      "past C", ["gdn", "tree", "gate_zero", "gate_underflow", "beta_zero", "beta_one", "zero_key", "fold"],
      705, B=1, H=1, HV=2, K=8, V=8, capacity=2, lengths=[1], has_state=[True], D=6,
      parents=[[-1, 0, 1, 1, 3, -1]], num_drafts=[6], nodes=[4], gate="mixed", beta="mixed",
      zero_keys=[(0, 1)]),
    # ---------------------------------------------------------------- prefill hand-off
    S("prefill_default_tail", "prefill", "T=11, C=4: the default tail T mod C = 3 stays buffered", ["gdn",
      "prefill", "t_not_multiple"], 801, B=2, T=11, H=1, HV=2, K=8, V=8, capacity=4, chunk_size=4),
    S("prefill_short_direct", "prefill", "T=3 <= C=8: everything buffered, no state formed (direct mode)",
      ["gdn", "prefill", "direct_mode"], 802, B=2, T=3, H=1, HV=2, K=8, V=8, capacity=8, chunk_size=4),
    S("prefill_kda_initial_state_full_tail", "prefill", "per-channel gates, initial state, tail = C = 5 (full "
      "buffer), chunk_size 3", ["kda", "prefill", "initial_state", "full_buffer"], 803, B=1, T=10, H=1, HV=2,
      K=8, V=6, channel=True, capacity=5, tail=5, chunk_size=3, h0=True),
    S("prefill_tail_zero_grouped", "prefill", "T=8, C=4: default tail 0 (empty buffer), H=1 < HV=2, K=6, V=10",
      ["gdn", "prefill", "grouped_heads", "non_pow2_dims", "empty_buffer"], 804, B=1, T=8, H=1, HV=2, K=6, V=10,
      capacity=4, chunk_size=3),
    S("prefill_explicit_tail_edges", "prefill", "tail=2 of T=9, mixed gates, betas 0/1, a zero key",
      ["gdn", "prefill", "gate_underflow", "beta_zero", "beta_one", "zero_key"], 805, B=2, T=9, H=1, HV=2, K=8,
      V=8, capacity=4, tail=2, chunk_size=4, gate="mixed", beta="mixed", zero_keys=[(1, 7)]),
]


# --------------------------------------------------------------------------------- building a case
def build(spec: dict) -> tuple[dict, dict]:
    """(index entry, arrays) of one spec; asserts the buffered reference agrees with the truth."""
    rng = np.random.default_rng(spec["seed"])
    op = spec["op"]
    B, H, HV, K, V = (spec[n] for n in ("B", "H", "HV", "K", "V"))
    channel = spec.get("channel", False)
    gate, beta = spec.get("gate", "mild"), spec.get("beta", "uniform")
    scale = spec.get("scale") or K ** -0.5
    params: dict = {"B": B, "H": H, "HV": HV, "K": K, "V": V, "gate": "channel" if channel else "scalar",
                    "scale": scale}
    arrays: dict = {}
    if op in golden.BUFFER_OPS:
        C = spec["capacity"]
        lengths = spec["lengths"]
        has_state = spec["has_state"]
        storage = spec.get("state_storage", True)
        buf = _tokens(rng, B, C, H, HV, K, V, channel, gate, beta, spec.get("buffer_zero_keys", ()))
        _pad_rows(buf, lengths, C)
        state = 0.5 * rng.standard_normal((B, HV, K, V))
        state[~np.array(has_state)] = 0.0
        arrays.update({f"buffer_{f}": buf[f] for f in KVBuffer.slot_fields("raw")})
        arrays.update(buffer_lengths=np.array(lengths, dtype=np.int64),
                      buffer_has_state=np.array(has_state, dtype=np.bool_))
        if storage:
            arrays["buffer_state"] = state
        params.update(capacity=C, lengths=lengths, has_state=has_state, state_storage=storage)
        T = spec.get("steps") or spec.get("D") or 0
        params["T"] = T
        if T:  # flush takes no tokens
            arrays.update(_tokens(rng, B, T, H, HV, K, V, channel, gate, beta, spec.get("zero_keys", ()),
                                  spec.get("q_normalized", True)))
        arrays.update(golden.derive_buffer(arrays, {"scale": scale, "capacity": C}))
        if op == "flush":
            if spec.get("count") is not None:
                arrays["count"] = np.array(spec["count"], dtype=np.int64)
            params["count"] = spec.get("count")
        if op == "decode":
            params["steps"] = T
        if op in ("verify_chain", "verify_tree"):
            D = spec["D"]
            nd = spec["num_drafts"]
            parents = spec.get("parents") or [list(range(-1, D - 1))] * B
            toks = {n: arrays[n] for n in ("q", "k", "v", "g", "beta")}
            _pad_rows(toks, nd, D)
            arrays["parents"] = np.array(parents, dtype=np.int64)
            arrays["num_drafts"] = np.array(nd, dtype=np.int64)
            params.update(D=D, parents=parents, num_drafts=nd)
            if op == "verify_chain":
                arrays["counts"] = np.array(spec["counts"], dtype=np.int64)
                params["counts"] = spec["counts"]
            else:
                arrays["nodes"] = np.array(spec["nodes"], dtype=np.int64)
                params["nodes"] = spec["nodes"]
    else:
        T = spec["T"]
        params["T"] = T
        arrays.update(_tokens(rng, B, T, H, HV, K, V, channel, gate, beta, spec.get("zero_keys", ()),
                              spec.get("q_normalized", True)))
        if spec.get("h0"):
            arrays["initial_state"] = 0.5 * rng.standard_normal((B, HV, K, V))
        if op in ("chunk", "prefill"):
            params["chunk_size"] = spec["chunk_size"]
        if op == "prefill":
            params.update(capacity=spec["capacity"], tail=spec.get("tail"),
                          tail_resolved=spec["tail"] if spec.get("tail") is not None
                          else default_tail(T, spec["capacity"]))
    params["initial_state"] = "initial_state" in arrays
    expected = {n: x.numpy() for n, x in golden.truth(op, params, arrays, torch.float64).items()}
    arrays.update(expected)
    entry = {
        "id": spec["id"],
        "op": op,
        "description": spec["description"],
        "exercises": spec["exercises"],
        "file": f"cases/{spec['id']}.npz",
        "params": params,
        "inputs": _describe({n: a for n, a in arrays.items() if not n.startswith("expected_")}),
        "expected": _describe({n: a for n, a in arrays.items() if n.startswith("expected_")}),
    }
    return entry, arrays


def _describe(arrays: dict) -> dict:
    return {n: {"dtype": str(a.dtype), "shape": list(a.shape)} for n, a in sorted(arrays.items())}


def verify_against_reference(entry: dict, file: Path) -> None:
    """The buffered / chunked reference forms (both buffer forms) must match the recurrent truth."""
    case = golden.GoldenCase(id=entry["id"], op=entry["op"], description=entry["description"],
                             exercises=tuple(entry["exercises"]), params=entry["params"], file=file,
                             arrays=golden.read_npz(file))
    forms = ("u", "raw") if entry["op"] in golden.BUFFER_OPS + ("prefill",) else ("u",)
    for form in forms:
        rep = golden.check_case(case, kvbuffer_ref, dtype=torch.float64, form=form)
        if not rep.passed:
            raise AssertionError(f"the reference disagrees with the recurrent truth:\n{rep}")


def _compact_lists(text: str) -> str:
    """Put lists of scalars (shapes, lengths, parents rows) on one line."""
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
                  text)


def index_header() -> dict:
    return {
        "format": golden.FORMAT,
        "version": golden.VERSION,
        "generator": "scripts/make_golden.py",
        "truth": "float64 recurrent reference over each case's token history (kvbuffer.golden.truth)",
        "conventions": {
            "q, k": "[B, T, H, K]", "v": "[B, T, HV, V]", "g": "[B, T, HV] (scalar) or [B, T, HV, K] (per-channel)",
            "beta": "[B, T, HV]", "state": "[B, HV, K, V] (key-major: o = S^T q)",
            "grouped heads": "value head i uses q/k head i // (HV // H)",
            "scale": "q is multiplied by params.scale inside the operation",
            "padding": "buffer slots >= lengths[b] and draft rows >= num_drafts[b] hold NaN (never read); "
                       "expected buffer entries are defined only in slots < expected_buffer_lengths[b]",
        },
        "docs": "docs/golden.md",
    }


def build_all(only=None) -> list[tuple[dict, dict]]:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [build(s) for s in SPECS if only is None or s["id"] in only]
    finally:
        torch.set_num_threads(prev)


def _without_digests(text: str, ids: list) -> str:
    """The index with the sha256 of the cases ``ids`` left out (their bytes differ by rounding only)."""
    index = json.loads(text)
    for e in index["cases"]:
        if e["id"] in ids:
            e.pop("sha256", None)
    return json.dumps(index, sort_keys=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "kvbuffer" / "golden" / "data")
    ap.add_argument("--only", nargs="*", help="rebuild only these case ids (the index is rewritten in full)")
    ap.add_argument("--check", action="store_true", help="compare with the stored files; write nothing")
    a = ap.parse_args(argv)
    built = build_all(None)
    out: Path = a.out
    differ, rounding = [], []
    with tempfile.TemporaryDirectory() as tmp:
        entries = []
        for entry, arrays in built:
            f = Path(tmp) / f"{entry['id']}.npz"
            golden.write_npz(f, arrays)
            verify_against_reference(entry, f)
            entry["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
            entries.append(entry)
            target = out / entry["file"]
            data = f.read_bytes()
            if a.check:
                if not target.is_file():
                    differ.append(entry["id"])
                elif target.read_bytes() != data:
                    stored = golden.read_npz(target)
                    same = sorted(stored) == sorted(arrays) and all(
                        golden.stored_mismatch(n, x, stored[n]) is None for n, x in arrays.items())
                    (rounding if same else differ).append(entry["id"])
            elif a.only is None or entry["id"] in a.only:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        ids = [e["id"] for e in entries]
        assert len(ids) == len(set(ids)), "duplicate case ids"
        index = index_header() | {"cases": entries}
        text = _compact_lists(json.dumps(index, indent=1)) + "\n"
        if a.check:
            if _without_digests((out / "index.json").read_text(), rounding) != _without_digests(text, rounding):
                differ.append("index.json")
        else:
            (out / "index.json").write_text(text)
    if a.check:
        if rounding:
            print(f"not bit for bit here, within the float64 row of the error table (this machine orders float64 "
                  f"sums differently from the one that wrote the files): {rounding}")
        print("golden vectors up to date" if not differ else f"golden vectors differ: {differ}")
        return 1 if differ else 0
    total = sum((out / e["file"]).stat().st_size for e in entries) + (out / "index.json").stat().st_size
    print(f"wrote {len(entries)} cases to {out} ({total / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
