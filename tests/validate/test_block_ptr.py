"""The interpreter's stand-in for Triton's block pointers (``kvbuffer.peers._block_ptr``), injected into tiny
jitted kernels the way the peers' kernels get it (``_sources.interpretable_chunk_kernels``), against direct
pointer arithmetic: element (i, j) of a block at offsets (o0, o1) of a tensor with strides (s0, s1) is at
``base + (o0 + i) s0 + (o1 + j) s1``; along a dim in ``boundary_check`` an index outside [0, shape) is not
read (0, or NaN with ``padding_option="nan"``) and not written; the other dims are not checked.

The tensor [M, N] = [5, 6] lies inside a larger buffer of distinct values, with strides (1, 7) (its first
dim the contiguous one), so an unchecked read out of its bounds still lands in the buffer and reads a
value no other element has: a wrong stride order, offset, advance or mask reads different values."""

import os
import types

import pytest
import torch
import triton
import triton.language as tl

from kvbuffer.peers._sources import interpretable_chunk_kernels

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the block-pointer stand-in serves the Triton interpreter only")

M, N, S0, S1, BASE = 5, 6, 1, 7, 100
BM, BN = 4, 8
CHECKS = {0: (), 1: (0,), 2: (1,), 3: (0, 1)}


@triton.jit
def _load_block(x, out, M, N, s0, s1, o0, o1, d0, d1, BM: tl.constexpr, BN: tl.constexpr, CHECK: tl.constexpr,
                NAN: tl.constexpr):
    p = tl.advance(tl.make_block_ptr(x, (M, N), (s0, s1), (o0, o1), (BM, BN), (0, 1)), (d0, d1))
    pad = "nan" if NAN else "zero"
    if CHECK == 0:
        b = tl.load(p)
    elif CHECK == 1:
        b = tl.load(p, boundary_check=(0,), padding_option=pad)
    elif CHECK == 2:
        b = tl.load(p, boundary_check=(1,), padding_option=pad)
    else:
        b = tl.load(p, boundary_check=(0, 1), padding_option=pad)
    tl.store(out + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], b)  # an ordinary pointer


@triton.jit
def _store_block(y, M, N, s0, s1, o0, o1, BM: tl.constexpr, BN: tl.constexpr, CHECK: tl.constexpr):
    p = tl.make_block_ptr(y, (M, N), (s0, s1), (o0, o1), (BM, BN), (1, 0))
    b = (1 + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]).to(p.dtype.element_ty)
    if CHECK == 1:
        tl.store(p, b, boundary_check=(0,))
    elif CHECK == 2:
        tl.store(p, b, boundary_check=(1,))
    else:
        tl.store(p, b, boundary_check=(0, 1))


interpretable_chunk_kernels({"tests": types.SimpleNamespace(load=_load_block, store=_store_block)})


def _addresses(o0, o1, check):
    """(buffer index [BM, BN] of each block element, whether the checked dims keep it) by pointer arithmetic."""
    i, j = torch.arange(BM)[:, None] + o0, torch.arange(BN)[None, :] + o1
    keep = torch.ones(BM, BN, dtype=torch.bool)
    if 0 in check:
        keep &= (i >= 0) & (i < M)
    if 1 in check:
        keep &= (j >= 0) & (j < N)
    return BASE + i * S0 + j * S1, keep


def _buffer():
    return torch.arange(1, 201, dtype=torch.float32)  # distinct and nonzero: a padded 0 is never a value


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("nan", [False, True])
def test_a_load_reads_the_block_at_its_advanced_offsets_masked_along_the_checked_dims(check, nan):
    if nan and check == 0:
        pytest.skip("no dim checked: nothing is padded")
    buf, out = _buffer(), torch.empty(BM, BN)
    # offsets (1, -3) advanced by (2, 2): rows 3..6 (5, 6 past M), columns -1..6 (-1 and 6 outside N)
    _load_block[(1,)](buf[BASE:], out, M, N, S0, S1, 1, -3, 2, 2, BM=BM, BN=BN, CHECK=check, NAN=nan)
    where, keep = _addresses(3, -1, CHECKS[check])
    want = torch.where(keep, buf[where], float("nan") if nan else 0.0)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())
    if check:
        assert not keep.all()  # the case reaches past the checked bounds


def test_the_stride_order_and_the_mask_decide_the_values():
    """The expected values of the (0, 1) load above differ from those with the strides swapped or no mask, so
    the test above fails for either mistake."""
    buf = _buffer()
    where, keep = _addresses(3, -1, (0, 1))
    right = torch.where(keep, buf[where], 0.0)
    i, j = torch.arange(BM)[:, None] + 3, torch.arange(BN)[None, :] - 1
    swapped = torch.where(keep, buf[BASE + i * S1 + j * S0], 0.0)
    assert not torch.equal(right, swapped) and not torch.equal(right, buf[where])


@pytest.mark.parametrize("check", [1, 2, 3])
def test_a_store_writes_the_block_skipping_what_the_checked_dims_exclude(check):
    buf = torch.zeros(200)
    _store_block[(1,)](buf[BASE:], M, N, S0, S1, 2, 3, BM=BM, BN=BN, CHECK=check)  # rows 2..5, columns 3..10
    where, keep = _addresses(2, 3, CHECKS[check])
    want = torch.zeros(200)
    want[where[keep]] = (1 + torch.arange(BM * BN, dtype=torch.float32).view(BM, BN))[keep]
    assert torch.equal(buf, want) and 0 < int(keep.sum()) < BM * BN
