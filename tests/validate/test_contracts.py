"""Declared arithmetic contracts: the emulation, the baselines computed in the contract's arithmetic, both verdicts
in the report, the exit code."""

from pathlib import Path

import pytest
import torch

import kvbuffer_ref as ref
from kvbuffer.validate import adapters
from kvbuffer import cli as kcli
from kvbuffer import implementations
from kvbuffer.validate.cases import Case
from kvbuffer.validate import properties as P
from kvbuffer.validate.contracts import _Arithmetic, LOG2E_F32, SEGMENT_WAYS, _scan_cumsum, exp_ex2, key_permutations
from kvbuffer.validate.contracts import (CONTRACTS, baseline_recurrent, check_contract, correct_forms, emulate,
                                             round_bf16, round_fp16, round_tf32, trunc_tf32)
from kvbuffer.validate.tolerances import active_contract, compare
from kvbuffer.validate import contracts

from .conftest import ADAPTERS


def test_tf32_rounding_keeps_ten_mantissa_bits_to_nearest_even():
    x = torch.tensor([1.0, 1.0 + 2 ** -10, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -12, float("inf")])
    y = round_tf32(x)
    assert y.tolist() == [1.0, 1.0 + 2 ** -10, 1.0, 1.0 + 2 ** -9, 1.0, float("inf")]  # ties to even
    assert round_bf16(torch.tensor([1.0 + 2 ** -9])).item() == 1.0


def test_tf32_as_a_tensor_core_takes_it_drops_the_low_bits_toward_zero():
    x = torch.tensor([1.0 + 2 ** -11, 1.0 + 2 ** -10 + 2 ** -11, -(1.0 + 3 * 2 ** -11), 1.0 + 2 ** -10, float("-inf")])
    assert trunc_tf32(x).tolist() == [1.0, 1.0 + 2 ** -10, -(1.0 + 2 ** -10), 1.0 + 2 ** -10, float("-inf")]
    assert trunc_tf32(x.double()).dtype == torch.float64 and torch.isnan(trunc_tf32(torch.tensor([float("nan")]))).all()
    # the contract's products are the truncated ones: a sum of positive products keeps a one-signed bias
    a = 1.0 + torch.rand(4096, generator=torch.Generator().manual_seed(0))
    with emulate("tf32"):
        got = torch.einsum("i,i->", a, a).item()
    exact = float((a.double() * a.double()).sum())
    assert -2 ** -9 < got / exact - 1 < -2 ** -11  # round to nearest would leave ~1e-6
    assert round_bf16(torch.tensor([1.0 + 2 ** -7])).item() == 1.0 + 2 ** -7


def _emulated(contract: str, x: dict):
    """The recurrence on ``x`` with its products in ``contract``'s arithmetic: (o, S)."""
    with emulate(contract):
        return ref.recurrent_gated_delta_rule(**x, output_final_state=True)


def test_float16_rounding_keeps_float16s_range():
    """fp16: ten mantissa bits to nearest even, float16's subnormals, 0 below half the smallest one, inf past
    65504: the operand of a float16 product that a chunk kernel scales by a decay of exp(-20) is lost."""
    x = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 2.0 ** -24, 2.0 ** -26, 7e4, -1e-9], dtype=torch.float64)
    assert round_fp16(x).tolist() == [1.0, 1.0 + 2 ** -9, 2.0 ** -24, 0.0, float("inf"), -0.0]
    assert round_fp16(torch.tensor([3], dtype=torch.int32)).dtype == torch.int32


def test_a_decayed_float16_operand_underflows_as_in_a_float16_chunk_kernel():
    """A head whose last tokens write nothing (beta = 0) under strong gates ends with a state decayed far below
    float16's range relative to its inputs: a chunkwise form whose fold multiplies float16 operands loses it
    (error 1), as fla's float16 chunk kernel does on the H100; bfloat16 (float32's range) and the recurrence
    (the decay applied to the float32 state) keep it."""
    torch.manual_seed(0)
    B, T, H, HV, K, V = 1, 12, 1, 1, 8, 8
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    x = dict(q=k.clone(), k=k, v=torch.randn(B, T, HV, V, dtype=torch.float64) * 0.05,
             g=torch.full((B, T, HV), -6.0, dtype=torch.float64),
             beta=torch.cat([torch.ones(B, T - 4, HV), torch.zeros(B, 4, HV)], 1).double())
    x = {n: t.to(torch.float16 if n in "qkv" else torch.float32) for n, t in x.items()}
    _, S64 = ref.recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    rel = lambda S: float((S.double() - S64).norm() / S64.norm())  # noqa: E731
    forms16 = correct_forms(**x, chunks=(T,), contract="fp16")
    assert rel(forms16[0][1]) < 1e-3 and max(rel(S) for _, S in forms16[1:]) == 1.0
    assert max(rel(S) for _, S in correct_forms(**x, chunks=(T,), contract="bf16")) < 1e-2


