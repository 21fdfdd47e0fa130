"""admit of a variable-length batch (``cu_seqlens``), as engines batch prompts: prompts longer and shorter
than the capacity, an empty one and a pad (-1) whose prompt is garbage, in one call, on both pools; every
request's outputs, its state and the decode step that follows against the float64 recurrence over its own
tokens (the error table's budget), the pad's prompt never read."""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvbuffer_fast.pool as fast_pool  # noqa: E402
import kvbuffer_ref.pool as ref_pool  # noqa: E402

from .schedule import FIELDS, Checker, Tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K, V, C = 1, 2, 4, 4, 3
KINDS = {"ref": (ref_pool.KVPool, torch.float64, "cpu"), "fast": (fast_pool.KVPool, torch.float32, DEVICE)}


def _pool(kind):
    cls, dtype, dev = KINDS[kind]
    kw = dict(dtype=dtype) if kind == "ref" else dict(device=dev)
    return cls(layers=1, num_state_slots=6, num_buffer_slots=6, capacity=C, max_drafts=2, num_heads=H,
               num_value_heads=HV, head_k_dim=K, head_v_dim=V, **kw)


@pytest.mark.parametrize("kind", ["ref", "fast"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_admit_of_a_varlen_batch(kind, index_dtype):
    _, dtype, dev = KINDS[kind]
    pool = _pool(kind)
    tok, chk = Tokens(11, H, HV, K, V, dtype, "cpu"), Checker(dtype, C)
    lengths = [5, 2, 0, 2, 7, 1]                  # entry 1 is a pad: its 2 tokens are NaN, never to be read
    got = pool.acquire(5).tolist()
    slots = torch.tensor([got[0], -1, got[1], got[2], got[3], got[4]], dtype=index_dtype, device=dev)
    prompts = [{f: t[0] for f, t in tok.draw(1, n).items()} for n in lengths]
    prompts[1] = {f: torch.full_like(t, float("nan")) for f, t in prompts[1].items()}
    packed = {f: torch.cat([p[f] for p in prompts], 0)[None].to(dev) for f in FIELDS}
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=index_dtype, device=dev)
    o = pool.admit(**packed, layer=0, slots=slots, cu_seqlens=cu)
    assert o.shape == (1, offsets[-1], HV, V)
    live = [n for n in range(len(lengths)) if n != 1]
    for n in live:
        a, b = offsets[n], offsets[n + 1]
        if b > a:
            chk.check(o[0, a:b].cpu(), {f: t[:0] for f, t in prompts[n].items()}, prompts[n], f"admit o[{n}]")
        S = pool.state_of(layer=0, slots=slots[n:n + 1])[0].cpu()
        chk.check_state(S, prompts[n], f"admit state[{n}]")
    if kind == "ref":
        assert bool((o[0, offsets[1]:offsets[2]] == 0).all())
    # the tails are in the buffers: one decode step continues every prompt
    new = tok.draw(len(lengths), 1)
    o2 = pool.decode(**{f: t.to(dev) for f, t in new.items()}, layer=0, slots=slots)
    for n in live:
        chk.check(o2[n].cpu(), prompts[n], {f: t[n] for f, t in new.items()}, f"decode after admit[{n}]")


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_bad_varlen_admits_name_the_argument(kind):
    _, dtype, dev = KINDS[kind]
    pool = _pool(kind)
    s = pool.acquire(2).to(dev)
    x = {f: t.to(dev) for f, t in Tokens(1, H, HV, K, V, dtype, "cpu").draw(1, 5).items()}
    with pytest.raises(ValueError, match=r"cu_seqlens: expected 3 offsets \(one prompt per entry of slots\)"):
        pool.admit(**x, layer=0, slots=s, cu_seqlens=torch.tensor([0, 5], device=dev))
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets from 0 to T = 5"):
        pool.admit(**x, layer=0, slots=s, cu_seqlens=torch.tensor([0, 3, 4], device=dev))
    two = {f: torch.cat([t, t], 0) for f, t in x.items()}
    with pytest.raises(ValueError, match="q: with cu_seqlens the sequences are concatenated along T in a batch of B = 1"):
        pool.admit(**two, layer=0, slots=s, cu_seqlens=torch.tensor([0, 2, 5], device=dev))
    assert int(pool.tensors()["lengths"].sum()) == 0  # nothing written


@pytest.mark.parametrize("kind", ["ref", "fast"])
def test_a_varlen_admit_of_pads_only_writes_nothing(kind):
    _, dtype, dev = KINDS[kind]
    pool = _pool(kind)
    pool.acquire(2)
    x = {f: t.to(dev) for f, t in Tokens(2, H, HV, K, V, dtype, "cpu").draw(1, 4).items()}
    o = pool.admit(**x, layer=0, slots=torch.tensor([-1, -1], device=dev), cu_seqlens=torch.tensor([0, 1, 4], device=dev))
    assert o.shape == (1, 4, HV, V)
    assert int(pool.tensors()["lengths"].sum()) == 0 and not bool(pool.tensors()["has_state"].any())
