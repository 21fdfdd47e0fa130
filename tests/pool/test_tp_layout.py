"""kvbuffer_ref.tp: the TP layout's head shards, the rejected layouts (an error naming the argument and
what it expected), and slicing tokens to a rank's heads and gathering outputs back."""

import pytest
import torch

from kvbuffer_ref import KVPool, check_pool_shard, gather_heads, shard_tokens, tp_shard, tp_shards


def test_qwen3_next_layouts():
    """H = 16, HV = 32: tp = 2 holds 8 q/k heads of 16 value heads per rank (vLLM's and SGLang's layout)."""
    s = tp_shards(16, 32, 2)
    assert [(x.value_heads, x.key_heads, x.key_replicas) for x in s] == [((0, 16), (0, 8), 1), ((16, 32), (8, 16), 1)]
    assert s[1].pool_kwargs() == dict(num_heads=16, num_value_heads=32, head_range=(16, 32))
    assert [x.key_heads for x in tp_shards(16, 32, 16)] == [(h, h + 1) for h in range(16)]
    assert tp_shard(16, 32, 1, 0).value_heads == (0, 32)


def test_tp_above_the_key_heads_replicates_them():
    """tp = 32 > H = 16: one value head per rank; the two ranks of a group hold its q/k head."""
    s = tp_shards(16, 32, 32)
    assert [x.key_heads for x in s] == [(h // 2, h // 2 + 1) for h in range(32)]
    assert {x.key_replicas for x in s} == {2}
    assert [x.key_heads for x in tp_shards(1, 4, 4)] == [(0, 1)] * 4


@pytest.mark.parametrize("args, kw, match", [
    ((16, 32, 3, 0), {}, "world_size: 3 ranks cannot hold equal whole groups of the 16 q/k heads; expected a divisor "
                         "of num_heads=16"),
    ((16, 32, 6, 0), {}, "world_size: 6 ranks"),
    ((2, 4, 4, 0), dict(replicate_key_heads=False), "world_size: 4 ranks for 2 q/k heads would give each rank a "
                                                    "fraction of a q/k head; expected a divisor of num_heads=2"),
    ((2, 6, 4, 0), {}, "world_size: .*multiple of num_heads=2 and divides num_value_heads=6"),
    ((2, 4, 8, 0), {}, "world_size: .*divides num_value_heads=4"),
    ((3, 4, 1, 0), {}, "num_value_heads: expected a multiple of num_heads=3"),
    ((2, 4, 2, 2), {}, r"rank: expected an int in 0..1 \(world_size=2\), got 2"),
    ((2, 4, 0, 0), {}, "world_size: expected a positive int, got 0"),
    ((0, 4, 2, 0), {}, "num_heads: expected a positive int"),
    ((2, 4, 2, True), {}, "rank: expected an int"),
])
def test_bad_layouts_name_the_argument(args, kw, match):
    with pytest.raises(ValueError, match=match):
        tp_shard(*args, **kw)


def _tokens(B=2, T=3, H=2, HV=8, K=4, V=3, channel=False):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K) if channel else r(B, T, HV),
                beta=r(B, T, HV), initial_state=r(B, HV, K, V))


@pytest.mark.parametrize("H, HV, tp", [(2, 8, 2), (2, 8, 4), (2, 8, 8), (1, 4, 2), (4, 4, 4)])
@pytest.mark.parametrize("channel", [False, True])
def test_slices_read_the_shard_heads_and_gather_back(H, HV, tp, channel):
    x = _tokens(H=H, HV=HV, channel=channel)
    group = HV // H
    shards = tp_shards(H, HV, tp)
    parts = {f: [] for f in x}
    for s in shards:
        local = shard_tokens(s, **x)
        for f, t in local.items():
            assert t.is_contiguous()
            parts[f].append(t)
        a, b = s.value_heads
        for j in range(a, b):  # every local value head's q/k head is its group's
            assert torch.equal(local["q"][:, :, j // group - s.key_heads[0]], x["q"][:, :, j // group])
        pool = KVPool(layers=1, num_state_slots=1, num_buffer_slots=1, capacity=2, max_drafts=0, head_k_dim=4,
                      head_v_dim=3, **s.pool_kwargs())
        check_pool_shard(pool, s)
        assert pool.k.shape[3] == local["k"].shape[2] and pool.u.shape[3] == local["v"].shape[2]
    for f in ("v", "g", "beta"):
        assert torch.equal(gather_heads(parts[f], shards), x[f])
    assert torch.equal(gather_heads(parts["initial_state"], shards, head_axis=1), x["initial_state"])
    order = list(reversed(range(tp)))  # any order of the parts, as long as each comes with its shard
    assert torch.equal(gather_heads([parts["v"][i] for i in order], [shards[i] for i in order]), x["v"])


def test_bad_slicing_and_gathering_name_the_argument():
    s = tp_shards(2, 8, 2)
    x = _tokens()
    with pytest.raises(ValueError, match=r"q: expected 2 q/k heads \(the model's\) on axis 2, got shape \[2, 3, 1, "):
        shard_tokens(s[0], q=x["q"][:, :, :1])
    with pytest.raises(ValueError, match=r"v: expected 8 value heads \(the model's\) on axis 2"):
        shard_tokens(s[0], v=x["v"][:, :, :4])
    with pytest.raises(TypeError, match="z: not a token tensor"):
        shard_tokens(s[0], z=x["v"])
    assert shard_tokens(s[0], q=None) == {"q": None}
    v = [shard_tokens(t, v=x["v"])["v"] for t in s]
    with pytest.raises(ValueError, match="parts: expected one tensor per shard"):
        gather_heads(v[:1], s)
    with pytest.raises(ValueError, match=r"shards: expected the 2 ranks of one layout, each once, got ranks \[0, 0\]"):
        gather_heads(v, [s[0], s[0]])
    with pytest.raises(ValueError, match=r"parts\[1\]: expected 4 value heads \(the shard's\)"):
        gather_heads([v[0], v[1][:, :, :2]], s)
    pool = KVPool(layers=1, num_state_slots=1, num_buffer_slots=1, capacity=2, max_drafts=0, head_k_dim=4,
                  head_v_dim=3, **s[0].pool_kwargs())
    with pytest.raises(ValueError, match="pool: holds .* but rank 1 of 2 holds"):
        check_pool_shard(pool, s[1])
