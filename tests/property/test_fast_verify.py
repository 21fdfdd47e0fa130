"""kvbuffer_fast speculative verification (verify / accept, chains and trees, ragged) against the float64
oracle through ``kvbuffer_ref.testing.properties.check_verify_accept``, and the per-draft-state baseline
against the recurrence.

On a CPU these run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), in
float32 with small shapes (K, V <= 16, B <= 3).  Every library-allocated output is NaN-poisoned
(``kvbuffer_fast._common.POISON``), and so is all buffer memory a kernel must not read (slots past each
request's length, the state of requests in direct mode).  The tokens after ``accept`` are decoded and
the buffer finally flushed by kvbuffer_fast too (the whole serving loop on the fast ops); the verify
outputs are compared before accept runs, so a failure names the op: ``verify[...]`` for verify,
``accept+decode[...]`` for accept or the decode after it (tests/property/test_fast_decode.py
covers decode alone).  ``_launch`` runs the same checks with small V-tiles (several per value head).
"""

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
import kvbuffer_fast._common as common  # noqa: E402
import kvbuffer_fast.speculative as spec  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_ref.testing import Case, compare  # noqa: E402
from kvbuffer_ref.testing import properties as P  # noqa: E402
from kvbuffer_ref.testing import strategies as kst  # noqa: E402

from .fast_adapter import Poisoned, verify_launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(max_H=2, max_group=2, dims=(3, 8, 16))
# the interpreter is slow: the ci profile runs 8 examples per test here; thorough keeps its own count
FEW = settings(max_examples=8) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else (lambda f: f)


@pytest.fixture(autouse=True)
def _poison_outputs():
    common.POISON = True
    yield
    common.POISON = False


@pytest.fixture
def _launch():
    """Small V-tiles (BV=16: several programs per value head) for verify and accept (fold too), restored after."""
    old = {kern: spec.set_launch(kern, BV=16) for kern in ("verify", "accept", "accept_fold")}
    yield
    for kern, cfg in old.items():
        spec.set_launch(kern, **cfg)


def _assert_all(results):
    assert results, "no comparison was made"
    for r in results:
        assert r.passed, str(r)


@st.composite
def _setup(draw, *, chain: bool, max_drafts: int = 6):
    C = draw(st.sampled_from([1, 2, 4, 8]), label="capacity")
    B = draw(st.integers(1, 3), label="B")
    parents, counts = draw(kst.draft_batch(B, max_drafts=max_drafts, chain=chain), label="drafts")
    D = len(parents[0])
    hist = draw(st.integers(0, 8), label="history")
    after = draw(st.integers(0, 2), label="after")
    case = draw(kst.cases(B=B, T=hist + D + after, **SMALL), label="case")
    lengths = draw(st.lists(st.integers(0, min(hist, C)), min_size=B, max_size=B), label="lengths")
    nodes = draw(kst.acceptances(counts), label="nodes")
    return dict(case=case, capacity=C, history=hist, lengths=lengths, parents=parents, num_drafts=counts,
                nodes=nodes, after=after)


@FEW
@given(s=_setup(chain=True))
def test_chain_verify_accept_counts_match_oracle(s):
    """Chains, ragged draft counts and buffer lengths, accept by counts (folds when past C), then decode."""
    _assert_all(P.check_verify_accept(Poisoned, dtype=torch.float32, device=DEVICE, use_counts=True, **s))


@FEW
@given(s=_setup(chain=False, max_drafts=8))
def test_tree_verify_accept_nodes_match_oracle(s):
    """Trees: every node == the recurrence along its path; accepting a node appends exactly its path."""
    _assert_all(P.check_verify_accept(Poisoned, dtype=torch.float32, device=DEVICE, **s))


def test_fold_on_accept_past_capacity_and_direct_requests():
    """Deterministic edge cases: full buffers, m > C (new entries folded too), direct and empty requests,
    zero drafts, per-channel gates."""
    for channel in (False, True):
        case = Case(B=3, T=4 + 5 + 2, H=1, HV=2, K=8, V=5, channel_gate=channel, gate="mixed", beta="mixed", seed=7)
        _assert_all(P.check_verify_accept(
            Poisoned, case, torch.float32, capacity=2, history=4, lengths=[2, 0, 1], parents=[list(range(-1, 4))] * 3,
            num_drafts=[5, 3, 0], nodes=[4, 2, -1], after=2, device=DEVICE, use_counts=True))


