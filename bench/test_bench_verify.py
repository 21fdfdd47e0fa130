"""Speculative-verify benchmarks: buffered verify (no per-draft state; chains and trees) against the
per-draft-state verify serving systems use today (one full state written per draft), 1..8 drafts;
and the whole speculative step (verify + accept of every draft) for chains.  Each row is checked
against the float64 oracle before it is timed.

Buffers hold ``verify_fill`` entries (n) out of ``verify_capacity`` (C) when verify runs, after a
few folded tokens (so a state exists).  Trees are binary: node i's parent is (i - 1) // 2.
"""

from __future__ import annotations

import pytest
import torch

from bench import io_model as io
from bench.conftest import DEVICE, Truth, check_rows, require

fast = pytest.importorskip("kvbuffer_fast", reason="kvbuffer_fast (Triton kernels) is not importable")


def _need(name: str, owner: str = "kvbuffer_fast"):
    if not hasattr(fast, name):
        pytest.skip(f"{owner}.{name} does not exist yet")
    return getattr(fast, name)


def _chain(B: int, d: int) -> torch.Tensor:
    return torch.arange(-1, d - 1, device=DEVICE, dtype=torch.long).expand(B, d).contiguous()


def _binary_tree(B: int, d: int) -> torch.Tensor:
    par = [-1] + [(i - 1) // 2 for i in range(1, d)]
    return torch.tensor(par, device=DEVICE, dtype=torch.long).expand(B, d).contiguous()


def _tree_truth(bench, x, rows, hist, parents_row: torch.Tensor) -> Truth:
    """Per node: the recurrence over the history and the node's root-to-node path (its last output)."""
    from kvbuffer_ref.speculative import path_to

    d = parents_row.shape[0]
    o, base = [], []
    for i in range(d):
        t = bench.truth(x, rows, hist=hist, select=path_to(parents_row.cpu(), i))
        o.append(t.o[:, -1])
        base.append(None if t.base_o is None else t.base_o[:, -1])
    base_o = None if base[0] is None else torch.stack(base, dim=1)
    idx = torch.as_tensor(rows, dtype=torch.long)
    g = torch.cat([hist.x["g"].index_select(0, idx % 2), x["g"].cpu().index_select(0, idx)], dim=1)
    return Truth(torch.stack(o, dim=1), base_o, None, None, g)


def _buffered_setup(bench, B: int, d: int, seed: int):
    cfg = bench.cfg
    hist = bench.history(B, cfg.verify_capacity, buffered=cfg.verify_fill)
    x = bench.tokens(B, d, seed=seed)
    nd = torch.full((B,), d, device=DEVICE, dtype=torch.long)
    return hist, x, nd


def test_verify_buffered_chain(benchmark, bench, vbatch, drafts):
    """kvbuffer_fast.verify of a chain of d drafts: |S| + n entries read, d entries written."""
    verify = _need("verify")
    s, rows, B, d, n = bench.cfg.shapes, check_rows(vbatch), vbatch, drafts, bench.cfg.verify_fill
    hist, x, nd = _buffered_setup(bench, B, d, seed=3)
    par, buf = _chain(B, d), hist.buffer
    truth = bench.truth(x, rows, hist=hist)
    o, _ = verify(**x, buffer=buf, parents=par, num_drafts=nd)
    checks = require([bench.compare(f"verify[chain d={d}].o", o, rows, truth)])
    bench.measure(benchmark, lambda: verify(**x, buffer=buf, parents=par, num_drafts=nd, validate=False),
                  kind="verify", style="buffered", topology="chain", impl="kvbuffer_fast.verify",
                  io_bytes=io.buffered_verify(s, B, n, d), checks=checks, B=B, d=d, n=n, C=bench.cfg.verify_capacity,
                  design_bytes=io.design_model_bytes("buffered_verify", s, B, n=n))


def test_verify_buffered_tree(benchmark, bench, vbatch, tree_drafts):
    """kvbuffer_fast.verify of a binary tree of d nodes (same traffic as a chain of d)."""
    verify = _need("verify")
    s, rows, B, d, n = bench.cfg.shapes, check_rows(vbatch), vbatch, tree_drafts, bench.cfg.verify_fill
    hist, x, nd = _buffered_setup(bench, B, d, seed=5)
    par, buf = _binary_tree(B, d), hist.buffer
    truth = _tree_truth(bench, x, rows, hist, par[0])
    o, _ = verify(**x, buffer=buf, parents=par, num_drafts=nd)
    checks = require([bench.compare(f"verify[tree d={d}].o", o, rows, truth)])
    bench.measure(benchmark, lambda: verify(**x, buffer=buf, parents=par, num_drafts=nd, validate=False),
                  kind="verify", style="buffered", topology="tree", impl="kvbuffer_fast.verify",
                  io_bytes=io.buffered_verify(s, B, n, d), checks=checks, B=B, d=d, n=n, C=bench.cfg.verify_capacity,
                  design_bytes=io.design_model_bytes("buffered_verify", s, B, n=n))


def _per_draft_setup(bench, B: int, d: int, seed: int):
    state = bench.history(B, bench.cfg.verify_capacity, buffered=0).buffer.state
    x = bench.tokens(B, d, seed=seed)
    s = bench.cfg.shapes
    inter = torch.empty(B, d, s.HV, s.K, s.V, device=DEVICE, dtype=state.dtype)
    return state, x, inter


def test_verify_per_draft_state(benchmark, bench, vbatch, drafts):
    """The per-draft-state baseline (kvbuffer_fast.per_draft_state_verify): |S| read + d|S| written."""
    pd_verify = _need("per_draft_state_verify")
    s, rows, B, d = bench.cfg.shapes, check_rows(vbatch), vbatch, drafts
    state, x, inter = _per_draft_setup(bench, B, d, seed=3)
    truth = bench.truth(x, rows, initial_state=state)
    o, inter = pd_verify(**x, state=state, intermediate=inter)
    checks = require([bench.compare(f"per_draft_verify[d={d}].o", o, rows, truth),
                      bench.compare(f"per_draft_verify[d={d}].last_state", inter[:, d - 1], rows, truth, state=True)])
    bench.measure(benchmark, lambda: pd_verify(**x, state=state, intermediate=inter), kind="verify",
                  style="per_draft_state", topology="chain", impl="kvbuffer_fast.per_draft_state_verify",
                  io_bytes=io.per_draft_verify(s, B, d), checks=checks, B=B, d=d,
                  design_bytes=io.design_model_bytes("per_draft_verify", s, B, d=d))


def test_step_buffered_chain(benchmark, bench, vbatch, drafts):
    """verify + accept of all d drafts (buffered): the timed graph resets the lengths to n first, so
    every replay appends d entries to the same n (no fold)."""
    verify, accept = _need("verify"), _need("accept")
    materialize = _need("materialize_state")
    s, rows, B, d, n = bench.cfg.shapes, check_rows(vbatch), vbatch, drafts, bench.cfg.verify_fill
    hist, x, nd = _buffered_setup(bench, B, d, seed=7)
    par, buf = _chain(B, d), hist.buffer
    counts = torch.full((B,), d, device=DEVICE, dtype=torch.long)
    truth = bench.truth(x, rows, hist=hist)
    o, drafts_ = verify(**x, buffer=buf, parents=par, num_drafts=nd)
    accept(buf, drafts_, counts=counts)
    checks = require([bench.compare(f"step[chain d={d}].o", o, rows, truth),
                      bench.compare(f"step[chain d={d}].state_after_accept", materialize(buf), rows, truth,
                                    state=True)])

    def step():
        buf.lengths.fill_(n)
        _, dr = verify(**x, buffer=buf, parents=par, num_drafts=nd, validate=False)
        accept(buf, dr, counts=counts, validate=False)

    bench.measure(benchmark, step, kind="step", style="buffered", topology="chain",
                  impl="kvbuffer_fast.verify + accept", io_bytes=io.buffered_verify(s, B, n, d) + io.buffered_accept(s, B, d),
                  checks=checks, B=B, d=d, n=n, C=bench.cfg.verify_capacity)


def test_step_per_draft_state(benchmark, bench, vbatch, drafts):
    """verify + accept of all d drafts (per-draft-state: the last intermediate is copied over the state)."""
    pd_verify, pd_accept = _need("per_draft_state_verify"), _need("per_draft_state_accept")
    s, rows, B, d = bench.cfg.shapes, check_rows(vbatch), vbatch, drafts
    state, x, inter = _per_draft_setup(bench, B, d, seed=7)
    counts = torch.full((B,), d, device=DEVICE, dtype=torch.long)
    truth = bench.truth(x, rows, initial_state=state)
    o, inter = pd_verify(**x, state=state, intermediate=inter)
    pd_accept(state, inter, counts)
    checks = require([bench.compare(f"per_draft_step[d={d}].o", o, rows, truth),
                      bench.compare(f"per_draft_step[d={d}].state_after_accept", state, rows, truth, state=True)])

    def step():
        pd_verify(**x, state=state, intermediate=inter)
        pd_accept(state, inter, counts)

    bench.measure(benchmark, step, kind="step", style="per_draft_state", topology="chain",
                  impl="kvbuffer_fast.per_draft_state_verify + accept",
                  io_bytes=io.per_draft_verify(s, B, d) + io.per_draft_accept(s, B), checks=checks, B=B, d=d)


def test_verify_fla_tokens(benchmark, bench, vbatch, drafts):
    """flash-linear-attention 0.6.0 fused_recurrent_gated_delta_rule over the same d tokens in one call
    (reads the state, writes only the final one: it cannot roll back a rejected draft).  The
    comparison the speculative issue asks for: buffered verify of d tokens vs this."""
    mod = pytest.importorskip("fla.ops.gated_delta_rule",
                              reason="flash-linear-attention (fla-core 0.6.0) is not importable")
    fused = mod.fused_recurrent_gated_delta_rule
    s, rows, B, d = bench.cfg.shapes, check_rows(vbatch), vbatch, drafts
    state, x, _ = _per_draft_setup(bench, B, d, seed=3)
    truth = bench.truth(x, rows, initial_state=state)

    def run():
        # keywords only (fla's positional order differs between its functions); state [B, HV, K, V]
        return fused(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=s.K ** -0.5, initial_state=state,
                     output_final_state=True, use_qk_l2norm_in_kernel=False)

    o, S = run()
    checks = require([bench.compare(f"fla.fused_recurrent[d={d}].o", o, rows, truth),
                      bench.compare(f"fla.fused_recurrent[d={d}].state", S, rows, truth, state=True)])
    import fla

    bench.measure(benchmark, run, kind="verify", style="fla", topology="chain",
                  impl=f"fla {getattr(fla, '__version__', '?')} fused_recurrent_gated_delta_rule over d tokens",
                  io_bytes=io.recurrent_step(s, B), checks=checks, B=B, d=d,
                  design_bytes=io.design_model_bytes("fla", s, B))
