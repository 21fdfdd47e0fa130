"""kvbuffer_fast.verify / accept against the float64 oracle, and the per-draft-state baseline against the
recurrence.

Two kinds of checks, both judged by the error table (``compare``):
* the serving loop (``properties.check_verify_accept``): every verified node's output against the float64
  recurrence along its root-to-node path; after ``accept``, decoding and flushing (kvbuffer_fast too)
  against the recurrence over the history plus the accepted path;
* the operations themselves against ``kvbuffer_ref.verify`` / ``accept`` in float64 on the same buffer:
  o, the Drafts (u, G; keys exactly) and every buffer field after accept (the fold past the capacity
  included), with kvbuffer_ref in float32 as the baseline.
On a CPU they run through the Triton interpreter, in float32 (and float16) with small shapes.  Every
library output is NaN-poisoned (``KVBUFFER_POISON=1``) and so is all buffer memory a kernel must not
read (slots past each request's length, the state of requests in direct mode).
"""

import dataclasses
import importlib
import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.launch import AcceptConfig, VerifyConfig, config_for, key_of  # noqa: E402

from kvbuffer.validate import cases, properties as P, strategies as kst, tolerances  # noqa: E402

from kvbuffer_fast.baselines import per_draft_state_accept, per_draft_state_verify  # noqa: E402

from tests.pool.launches import NoLaunch  # noqa: E402

from .fast_adapter import Poisoned, assert_all as _assert_all  # noqa: E402
from .strategies_local import Calling, Drawn, counted, fast_drawn, informative  # noqa: E402

# The accept fold computes exp(G_end - G_j) for every draft j up to the accepted node and selects 0 for those
# it does not fold (on another branch, or kept in the buffer); with strongly decaying gates (the 'underflow'
# regime, -104..-120 per token) such a G_j lies far below G_end and the discarded exp overflows to inf.  The
# select drops it (inf is never multiplied), so on a GPU nothing happens; the Triton interpreter evaluates
# tl.exp with numpy, which warns.  A real overflow would reach an output, and non-finite outputs never pass.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
Case, compare = cases.Case, tolerances.compare
fast_verify = importlib.import_module("kvbuffer_fast.verify")  # the module (kvbuffer_fast.verify is the function)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(max_H=2, max_group=2, dims=(3, 8, 16))
# the interpreter is slow: the ci profile runs 5 examples per test here; thorough keeps its own count
FEW = settings(max_examples=5) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else (lambda f: f)
BF16_CUDA = pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic")
TREE = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8]  # several branches, a second root, ten nodes (two row blocks of 16)




# ------------------------------------------------------------------ the serving loop, drawn cases
@st.composite
def _setup(draw, *, chain: bool, max_drafts: int = 6, budget: int = 16):
    """Capacities past one 16-row tile, kvbuffer_fast sizes and every region of ``strategies_local.drawn``."""
    C = draw(st.sampled_from([4, 8, 17, 1, 2]), label="capacity")
    B = draw(st.integers(1, 5), label="B")
    parents, counts = draw(kst.draft_batch(B, max_drafts=max_drafts, chain=chain), label="drafts")
    D = len(parents[0])
    hist = draw(st.one_of(st.just(C), st.integers(0, 20)), label="history")
    after = draw(st.integers(0, 2), label="after")
    d = draw(fast_drawn(B=B, T=hist + D + after, steps=lambda d: 2 + after, budget=budget), label="drawn")
    lengths = draw(st.lists(st.integers(0, min(hist, C)), min_size=B, max_size=B), label="lengths")
    nodes = draw(kst.acceptances(counts), label="nodes")
    return dict(case=d, capacity=C, history=hist, lengths=lengths, parents=parents, num_drafts=counts,
                nodes=nodes, after=after)


def _informative(s):
    """The example's truth over the history and the drafts is neither zero nor constant (else ``assume``d away)."""
    d = s["case"]
    informative(d.inputs(), tokens=slice(s["history"], d.T))


@FEW
@counted()
@given(s=_setup(chain=True))
def test_chain_verify_accept_counts_match_oracle(s):
    """Chains, ragged draft counts and buffer lengths, accept by counts (folds when past C), then decode."""
    _informative(s)
    impl = Calling(Poisoned, s["case"])
    _assert_all(P.check_verify_accept(impl, dtype=torch.float32, device=DEVICE, use_counts=True, **s))


@FEW
@counted()
@given(s=_setup(chain=False, max_drafts=8))
def test_tree_verify_accept_nodes_match_oracle(s):
    """Trees: every node == the recurrence along its path; accepting a node appends exactly its path."""
    _informative(s)
    _assert_all(P.check_verify_accept(Calling(Poisoned, s["case"]), dtype=torch.float32, device=DEVICE, **s))


