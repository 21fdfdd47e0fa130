"""Peer adapters loaded from a checkout: ReplaySSM (skipped unless $KVBUFFER_PEER_PATH names a checkout)."""

import os

import pytest

from kvbuffer.validate import adapters

from kvbuffer import implementations
from kvbuffer import cli as kcli

PEER = os.environ.get("KVBUFFER_PEER_PATH")


def test_without_a_checkout_the_adapter_says_how_to_give_one(monkeypatch, capsys):
    monkeypatch.delenv("KVBUFFER_PEER_PATH", raising=False)
    with pytest.raises(adapters.AdapterError, match="--peer-path <checkout>"):
        implementations.resolve("replayssm")
    assert kcli.main(["validate", "--impl", "replayssm", "--peer-path", "/nonexistent/checkout"]) == 2
    assert "no vllm/model_executor/layers/fla/ops/fused_recurrent_replayssm.py there" in capsys.readouterr().err


@pytest.mark.skipif(not PEER, reason="set KVBUFFER_PEER_PATH to a ReplaySSM checkout to test its adapter")
def test_the_replayssm_kernel_loads_from_the_checkout_without_vllm():
    import sys
    impl = implementations.resolve("replayssm")
    assert impl.contract == "tf32" and impl.has("recurrent_gated_delta_rule")
    assert not any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)  # the shims are gone again
    if impl.interpreted:
        assert "Triton interpreter" in impl.unavailable


# ----------------------------------------------------------------------------- the mapping, on the CPU
# ReplaySSM's kernels do not run under the Triton interpreter: the adapter is validated here through
# peers.emulation(), a float64 PyTorch model of what its kernels compute (read from their source), held to
# IEEE float32's budget; the GPU run then only has to show that the kernels compute what the model does.
LANES = [("recurrent", None), ("verify_chain", None), ("decode", None), ("flush", None)]


def _lanes(kernels, ops=LANES, seed=3, n=4):
    import torch

    from kvbuffer.peers import replayssm as peers
    from kvbuffer.validate.runner import run_validation

    impl = adapters.describe(peers.ReplaySSM(kernels=kernels, name="replayssm-model"))
    rep = run_validation([impl], ops=ops, dtypes=[torch.float32], seed=seed, max_examples=n, progress=None,
                         explain=False)
    return {r.operation: r for r in rep.lanes}


def test_the_mapping_passes_through_the_kernel_model():
    from kvbuffer.peers import replayssm as peers

    lanes = _lanes(peers.emulation())
    for op in ("recurrent", "verify_chain[u]", "decode[u]", "flush[u]"):
        assert lanes[op].status == "PASS", (op, lanes[op].failure)
        assert lanes[op].checks > 0


def test_a_cursor_kernel_that_forgets_the_flush_rebase_fails_verify():
    from kvbuffer.peers import replayssm as peers

    def no_rebase(write_pos, cache_base, is_flush, num_accepted, state_batch_indices, **kw):
        base = cache_base.clone()
        peers._em_commit(write_pos, cache_base, is_flush, num_accepted, state_batch_indices, **kw)
        cache_base.copy_(base)  # the history no longer starts at the window after a flush round
    lanes = _lanes(peers.emulation(commit_gdn_replayssm_spec=no_rebase), ops=[("verify_chain", None)])
    assert lanes["verify_chain[u]"].status == "FAIL"


def test_a_flush_launch_that_does_not_fold_fails_decode():
    from kvbuffer.peers import replayssm as peers

    def no_fold(*a, is_flush, **kw):
        return peers._em_spec(*a, is_flush=torch_zeros_like(is_flush), **kw)
    lanes = _lanes(peers.emulation(gdn_replayssm_spec_decode=no_fold), ops=[("decode", None)])
    assert lanes["decode[u]"].status == "FAIL"


def torch_zeros_like(x):
    import torch
    return torch.zeros_like(x)


def test_a_draft_tree_is_refused_with_the_reason():
    import torch

    from kvbuffer.peers import replayssm as peers

    lanes = _lanes(peers.emulation(), ops=[("verify_tree", None), ("recurrent", None)], n=1)
    lane = lanes["verify_tree"]
    assert lane.status == "NOT PROVIDED" and "one chain per request" in lane.reason, (lane.status, lane.reason)
    ad = peers.ReplaySSM(kernels=peers.emulation())
    assert "verify_tree" in ad.not_provided and ad.contract == "ieee"  # the model is float64: strictest budget
    assert peers.ReplaySSM.contract == "tf32"  # the kernels' own: tl.dot of float32 operands on a GPU
    del torch


@pytest.mark.skipif(not PEER, reason="set KVBUFFER_PEER_PATH to a ReplaySSM checkout to test its adapter")
def test_the_model_and_the_adapter_call_the_checkouts_api():
    """The kernel wrappers' parameters are the model's (same names, same order), so the calls the adapter
    and the benchmark make with the model on the CPU are the calls they make with the kernels on a GPU;
    the launch table is the checkout's own (its tuned GDN configs, vllm.platforms shimmed)."""
    import inspect

    from kvbuffer.peers import replayssm as peers

    ad = peers.ReplaySSM(PEER)
    em = peers.emulation()
    for name in ("fused_recurrent_gated_delta_rule_replayssm", "gdn_replayssm_spec_decode", "commit_gdn_replayssm_spec"):
        real = [p for p in inspect.signature(getattr(ad._k, name)).parameters]
        model = [p for p in inspect.signature(getattr(em, name)).parameters if p != "_launch"]
        assert real[:len(model)] == model, (name, real, model)
    assert ad.config_source == "checkout", ad.config_source
    for T in (1, 2, 5, 6, 16):
        assert ad._k.get_replayssm_config("gdn_spec_verify", max_spec_len=T) == em.get_replayssm_config(
            "gdn_spec_verify", max_spec_len=T)
    assert ad._k.get_replayssm_config("gdn_decode", L=4) == em.get_replayssm_config("gdn_decode", L=4)
