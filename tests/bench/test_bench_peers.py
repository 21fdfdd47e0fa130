"""The peers in the benchmark: the serving pool's ops (and ``round_cycle_fold``, sharing the run) and SGLang's
packed decode (where its wheel is in the checkout's .whl/sglang/) run end to end under --smoke (CPU, Triton
interpreter), ReplaySSM's ops skip there with the reason, and their cases (ring layout, cursors, the state the
kernels would reconstruct) match the oracle when driven through the PyTorch model of ReplaySSM's kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton not installed: the benchmarks time the Triton kernels")

ROOT = Path(__file__).resolve().parents[2]
#: the smoke's layers: one, the runner's layer loop and its op counts are the second-root smoke's to check at two
#: (tests/bench/test_bench_smoke.py), a pool's layers the pool tests' (tests/pool)
LAYERS = 1
POOL_OPS = ("buffered_decode,pool_decode,pool_decode_engine,round,pool_round,pool_round_per_layer,pool_round_cycle,"
            "pool_round_cycle_fold")


def _sglang_wheel() -> bool:
    from bench.workloads import SGLANG_PATH
    from kvbuffer.peers import sglang as sg

    return bool(sg._tree(Path(SGLANG_PATH)))


def test_smoke_runs_the_pool_ops_and_skips_replayssm(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in [n for n in env if n.startswith("PYTEST_")]:
        env.pop(name)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--layers", str(LAYERS), "--out", str(out),
                        "--peer-path", "/nonexistent",
                        "--ops", POOL_OPS + ",round_cycle_fold,round_cycle_fold_bf16,buffered_decode_bf16,sglang_decode,"
                        "replayssm_decode,replayssm_round"], cwd=ROOT,
                       env=env,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "gpu.json").read_text())
    tree = data["trees"]["after"]
    assert not tree["failures"], tree["failures"]
    rows = {row["op"]: row for row in tree["rows"]}
    wheel = _sglang_wheel()
    assert set(rows) == (set(POOL_OPS.split(",")) | {"round_cycle_fold", "round_cycle_fold_bf16", "buffered_decode_bf16"}
                         | ({"sglang_decode"} if wheel else set()))
    # the 16-bit state ops (float16 under the interpreter): the state checked in it, the round's outputs as fp32
    cycle16 = rows["round_cycle_fold_bf16"]
    assert cycle16["state_dtype"] == "float16"
    assert sorted(c["dtype"] for c in cycle16["checks"]) == ["float16", "float32", "float32"]
    assert [c["dtype"] for c in cycle16["checks"] if "state_after_cycle" in c["name"]] == ["float16"]
    for row in rows.values():
        assert row["checks"] and all(c["passed"] for c in row["checks"]) and row["within_budget"], row
    assert rows["pool_decode"]["ops_per_replay"] == LAYERS * 4  # layers x a cycle of C steps
    assert rows["pool_decode_engine"]["ops_per_replay"] == LAYERS * 4 and rows["pool_decode_engine"]["vs_pool_decode"] > 0
    assert rows["pool_round"]["vs_round"] > 0 and rows["pool_round_per_layer"]["vs_pool_round"] > 0
    assert rows["pool_round_cycle"]["ops_per_replay"] == LAYERS * 3 and rows["pool_round_cycle"]["vs_pool_round"] > 0
    # pool_round_cycle with the folding round's pool.verify(fold=True): its first and folding rounds' outputs and the
    # state after the cycle
    fold = rows["pool_round_cycle_fold"]
    assert fold["ops_per_replay"] == LAYERS * 3 and len(fold["checks"]) == 3 and fold["vs_pool_round_cycle"] > 0
    # round_cycle_fold (kvbuffer_fast's cycle with the folding round's verify(fold=True)), run here to share the
    # runner's start: its first and folding rounds' outputs and the state after the cycle
    assert rows["round_cycle_fold"]["ops_per_replay"] == LAYERS * 3 and len(rows["round_cycle_fold"]["checks"]) == 3
    # a cycle's bytes are per round, as its time (a cycle's total would put its floor R times too high)
    for op in ("round_cycle_fold", "round_cycle_fold_bf16", "pool_round_cycle", "pool_round_cycle_fold"):
        assert 0.5 < rows[op]["io_bytes"] / rows["round"]["io_bytes"] < 2, (op, rows[op]["io_bytes"])
    skipped = {s["op"]: s["reason"] for s in tree["skips"]}
    assert set(skipped) == {"replayssm_decode", "replayssm_round"} | (set() if wheel else {"sglang_decode"})
    assert all("Triton interpreter" in skipped[op] for op in ("replayssm_decode", "replayssm_round"))
    if wheel:  # SGLang's packed decode: one token per layer, checked (output and pool state), a peer of both decodes
        assert rows["sglang_decode"]["ops_per_replay"] == LAYERS and len(rows["sglang_decode"]["checks"]) == 2
        assert rows["buffered_decode"]["vs_sglang_decode"] > 0 and rows["pool_decode"]["vs_sglang_decode"] > 0
        assert rows["pool_decode_engine"]["vs_sglang_decode"] > 0
        assert data["sglang_path"].endswith(os.path.join(".whl", "sglang"))
    else:
        assert "--sglang-path" in skipped["sglang_decode"]
    md = (out / "report.md").read_text()
    assert "pool_round / round" in md and "pool_round_per_layer / pool_round" in md and "replayssm_round" in md


def _replayssm_api(**replace):
    from bench import workloads as W
    from kvbuffer.peers.replayssm import emulation

    em = emulation(**replace)
    api = W.Api()
    api.replayssm = lambda device: (types.SimpleNamespace(
        fused_recurrent_gated_delta_rule_replayssm=em.fused_recurrent_gated_delta_rule_replayssm),
        types.SimpleNamespace(gdn_replayssm_spec_decode=em.gdn_replayssm_spec_decode,
                              commit_gdn_replayssm_spec=em.commit_gdn_replayssm_spec))
    return W, api


@pytest.mark.parametrize("op", ["replayssm_decode", "replayssm_round", "replayssm_round_cycle"])
def test_replayssm_cases_match_the_oracle_through_the_kernel_model(op):
    W, api = _replayssm_api()
    case = W.build(op, api, W.Workload(W.SMOKE, 3, "cpu"))
    assert case.peer and case.passed, [c["text"] for c in case.checks]
    assert len(case.checks) == 2 and case.io_bytes > 0
    case.run()  # a replay: the cursors restored (round) or a whole ring cycle (decode)


def test_replayssm_cycle_bytes_are_per_round():
    """The ring cycle's bytes per round (its time is per round and layer), within 2x of one round's."""
    W, api = _replayssm_api()
    wl = W.Workload(W.SMOKE, 3, "cpu")
    one, cycle = W.build("replayssm_round", api, wl), W.build("replayssm_round_cycle", api, wl)
    assert 0.5 < cycle.io_bytes / one.io_bytes < 2, (cycle.io_bytes, one.io_bytes)


@pytest.mark.parametrize("op, check", [("replayssm_round", "state_after_commit"),
                                       ("replayssm_round_cycle", "state_after_cycle")])
def test_a_wrong_cursor_model_fails_the_round_check(op, check):
    from kvbuffer.peers.replayssm import _em_commit

    def no_advance(write_pos, cache_base, is_flush, num_accepted, state_batch_indices, **kw):
        _em_commit(write_pos, cache_base, is_flush, num_accepted * 0, state_batch_indices, **kw)
    W, api = _replayssm_api(commit_gdn_replayssm_spec=no_advance)
    case = W.build(op, api, W.Workload(W.SMOKE, 3, "cpu"))
    assert not case.passed and check in next(c["name"] for c in case.checks if not c["passed"])


def test_replayssm_ops_say_how_to_give_a_checkout():
    from bench import workloads as W

    with pytest.raises(W.Skip, match="--peer-path"):
        W.Api(peer_path=None).replayssm("cuda")
    with pytest.raises(W.Skip, match="no vllm/model_executor/layers/fla/ops"):
        W.Api(peer_path="/nonexistent").replayssm("cuda")
