"""Shared memory of the chunk launches as Triton builds them for sm_90, compiled on the CPU (no GPU): for
each (dtype, K, V) given, the launch the table, ``fit_chunk_tiles`` and ``fitted_chunk_size`` pick on an
H100 / H200, its bytes by Triton and by ``launch.chunk_smem_bytes``.  Run as a script (Triton's compiler,
not its interpreter: TRITON_INTERPRET must be unset); prints one JSON list.

    python3 tests/kernels/sm90_smem.py float32:256:264 bfloat16:136:128
"""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvbuffer_fast import chunk as CH
from kvbuffer_fast.launch import SM90_SHARED_BYTES, Key, chunk_smem_bytes, config_for, fit_chunk_tiles


def _shared(fn, types: dict, const: dict, **options) -> int:
    sig = dict(types, **{k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared


def launches(dtype: torch.dtype, K: int, V: int, channel: bool = False) -> dict:
    """The three launches of a chunk call on sm_90 at heads K, V (one sequence of 64 tokens): the config and
    chunk size picked, and {launch: (Triton's bytes, the estimate)}."""
    t16 = dtype != torch.float32
    cfg = config_for("chunk", Key(columns=32 * 128, dtype=dtype, channel=channel, capability=(9, 0)))
    BT = triton.next_power_of_2(max(16, CH.fitted_chunk_size(64, cfg, dtype=dtype, K=K, V=V,
                                                             limit=SM90_SHARED_BYTES)))
    cfg = fit_chunk_tiles(cfg, dtype=dtype, K=K, V=V, BT=BT, limit=SM90_SHARED_BYTES)
    e, f, i = ("*bf16" if t16 else "*fp32"), "*fp32", "*i32"
    lo = e if t16 else f  # W in the keys' dtype (16-bit inputs)
    low = e if t16 and cfg.fast16 else f  # U and h in 16 bits (fast16)
    common = dict(H=1, HV=1, K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), CHANNEL=channel,
                  PREC="tf32" if t16 else "tf32x3")
    got = {
        "prep": _shared(CH._chunk_prep_kernel,
                        dict(q_ptr=e, k_ptr=e, v_ptr=e, g_ptr=f, beta_ptr=f, start_ptr=i, len_ptr=i, w_ptr=lo,
                             ut_ptr=f, gc_ptr=f, aqk_ptr=f, ta_ptr=f, scale="fp32"),
                        dict(common, BVF=triton.next_power_of_2(V), MMA16=t16, LOWP=t16 and cfg.fast16),
                        num_warps=cfg.prep_warps),
        "state": _shared(CH._chunk_state_kernel,
                         dict(k_ptr=e, w_ptr=lo, ut_ptr=f, gc_ptr=f, start_ptr=i, len_ptr=i, coff_ptr=i, fend_ptr=i,
                              u_ptr=low, h_ptr=low, s0_ptr=f, sf_ptr=f, bk_ptr=e, bu_ptr=f, bg_ptr=f, CS="i32"),
                         dict(common, C=1, BV=cfg.BV, INITIAL=True, FINAL=True, TAIL=False, LOWP=t16),
                         num_warps=cfg.num_warps, num_stages=cfg.stages),
        "output": _shared(CH._chunk_output_kernel,
                          dict(q_ptr=e, u_ptr=low, h_ptr=low, gc_ptr=f, aqk_ptr=f, start_ptr=i, len_ptr=i, o_ptr=e,
                               scale="fp32"),
                          dict(common, BV=cfg.out_BV, LOWP=t16 and cfg.fast16), num_warps=cfg.out_warps),
    }
    est = {n: chunk_smem_bytes(n, cfg, dtype=dtype, K=K, V=V, BT=BT) for n in got}
    return dict(dtype=str(dtype).replace("torch.", ""), K=K, V=V, BT=BT, config=repr(cfg),
                launches={n: [got[n], est[n]] for n in got})


if __name__ == "__main__":
    rows = []
    for spec in sys.argv[1:]:
        dt, K, V = spec.split(":")
        rows.append(launches(getattr(torch, dt), int(K), int(V)))
    print(json.dumps(rows))
