"""Registers, spills and PTX size of a kvbuffer_fast kernel for sm_90, without a GPU.

Triton compiles the kernel ahead of time to PTX for sm_90 and the ptxas bundled with Triton reports
(-v) the registers and spill stores it allocated; the PTX instructions are counted without debug
locations, labels and directives.  The local Triton may differ from the device's, so compare two
package roots with the same Triton (e.g. before and after a refactor) rather than with the device.

    python scripts/aot_regs.py KERNEL [KEY=VALUE ...] [--root DIR]
    python scripts/aot_regs.py all [--root DIR]

KERNEL: decode, fold_group, fold_full (the tile fold), book (kvbuffer_fast/decode.py), flush
(kvbuffer_fast/flush.py), verify_prep_group, verify_prep, verify_stream (kvbuffer_fast/verify.py;
speculative.py in older trees), accept_fold_slots,
accept_slots (kvbuffer_fast/accept.py, the pool's fold and copy launches), chunk_prep
(kvbuffer_fast/chunk.py, bf16 inputs at chunk 64), or ``all``.
Constexprs take, in order: KEY=VALUE from the command line, the value of the default H200 launch
below (Qwen3-Next heads, B = 128, C = 16, bf16), the kernel's own default; a constexpr with none of
these is an error that names it, and names the table gives that the kernel lacks are ignored (a
renamed switch must then be given on the command line).  num_warps, maxnreg and num_stages are compile options.
A VALUE starting with ``*`` sets the type of the pointer argument KEY (``k_ptr=*fp32``; by default an
argument's type follows its name: bf16 tokens and keys, int32 chunk tables, fp32 the rest).
``--root DIR`` imports kvbuffer_fast from DIR.  ``ptx_sha256`` digests the PTX's code without debug
locations, comments and parameter names: equal digests of two roots mean the same kernel code (a
kernel that lost an unused argument differs only in its ``params`` count: diff the AOT_PTX files).  AOT_PTX=FILE writes the PTX there (AOT_TTGIR=FILE Triton's GPU IR); AOT_DEBUG=1 prints
ptxas's whole report; AOT_ALIGNED=1 compiles with the pointers 16-byte aligned, as a launch on torch's
tensors specializes them (vectorized loads and stores).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

#: kernel name -> (modules to look in, the jit function's names, newest last, constexprs, compile options).  The constexprs
#: are those of the default launch on an H200 at Qwen3-Next heads, B = 128, C = 16, bf16 tokens, scalar
#: gates, d = 5 verified tokens (the fold kernels: the grouped one serves the requests it folds).
KERNELS = {
    "decode": (("decode",), ("_decode_lean_kernel", "_decode_kernel"),
               dict(C=16, H=16, HV=32, K=128, V=128, CB=16, BK=128, BV=64, NV=2, BH=16, BHV=32, CHANNEL=False,
                    STORAGE=True, TICKET=False, KB=32, NS=1, LOADN=True, KEYN=True, KT=False, SNAP=False, FOLD=False,
                    EARLY=False, PF=False, PDL=True, SERVED=True, LATE=True, EV_STATE="evict_first",
                    EV_ROWS="evict_last"), dict(num_warps=2)),
    "fold_group": (("decode", "_fold"), "_fold_group_kernel",
                   dict(C=16, H=16, HV=32, K=128, V=128, CB=16, KB=32, BV=64, NV=2, FH=8, NS=2, CHANNEL=False,
                        SNAP=False, STORAGE=True, PDL=True, SERVE=True, FP="ieee"), dict(num_warps=2)),
    "fold_full": (("decode", "_fold", "flush"), ("_fold_full_kernel", "_fold_tile_kernel"),
                  dict(C=16, H=16, HV=32, K=128, V=128, FB=16, BK=128, BV=64, NV=2, CHANNEL=False, SNAP=False,
                       STORAGE=True, SERVE=False), dict(num_warps=4)),
    "flush": (("flush",), "_flush_kernel",
              dict(C=16, H=16, HV=32, K=128, V=128, BC=16, BK=128, BV=64, FB=16, CHANNEL=False), dict(num_warps=8)),
    "book": (("decode",), "_book_kernel", dict(C=16, H=16, HV=32, K=128, BK=128, BH=16, BHV=32, CHANNEL=False,
                                               PDL=True), dict(num_warps=4)),
    "verify_prep_group": (("verify", "speculative"), "_verify_prep_group_kernel",
                          dict(C=16, H=16, HV=32, K=128, BD=8, BC=16, KC=32, PREC="ieee", PDL=True, HOIST=True, BG=2,
                               MMA16=True, DOUBLING=False, LOG_BD=3, POOL=False, BDR=8, FOLD=0), dict(num_warps=1, maxnreg=128)),
    "verify_prep": (("verify", "speculative"), "_verify_prep_kernel",
                    dict(C=16, H=16, HV=32, K=128, BD=8, BC=16, KC=32, PREC="ieee", PDL=True, CHANNEL=False, ZP=True,
                         POOL=False, BDR=8, FOLD=0),
                    dict(num_warps=1)),
    "verify_stream": (("verify", "speculative"), "_verify_stream_kernel",
                      dict(C=16, HV=32, K=128, V=128, BD=8, BC=16, KB=32, BV=128, NS=3, STORAGE=True, PREC="tf32x3",
                           ZP=True, PDL=True, H=16, EARLY=True, XSPLIT=1, XP="tf32", FOLD=0), dict(num_warps=4)),
    "accept_fold_slots": (("accept",), "_accept_fold_slots_kernel",
                          dict(C=16, H=16, HV=32, K=128, V=128, BD=8, CB=16, KB=32, BV=64, FH=4, NS=2, CHANNEL=False,
                               PDL=True), dict(num_warps=2)),
    "accept_slots": (("accept",), "_accept_slots_kernel",
                     dict(C=16, H=16, HV=32, K=128, V=128, BD=8, CU=256, CK=128, GB=2, P=4, CHANNEL=False, PDL=True),
                     dict(num_warps=2)),
    "chunk_prep": (("chunk",), "_chunk_prep_kernel",
                   dict(H=16, HV=32, K=128, V=128, BT=64, BK=128, BVF=128, CHANNEL=False, PREC="tf32", MMA16=True,
                        LOWP=True), dict(num_warps=4)),
}
OPTIONS = ("num_warps", "maxnreg", "num_stages")
_BF16 = {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "ck_ptr", "dk_ptr", "beta_ptr"}
_I64 = {"len_ptr", "nd_ptr", "par_ptr", "snap_ptr"}
#: Kernels whose arguments of these names are int32 (the chunk tables)
_I32 = {"_chunk_prep_kernel": {"start_ptr", "len_ptr"}}


def _arg_type(name: str, kernel: str = "") -> str:
    """The signature type of a runtime argument, from its name (bf16 tokens and keys, fp32 the rest)."""
    if name in _I32.get(kernel, ()):
        return "*i32"
    if not name.endswith("_ptr"):
        return "fp32" if name == "scale" else "i32"
    if name in _BF16:
        return "*bf16"
    if name in _I64:
        return "*i64"
    return {"own_ptr": "*u8", "ticket_ptr": "*i32", "ready_ptr": "*i32"}.get(name, "*fp32")


def find_kernel(name: str):
    modules, attrs, const, opts = KERNELS[name]
    attrs = (attrs,) if isinstance(attrs, str) else attrs
    tried = []
    for mod in modules:
        try:
            m = importlib.import_module(f"kvbuffer_fast.{mod}")
        except ImportError as e:
            tried.append(f"kvbuffer_fast.{mod} ({e})")
            continue
        for attr in attrs:  # the older name first: an older tree may hold another kernel under the newer one
            if hasattr(m, attr):
                return getattr(m, attr), dict(const), dict(opts)
        tried.append(f"kvbuffer_fast.{mod}")
    raise SystemExit(f"aot_regs: kernel {' / '.join(attrs)} ({name}) is missing; looked in {', '.join(tried)}")


def signature(fn, const: dict, types: dict | None = None) -> tuple[dict, dict]:
    """(signature, constexprs) of ``fn``: every constexpr from ``const`` or the kernel's default, every
    argument's type from ``types`` or its name."""
    sig, values = {}, {}
    missing = []
    for p in fn.params:
        if p.is_constexpr:
            if p.name in const:
                values[p.name] = const[p.name]
            elif p.default is not inspect.Parameter.empty:
                values[p.name] = p.default
            else:
                missing.append(p.name)
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = (types or {}).get(p.name) or _arg_type(p.name, fn.__name__)
    if missing:
        raise SystemExit(f"aot_regs: give {', '.join(m + '=...' for m in missing)} (constexprs of {fn.__name__} "
                         f"without a default)")
    return sig, values


