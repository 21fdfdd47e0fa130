"""Test-wide setup: the hypothesis profile (HYPOTHESIS_PROFILE=ci|thorough, default ci), NaN-poisoned
library outputs (KVBUFFER_POISON=1: every output kvbuffer_fast allocates starts as NaN, so an element a
kernel forgets to write fails) and, on a machine without CUDA, the Triton interpreter (set before
anything imports triton)."""

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVBUFFER_POISON", "1")

from kvbuffer_ref.validate import load_profile  # noqa: E402

load_profile()


def pytest_report_header(config):
    return [f"hypothesis profile: {os.environ.get('HYPOTHESIS_PROFILE', 'ci')}; "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; "
            f"KVBUFFER_POISON={os.environ.get('KVBUFFER_POISON', '0')}"]
