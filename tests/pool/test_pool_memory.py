"""kvbuffer_ref.memory's pool accounting: the bytes a pool holds now by kind (against the actual nbytes of
small pools of both kinds, and a hand count), the layout formula, and the concurrency planner (against a
hand computation at Qwen3-Next's shapes)."""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvbuffer_ref as ref  # noqa: E402
from kvbuffer_fast.pool import KVPool as FastPool  # noqa: E402
from kvbuffer_ref.memory import (QWEN3_NEXT, LayerShape, concurrency_table, max_pool_requests,  # noqa: E402
                                 pool_bytes, pool_layout_bytes)

from .schedule import Tokens  # noqa: E402

L, S, N, C, D, H, HV, K, V = 2, 3, 4, 3, 2, 1, 2, 4, 4


#: The fast pool's device: CUDA where there is one (its kernels compiled), else the CPU (interpreted).
FAST_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(kind):
    if kind == "ref":
        return ref.KVPool(layers=L, num_state_slots=S, num_buffer_slots=N, capacity=C, max_drafts=D, num_heads=H,
                          num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=torch.float64)
    return FastPool(layers=L, num_state_slots=S, num_buffer_slots=N, capacity=C, max_drafts=D, num_heads=H,
                    num_value_heads=HV, head_k_dim=K, head_v_dim=V, dtype=torch.float32, device=FAST_DEVICE)


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_pool_bytes_by_kind(kind):
    p = _pool(kind)
    isz = 8 if kind == "ref" else 4                       # the reference pool: float64 throughout
    per_state = HV * K * V * isz                          # 2*4*4 = 32 elements
    entry = H * K * isz + HV * V * isz + HV * isz         # k 4 + u 8 + G 2 = 14 elements
    book = L * N * (8 + 1 + 8 + 8 * D + 8 + 1) + L * S * 8 + N  # lengths, has_state, state_slot, parents,
    # num_drafts, pending per buffer slot and layer; refs per state slot and layer; live per buffer slot
    b = pool_bytes(p)
    assert b.parts == {"states_in_use": 0, "free_state_slots": L * S * per_state, "buffer_entries": L * N * C * entry,
                       "draft_room": L * N * D * entry, "bookkeeping": book}
    assert b.total == sum(t.nbytes for t in p.tensors().values())
    assert (b.live_requests, b.states_in_use, b.state_slots) == (0, 0, L * S)
    # two requests: one folds in layer 0 only (a prompt past C there), a fork shares its state slot
    tok = Tokens(0, H, HV, K, V, torch.float64 if kind == "ref" else torch.float32,
                 "cpu" if kind == "ref" else FAST_DEVICE)
    s = p.acquire(2)
    p.admit(**tok.draw(2, C + 1), layer=0, slots=s)      # two state slots in layer 0
    p.admit(**tok.draw(2, C), layer=1, slots=s)          # direct mode in layer 1
    p.fork(src=s[:1], dst=p.acquire(1), keep=0)          # shares, takes none
    b = pool_bytes(p)
    assert (b.live_requests, b.states_in_use) == (3, 2)
    assert b.parts["states_in_use"] == 2 * per_state
    assert b.parts["free_state_slots"] == (L * S - 2) * per_state
    assert b.total == sum(t.nbytes for t in p.tensors().values())
    p.release(s)                                          # the fork keeps one slot alive
    assert pool_bytes(p).states_in_use == 1


def test_layout_formula_is_the_pools_nbytes():
    """pool_layout_bytes counts what a pool of that layout allocates (all states counted as held)."""
    shape = LayerShape(H=H, HV=HV, K=K, V=V, state_dtype="float64", key_dtype="float64", cache_dtype="float64")
    want = pool_layout_bytes(shape, layers=L, num_buffer_slots=N, num_state_slots=S, capacity=C, max_drafts=D)
    got = pool_bytes(_pool("ref")).parts
    assert want == {"states": got["free_state_slots"], "buffer_entries": got["buffer_entries"],
                    "draft_room": got["draft_room"], "bookkeeping": got["bookkeeping"]}


def test_concurrency_by_hand_qwen3_next():
    """36 layers, 40 GiB, C = 16, 5 draft tokens, bf16 keys and u-cache, fp32 state."""
    shape = LayerShape(**QWEN3_NEXT, cache_dtype="bfloat16")
    S_ = 32 * 128 * 128 * 4                               # 2 MiB state
    e = 16 * 128 * 2 + 32 * 128 * 2 + 32 * 2              # 12352 bytes per entry
    per_layer_slot = (16 + 5) * e + 3 * 8 + 2 + 8 * 5     # a buffer slot: entries, draft room, bookkeeping
    budget = 40 * 2 ** 30
    # every request holds a state: per request 36 (|S| + 8 + per_layer_slot) + 1 (live)
    n = budget // (36 * (S_ + 8 + per_layer_slot) + 1)
    assert n == 506
    assert max_pool_requests(shape, budget_bytes=budget, layers=36, capacity=16, drafts=5) == n
    # half the requests stay within C: N buffer slots, ceil(N / 2) state slots
    half = max_pool_requests(shape, budget_bytes=budget, layers=36, capacity=16, drafts=5, direct_fraction=0.5)
    cost = lambda m: 36 * (m * per_layer_slot + -(-m // 2) * (S_ + 8)) + m  # noqa: E731
    assert cost(half) <= budget < cost(half + 1) and half == 912
    rows = concurrency_table(shape, budget_bytes=budget, layers=36, drafts=5, capacities=(16,),
                             direct_fractions=(0.0,))
    pds = budget // (36 * 6 * S_)                         # per-draft-state: 1 + 5 states per layer
    assert pds == 94
    assert rows == [dict(C=16, direct_fraction=0.0, pool_requests=506, per_draft_state_requests=94, ratio=506 / 94)]


def test_planner_edges_and_errors():
    shape = LayerShape(H=1, HV=1, K=1, V=1)
    one = sum(pool_layout_bytes(shape, layers=1, num_buffer_slots=1, num_state_slots=1, capacity=1,
                                max_drafts=0).values())
    assert max_pool_requests(shape, budget_bytes=one - 1, layers=1, capacity=1, drafts=0) == 0
    assert max_pool_requests(shape, budget_bytes=one, layers=1, capacity=1, drafts=0) == 1
    everyone_direct = max_pool_requests(shape, budget_bytes=10 * one, layers=1, capacity=1, drafts=0,
                                        direct_fraction=1.0)
    assert everyone_direct > 10                           # no state slot at all
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="direct_fraction"):
            max_pool_requests(shape, budget_bytes=one, layers=1, capacity=1, drafts=0, direct_fraction=bad)
    with pytest.raises(ValueError, match="budget_bytes"):
        max_pool_requests(shape, budget_bytes=-1, layers=1, capacity=1, drafts=0)
    with pytest.raises(ValueError, match="max_drafts"):
        pool_layout_bytes(shape, layers=1, num_buffer_slots=1, num_state_slots=1, capacity=1, max_drafts=-1)
    with pytest.raises(ValueError, match="pool"):
        pool_bytes(type("P", (), {"tensors": lambda self: {"state": torch.zeros(2, 3), "refs": torch.zeros(3)}})())


def test_cli_prints_the_table(capsys):
    from kvbuffer_ref.memory import _main
    _main(["--capacities", "16", "--direct-fractions", "0"])
    out = capsys.readouterr().out
    assert "36 layers" in out and "| 16 | 0 | 506 | 94 | 5.38x |" in out
