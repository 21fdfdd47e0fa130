"""kvbuffer_fast.prefill: the prompt's outputs, then buffered decoding from the buffer it hands off, against
the float64 recurrence over prompt + continuation (``properties.check_prefill``, judged by ``compare``);
the buffer's contents against the oracle's (kvbuffer_ref.prefill: the same layout and dtypes); ragged
prompts (cu_seqlens) in one launch.  Interpreter, float32, chunk_size 16 with prompts past two chunks.
"""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvbuffer_fast as fast  # noqa: E402
import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.launch import PrefillConfig  # noqa: E402
from kvbuffer.validate import Case, assert_matches  # noqa: E402
from kvbuffer.validate import properties as P  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("KVBUFFER_POISON", "1")


@pytest.mark.parametrize("prompt,tail,channel,C", [
    (37, None, False, 8),   # head of 32 (two chunks), tail 37 % 8 = 5
    (37, 0, True, 8),       # nothing buffered: the whole prompt folded
    (40, 16, False, 16),    # a full buffer of C = chunk_size rows
    (6, None, True, 8),     # the whole prompt buffered: direct mode (no state owned)
    (35, 30, False, 40),    # a tail of 30 rows, past one chunk of 16: the tail's chunk widens to hold it
], ids=["tail-default", "tail-0-channel", "tail-full", "direct-mode-channel", "tail-past-a-chunk"])
def test_prefill_then_decode_is_the_recurrence(prompt, tail, channel, C):
    case = Case(B=2, T=prompt + 3, H=1, HV=2, K=8, V=12, channel_gate=channel, gate="mixed", seed=prompt + C)
    results = P.check_prefill(fast, case, torch.float32, capacity=C, prompt=prompt, tail=tail, chunk_size=16,
                              device=DEVICE)
    assert results
    for r in results:
        assert r.passed, str(r)


