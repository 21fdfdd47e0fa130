"""kvbuffer_ref.memory: exact byte counts for small configurations, worked out by hand."""

import pytest
import torch

from kvbuffer_ref.memory import (LayerShape, buffered_verify_bytes, compare_styles, entry_bytes, itemsize,
                                 max_concurrent_requests, per_draft_state_bytes, state_bytes)

SMALL = LayerShape(H=1, HV=2, K=4, V=3)  # fp32 state, bf16 keys, fp32 u-cache


def test_small_config_by_hand():
    # |S| = HV*K*V*4 = 2*4*3*4 = 96; entry = key 1*4*2 + u 2*3*4 + G 2*1*4 = 8 + 24 + 8 = 40
    assert state_bytes(SMALL) == 96
    assert entry_bytes(SMALL) == 40
    buf = buffered_verify_bytes(SMALL, drafts=2, capacity=5, layers=3)
    assert buf.parts == {
        "state": 3 * 96,                      # 288
        "buffer_entries": 3 * 5 * 40,         # 600
        "buffer_bookkeeping": 3 * (8 + 1),    # 27: lengths int64 + has_state bool
        "draft_entries": 3 * 2 * 40,          # 240
        "draft_bookkeeping": 3 * (2 * 8 + 8),  # 72: parents int64 [d] + num_drafts int64
    }
    assert buf.total == 1227
    pds = per_draft_state_bytes(SMALL, drafts=2, layers=3)
    assert pds.parts == {"state": 288, "intermediate_states": 3 * 2 * 96}
    assert pds.total == 864
    r = compare_styles(SMALL, drafts=2, capacity=5, layers=3, budget_bytes=10_000)
    assert r["buffered_max_requests"] == 10_000 // 1227 == 8
    assert r["per_draft_state_max_requests"] == 10_000 // 864 == 11
    assert r["ratio"] == pytest.approx(8 / 11)


def test_per_channel_gate_and_dtypes():
    s = LayerShape(H=2, HV=4, K=8, V=2, state_dtype=torch.float32, key_dtype="float16", cache_dtype="bfloat16",
                   channel_gate=True)
    # key 2*8*2 = 32, u 4*2*2 = 16, G 4*8*2 = 64
    assert entry_bytes(s) == 112
    assert state_bytes(s) == 4 * 8 * 2 * 4
    assert itemsize(torch.float64) == 8 and itemsize("bool") == 1


def test_qwen3_next_four_drafts():
    """Qwen3-Next layer, 4 drafts: per-draft-state holds 5 states; buffered 1 state + C + 4 entries."""
    s = LayerShape(H=16, HV=32, K=128, V=128)
    S = 32 * 128 * 128 * 4
    e = 16 * 128 * 2 + 32 * 128 * 4 + 32 * 4
    assert per_draft_state_bytes(s, drafts=4).total == 5 * S
    assert buffered_verify_bytes(s, drafts=4, capacity=16).total == S + 16 * e + 9 + 4 * e + 40


def test_errors():
    with pytest.raises(ValueError, match="HV"):
        LayerShape(H=3, HV=4, K=1, V=1)
    with pytest.raises(ValueError, match="drafts"):
        buffered_verify_bytes(SMALL, drafts=-1, capacity=1)
    with pytest.raises(ValueError, match="dtype"):
        itemsize("float7")
    with pytest.raises(ValueError, match="per_request_bytes"):
        max_concurrent_requests(10, 0)
    assert max_concurrent_requests(10, 3) == 3
