"""Tensor parallelism of the serving pool by heads, under torch.distributed with gloo on CPU.

Four processes, forked from one forkserver, form one gloo process group, started once for the module: the
world is a tp = 4 layout and ranks {0, 1}, {2, 3} two tp = 2 layouts.  A schedule of admit / decode / verify (chains and
trees) / accept / flush / fork / release drawn by hypothesis (``schedule.run_schedule``) runs in lock step
on one unsharded ``kvbuffer_ref.KVPool`` and on every rank's shard (``kvbuffer_ref.tp``: heads from
``tp_shard``, tokens sliced by ``shard_tokens``); each call's outputs are all-gathered per TP group and
required equal to the unsharded pool's: float64 bit for bit per head, float32 within the error table.
The gathered tp = 4 outputs are also checked against the float64 recurrence of each request, and the
shards' pool contents outside the addressed slots must stay bit-identical (tests/pool/tp_harness.py).
Layouts cover whole groups per rank, several groups per rank, and tp > H (q/k heads replicated).
"""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py does this too; kvbuffer_fast decorates kernels at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch.distributed as dist  # noqa: E402

from .schedule import run_schedule  # noqa: E402
from .tp_harness import TPPool, Workers  # noqa: E402

# one pytest-xdist worker runs this file (tests/conftest.py's ONE_WORKER): it starts the processes once
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

CI = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"
# (H, HV) of the model: tp = 2 and 4 hold 1 q/k head of 2 or 1 value heads (tp = 4 > H = 2: replicated);
# 2 q/k heads of 4 value heads (tp = 2) and 1 of 2 (tp = 4); one q/k head for all (replicated everywhere)
LAYOUTS = [(2, 4), (4, 8), (1, 4)]
SHAPES = dict(layers=2, N=5, C=3, D=3, K=4, V=3)   # K != V: a swapped axis is a shape error


@pytest.fixture(scope="module")
def workers():
    w = Workers(world_size=4)
    yield w
    w.close()


def _tp_pool(workers, impl, H, HV, dtype, layers, N, C, D, K, V, breaker=None):
    return TPPool(workers, impl=impl, H=H, HV=HV, dtype=dtype, breaker=breaker, layers=layers, num_state_slots=N,
                  num_buffer_slots=N, capacity=C, max_drafts=D, head_k_dim=K, head_v_dim=V,
                  device="cpu")


def _run(workers, data, impl, dtype, steps, shapes=SHAPES, breaker=None):
    H, HV = data.draw(st.sampled_from(LAYOUTS), label="(H, HV)")
    holder = {}

    def make():
        holder["pool"] = _tp_pool(workers, impl, H, HV, dtype, breaker=breaker, **shapes)
        return holder["pool"]

    run_schedule(make, data, dtype=dtype, device="cpu", steps=steps, H=H, HV=HV, **shapes)
    return holder["pool"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=3 if CI else 30, deadline=None)
@given(data=st.data())
def test_tp_shards_equal_the_unsharded_pool(workers, data, dtype):
    """Every output of every call, gathered from tp = 2 (both replicas) and tp = 4, equals the unsharded
    pool's (float64: bit for bit per head; float32: the error table), and the recurrence's."""
    pool = _run(workers, data, "ref", dtype, steps=8)
    assert all(n > 0 for n in pool.compared.values()), pool.compared


def _off_by_one_value_head(shard):
    """A wrong mapping: every rank's value heads shifted by one (mod HV), its q/k heads recomputed."""
    from kvbuffer_ref.pool import head_layout
    per = shard.local_value_heads
    start = (shard.value_heads[0] + 1) % shard.num_value_heads
    if start + per > shard.num_value_heads:
        start = 0
    h0, h, _ = head_layout(shard.num_heads, shard.num_value_heads, (start, start + per))
    return dataclasses.replace(shard, value_heads=(start, start + per), key_heads=(h0, h0 + h))


@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_a_wrong_shard_mapping_fails(workers, data):
    """The harness catches a mapping whose ranks hold other heads than they are given tokens for."""
    with pytest.raises(AssertionError, match="not bit-identical to the unsharded pool at value head"):
        _run(workers, data, "ref", torch.float64, steps=2, breaker=_off_by_one_value_head)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="gloo shards live in CPU memory, where Triton runs only interpreted (TRITON_INTERPRET=1); "
                           "scripts/tp_nccl.py runs the fast pool's shards on GPUs")
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_tp_shards_of_the_fast_pool(workers, data):
    """kvbuffer_fast.pool.KVPool (the interpreter on a CPU, float32): tp shards equal the unsharded fast
    pool within the error table (one short schedule: every kernel launch is interpreted)."""
    pool = _run(workers, data, "fast", torch.float32, steps=4, shapes=dict(SHAPES, layers=1, N=4))
    assert all(n > 0 for n in pool.compared.values()), pool.compared


def _script():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "tp_nccl.py")
    spec = importlib.util.spec_from_file_location("tp_nccl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nccl_script_cpu_pieces(capsys):
    """scripts/tp_nccl.py without GPUs: the NCCL run is skipped (exit 0, one JSON object), and the shards
    simulated side by side on the CPU (the reference pool, float64) equal the single pool bit for bit."""
    import json
    mod = _script()
    if not torch.cuda.is_available():
        assert mod.main([]) == 0
        out = json.loads(capsys.readouterr().out)
        assert "skipped" in out and out["torch"] == torch.__version__
    assert mod.main(["--cpu", "--simulate", "--steps", "2", "--warmup", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["correctness"]["passed"] and out["correctness"]["all_bit_identical"], out["correctness"]
    assert out["correctness"]["compared"] > 0 and len(out["decode_ms_per_layer"]["per_rank"]) == 2
    assert mod.main(["--cpu", "--tp", "3"]) == 1
    assert "world_size: 3 ranks" in json.loads(capsys.readouterr().out)["error"]