def test_tl_exp2_flushes_a_result_below_float32s_normal_range():
    """exp2 of log2-scaled gates as Triton's tl.exp2 returns it (ex2.approx.ftz.f32, measured on an H100): 0
    below float32's smallest normal number, where tl.exp (exp_ex2 without ftz) keeps the subnormal."""
    x = torch.tensor([-80.0, -87.0, -88.0, -100.0])
    kept, flushed = exp_ex2(x), exp_ex2(x, ftz=True)
    assert torch.equal(kept[:2], flushed[:2]) and bool((kept[2:] > 0).all()) and flushed[2:].tolist() == [0.0, 0.0]


def test_the_decay_scales_either_factor_of_the_fold_to_the_same_sum():
    from kvbuffer.validate.contracts import _fold
    from kvbuffer_ref.core import fold_state

    torch.manual_seed(1)
    S, k, u = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(2, 6, 3, 4, dtype=torch.float64), \
        torch.randn(2, 6, 3, 5, dtype=torch.float64)
    G = -torch.rand(2, 6, 3, dtype=torch.float64).cumsum(1)
    a, b = _fold(S, k, u, G, "k"), _fold(S, k, u, G, "u")
    assert torch.equal(a, fold_state(S, k, u, G, G[:, -1]))
    assert torch.allclose(a, b, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="decay_on: expected 'k' or 'u', got 'v'"):
        _fold(S, k, u, G, "v")


def test_the_gpu_ways_flush_a_subnormal_decay_as_tl_exp2_does():
    """The chunkwise forms whose exponentials are a GPU's take exp2 with the flush (fla's chunk kernels do): a
    head whose last tokens write nothing and whose decays pass exp(-87.3) ends at 0 in those forms, and is
    kept by the recurrences and the correctly rounded way."""
    B, T, H, HV, K, V = 1, 8, 1, 1, 4, 4
    torch.manual_seed(2)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    x = dict(q=k.clone(), k=k, v=torch.randn(B, T, HV, V, dtype=torch.float64),
             g=torch.full((B, T, HV), -18.0, dtype=torch.float64),  # the last write decays by exp(-90)
             beta=torch.cat([torch.ones(B, 3, HV), torch.zeros(B, T - 3, HV)], 1).double())
    x32 = {n: t.float() for n, t in x.items()}
    _, S64 = ref.recurrent_gated_delta_rule(**x, output_final_state=True)
    forms = correct_forms(**x32, chunks=(T,), contract="ieee")
    rel = [float((S.double() - S64).norm() / S64.norm()) for _, S in forms]
    # after the two recurrences and the K orders
    gpu = [i + 2 + len(key_permutations(K)) for i, w in enumerate(SEGMENT_WAYS) if w.get("exp") == "ex2-ftz"]
    assert 1e-45 < S64.abs().max() < 1e-38 and len(gpu) == 2  # a float32 subnormal
    assert all(rel[i] == 1.0 for i in gpu) and max(r for i, r in enumerate(rel) if i not in gpu) < 1e-3, rel


def test_a_baseline_that_overflowed_counts_as_one_that_lost_the_slice():
    """A correct form in float16 products can overflow (inf): its slice's baseline error is then 1, as for a
    form that returned 0, not an infinite budget that would pass any answer."""
    truth = torch.ones(1, 1, 2, 4, dtype=torch.float64)
    base = truth.clone().float()
    base[..., 0] = float("inf")
    c = compare(truth.float() * 6, truth, base, dtype=torch.float32)  # error 5 on both slices
    assert not c.passed and c.baseline_rel == 1.0 and 4 < c.budget < 4.01
    assert compare(truth.float() * 0, truth, base, dtype=torch.float32).passed  # the answer such a form gives


