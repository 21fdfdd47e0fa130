"""``read_state``: a kernel that only reads a decode state, the measured floor of a state read.

Every decode kernel reads each request's fp32 state [HV, K, V] once per step; this one does nothing else.
Its grid is a decode kernel's, (V tiles, B * HV): each program loads its [K, BV] tile in [KB, BV] blocks
(a pipelined ``tl.range`` loop, the loads marked evict-first as the decode kernel marks its state's) and
writes one fp32 sum, so no load can be eliminated.  Its time is what any decode kernel at least pays to
read the state; a decode op's time over it (the report's "x read") is how close the op is to that.

It is a measuring instrument of the benchmark, not part of the library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

__all__ = ["Tiling", "TILINGS", "fit", "launch", "sums_check"]


@dataclass(frozen=True)
class Tiling:
    """One launch: [KB, BV] blocks, ``num_warps`` warps, ``NS`` pipeline stages."""

    BV: int
    KB: int
    num_warps: int
    NS: int

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"BV={self.BV} KB={self.KB} warps={self.num_warps} NS={self.NS}"


#: The tilings the case times; it keeps the fastest.  On the H200 (HV = 32, K = V = 128, B = 64..512) every
#: tiling of BV 32..128, KB 16..64, 2..8 warps with 2..4 stages read within about 1 % of the best (one stage:
#: 3-6 % slower); these two were within 0.3 % of it.
TILINGS = (Tiling(BV=64, KB=32, num_warps=4, NS=3), Tiling(BV=128, KB=32, num_warps=4, NS=3))


def fit(t: Tiling, K: int, V: int) -> Tiling:
    """``t`` with its blocks no larger than the state (the smoke shapes are smaller than a tile)."""
    return Tiling(BV=min(t.BV, V), KB=min(t.KB, K), num_warps=t.num_warps, NS=t.NS)


@triton.jit
def _read_state(S, out, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
                NS: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    p = S + i_bh.to(tl.int64) * K * V + i_v * BV + tl.arange(0, KB)[:, None] * V + tl.arange(0, BV)[None, :]
    acc = tl.zeros([KB, BV], dtype=tl.float32)
    for k0 in tl.range(0, K, KB, num_stages=NS):
        acc += tl.load(p + k0 * V, eviction_policy="evict_first")
    tl.store(out + i_bh * (V // BV) + i_v, tl.sum(acc))


def launch(state: torch.Tensor, out: torch.Tensor, t: Tiling) -> torch.Tensor:
    """One read of ``state`` [B, HV, K, V] (fp32, contiguous): ``out`` [B * HV, V // BV] gets each tile's sum."""
    B, HV, K, V = state.shape
    assert state.dtype == torch.float32 and state.is_contiguous(), "read_state: a contiguous fp32 state"
    assert K % t.KB == 0 and V % t.BV == 0, f"read_state: {t} does not tile K={K}, V={V}"
    assert out.shape == (B * HV, V // t.BV) and out.dtype == torch.float32
    _read_state[(V // t.BV, B * HV)](state, out, K=K, V=V, KB=t.KB, BV=t.BV, NS=t.NS, num_warps=t.num_warps)
    return out


def sums_check(name: str, state: torch.Tensor, sums: torch.Tensor, BV: int, budget: float = 1e-5) -> dict:
    """The kernel's tile sums against torch's float64 sums of the same tiles, each error relative to the
    tile's sum of |x| (fp32 sums of a few thousand values: a few eps); a check row as the other cases'."""
    B, HV, K, V = state.shape
    tiles = state.detach().double().view(B * HV, K, V // BV, BV)
    ref, scale = tiles.sum((1, 3)), tiles.abs().sum((1, 3)).clamp_min(1e-30)
    err = (sums.detach().double() - ref).abs()
    worst, max_abs = float((err / scale).max()), float(err.max())
    passed = worst <= budget
    text = (f"{name}: {'PASS' if passed else 'FAIL'} worst |sum - torch| / sum|x| {worst:.2e} "
            f"(budget {budget:.0e}) over {ref.numel()} tiles, max abs {max_abs:.2e}")
    return dict(name=name, dtype="float32", passed=passed, worst_rel=worst, baseline_rel=None, budget=budget,
                max_abs=max_abs, text=text)
