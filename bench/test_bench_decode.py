"""Decode benchmarks: recurrent (ours and fla's) vs buffered decode over a whole C-step cycle, the
flush alone, and direct mode.  Each row is checked against the float64 oracle before it is timed.

Run: ``pytest bench/test_bench_decode.py --benchmark-json out.json`` (bench/conftest.py: modes,
device timing; docs/benchmarks.md: fields).
"""

from __future__ import annotations

import pytest
import torch

from bench import io_model as io
from bench.conftest import DEVICE, check_rows, require

fast = pytest.importorskip("kvbuffer_fast", reason="kvbuffer_fast (Triton kernels) is not importable")


def _need(name: str):
    if not hasattr(fast, name):
        pytest.skip(f"kvbuffer_fast.{name} does not exist yet")
    return getattr(fast, name)


def test_recurrent_decode(benchmark, bench, batch):
    """kvbuffer_fast.recurrent_decode: one token, the state read and written in place (2|S|)."""
    recurrent_decode = _need("recurrent_decode")
    s, rows = bench.cfg.shapes, check_rows(batch)
    state = bench.history(batch, capacity=bench.cfg.verify_capacity, buffered=0).buffer.state
    x = bench.tokens(batch, 1, seed=1)
    truth = bench.truth(x, rows, initial_state=state)
    o = recurrent_decode(**x, state=state)
    checks = require([bench.compare("recurrent_decode.o", o, rows, truth),
                      bench.compare("recurrent_decode.state", state, rows, truth, state=True)])
    bench.measure(benchmark, lambda: recurrent_decode(**x, state=state), kind="recurrent",
                  impl="kvbuffer_fast.recurrent_decode", io_bytes=io.recurrent_step(s, batch), checks=checks,
                  B=batch, design_bytes=io.design_model_bytes("recurrent", s, batch))


def test_fla_fused_recurrent(benchmark, bench, batch):
    """flash-linear-attention 0.6.0 fused_recurrent_gated_delta_rule: the decode kernel serving uses (2|S|)."""
    mod = pytest.importorskip("fla.ops.gated_delta_rule",
                              reason="flash-linear-attention (fla-core 0.6.0) is not importable")
    fused = mod.fused_recurrent_gated_delta_rule
    s, rows = bench.cfg.shapes, check_rows(batch)
    state = bench.history(batch, capacity=bench.cfg.verify_capacity, buffered=0).buffer.state
    x = bench.tokens(batch, 1, seed=1)
    truth = bench.truth(x, rows, initial_state=state)

    def run():
        # keywords only (fla's positional order differs between its functions); the state [B, HV, K, V]
        return fused(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=s.K ** -0.5, initial_state=state,
                     output_final_state=True, use_qk_l2norm_in_kernel=False)

    o, S = run()
    checks = require([bench.compare("fla.fused_recurrent.o", o, rows, truth),
                      bench.compare("fla.fused_recurrent.state", S, rows, truth, state=True)])
    import fla

    bench.measure(benchmark, run, kind="fla", impl=f"fla {getattr(fla, '__version__', '?')} "
                  "fused_recurrent_gated_delta_rule", io_bytes=io.recurrent_step(s, batch), checks=checks, B=batch,
                  design_bytes=io.design_model_bytes("fla", s, batch))


def test_buffered_decode_cycle(benchmark, bench, batch, capacity):
    """kvbuffer_fast.buffered_decode over a whole cycle of C steps from full buffers (the first step
    folds the C entries in the same launch): the time per step, flushes included."""
    buffered_decode = _need("buffered_decode")
    s, rows, C = bench.cfg.shapes, check_rows(batch), capacity
    hist = bench.history(batch, C, buffered=C)
    buf = hist.buffer
    x = bench.tokens(batch, C, seed=2)
    steps = bench.steps(x)
    truth = bench.truth(x, rows, hist=hist)
    outs = [buffered_decode(**st, buffer=buf)[0] for st in steps]
    checks = require([bench.compare(f"buffered_decode[C={C}] cycle.o", torch.cat(outs, dim=1), rows, truth)])
    assert bool((buf.lengths == C).all()), "after a whole cycle every buffer is full again"

    def cycle():
        for st in steps:
            buffered_decode(**st, buffer=buf, validate=False)

    bench.measure(benchmark, cycle, per=C, kind="buffered_cycle", impl="kvbuffer_fast.buffered_decode",
                  io_bytes=io.buffered_cycle_step(s, batch, C), checks=checks, B=batch, C=C,
                  design_bytes=io.design_model_bytes("buffered_cycle", s, batch, C=C))


def test_flush(benchmark, bench, batch, capacity):
    """kvbuffer_fast.flush of full buffers alone (2|S| + C entries); the timed graph also refills the
    lengths (one B-element fill kernel) so that every replay folds C entries."""
    flush = _need("flush")
    s, rows, C = bench.cfg.shapes, check_rows(batch), capacity
    hist = bench.history(batch, C, buffered=C)
    buf = hist.buffer
    truth = bench.truth(bench.tokens(batch, 0, seed=0), rows, hist=hist)
    flush(buf)
    checks = require([bench.compare(f"flush[C={C}].state", buf.state, rows, truth, state=True)])

    def run():
        buf.lengths.fill_(C)
        flush(buf, validate=False)

    bench.measure(benchmark, run, kind="flush", impl="kvbuffer_fast.flush", io_bytes=io.flush_full(s, batch, C),
                  checks=checks, B=batch, C=C)


def test_direct_decode(benchmark, bench, batch, capacity):
    """Direct mode (no state exists): the first C-1 tokens of requests, averaged per step; the timed
    graph starts with a fill of the lengths to 0."""
    buffered_decode = _need("buffered_decode")
    from kvbuffer_ref.buffer import KVBuffer

    s, rows, C = bench.cfg.shapes, check_rows(batch), capacity
    if C < 2:
        pytest.skip("direct mode needs C >= 2")
    buf = KVBuffer.empty(batch, s.H, s.HV, s.K, s.V, C, with_state=False, dtype=torch.float32,
                         key_dtype=bench.cfg.dtype, device=DEVICE)
    x = bench.tokens(batch, C - 1, seed=4)
    steps = bench.steps(x)
    truth = bench.truth(x, rows)
    outs = [buffered_decode(**st, buffer=buf)[0] for st in steps]
    checks = require([bench.compare(f"direct[C={C}].o", torch.cat(outs, dim=1), rows, truth)])

    def run():
        buf.lengths.fill_(0)
        for st in steps:
            buffered_decode(**st, buffer=buf, validate=False)

    bench.measure(benchmark, run, per=C - 1, kind="direct", impl="kvbuffer_fast.buffered_decode (direct mode)",
                  io_bytes=io.direct_step(s, batch, C), checks=checks, B=batch, C=C)
