"""Every call of an implementation runs with fresh allocations filled with NaN (``poisoned_allocations``),
without its cooperation: an output left partly unwritten fails, on the CPU too."""

import types
import warnings

import torch
import torch.utils.deterministic as det

import kvbuffer_ref as ref
from kvbuffer.validate import adapters, lanes, runner


def _one_row_unwritten(q, k, v, *, g, beta, scale=None):
    o = ref.direct_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale)
    out = torch.empty(o.shape, dtype=o.dtype, device=o.device)  # as a kernel's wrapper allocates
    out[:, :-1] = o[:, :-1]  # the last token's row is never written
    return out


def test_an_unwritten_output_row_fails_as_non_finite():
    impl = adapters.describe(types.SimpleNamespace(name="unwritten", dtypes=(torch.float64,),
                                                   direct_gated_delta_rule=_one_row_unwritten))
    rep = runner.run_validation([impl], ops=lanes.select_ops("direct"), dtypes=[torch.float64], seed=3,
                                max_examples=2, shrink=False, progress=None)
    (r,) = [r for r in rep.lanes if r.status != "NOT PROVIDED"]
    assert r.status == "FAIL", (r.status, r.klass, r.why)
    assert any("non-finite" in c for c in r.failure["comparisons"]), r.failure["comparisons"]


def test_poisoned_allocations_fill_and_restore():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              det.fill_uninitialized_memory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warn_only notes are silenced inside
        with adapters.poisoned_allocations():
            assert torch.empty(3, 4).isnan().all() and torch.empty_like(torch.zeros(2)).isnan().all()
            assert (torch.empty(3, dtype=torch.long) == torch.iinfo(torch.long).max).all()
    after = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             det.fill_uninitialized_memory)
    assert after == before


def test_poisoned_allocations_restore_after_an_exception():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        with adapters.poisoned_allocations():
            raise RuntimeError("x")
    except RuntimeError:
        pass
    assert torch.are_deterministic_algorithms_enabled() == before