def ptx_code(ptx: str) -> list[str]:
    """The PTX's code lines: the text before its DWARF sections, without debug locations, file
    directives, comments and the labels the debug information points at."""
    code = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    lines = []
    for line in code.splitlines():
        s = line.split("//", 1)[0].strip()
        if s and not s.startswith((".loc", ".file")) and not re.fullmatch(r"\$L__tmp\d+:", s):
            lines.append(s)
    return lines


def ptx_digest(ptx: str) -> str:
    """sha256 of ``ptx_code`` with the parameter names (``kernel_param_<i>``: their order) made equal: two
    builds of the same kernel code give the same digest."""
    import hashlib

    lines = [re.sub(r"_param_\d+", "_param_#", s) for s in ptx_code(ptx)]  # parameter names (their order)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def ptx_instructions(ptx: str) -> int:
    """Instructions among ``ptx_code``: the statements that are no directive or declaration."""
    return sum(1 for s in ptx_code(ptx) if s.endswith(";") and not s.startswith("."))


def compile_report(name: str, over: dict, opts: dict, types: dict | None = None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, const, kopts = find_kernel(name)
    const.update(over)
    kopts.update(opts)
    sig, values = signature(fn, const, types)
    # AOT_ALIGNED=1: pointers 16-byte aligned, as Triton specializes them at a launch on torch's allocations
    # (vectorized loads and stores); by default no alignment is assumed
    attrs = {} if os.environ.get("AOT_ALIGNED") != "1" else {
        (fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in values.items()}, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=kopts)
    ptx = ck.asm["ptx"]
    if os.environ.get("AOT_TTGIR"):
        with open(os.environ["AOT_TTGIR"], "w") as fh:
            fh.write(ck.asm["ttgir"])
    if os.environ.get("AOT_PTX"):
        with open(os.environ["AOT_PTX"], "w") as fh:
            fh.write(ptx)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    info = ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):  # Triton's sm_90 assembler; the newer one for newer PTX
            if not os.path.exists(os.path.join(bindir, exe)):
                continue
            out = subprocess.run([os.path.join(bindir, exe), "-v", "--gpu-name=sm_90a", path, "-o",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True)
            info = out.stderr + out.stdout
            if out.returncode == 0:
                break
    if os.environ.get("AOT_DEBUG"):
        print(info)
    regs = re.findall(r"Used (\d+) registers", info)
    if not regs:
        raise SystemExit(f"aot_regs: no usable ptxas for sm_90 in {bindir}:\n{info[-1000:]}")
    spills = re.findall(r"(\d+) bytes spill stores", info)
    return dict(kernel=fn.__name__, regs=int(regs[0]), spill_stores=int(spills[0]) if spills else 0,
                shared=getattr(ck.metadata, "shared", None), ptx_instructions=ptx_instructions(ptx),
                ptx_sha256=ptx_digest(ptx), params=sum(1 for s in ptx_code(ptx) if s.startswith(".param")),
                options=kopts)


def _value(v: str):
    if v in ("True", "False"):
        return v == "True"
    return int(v) if v.lstrip("-").isdigit() else v


def main(argv) -> int:
    if "--root" in argv:
        i = argv.index("--root")
        sys.path.insert(0, os.path.abspath(argv[i + 1]))
        argv = argv[:i] + argv[i + 2:]
    if not argv or argv[0] not in (*KERNELS, "all"):
        raise SystemExit(f"aot_regs: give a kernel: {', '.join(KERNELS)} or all")
    over, opts, types = {}, {}, {}
    for kv in argv[1:]:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"aot_regs: expected KEY=VALUE, got {kv!r}")
        if v.startswith("*"):
            types[k] = v
        else:
            (opts if k in OPTIONS else over)[k] = _value(v)
    failed = 0
    for name in (KERNELS if argv[0] == "all" else [argv[0]]):
        try:
            r = compile_report(name, over, opts, types)
        except SystemExit as e:  # a missing kernel or constexpr: said, and the others still compile
            if argv[0] != "all":
                raise
            print(e, file=sys.stderr)
            failed += 1
            continue
        print(f"{name} {r['kernel']} regs {r['regs']} spill_stores {r['spill_stores']} shared {r['shared']} "
              f"ptx_instructions {r['ptx_instructions']} params {r['params']} ptx_sha256 {r['ptx_sha256']} {r['options']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
