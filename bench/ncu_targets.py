"""Launches for Nsight Compute (hardware counters, where the device's runtime allows them):

    ncu --clock-control none -k regex:'_read_blocks|_decode|_fold|_book|_verify' python3 -m bench.ncu_targets

At B=128, Qwen3-Next shapes, C=16: the read-only floor kernel (bench.gpu_probe._read_blocks, BV=64, 2
warps), one buffered_decode step at buffer length 8 (its launches) and at length C (the fold step), and one
verify of 5 tokens (buffer 8).  Each is run twice (the first compiles); ncu profiles every launch.
"""

from __future__ import annotations

import sys

import torch

import bench.gpu_decode as gd
import bench.gpu_probe as gp
import bench.gpu_verify as gv
from bench.gpu_decode import H, HV, K, V


def main(B: int = 128, C: int = 16) -> int:
    import kvbuffer_fast as fast

    x = gd.tokens(B)
    state = torch.randn(B, HV, K, V, device="cuda")
    o = torch.empty(B, HV, V, device="cuda")
    for _ in range(2):
        gp._read_blocks[(V // 64, B * HV)](state, x["k"], x["q"], o, H=H, HV=HV, K=K, V=V, BV=64, KB=32, NS=1,
                                           num_warps=2)
    del state
    buf = gd.full_buffer(B, C)
    for n in (8, C):
        for _ in range(2):
            buf.lengths.fill_(n)
            fast.buffered_decode(**x, buffer=buf, validate=False)
    del buf
    x5 = gv.tokens(B, 5)
    vbuf = gv.buffer_with(B)
    f = gv.verify_fn(x5, vbuf)
    for _ in range(2):
        f()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