@pytest.mark.parametrize("channel", [False, True])
def test_several_v_tiles_long_drafts_and_trees(_launch, channel):
    """V = 40 over BV = 16 tiles (a partial last tile; accept's ticket counts every tile), K = 40 (four key
    chunks, partial), ten drafts (two row blocks of 16), a tree with several branches, folds on accept
    (several V-tiles of the fold too), a direct request."""
    case = Case(B=3, T=3 + 10 + 2, H=1, HV=2, K=40, V=40, channel_gate=channel, gate="mixed", beta="mixed", seed=11)
    tree = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8]
    _assert_all(P.check_verify_accept(
        Poisoned, case, torch.float32, capacity=4, history=3, lengths=[3, 0, 2], parents=[list(range(-1, 9)), tree,
                                                                                          tree],
        num_drafts=[10, 7, 10], nodes=[9, 5, 9], after=2, device=DEVICE))


VARIANTS = {"stream": dict(variant="stream"), "stream-p": dict(variant="stream", zp=False),
            "stream-group": dict(variant="stream", zp=True, prep_group=True, prep_hoist=False, prep_maxnreg=0),
            "stream-doubling": dict(variant="stream", prep_solve="doubling"),
            "stream-early": dict(variant="stream", early=True), "stream-late": dict(variant="stream", early=False),
            "fused": dict(variant="fused")}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("channel", [False, True])
def test_variants(channel, variant):
    """variant='stream' (phase 2 streams the state in KB=16-row blocks: K=40 gives three, the last partial;
    scalar gates form X S0 from the raw rows, 'stream-p' the [R, K] P of phase 1 instead, as per-channel
    gates always do) and 'fused' (one launch: the state, the scores and the solve in one program;
    per-channel gates take the two phases), V over partial BV=16 tiles, a tree, folds on accept and a
    direct request.  'stream' is the default (phase 1 per q/k head, its loads hoisted, a register cap;
    its 16-bit scores need 16-bit inputs: test_16bit_inputs_phase1_scores); 'stream-group' without the
    hoisted loads and the cap; 'stream-doubling' with the solve by products; 'stream-early' / 'stream-late'
    with phase 2's draft values and u rows loaded before / after its state loop (the default 'auto' takes
    'early' at these sizes)."""
    with verify_launch(BV=16, KB=16, **VARIANTS[variant]):
        case = Case(B=3, T=3 + 10 + 2, H=1, HV=2, K=40, V=40, channel_gate=channel, gate="mild", beta="mixed",
                    seed=12)
        tree = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8]
        _assert_all(P.check_verify_accept(
            Poisoned, case, torch.float32, capacity=4, history=3, lengths=[3, 0, 2],
            parents=[list(range(-1, 9)), tree, tree], num_drafts=[10, 7, 10], nodes=[9, 5, 9], after=2,
            device=DEVICE))


def test_verify_validate_false_matches_validated():
    """validate=False (CUDA graphs: no host reads) gives the same outputs and drafts."""
    case = Case(B=2, T=7, H=2, HV=4, K=8, V=8, seed=3)
    x = case.inputs(torch.float32, DEVICE)
    _, buf = ref.prefill(**{n: t[:, :3] for n, t in x.items()}, capacity=4)
    buf = P.buffer_to(buf, dtype=torch.float32, device=DEVICE)
    a = fast.verify(**{n: t[:, 3:] for n, t in x.items()}, buffer=buf)
    b = fast.verify(**{n: t[:, 3:] for n, t in x.items()}, buffer=buf, validate=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].u, b[1].u) and torch.equal(a[1].G, b[1].G)
    assert torch.equal(a[1].k, b[1].k)


def test_verify_out_and_padding_rows():
    case = Case(B=2, T=6, H=1, HV=1, K=8, V=8, seed=1)
    x = case.inputs(torch.float32, DEVICE)
    _, buf = ref.prefill(**{n: t[:, :2] for n, t in x.items()}, capacity=4)
    buf = P.buffer_to(buf, dtype=torch.float32, device=DEVICE)
    out = torch.full((2, 4, 1, 8), float("nan"), device=DEVICE)
    nd = torch.tensor([4, 1], device=DEVICE)
    o, drafts = fast.verify(**{n: t[:, 2:] for n, t in x.items()}, buffer=buf, num_drafts=nd, out=out)
    assert o is out
    assert torch.isfinite(o).all() and (o[1, 1:] == 0).all(), "padding rows must be written as 0"
    o_ref, _ = ref.verify(**{n: t[:, 2:] for n, t in x.items()}, buffer=buf, num_drafts=nd)
    assert torch.allclose(o, o_ref, atol=1e-5)
    assert drafts.u.dtype == torch.float32 and tuple(drafts.G.shape) == (2, 4, 1)


