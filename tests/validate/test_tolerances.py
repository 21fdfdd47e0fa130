"""The error policy's budget (kvbuffer.validate.tolerances): per (request, head) slice,
``err <= kappa x baseline_err + floor x eps(compute) + tiny / rms(ref)``, the baseline what a correct
implementation computes in the compute dtype (``properties.truth_and_baseline``); what it admits, what it
still rejects (1 % off in q, g or beta), and the line that reports it."""

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import properties as P
from kvbuffer.validate.cases import Case
from kvbuffer.validate.contracts import emulate
from kvbuffer.validate.tolerances import (GAIN_MIN_SLICES, TOLERANCES, active_contract, assert_matches, compare,
                                          compute_dtype, current_contract, rel_rms_slices, tolerance_for)

EPS32 = torch.finfo(torch.float32).eps


def _pair(shape=(2, 3, 2, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return e, e.float()


# ----------------------------------------------------------------------------- the metric and its edges
def test_rel_rms_slices_is_per_request_and_head():
    e = torch.ones(2, 3, 2, 4, dtype=torch.float64)
    a = e.clone()
    a[1, :, 0] *= 1.5  # only (request 1, head 0)
    r = rel_rms_slices(a, e)
    assert r.shape == (2, 2) and r[1, 0] == pytest.approx(0.5) and r.sum() == pytest.approx(0.5)
    S = torch.ones(2, 2, 3, 3, dtype=torch.float64)  # states [B, HV, K, V]: heads on axis 1
    Sa = S.clone()
    Sa[0, 1] = 0.0
    assert rel_rms_slices(Sa, S, head_axis=1)[0, 1] == pytest.approx(1.0)
    valid = torch.zeros(2, 3, 1, 1, dtype=torch.bool)  # every row padding: nothing counted
    assert rel_rms_slices(a, e, valid=valid).sum() == 0
    z = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    assert rel_rms_slices(z, z).item() == 0.0 and rel_rms_slices(z + 1, z).item() == float("inf")  # 0/0, x/0


def test_nan_or_inf_never_passes():
    e, a = _pair()
    for bad in (float("nan"), float("inf")):
        x = a.clone()
        x[0, 0, 0, 0] = bad
        c = compare(x, e, [a, x])  # not even against a baseline that is itself non-finite
        assert not c.passed and c.nonfinite == 1 and c.ratio == float("inf")
        assert rel_rms_slices(x, e)[0, 0] == float("inf")


def test_shape_errors_name_the_argument():
    e, a = _pair()
    with pytest.raises(ValueError, match="actual: shape"):
        compare(a[:1], e)
    with pytest.raises(ValueError, match=r"baseline: shape"):
        compare(a, e, a[:1])
    with pytest.raises(ValueError, match=r"baseline\[1\]: shape"):
        compare(a, e, [a, a[:1]])
    with pytest.raises(TypeError, match="expected: the truth must be float64"):
        compare(a, e.float())
    with pytest.raises(ValueError, match="head_axis"):
        compare(a, e, head_axis=4)
    with pytest.raises(ValueError, match="contract: expected one of"):
        compare(a, e, a, contract="fp8")
    with pytest.raises(ValueError, match="dtype: no tolerance"):
        tolerance_for(torch.int32)


@pytest.mark.parametrize("shape, head_axis", [((0, 3, 2, 4), 2), ((2, 0, 2, 4), 2), ((0, 2, 3, 4), 1)])
def test_empty_tensors_agree(shape, head_axis):
    e = torch.zeros(shape, dtype=torch.float64)
    c = compare(e.float(), e, e.float(), head_axis=head_axis)
    assert c.passed and c.worst_rel == 0.0
    assert "PASS" in str(c)


def test_subnormal_truth_admits_errors_below_the_smallest_normal_number():
    """An exact value of 1e-40 is subnormal in float32 (2-3 significant digits): an error of a few
    1e-45 is float32's range, not the implementation's; the float32 baseline happening to be exact
    there must not demand exactness."""
    e = torch.full((1, 2, 1, 4), 1e-40, dtype=torch.float64)
    e[0, 1] = 0.7
    base = e.float()
    a = base.clone()
    a[0, 0] = torch.nextafter(a[0, 0], torch.zeros(())).nextafter(torch.zeros(()))  # two subnormal ulps off
    assert compare(base, e, base).passed
    c = compare(a, e, base)
    assert c.passed, str(c)
    a[0, 1] *= 1.001  # a normal-range slice is held to the usual budget
    assert not compare(a, e, base).passed


def test_compute_dtype_and_the_table():
    assert compute_dtype(torch.float64) == torch.float64
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert compute_dtype(dt) == torch.float32 and TOLERANCES[dt].kappa == 4.0 and TOLERANCES[dt].floor == 8.0


def test_active_contract_labels_the_comparisons_inside_it():
    e, a = _pair()
    assert current_contract() == "ieee" and compare(a, e, a).contract == "ieee"
    with active_contract("tf32"):
        assert current_contract() == "tf32" and compare(a, e, a).contract == "tf32"
        with active_contract("bf16"):
            assert compare(a, e, a).contract == "bf16"
        assert current_contract() == "tf32"
    assert current_contract() == "ieee"
    with pytest.raises(ValueError, match="contract: expected one of"):
        active_contract("fp8")


# ----------------------------------------------------------------------------- the budget
def test_the_budget_adds_up_to_its_printed_terms():
    e, a = _pair()
    base = (e * (1 + 1e-6)).float()
    c = compare(a, e, base)
    tol = TOLERANCES[torch.float32]
    assert c.budget == pytest.approx(tol.kappa * c.baseline_rel + tol.floor * EPS32 + c.range_term, rel=1e-12)
    assert c.ratio == pytest.approx(c.worst_rel / c.budget) and c.ratios == {"ieee": c.ratio}
    assert c.over_baseline == pytest.approx(c.worst_rel / c.baseline_rel)
    assert f"4 x baseline {c.baseline_rel:.3e} + 8 x eps" in str(c)


def test_a_slice_whose_baseline_is_exact_gets_the_floor():
    e, a = _pair()
    base = a.clone()  # the baseline exact to float32 rounding everywhere but (request 1, head 1)
    base[1, :, 1] = e[1, :, 1] * (1 + 1e-3)
    x = a.clone()
    x[0, :, 0] = e[0, :, 0] * (1 + 4 * EPS32)  # within 8 eps on a slice whose baseline error is float32 rounding
    assert compare(x, e, base).passed
    z = e.clone()  # the baseline exactly the truth on every slice: the floor is the whole budget
    c = compare(x, e, z)
    assert c.baseline_rel == 0.0 and c.budget == pytest.approx(8 * EPS32 + c.range_term) and c.passed
    x[0, :, 0] = e[0, :, 0] * (1 + 16 * EPS32)  # past the floor
    c = compare(x, e, z)
    assert not c.passed and c.over_baseline == float("inf")


def test_a_list_of_baselines_takes_the_worst_per_slice():
    e, a = _pair()
    b1, b2 = a.clone(), a.clone()
    b1[0, :, 0] = e[0, :, 0] * (1 + 1e-4)  # form 1 is poor on (0, 0), form 2 on (1, 1)
    b2[1, :, 1] = e[1, :, 1] * (1 - 1e-3)
    x = a.clone()
    x[0, :, 0] = e[0, :, 0] * (1 + 3e-4)
    x[1, :, 1] = e[1, :, 1] * (1 + 3e-3)
    assert not compare(x, e, b1).passed and not compare(x, e, b2).passed  # each alone fails one slice
    c = compare(x, e, [b1, b2])
    assert c.passed, str(c)
    per = torch.maximum(rel_rms_slices(b1, e), rel_rms_slices(b2, e))
    i, j = c.worst_slice
    assert c.baseline_rel == pytest.approx(float(per[i, j]))
    # the worst per slice, not the worst overall: (1, 1) is not loosened by (0, 0)'s baseline, nor vice versa
    x[1, :, 0] = e[1, :, 0] * (1 + 1e-4)
    assert not compare(x, e, [b1, b2]).passed
    # and P.worst_rows builds the same tensor row by row
    w = P.worst_rows(e, [b1, b2], 3)
    assert torch.equal(rel_rms_slices(w, e), per)


def test_assert_matches_raises_with_the_verdict():
    e, a = _pair()
    assert assert_matches(a, e, a).passed
    with pytest.raises(AssertionError, match=r"FAIL output \[float32\]: worst slice"):
        assert_matches(a * 1.01, e, a)


# ----------------------------------------------------------------------------- correct forms pass, 1 % off fails
def _kernel(x: dict, dtype, chunk: int, **scaled):
    """The chunkwise form with chunks of ``chunk``, computed in float32 from the inputs ``x`` (their dtype
    ``dtype``), its outputs rounded to ``dtype``; ``scaled``: inputs multiplied by a factor (a wrong kernel)."""
    xc = {n: t.float() * scaled.get(n, 1.0) for n, t in x.items()}
    o, S = ref.chunk_gated_delta_rule(**xc, chunk_size=chunk, output_final_state=True)
    return o.to(dtype), S


def _realistic_gates(x: dict, seed: int = 7) -> dict:
    """``x`` with its log-gates drawn in [-1, -0.05] (the decays of trained models), in their own dtype."""
    gen = torch.Generator().manual_seed(seed)
    g = -(0.05 + 0.95 * torch.rand(x["g"].shape, generator=gen, dtype=torch.float64))
    return dict(x, g=g.to(x["g"].dtype))


@pytest.mark.parametrize("chunk", [16, 64, 100])
@pytest.mark.parametrize("gate", ["mild", "mixed", "reset"])
@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_a_correct_float32_chunk_form_passes_against_the_recurrence_and_chunk_baseline(chunk, gate, channel):
    case = Case(B=2, T=150, H=2, HV=4, K=32, V=32, channel_gate=channel, gate=gate, seed=5)
    x = case.inputs(torch.float32)
    gen = torch.Generator().manual_seed(1)
    S0 = 0.5 * torch.randn(2, 4, 32, 32, generator=gen)
    (o64, S64), (ob, Sb) = P.truth_and_baseline(x, S0, chunk=chunk)
    o, S = ref.chunk_gated_delta_rule(**x, initial_state=S0, chunk_size=chunk, output_final_state=True)
    for c in (compare(o, o64, ob), compare(S, S64, Sb, head_axis=1)):
        assert c.passed, str(c)


CASES_1PC = [(dt, T, ch) for dt in (torch.float32, torch.bfloat16) for T in (64, 256) for ch in (False, True)]


def _ids(p):
    dt, T, ch = p
    return f"{str(dt)[6:]}-T{T}-{'channel' if ch else 'scalar'}"


@pytest.mark.parametrize("dtype, T, channel", CASES_1PC, ids=[_ids(p) for p in CASES_1PC])
def test_q_off_by_one_percent_fails(dtype, T, channel):
    x = Case(B=2, T=T, H=2, HV=4, K=32, V=32, channel_gate=channel, gate="mild", seed=3).inputs(dtype)
    (o64, S64), (ob, Sb) = P.truth_and_baseline(x, chunk=64)
    o, _ = _kernel(x, dtype, 64)
    assert compare(o, o64, ob).passed  # the correct kernel passes
    o, _ = _kernel(x, dtype, 64, q=1.01)
    c = compare(o, o64, ob)
    assert not c.passed, str(c)


@pytest.mark.parametrize("dtype, T, channel", CASES_1PC, ids=[_ids(p) for p in CASES_1PC])
@pytest.mark.parametrize("name", ["g", "beta"])
def test_g_or_beta_off_by_one_percent_fails_with_realistic_gates(dtype, T, channel, name):
    """Log-gates in [-1, -0.05]: in float32 the output and the state each fail.  In bfloat16 the state (float32)
    fails; the output alone catches beta but not g: 1 % of g moves a bfloat16 output by less than 4x its own
    rounding (measured: 0.84-0.93 of the budget)."""
    x = _realistic_gates(Case(B=2, T=T, H=2, HV=4, K=32, V=32, channel_gate=channel, gate="mild",
                              seed=3).inputs(dtype))
    (o64, S64), (ob, Sb) = P.truth_and_baseline(x, chunk=64)
    o, S = _kernel(x, dtype, 64)
    assert compare(o, o64, ob).passed and compare(S, S64, Sb, head_axis=1).passed
    o, S = _kernel(x, dtype, 64, **{name: 1.01})
    co, cS = compare(o, o64, ob), compare(S, S64, Sb, head_axis=1)
    assert not cS.passed, str(cS)
    if dtype == torch.float32 or name == "beta":
        assert not co.passed, str(co)


def test_the_float32_buffer_forms_pass_the_case_a_validator_run_failed():
    """`kvbuffer validate --impl fast --ops verify_chain --seed 108` failed on this case (6.1e-5 against a
    budget of 4.9e-5): nine buffered tokens behind two float32-underflowing gates (|G| ~ 240, whose float32
    rounding is 1.5e-5), K = V = 1.  The float32 reference's own buffer form has the same error, to the
    digit: the baseline's buffer form holds it."""
    case = Case(B=2, T=10, H=1, HV=2, K=1, V=1, channel_gate=False, gate="mixed", beta="uniform", seed=1)
    comps = P.check_verify_accept(ref, case, torch.float32, capacity=18, history=9, lengths=[9, 9],
                                  parents=[[-1], [-1]], num_drafts=[0, 0], nodes=[-1, -1], after=0,
                                  use_counts=True, poison=True)
    state = next(c for c in comps if c.name.endswith(".state"))
    assert 4e-5 < state.worst_rel < 1e-4  # the error is real, and the one the run reported
    assert all(c.passed for c in comps), [str(c) for c in comps]


# ----------------------------------------------------------------------------- the gain check
def _bf16_products_kernel(x: dict, **scaled):
    """A correct kernel in bfloat16 products (``contracts.emulate``), chunks of 16 tokens (none of the baseline's
    forms chunk that way); ``scaled`` makes it wrong."""
    with emulate("bf16"):
        return _kernel(x, x["q"].dtype, 16, **scaled)


@pytest.mark.parametrize("name", ["q", "g", "beta"])
def test_one_percent_off_in_bfloat16_products_fails_on_its_gain(name):
    """In bfloat16 products a 1 % wrong scale, gate or beta stays inside the RMS budget (a correct kernel's error
    there is about 0.4 %), but it shifts every slice's error along the truth the same way: the mean gain over
    the 32 slices fails, while the correct kernel's stays a small fraction of its budget."""
    x = Case(B=2, T=64, H=8, HV=16, K=64, V=64, gate="mild", seed=3).inputs(torch.bfloat16)
    with active_contract("bf16"):
        (o64, S64), (ob, Sb) = P.truth_and_baseline(x, chunk=64)
        o, S = _bf16_products_kernel(x)
        good = [compare(o, o64, ob), compare(S, S64, Sb, head_axis=1)]
        o, S = _bf16_products_kernel(x, **{name: 1.01})
        bad = [compare(o, o64, ob), compare(S, S64, Sb, head_axis=1)]
    for c in good:
        assert c.passed and c.gain_judged and c.gain_slices == 32 and abs(c.gain) < 0.25 * c.gain_budget, str(c)
    past = [c for c in bad if not c.gain_passed]
    assert past, [str(c) for c in bad]
    assert "PAST its budget" in str(past[0]) and past[0].ratio > 1
    if name != "g":  # 1 % of q or beta: every slice's gain is +1 %, tens of standard errors out
        assert abs(past[0].gain) / past[0].gain_budget > 5, str(past[0])


def test_the_gain_is_judged_from_the_minimum_number_of_slices():
    """A 1 % gain on every slice: judged (and failed, the RMS check alone would pass it against a baseline of
    1 % noise) from GAIN_MIN_SLICES slices on; with fewer the RMS check alone decides."""
    gen = torch.Generator().manual_seed(0)
    for heads in (GAIN_MIN_SLICES - 1, GAIN_MIN_SLICES):
        e = torch.randn(1, 64, heads, 32, generator=gen, dtype=torch.float64)
        noise = lambda: 0.01 * e.abs().mean() * torch.randn(e.shape, generator=gen, dtype=torch.float64)  # noqa: E731
        base = (e + noise()).float()
        c = compare((1.01 * e + noise()).float(), e, base)
        assert c.worst_rel <= c.budget, str(c)
        assert c.gain_judged == (heads >= GAIN_MIN_SLICES) and c.passed == (heads < GAIN_MIN_SLICES), str(c)
    assert compare((e + noise()).float(), e, base).passed  # the same noise without the gain passes