def test_the_emulation_changes_the_products_and_nothing_else():
    x = Case(B=1, T=6, H=1, HV=1, K=16, V=16, seed=3).inputs(torch.float32)
    o, _ = ref.recurrent_gated_delta_rule(**x)
    with emulate("ieee"):
        assert torch.equal(ref.recurrent_gated_delta_rule(**x)[0], o)
    with emulate("bf16-state"):  # a state contract changes no product
        assert torch.equal(ref.recurrent_gated_delta_rule(**x)[0], o)
    t, _ = _emulated("tf32", x)
    b, _ = _emulated("bf16", x)
    e_t, e_b = float((t - o).norm() / o.norm()), float((b - o).norm() / o.norm())
    # bf16: 3 fewer mantissa bits, rounded to nearest; tf32 truncated: twice a rounded step's error, one-signed
    assert 1e-5 < e_t < 3e-3 and 2 * e_t < e_b < 3e-2, (e_t, e_b)
    # the baseline's recurrence follows the contract: the emulated products, or the state rounded to bfloat16
    assert torch.equal(baseline_recurrent(**x, contract="tf32")[0], t)
    s, _ = baseline_recurrent(**x, contract="bf16-state")
    assert not torch.equal(s, o) and float((s - o).norm() / o.norm()) < 3e-2


def test_unknown_contract_names_are_refused():
    assert CONTRACTS[0] == "ieee" and set(CONTRACTS) == {"ieee", "tf32x3", "tf32", "fp16", "bf16", "bf16-state"}
    assert check_contract("fp32") == "ieee" and check_contract(None) == "ieee"
    with pytest.raises(ValueError, match="contract: expected one of ieee, tf32"):
        check_contract("tf16")
    with pytest.raises(ValueError, match="contract: expected one of"):
        emulate("fp8")
    with pytest.raises(adapters.AdapterError, match="adapter x: contract: expected one of"):
        adapters.describe(type("A", (), dict(name="x", contract="fp8", direct_gated_delta_rule=staticmethod(
            ref.direct_gated_delta_rule)))())


def test_the_gpu_exponential_is_two_to_the_float32_product_with_log2_e():
    x = torch.tensor([-0.3, -8.0, -50.0, float("-inf")], dtype=torch.float32)
    e = exp_ex2(x)
    y = x * torch.tensor(LOG2E_F32)  # rounded to float32: the argument ex2.approx.f32 receives
    assert y.dtype == torch.float32 and torch.equal(e, torch.exp2(y.double()).float())
    rel = (e[:3].double() / x[:3].double().exp() - 1).abs()
    # the product's rounding moves the result by up to |x| log2(e) 2^-24 ln 2, more than float32's own
    # rounding of a correctly rounded exp (2^-24) once |x| is large
    bound = x[:3].double().abs() * 2 ** -24 + 2 ** -24
    assert bool((rel <= bound).all()) and float(rel[2]) > 2 ** -24
    assert float(e[3]) == 0.0 and torch.equal(exp_ex2(x.double()), x.double().exp())


def test_the_correct_forms_are_the_recurrence_and_with_a_chunk_the_chunkwise_form():
    x = Case(B=1, T=20, H=1, HV=2, K=8, V=8, gate="mixed", seed=2).inputs(torch.float32)
    rec, rec_ex2, *orders = correct_forms(**x)
    assert torch.equal(rec[0], ref.recurrent_gated_delta_rule(**x)[0])
    assert len(orders) == len(key_permutations(8)) == 2
    for (o, S), p in zip(orders, key_permutations(8)):  # the recurrence on K-permuted channels, S put back
        op, Sp = ref.recurrent_gated_delta_rule(**dict(x, q=x["q"][..., p], k=x["k"][..., p]), output_final_state=True)
        assert torch.equal(o, op) and torch.equal(S, Sp[:, :, torch.argsort(p)])
    with _Arithmetic(exp="ex2"):  # the recurrence with its exponentials as a GPU takes them
        assert torch.equal(rec_ex2[0], ref.recurrent_gated_delta_rule(**x)[0])
    assert len(correct_forms(**{n: t.double() for n, t in x.items()})) == 1  # float64: one exponential
    forms = correct_forms(**x, chunks=(8,))
    assert len(forms) >= 3 and torch.equal(forms[0][0], rec[0])
    c8 = ref.chunk_gated_delta_rule(**x, chunk_size=8)[0]
    truth = ref.recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()})[0]
    # the chunkwise forms are the chunked computation (its cumulative gates summed one way or the other)
    assert any(float((o - c8).norm()) <= float((c8 - truth).norm()) for o, _ in forms[2:])
    # truth_and_baseline (chunks of 8 and of 64): row by row the worst of those forms, so each slice's baseline
    # error is at least each form's
    (o64, _), (ob, _) = P.truth_and_baseline(x, chunk=8)
    err = lambda o: torch.linalg.vector_norm(o.double() - o64, dim=(1, 3))  # noqa: E731
    for o, _ in correct_forms(**x, chunks=(64,)):
        assert bool((err(ob) >= err(o)).all())


