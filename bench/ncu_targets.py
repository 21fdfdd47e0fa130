"""Launches for Nsight Compute (hardware counters, where the device's runtime allows them):

    ncu --clock-control none -k regex:'_read_blocks|_decode|_fold|_book|_verify' python3 -m bench.ncu_targets

Qwen3-Next shapes, C=16, batch NCU_B (default 128).  NCU_PARTS (comma list, default all) picks among:
floor (the read-only floor kernel, bench.gpu_probe._read_blocks, BV=64, 2 warps), plain (one
buffered_decode step at buffer length 8: its launches), fold (one step at length C, the fold step, once per
fold launch in NCU_FOLD, a JSON list of fold_launch dicts; default: the default launch) and verify (5
tokens, buffer 8).  Each is run twice (the first compiles); ncu profiles every launch.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import bench.gpu_decode as gd
import bench.gpu_probe as gp
import bench.gpu_verify as gv
from bench.gpu_decode import H, HV, K, V


def main(B: int = 128, C: int = 16) -> int:
    import kvbuffer_fast as fast

    B = int(os.environ.get("NCU_B", B))
    parts = os.environ.get("NCU_PARTS", "floor,plain,fold,verify").split(",")
    folds = json.loads(os.environ.get("NCU_FOLD", "[{}]"))
    x = gd.tokens(B)
    if "floor" in parts:
        state = torch.randn(B, HV, K, V, device="cuda")
        o = torch.empty(B, HV, V, device="cuda")
        for _ in range(2):
            gp._read_blocks[(V // 64, B * HV)](state, x["k"], x["q"], o, H=H, HV=HV, K=K, V=V, BV=64, KB=32, NS=1,
                                               num_warps=2)
        del state
    buf = gd.full_buffer(B, C)
    if "plain" in parts:
        for _ in range(2):
            buf.lengths.fill_(8)
            fast.buffered_decode(**x, buffer=buf, validate=False)
    if "fold" in parts:
        for fl in folds:
            print("fold_launch", fl, flush=True)
            for _ in range(2):
                buf.lengths.fill_(C)
                fast.buffered_decode(**x, buffer=buf, validate=False, fold_launch=fl or None)
    del buf
    if "verify" in parts:
        x5 = gv.tokens(B, 5)
        vbuf = gv.buffer_with(B)
        f = gv.verify_fn(x5, vbuf)
        for _ in range(2):
            f()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
