"""Peer adapters loaded from a checkout: ReplaySSM (skipped unless $KVBUFFER_PEER_PATH names a checkout)."""

import os

import pytest

from kvbuffer_ref.validate import adapters
from kvbuffer_ref.validate import cli as kcli

PEER = os.environ.get("KVBUFFER_PEER_PATH")


def test_without_a_checkout_the_adapter_says_how_to_give_one(monkeypatch, capsys):
    monkeypatch.delenv("KVBUFFER_PEER_PATH", raising=False)
    with pytest.raises(adapters.AdapterError, match="--peer-path <checkout>"):
        adapters.resolve("replayssm")
    assert kcli.main(["validate", "--impl", "replayssm", "--peer-path", "/nonexistent/checkout"]) == 2
    assert "no vllm/model_executor/layers/fla/ops/fused_recurrent_replayssm.py there" in capsys.readouterr().err


@pytest.mark.skipif(not PEER, reason="set KVBUFFER_PEER_PATH to a ReplaySSM checkout to test its adapter")
def test_the_replayssm_kernel_loads_from_the_checkout_without_vllm():
    import sys
    impl = adapters.resolve("replayssm")
    assert impl.contract == "tf32" and impl.has("recurrent_gated_delta_rule")
    assert not any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)  # the shims are gone again
    if impl.interpreted:
        assert "Triton interpreter" in impl.unavailable
