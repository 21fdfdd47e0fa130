"""Smoke check of FlashInfer's GDN kernels on a GPU: import them, run one small call of each form the benchmark
times, and print each one's max error against kvbuffer_ref's float64 recurrence.

    python3 scripts/flashinfer_smoke.py [--flashinfer-path DIR]     (default: .fi-site/ if present, else installed)

Shapes: B = 4, H = 2, HV = 4, K = V = 128 (FlashInfer's kernels need K, V >= 128; its bf16 state needs 128),
bf16 tokens, raw gates (a, b in bf16), q/k L2-normalised in the kernel.  Exit status 0 when every output is
within 2e-2 and every state within 2e-2 of the float64 result (bf16 state: 5e-2), max abs; 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbuffer_ref as ref  # noqa: E402
from kvbuffer.peers import flashinfer as FI  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = Path(__file__).resolve().parents[1] / ".fi-site"
    ap.add_argument("--flashinfer-path", default=str(default) if default.is_dir() else None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashinfer_smoke: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    fi = FI.load(args.flashinfer_path)
    print(f"FlashInfer {fi.version} from {fi.source}; import {time.time() - t0:.1f} s; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    dev, B, H, HV, K, V, T, m = "cuda", 4, 2, 4, 128, 128, 5, 3
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dev, torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dev, torch.bfloat16)
    v = torch.randn(B, T, HV, V, generator=g).to(dev, torch.bfloat16)
    lg = (-0.5 * torch.rand(B, T, HV, generator=g)).to(dev)
    beta = torch.rand(B, T, HV, generator=g).to(dev)
    S0 = (0.1 * torch.randn(B, HV, K, V, generator=g)).to(dev)  # ours: [B, HV, K, V] fp32
    A_log, dt_bias, a, b = FI.raw_gates(lg.reshape(B * T, HV), beta.reshape(B * T, HV), seed=1)
    a, b = a.view(B, T, HV), b.view(B, T, HV)
    x64 = FI.oracle_inputs(q, k, v, a, b, A_log, dt_bias)
    scale = K ** -0.5

    def truth(n):
        o, S = ref.recurrent_gated_delta_rule(*(x64[t][:, :n].cpu() for t in ("q", "k", "v")),
                                              g=x64["g"][:, :n].cpu(), beta=x64["beta"][:, :n].cpu(), scale=scale,
                                              initial_state=S0.double().cpu(), output_final_state=True)
        return o, S

    ok = True

    def report(name, o, o64, S, S64, tol_s):
        nonlocal ok
        eo = (o.double().cpu() - o64).abs().max().item()
        es = (S.double().cpu() - S64).abs().max().item()
        good = eo <= 2e-2 and es <= tol_s
        ok &= good
        print(f"{name:44s} max|o - o64| {eo:.3e}   max|S - S64| {es:.3e}   {'ok' if good else 'FAIL'}")

    o1, S1 = truth(1)
    x1 = dict(q=q[:, :1].contiguous(), k=k[:, :1].contiguous(), v=v[:, :1].contiguous(), A_log=A_log,
              dt_bias=dt_bias, a=a[:, :1].contiguous(), b=b[:, :1].contiguous())
    slots = torch.tensor([2, 0, 3, 1], device=dev, dtype=torch.int32)
    for name, kind, dtype, null in (("decode_pretranspose fp32 pool", "pretranspose", torch.float32, 0),
                                    ("decode_pretranspose bf16 pool", "pretranspose", torch.bfloat16, 1),
                                    ("decode (K-major, fp32, our layout)", "kmajor", torch.float32, 0)):
        try:
            sl = slots + null if kind == "pretranspose" else torch.arange(B, device=dev, dtype=torch.int32)
            pool = FI.to_pool(S0, sl, B + null, dtype=dtype, v_major=kind == "pretranspose")
            out = torch.empty(B, 1, HV, V, device=dev, dtype=torch.bfloat16)
            fn = fi.decode_pretranspose if kind == "pretranspose" else fi.decode_kmajor
            t = time.time()
            fn(**FI.decode_kwargs(kind, **x1, pool=pool, slots=sl, out=out, scale=scale))
            torch.cuda.synchronize()
            print(f"  first call (compile) {time.time() - t:.1f} s")
            report(name, out, o1, FI.from_pool(pool, sl, v_major=kind == "pretranspose"), S1,
                   5e-2 if dtype == torch.bfloat16 else 2e-2)
        except Exception as e:  # noqa: BLE001 - report each form, go on
            ok = False
            print(f"{name:44s} ERROR {type(e).__name__}: {str(e)[:400]}")
    try:
        oT, _ = truth(T)
        _, Sm = truth(m)
        pool = FI.to_pool(S0, slots, B)
        out = torch.empty(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        inter = torch.empty(B, T, HV, V, K, device=dev)
        t = time.time()
        fi.mtp(**FI.mtp_kwargs(q=q, k=k, v=v, A_log=A_log, dt_bias=dt_bias, a=a, b=b, pool=pool, slots=slots, out=out,
                               intermediate=inter, scale=scale))
        torch.cuda.synchronize()
        print(f"  first call (compile) {time.time() - t:.1f} s")
        report(f"mtp T={T} (pool frozen)", out, oT, FI.from_pool(pool, slots), S0.double().cpu(), 1e-6)
        FI.accept_into_pool(pool, inter, slots.long(), m)
        report(f"mtp T={T} + accept m={m} (state after m)", out, oT, FI.from_pool(pool, slots), Sm, 2e-2)
    except Exception as e:  # noqa: BLE001
        ok = False
        print(f"{'mtp':44s} ERROR {type(e).__name__}: {str(e)[:400]}")
    print("flashinfer_smoke:", "OK" if ok else "FAILED", f"({time.time() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
