"""What a reduced-precision pool does to a real model's next-token distributions (docs/models.md, "Reduced
precision: next-token KL and top-1"; ``kvbuffer validate --report precision --models ...``).

A model of a served family (``kvbuffer.integrations.transformers``) generates over the same prompts
once per *serving precision* (``ServingPrecision``): the reference is the float32 pool (float32 state,
float32 u-cache, the model in float32) generating greedily; every other precision is teacher-forced on the
reference's tokens, so that step n of every run reads the same history and only the linear layers' stored
precision differs:

    float64           the truth: a float64 copy of the model through a float64 pool
    fp32              the reference: float32 model, pool state and u-cache
    <lowp> state      the pool's states stored in ``lowp`` (bfloat16 by default), one rounding per fold
    <lowp> u-cache    the buffered innovations u stored in ``lowp``, one rounding per append or rebase
    <lowp> state + u-cache
    <lowp> state, C = 1   the state rounded after every token (capacity 1: each decode folds), what an
                      engine storing a 16-bit state in its in-place recurrent step does

and, per implementation given (``peers``: ``peer_servings``, ``kvbuffer validate --report precision --models M
--impl PEER``), a row of that implementation's own decode step (``PeerServing``):

    <impl> recurrent_decode (state <dtype>)
                      every linear layer's decode steps run by the implementation's ``recurrent_decode`` on a
                      state it is handed in ``state_dtype`` (and stores in its own dtype where its engine
                      convention keeps one: ``validate.precision.stored_state_dtype``).  The prompt is the
                      fp32 reference pool's (its prefill hand-off, float32): the state after the prompt
                      (``pool.state_of``) is rounded once into ``state_dtype`` and handed to the
                      implementation, which then runs every generated token (``PeerDecodePool``).  The
                      reference (``kvbuffer_ref``, which has no in-place step) is stepped through its own
                      recurrence one token at a time, the state written back (rounded) after each token.

What is modelled: the model computes in float32 and the pool's operations compute in float32 (at least);
the 16-bit fields are stored precision only, read exactly and rounded once (round to nearest even) when
written, as ``kvbuffer_fast``'s kernels store them.  Keys and the cumulative gates G stay float32 (the fast
pool's G is always float32).  With ``kvbuffer_ref.KVPool`` (a CPU) that rounding is the reference's
``entries.store`` / ``KVPool._scatter``; with ``kvbuffer_fast.pool.KVPool`` (a GPU) it is the kernels' own.

The models (no checkpoint is downloaded): ``build_model``'s tiny configs with random weights of a fixed
seed, Qwen's gate biases redrawn by ``slow_gates`` so that the state carries memory over many tokens; a
random model's next-token distributions are nearly uniform, so its KL values are far smaller than a trained
model's for the same logit error (KL grows with the square of the logits' spread): the harness measures the
mechanism, a checkpoint (``model=``) measures a model.

Measured per step n (the distribution of the n-th generated token; request rows b):

    KL(p_ref || p)    in nats, ``kl_divergence``, against the fp32 run (what an engine decides by) and the
                      float64 run (the truth, so that fp32's own KL stands beside the 16-bit ones)
    top-1 agreement   ``argmax p == argmax p_ref`` (``top1_agreement``)
    logit rel-RMS     the worst (request, step) slice's relative RMS error of the logits
    state rel-RMS     worst (layer, request, value head) slice of the current state (the pool's state slot
                      plus its buffer, ``pool.state_of``) that the n-th distribution was read from
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
import types
from typing import Any, Callable, Optional, Sequence

import torch

from kvbuffer_ref.pool import KVPool

from . import transformers as kt
from .transformers import FAMILIES, KVBufferRunner, family_of
from ..validate.precision import stored_state_dtype
from ..validate.tolerances import rel_rms_slices

__all__ = ["ServingPrecision", "serving_precisions", "precision_pool", "kl_divergence", "top1_agreement",
           "checkpoints4", "slow_gates", "random_prompts", "serve", "model_precision_report",
           "model_precision_markdown",
           "DEFAULT_MODELS", "parse_models", "models_section", "PeerServing", "PeerDecodePool", "peer_pool",
           "decode_step", "peer_servings"]

#: The models of ``--models all``.
DEFAULT_MODELS = ("qwen3_next", "qwen3_5", "kimi_linear")


@dataclass(frozen=True)
class ServingPrecision:
    """One way to serve a model's linear layers: ``name``; the pool's ``state_dtype`` and ``cache_dtype``
    (of the buffered u); ``capacity`` C (None: the report's); ``float64``: run a float64 copy of the model
    through a float64 pool (the truth; the dtypes are then float64)."""

    name: str
    state_dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype = torch.float32
    capacity: Optional[int] = None
    float64: bool = False


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype)[6:])


def serving_precisions(lowp: torch.dtype = torch.bfloat16) -> list[ServingPrecision]:
    """The report's precisions: float64, fp32 (the reference, second), ``lowp`` state, ``lowp`` u-cache,
    both, and ``lowp`` state at C = 1 (rounded after every token)."""
    s = _short(lowp)
    return [ServingPrecision("float64", torch.float64, torch.float64, float64=True),
            ServingPrecision("fp32"),
            ServingPrecision(f"{s} state", state_dtype=lowp),
            ServingPrecision(f"{s} u-cache", cache_dtype=lowp),
            ServingPrecision(f"{s} state + u-cache", state_dtype=lowp, cache_dtype=lowp),
            ServingPrecision(f"{s} state, C = 1", state_dtype=lowp, capacity=1)]


def precision_pool(pool_cls, sp: ServingPrecision):
    """A pool constructor for ``KVBufferRunner(pool_cls=...)`` storing ``sp``'s precisions: called with the
    runner's arguments (``dtype`` = the compute dtype), it builds ``pool_cls`` with the state in
    ``sp.state_dtype``, u in ``sp.cache_dtype``, and keys and (where the pool takes ``gate_dtype``, the
    reference pool) the cumulative gates in the compute dtype."""
    takes_gate = "gate_dtype" in inspect.signature(pool_cls).parameters

    def build(*, dtype, **kw):
        extra = dict(gate_dtype=dtype) if takes_gate else {}
        return pool_cls(**kw, dtype=sp.cache_dtype, key_dtype=dtype, state_dtype=sp.state_dtype, **extra)

    return build


# ----------------------------------------------------------------------------- an implementation's decode steps
def decode_step(impl) -> tuple[Optional[Callable], str]:
    """(step, what it is) of an implementation (``validate.adapters.Implementation``): its ``recurrent_decode``
    (``step(q, k, v, *, g, beta, state, scale)`` updating ``state`` in place, returning o); for the oracle itself
    (``is_truth``, kvbuffer_ref, which has no in-place step by design) its ``recurrent_gated_delta_rule`` on one
    token from ``state`` (in at least float32), the final state written back into ``state`` (rounded once into
    its dtype); (None, why) otherwise."""
    obj = impl.obj
    if impl.has("recurrent_decode"):
        return obj.recurrent_decode, "recurrent_decode"
    if impl.is_truth and impl.has("recurrent_gated_delta_rule"):
        rec = obj.recurrent_gated_delta_rule

        def step(q, k, v, *, g, beta, state, scale=None):
            o, S = rec(q, k, v, g=g, beta=beta, scale=scale,
                       initial_state=state.to(torch.promote_types(q.dtype, torch.float32)), output_final_state=True)
            state.copy_(S)
            return o

        return step, "recurrence, T = 1 per step"
    why = impl.not_provided.get("recurrent_decode") if isinstance(impl.not_provided, dict) else None
    return None, why or "no recurrent_decode"


class PeerDecodePool:
    """A serving pool for ``KVBufferRunner`` whose decode steps are an implementation's ``step`` (``decode_step``)
    on states of its own, one [HV, K, V] state in ``state_dtype`` per (layer, request), handed to ``step`` as the
    batch's [B, HV, K, V]; q, k, v handed in ``input_dtype`` (g and beta as the model computes them).  Everything
    else is ``inner``'s, a float32 pool: ``admit`` (the prompt) runs there, and its state after the prompt
    (``inner.state_of``) becomes the request's state, rounded once into ``state_dtype``.  ``state_of`` gives the
    implementation's states (in the compute dtype).  Decode only: ``verify``, ``accept``, ``flush`` and ``fork``
    raise.  The capacity is irrelevant to the decode steps (the inner pool's buffer only holds the prompt's
    tail, folded into the state handed over)."""

    def __init__(self, inner, step: Callable, *, state_dtype: torch.dtype, input_dtype: torch.dtype,
                 dtype: torch.dtype = torch.float32):
        self._inner, self._step = inner, step
        self.state_dtype, self.input_dtype, self.compute_dtype = state_dtype, input_dtype, dtype
        self.states = torch.zeros(inner.layers, inner.num_buffer_slots, inner.num_value_heads, inner.head_k_dim,
                                  inner.head_v_dim, dtype=state_dtype, device=inner.device)

    def __getattr__(self, name):
        if name == "_inner":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    def acquire(self, n: int) -> torch.Tensor:
        got = self._inner.acquire(n)
        self.states[:, got] = 0
        return got

    def admit(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, **kw) -> torch.Tensor:
        o = self._inner.admit(q, k, v, g=g, beta=beta, layer=layer, slots=slots, **kw)
        s = slots.to(self.states.device).long()
        s = s[s >= 0]
        self.states[layer, s] = self._inner.state_of(layer=layer, slots=s).to(self.state_dtype)
        return o

    def decode(self, q, k, v, *, g, beta, layer: int, slots: torch.Tensor, scale=None) -> torch.Tensor:
        s = slots.to(self.states.device).long()
        rows = (s >= 0).nonzero().flatten()
        sv = s[rows]
        S = self.states[layer, sv]  # a gathered copy: the step updates it in place
        dt = self.input_dtype
        o_rows = self._step(q[rows].to(dt), k[rows].to(dt), v[rows].to(dt), g=g[rows], beta=beta[rows], state=S,
                            scale=scale)
        self.states[layer, sv] = S.to(self.state_dtype)
        o = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
        o[rows] = o_rows.to(v.dtype)
        return o

    def state_of(self, *, layer: int, slots: torch.Tensor) -> torch.Tensor:
        s = slots.to(self.states.device).long()
        out = torch.zeros(s.shape[0], *self.states.shape[2:], dtype=self.compute_dtype, device=self.states.device)
        out[s >= 0] = self.states[layer, s[s >= 0]].to(out.dtype)
        return out

    def _decode_only(self, *a, **kw):
        raise NotImplementedError("PeerDecodePool serves prompts and decode steps only (no speculative decoding)")

    verify = accept = flush = fork = _decode_only


def peer_pool(pool_cls, step: Callable, *, state_dtype: torch.dtype, input_dtype: torch.dtype):
    """A pool constructor for ``KVBufferRunner(pool_cls=...)``: a ``PeerDecodePool`` around a float32
    ``pool_cls`` pool (``precision_pool`` of the fp32 precision) for the prompts."""
    inner = precision_pool(pool_cls, ServingPrecision("fp32"))

    def build(*, dtype, **kw):
        return PeerDecodePool(inner(dtype=dtype, **kw), step, state_dtype=state_dtype, input_dtype=input_dtype,
                              dtype=dtype)

    return build


@dataclass(frozen=True)
class PeerServing:
    """An implementation's decode steps as a row of the model report (``peer_servings``): ``name`` (the row),
    ``implementation`` (its name), ``op`` (``decode_step``'s what), ``step``, the ``state_dtype`` it is handed,
    the ``stored_dtype`` it is stored in (``stored_state_dtype``), the ``input_dtype`` of q, k, v;
    ``impl`` the ``Implementation`` (its declarations: per-channel gates, ``declines``)."""

    name: str
    implementation: str
    op: str
    step: Any
    state_dtype: torch.dtype
    stored_dtype: torch.dtype
    input_dtype: torch.dtype
    impl: Any = None

    def refuses(self, model_type: str, heads: tuple) -> str:
        """Why the implementation cannot serve ``model_type``'s linear layers (heads (H, HV, K, V)), "" where it
        can: per-channel (KDA) gates it does not take, or shapes its ``declines`` refuses."""
        fam = FAMILIES[model_type]
        impl = self.impl
        if impl is None:
            return ""
        if fam.channel_gate and not impl.supports_channel_gate(("recurrent_decode",)):
            return f"{self.implementation} takes no per-channel (KDA) gates in recurrent_decode"
        if impl.declines is not None:
            H, HV, K, V = heads
            case = types.SimpleNamespace(B=2, T=1, H=H, HV=HV, K=K, V=V, channel_gate=fam.channel_gate)
            try:
                why = impl.declines(case, "recurrent_decode")
            except Exception:  # noqa: BLE001 - a declines that reads more of a case than this one has: not refused
                why = ""
            if why:
                return why
        return ""


def _input_dtype(impl, device) -> torch.dtype:
    """q, k, v for the implementation: float32 where it declares float32 (the model computes in float32), else
    the 16-bit dtype it declares (bfloat16 first on CUDA, float16 first on the CPU)."""
    if torch.float32 in impl.dtypes:
        return torch.float32
    order = (torch.bfloat16, torch.float16) if str(device).startswith("cuda") else (torch.float16, torch.bfloat16)
    return next((d for d in order if d in impl.dtypes), impl.dtypes[0])


def peer_servings(impls: Sequence, state_dtypes: Sequence[torch.dtype] = (torch.float32,), *,
                  device="cpu") -> tuple[list, list]:
    """The rows of ``impls`` (``validate.adapters.Implementation``): (``PeerServing`` per implementation that
    has a decode step and per state dtype, lines [(name, "NOT RUN" | "NOT PROVIDED", reason)] for the others)."""
    rows, lines = [], []
    for impl in impls:
        if impl.unavailable:
            lines.append((impl.name, "NOT RUN", impl.unavailable))
            continue
        step, op = decode_step(impl)
        if step is None:
            lines.append((impl.name, "NOT PROVIDED", op))
            continue
        impl.prepare()
        inputs = _input_dtype(impl, device)
        for sd in state_dtypes:
            stored = stored_state_dtype(impl, sd)
            what = _short(stored) + ("" if stored == sd else f", its own; handed {_short(sd)}")
            extra = "" if inputs == torch.float32 else f", {_short(inputs)} q/k/v"
            rows.append(PeerServing(f"{impl.name} {op} (state {what}{extra})", impl.name, op, step, sd, stored,
                                    inputs, impl))
    return rows, lines


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats of p = softmax(logits_p) and q = softmax(logits_q) over the last axis: [..., vocab]
    twice -> [...] float64.

    Computed as log E_p[exp(d)] with d = (logits_q - logits_p) - E_p[logits_q - logits_p] (the normalisers
    cancel), by ``log1p(E_p[expm1(d)])``, so that a KL of 1e-15 between nearly equal logits is not lost to
    the rounding of two log-normalisers (about 1e-16 x |log p| each).  Logits equal up to a shift give 0
    (exactly, where the shift is exact)."""
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"logits_q: shape {list(logits_q.shape)} differs from logits_p's {list(logits_p.shape)}")
    x, y = logits_p.detach().double(), logits_q.detach().double()
    p = torch.softmax(x, dim=-1)
    d = y - x
    for _ in range(2):  # centred twice: a shift common to all logits leaves eps x |d|, then eps^2 x |d|
        d = d - (p * d).sum(-1, keepdim=True)
    return torch.log1p((p * torch.expm1(d)).sum(-1))


def top1_agreement(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Whether the two distributions' most likely tokens agree: [..., vocab] twice -> [...] bool."""
    return logits_p.argmax(-1) == logits_q.argmax(-1)


def checkpoints4(steps: int) -> list[int]:
    """1, 4, 16, 64, ... up to ``steps`` (``steps`` itself last when it is not a power of four)."""
    if steps < 1:
        raise ValueError(f"steps: expected a positive integer, got {steps}")
    out, n = [], 1
    while n <= steps:
        out.append(n)
        n *= 4
    return out + ([steps] if out[-1] != steps else [])


def slow_gates(model, seed: int) -> bool:
    """Redraw (in place) the ``dt_bias`` of ``model``'s Qwen gated-delta layers as Mamba-style models
    initialise it, and as transformers' Kimi Linear init does for its own gates: ``softplus(dt_bias) = dt``
    with dt log-uniform in [1e-3, 1e-1] (under ``seed``, layer by layer).  The decay per token is then
    ``-exp(A_log) * dt``: heads remember from about one token to thousands.  transformers' Qwen init
    (``dt_bias = 1``, A in [0.01, 16]) forgets within about a token in almost every head, so that a state's
    rounding hardly reaches the logits.  Kimi's layers (per-channel gates, already so drawn) are left as
    they are.  Returns whether anything was redrawn."""

    fam = family_of(model)
    if fam.channel_gate:
        return False
    g = torch.Generator().manual_seed(seed)
    cls = getattr(fam.modeling(), fam.layer_class)
    for layer in sorted((m for m in model.modules() if isinstance(m, cls)), key=lambda m: m.layer_idx):
        b = layer.dt_bias
        dt = torch.empty(b.shape, dtype=torch.float64).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
        with torch.no_grad():
            b.copy_((dt + torch.log(-torch.expm1(-dt))).to(b.dtype))
    return True


def random_prompts(batch: int, length: int, vocab: int, seed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` prompts of ``length`` token ids drawn uniformly from 1..vocab-1 under ``seed``: (input_ids,
    attention_mask), both [batch, length] int64 (no padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    return ids.to(device), torch.ones_like(ids).to(device)


@torch.no_grad()
def serve(model, input_ids, attention_mask, *, steps: int, sp: ServingPrecision, capacity: int, pool_cls=KVPool,
          tokens: Optional[torch.Tensor] = None, marks: Sequence[int] = (), pool: Optional[Callable] = None) -> tuple:
    """One generation of ``steps`` tokens of ``model`` (in the dtype it is in) through a pool of ``sp``'s
    precision and capacity (``sp.capacity`` or ``capacity``), greedy, or teacher-forced on ``tokens``
    [B, steps].  Returns (tokens [B, steps], logits [B, steps, vocab] float64, states {n: [L, B, HV, K, V]
    float64 on the CPU}: at each step n of ``marks``, every linear layer's current state (``state_of``) that
    the n-th distribution was read from).  ``pool``: a ready pool constructor (``peer_pool``) instead of
    ``precision_pool(pool_cls, sp)``."""

    runner = KVBufferRunner(model, capacity=sp.capacity or capacity, pool_cls=pool or precision_pool(pool_cls, sp),
                            max_requests=input_ids.shape[0])
    pool, states, want = runner.pool, {}, set(marks)

    def progress(n):
        if n in want:
            slots = pool.live.nonzero().flatten()  # this generation's requests, in acquire order
            states[n] = torch.stack([pool.state_of(layer=i, slots=slots) for i in range(pool.layers)]).to(
                "cpu", torch.float64)

    choose = None
    if tokens is not None:
        forced = tokens.to(input_ids.device)
        choose = lambda step, _: forced[:, step]  # noqa: E731
    tok, logits = runner.generate(input_ids, attention_mask, steps, choose=choose, progress=progress)
    return tok, logits.cpu(), states


def _state_rel(states: dict, ref: dict) -> dict:
    """{n: worst (layer, request, value head) slice's rel-RMS of ``states[n]`` against ``ref[n]``}."""
    return {n: float(max(rel_rms_slices(S[i], ref[n][i], 1).max() for i in range(S.shape[0])))
            for n, S in states.items()}


def _windows(x: torch.Tensor, marks: Sequence[int], how) -> list[float]:
    """``how`` (a reduction of a tensor to a float) of x [B, N] over the steps (previous mark, n] per mark."""
    out, prev = [], 0
    for n in marks:
        out.append(float(how(x[:, prev:n])))
        prev = n
    return out


def _against(logits: torch.Tensor, ref_logits: torch.Tensor, states: dict, ref_states: dict,
             marks: Sequence[int]) -> dict:
    """The measures of one run against one reference run (logits [B, N, vocab], states as ``serve``)."""
    kl = kl_divergence(ref_logits, logits)       # [B, N]
    top1 = top1_agreement(ref_logits, logits)    # [B, N]
    rel = _state_rel(states, ref_states)
    return dict(kl_mean=float(kl.mean()), kl_max=float(kl.max()), top1=float(top1.double().mean()),
                logit_rel_max=float(rel_rms_slices(logits, ref_logits, 1).max()),
                state_rel_max=max(rel.values()) if rel else None,
                per_step=dict(kl_mean=kl.mean(0).tolist(), kl_max=kl.max(0).values.tolist(),
                              top1=top1.double().mean(0).tolist()),
                checkpoints=dict(kl_mean=_windows(kl, marks, torch.mean), kl_max=_windows(kl, marks, torch.max),
                                 top1=_windows(top1.double(), marks, torch.mean),
                                 state_rel=[rel.get(n) for n in marks]))


def model_precision_report(model_type: str, *, steps: int = 64, capacity: int = 16, batch: int = 2,
                           prompt_length: int = 24, seed: int = 0, lowp: torch.dtype = torch.bfloat16,
                           precisions: Optional[Sequence[ServingPrecision]] = None, pool_cls=None, device=None,
                           gates: str = "slow", model=None, peers: Sequence[PeerServing] = (),
                           peer_lines: Sequence[tuple] = ()) -> dict:
    """The next-token KL, top-1 agreement and state error of every serving precision (default
    ``serving_precisions(lowp)``, which must hold one ``float64`` precision and one named ``fp32``, the
    reference) over ``steps`` generated tokens of ``batch`` random prompts of ``prompt_length`` tokens
    (seed ``seed``), at capacity C = ``capacity``.  ``model``: a float32 model of ``model_type``, used as it
    is; default ``build_model(model_type, seed=seed)`` (the tiny config, random weights) with ``gates``
    "slow" (``slow_gates``) or "model" (transformers' own init); ``pool_cls`` serves the
    float32-compute runs (default ``kvbuffer_ref.KVPool``; the float64 run always uses it), on ``device``
    (default the CPU).  ``peers`` (``peer_servings``): a row per implementation's decode step, teacher-forced
    as the others; one it refuses for this model (``PeerServing.refuses``) and ``peer_lines`` become the
    report's NOT RUN / NOT PROVIDED lines.  A JSON-ready dict; ``model_precision_markdown`` renders it."""

    precisions = list(precisions or serving_precisions(lowp))
    names = [sp.name for sp in precisions]
    if "fp32" not in names or sum(sp.float64 for sp in precisions) != 1:
        raise ValueError(f"precisions: expected one float64 precision and one named 'fp32', got {names}")
    if gates not in ("slow", "model"):
        raise ValueError(f"gates: expected 'slow' or 'model', got {gates!r}")
    if model is None:
        model = kt.build_model(model_type, seed=seed, device=device)
        if gates == "slow" and not slow_gates(model, seed):
            gates = "model"  # Kimi: its own init already draws slow channels
    else:
        gates = "given"
    pool_cls = pool_cls or KVPool
    model64 = copy.deepcopy(model).double()
    model64.config._experts_implementation = "eager"  # grouped_mm takes no float64
    vocab = model.config.vocab_size
    ids, mask = random_prompts(batch, prompt_length, vocab, seed, device=next(model.parameters()).device)
    marks = checkpoints4(steps)
    runs = {}
    ref = next(sp for sp in precisions if sp.name == "fp32")
    runs["fp32"] = serve(model, ids, mask, steps=steps, sp=ref, capacity=capacity, pool_cls=pool_cls, marks=marks)
    tokens = runs["fp32"][0]
    for sp in precisions:
        if sp.name == "fp32":
            continue
        m, cls = (model64, KVPool) if sp.float64 else (model, pool_cls)
        runs[sp.name] = serve(m, ids, mask, steps=steps, sp=sp, capacity=capacity, pool_cls=cls, tokens=tokens,
                              marks=marks)
    lines = [dict(implementation=n, status=st, reason=why) for n, st, why in peer_lines]
    fam = family_of(model)
    heads = fam.heads(model.config)
    served = []
    for pr in peers:
        if pr.name in runs:
            raise ValueError(f"peers: the row {pr.name!r} is named twice (or as a precision)")
        why = pr.refuses(fam.model_type, heads)
        if why:
            lines.append(dict(implementation=pr.name, status="NOT RUN", reason=why))
            continue
        build = peer_pool(pool_cls, pr.step, state_dtype=pr.state_dtype, input_dtype=pr.input_dtype)
        try:
            runs[pr.name] = serve(model, ids, mask, steps=steps, sp=ref, capacity=capacity, tokens=tokens,
                                  marks=marks, pool=build)
        except (TypeError, ValueError, NotImplementedError) as e:  # it refuses the state or inputs it is handed
            lines.append(dict(implementation=pr.name, status="NOT RUN",
                              reason=f"its {pr.op} raised {type(e).__name__}: {e}"))
            continue
        served.append(pr)
    truth = next(sp.name for sp in precisions if sp.float64)
    _, ref_logits, ref_states = runs["fp32"]
    _, t_logits, t_states = runs[truth]
    p = torch.softmax(ref_logits, -1)
    entropy = float(-(p * torch.log_softmax(ref_logits, -1)).sum(-1).mean())
    series = {}
    for sp in precisions:
        if sp.float64:
            continue
        _, logits, states = runs[sp.name]
        series[sp.name] = dict(state_dtype=_short(sp.state_dtype), cache_dtype=_short(sp.cache_dtype),
                               capacity=sp.capacity or capacity,
                               vs_fp32=_against(logits, ref_logits, states, ref_states, marks),
                               vs_float64=_against(logits, t_logits, states, t_states, marks))
    for pr in served:
        _, logits, states = runs[pr.name]
        series[pr.name] = dict(state_dtype=_short(pr.stored_dtype), handed_state_dtype=_short(pr.state_dtype),
                               cache_dtype=None, capacity=None, implementation=pr.implementation, op=pr.op,
                               input_dtype=_short(pr.input_dtype),
                               vs_fp32=_against(logits, ref_logits, states, ref_states, marks),
                               vs_float64=_against(logits, t_logits, states, t_states, marks))
    notes = []
    if served:
        notes.append("implementation rows: the prompt is the fp32 reference pool's prefill (float32 state); its "
                     "final state is rounded once into the row's state dtype and handed to the implementation, "
                     "whose decode step then runs every generated token of every linear-attention layer "
                     "(teacher-forced like the other rows); g and beta as the model computes them (float32)")
        if any(pr.impl is not None and pr.impl.qk_l2norm for pr in served):
            notes.append("an implementation that L2-normalises q and k itself normalises the model's already "
                         "normalised rows again (x / sqrt(|x|^2 + 1e-6): a relative change of about 5e-7)")
        raw = sorted({pr.implementation for pr in served if pr.impl is not None and pr.impl.raw_gate_dtype})
        if raw:
            notes.append(f"{', '.join(raw)}: raw-gated (engine convention): g and beta are handed over as raw "
                         f"gates a, b under the adapter's fixed A_log and dt_bias, in the dtype it declares "
                         f"(raw_gate_dtype), so the gates it computes are those of the rounded a and b, not the "
                         f"model's own A_log and dt_bias")
    cfg = model.config
    return dict(tool="kvbuffer validate --report precision --models", model=model_type,
                config=dict(hidden_size=cfg.hidden_size, layers=cfg.num_hidden_layers, vocab=vocab,
                            linear_layers=runs["fp32"][2][marks[0]].shape[0] if marks else None),
                gates=gates, seed=seed, batch=batch, prompt_length=prompt_length, steps=steps, capacity=capacity,
                lowp=_short(lowp), pool=f"{pool_cls.__module__}.{pool_cls.__name__}",
                device=str(ids.device), checkpoints=marks, reference_entropy=entropy, uniform_entropy=math.log(vocab),
                tokens=tokens.tolist(), series=series, notes=notes, peers=lines)


def _e(x) -> str:
    return "–" if x is None else ("0" if x == 0 else f"{x:.2e}")


def model_precision_markdown(rep: dict) -> str:
    """One model's report as Markdown: the settings, a summary row per precision (against float64 and
    against fp32), then per checkpoint the mean KL of the steps since the previous checkpoint and the state
    error, each 16-bit precision against fp32 beside fp32 against float64."""
    c, s = rep["config"], rep["series"]
    lowp = [n for n in s if n != "fp32"]
    md = [f"## Next-token precision: {rep['model']}", "",
          f"- Model: hidden {c['hidden_size']}, {c['layers']} layers ({c['linear_layers']} linear-attention), "
          f"vocabulary {c['vocab']}; " + {
              "slow": f"random weights of seed {rep['seed']}, Qwen's dt_bias drawn log-uniform (slow_gates)",
              "model": f"random weights of seed {rep['seed']} (transformers' init)",
              "given": "the model given"}[rep["gates"]],
          f"- {rep['batch']} prompts of {rep['prompt_length']} random tokens (seed {rep['seed']}), {rep['steps']} "
          f"generated tokens, C = {rep['capacity']}, {rep['pool']} on {rep['device']}; every run teacher-forced on "
          f"the fp32 run's greedy tokens",
          f"- The fp32 run's next-token entropy: {rep['reference_entropy']:.3f} nats on average (uniform: "
          f"{rep['uniform_entropy']:.3f}); KL grows with the square of the logits' spread, so sharper (trained) "
          f"models show larger KL for the same state error",
          "- KL in nats; logits: worst (request, step) rel-RMS; state: worst (layer, request, value head) "
          "rel-RMS of the current state"] + [f"- {n}" for n in rep.get("notes", [])] + [
          f"- {x['implementation']}: {x['status']}: {x['reason']}" for x in rep.get("peers", [])] + ["",
          "| precision | KL vs float64: mean | max | top-1 = float64 | KL vs fp32: mean | max | top-1 = fp32 "
          "| logits vs fp32 (worst) | state vs float64 (worst) | state vs fp32 (worst) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, x in s.items():
        a, b = x["vs_float64"], x["vs_fp32"]
        md.append(f"| {name} | {_e(a['kl_mean'])} | {_e(a['kl_max'])} | {a['top1']:.3f} | {_e(b['kl_mean'])} | "
                  f"{_e(b['kl_max'])} | {b['top1']:.3f} | {_e(b['logit_rel_max'])} | {_e(a['state_rel_max'])} | "
                  f"{_e(b['state_rel_max'])} |")
    cols = ["fp32 vs float64"] + [f"{n} vs fp32" for n in lowp]
    pick = lambda n: s["fp32"]["vs_float64"] if n == "fp32" else s[n]["vs_fp32"]  # noqa: E731
    for title, key in (("KL, mean over the steps since the previous checkpoint", "kl_mean"),
                       ("top-1 agreement over the steps since the previous checkpoint", "top1"),
                       ("State rel-RMS at step n", "state_rel")):
        md += ["", f"**{title}**", "", "| step | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
        for i, n in enumerate(rep["checkpoints"]):
            vals = [pick(name)["checkpoints"][key][i] for name in ["fp32"] + lowp]
            md.append(f"| {n} | " + " | ".join(f"{v:.3f}" if key == "top1" else _e(v) for v in vals) + " |")
    return "\n".join(md) + "\n"


def parse_models(text: str) -> list[str]:
    """``--models``: a comma list of served model types, or ``all`` (``DEFAULT_MODELS``); ValueError naming
    the served ones otherwise.  Needs no transformers."""

    names = list(DEFAULT_MODELS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in FAMILIES]
    if not names or bad:
        raise ValueError(f"--models: expected 'all' or a comma list of {', '.join(sorted(FAMILIES))}, got {text!r}")
    return names


def models_section(models: Sequence[str], *, steps: Optional[int], device: str, seed: int, impls: Sequence = (),
                   state_dtypes: Sequence[torch.dtype] = (torch.float32,)) -> tuple[str, list]:
    """The model part of ``kvbuffer validate --report precision --models``: (Markdown, reports).  ``steps``
    None: 64 on the CPU, 256 on CUDA.  The pool: ``kvbuffer_ref.KVPool`` on the CPU,
    ``kvbuffer_fast.pool.KVPool`` on CUDA.  ``impls`` (``validate.adapters.Implementation``): each adds a row
    per state dtype of ``state_dtypes`` to every model's table (``peer_servings``), or a NOT RUN / NOT PROVIDED
    line.  Without a usable transformers, one line saying why and no reports."""

    try:
        kt._transformers()
    except ImportError as e:
        return (f"## Next-token precision: skipped\n\nThe model table needs HF transformers: {e} "
                f"(pip install -e '.[hf]')\n"), []
    pool_cls = KVPool
    if device == "cuda":
        from kvbuffer_fast.pool import KVPool as pool_cls  # here: triton is optional, and CUDA only
    steps = steps or (256 if device == "cuda" else 64)
    peers, lines = peer_servings(impls, state_dtypes, device=device)
    threads = torch.get_num_threads()
    if device != "cuda":
        torch.set_num_threads(1)  # tiny matrices: one thread is several times faster on a busy CPU
    try:
        reports = [model_precision_report(m, steps=steps, seed=seed, pool_cls=pool_cls, device=device, peers=peers,
                                          peer_lines=lines)
                   for m in models]
    finally:
        torch.set_num_threads(threads)
    return "\n".join(model_precision_markdown(r) for r in reports), reports