def test_a_tf32_error_fails_as_fp32_and_passes_as_tf32():
    case = Case(B=1, T=8, H=1, HV=2, K=32, V=16, seed=5)
    x = case.inputs(torch.float32)
    t, _ = _emulated("tf32", x)  # a kernel multiplying in TF32
    (truth, _), base = P.truth_and_baseline(x)  # the baseline under the active contract: IEEE float32
    c = compare(t, truth, base[0])
    assert c.contract == "ieee" and not c.passed
    with active_contract("tf32"):  # the baseline computed in the declared arithmetic, the comparison labelled
        (_, _), tb = P.truth_and_baseline(x)
        c3 = compare(t, truth, tb[0])
    assert c3.contract == "tf32" and c3.passed, str(c3)
    assert "in tf32 arithmetic" in str(c3)
    wrong = t * 1.3  # no rounding of any contract explains 30 %
    for k in CONTRACTS:
        with active_contract(k):
            (_, _), kb = P.truth_and_baseline(x)
            assert not compare(wrong, truth, kb[0]).passed, k
    # TF32 products with q off by 1 %: not explained by TF32, fails as tf32 too
    with active_contract("tf32"):
        off, _ = _emulated("tf32", dict(x, q=x["q"] * 1.01))
        assert not compare(off, truth, tb[0]).passed


def _main(capsys, *args):
    rc = kcli.main(["validate", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_report_says_both_verdicts_and_the_exit_code_follows_the_declared_contract(capsys):
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:tf32_undeclared", "--ops", "recurrent", "--seed", "4",
                         "--max-examples", "3", "--no-shrink")
    assert rc == 1, out + err
    assert "FAIL as fp32; PASS as tf32: error consistent with TF32 products" in out, out
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:tf32_declared", "--ops", "recurrent,chunk", "--seed", "4",
                         "--max-examples", "3")
    assert rc == 0, out + err
    assert "[contract tf32]" in out and "FAIL [wrong-result] as fp32; PASS as tf32: error consistent" in out, out
    # the same kernel judged as fp32 by the command line: the exit code follows the contract judged by
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:tf32_declared", "--ops", "recurrent", "--seed", "4",
                         "--max-examples", "3", "--no-shrink", "--contract", "ieee")
    assert rc == 1 and "FAIL as fp32; PASS as tf32" in out, out


def test_a_looser_contract_that_fails_only_on_reset_gates_still_explains_the_failure(capsys):
    """Under tf32 the lane fails on reset gates ([domain]) and passes the rest: tf32 explains the fp32 failure
    on mild gates (the report said "not explained by a looser arithmetic contract" before)."""
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:tf32_no_resets", "--ops", "recurrent", "--seed", "4",
                         "--max-examples", "3", "--no-shrink")
    assert rc == 1, out + err
    assert ("FAIL as fp32; PASS as tf32 without reset gates (on them it fails as tf32 too: [domain]): error "
            "consistent with TF32 products") in out, out


def test_a_looser_arithmetic_or_a_real_bug_is_not_excused_by_the_declared_contract(capsys):
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:bf16_as_tf32", "--ops", "recurrent", "--seed", "4",
                         "--max-examples", "3", "--no-shrink")
    # bf16 products fail against the tf32 baseline, and the report says what they are consistent with
    assert rc == 1 and "FAIL as tf32; PASS as bf16: error consistent with bfloat16 products" in out, out
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:tf32_buggy", "--ops", "recurrent", "--seed", "4",
                         "--max-examples", "3", "--no-shrink")
    assert rc == 1 and "not explained by a looser arithmetic contract" in out, out
    rc, out, err = _main(capsys, "--impl", f"{ADAPTERS}:good", "--contract", "fp8")
    assert rc == 2 and "--contract: expected one of" in err


