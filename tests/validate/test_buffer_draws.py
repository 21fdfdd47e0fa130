"""Draws and checks of the buffer and speculative lanes that realistic wrong kernels need: each adapter here passes
without the draw (or check) and fails with it."""

import types

import torch

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes, runner
from kvbuffer.validate.cases import NORMAL


def _run(obj, ops, *, dtype=torch.float64, max_examples=1, seed=11):
    impl = adapters.describe(types.SimpleNamespace(name="planted", dtypes=(dtype,), **obj))
    rep = runner.run_validation([impl], ops=lanes.select_ops(ops), dtypes=[dtype], seed=seed,
                                max_examples=max_examples, shrink=False, progress=None, explain=False)
    return [r for r in rep.lanes if r.status != "NOT PROVIDED"]


SPEC = dict(verify=ref.verify, accept=ref.accept, buffered_decode=ref.buffered_decode, flush=ref.flush)
BUF = dict(buffered_decode=ref.buffered_decode, flush=ref.flush)


# ----------------------------------------------------------------------------- verify's padding rows hold NaN
def _padding_leaks(q, k, v, *, g, beta, buffer, parents=None, num_drafts=None, scale=None):
    """Dense [D, D] products that mask by multiplying by 0: a padding row's NaN reaches the verified rows."""
    o, d = ref.verify(q, k, v, g=g, beta=beta, buffer=buffer, parents=parents, num_drafts=num_drafts, scale=scale)
    nd = [q.shape[1]] * q.shape[0] if num_drafts is None else num_drafts.tolist()
    o = o.clone()
    for b, t in enumerate(nd):
        o[b, :t] = o[b, :t] + 0.0 * v[b, t:].sum()
    return o, d


def test_verify_padding_rows_are_poisoned():
    (r,) = _run(dict(SPEC, verify=_padding_leaks), "verify_chain[u]")
    assert r.status == "FAIL", (r.status, r.failure)


# ----------------------------------------------------------------------------- parents=None, num_drafts=None
def _default_parents_star(q, k, v, *, g, beta, buffer, parents=None, num_drafts=None, scale=None):
    if parents is None:
        parents = torch.full(q.shape[:2], -1, dtype=torch.long)
    return ref.verify(q, k, v, g=g, beta=beta, buffer=buffer, parents=parents, num_drafts=num_drafts, scale=scale)


def test_verify_defaults_are_drawn():
    (r,) = _run(dict(SPEC, verify=_default_parents_star), "verify_chain[u]")
    assert r.status == "FAIL" and r.klass == "arguments" and "parents=None" in r.why, (r.status, r.klass, r.why)


def test_the_boundary_chains_pass_the_defaults_and_int32_indices():
    for key in ("verify_chain", "verify_tree"):
        for p in lanes.edge_params(key, NORMAL):
            assert p["index_dtype"] == "int32" and p["scalar"] and p["defaults"] == (key == "verify_chain")


# ----------------------------------------------------------------------------- int32 index tensors
def _int32_read_as_int64(q, k, v, *, g, beta, buffer, parents=None, num_drafts=None, scale=None):
    """A kernel whose pointers are typed int64 reads an int32 parents tensor two values at a time."""
    if parents is not None and parents.dtype != torch.int64:
        flat = parents.reshape(-1).tolist() + [0] * parents.numel()
        wide = [flat[2 * i] + (flat[2 * i + 1] << 32) for i in range(parents.numel())]
        parents = torch.tensor(wide).reshape(parents.shape)
        ok = (parents >= -1) & (parents < torch.arange(parents.shape[1])[None])
        parents = torch.where(ok, parents, torch.full_like(parents, -1))
    return ref.verify(q, k, v, g=g, beta=beta, buffer=buffer, parents=parents, num_drafts=num_drafts, scale=scale)


def test_int32_index_tensors_are_drawn():
    (r,) = _run(dict(SPEC, verify=_int32_read_as_int64), "verify_tree[u]")
    assert r.status == "FAIL" and r.klass == "arguments" and "int32" in r.why, (r.status, r.klass, r.why)


# ----------------------------------------------------------------------------- Python int counts
def _int_counts_as_node(buffer, drafts, *, counts=None, nodes=None):
    if isinstance(counts, int):
        return ref.accept(buffer, drafts, nodes=counts)
    return ref.accept(buffer, drafts, counts=counts, nodes=nodes)


def _flush_int_as_all(buffer, *, count=None):
    return ref.flush(buffer, count=None if isinstance(count, int) else count)


def test_int_accept_counts_are_drawn():
    (r,) = _run(dict(SPEC, accept=_int_counts_as_node), "verify_chain[u]")
    assert r.status == "FAIL" and r.klass == "arguments" and "Python int" in r.why, (r.status, r.klass, r.why)


def test_int_flush_counts_are_drawn():
    (r,) = _run(dict(BUF, flush=_flush_int_as_all), "flush[u]")
    assert r.status == "FAIL" and "lengths" in r.failure["error"], (r.status, r.failure)


# ----------------------------------------------------------------------------- buffers without state storage
def _flush_allocates_garbage(buffer, *, count=None):
    """state=None: storage allocated uninitialised (NaN here) and every request marked as owning it."""
    if buffer.state is None:
        B, HV, K, V = buffer.batch, buffer.num_value_heads, buffer.head_k_dim, buffer.head_v_dim
        buffer = buffer.replace(state=torch.full((B, HV, K, V), float("nan"), dtype=buffer.values.dtype),
                                has_state=torch.ones_like(buffer.has_state))
    return ref.flush(buffer, count=count)


def test_stateless_buffers_are_drawn():
    for op in ("decode[u]", "flush[u]"):
        (r,) = _run(dict(BUF, flush=_flush_allocates_garbage), op)
        assert r.status == "FAIL", (op, r.status, r.failure)


def _materialize_returns_storage(buffer):
    if buffer.state is not None and bool((buffer.lengths == 0).all()) and bool(buffer.has_state.all()):
        return buffer.state
    return ref.materialize_state(buffer)


def test_materialize_anchors_cover_empty_and_stateless_buffers():
    (r,) = _run(dict(materialize_state=_materialize_returns_storage), "materialize[u]")
    assert r.status == "FAIL" and r.klass == "state-leak" and "shares memory" in r.failure["error"], r.failure
    assert any(a.get("stateless") for a in lanes.ANCHORS["materialize"])


# ----------------------------------------------------------------------------- prefill keeps exactly its tail
def _prefill_tail_multiple(q, k, v, *, capacity, tail=None, **kw):
    T = q.shape[1]
    if tail is None and T > capacity:
        tail = (T - 1) % capacity + 1  # a prompt of a multiple of C leaves a full buffer
    return ref.prefill(q, k, v, capacity=capacity, tail=tail, **kw)


def _prefill_tail_mod(q, k, v, *, capacity, tail=None, **kw):
    return ref.prefill(q, k, v, capacity=capacity, tail=q.shape[1] % capacity if tail is None else tail, **kw)


def test_prefill_lengths_follow_the_tail():
    for fn in (_prefill_tail_multiple, _prefill_tail_mod):
        (r,) = _run(dict(BUF, prefill=fn), "prefill[u]")
        assert r.status == "FAIL" and r.klass == "arguments" and "default tail" in r.failure["error"], r.failure