@FEW
@counted()
@given(s=_setup(chain=False, max_drafts=4, budget=8))
def test_tree_verify_accept_fp16_match_oracle(s):
    """The same in float16 (q, k, v half; g, beta float32): the float16 row of the table.  q of unit norm
    and v not scaled up: float16 tops out at 65504, and q of norm 100 times v of 1e4 overflows it."""
    s = dict(s, case=dataclasses.replace(s["case"], q_norm=False, v_decades=min(s["case"].v_decades, 0.0)))
    _informative(s)
    _assert_all(P.check_verify_accept(Calling(Poisoned, s["case"]), dtype=torch.float16, device=DEVICE, **s))


# ------------------------------------------------------------------ the operations against kvbuffer_ref
def _buffers(case: Case, dtype, *, history: int, lengths, capacity: int, key_dtype=None):
    """The history's ragged buffer in float64 (for the oracle) and as kvbuffer_fast holds it (u / G / state
    float32, keys in ``key_dtype``, default the inputs' dtype), its unused memory NaN-poisoned."""
    x = case.inputs(dtype, DEVICE)
    x64 = {n: t.cpu().double() for n, t in x.items()}
    buf64 = P.ragged_buffer({n: t[:, :history] for n, t in x64.items()}, lengths, capacity, compute=torch.float32)
    buf = P.poison_unused_(P.buffer_to(buf64, dtype=torch.float32, device=DEVICE, key_dtype=key_dtype or dtype))
    return x, x64, buf64, buf


def _folded(fast_out, ref64_out, ref32_out, res: list, capacity: int):
    """verify(fold=...)'s buffers (fast, float64 oracle, float32 baseline), checked against each other: the
    lengths and has_state exactly, the state each request owns by the error table."""
    buf, buf64, buf32 = fast_out[2], ref64_out[2], ref32_out[2]
    assert torch.equal(buf.lengths.cpu(), buf64.lengths), "verify(fold): lengths"
    assert torch.equal(buf.has_state.cpu(), buf64.has_state), "verify(fold): has_state"
    if bool(buf64.has_state.any()):
        res.append(compare(P.owned_state(buf).cpu(), P.owned_state(buf64), P.owned_state(buf32),
                           name="verify(fold).state", head_axis=1))
    return buf, buf64, buf32


def _check_against_reference(case: Case, dtype, *, history, lengths, capacity, parents, num_drafts, nodes,
                             config=None, key_dtype=None, fold=False, with_state=True, accept_fold=True):
    """fast.verify then fast.accept against kvbuffer_ref's in float64 (kvbuffer_ref in float32 the baseline).
    ``fold``: verify's (False, True or a list of B bools); with a fold, the verified buffer is checked too,
    the drafts' padding rows are NaN, and accept runs on the folded buffers.  ``with_state=False``: the
    buffer has no state storage (every request in direct mode).  ``accept_fold``: accept's ``fold``."""
    x, x64, buf64, buf = _buffers(case, dtype, history=history, lengths=lengths, capacity=capacity,
                                  key_dtype=key_dtype)
    if not with_state:
        assert not bool(buf64.has_state.any()), "with_state=False needs every history buffered"
        buf64, buf = buf64.replace(state=None), buf.replace(state=None)
    drafts_in = {n: t[:, history:] for n, t in x.items()}
    par = torch.tensor(parents, device=DEVICE)
    nd = torch.tensor(num_drafts, device=DEVICE)
    kw = {}
    if fold is not False:
        drafts_in = P.poison_padding(drafts_in, num_drafts)
        kw = dict(fold=fold if isinstance(fold, bool) else torch.tensor(fold, device=DEVICE))
    kw_cpu = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    out = fast.verify(**drafts_in, buffer=buf, parents=par, num_drafts=nd, config=config, **kw)
    o, drafts = out[:2]
    out64 = ref.verify(**{n: t[:, history:] for n, t in x64.items()}, buffer=buf64, parents=par.cpu(),
                       num_drafts=nd.cpu(), **kw_cpu)
    o64, d64 = out64[:2]
    # the baseline: kvbuffer_ref's same calls on a float32 copy of the buffer (the own form)
    buf32 = P.buffer_to(buf64, dtype=torch.float32)
    out32 = ref.verify(**{n: t.cpu().float() for n, t in drafts_in.items()}, buffer=buf32, parents=par.cpu(),
                       num_drafts=nd.cpu(), **kw_cpu)
    o32, d32 = out32[:2]
    base_o, base_u, accepted = [o32.to(o.dtype)], [d32.u], [d32]
    if fold is not False:
        # o and the drafts' u are computed from S0 and the buffer, as verify without a fold does: the float32
        # reference on the unfolded buffer is a correct form of them too (each slice takes the worst form)
        o32n, d32n = ref.verify(**{n: t.cpu().float() for n, t in drafts_in.items()}, buffer=buf32,
                                parents=par.cpu(), num_drafts=nd.cpu())
        base_o.append(o32n.to(o.dtype))
        base_u.append(d32n.u)
        accepted.append(dataclasses.replace(d32, u=d32n.u))
    valid = (torch.arange(par.shape[1])[None, :] < nd.cpu()[:, None])[:, :, None, None]
    vg = valid if case.channel_gate else valid[..., 0]
    res = [compare(o.cpu(), o64, base_o, name="verify.o", valid=valid),
           compare(drafts.u.cpu(), d64.u, base_u, name="verify.drafts.u", valid=valid),
           compare(drafts.G.cpu(), d64.G, d32.G, name="verify.drafts.G", valid=vg)]
    if fold is not False:
        buf, buf64, buf32 = _folded(out, out64, out32, res, capacity)
    assert torch.isfinite(o).all() and not o[~valid.expand_as(o).to(o.device)].any(), "padding rows must be 0"
    vk = valid.expand(drafts.k.shape).to(DEVICE)
    assert torch.equal(drafts.k[vk], drafts_in["k"][vk]), "Drafts.k must be the drafts' keys"
    node_t = torch.tensor(nodes, device=DEVICE)
    # accept: 3 programs per request (a folding request's tiles split over them, the ticket elects the last) with
    # the early-loads configs, 1 (no ticket) with the late ones
    acfg = None if config is None else AcceptConfig(BV=16, KB=16, CH=16,
                                                    programs=3 * buf.batch if config.early else 1)
    out = Poisoned.accept(buf, drafts, nodes=node_t, config=acfg, fold=accept_fold)
    ref64 = ref.accept(buf64, d64, nodes=node_t.cpu(), fold=accept_fold)
    ref32 = [ref.accept(buf32, d, nodes=node_t.cpu(), fold=accept_fold) for d in accepted]
    assert torch.equal(out.lengths.cpu(), ref64.lengths) and torch.equal(out.has_state.cpu(), ref64.has_state)
    kept = torch.arange(capacity)[None, :] < ref64.lengths[:, None]  # the entries in use after accept
    assert torch.equal(out.k.cpu()[kept].float(), ref64.k[kept].to(out.k.dtype).float()), "accept: keys"
    res += [compare(out.u.cpu(), ref64.u, [r.u for r in ref32], name="accept.u", valid=kept[:, :, None, None]),
            compare(out.G.cpu(), ref64.G, [r.G for r in ref32], name="accept.G",
                    valid=kept[:, :, None] if out.G.dim() == 3 else kept[:, :, None, None])]
    if out.state is not None and bool(ref64.has_state.any()):
        res.append(compare(P.owned_state(out).cpu(), P.owned_state(ref64), [P.owned_state(r) for r in ref32],
                           name="accept.state", head_axis=1))
    _assert_all(res)


