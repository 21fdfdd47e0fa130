"""The adapter protocol: how any gated-delta-rule kernel is plugged into ``kvbuffer validate``.

An *adapter* is any object (a module, a class instance, a ``types.SimpleNamespace``) whose attributes
are the operations it implements, each with the signature and conventions of docs/conventions.md
(every argument after ``q, k, v`` keyword-only; shapes ``[B, T, H, K]`` / ``[B, T, HV, V]``; state
``[B, HV, K, V]``; scale default ``K ** -0.5``)::

    recurrent_gated_delta_rule(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False) -> (o, S | None)
    recurrent_decode(q, k, v, *, g, beta, state, scale=None) -> o       # updates `state` IN PLACE
    chunk_gated_delta_rule(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64) -> (o, S | None)
    direct_gated_delta_rule(q, k, v, *, g, beta, scale=None) -> o
    buffered_decode(q, k, v, *, g, beta, buffer, scale=None) -> (o, buffer)
    flush(buffer, *, count=None) -> buffer
    materialize_state(buffer) -> S
    verify(q, k, v, *, g, beta, buffer, parents=None, num_drafts=None, scale=None) -> (o, drafts)
    accept(buffer, drafts, *, counts=None, nodes=None) -> buffer
    prefill(q, k, v, *, g, beta, capacity, tail=None, scale=None, initial_state=None, form="u", chunk_size=64) -> (o, buffer)

Buffers are ``kvbuffer_ref.KVBuffer`` objects (an adapter converts to its own layout inside and
back).  The validator discovers which operations an adapter provides (``provided_ops``) and reports
every other one as "not provided", with the reason.  Optional attributes describe what it supports:

    name           str         the name in the report (default: the object's name)
    dtypes         tuple       input dtypes it takes (default ``(torch.float32,)``)
    forms          tuple       buffer forms of its buffer operations, "u" and/or "raw" (default ``("u",)``)
    channel_gate   bool | set  per-channel (KDA) gates: True (all ops), False, or the set of op attribute
                               names that take them (default True)
    interpreted    bool        it runs on the (slow) Triton interpreter: the validator draws fewer,
                               smaller cases (default False)
    not_provided   dict        {attribute: reason} for operations it deliberately leaves out
    prepare()      callable    called once before the validation (e.g. to turn on NaN-filled outputs)

``resolve("module:attr")`` loads an adapter; ``attr`` may also be a factory (a callable that is not
itself an operation, called with no arguments).  Ready adapters: ``reference`` (kvbuffer_ref, float64
and float32, both forms), ``fast`` (kvbuffer_fast, the Triton kernels), ``fla`` (flash-linear-attention's
fused_recurrent / chunk kernels).  Short names: ``ref``, ``fast``, ``fla``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["OPERATION_ATTRS", "AdapterError", "Implementation", "describe", "resolve", "builtin_names",
           "reference", "reference_from", "fast", "fast_from", "fla", "FlaAdapter", "stepwise_recurrent",
           "interpreter_active", "POISON_ENV"]

#: Every operation attribute the validator knows, in report order.
OPERATION_ATTRS = (
    "recurrent_gated_delta_rule", "recurrent_decode", "chunk_gated_delta_rule", "direct_gated_delta_rule",
    "buffered_decode", "flush", "materialize_state", "verify", "accept", "prefill",
)


#: The environment variable kvbuffer_fast reads when it allocates an output: "1" fills it with NaN first.
POISON_ENV = "KVBUFFER_POISON"


class AdapterError(ValueError):
    """A bad --impl: unknown module, missing attribute, not an adapter.  The CLI exits 2 on it."""


def interpreter_active() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class Implementation:
    """An adapter plus what it declares about itself (read once by ``describe``)."""

    name: str
    obj: Any
    dtypes: tuple
    forms: tuple
    channel_gate: Any = True
    interpreted: bool = False
    not_provided: dict = field(default_factory=dict)
    is_truth: bool = False  # the oracle itself: its recurrence is the truth, not validated against itself

    def has(self, attr: str) -> bool:
        return callable(getattr(self.obj, attr, None))

    def supports_channel_gate(self, attrs) -> bool:
        if isinstance(self.channel_gate, bool):
            return self.channel_gate
        return all(a in self.channel_gate for a in attrs)

    def prepare(self) -> None:
        fn = getattr(self.obj, "prepare", None)
        if callable(fn):
            fn()


def _is_adapter(obj) -> bool:
    return isinstance(obj, types.ModuleType) or any(callable(getattr(obj, a, None)) for a in OPERATION_ATTRS)


def _dtype(x) -> torch.dtype:
    if isinstance(x, torch.dtype):
        return x
    name = str(x).replace("torch.", "")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise AdapterError(f"adapter: dtypes must be torch dtypes or their names, got {x!r}")
    return dt


def describe(obj, name: Optional[str] = None) -> Implementation:
    """Read an adapter's declarations (see the module docstring) into an ``Implementation``."""
    if isinstance(obj, Implementation):
        return obj
    if not _is_adapter(obj):
        raise AdapterError(f"adapter: {name or obj!r} has none of the operation attributes {', '.join(OPERATION_ATTRS)}")
    label = getattr(obj, "name", None)
    if not isinstance(label, str):
        label = name or getattr(obj, "__name__", None) or type(obj).__name__
    dtypes = tuple(_dtype(d) for d in getattr(obj, "dtypes", (torch.float32,)))
    forms = tuple(getattr(obj, "forms", ("u",)))
    bad = [f for f in forms if f not in ("u", "raw")]
    if bad:
        raise AdapterError(f"adapter {label}: forms must be 'u' and/or 'raw', got {bad}")
    cg = getattr(obj, "channel_gate", True)
    if not isinstance(cg, bool):
        cg = frozenset(cg)
    return Implementation(name=label, obj=obj, dtypes=dtypes, forms=forms, channel_gate=cg,
                          interpreted=bool(getattr(obj, "interpreted", False)),
                          not_provided=dict(getattr(obj, "not_provided", {}) or {}),
                          is_truth=bool(getattr(obj, "is_truth", False)))