def test_accept_validation_errors():
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
    assert fast.accept(buf, drafts, nodes=2) is buf and int(buf.lengths[0]) == 2


@pytest.mark.parametrize("opts,match", [(dict(precision="tf32"), "precision: expected"),
                                        (dict(variant="two-phase"), "variant: expected"),
                                        (dict(prep_solve="inverse"), "prep_solve: expected"),
                                        (dict(early=1), "early: expected"),
                                        (dict(KB="16"), "KB: expected"),
                                        (dict(NS=0), "NS: expected"),
                                        (dict(xprec="tf32"), "xprec: expected"),
                                        (dict(xprec="bf16x3"), "needs q and k both in"),
                                        (dict(xprec="tf32x2"), "needs q and k both in"),
                                        (dict(xprec="bf16x3", dtype=torch.float16), "needs q and k both in"),
                                        (dict(xprec="tf32x2", zp=False, dtype=torch.float16), "applies to phase 2"),
                                        (dict(xprec="tf32x2", variant="fused", dtype=torch.float16),
                                         "applies to phase 2")],
                         ids=["tf32", "variant", "solve", "early", "kb", "ns", "xprec", "xprec-bf16x3-fp32", "xprec-tf32x2-fp32",
                              "xprec-bf16x3-fp16", "xprec-zp", "xprec-fused"])
def test_bad_verify_launch_options_are_rejected(opts, match):
    opts = dict(opts)
    case = Case(B=1, T=2, H=1, HV=1, K=4, V=4, seed=2)
    x = case.inputs(opts.pop("dtype", torch.float32), DEVICE)
    buf = ref.KVBuffer.empty(1, 1, 1, 4, 4, 2, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fast.verify(**x, buffer=buf, **opts)


@triton.jit
def _pieces_kernel(s_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    s = tl.load(s_ptr + o)
    hi = spec._tf32_round(s)
    s1, s2, s3 = spec._bf16_pieces(s)
    tl.store(out_ptr + o, hi)
    tl.store(out_ptr + N + o, s1.to(tl.float32))
    tl.store(out_ptr + 2 * N + o, s2.to(tl.float32))
    tl.store(out_ptr + 3 * N + o, s3.to(tl.float32))


def test_phase2_split_pieces():
    """The pieces of phase 2's split X S0 (xprec), exact identities over random fp32 values of every scale
    (and 0, signs, values at a rounding tie): tf32x2's hi has its 13 low bits clear, hi + lo == s exactly
    in fp32, |lo| <= 2^-11 |s| (round to nearest); bf16x3's pieces are bf16 values whose sum leaves at most
    2^-27 |s| (each rounding keeps 9 bits).  The bf16 products themselves need the GPU (the interpreter's
    bf16 dots are wrong): the compiled run of test_16bit_inputs_phase2_split covers them."""
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(1024, generator=gen) * torch.exp2(torch.randint(-60, 60, (1024,), generator=gen).float())
    s[:4] = torch.tensor([0.0, -0.0, 1.0 + 2.0 ** -11, -(1.0 + 3 * 2.0 ** -11)])  # ties of the TF32 rounding
    out = torch.full((4 * 1024,), float("nan"))
    s, out = s.to(DEVICE), out.to(DEVICE)
    _pieces_kernel[(1,)](s, out, N=1024)
    s, hi, s1, s2, s3 = s.cpu(), *out.cpu().view(4, 1024)
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all(), "tf32x2: hi must be a TF32 value"
    assert torch.equal(hi + (s - hi), s) and torch.equal((s - hi) + hi, s)
    assert ((s - hi).abs() <= 2.0 ** -11 * s.abs()).all(), "tf32x2: hi must be the nearest TF32 value"
    assert torch.equal(hi[2:4], torch.tensor([1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -9)])), "ties round away from 0"
    for p in (s1, s2, s3):
        assert torch.equal(p.bfloat16().float(), p), "bf16x3: every piece must be a bf16 value"
    rest = s.double() - s1.double() - s2.double() - s3.double()
    assert (rest.abs() <= 2.0 ** -27 * s.double().abs()).all(), "bf16x3: the pieces must carry s to 2^-27"


_BF16_CUDA = pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter mishandles bfloat16 arithmetic; bf16 runs on CUDA only")


def _check_16bit(dtype, seed):
    """verify + accept + decode on 16-bit q / k (keys cached in the same dtype) under the launch now set:
    several q/k heads with two value heads each, K = 40 over 16-row blocks, a tree, folds on accept and a
    direct request; the outputs within the 16-bit row of the tolerance table, the final state within the
    fp32 one."""
    case = Case(B=3, T=3 + 10 + 2, H=2, HV=4, K=40, V=24, gate="mild", beta="mixed", seed=seed)
    tree = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8]
    _assert_all(P.check_verify_accept(
        Poisoned, case, dtype, capacity=4, history=3, lengths=[3, 0, 2],
        parents=[list(range(-1, 9)), tree, tree], num_drafts=[10, 7, 10], nodes=[9, 5, 9], after=2,
        device=DEVICE))