def test_a_lane_contract_covers_every_form_of_its_operation():
    """A contract declared for an operation holds for its buffer-form lanes ("prefill[u]"), unless the form
    has its own entry: kvbuffer_fast's 16-bit prefill lane was judged as fp32 while its chunk lane took
    the declared bf16 contract."""
    impl = adapters.Implementation(
        name="x", obj=None, dtypes=(torch.bfloat16,), forms=("u",), contract="ieee",
        lane_contracts={("prefill", torch.bfloat16): "bf16", ("decode[raw]", torch.bfloat16): "tf32"})
    assert impl.contract_for("prefill[u]", torch.bfloat16) == "bf16"
    assert impl.contract_for("prefill", torch.bfloat16) == "bf16"
    assert impl.contract_for("prefill[u]", torch.float32) == "ieee"
    assert impl.contract_for("decode[raw]", torch.bfloat16) == "tf32"
    assert impl.contract_for("decode[u]", torch.bfloat16) == "ieee"
    if not adapters.interpreter_active():
        assert implementations.fast().contract_for("prefill[u]", torch.bfloat16) == "bf16"


def test_fast_declares_16_bit_products_for_every_chunk_lane(monkeypatch):
    """Compiled, kvbuffer_fast's chunk kernels multiply 16-bit inputs in 16-bit products in every operation
    that runs them, the variable-length chunk lane too (judged as fp32, its final state failed on the H200
    at 4.0e-3 against 1.1e-5 while the fixed-length lanes passed as bf16); the recurrence, decode and
    verify lanes keep the fp32 contract.  Their float32 products are three TF32 products (tf32x3): judged as
    IEEE float32 on the H200's gpu profile, the chunk lane came out 1.2x its budget."""
    monkeypatch.setattr(implementations, "interpreter_active", lambda: False)
    impl = implementations.fast()
    for op in ("chunk", "chunk_varlen", "direct", "prefill[u]"):
        for dt in (torch.float16, torch.bfloat16):  # float16: products of float16 and TF32 operands, mixed
            assert impl.contract_for(op, dt) == "bf16", (op, dt)
        assert impl.contract_for(op, torch.float32) == "tf32x3", op
    for op in ("recurrent", "recurrent_varlen", "decode[u]", "verify_chain[u]"):
        assert impl.contract_for(op, torch.bfloat16) == "ieee", op


def test_three_tf32_products_sit_between_ieee_and_tf32():
    """tf32x3 (Triton's input_precision="tf32x3", kvbuffer_fast's compiled float32 chunk kernels): the chunk
    form's error under it is of the float32 order, and far below one TF32 product's."""
    x = Case(B=1, T=64, H=1, HV=2, K=32, V=32, seed=3).inputs(torch.float32)
    o64 = ref.chunk_gated_delta_rule(**{n: t.double() for n, t in x.items()})[0]
    err = {}
    for c in ("ieee", "tf32x3", "tf32"):
        with emulate(c):
            o = ref.chunk_gated_delta_rule(**x)[0]
        err[c] = float((o.double() - o64).norm() / o64.norm())
    assert err["ieee"] < 1e-6 and err["tf32x3"] < 4 * err["ieee"] and err["tf32"] > 100 * err["tf32x3"]


#: Outputs measured on an H100 (tests/validate/h100_tensor_core.pt; device and versions inside; the scripts that
#: measured them: bench/results/h100-2026-12-07-tensor-core): Triton dots of float32 operands, and
#: kvbuffer_fast's compiled chunk kernel on one case whose output is a cancelling q . k.
H100 = Path(__file__).with_name("h100_tensor_core.pt")


