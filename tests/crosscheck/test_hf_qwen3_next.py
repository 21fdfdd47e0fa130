"""Agreement with HF transformers' Qwen3-Next torch fallbacks of the gated delta rule.

``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule`` from
``transformers.models.qwen3_next.modeling_qwen3_next``: float32, scalar gates, grouped heads native,
no scale argument (q always scaled by K^-0.5).  When fla is installed the module-level names dispatch to
fla's kernels; the adapters unwrap them to reach the torch code (see adapters.hf_torch_fallbacks).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("HF transformers not installed (pip install -e '.[crosscheck]')", allow_module_level=True)
from .common import expected_import_warnings  # noqa: E402

# transformers is installed: a Qwen3-Next module that does not import is a failure, not a skip
with expected_import_warnings():
    from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: F401

from . import adapters  # noqa: E402
from .common import BUFFERED_CASES, RANDOM_CASES, SCALAR_CASES, check_golden, check_random, replay_histories  # noqa: E402,E501


def test_fallbacks_are_the_torch_code():
    fns = adapters.hf_torch_fallbacks()
    assert set(fns) == {"torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"}


@pytest.mark.parametrize("case", SCALAR_CASES, ids=lambda c: c.id)
def test_recurrent_matches_golden(case):
    check_golden(case, adapters.namespace(adapters.hf_recurrent))


@pytest.mark.parametrize("case", SCALAR_CASES, ids=lambda c: c.id)
def test_chunk_matches_golden(case):
    check_golden(case, adapters.namespace(adapters.hf_chunk, default_chunk=4))


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: f"seed{c.seed}")
def test_random_cases(case):
    check_random(case, adapters.hf_recurrent, channel_ok=False)
    check_random(case, adapters.hf_chunk, channel_ok=False, chunk=64)  # default chunk_size 64


@pytest.mark.parametrize("case", [c for c in BUFFERED_CASES if c.params["gate"] == "scalar"], ids=lambda c: c.id)
def test_chunk_replays_buffered_histories(case):
    """The golden decode / chain-verify expectations, rebuilt by HF's chunked fallback (chunk_size 4)."""

    def run(q, k, v, g, beta, h0, scale):
        return adapters.hf_chunk(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
                                 chunk_size=4)

    replay_histories(case, run, chunk=4)
