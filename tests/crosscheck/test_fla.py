"""Agreement with flash-linear-attention (fla-core 0.6.0), an independent implementation.

* ``naive_recurrent_gated_delta_rule`` and ``naive_chunk_gated_delta_rule`` (pure torch, float32);
* ``fused_recurrent_gated_delta_rule`` (Triton) under the interpreter on CPU, float32, tiny shapes,
  including per-channel (KDA, ``gk``) gates and grouped heads, and replaying the golden buffered
  histories (decode, chain verify) as plain recurrences.

fla's chunk kernels run under the interpreter through the validator's adapter
(tests/validate/test_fla_kda.py), not here.
Conventions mapped in tests/crosscheck/adapters.py and docs/crosscheck.md.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention not installed (pip install -e '.[crosscheck]')", allow_module_level=True)

from .common import expected_import_warnings  # noqa: E402

with expected_import_warnings():  # fla is installed: an import that fails is a failure, not a skip
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.gated_delta_rule.naive  # noqa: F401

from . import adapters  # noqa: E402
from .common import (BUFFERED_CASES, RANDOM_CASES, SCALAR_CASES, SEQUENCE_CASES, check_golden,  # noqa: E402
                     check_random, replay_histories)


def _triton_interpretable():
    import os

    import torch

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


needs_triton = pytest.mark.skipif(not _triton_interpretable(),
                                  reason="no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it on CPU)")


@pytest.mark.parametrize("case", SCALAR_CASES, ids=lambda c: c.id)
def test_naive_recurrent_matches_golden(case):
    check_golden(case, adapters.namespace(adapters.fla_naive_recurrent))


@pytest.mark.parametrize("case", SCALAR_CASES, ids=lambda c: c.id)
def test_naive_chunk_matches_golden(case):
    check_golden(case, adapters.namespace(adapters.fla_naive_chunk, default_chunk=4))


@needs_triton
@pytest.mark.parametrize("case", SEQUENCE_CASES, ids=lambda c: c.id)
def test_fused_recurrent_matches_golden(case):
    check_golden(case, adapters.namespace(adapters.fla_fused_recurrent))


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: f"seed{c.seed}")
def test_naive_forms_match_random_cases(case):
    check_random(case, adapters.fla_naive_recurrent, channel_ok=False)
    check_random(case, adapters.fla_naive_chunk, channel_ok=False, chunk=64)  # default chunk_size 64


@needs_triton
@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: f"seed{c.seed}")
def test_fused_recurrent_matches_random_cases(case):
    check_random(case, adapters.fla_fused_recurrent, channel_ok=True)


@needs_triton
@pytest.mark.parametrize("case", BUFFERED_CASES, ids=lambda c: c.id)
def test_fused_recurrent_replays_buffered_histories(case):
    """The golden decode / chain-verify expectations, rebuilt by fla's recurrent kernel."""

    def run(q, k, v, g, beta, h0, scale):
        return adapters.fla_fused_recurrent(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                            output_final_state=True)

    replay_histories(case, run)
