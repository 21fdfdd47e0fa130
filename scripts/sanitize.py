"""Run every kvbuffer_fast kernel once over edge shapes, for compute-sanitizer (docs/testing.md).

    compute-sanitizer --tool memcheck  python3 scripts/sanitize.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize.py --quick

Edge shapes: one request, C = 1, full buffers (a fold on the next token), direct-mode requests (no
state), odd K and V (masked tiles), grouped heads, channel gates, trees of one node and a forest,
accept of 0 / all drafts, prompts of one token, shorter than a chunk and past several chunks, ragged
prompts packed by cu_seqlens.  The serving pool's kernels run under the sanitizer through
tests/pool/test_pool_gpu.py.  Each call's outputs are compared with the float64 reference so that a
kernel that runs clean but computes garbage is still reported.  Prints one JSON line: the number of
calls, the worst error ratio (error / budget of the error table) and the failures.  Runs on a CPU too
(under the Triton interpreter), where it is a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.baselines import per_draft_state_accept, per_draft_state_verify, recurrent_decode  # noqa: E402
from kvbuffer.validate.tolerances import compare  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tokens(B, T, H, HV, K, V, *, channel=False, seed=0, dtype=torch.float32):
    """Unit-norm keys, gates in (-1, 0), beta in (0, 1): q, k [B,T,H,K], v [B,T,HV,V], g, beta."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    gshape = (B, T, HV, K) if channel else (B, T, HV)
    g = -torch.rand(gshape, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    return {n: t.to(DEVICE, dtype) for n, t in x.items()}, {n: t.to(DEVICE) for n, t in x.items()}


def step(x, t):
    return {n: v[:, t:t + 1] for n, v in x.items()}


class Run:
    def __init__(self):
        self.calls, self.worst, self.failures = 0, 0.0, []

    def check(self, name, got, truth, baseline, head_axis=2):
        """got (fast, float32) against truth (float64 reference), budget from baseline (float32 reference)."""
        self.calls += 1
        r = compare(got, truth.double(), baseline, name=name, head_axis=head_axis)
        self.worst = max(self.worst, r.worst_rel / r.budget if r.budget > 0 else float("inf"))
        if not r.passed:
            self.failures.append(str(r))


def buffers(x64, x32, *, capacity, history):
    """The float64 oracle's buffer and the float32 one (reference baseline and fast copy) after a
    prefill of ``history`` tokens."""
    _, b64 = ref.prefill(**{n: t[:, :history] for n, t in x64.items()}, capacity=capacity)
    _, b32 = ref.prefill(**{n: t[:, :history] for n, t in x32.items()}, capacity=capacity)
    return b64, b32, b32.replace(**b32.cloned())


def decode_cases(run: Run, shapes):
    for B, H, HV, K, V, C, channel, history in shapes:
        x32, x64 = tokens(B, history + C + 2, H, HV, K, V, channel=channel, seed=B * 7 + K)
        b64, r32, f32 = buffers(x64, x32, capacity=C, history=history)
        for t in range(history, history + C + 2):  # past one full buffer: the fold runs
            o64, b64 = ref.buffered_decode(**step(x64, t), buffer=b64)
            o_r, r32 = ref.buffered_decode(**step(x32, t), buffer=r32)
            o_f, f32 = fast.buffered_decode(**step(x32, t), buffer=f32)
            run.check(f"decode B={B} H={H} HV={HV} K={K} V={V} C={C} ch={channel} t={t}", o_f, o64, o_r)
        run.check(f"materialize_state B={B} K={K} V={V} C={C}", fast.materialize_state(f32),
                  ref.materialize_state(b64), ref.materialize_state(r32), head_axis=1)
        count = torch.arange(B, device=DEVICE) % (int(b64.lengths.min()) + 1)
        s64 = ref.materialize_state(ref.flush(b64, count=count))
        s_r = ref.materialize_state(ref.flush(r32, count=count))
        s_f = fast.materialize_state(fast.flush(f32, count=count))
        run.check(f"flush partial B={B} C={C}", s_f, s64, s_r, head_axis=1)


def verify_cases(run: Run, shapes):
    for B, H, HV, K, V, C, channel, history, parents in shapes:
        D = len(parents)
        x32, x64 = tokens(B, history + D, H, HV, K, V, channel=channel, seed=D * 11 + K)
        b64, r32, f32 = buffers(x64, x32, capacity=C, history=history)
        par = torch.tensor(parents, device=DEVICE).expand(B, D).contiguous()
        o64, d64 = ref.verify(**{n: t[:, history:] for n, t in x64.items()}, buffer=b64, parents=par)
        o_r, d_r = ref.verify(**{n: t[:, history:] for n, t in x32.items()}, buffer=r32, parents=par)
        o_f, d_f = fast.verify(**{n: t[:, history:] for n, t in x32.items()}, buffer=f32, parents=par)
        run.check(f"verify B={B} K={K} V={V} C={C} D={D} tree={parents}", o_f, o64, o_r)
        pick = dict(counts=D) if parents == list(range(-1, D - 1)) else dict(nodes=D - 1)
        for kw in (pick, {next(iter(pick)): 0 if "counts" in pick else -1}):  # all (the last node's path), none
            s64 = ref.materialize_state(ref.accept(b64, d64, **kw))
            s_r = ref.materialize_state(ref.accept(r32, d_r, **kw))
            s_f = fast.materialize_state(fast.accept(f32.replace(**f32.cloned()), d_f, **kw))
            run.check(f"accept {kw} B={B} C={C} D={D}", s_f, s64, s_r, head_axis=1)


def baseline_cases(run: Run, shapes):
    for B, H, HV, K, V in shapes:
        x32, x64 = tokens(B, 4, H, HV, K, V, seed=K + V)
        S0 = torch.randn(B, HV, K, V, device=DEVICE, dtype=torch.float64) * 0.1
        o64, S64 = ref.recurrent_gated_delta_rule(**x64, initial_state=S0, output_final_state=True)
        o_r, S_r = ref.recurrent_gated_delta_rule(**x32, initial_state=S0.float(), output_final_state=True)
        o_f, S_f = fast.recurrent_gated_delta_rule(**x32, initial_state=S0.float(), output_final_state=True)
        run.check(f"recurrent B={B} K={K} V={V}", o_f, o64, o_r)
        run.check(f"recurrent state B={B} K={K} V={V}", S_f, S64, S_r, head_axis=1)
        state = S0.float().clone()
        o = recurrent_decode(**step(x32, 0), state=state)
        run.check(f"recurrent_decode B={B} K={K} V={V}", o, o64[:, :1], o_r[:, :1])
        o, inter = per_draft_state_verify(**x32, state=S0.float())
        run.check(f"per_draft_state_verify B={B} K={K} V={V}", o, o64, o_r)
        state = S0.float().clone()
        per_draft_state_accept(state, inter, torch.full((B,), 4, device=DEVICE))
        run.check(f"per_draft_state_accept B={B} K={K} V={V}", state, S64, S_r, head_axis=1)


def prefill_cases(run: Run, shapes):
    """chunk (uniform and cu_seqlens), direct and prefill-then-decode over short, ragged and odd shapes."""
    for B, H, HV, K, V, T, channel, chunk in shapes:
        x32, x64 = tokens(B, T, H, HV, K, V, channel=channel, seed=T + K)
        S0 = torch.randn(B, HV, K, V, device=DEVICE, dtype=torch.float64) * 0.1
        o64, S64 = ref.recurrent_gated_delta_rule(**x64, initial_state=S0, output_final_state=True)
        o_r, S_r = ref.recurrent_gated_delta_rule(**x32, initial_state=S0.float(), output_final_state=True)
        o_f, S_f = fast.chunk_gated_delta_rule(**x32, initial_state=S0.float(), output_final_state=True,
                                               chunk_size=chunk)
        run.check(f"chunk B={B} T={T} K={K} V={V} ch={channel} chunk={chunk}", o_f, o64, o_r)
        run.check(f"chunk state B={B} T={T} K={K} V={V}", S_f, S64, S_r, head_axis=1)
        run.check(f"direct B={B} T={T} K={K} V={V}", fast.direct_gated_delta_rule(**x32),
                  ref.direct_gated_delta_rule(**x64), ref.direct_gated_delta_rule(**x32))
        lens = [max(1, T - 3 * i) for i in range(B)]  # ragged prompts, one sequence per request, B = 1 packed
        cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
        packed = {n: torch.cat([t[i, :lens[i]] for i in range(B)])[None] for n, t in x32.items()}
        packed64 = {n: torch.cat([t[i, :lens[i]] for i in range(B)])[None] for n, t in x64.items()}
        o_f, _ = fast.chunk_gated_delta_rule(**packed, cu_seqlens=cu, chunk_size=chunk)
        o64, _ = ref.chunk_gated_delta_rule(**packed64, cu_seqlens=cu)
        o_r, _ = ref.chunk_gated_delta_rule(**packed, cu_seqlens=cu)
        run.check(f"chunk varlen lens={lens} K={K} V={V}", o_f, o64, o_r)
        C = 4
        o_f, buf = fast.prefill(**x32, capacity=C)
        o64, b64 = ref.prefill(**x64, capacity=C)
        o_r, b_r = ref.prefill(**x32, capacity=C)
        run.check(f"prefill B={B} T={T} C={C}", o_f, o64, o_r)
        run.check(f"prefill state B={B} T={T} C={C}", fast.materialize_state(buf), ref.materialize_state(b64),
                  ref.materialize_state(b_r), head_axis=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes (racecheck is slow)")
    ap.add_argument("--ops", default="decode,verify,baselines,prefill",
                    help="comma list of the groups to run: decode, verify, baselines, prefill (default: all)")
    args = ap.parse_args(argv)
    t0 = time.time()
    run = Run()
    # (B, H, HV, K, V, C, channel gate, history)
    dec = [(1, 1, 1, 16, 16, 1, False, 0), (1, 1, 2, 7, 5, 3, False, 3), (3, 2, 4, 33, 17, 4, True, 4),
           (2, 1, 2, 128, 128, 16, False, 16)]
    # (B, H, HV, K, V, C, channel gate, history, parents)
    ver = [(1, 1, 1, 16, 16, 1, False, 1, [-1]), (2, 1, 2, 7, 5, 4, False, 4, [-1, 0, 1, 2]),
           (3, 2, 4, 33, 17, 4, True, 2, [-1, 0, 0, 1, -1]), (2, 1, 2, 128, 128, 16, False, 16, list(range(-1, 15)))]
    base = [(1, 1, 1, 16, 16), (2, 1, 2, 7, 5), (2, 2, 4, 128, 128)]
    # (B, H, HV, K, V, T, channel gate, chunk size)
    pre = [(1, 1, 1, 16, 16, 1, False, 16), (2, 1, 2, 7, 5, 17, False, 16), (3, 2, 4, 33, 17, 40, True, 32),
           (2, 1, 2, 128, 128, 70, False, 64)]
    if args.quick:
        dec, ver, base, pre = dec[:3], ver[:3], base[:2], pre[:3]
    groups = dict(decode=(decode_cases, dec), verify=(verify_cases, ver), baselines=(baseline_cases, base),
                  prefill=(prefill_cases, pre))
    for name in args.ops.split(","):
        if name not in groups:
            ap.error(f"--ops: expected names from {', '.join(groups)}, got {name!r}")
        fn, shapes = groups[name]
        fn(run, shapes)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(json.dumps(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                          calls=run.calls, worst_ratio=round(run.worst, 4), failures=run.failures,
                          seconds=round(time.time() - t0, 1))))
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