def test_the_tensor_core_sum_reproduces_an_h100s_dots_bit_for_bit():
    """``_tc_product`` (exact products summed in groups of 8 with the accumulator, cut toward zero) gives the H100's
    own float32 dots of three TF32 products on almost every output and its error to three digits; the same
    products summed in IEEE float32 (``_split_product``) have about half the H100's error at K = 128."""
    from kvbuffer.validate.contracts import _split_product, _tc_product, _tc_sum
    data = torch.load(H100)["dots"]
    for name, d in data.items():
        A, B, O = d["A"], d["B"], d["O"]
        exact = A.double() @ B.double()
        if d["precision"] == "tf32":  # one TF32 product: truncated operands, the tensor core's sum
            got = _tc_sum((trunc_tf32(A).double()[:, None, :] * trunc_tf32(B).double().T[None]).split(8, -1), None)
        else:
            got = _tc_product(torch.einsum, "mk,kn->mn", A, B)
        assert (got == O).float().mean() > 0.93, name

        def err(x):
            return float((x.double() - exact).norm() / exact.norm())
        assert abs(err(got) / err(O) - 1) < 0.02, name
        if name == "16x16x128-tf32x3":
            assert err(_split_product(torch.einsum, "mk,kn->mn", A, B)) < 0.6 * err(O)


def test_the_tensor_core_sum_keeps_products_far_below_float32s_normal_range():
    """Products near float32's smallest normal number (decays after a strong gate) are summed, not lost: the
    alignment step is taken in float64 (a step of 2^-151 in float32 underflows to 0 and makes NaN)."""
    from kvbuffer.validate.contracts import _tc_product
    a = torch.full((3, 16), 2.0 ** -70)
    b = torch.full((16, 2), 2.0 ** -60)
    got = _tc_product(torch.einsum, "mk,kn->mn", a, b)
    assert torch.equal(got, torch.full((3, 2), 16 * 2.0 ** -130))


def test_a_three_tf32_chunk_kernel_on_a_tensor_core_is_within_its_budget():
    """kvbuffer_fast's chunk kernel on an H100 (one token, scale 0.37, rows of any norm: the output is a
    q . k that cancels over K = 128, taken as three TF32 products on the tensor core): about 4x the error of
    the tf32x3 forms summed in IEEE float32 (0.96 of the budget they make here, 1.01 computed on the H100),
    about 1.3x the form summed as the tensor core sums (``TC_WAY``), a third of the budget with it; 0.66 of the
    budget the forms make with K summed in other orders too (``key_orders``) but without ``TC_WAY``."""
    from kvbuffer.validate import contracts as C
    d = torch.load(H100)["chunk"]
    x = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
    o64 = ref.recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()}, scale=d["scale"])[0]
    with active_contract("tf32x3"):
        forms = correct_forms(**x, scale=d["scale"], chunks=(d["chunk_size"],))
    assert len(forms) == 2 + len(key_permutations(128)) + len(SEGMENT_WAYS) + 1
    n = 2 + len(key_permutations(128))  # the recurrences, then the K orders (contracts.key_orders)
    with_tc = compare(d["o"], o64, [o for o, _ in forms], contract="tf32x3")
    index_order = compare(d["o"], o64, [o for o, _ in forms[:2] + forms[n:-1]], contract="tf32x3")
    orders = compare(d["o"], o64, [o for o, _ in forms[:-1]], contract="tf32x3")
    assert with_tc.passed and with_tc.worst_rel < 0.4 * with_tc.budget and with_tc.over_baseline < 1.5
    # without the tensor core's sums and K in index order only, it comes to the edge of the budget; the K
    # orders alone (the cancelling q . k rounds differently in each) leave it room
    assert index_order.worst_rel > 0.9 * index_order.budget and index_order.over_baseline > 3.5
    assert orders.passed and orders.worst_rel < 0.8 * orders.budget


def test_a_gpu_scan_sums_in_a_tree_order_within_32_lanes_and_carries_between_them():
    from kvbuffer.validate.contracts import _scan_cumsum
    x = torch.randn(3, 70, 2, dtype=torch.float64)
    assert torch.allclose(_scan_cumsum(x, 1), x.cumsum(1), rtol=0, atol=1e-12)  # a cumulative sum
    # float32 after a gate of -200: element 3 is (x0 + x1) + (x2 + x3), not ((x0 + x1) + x2) + x3
    g = torch.tensor([-0.38308, -0.11736, -200.0, -0.27897, -0.14824, -0.016843], dtype=torch.float32)
    s = _scan_cumsum(g, 0)
    assert float(s[3]) == float((g[0] + g[1]) + (g[2] + g[3]))
    assert float(s[5]) == float(((g[0] + g[1]) + (g[2] + g[3])) + (g[4] + g[5]))
    with _Arithmetic(cumsum="scan"):
        assert torch.equal(torch.cumsum(g, 0), s) and torch.equal(g.cumsum(dim=0), s)


