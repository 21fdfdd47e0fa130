"""Registers and spills of a kvbuffer_fast kernel for sm_90 without a GPU: Triton compiles it ahead of
time to PTX, and the ptxas bundled with Triton reports (-v) what it allocated.  The local Triton may
differ from the device's (3.6), so this only flags a change (e.g. a register blow-up) before a device
call; the probe's `compiled` rows on the GPU are the record.

    python scripts/aot_regs.py KERNEL [KEY=VALUE ...]     e.g.  decode FOLD=1 EARLY=1 maxnreg=96 num_warps=2

KERNEL: decode (the lean decode kernel), fold_group, verify_prep, verify_prep_group, verify_stream (num_warps=4).

KEY=VALUE sets a constexpr of the kernel (the rest: Qwen3-Next shapes, C=16, the kernel's defaults) or
a compile option (num_warps, maxnreg, num_stages).  PYTHONPATH=<a Triton 3.6 install> compiles as the
H200 image does; AOT_DEBUG=1 prints ptxas's whole report; AOT_PTX=FILE writes the PTX there.  tests/bench/test_gpu_probe_config.py runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _lean_decode(over):
    import kvbuffer_fast.decode as dec

    ptr = "*fp32"
    sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr=ptr, beta_ptr="*bf16", o_ptr="*bf16",
               ck_ptr="*bf16", cu_ptr=ptr, cg_ptr=ptr, len_ptr="*i64", own_ptr="*u8", state_ptr=ptr,
               ticket_ptr="*i32", scale="fp32", snap_ptr="*i64")
    const = dict(C=16, H=16, HV=32, K=128, V=128, CB=16, BK=128, BV=64, NV=2, BH=16, BHV=32, CHANNEL=False,
                 STORAGE=True, TICKET=False, KB=32, NS=1, LOADN=True, KEYN=True)
    const.update(over)
    return dec._decode_lean_kernel, sig, const


def _verify(kernel: str):
    def make(over):
        import kvbuffer_fast.speculative as spec

        ptr = "*fp32"
        fn = getattr(spec, kernel)
        if kernel == "_verify_stream_kernel":
            sig = dict(v_ptr="*bf16", nd_ptr="*i64", o_ptr="*bf16", du_ptr=ptr, cu_ptr=ptr, len_ptr="*i64",
                       own_ptr="*u8", state_ptr=ptr, p_ptr=ptr, l_ptr=ptr, D="i32", q_ptr="*bf16", k_ptr="*bf16")
            const = dict(C=16, HV=32, K=128, V=128, BD=8, BC=16, KB=32, BV=128, NS=3, STORAGE=True, PREC="tf32x3",
                         ZP=True, PDL=True, H=16)
        else:
            sig = dict(q_ptr="*bf16", k_ptr="*bf16", g_ptr=ptr, beta_ptr="*bf16", par_ptr="*i64", nd_ptr="*i64",
                       dg_ptr=ptr, dk_ptr="*bf16", ck_ptr="*bf16", cg_ptr=ptr, len_ptr="*i64", p_ptr=ptr, l_ptr=ptr,
                       scale="fp32", D="i32")
            const = dict(C=16, H=16, HV=32, K=128, BD=8, BC=16, KC=32, PREC="tf32x3", PDL=True)
            if kernel == "_verify_prep_kernel":
                const.update(CHANNEL=False, ZP=True)
        const.update(over)
        return fn, sig, const
    return make


def _fold_group(over):
    import kvbuffer_fast.decode as dec

    ptr = "*fp32"
    sig = dict(ck_ptr="*bf16", cu_ptr=ptr, cg_ptr=ptr, len_ptr="*i64", own_ptr="*u8", state_ptr=ptr,
               ticket_ptr="*i32", snap_ptr="*i64", q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr=ptr,
               beta_ptr="*bf16", o_ptr="*bf16", scale="fp32")
    const = dict(C=16, H=16, HV=32, K=128, V=128, CB=16, KB=32, BV=64, NV=2, FH=8, NS=2, CHANNEL=False)
    const.update(over)
    return dec._fold_group_kernel, sig, const


KERNELS = {"decode": _lean_decode, "fold_group": _fold_group, "verify_prep": _verify("_verify_prep_kernel"),
           "verify_prep_group": _verify("_verify_prep_group_kernel"), "verify_stream": _verify("_verify_stream_kernel")}


def main(argv):
    name, over = argv[0], {}
    opts = dict(num_warps=2)
    for kv in argv[1:]:
        k, v = kv.split("=")
        v = int(v) if v.lstrip("-").isdigit() else v
        v = {"True": True, "False": False}.get(v, v) if isinstance(v, str) else v
        if k in ("num_warps", "maxnreg", "num_stages"):
            opts[k] = v
        else:
            over[k] = v
    fn, sig, const = KERNELS[name](over)
    import inspect

    for prm in fn.params:  # constexprs added to the kernel since this list was written take their defaults
        if prm.is_constexpr and prm.name not in const:
            if prm.default is inspect.Parameter.empty:
                raise SystemExit(f"aot_regs: give {prm.name}=... (a constexpr of {fn.__name__} without a default)")
            const[prm.name] = prm.default
    for k, v in const.items():
        sig[k] = "constexpr"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ck.asm["ptx"])
        if os.environ.get("AOT_PTX"):  # keep the PTX (e.g. to diff two versions of a kernel)
            open(os.environ["AOT_PTX"], "w").write(ck.asm["ptx"])
        for exe in ("ptxas", "ptxas-blackwell"):  # Triton's sm_90 assembler; the newer one for newer PTX
            out = subprocess.run([os.path.join(bindir, exe), "-v", "--gpu-name=sm_90a", p, "-o",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True)
            if out.returncode == 0:
                break
    info = out.stderr + out.stdout
    if os.environ.get("AOT_DEBUG"):
        print(info)
    regs = re.findall(r"Used (\d+) registers", info)
    spill = re.findall(r"(\d+) bytes spill stores", info)
    print(name, over, opts, "regs", regs, "spill_stores", spill, "shared", getattr(ck.metadata, "shared", None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