# ----------------------------------------------------------------------------- ready adapters
def reference_from(package: str = "kvbuffer_ref", *, as_truth: bool = True) -> Implementation:
    """A pure-PyTorch package with kvbuffer_ref's functions, in float64 and float32, both buffer forms.

    as_truth: it is the oracle itself, whose recurrence is the truth (so it is not validated against
    itself); False for a copy (e.g. a mutant in scripts/mutate.py), whose recurrence is validated too.
    """
    mod = importlib.import_module(package)
    not_provided = {"recurrent_decode": "the reference has no in-place decode step"}
    if as_truth:
        not_provided["recurrent_gated_delta_rule"] = "it is the float64 truth itself"
    return Implementation(name=package, obj=mod, dtypes=(torch.float64, torch.float32), forms=("u", "raw"),
                          channel_gate=True, interpreted=False, is_truth=as_truth, not_provided=not_provided)


def reference() -> Implementation:
    """The oracle's own forms (kvbuffer_ref) in float64 and float32, both buffer forms."""
    return reference_from("kvbuffer_ref")


#: Where kvbuffer_fast keeps what is not part of the mirrored API (``recurrent_decode``, the in-place
#: decode step serving engines run today): validated too, through ``stepwise_recurrent``.
_FAST_EXTRA_MODULES = ("baselines",)