def test_a_chunk_kernel_summing_its_gates_by_a_gpu_scan_is_within_its_baseline():
    """Reset gates (-200) leave only the low bits of the cumulative gates after them, and which bits depends on
    the order of the sum: on this case a kernel whose ``tl.cumsum`` sums in a scan's tree order made 14x the
    error of the loop-summed form on one head (compiled kvbuffer_fast, H200), which the baseline now covers."""
    c = Case(B=2, T=7, H=2, HV=4, K=7, V=5, gate="reset", beta="uniform", seed=1, norm="any")
    x = c.inputs(torch.float32)
    (o64, _), (ob, _) = P.truth_and_baseline(x, chunk=c.T)
    with _Arithmetic(cumsum="scan", exp="ex2"):
        scan = ref.chunk_gated_delta_rule(**x, chunk_size=64)[0]
    with _Arithmetic(cumsum="sequential", exp="ex2"):
        loop = ref.chunk_gated_delta_rule(**x, chunk_size=64)[0]
    err = lambda o: torch.linalg.vector_norm(o.double() - o64, dim=(1, 3))  # noqa: E731
    assert float((err(scan) / err(loop)).max()) > 10  # the order matters on some head
    assert bool((err(scan) <= err(ob)).all()) and bool((err(loop) <= err(ob)).all())


def test_the_interpreter_judges_fast_as_its_16_bit_paths_when_it_takes_them(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBUFFER_FAST_16BIT_PATHS", "1")
    impl = implementations.fast()
    for op in ("chunk", "chunk_varlen", "direct", "prefill[u]"):
        assert impl.contract_for(op, torch.float16) == "fp16", op
        assert impl.contract_for(op, torch.float32) == "ieee", op
    assert impl.contract_for("recurrent", torch.float16) == "ieee"
    monkeypatch.setenv("KVBUFFER_FAST_16BIT_PATHS", "0")
    assert implementations.fast().contract_for("chunk", torch.float16) == "ieee"


def _blelloch(x: torch.Tensor) -> torch.Tensor:
    """Inclusive scan of x [T, ...] in float32 as a work-efficient scan forms it: an up-sweep of pairwise sums, a
    down-sweep of exclusive prefixes (T padded to a power of two), then + x."""
    n, p = x.shape[0], 1
    while p < n:
        p *= 2
    a = torch.cat([x, x.new_zeros(p - n, *x.shape[1:])])
    s = 1
    while s < p:
        i = torch.arange(2 * s - 1, p, 2 * s)
        a[i] = a[i] + a[i - s]
        s *= 2
    a[p - 1] = 0
    while s > 1:
        s //= 2
        i = torch.arange(2 * s - 1, p, 2 * s)
        left = a[i - s].clone()
        a[i - s] = a[i]
        a[i] = a[i] + left
    return a[:n] + x


class _ScanOrder(torch.overrides.TorchFunctionMode):
    """Every float32 cumulative sum taken in one scan order (along ``dim``): the one thing a kernel under test
    does differently from the reference's chunkwise form."""

    def __init__(self, scan):
        super().__init__()
        self.scan = scan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.cumsum, torch.Tensor.cumsum) and args[0].dtype == torch.float32:
            dim = args[1] if len(args) > 1 else kwargs["dim"]
            return self.scan(args[0].movedim(dim, 0)).movedim(0, dim)
        return func(*args, **kwargs)


@pytest.mark.parametrize("gate, seed, order", [
    ("strong", 0, "runs of 8"), ("strong", 17, "whole chunk"), ("wide", 5, "runs of 16"), ("mixed", 18, "work-efficient")])