# config None = the launch table's choice; the others pick rows the table takes elsewhere (the early loads
# off, 16-row state blocks with 4 stages), small V-tiles (several programs per value head, a partial last
# one) and phase 1 on a persistent grid with ready flags (prep_per_sm: one program per SM in the interpreter,
# so one program takes every (request, q/k head) pair).  Per-channel gates have no 16-row blocks in the
# table, and their phase 1 is slow in the interpreter.
CONFIGS = {
    "scalar-table": (False, None),
    "scalar-early-KB16-BV16": (False, VerifyConfig(BV=16, KB=16, NS=4, early=True)),
    "scalar-late-KB32-BV16": (False, VerifyConfig(BV=16, KB=32, NS=3, early=False)),
    "scalar-ready-KB16-BV16": (False, VerifyConfig(BV=16, KB=16, NS=4, early=False, prep_per_sm=1)),
    "channel-table": (True, None),
    "channel-late-KB32-BV16": (True, VerifyConfig(BV=16, KB=32, NS=3, early=False)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_accept_match_reference(name):
    """A chain (ten drafts), a ragged tree and a full tree over buffers holding 3 / 0 / 2 of C = 4 entries
    (request 0 in direct mode: its whole history buffered); two value heads per q/k head (two q/k heads
    with the table's launch), K = 40 or 24 (partial key chunks and state blocks), V = 24 (two partial
    V-tiles at BV = 16); accept folds requests 0 and 2 (past C)."""
    channel, config = CONFIGS[name]
    H, K = (2, 40) if name == "scalar-table" else (1, 24)
    case = Case(B=3, T=3 + 10, H=H, HV=2 * H, K=K, V=24, channel_gate=channel, gate="mixed", beta="mixed",
                seed=11)
    _check_against_reference(case, torch.float32, history=3, lengths=[3, 0, 2], capacity=4,
                             parents=[list(range(-1, 9)), TREE, TREE], num_drafts=[10, 7, 10], nodes=[9, 5, 9],
                             config=config)


def test_ready_flags_same_bits_and_left_zero():
    """Phase 1 on a persistent grid with ready flags (``prep_per_sm``) does each (request, q/k head) pair's
    arithmetic as one program per pair does: o and the Drafts equal bit for bit those of the launch without
    flags, with and without a fold, and every flag is 0 again after the launch (the next launch's phase 2
    must not see one).  On a GPU the requests are many, so phase 2 runs beside phase 1 (with PDL)."""
    B = 64 if DEVICE == "cuda" else 3
    case = Case(B=B, T=4 + 5, H=2, HV=4, K=32, V=32, gate="mixed", beta="mixed", seed=3)
    x, _, _, buf = _buffers(case, torch.float32, history=4, lengths=[i % 5 for i in range(B)], capacity=8)
    drafts_in = {n: t[:, 4:] for n, t in x.items()}
    flags = fast_verify.int_scratch("verify_ready", B * case.H, DEVICE)
    for fold in (False, True):
        outs = []
        for cfg in (VerifyConfig(BV=16, prep_per_sm=0), VerifyConfig(BV=16, prep_per_sm=1)):
            b = buf.replace(**{f: getattr(buf, f).clone() for f in ("k", "u", "G", "state", "lengths", "has_state")})
            o, dr = fast.verify(**drafts_in, buffer=b, config=cfg, fold=fold)[:2]
            outs.append((o, dr.u, dr.G, dr.k, b.state, b.lengths))
            assert int(flags.count_nonzero()) == 0, f"prep_per_sm={cfg.prep_per_sm}, fold={fold}: flags left set"
        for name, a, c in zip(("o", "u", "G", "k", "state", "lengths"), *outs):
            assert torch.equal(a, c), f"fold={fold}: {name} differs with ready flags"


# ------------------------------------------------------------------ verify(fold=...): the buffer folded in phase 2
# scalar and per-channel gates, 16- and 32-row state blocks, the early loads on and off, with fold=True or with
# per-request flags (a request left unfolded keeps its entries, and accept folds request 0's past C); the drawn
# property below covers the launch table's rows
FOLD_CONFIGS = [("scalar-early-KB16-BV16", [False, True, True]), ("channel-late-KB32-BV16", True),
                ("scalar-ready-KB16-BV16", [True, False, True])]


@pytest.mark.parametrize("name,fold", FOLD_CONFIGS, ids=[f"{n}-{'all' if f is True else 'flags'}"
                                                         for n, f in FOLD_CONFIGS])
def test_fold_verify_accept_match_reference(name, fold):
    """verify(fold=...) then accept, against kvbuffer_ref's (flush of the folding requests, then verify): the
    buffers of 3 / 0 / 2 of C = 4 entries as in test_verify_accept_match_reference (request 0 in direct mode:
    its fold makes it own a state), the state folded block by block in phase 2 (16- and 32-row blocks, two
    V-tiles), the buffer emptied, the drafts' G relative to it; accept then appends on the emptied buffers
    (request 0's chain of ten folds past C again)."""
    channel, config = CONFIGS[name]
    case = Case(B=3, T=3 + 10, H=1, HV=2, K=24, V=24, channel_gate=channel, gate="mixed", beta="mixed", seed=11)
    _check_against_reference(case, torch.float32, history=3, lengths=[3, 0, 2], capacity=4,
                             parents=[list(range(-1, 9)), TREE, TREE], num_drafts=[10, 7, 10], nodes=[9, 5, 9],
                             config=config, fold=fold)


@pytest.mark.parametrize("fold", [True, [True, False, True]], ids=["all", "flags"])
def test_accept_without_fold_after_a_folding_verify(fold, monkeypatch):
    """accept(fold=False) after verify(fold=...) emptied the buffers that could pass C (as an engine folding
    in verify runs a round): no fold launch (the kernel replaced by one that fails when launched), and the
    same buffer as kvbuffer_ref's accept; request 1 (no fold flag, 0 entries) and the others get paths of
    4, 3 and 3 entries into C = 4."""
    monkeypatch.setattr(importlib.import_module("kvbuffer_fast.accept"), "_accept_fold_kernel",
                        NoLaunch("accept(fold=False) makes no fold launch"))
    case = Case(B=3, T=3 + 10, H=1, HV=2, K=24, V=24, gate="mixed", beta="mixed", seed=11)
    _check_against_reference(case, torch.float32, history=3, lengths=[3, 0, 2], capacity=4,
                             parents=[list(range(-1, 9)), TREE, TREE], num_drafts=[10, 7, 10], nodes=[3, 5, 4],
                             config=CONFIGS["scalar-early-KB16-BV16"][1], fold=fold, accept_fold=False)


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_fold_without_state_storage(channel):
    """A buffer with no state storage (both requests' whole history buffered, C of C): verify(fold=True)
    allocates a zeroed state as flush does and returns a new buffer holding it; both requests own a state."""
    case = Case(B=2, T=4 + 3, H=1, HV=2, K=8, V=8, channel_gate=channel, gate="mild", beta="mixed", seed=5)
    _check_against_reference(case, torch.float32, history=4, lengths=[4, 4], capacity=4,
                             parents=[[-1, 0, 1], [-1, 0, 0]], num_drafts=[3, 2], nodes=[2, 1], fold=True,
                             with_state=False)


@st.composite
def _fold_setup(draw):
    """Buffers empty, partial and full (C past one 16-row tile too), ragged chains or trees, scalar or
    per-channel gates, fold=True or per-request flags, one accepted node per request."""
    C = draw(st.sampled_from([4, 8, 17, 1]), label="capacity")
    B = draw(st.integers(1, 4), label="B")
    chain = draw(st.booleans(), label="chain")
    parents, counts = draw(kst.draft_batch(B, max_drafts=6, chain=chain), label="drafts")
    hist = draw(st.one_of(st.just(C), st.integers(0, 12)), label="history")
    d = draw(fast_drawn(B=B, T=hist + len(parents[0]), steps=lambda d: 2, budget=12, layouts=("contiguous",),
                        scale=False), label="drawn")
    lengths = draw(st.lists(st.integers(0, min(hist, C)), min_size=B, max_size=B), label="lengths")
    fold = draw(st.one_of(st.just(True), st.lists(st.booleans(), min_size=B, max_size=B)), label="fold")
    return dict(case=d, capacity=C, history=hist, lengths=lengths, parents=parents, num_drafts=counts,
                nodes=draw(kst.acceptances(counts), label="nodes"), fold=fold)


@FEW
@counted()
@given(s=_fold_setup())
def test_fold_verify_accept_drawn_match_reference(s):
    """Chains and trees: fast verify(fold=...) (o, the Drafts, the folded buffer) and accept after it ==
    kvbuffer_ref's."""
    informative(s["case"].inputs(), tokens=slice(s["history"], s["case"].T))
    _check_against_reference(s.pop("case"), torch.float32, **s)


@pytest.mark.parametrize("dtype,key_dtype", [
    (torch.float16, None), (torch.float16, torch.float32),
    pytest.param(torch.bfloat16, None, marks=BF16_CUDA)], ids=["fp16", "fp16-fp32-keys", "bf16"])
def test_16bit_inputs(dtype, key_dtype):
    """16-bit q / k: phase 1's scores as 16-bit MMAs (keys cached in the same dtype) or fp32 products
    (fp32 keys), phase 2's X S0 with the state split in two TF32 pieces; the outputs within the 16-bit row
    of the table, the Drafts and the buffer after accept within the fp32 one."""
    case = Case(B=3, T=3 + 10, H=2, HV=4, K=40, V=24, gate="mild", beta="mixed", seed=14)
    _check_against_reference(case, dtype, history=3, lengths=[3, 0, 2], capacity=4,
                             parents=[list(range(-1, 9)), TREE, TREE], num_drafts=[10, 7, 10], nodes=[9, 5, 9],
                             key_dtype=key_dtype)


def test_deep_chain_strong_coupling():
    """Phase 1's triangular solve on a chain of 10 drafts where every power of the coupling matters: K = 4
    (random unit keys overlap strongly), beta = 1 and no decay, so the terms up to A^9 of (I + A)^-1 are
    far above the budget."""
    case = Case(B=2, T=3 + 10 + 2, H=1, HV=2, K=4, V=8, gate="zero", beta="one", seed=21)
    _assert_all(P.check_verify_accept(
        Poisoned, case, torch.float32, capacity=4, history=3, lengths=[3, 1],
        parents=[list(range(-1, 9)), list(range(-1, 9))], num_drafts=[10, 9], nodes=[9, 4], after=2,
        device=DEVICE))


# ------------------------------------------------------------------ the decays in the buffer's frame
# verify's innovations are folded later (accept past C, flush) with the float32 G the Drafts store, so the
# decays they are solved with must be differences of those same G: at |G| of a few hundred each G carries
# ~1e-5 of rounding, which the fold undoes only when verify saw it too.  Decays taken from the drafts' path
# sums instead (more accurate alone) left the state after accept + flush 4.35x and 4.81x past the oracle's
# float32 forms in the two cases below (found by the chain property and by `kvbuffer validate --seed 1`).
def test_chain_accept_state_large_gates():
    """A chain over a buffer holding 4 of C = 8 entries, K = 3 and beta = 1 (the solve couples strongly), a
    draft gate of -118 then -107 (G down to -357 from the buffer's start); accepting 4 drafts fills the buffer,
    flush folds it (test_chain_verify_accept_counts_match_oracle's draw)."""
    d = Drawn(Case(B=2, T=14, H=3, HV=3, K=3, V=3, gate="mixed", beta="one", seed=2_147_483_647), q_norm=True,
              v_decades=-3.0)
    _assert_all(P.check_verify_accept(Calling(Poisoned, d), d, torch.float32, capacity=8, history=8, lengths=[0, 4],
                                      parents=[list(range(-1, 5))] * 2, num_drafts=[0, 6], nodes=[-1, 3], after=0,
                                      device=DEVICE, use_counts=True))


def test_channel_reset_accept_state_fp16():
    """Per-channel gates with a reset (-inf, taken as -200) in the buffered history, float16 inputs, a full
    chain of 4 drafts by the defaults; accepting 3 of them folds the buffer's 3 entries and rebases the
    drafts' G by one subtraction, then flush folds them (`kvbuffer validate --impl fast --ops verify_chain
    --dtype float16 --seed 1`'s draw)."""
    case = Case(B=1, T=8, H=1, HV=2, K=1, V=2, channel_gate=True, gate="reset", beta="mixed", seed=140, norm="any",
                v_scale=0.05)
    _assert_all(P.check_verify_accept(Poisoned, case, torch.float16, capacity=4, history=4, lengths=[3],
                                      parents=[[-1, 0, 1, 2]], num_drafts=[4], nodes=[2], after=0, device=DEVICE,
                                      poison=True, index_dtype="int32", scalar=True, defaults=True))


def test_zero_drafts_and_empty_buffers():
    """Requests with no drafts, an empty buffer and no state storage at all: o = 0 on padding rows, accept of
    nothing leaves the buffer as it was."""
    case = Case(B=2, T=4, H=1, HV=2, K=8, V=8, seed=2)
    x = case.inputs(torch.float32, DEVICE)
    buf = ref.KVBuffer.empty(2, 1, 2, 8, 8, 4, dtype=torch.float32, with_state=False, device=DEVICE)
    o, drafts = fast.verify(**x, buffer=buf, num_drafts=torch.tensor([0, 4], device=DEVICE))
    o64, _ = ref.verify(**{n: t.cpu().double() for n, t in x.items()},
                        buffer=P.buffer_to(buf, dtype=torch.float64), num_drafts=torch.tensor([0, 4]))
    assert (o[0] == 0).all()
    # the baseline: kvbuffer_ref's same call on a float32 copy of the buffer (its own form), and request 1's
    # chain of 4 drafts from no state as the correct forms compute it (the recurrence, the chunkwise form)
    own, _ = ref.verify(**{n: t.cpu() for n, t in x.items()}, buffer=P.buffer_to(buf, dtype=torch.float32),
                        num_drafts=torch.tensor([0, 4]))
    _, (ob, _) = P.truth_and_baseline(x, chunk=4)
    valid = (torch.arange(4)[None, :] < torch.tensor([0, 4])[:, None])[:, :, None, None]
    _assert_all([compare(o.cpu(), o64, [own, ob.cpu()], name="verify.o", valid=valid)])
    assert fast.accept(buf, drafts, counts=torch.tensor([0, 0], device=DEVICE)) is buf
    assert buf.lengths.tolist() == [0, 0]


# ------------------------------------------------------------------ the defaults, errors and configs
def test_default_drafts_belong_to_the_call():
    """The default parents / num_drafts in the returned Drafts are the call's own: editing them changes
    neither the next call's answer nor another call's Drafts."""
    case = Case(B=2, T=4, H=1, HV=1, K=8, V=8, seed=3)
    x = case.inputs(torch.float32, DEVICE)
    buf = ref.KVBuffer.empty(2, 1, 1, 8, 8, 4, dtype=torch.float32, device=DEVICE)
    o1, d1 = fast.verify(**x, buffer=buf)
    o2, d2 = fast.verify(**x, buffer=buf)
    d1.parents.fill_(-1)
    d1.num_drafts.zero_()
    o3, d3 = fast.verify(**x, buffer=buf)
    assert torch.equal(o1, o3) and torch.equal(o2, o3)
    chain = torch.arange(-1, 3, device=DEVICE).expand(2, 4)
    for d in (d2, d3):
        assert torch.equal(d.parents, chain) and d.num_drafts.tolist() == [4, 4]
    assert d2.parents.data_ptr() != d3.parents.data_ptr()
    rows = [fast_verify._default_drafts(None, None, 2, 4, x["q"]) for _ in range(2 * fast_verify._ROWS)]
    assert len({p.data_ptr() for p, _ in rows}) == len(rows), "every default call gets memory of its own"
    assert all(torch.equal(p, chain) and n.tolist() == [4, 4] for p, n in rows)


def test_accept_errors():
    case = Case(B=1, T=4, H=1, HV=1, K=4, V=4, seed=2)
    x = case.inputs(torch.float32, DEVICE)
    buf = ref.KVBuffer.empty(1, 1, 1, 4, 4, 2, dtype=torch.float32, with_state=False, device=DEVICE)
    _, drafts = fast.verify(**x, buffer=buf, parents=torch.tensor([[-1, 0, 0, 1]], device=DEVICE))
    with pytest.raises(ValueError, match="exactly one"):
        fast.accept(buf, drafts)
    with pytest.raises(ValueError, match="tree"):
        fast.accept(buf, drafts, counts=2)
    with pytest.raises(ValueError, match="no state storage"):
        fast.accept(buf, drafts, nodes=3)  # path 0, 1, 3: three entries past C = 2
    assert buf.lengths.tolist() == [0], "a refused accept must leave the buffer as it was"
    assert fast.accept(buf, drafts, nodes=2) is buf and buf.lengths.tolist() == [2]
    # fold=False: the caller's word that nothing passes C, checked; on a buffer with state storage too
    buf = ref.KVBuffer.empty(1, 1, 1, 4, 4, 2, dtype=torch.float32, device=DEVICE)
    _, drafts = fast.verify(**x, buffer=buf, parents=torch.tensor([[-1, 0, 0, 1]], device=DEVICE))
    state = buf.state.clone()
    for impl in (fast, ref):
        with pytest.raises(ValueError, match=r"fold: False, but request 0 has 0 entries and gets 3 more.*C=2"):
            impl.accept(buf, drafts, nodes=3, fold=False)
        with pytest.raises(TypeError, match="fold: expected True or False, got str"):
            impl.accept(buf, drafts, nodes=1, fold="no")
    assert buf.lengths.tolist() == [0] and torch.equal(buf.state, state), "a refused accept changes nothing"


def test_bad_config_type():
    case = Case(B=1, T=2, H=1, HV=1, K=4, V=4, seed=2)
    x = case.inputs(torch.float32, DEVICE)
    buf = ref.KVBuffer.empty(1, 1, 1, 4, 4, 2, dtype=torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="VerifyConfig"):
        fast.verify(**x, buffer=buf, config=AcceptConfig())
    with pytest.raises(TypeError, match="VerifyConfig"):
        fast.verify(**x, buffer=buf, config=dict(BV=16))
    _, drafts = fast.verify(**x, buffer=buf)
    with pytest.raises(TypeError, match="AcceptConfig"):
        fast.accept(buf, drafts, counts=1, config=VerifyConfig())


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("B,C,dtype,channel,state,want", [
    # the split X S0, few programs, C <= 16; phase 1 at its register cap at every batch
    (64, 16, BF16, False, F32, dict(early=True, KB=16, NS=4, prep_maxnreg=128)),
    (64, 32, BF16, False, F32, dict(early=True, KB=32, NS=3)),   # more buffer rows: 32-row blocks
    (128, 16, BF16, False, F32, dict(early=True, KB=32, NS=3, prep_maxnreg=128)),  # early at every batch
    (128, 16, F32, False, F32, dict(early=False, KB=32, NS=3)),  # tf32x3 rows above 2048 programs
    (64, 16, F32, True, F32, dict(early=True, KB=32, NS=3)),     # per-channel gates at <= 2048 programs
    (64, 16, BF16, False, BF16, dict(early=True, KB=32, NS=3, prep_maxnreg=128)),  # a 16-bit state, few programs
    (128, 16, BF16, False, BF16, dict(KB=32, NS=3, prep_maxnreg=128)),
])
def test_launch_table_rows(B, C, dtype, channel, state, want):
    """The verify table at Qwen3-Next heads (HV = 32, V = 128: one phase-2 program per 128 columns) on sm_90,
    keyed on the state's dtype too."""
    key = key_of(torch.empty(0), C=C, B=B, HV=32, V=128, channel=channel, dtype=dtype, state=state)
    cfg = config_for("verify", dataclasses.replace(key, capability=(9, 0)))
    assert {f: getattr(cfg, f) for f in want} == want


@pytest.mark.parametrize("state", [None, torch.float32, torch.bfloat16, torch.float16])
def test_launch_key_carries_the_state_dtype(state):
    """verify's launch key holds S0's storage dtype (float32 without storage), so the table can choose a
    16-bit state's launch, for a buffer and a pool alike (``_launch_settings`` passes the S0 storage)."""
    q = torch.empty(2, 3, 1, 16, dtype=torch.bfloat16)
    x = dict(q=q, k=q, v=torch.empty(2, 3, 2, 16), g=torch.empty(2, 3, 2), beta=torch.empty(2, 3, 2))
    buf = ref.KVBuffer.empty(2, 1, 2, 16, 16, 4, dtype=torch.float32, with_state=state is not None,
                             state_dtype=state)
    key = fast_verify._key(q, q, fast_verify.check_tokens(**x), buf, buf.state)
    assert key.state == (state or torch.float32) and key.dtype == torch.bfloat16


# ------------------------------------------------------------------ phase 2's split X S0
@triton.jit
def _tf32_round_kernel(s_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr + o, fast_verify._tf32_round(tl.load(s_ptr + o)))


def test_tf32_rounding_of_the_split():
    """The hi piece of phase 2's split X S0, over random fp32 values of every scale (and 0, signs, values at
    a rounding tie): a TF32 value (13 low bits clear), hi + (s - hi) == s exactly, |s - hi| <= 2^-11 |s|
    (round to nearest, ties away from zero)."""
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(1024, generator=gen) * torch.exp2(torch.randint(-60, 60, (1024,), generator=gen).float())
    s[:4] = torch.tensor([0.0, -0.0, 1.0 + 2.0 ** -11, -(1.0 + 3 * 2.0 ** -11)])
    hi = torch.full((1024,), float("nan"), device=DEVICE)
    _tf32_round_kernel[(1,)](s.to(DEVICE), hi, N=1024)
    hi = hi.cpu()
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all(), "hi must be a TF32 value"
    assert torch.equal(hi + (s - hi), s) and torch.equal((s - hi) + hi, s)
    assert ((s - hi).abs() <= 2.0 ** -11 * s.abs()).all(), "hi must be the nearest TF32 value"
    assert torch.equal(hi[2:4], torch.tensor([1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -9)])), "ties round away from 0"


# ------------------------------------------------------------------ the per-draft-state baseline
@FEW
@given(case=kst.cases(max_T=6, **SMALL), data=st.data())
def test_per_draft_state_baseline_matches_recurrence(case, data):
    x = case.inputs(torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(case.seed)
    S0 = (torch.randn(case.B, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.5)
    state = S0.float().to(DEVICE)
    keep = state.clone()
    o, inter = per_draft_state_verify(**x, state=state)
    assert torch.equal(state, keep), "per_draft_state_verify must not modify the state"
    (o64, _), base = P.truth_and_baseline(x, state)
    r = compare(o.cpu(), o64, base[0], name="per_draft_state.o")
    assert r.passed, str(r)
    for t in range(case.T):  # intermediate t == the state after token t
        xt = {n: v[:, : t + 1] for n, v in x.items()}
        (_, S64), bt = P.truth_and_baseline(xt, state)
        r = compare(inter[:, t].cpu(), S64, bt[1], name=f"intermediate[{t}]", head_axis=1)
        assert r.passed, str(r)
    counts = torch.tensor(data.draw(st.lists(st.integers(0, case.T), min_size=case.B, max_size=case.B)),
                          device=DEVICE)
    per_draft_state_accept(state, inter, counts)
    for b in range(case.B):
        want = keep[b] if int(counts[b]) == 0 else inter[b, int(counts[b]) - 1]
        assert torch.equal(state[b], want)


@FEW
@given(case=kst.cases(max_T=1, **SMALL), data=st.data())
def test_per_draft_state_baseline_tree_matches_recurrence(case, data):
    """A draft tree: every node's output and intermediate state are the recurrence over its root-to-node
    path from the state (the kernel reads a parent's tile back unless the parent is the node before it);
    accepting node n copies intermediate[n]."""
    par = [data.draw(kst.draft_tree(max_nodes=7, max_depth=4, max_branch=3)) for _ in range(case.B)]
    D = max(map(len, par))
    par = [p + [-1] * (D - len(p)) for p in par]  # extra roots: a tree is any list of earlier parents
    case = dataclasses.replace(case, T=D)
    x = case.inputs(torch.float32, DEVICE)
    parents = torch.tensor(par, device=DEVICE)
    gen = torch.Generator().manual_seed(case.seed)
    state = (torch.randn(case.B, case.HV, case.K, case.V, generator=gen) * 0.5).to(DEVICE)
    keep = state.clone()
    o = torch.full((case.B, D, case.HV, case.V), float("nan"), device=DEVICE)
    inter = torch.full((case.B, D, case.HV, case.K, case.V), float("nan"), device=DEVICE)
    o_, inter_ = per_draft_state_verify(**x, state=state, parents=parents, intermediate=inter)
    o.copy_(o_)
    assert inter_ is inter and torch.equal(state, keep), "per_draft_state_verify must not modify the state"
    for b in range(case.B):
        for node in range(D):
            path = ref.path_to(parents[b].cpu(), node)
            xb = {n: v[b:b + 1, path] for n, v in x.items()}
            (o64, S64), base = P.truth_and_baseline(xb, state[b:b + 1])
            r = compare(o[b:b + 1, node:node + 1].cpu(), o64[:, -1:], base[0][:, -1:], name=f"o[{b}, {node}]")
            assert r.passed, str(r)
            r = compare(inter[b:b + 1, node].cpu(), S64, base[1], name=f"intermediate[{b}, {node}]", head_axis=1)
            assert r.passed, str(r)
    nodes = torch.tensor(data.draw(st.lists(st.integers(-1, D - 1), min_size=case.B, max_size=case.B)),
                         device=DEVICE)
    per_draft_state_accept(state, inter, nodes + 1)
    for b in range(case.B):
        want = keep[b] if int(nodes[b]) < 0 else inter[b, int(nodes[b])]
        assert torch.equal(state[b], want)


def test_phase_one_warps_grow_with_the_draft_block():
    """Phase 1 takes a warp per 8 drafts at least from 32 drafts (64 drafts on one warp compiled for
    minutes), the register cap only at the configured warp count; up to 16 drafts the configured launch."""
    from kvbuffer_fast.verify import prep_warps
    cfg = VerifyConfig()
    assert prep_warps(cfg, 8) == prep_warps(cfg, 16) == (cfg.prep_warps, cfg.prep_maxnreg)
    assert prep_warps(cfg, 32) == (max(cfg.prep_warps, 4), 0 if cfg.prep_warps < 4 else cfg.prep_maxnreg)
    assert prep_warps(cfg, 64) == (8, 0)
    assert prep_warps(VerifyConfig(prep_warps=8, prep_maxnreg=96), 64) == (8, 96)
