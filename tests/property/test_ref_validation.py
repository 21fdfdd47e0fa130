"""Bad input raises ValueError / TypeError naming the argument, the expected and the actual value."""

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import Case

B, T, H, HV, K, V = 2, 3, 2, 4, 5, 3


def _x(**over):
    x = Case(B=B, T=T, H=H, HV=HV, K=K, V=V, seed=1).inputs()
    x.update(over)
    return x


BAD_TOKENS = [
    ("q rank", dict(q=torch.zeros(B, T, K, dtype=torch.float64)), ValueError, r"q: expected rank 4 \[B, T, H, K\], got rank 3"),
    ("k shape", dict(k=torch.zeros(B, T, H, K + 1, dtype=torch.float64)), ValueError, r"k: expected the shape of q"),
    ("v batch", dict(v=torch.zeros(B + 1, T, HV, V, dtype=torch.float64)), ValueError, r"v: dimension 0 \(batch B\) must be 2.*got 3"),
    ("v tokens", dict(v=torch.zeros(B, T + 1, HV, V, dtype=torch.float64)), ValueError, r"v: dimension 1 \(tokens T\) must be 3"),
    ("HV not multiple", dict(v=torch.zeros(B, T, 3, V, dtype=torch.float64), g=torch.zeros(B, T, 3, dtype=torch.float64),
                             beta=torch.zeros(B, T, 3, dtype=torch.float64)), ValueError, r"HV=3 must be a positive multiple of the q/k heads H=2"),
    ("g shape", dict(g=torch.zeros(B, T, HV, K + 1, dtype=torch.float64)), ValueError, r"g: expected \[B, T, HV\] = \[2, 3, 4\].*got \[2, 3, 4, 6\]"),
    ("g rank", dict(g=torch.zeros(B, T, dtype=torch.float64)), ValueError, r"g: expected rank 3 .* or rank 4"),
    ("beta shape", dict(beta=torch.zeros(B, T, H, dtype=torch.float64)), ValueError, r"beta: expected \[B, T, HV\] = \[2, 3, 4\], got \[2, 3, 2\]"),
    ("integer q", dict(q=torch.zeros(B, T, H, K, dtype=torch.int64)), TypeError, r"q: expected a floating-point dtype, got torch.int64"),
    ("integer beta", dict(beta=torch.zeros(B, T, HV, dtype=torch.int32)), TypeError, r"beta: expected a floating-point dtype"),
    ("not a tensor", dict(v=[1.0]), TypeError, r"v: expected a torch.Tensor, got list"),
    ("mixed devices", dict(g=torch.zeros(B, T, HV, dtype=torch.float64, device="meta")), ValueError, r"g: expected a tensor on device cpu"),
]


@pytest.mark.parametrize("fn", [ref.recurrent_gated_delta_rule, ref.chunk_gated_delta_rule, ref.direct_gated_delta_rule])
@pytest.mark.parametrize("what,over,exc,msg", BAD_TOKENS, ids=[b[0] for b in BAD_TOKENS])
def test_bad_tokens_are_rejected(fn, what, over, exc, msg):
    with pytest.raises(exc, match=msg):
        fn(**_x(**over))


