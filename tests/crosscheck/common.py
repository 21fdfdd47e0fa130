"""Shared by the cross-check suites: the golden cases they replay and the comparison they make."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch

from kvbuffer_ref import KVBuffer
from kvbuffer import golden
from kvbuffer.validate import Case, compare, make_inputs
from kvbuffer.validate.properties import truth_and_baseline

@contextlib.contextmanager
def expected_import_warnings():
    """Importing fla (directly, or through transformers' Qwen3-Next module) warns that it found no GPU (its
    kernels run on the Triton interpreter here) and trips torch's deprecation of torch.jit.script_method,
    which fla still uses at import: both expected on this CPU machine, filtered for that import only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        yield


#: The golden cases a sequence-level function (recurrent or chunked) can run: recurrent, chunk, direct.
SEQUENCE_CASES = golden.load_cases(ops=["recurrent", "chunk", "direct"])
SCALAR_CASES = [c for c in SEQUENCE_CASES if c.params["gate"] == "scalar"]


def check_golden(case, impl) -> None:
    """``impl`` (a golden.check-style namespace) on ``case`` in float32: the calibrated float32 budget."""
    rep = golden.check_case(case, impl, dtype=torch.float32, raise_errors=True)
    assert rep.passed, rep.table()


#: Random cases beyond the golden set: longer than one default chunk (T=70 > 64), grouped heads.
RANDOM_CASES = [
    Case(B=2, T=70, H=2, HV=4, K=16, V=12, gate="mild", beta="uniform", seed=11),
    Case(B=1, T=33, H=1, HV=2, K=16, V=16, gate="mixed", beta="mixed", zero_key=True, seed=12),
    Case(B=1, T=20, H=1, HV=1, K=32, V=32, gate="strong", beta="one", seed=13),
]


def check_random(case: Case, adapter, *, channel_ok: bool, chunk=None, **kw) -> None:
    """``adapter`` vs the float64 recurrent truth on ``case`` (inputs rounded to float32 first), with an
    initial state, under the float32 budget (baseline: kvbuffer_ref's correct forms in float32,
    ``truth_and_baseline``: the recurrence, and for a chunked adapter (``chunk``: its chunk size) the
    chunkwise form with chunks of max(64, chunk))."""
    if case.channel_gate and not channel_ok:
        pytest.skip(f"this adapter takes scalar gates only; {case} has per-channel gates")
    x = make_inputs(case, torch.float32)
    gen = torch.Generator().manual_seed(case.seed)
    h0 = 0.5 * torch.randn(case.B, case.HV, case.K, case.V, generator=gen)
    (o, S), (ob, Sb) = truth_and_baseline(x, h0, chunk=chunk)
    oa, Sa = adapter(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=h0.clone(),
                     output_final_state=True, **kw)
    for name, a, e, b, axis in (("o", oa, o, ob, 2), ("final_state", Sa, S, Sb, 1)):
        c = compare(a, e, b, name=name, dtype=torch.float32, head_axis=axis)
        assert c.passed, str(c)


def replay_histories(case, run_sequence, *, chunk=None) -> None:
    """A buffered golden case (decode / verify_chain) replayed as one plain recurrence per request.

    Request b's history is its buffered raw entries followed by its new tokens, from its stale state
    (zeros in direct mode).  ``run_sequence(q, k, v, g, beta, h0)`` ([1, T, ...] float32, h0 [1, HV, K, V])
    returns (o [1, T, HV, V], final state).  The outputs of the new tokens must match the stored
    expected_o, and for decode the final state must match expected_state; budget: float32, baseline
    kvbuffer_ref's correct forms in float32 over the same history (``truth_and_baseline``: the recurrence, and
    for a chunked ``run_sequence`` (``chunk``: its chunk size) the chunkwise form with chunks of max(64, chunk)).
    """
    a = {n: torch.from_numpy(np.array(x)) for n, x in case.arrays.items()}
    B = a["buffer_lengths"].shape[0]
    T = a["q"].shape[1]
    for b in range(B):
        n = int(a["buffer_lengths"][b])
        t = int(a["num_drafts"][b]) if "num_drafts" in a else T
        if t == 0:
            continue
        hist = {f: torch.cat([a["buffer_" + f][b, :n], a[f][b, :t]])[None] for f in KVBuffer.slot_fields("raw")}
        hist["q"] = torch.cat([a["buffer_k"][b, :n], a["q"][b, :t]])[None]  # buffered tokens' outputs unused
        owns = "buffer_state" in a and bool(a["buffer_has_state"][b])
        h0 = (a["buffer_state"][b] if owns else torch.zeros_like(a["expected_state"][b]))[None]
        h32 = {f: x.float() for f, x in hist.items()}
        scale = float(case.params["scale"])
        o, S = run_sequence(h32["q"], h32["k"], h32["v"], h32["g"], h32["beta"], h0.float(), scale)
        _, (ob, Sb) = truth_and_baseline(h32, h0.float(), scale=scale, chunk=chunk)
        exp_o = a["expected_o"][b:b + 1, :t]
        c = compare(o[:, n:], exp_o, ob[:, n:], name=f"{case.id}[{b}].o", dtype=torch.float32)
        assert c.passed, str(c)
        if case.op == "decode":
            c = compare(S, a["expected_state"][b:b + 1], Sb, name=f"{case.id}[{b}].state", dtype=torch.float32,
                        head_axis=1)
            assert c.passed, str(c)


BUFFERED_CASES = golden.load_cases(ops=["decode", "verify_chain"])