@pytest.mark.parametrize("xprec,dtype", [
    ("tf32x2", torch.float16),
    pytest.param("tf32x2", torch.bfloat16, marks=_BF16_CUDA),
    pytest.param("bf16x3", torch.bfloat16, marks=_BF16_CUDA)],
    ids=["tf32x2-fp16", "tf32x2-bf16", "bf16x3-bf16"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_16bit_inputs_phase2_split(xprec, dtype, early):
    """Phase 2's X S0 with the state split (xprec: 'tf32x2', two TF32 pieces; 'bf16x3', three bf16 ones),
    with its draft values and u rows loaded before or after the state loop; the direct request's
    NaN-poisoned state must stay out of every piece."""
    with verify_launch(BV=16, KB=16, xprec=xprec, early=early):
        _check_16bit(dtype, seed=15)


# ------------------------------------------------------------------ the per-draft-state baseline
@FEW
@given(case=kst.cases(max_T=6, **SMALL), data=st.data())
def test_per_draft_state_baseline_matches_recurrence(case, data):
    x = case.inputs(torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(case.seed)
    S0 = (torch.randn(case.B, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.5)
    state = S0.float().to(DEVICE)
    keep = state.clone()
    o, inter = fast.per_draft_state_verify(**x, state=state)
    assert torch.equal(state, keep), "per_draft_state_verify must not modify the state"
    (o64, _), base = P.truth_and_baseline(x, state)
    r = compare(o.cpu(), o64, base[0], name="per_draft_state.o", g=x["g"])
    assert r.passed, str(r)
    for t in range(case.T):  # intermediate t == the state after token t
        xt = {n: v[:, : t + 1] for n, v in x.items()}
        (_, S64), bt = P.truth_and_baseline(xt, state)
        r = compare(inter[:, t].cpu(), S64, bt[1], name=f"intermediate[{t}]", head_axis=1, g=xt["g"])
        assert r.passed, str(r)
    counts = torch.tensor(data.draw(st.lists(st.integers(0, case.T), min_size=case.B, max_size=case.B)),
                          device=DEVICE)
    fast.per_draft_state_accept(state, inter, counts)
    for b in range(case.B):
        want = keep[b] if int(counts[b]) == 0 else inter[b, int(counts[b]) - 1]
        assert torch.equal(state[b], want)


@pytest.mark.parametrize("mma", [True, False], ids=["mma16", "tf32"])
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=_BF16_CUDA)],
                         ids=["fp16", "bf16"])
def test_16bit_inputs_phase1_scores(dtype, mma):
    """Phase 1 forms its scores with 16-bit MMAs of the raw rows (prep_mma=True: exact products, the query
    scale applied after) or with the fp32 path."""
    with verify_launch(BV=16, KB=16, prep_mma=mma):
        _check_16bit(dtype, seed=14)


@pytest.mark.parametrize("solve", ["rows", "doubling"])
def test_deep_chain_strong_coupling(solve):
    """Phase 1's triangular solve on a chain of 10 drafts where every power of the coupling matters: K=4
    (random unit keys overlap strongly), beta = 1 and no decay, so the terms up to A^9 of
    (I + A)^-1 are far above the budget; 'doubling' must form all of them (four factors at BD = 16)."""
    with verify_launch(BV=16, KB=16, prep_solve=solve):
        case = Case(B=2, T=3 + 10 + 2, H=1, HV=2, K=4, V=8, gate="zero", beta="one", seed=21)
        _assert_all(P.check_verify_accept(
            Poisoned, case, torch.float32, capacity=4, history=3, lengths=[3, 1],
            parents=[list(range(-1, 9)), list(range(-1, 9))], num_drafts=[10, 9], nodes=[9, 4], after=2,
            device=DEVICE))