def test_bad_state_scale_and_chunk_size():
    with pytest.raises(ValueError, match=r"initial_state: expected \[B, HV, K, V\] = \[2, 4, 5, 3\], got \[2, 4, 3, 5\]"):
        ref.recurrent_gated_delta_rule(**_x(), initial_state=torch.zeros(B, HV, V, K, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"scale: expected a positive finite number, got -1"):
        ref.recurrent_gated_delta_rule(**_x(), scale=-1.0)
    with pytest.raises(ValueError, match=r"chunk_size: expected a positive int, got 0"):
        ref.chunk_gated_delta_rule(**_x(), chunk_size=0)
    with pytest.raises(TypeError, match=r"positional"):
        ref.recurrent_gated_delta_rule(*_x().values())


def _buffer(C=2, with_state=True, n=None):
    x = _x()
    buf = ref.KVBuffer.empty(B, H, HV, K, V, C, with_state=with_state)
    for t in range(C if n is None else n):
        _, buf = ref.buffered_decode(**{k: v[:, t:t + 1] for k, v in x.items()}, buffer=buf)
    return buf


def test_decode_into_a_full_buffer_without_state_storage():
    buf = _buffer(C=2, with_state=False)
    assert buf.lengths.tolist() == [2, 2]
    x = _x()
    with pytest.raises(ValueError, match=r"buffer: request 0 has 2 entries and gets 1 more, past the capacity C=2, "
                                         r"but the buffer has no state storage"):
        ref.buffered_decode(**{k: v[:, 2:3] for k, v in x.items()}, buffer=buf)
    # flush allocates the state explicitly, after which decoding goes on
    o, buf2 = ref.buffered_decode(**{k: v[:, 2:3] for k, v in x.items()}, buffer=ref.flush(buf))
    assert buf2.lengths.tolist() == [1, 1] and buf2.has_state.all()


def test_decode_takes_one_token_and_a_matching_buffer():
    x = _x()
    with pytest.raises(ValueError, match=r"q: buffered_decode takes one token per request, expected \[B, 1, H, K\], got \[2, 3, 2, 5\]"):
        ref.buffered_decode(**x, buffer=_buffer(n=0))
    other = ref.KVBuffer.empty(B, H, HV, K + 1, V, 2)
    with pytest.raises(ValueError, match=r"buffer: its K=6 does not match the tokens' K=5"):
        ref.buffered_decode(**{k: v[:, :1] for k, v in x.items()}, buffer=other)
    chan = ref.KVBuffer.empty(B, H, HV, K, V, 2, channel_gate=True)
    with pytest.raises(ValueError, match=r"g: the buffer holds per-channel .* gates but g is scalar"):
        ref.buffered_decode(**{k: v[:, :1] for k, v in x.items()}, buffer=chan)
    with pytest.raises(TypeError, match=r"buffer: expected a KVBuffer, got dict"):
        ref.buffered_decode(**{k: v[:, :1] for k, v in x.items()}, buffer={})
    bad_len = _buffer(n=0).replace(lengths=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"buffer.lengths: entry \[1\] is 3, expected a value in 0..2"):
        ref.buffered_decode(**{k: v[:, :1] for k, v in x.items()}, buffer=bad_len)


def test_accept_counts_and_nodes_are_checked():
    x = _x()
    buf = _buffer(C=4, n=1)
    _, drafts = ref.verify(**x, buffer=buf)
    with pytest.raises(ValueError, match=r"counts: entry \[1\] is 4, expected a value in 0..3"):
        ref.accept(buf, drafts, counts=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match=r"counts: expected \[B\] = \[2\], got \[3\]"):
        ref.accept(buf, drafts, counts=torch.tensor([1, 1, 1]))
    with pytest.raises(TypeError, match=r"counts: expected an integer tensor, got dtype torch.float32"):
        ref.accept(buf, drafts, counts=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match=r"counts: entry \[0\] is -1"):
        ref.accept(buf, drafts, counts=-1)
    with pytest.raises(ValueError, match=r"nodes: entry \[0\] is 3, expected -1 \(accept none\) or a draft index in 0..2"):
        ref.accept(buf, drafts, nodes=3)
    with pytest.raises(ValueError, match=r"exactly one of counts="):
        ref.accept(buf, drafts)
    _, tree = ref.verify(**x, buffer=buf, parents=torch.tensor([[-1, -1, 0], [-1, 0, 1]]))
    with pytest.raises(ValueError, match=r"counts: request 0's drafts form a tree"):
        ref.accept(buf, tree, counts=2)


def test_parents_and_num_drafts_are_checked():
    x = _x()
    buf = _buffer(C=4, n=1)
    with pytest.raises(ValueError, match=r"parents: entry \[0, 1\] is 1, expected a value in -1..0"):
        ref.verify(**x, buffer=buf, parents=torch.tensor([[-1, 1, 0], [-1, 0, 1]]))
    with pytest.raises(ValueError, match=r"parents: expected \[B, D\] = \[2, 3\], got \[3\]"):
        ref.verify(**x, buffer=buf, parents=torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match=r"num_drafts: entry \[0\] is 4, expected a value in 0..3"):
        ref.verify(**x, buffer=buf, num_drafts=torch.tensor([4, 1]))


def test_flush_and_prefill_arguments_are_checked():
    buf = _buffer(C=4, n=2)
    with pytest.raises(ValueError, match=r"count: entry \[0\] is 3, expected a value in 0..2"):
        ref.flush(buf, count=3)
    with pytest.raises(ValueError, match=r"tail: expected an int in 0..min\(T, C\) = 0..2, got 3"):
        ref.prefill(**_x(), capacity=2, tail=3)
    with pytest.raises(ValueError, match=r"capacity: expected a positive int, got 0"):
        ref.prefill(**_x(), capacity=0)
    with pytest.raises(ValueError, match=r"form: expected 'u' \(u-cache\) or 'raw'"):
        ref.prefill(**_x(), capacity=2, form="kv")


def test_materialize_state_is_zero_for_requests_without_a_state():
    buf = ref.KVBuffer.empty(B, H, HV, K, V, 3)
    buf = buf.replace(state=torch.full_like(buf.state, 7.0))  # storage garbage, owned by nobody
    assert torch.equal(ref.materialize_state(buf), torch.zeros_like(buf.state))
