"""Engine conventions: a plain-PyTorch engine decode kernel passes in its own convention, in float32 and in
float16 (where its in-kernel q/k normalisation of the rounded rows is what the truth is computed on); its
realistic wrong variants (pads not skipped, the state read as [K, V], a softplus-threshold bug, a stale state
on slot reuse, the q/k norm's epsilon wrong or the norm skipped, and the serving bugs of ``_SERVING_BUGS``)
fail, each with the class that names it."""

import random
import types

import pytest
import torch

from kvbuffer.validate import adapters
from kvbuffer.peers.engine import Convention, engine_adapter, from_raw_gates, to_raw_gates
from kvbuffer.validate.lanes import plan
from kvbuffer.validate.runner import run_validation
from kvbuffer.validate.tolerances import tolerance_for

from . import engine_kernels as ek


def _run(adapter, seed=11, n=6, dtype=torch.float32):
    rep = run_validation([adapters.describe(adapter)], ops=[("recurrent_decode", None)],
                         dtypes=[dtype], seed=seed, max_examples=n, progress=None, explain=False)
    (lane,) = [r for r in rep.lanes if r.status in ("PASS", "FAIL", "ERROR")]
    return lane


def test_raw_gates_round_trip_through_the_engine_formula():
    g = torch.tensor([[0.0, -0.3, -7.5, -110.0, float("-inf")]]).T.expand(5, 3).contiguous()
    beta = torch.tensor([0.0, 0.2, 0.5, 1.0, 0.9])[:, None].expand(5, 3).contiguous()
    A_log, dt_bias, a, b = to_raw_gates(g, beta, random.Random(0))
    g2, beta2 = from_raw_gates(A_log, dt_bias, a, b)
    fin = torch.isfinite(g)
    # the one policy's floor, relative: 8 float32 eps (the raw inputs are stored in float32 once)
    tol = tolerance_for(torch.float32).floor * torch.finfo(torch.float32).eps
    assert bool(((g2 - g).abs()[fin] <= tol * g.abs()[fin]).all()) and torch.all(g2[~fin] == float("-inf"))
    assert bool(((beta2 - beta).abs() <= tol * beta.abs()).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_correct_engine_kernel_passes(dtype):
    r = _run(ek.correct, dtype=dtype)
    assert r.status == "PASS", r.failure


@pytest.mark.parametrize("variant, klass", [("wrong_pads", {"pool-slots", "wrong-result", "state-leak"}),
                                            ("transposed", {"wrong-result", "tile-boundary", "state-leak"}),
                                            ("softplus", {"wrong-result", "domain", "tile-boundary", "state-leak"}),
                                            ("slot_reuse", {"state-leak", "wrong-result"})])
def test_each_wrong_engine_kernel_is_caught(variant, klass):
    r = _run(getattr(ek, variant))
    assert r.status == "FAIL", (variant, r.status)
    assert r.klass in klass, (variant, r.klass, r.failure)


@pytest.mark.parametrize("variant, klass", [("wrong_eps", {"wrong-result", "domain"}),
                                            ("no_norm", {"domain", "wrong-result"})])
def test_a_wrong_in_kernel_norm_is_caught_in_float16(variant, klass):
    """The truth on the normalised rounded rows admits the right normalisation only: an epsilon of 1e-3 for
    1e-6 (every row about 5e-4 short) or no normalisation at all fails the float32 state's budget."""
    r = _run(getattr(ek, variant), dtype=torch.float16)
    assert r.status == "FAIL", (variant, r.status)
    assert r.klass in klass, (variant, r.klass, r.failure)


@pytest.mark.parametrize("name", ["correct_null_block", "correct_int64"])
def test_the_correct_engine_kernel_passes_with_a_null_block_or_int64_slots(name):
    r = _run(getattr(ek, name), n=4)
    assert r.status == "PASS", r.failure


# the bugs of serving kernels: variant -> (dtype it shows in, the classes that name it)
_SERVING_BUGS = {
    "null_block": ("float32", {"pool-slots"}),  # pads tested as slot < 0 when they carry the null block
    "zero_is_pad": ("float32", {"wrong-result", "state-leak"}),  # slot 0 skipped as if it were the null block
    "last_row_dropped": ("float32", {"wrong-result", "state-leak"}),
    "block_tail": ("float32", {"wrong-result", "state-leak"}),  # rows in blocks of 2, the odd one left out
    "first_n_1_written": ("float32", {"wrong-result", "state-leak"}),
    "state_on_copy": ("float32", {"wrong-result", "state-leak"}),
    "int64_as_int32": ("float32", {"wrong-result", "state-leak", "pool-slots"}),
    "dt_bias_half": ("float32", {"wrong-result", "domain"}),
    "A_log_as_A": ("float32", {"wrong-result", "domain"}),
    "beta_twice": ("float32", {"wrong-result", "domain"}),
    "gate_after": ("float32", {"wrong-result", "domain"}),
    "gqa_mod": ("float32", {"wrong-result"}),
    "scale_twice": ("float32", {"wrong-result", "arguments"}),
    "no_scale": ("float32", {"wrong-result", "arguments"}),
    "default_scale": ("float32", {"arguments", "wrong-result"}),  # an explicit scale ignored
    "eps_outside": ("float32", {"domain", "wrong-result"}),
    "k_unnormalised": ("float32", {"domain", "wrong-result"}),
    "bf16_read": ("float32", {"wrong-result"}),
    "state_in_io_dtype": ("float16", {"wrong-result", "state-leak"}),
    "mutates_q": ("float32", {"inputs-changed"}),  # q normalised into the caller's tensor
}


@pytest.mark.parametrize("variant", sorted(_SERVING_BUGS))
def test_each_serving_kernel_bug_is_caught(variant):
    dtype, klass = _SERVING_BUGS[variant]
    r = _run(getattr(ek, variant), n=4, dtype=getattr(torch, dtype))
    assert r.status == "FAIL", (variant, r.status)
    assert r.klass in klass, (variant, r.klass, r.failure)


def test_a_scratch_null_block_may_be_written_by_pads():
    """pad_writes=True (a kernel without a pad check, fla's): the pads' reads and writes of the null block pass."""
    r = _run(ek.make("null-block", "engine-decode-scratch-null", pad_writes=True, **ek.NULL_BLOCK), n=4)
    assert r.status == "PASS", r.failure


def test_the_serving_bug_table_covers_every_variant():
    assert set(_SERVING_BUGS) == set(ek.NEW_BUGS)


def test_the_null_block_holds_finite_garbage_and_the_inputs_are_checked():
    """A pad that reads the null block as a state and writes it back would write NaN over NaN (unseen) if the
    null block were NaN like the free slots; and q, k, v, a, b are the engine adapter's own tensors, which the
    oracle-side input check does not see."""
    seen = {}

    def step(*, state, slots, q, **kw):
        seen["null"] = state[0].clone()
        q.mul_(1.0)  # a no-op write: bits unchanged, not a violation
        return torch.zeros(1, q.shape[1], kw["v"].shape[2], kw["v"].shape[3])
    ad = engine_adapter(step, gating="raw", qk_l2norm=True, pool=True, pad_slot=0, reserved_slots=(0,), varlen=True)
    q = torch.randn(2, 1, 1, 4)
    ad._call(q, q.clone(), torch.randn(2, 1, 1, 3), torch.full((2, 1, 1), -0.5), torch.full((2, 1, 1), 0.5),
             torch.zeros(2, 1, 4, 3), torch.zeros(2, 1, 4, 3), None, T=1)
    assert torch.isfinite(seen["null"]).all()


def test_an_adapter_that_normalises_qk_itself_declares_it_by_name():
    """qk_l2norm leaves out the buffer operations (they take the caller's normalised keys); the old name is
    refused rather than ignored."""
    fn = lambda *a, **kw: None  # noqa: E731
    obj = types.SimpleNamespace(qk_l2norm=True, buffered_decode=fn, flush=fn, recurrent_gated_delta_rule=fn)
    by_op = {l.op.name: l for l in plan([adapters.describe(obj, "normalising")], [("recurrent", None),
                                                                                     ("decode", None)])}
    assert by_op["recurrent"].status == "RUN"
    assert by_op["decode"].status == "NOT PROVIDED" and "qk_l2norm" in by_op["decode"].reason
    with pytest.raises(adapters.AdapterError, match="declare qk_l2norm = True"):
        adapters.describe(types.SimpleNamespace(unit_qk=True, recurrent_gated_delta_rule=fn), "old")


def test_the_convention_refuses_bad_fields_by_name():
    with pytest.raises(adapters.AdapterError, match="convention state_layout: expected one of KV, VK"):
        Convention(state_layout="KVT")
    with pytest.raises(adapters.AdapterError, match="unknown convention field"):
        engine_adapter(lambda **kw: None, layout="VK")
    with pytest.raises(adapters.AdapterError, match="pad_slot: 0 is a real slot"):
        Convention(pool=True, pad_slot=0)
    assert engine_adapter(lambda **kw: None, state_dtype=torch.bfloat16).contract == "bf16-state"


def test_a_correct_engine_kernel_is_judged_with_the_gates_it_computes():
    """An engine kernel computes g = -exp(A_log) softplus(a + dt_bias) and beta in float32 from the raw gates it
    is handed: every rounding there is a float32 step of g, which a decay exp(g) carries |g| times.  The budget
    includes those gates (``contracts.kernel_gates``): the correct float32 kernel passes a band-gate case whose
    state it misses against the once-rounded gates alone."""
    from kvbuffer.validate import properties as P
    from kvbuffer.validate.adapters import stepwise_recurrent
    from kvbuffer.validate.cases import Case
    from kvbuffer.validate.contracts import raw_gating

    from . import engine_kernels as ek
    case = Case(B=2, T=5, H=2, HV=4, K=5, V=12, gate="band", beta="mixed", seed=303, norm="unit", v_scale=20.0,
                scale=1.6, qk_l2norm=True, raw_gate_dtype="float32")
    assert ek.correct.raw_gate_dtype == "float32"  # the default of raw gating

    def check(raw):
        with raw_gating(raw):
            return P.check_recurrent(stepwise_recurrent(ek.correct.recurrent_decode), case, torch.float32,
                                     initial=False)
    assert all(c.passed for c in check("float32")), [str(c) for c in check("float32")]
    assert not all(c.passed for c in check(""))  # judged against the rounded gates alone