def fast_from(package: str = "kvbuffer_fast") -> Implementation:
    """A package with kvbuffer_fast's public API (e.g. a mutant copy): u-cache form, float32 and float16.

    The operations are the package's public functions (and ``recurrent_decode`` of its ``baselines``
    module), called with the reference's signatures.  ``prepare`` sets ``KVBUFFER_POISON=1``, which the
    package reads whenever it allocates an output: every output starts as NaN, so an element a kernel
    forgets to write fails.
    """
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton is installed where the kernels are used
        raise AdapterError(f"{package} needs triton, which is not installed ({e})") from None
    modules = [importlib.import_module(package)]
    for extra in _FAST_EXTRA_MODULES:
        if importlib.util.find_spec(f"{package}.{extra}") is not None:
            modules.insert(0, importlib.import_module(f"{package}.{extra}"))
    ops = {}
    for attr in OPERATION_ATTRS:
        fn = next((getattr(m, attr) for m in modules if callable(getattr(m, attr, None))), None)
        if fn is not None:
            ops[attr] = fn

    def prepare():
        os.environ[POISON_ENV] = "1"

    missing = {a: f"not implemented in {package}" for a in OPERATION_ATTRS if a not in ops}
    return Implementation(name=package, obj=types.SimpleNamespace(prepare=prepare, **ops),
                          dtypes=(torch.float32, torch.float16), forms=("u",), channel_gate=True,
                          interpreted=interpreter_active(), not_provided=missing)


def fast() -> Implementation:
    """This project's Triton kernels (kvbuffer_fast): compiled on CUDA, on the interpreter on the CPU."""
    return fast_from("kvbuffer_fast")


class FlaAdapter:
    """flash-linear-attention (fla >= 0.6) behind the protocol.

    * ``recurrent_gated_delta_rule`` -> ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``
      (fla's decode kernel).  fla takes g and beta positionally after v; here they are keywords.
      Scalar gates go to fla's ``g`` [B, T, HV], per-channel gates to its ``gk`` [B, T, HV, K]; beta
      [B, T, HV] is "head-wise"; fla's default scale is also K ** -0.5; its initial_state is
      [B, HV, K, V] in float32 (the same layout; ``state_v_first=False``); q/k normalisation inside
      the kernel is off (``use_qk_l2norm_in_kernel=False``: the caller normalises, as our convention
      says); grouped value heads (HV > H, head i uses q/k head i // (HV // H)) are native to fla.
    * ``recurrent_decode``: the same kernel called with T = 1, the state passed in and its final state
      copied back (how a serving engine calls it per decode step).
    * ``chunk_gated_delta_rule`` -> fla's ``chunk_gated_delta_rule`` (prefill): scalar gates only (KDA
      is fla.ops.kda), chunk sizes 16/32/64 only (the requested size is a property of our reference
      form, so fla's own 64 is used), and CUDA only: its kernels do not run under the Triton
      interpreter (autotuner, int64 casts), so on the CPU it is reported as not provided.
    * No buffered decode, flush, verify or accept exists in fla: not provided.
    """

    name = "fla"
    forms = ("u",)
    channel_gate = frozenset({"recurrent_gated_delta_rule"})

    def __init__(self):
        try:
            with warnings.catch_warnings():  # fla warns at import when it finds no GPU
                warnings.simplefilter("ignore")
                import fla  # noqa: F401
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError as e:
            raise AdapterError(f"the fla adapter needs flash-linear-attention (pip install flash-linear-attention): {e}") \
                from None
        self._fused = fused_recurrent_gated_delta_rule
        self._chunk = chunk_gated_delta_rule
        self.version = getattr(fla, "__version__", "?")
        self.name = f"fla {self.version}"
        self.interpreted = interpreter_active()
        on_gpu = torch.cuda.is_available() and not self.interpreted
        self.dtypes = (torch.float32, torch.float16, torch.bfloat16) if on_gpu else (torch.float32, torch.float16)
        self.not_provided = {
            "direct_gated_delta_rule": "fla has no stateless (direct) form",
            "buffered_decode": "fla has no buffered decode (it reads and writes the state every step)",
            "flush": "fla has no buffer", "materialize_state": "fla has no buffer",
            "verify": "fla has no gated-delta-rule speculative verification",
            "accept": "fla has no gated-delta-rule speculative verification",
            "prefill": "fla has no buffer hand-off",
        }
        if not on_gpu:
            self.not_provided["chunk_gated_delta_rule"] = (
                "fla's chunk kernels do not run under the Triton interpreter (CPU); validate them with --device cuda")
            self.chunk_gated_delta_rule = None

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
        gates = {"gk": g} if g.dim() == 4 else {"g": g}
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        return self._fused(q.contiguous(), k.contiguous(), v.contiguous(), beta=beta.contiguous(), scale=scale,
                           initial_state=h0, output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                           **{n: t.contiguous() for n, t in gates.items()})

    def recurrent_decode(self, q, k, v, *, g, beta, state, scale=None):
        """One decode step the way serving calls fla: state in, final state out, copied back in place."""
        o, new = self.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                                 output_final_state=True)
        state.copy_(new)
        return o

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                               chunk_size=64):
        if g.dim() == 4:
            raise NotImplementedError("fla's chunk_gated_delta_rule takes scalar gates only")
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        return self._chunk(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                           scale=scale, initial_state=h0, output_final_state=output_final_state,
                           use_qk_l2norm_in_kernel=False)


