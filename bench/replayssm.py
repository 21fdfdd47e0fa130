"""ReplaySSM's kernels in the benchmark: loaded from the checkout ``--peer-path`` names (never copied here),
their storage built as vLLM's ReplaySSM backend lays it out, and the state its kernels would reconstruct.

Storage per layer (vLLM's ReplaySSM page, Qwen3-Next in bf16): the checkpoint pool [blocks, HV, V, K] in
fp32 (block 0 the null block), the ring caches d [blocks, HV, R, V] and k [blocks, H, R, K] in the
activation dtype (bf16), g [blocks, HV, R] in fp32.  The decode kernel's ring has R = L = 16 rows, a
per-row cursor the caller advances, and folds at cursor L - 1; the speculative kernel's ring is circular,
R = next_pow2(C + T), with block-keyed cursors (write_pos, cache_base, is_flush) shared by every layer and
advanced once per step for all layers by ``commit_gdn_replayssm_spec``.
"""

from __future__ import annotations

import random
from typing import Optional

import torch

from kvbuffer.peers.engine import to_raw_gates
from kvbuffer.peers.replayssm import load_kernel_module

__all__ = ["load", "raw_gates", "pack", "ring_state", "entry_bytes"]


def load(peer_path: Optional[str]):
    """(decode module, speculative module) from the checkout, with kvbuffer's shims for the two vllm
    imports; the launch table is the checkout's own ``replayssm_config.py``."""
    return (load_kernel_module(peer_path, "fused_recurrent_replayssm.py"),
            load_kernel_module(peer_path, "gdn_replayssm_spec_decode.py"))


def raw_gates(g: torch.Tensor, beta: torch.Tensor, seed: int):
    """vLLM's gating inputs for log-gates g and betas [.., HV]: A_log, dt_bias [HV] and a, b [.., HV] (fp32)
    with -exp(A_log) softplus(a + dt_bias) = g and sigmoid(b) = beta (the validator's ``to_raw_gates``)."""
    A_log, dt_bias, a, b = to_raw_gates(g.float(), beta.float(), random.Random(seed))
    return A_log.contiguous(), dt_bias.contiguous(), a.contiguous(), b.contiguous()


def pack(x: dict) -> torch.Tensor:
    """vLLM's packed post-conv activations [tokens, 2 H K + HV V] (q | k | v) of tokens [B, T, ...]."""
    B, T, H, K = x["q"].shape
    HV, V = x["v"].shape[2], x["v"].shape[3]
    n = B * T
    return torch.cat([x["q"].reshape(n, H * K), x["k"].reshape(n, H * K), x["v"].reshape(n, HV * V)], -1).contiguous()


def ring_state(h, d, k, g, blocks, write_pos, cache_base=None) -> torch.Tensor:
    """float64 [B, HV, K, V]: the state ReplaySSM's next call reconstructs for requests in ``blocks``:
    exp(G) S0 + sum_i exp(G - G_i) k_i d_i^T over the write_pos entries from cache_base on (circular)."""
    HV, R = d.shape[1], d.shape[2]
    H = k.shape[1]
    out = []
    for i, s in enumerate(blocks.tolist()):
        n = int(write_pos[i])
        base = 0 if cache_base is None else int(cache_base[i])
        pos = (base + torch.arange(n, device=d.device)) % R
        S = h[s].double().transpose(-1, -2)  # [HV, K, V]
        G = g[s][:, pos].double()
        tot = G.sum(-1)
        dec = (tot[:, None] - G.cumsum(-1)).exp()
        kk = k[s][:, pos].double().repeat_interleave(HV // H, 0)
        dd = d[s][:, pos].double() * dec[..., None]
        out.append(S * tot.exp()[:, None, None] + torch.einsum("hnk,hnv->hkv", kk, dd))
    return torch.stack(out)


def entry_bytes(s, B: int, d_bytes: int = 2, key_bytes: int = 2) -> int:
    """One ring entry of B requests: k per q/k head, d per value head (activation dtype), g per value head (fp32)."""
    return B * (s.H * s.K * key_bytes + s.HV * s.V * d_bytes + s.HV * 4)