def test_a_chunk_kernel_may_sum_its_cumulative_gates_in_any_scan_order(gate, seed, order):
    """The reference's chunkwise form in float32, its in-chunk cumulative gates summed as another scan does
    (CUDA's cumsum and Triton layouts other than one element per lane each take their own tree), is a correct
    kernel and passes; each of these cases failed against the loop, 32-lane scan and correctly rounded ways alone
    (its state 1.8x to 203x the budget: a gate of 0 between two tokens whose cumulative gates are near -3000
    leaves a loop's decay exact and a tree's one float32 step of 3000 off)."""
    # Hillis-Steele within runs of 8, 16 or the whole chunk, each run adding the runs before it; or work-efficient
    scan = {"runs of 8": lambda x: _scan_cumsum(x, 0, lanes=8), "runs of 16": lambda x: _scan_cumsum(x, 0, lanes=16),
            "whole chunk": lambda x: _scan_cumsum(x, 0, lanes=1 << 20), "work-efficient": _blelloch}[order]
    case = Case(B=1, T=128, H=2, HV=4, K=32, V=32, gate=gate, beta="mixed", seed=seed, norm="any", scale=0.37)
    x = case.inputs(torch.float32)
    o64, S64 = ref.recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()}, scale=0.37,
                                              output_final_state=True)
    with _ScanOrder(scan):
        o, S = ref.chunk_gated_delta_rule(**x, scale=0.37, chunk_size=64, output_final_state=True)
    forms = correct_forms(**x, scale=0.37, chunks=(64,), contract="ieee")
    assert compare(o, o64, [f[0] for f in forms], dtype=torch.float32).passed
    c = compare(S, S64, [f[1] for f in forms], dtype=torch.float32, head_axis=1, name="final state")
    assert c.passed, str(c)


def test_the_tensor_core_form_bounds_its_memory_without_changing_a_bit(monkeypatch):
    """``_tc_product`` splits a large output into pieces of at most ``TC_BYTES`` of products: the same bits."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 2, 16, 40, generator=g), torch.randn(3, 2, 16, 24, generator=g)
    c = torch.randn(1, 2, 9, 40, generator=g)  # broadcast over the first index
    whole = [contracts._tc_product(torch.einsum, "bhck,bhcv->bhkv", a, b),
             contracts._tc_product(torch.einsum, "...ck,...cv->...kv", a, b),
             contracts._tc_product(torch.einsum, "bhck,bhdk->bhcd", a, c)]
    monkeypatch.setattr(contracts, "TC_BYTES", 200)
    split = [contracts._tc_product(torch.einsum, "bhck,bhcv->bhkv", a, b),
             contracts._tc_product(torch.einsum, "...ck,...cv->...kv", a, b),
             contracts._tc_product(torch.einsum, "bhck,bhdk->bhcd", a, c)]
    for w, s in zip(whole, split):
        assert s.shape == w.shape and torch.equal(s, w)


def _cancelling_tokens(B=16, T=1, K=40, V=3, seed=0):
    """float32 tokens whose q . k cancels (|q . k| ~ 1e-3 |q| |k|) under underflowing per-channel gates: each
    output is (q_t . k_t) beta_t v_t alone, a sum over K whose rounding depends on the order it is taken in."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(B, T, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    q = q - (q * k).sum(-1, keepdim=True) * k * (1 - 1e-3)
    return dict(q=q.float(), k=k.float(), v=torch.randn(B, T, 1, V, generator=gen).float(),
                g=torch.full((B, T, 1, K), -110.0), beta=torch.full((B, T, 1), 0.5))


def test_a_correct_kernel_summing_k_in_any_order_is_within_budget(monkeypatch):
    """The budget covers the rounding of a correct kernel whatever order it sums the K channels in
    (``contracts.key_orders``): the recurrence on randomly permuted K channels passes on cancelling q . k; with
    the budget taken from one order only, some of those orders fail (the check can fail)."""
    x = _cancelling_tokens()
    (o64, _), base = P.truth_and_baseline(x)
    gen = torch.Generator().manual_seed(1)
    perms = [torch.randperm(x["q"].shape[-1], generator=gen) for _ in range(24)]

    def worst(base):
        ratios = []
        for p in perms:
            xp = dict(x, q=x["q"][..., p], k=x["k"][..., p], g=x["g"][..., p])
            o, _ = ref.recurrent_gated_delta_rule(**xp, output_final_state=True)
            ratios.append(compare(o, o64, base[0], dtype=torch.float32).ratio)
        return max(ratios)

    assert worst(base) <= 1.0
    monkeypatch.setattr(contracts, "key_orders", lambda *a, **kw: [])
    assert worst(P.truth_and_baseline(x)[1]) > 1.0
