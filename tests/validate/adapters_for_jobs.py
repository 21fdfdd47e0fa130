"""Adapters for the tests of ``kvbuffer validate --jobs``: one that ends the process that runs it."""

import multiprocessing
import os
import types

import torch


def _crashing_direct(q, k, v, *, g, beta, scale=None):
    """Ends its process at once, as a segmentation fault would; raises instead outside a worker process (where
    it would end the test run)."""
    if multiprocessing.parent_process() is None:
        raise RuntimeError("crashes only in a worker process")
    os._exit(3)


#: Ends the worker process that runs it (direct, float64).
crashes = types.SimpleNamespace(name="crashes", dtypes=(torch.float64,), direct_gated_delta_rule=_crashing_direct)