def _same_buffer(buf, want, base, name):
    """The fast buffer field by field against the float64 oracle's (rows past each length excluded)."""
    assert buf.form == want.form == "u"
    for field in ("k", "u", "G", "state"):
        a, w = getattr(buf, field), getattr(want, field)
        assert a.shape == w.shape and a.dtype == torch.float32, field
    assert torch.equal(buf.lengths.cpu(), want.lengths) and torch.equal(buf.has_state.cpu(), want.has_state)
    C = want.capacity
    valid = torch.arange(C)[None, :] < want.lengths[:, None]  # [N, C]
    if bool(valid.any()):
        assert torch.equal(buf.k.cpu()[valid].double(), want.k[valid])  # the keys, copied exactly
    for field in ("u", "G"):
        a = getattr(buf, field).cpu()[valid]
        w = getattr(want, field)[valid]
        b = getattr(base, field)[valid]
        assert_matches(a.unsqueeze(0), w.unsqueeze(0), b.unsqueeze(0), name=f"{name}.{field}", head_axis=2)
    owned = want.has_state
    assert_matches(buf.state.cpu()[owned], want.state[owned], base.state[owned], name=f"{name}.state", head_axis=1)


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_ragged_prefill_in_one_launch(channel):
    """cu_seqlens: prompts of 0, 5, 21 and 35 tokens with C = 8 (default tails 0, 5, 5, 3; the 5-token prompt
    is in direct mode) from initial states; the buffer == the oracle's; decoding 2 more tokens per request
    from it == the per-sequence recurrence."""
    lens, more = [0, 5, 21, 35], 2
    H, HV, K, V, C = 1, 2, 8, 12, 8
    case = Case(B=len(lens), T=max(lens) + more, H=H, HV=HV, K=K, V=V, channel_gate=channel, gate="mixed",
                seed=21 + channel)
    x = case.inputs(torch.float32, DEVICE)  # request n's tokens: x[n, :lens[n] + more]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    flat = {name: torch.cat([t[n:n + 1, :lens[n]] for n in range(len(lens))], dim=1) for name, t in x.items()}
    cu_t = torch.tensor(cu, device=DEVICE)
    S0 = 0.5 * torch.randn(len(lens), HV, K, V, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    o, buf = fast.prefill(**flat, capacity=C, chunk_size=16, cu_seqlens=cu_t, initial_state=S0)
    want_o, want = ref.prefill(**P.upcast_inputs(flat), capacity=C, chunk_size=16, cu_seqlens=cu_t.cpu(),
                               initial_state=S0.double().cpu())
    base_o, base = ref.prefill(**{n: t.cpu() for n, t in flat.items()}, capacity=C, chunk_size=16,
                               cu_seqlens=cu_t.cpu(), initial_state=S0.cpu())
    # the baseline: kvbuffer_ref's same call in float32 (its own form), and per prompt the correct forms in
    # float32 (the recurrence and the chunkwise form with chunks of max(64, C, chunk_size))
    forms = [P.truth_and_baseline({name: t[n:n + 1, :lens[n]] for name, t in x.items()}, S0[n:n + 1],
                                  chunk=max(C, 16))[1][0].cpu() for n in range(len(lens)) if lens[n]]
    assert_matches(o.cpu(), want_o, [base_o, torch.cat(forms, 1)], name="prefill[varlen].o")
    _same_buffer(buf, want, base, "prefill[varlen]")
    own = base  # kvbuffer_ref's float32 buffer, decoding the same tokens: the own form of the decode steps
    for step in range(more):  # decode request n's token lens[n] + step
        tok = {name: torch.stack([t[n, lens[n] + step] for n in range(len(lens))])[:, None] for name, t in x.items()}
        ot, buf = fast.buffered_decode(**tok, buffer=buf)
        own_o, own = ref.buffered_decode(**{name: t.cpu() for name, t in tok.items()}, buffer=own)
        for n in range(len(lens)):
            xs = {name: t[n:n + 1, :lens[n] + step + 1] for name, t in x.items()}
            (o64, _), b = P.truth_and_baseline(xs, S0[n:n + 1], chunk=max(C, 16))
            assert_matches(ot[n:n + 1].cpu(), o64[:, -1:], [b[0][:, -1:].cpu(), own_o[n:n + 1]],
                           name=f"decode[{n}, {step}].o")


def test_prefill_buffer_matches_the_oracle_with_groups():
    """Two q/k heads of two value heads each: keys per q/k head, u and G per value head, as the oracle has them."""
    x = Case(B=2, T=29, H=2, HV=4, K=5, V=7, gate="strong", seed=9).inputs(torch.float32, DEVICE)
    o, buf = fast.prefill(**x, capacity=8, chunk_size=16)
    want_o, want = ref.prefill(**P.upcast_inputs(x), capacity=8, chunk_size=16)
    base_o, base = ref.prefill(**{n: t.cpu() for n, t in x.items()}, capacity=8, chunk_size=16)
    _, (bo, _) = P.truth_and_baseline(x, chunk=16)  # the recurrence and the chunkwise form in float32
    assert_matches(o.cpu(), want_o, [base_o, bo.cpu()], name="prefill.o")
    _same_buffer(buf, want, base, "prefill")


def test_prefill_bad_arguments():
    x = Case(B=1, T=10, H=1, HV=2, K=8, V=8, seed=1).inputs(torch.float32, DEVICE)
    with pytest.raises(ValueError, match="tail"):
        fast.prefill(**x, capacity=4, tail=5)
    with pytest.raises(ValueError, match="tail"):
        fast.prefill(**x, capacity=16, tail=3, cu_seqlens=torch.tensor([0, 2, 10], device=DEVICE))
    with pytest.raises(NotImplementedError, match="u-cache"):
        fast.prefill(**x, capacity=4, form="raw")
    with pytest.raises(ValueError, match="form"):
        fast.prefill(**x, capacity=4, form="x")
    with pytest.raises(TypeError, match="capacity"):
        fast.prefill(**x, capacity=4.0)
    with pytest.raises(TypeError, match="PrefillConfig"):
        fast.prefill(**x, capacity=4, config=object())
    assert isinstance(PrefillConfig(), PrefillConfig)


def test_a_repeated_prefill_makes_no_host_tensor(monkeypatch):
    """The chunk table and the buffer's lengths / has-state rows are cached on the device: a second call
    with the same prompt lengths builds no host tensor (whose copy to a GPU would wait for the stream and
    could not be captured in a CUDA graph), and hands off the same buffer."""
    x = Case(B=2, T=21, H=1, HV=2, K=8, V=8, seed=4).inputs(torch.float32, DEVICE)
    o1, b1 = fast.prefill(**x, capacity=8, tail=5)
    made = []
    real = torch.tensor

    def counting(*a, **kw):
        made.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(torch, "tensor", counting)
    o2, b2 = fast.prefill(**x, capacity=8, tail=5)
    monkeypatch.undo()
    assert made == []
    assert torch.equal(o1, o2) and torch.equal(b1.lengths, b2.lengths) and torch.equal(b1.has_state, b2.has_state)
    assert b2.lengths.tolist() == [5, 5] and b2.has_state.tolist() == [True, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_prefill_replays_in_a_cuda_graph():
    """A prefill of fixed prompt lengths, captured once (after a warm-up call that compiles and caches),
    replays to the eager call's outputs and buffer."""
    x = Case(B=2, T=40, H=2, HV=4, K=16, V=16, seed=6).inputs(torch.float32, DEVICE)
    o_eager, b_eager = fast.prefill(**x, capacity=16)
    static = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["o"], static["buf"] = fast.prefill(**x, capacity=16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static["o"], o_eager)
    for name in ("lengths", "has_state", "state", "u", "G", "k"):
        assert torch.equal(getattr(static["buf"], name), getattr(b_eager, name)), name