def fla() -> Implementation:
    """flash-linear-attention's kernels (see ``FlaAdapter``)."""
    return describe(FlaAdapter())


_BUILTIN = {"reference": reference, "ref": reference, "kvbuffer_ref": reference,
            "fast": fast, "kvbuffer_fast": fast, "fla": fla}


def builtin_names() -> list[str]:
    return ["reference", "fast", "fla"]


def resolve(spec: str) -> Implementation:
    """An implementation from ``module:attr`` (an adapter object, module or factory), ``module`` (the
    module itself is the adapter) or a ready adapter's short name (reference, fast, fla)."""
    if not isinstance(spec, str) or not spec.strip():
        raise AdapterError(f"--impl: expected module:attr or one of {builtin_names()}, got {spec!r}")
    spec = spec.strip()
    if spec in _BUILTIN:
        return _BUILTIN[spec]()
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.startswith(e.name):
            raise AdapterError(f"--impl {spec}: no module named {mod_name!r} (is it on PYTHONPATH?)") from None
        raise AdapterError(f"--impl {spec}: importing {mod_name!r} failed: {e}") from None
    except Exception as e:
        raise AdapterError(f"--impl {spec}: importing {mod_name!r} failed: {type(e).__name__}: {e}") from None
    if not attr:
        return describe(mod, name=mod_name)
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AdapterError(f"--impl {spec}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, Implementation):
        return obj
    if not _is_adapter(obj) and callable(obj):
        try:
            obj = obj()
        except AdapterError:
            raise
        except Exception as e:
            raise AdapterError(f"--impl {spec}: calling the factory {attr!r} failed: {type(e).__name__}: {e}") from None
        if isinstance(obj, Implementation):
            return obj
    if not _is_adapter(obj):
        raise AdapterError(f"--impl {spec}: {attr!r} is not an adapter: it has none of the operation attributes "
                           f"{', '.join(OPERATION_ATTRS)} (see kvbuffer_ref.validate.adapters)")
    return describe(obj, name=spec)


# ----------------------------------------------------------------------------- helpers
class _Stepwise:
    def __init__(self, step):
        self._step = step

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
        B, T, HV, V = v.shape
        K = k.shape[-1]
        if initial_state is None:
            state = torch.zeros(B, HV, K, V, dtype=torch.float32, device=q.device)
        else:
            state = initial_state.to(torch.float32, copy=True).contiguous()
        outs = []
        for t in range(T):
            sl = slice(t, t + 1)
            outs.append(self._step(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], state=state,
                                   scale=scale))
        o = torch.cat(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
        return o, (state if output_final_state else None)


def stepwise_recurrent(step) -> _Stepwise:
    """A ``recurrent_gated_delta_rule`` built from an in-place single-token step
    ``step(q, k, v, *, g, beta, state, scale)`` called once per token (T = 1 each)."""
    return _Stepwise(step)
