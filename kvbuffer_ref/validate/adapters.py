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
    interpreted    bool        it runs on the (slow) Triton interpreter (default False)
    sizes          Sizes | str its size budget: how large the drawn and boundary cases are (the
                               dimensions past tile sizes are in ``cases.Sizes``): "normal" (the default:
                               B past 64, 36 value heads, K and V of 256 and 264, T past 128, 70
                               buffered rows), "small" (the default when ``interpreted``: the boundary
                               cases a slow path can afford) or a ``cases.Sizes`` of its own.  The
                               ``gpu`` profile uses production shapes (``cases.GPU``) unless the
                               implementation is interpreted.  The report prints the budget per lane
    in_place       dict        {attribute: argument names it updates IN PLACE by contract}; every other
                               tensor argument (and field of a buffer or drafts argument) must be left
                               bit for bit as it was (default: ``{"recurrent_decode": ("state",)}``)
    contract       str         the arithmetic it keeps (kvbuffer_ref.validate.contracts): "ieee" (IEEE float32,
                               the default), "tf32" (TF32 products), "bf16" (bfloat16 products, float32
                               accumulation), "bf16-state" (a bfloat16 recurrent state); the baselines of
                               its budgets are computed in that arithmetic, and the verdict follows it
    convention     dict        an engine kernel's calling convention (kvbuffer_ref.validate.engine): the
                               validator converts to it; see ``engine.engine_adapter``
    varlen         tuple       the attributes that take ``cu_seqlens`` (variable-length batches, B = 1):
                               "recurrent_gated_delta_rule", "chunk_gated_delta_rule"; their varlen lanes
                               run only when listed (default: none)
    beta_max       float       the top of its beta domain (default 1.0; 2.0 for kernels that allow
                               negative eigenvalues): beta is drawn in [0, beta_max]
    gates          str         the gate domain it serves: "all" (the default: every log-gate, the resets
                               -inf, -1e30 and -300 of the "reset" regime included) or "finite" (gates such
                               as -exp(A_log) softplus(a + dt_bias), never a reset: the "reset" regime is not
                               drawn; every finite regime, down to -200, still is)
    not_provided   dict        {attribute or lane name: reason} for operations (or lanes, such as
                               "verify_tree") it deliberately leaves out
    prepare()      callable    called once before the validation (e.g. to turn on NaN-filled outputs)

Every call the validator makes goes through ``Guarded``: it clones every tensor argument (and every field
of a buffer or drafts argument), calls, and compares them bit for bit afterwards ([inputs-changed]
unless the argument is in ``in_place``); in examples that draw it, every read-only tensor argument is
passed as a strided, transposed-back, sliced or storage-offset view ([memory-layout]).  During the call
every fresh allocation (``torch.empty`` and its kin) is filled with NaN (integers: their largest value),
without the implementation's cooperation (``poisoned_allocations``): an output element a kernel leaves
unwritten is non-finite, whatever the allocator would have handed out.

``resolve("module:attr")`` loads an adapter; ``attr`` may also be a factory (a callable that is not
itself an operation, called with no arguments).  Ready adapters: ``reference`` (kvbuffer_ref, float64
and float32, both forms), ``fast`` (kvbuffer_fast, the Triton kernels), ``fla`` (flash-linear-attention's
fused_recurrent / chunk kernels, gated delta rule and KDA), ``fla-pool`` (fla's pooled KDA decode step, in
its engine convention).  Short names: ``ref``, ``fast``, ``fla``, ``fla-pool``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvbuffer_ref.checks import byte_range

from .cases import NORMAL, SMALL, Sizes

__all__ = ["ContractViolation", "Guarded", "layout_views", "DEFAULT_IN_PLACE", "OPERATION_ATTRS", "AdapterError", "Implementation", "describe", "resolve", "builtin_names",
           "reference", "reference_from", "fast", "fast_from", "fla", "FlaAdapter", "fla_pool", "stepwise_recurrent",
           "interpreter_active", "POISON_ENV", "unavailable", "default_implementations", "returned_changed",
           "GATE_DOMAINS", "poisoned_allocations"]

#: Every operation attribute the validator knows, in report order.
OPERATION_ATTRS = (
    "recurrent_gated_delta_rule", "recurrent_decode", "chunk_gated_delta_rule", "direct_gated_delta_rule",
    "buffered_decode", "flush", "materialize_state", "verify", "accept", "prefill",
)


#: The gate domains an adapter may declare (``gates``): "all" (every log-gate, resets included) or "finite".
GATE_DOMAINS = ("all", "finite")

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
    sizes: Sizes = NORMAL  # its declared size budget (SMALL on the Triton interpreter)
    in_place: dict = field(default_factory=lambda: dict(DEFAULT_IN_PLACE))
    beta_max: float = 1.0
    unavailable: str = ""  # why it cannot run here at all (e.g. triton missing): every lane is NOT RUN
    contract: str = "ieee"  # the arithmetic contract it declares (contracts.CONTRACTS)
    varlen: tuple = ()  # attributes that take cu_seqlens
    #: {(operation, dtype): contract} where a lane keeps another contract than ``contract`` (e.g. 16-bit
    #: products in a chunk kernel's 16-bit lanes)
    lane_contracts: dict = field(default_factory=dict)
    #: it L2-normalises q and k itself (``Case.qk_l2norm``): rows of any norm, the truth on their normalisation
    qk_l2norm: bool = False
    #: the gate domain it serves (``GATE_DOMAINS``): "all" (resets -inf, -1e30, -300 drawn) or "finite" (not)
    gates: str = "all"

    def contract_for(self, op: str, dtype) -> str:
        """The contract the lane (op, dtype) declares: its ``lane_contracts`` entry by the lane's name
        ("prefill[u]"), else by its operation ("prefill": every form of it), else ``contract``."""
        base = op.split("[", 1)[0]
        return self.lane_contracts.get((op, dtype), self.lane_contracts.get((base, dtype), self.contract))

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


#: What the protocol itself updates in place: recurrent_decode's state.
DEFAULT_IN_PLACE = {"recurrent_decode": ("state",)}


def _sizes(x, label) -> Sizes:
    if isinstance(x, Sizes):
        return x
    by = {"normal": NORMAL, "small": SMALL}
    if x not in by:
        raise AdapterError(f"adapter {label}: sizes must be 'normal', 'small' or a Sizes, got {x!r}")
    return by[x]


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
    interpreted = bool(getattr(obj, "interpreted", False))
    in_place = dict(DEFAULT_IN_PLACE)
    in_place.update({a: tuple(v) for a, v in (getattr(obj, "in_place", None) or {}).items()})
    beta_max = float(getattr(obj, "beta_max", 1.0))
    if not beta_max > 0:
        raise AdapterError(f"adapter {label}: beta_max must be positive, got {beta_max}")
    if hasattr(obj, "unit_qk"):
        raise AdapterError(f"adapter {label}: unit_qk is not a declaration (the validator would ignore it); declare "
                           f"qk_l2norm = True for a kernel that L2-normalises q and k itself")
    gates = getattr(obj, "gates", "all")
    if isinstance(obj, types.ModuleType) and not isinstance(gates, str):
        gates = "all"  # a module's own attribute of that name (a helper), not a declaration
    if gates not in GATE_DOMAINS:
        raise AdapterError(f"adapter {label}: gates must be one of {GATE_DOMAINS} (\"finite\": a kernel whose "
                           f"gates are never a reset, -inf or -1e30), got {gates!r}")
    from .contracts import check_contract
    try:
        contract = check_contract(getattr(obj, "contract", "ieee"), f"adapter {label}: contract")
    except ValueError as e:
        raise AdapterError(str(e)) from None
    return Implementation(name=label, obj=obj, dtypes=dtypes, forms=forms, channel_gate=cg,
                          interpreted=interpreted,
                          not_provided=dict(getattr(obj, "not_provided", {}) or {}),
                          is_truth=bool(getattr(obj, "is_truth", False)),
                          sizes=_sizes(getattr(obj, "sizes", "small" if interpreted else "normal"), label),
                          in_place=in_place, beta_max=beta_max, contract=contract,
                          qk_l2norm=bool(getattr(obj, "qk_l2norm", False)), gates=gates,
                          varlen=tuple(getattr(obj, "varlen", ()) or ()))


# ----------------------------------------------------------------------------- ready adapters
#: The forms kvbuffer_ref and kvbuffer_fast take variable-length batches in (``cu_seqlens``).
_VARLEN = ("recurrent_gated_delta_rule", "chunk_gated_delta_rule")

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
                          channel_gate=True, interpreted=False, is_truth=as_truth, not_provided=not_provided,
                          varlen=_VARLEN)


def reference() -> Implementation:
    """The oracle's own forms (kvbuffer_ref) in float64 and float32, both buffer forms."""
    return reference_from("kvbuffer_ref")


#: Where kvbuffer_fast keeps what is not part of the mirrored API (``recurrent_decode``, the in-place
#: decode step serving engines run today): validated too, through ``stepwise_recurrent``.
_FAST_EXTRA_MODULES = ("baselines",)


#: kvbuffer_fast's buffer operations update the buffer's tensors IN PLACE (its contract); its verify and
#: materialize_state leave the buffer as it was.
FAST_IN_PLACE = {**DEFAULT_IN_PLACE, "buffered_decode": ("buffer",), "flush": ("buffer",), "accept": ("buffer",)}


def fast_from(package: str = "kvbuffer_fast") -> Implementation:
    """A package with kvbuffer_fast's public API (e.g. a mutant copy): u-cache form, float32 and float16
    (and bfloat16 when compiled).

    The operations are the package's public functions (and ``recurrent_decode`` of its ``baselines``
    module), called with the reference's signatures.  ``prepare`` sets ``KVBUFFER_POISON=1``, which the
    package reads whenever it allocates an output: every output starts as NaN, so an element a kernel
    forgets to write fails.
    """
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton is installed where the kernels are used
        raise AdapterError(f"{package} needs triton, which is not installed ({e}); pip install 'kvbuffer[fast]'") \
            from None
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
    # compiled, the chunk kernels multiply float32 inputs as three TF32 products and 16-bit inputs in 16-bit
    # products (kvbuffer_fast/chunk.py, "Precision"; docs/kernels.md)
    lane_contracts = {} if interpreter_active() else {
        (op, dt): "tf32x3" if dt == torch.float32 else "bf16" for op in ("chunk", "chunk_varlen", "direct", "prefill")
        for dt in (torch.float32, torch.float16, torch.bfloat16)}
    # bfloat16 only compiled: under the Triton interpreter bfloat16 arithmetic is not what the GPU computes
    dtypes = (torch.float32, torch.float16) + (() if interpreter_active() else (torch.bfloat16,))
    return Implementation(name=package, obj=types.SimpleNamespace(prepare=prepare, **ops),
                          dtypes=dtypes, forms=("u",), channel_gate=True,
                          interpreted=interpreter_active(), not_provided=missing,
                          sizes=SMALL if interpreter_active() else NORMAL, in_place=dict(FAST_IN_PLACE),
                          lane_contracts=lane_contracts, varlen=_VARLEN)


def unavailable(name: str, reason: str) -> Implementation:
    """An implementation that cannot run here (``reason``): the report lists each of its lanes as NOT RUN."""
    return Implementation(name=name, obj=types.SimpleNamespace(), dtypes=(torch.float32,), forms=("u",),
                          unavailable=reason)


def default_implementations() -> list:
    """What ``kvbuffer validate`` checks without --impl: the reference's forms and kvbuffer_fast; without
    triton, kvbuffer_fast is listed as NOT RUN (with the reason) rather than dropped."""
    try:
        return [reference(), fast()]
    except AdapterError as e:
        return [reference(), unavailable("kvbuffer_fast", str(e))]


def fast() -> Implementation:
    """This project's Triton kernels (kvbuffer_fast): compiled on CUDA, on the interpreter on the CPU."""
    return fast_from("kvbuffer_fast")


class FlaAdapter:
    """flash-linear-attention (fla >= 0.6) behind the protocol: scalar gates go to its gated-delta-rule
    kernels (``fla.ops.gated_delta_rule``), per-channel gates [B, T, HV, K] to its KDA kernels
    (``fla.ops.kda``, Kimi Delta Attention).

    * ``recurrent_gated_delta_rule`` -> ``fused_recurrent_gated_delta_rule`` (scalar ``g`` [B, T, HV]) or
      ``fused_recurrent_kda`` (per-channel ``g``), fla's decode kernels.  fla takes g and beta
      positionally after v; here they are keywords.  beta [B, T, HV] is "head-wise" (one per value
      head); fla's default scale is also K ** -0.5; its initial_state is [B, HV, K, V] in float32 (the
      same layout; ``state_v_first=False``); q/k normalisation inside the kernel is off
      (``use_qk_l2norm_in_kernel=False``: the caller normalises, as our convention says); grouped
      value heads (HV > H, head i uses q/k head i // (HV // H)) are native to fla.  KDA's gate is
      passed in log space as it is (``use_gate_in_kernel=False``: no in-kernel ``-exp(A_log)
      softplus(g + dt_bias)``) and beta as it is (``use_beta_sigmoid_in_kernel=False``): no conversion.
    * ``recurrent_decode``: the same kernels called with T = 1, the state passed in and its final state
      copied back (how a serving engine calls them per decode step).
    * ``chunk_gated_delta_rule`` -> ``chunk_gated_delta_rule`` (scalar gates) or ``chunk_kda``
      (per-channel gates), fla's prefill kernels, with fla's own chunk size 64 (the requested size is a
      property of our reference form; fla takes 16/32/64, KDA 32/64), and CUDA only: their kernels do
      not run under the Triton interpreter (their autotuners benchmark on a GPU driver), so on the CPU
      they are reported as not provided.
    * Every kernel takes ``cu_seqlens`` (int64 offsets, B = 1): the varlen lanes.
    * No buffered decode, flush, verify or accept exists in fla: not provided.  Its pooled KDA decode
      (state slots addressed by ``ssm_state_indices``) is the separate adapter ``fla_pool``.
    """

    name = "fla"
    forms = ("u",)
    channel_gate = frozenset({"recurrent_gated_delta_rule", "recurrent_decode", "chunk_gated_delta_rule"})

    def __init__(self):
        try:
            with warnings.catch_warnings():  # fla warns at import when it finds no GPU
                warnings.simplefilter("ignore")
                import fla  # noqa: F401
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
                from fla.ops.kda import chunk_kda, fused_recurrent_kda
        except ImportError as e:
            raise AdapterError(f"the fla adapter needs fla-core 0.6.0 (pip install 'kvbuffer[crosscheck]', or pip install fla-core==0.6.0): {e}") \
                from None
        self._fused, self._fused_kda = fused_recurrent_gated_delta_rule, fused_recurrent_kda
        self._chunk, self._chunk_kda = chunk_gated_delta_rule, chunk_kda
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
                "fla's chunk kernels (chunk_gated_delta_rule, chunk_kda) do not run under the Triton interpreter "
                "(CPU: their autotuners need a GPU driver); validate them with --device cuda")
            self.chunk_gated_delta_rule = None

    varlen = ("recurrent_gated_delta_rule", "chunk_gated_delta_rule")  # fla's cu_seqlens (int64 offsets)

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   cu_seqlens=None):
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        kw = dict(beta=beta, scale=scale, initial_state=_fla_state(initial_state), output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=False, **_fla_offsets(cu_seqlens))
        if g.dim() == 4:
            return self._fused_kda(q, k, v, g=g, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kw)
        return self._fused(q, k, v, g=g, **kw)

    def recurrent_decode(self, q, k, v, *, g, beta, state, scale=None):
        """One decode step the way serving calls fla: state in, final state out, copied back in place."""
        o, new = self.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                                 output_final_state=True)
        state.copy_(new)
        return o

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                               chunk_size=64, cu_seqlens=None):
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        kw = dict(scale=scale, initial_state=_fla_state(initial_state), output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=False, **_fla_offsets(cu_seqlens))
        if g.dim() == 4:
            return self._chunk_kda(q, k, v, g, beta, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kw)
        return self._chunk(q, k, v, g, beta, **kw)


def _fla_state(S):
    """An initial state as fla's kernels take it: [N, HV, K, V], float32, contiguous (or None)."""
    return None if S is None else S.to(torch.float32).contiguous()


def _fla_offsets(cu_seqlens) -> dict:
    """fla's ``cu_seqlens`` keyword (int64 offsets), or none."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(torch.int64)}


def fla() -> Implementation:
    """flash-linear-attention's kernels (see ``FlaAdapter``)."""
    return describe(FlaAdapter())


def fla_pool() -> Implementation:
    """fla's pooled KDA decode step in its own calling convention (``engine.engine_adapter``), as a serving
    engine calls it: ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` with the states in a pool
    [slots, HV, K, V] (float32) addressed by ``ssm_state_indices`` and updated in place
    (``inplace_final_state=True``), tokens flattened with ``cu_seqlens``, q and k L2-normalised in the
    kernel (``use_qk_l2norm_in_kernel=True``).  Padded rows carry slot 0, a reserved null block (the
    kernel has no pad check: a negative slot would address memory before the pool).  The gate goes in
    log space and beta as it is (``use_gate_in_kernel=False``, ``use_beta_sigmoid_in_kernel=False``): the
    in-kernel gating (``-exp(A_log) softplus(g + dt_bias)`` per channel, ``sigmoid(beta)``) would need
    raw inputs converted from our log gates, which float32 cannot hold exactly, so it is not exercised.
    A scalar gate is passed as the same gate in every key channel (exact).  Inputs in float32 and float16
    (the engine convention's dtypes)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fla
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:
        raise AdapterError(f"the fla-pool adapter needs fla-core 0.6.0 (pip install fla-core==0.6.0): {e}") from None
    from .engine import engine_adapter

    def step(*, q, k, v, g, beta, state, slots, cu_seqlens, scale):
        if g.dim() == beta.dim():
            g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
        o, _ = fused_recurrent_kda_fwd(q, k, v, g.contiguous(), beta, scale=scale, initial_state=state,
                                       inplace_final_state=True, cu_seqlens=cu_seqlens, ssm_state_indices=slots,
                                       use_qk_l2norm_in_kernel=True)
        return o

    adapter = engine_adapter(step, name=f"fla {getattr(fla, '__version__', '?')} kda pool decode", qk_l2norm=True,
                             pool=True, pad_slot=0, reserved_slots=(0,), pad_writes=True, varlen=True)
    adapter.interpreted = interpreter_active()
    return describe(adapter)


def replayssm() -> Implementation:
    """ReplaySSM's decode kernel, loaded from the checkout in $KVBUFFER_PEER_PATH (``peers.replayssm``)."""
    from .peers import replayssm as load
    return load()


def _sglang(kind: str):
    """SGLang's kernels (``kvbuffer_ref.validate.sglang``), from --peer-path or an installed sglang."""
    def factory():
        from . import sglang
        return getattr(sglang, kind)()
    return factory


_SGLANG = {"sglang": _sglang("sglang"), "sglang-decode": _sglang("sglang_decode"),
           "sglang-packed": _sglang("sglang_packed"), "sglang-pool": _sglang("sglang_pool"),
           "sglang-chunk": _sglang("sglang_chunk")}
_BUILTIN = {"reference": reference, "ref": reference, "kvbuffer_ref": reference,
            "fast": fast, "kvbuffer_fast": fast, "fla": fla, "fla-pool": fla_pool, "replayssm": replayssm, **_SGLANG}


def builtin_names() -> list[str]:
    return ["reference", "fast", "fla", "fla-pool", "replayssm", *_SGLANG]


def resolve(spec: str) -> Implementation:
    """An implementation from ``module:attr`` (an adapter object, module or factory), ``module`` (the
    module itself is the adapter) or a ready adapter's short name (``builtin_names``)."""
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
            state = torch.zeros(B, HV, K, V, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        else:  # the state in the compute dtype (float64 inputs keep a float64 state), never the caller's tensor
            state = initial_state.to(torch.promote_types(q.dtype, torch.float32), copy=True).contiguous()
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


# ----------------------------------------------------------------------------- the call guard
class ContractViolation(AssertionError):
    """A breach of the protocol found by the lane itself, not by a comparison: its ``klass`` names the
    class of bug ("inputs-changed", "state-leak", ...) and the message starts with it in brackets."""

    def __init__(self, klass: str, message: str):
        super().__init__(f"[{klass}] {message}")
        self.klass = klass


#: The positional parameters of each operation (the rest are keywords).
_POSITIONAL = {"flush": ("buffer",), "materialize_state": ("buffer",), "accept": ("buffer", "drafts")}


def _tensors_of(name: str, x) -> dict:
    """{label: tensor} of one argument: a tensor, or every tensor field of a buffer / drafts object."""
    if isinstance(x, torch.Tensor):
        return {name: x}
    fields = getattr(x, "tensors", None)
    if callable(fields):
        return {f"{name}.{f}": t for f, t in fields().items() if isinstance(t, torch.Tensor)}
    return {}


def _bits(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    y.copy_(x.detach().reshape(-1))
    return y.view(torch.uint8) if x.numel() and x.dtype != torch.bool else y


#: The memory layouts ``layout_views`` draws: every element equal, the strides and offsets not.
LAYOUTS = ("strided", "transposed", "offset", "sliced")


def layout_view(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as ``x`` in a non-contiguous view (or one whose storage offset is not zero);
    "compact": a fresh contiguous copy (storage offset 0)."""
    if kind == "compact":
        return x.detach().clone(memory_format=torch.contiguous_format)
    if x.dim() == 0 or x.numel() == 0:
        return x
    if kind == "strided":  # every other element of a twice-as-wide last dimension
        big = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan") if x.is_floating_point() else -7,
                         dtype=x.dtype, device=x.device)
        big[..., ::2] = x
        return big[..., ::2]
    if kind == "transposed" and x.dim() >= 3:  # stored [.., T, B, ..] then transposed back
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "sliced":  # one request of padding on each side of the batch
        pad = torch.full((1, *x.shape[1:]), float("nan") if x.is_floating_point() else -7, dtype=x.dtype,
                         device=x.device)
        return torch.cat([pad, x, pad])[1:-1]
    flat = torch.empty(x.numel() + 5, dtype=x.dtype, device=x.device)  # offset (and the fallback)
    out = flat[5:].view(x.shape)
    out.copy_(x)
    return out


def layout_views(args: dict, rng, skip=()) -> dict:
    """Every tensor of ``args`` (not named in ``skip``) replaced by a ``layout_view``: of a kind drawn from
    ``rng`` (a ``random.Random``), or of the kind ``rng`` names ("compact": a fresh contiguous copy)."""
    def kind():
        return rng if isinstance(rng, str) else LAYOUTS[rng.randrange(len(LAYOUTS))]
    return {n: (layout_view(t, kind()) if isinstance(t, torch.Tensor) and n not in skip else t)
            for n, t in args.items()}


@contextlib.contextmanager
def poisoned_allocations():
    """Every fresh allocation made inside (``torch.empty``, ``empty_like``, ``new_empty``, ``empty_strided``,
    a growing ``resize_``) filled with NaN (floating and complex dtypes; integers: their largest value), on
    the CPU and on CUDA, without the cooperation of the code that allocates: PyTorch's deterministic mode
    with ``torch.utils.deterministic.fill_uninitialized_memory``, in ``warn_only`` mode (an operation without
    a deterministic implementation still runs; its warning is silenced).  The previous settings come back
    on the way out.  An output a kernel leaves partly unwritten is then non-finite there, where the
    allocator could have handed it zeros (or the previous call's result) and let it pass."""
    import torch.utils.deterministic as det

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = det.fill_uninitialized_memory
    try:
        with warnings.catch_warnings():
            # the warn_only notes ("... does not have a deterministic implementation", cuBLAS' workspace)
            warnings.filterwarnings("ignore", message=r"(?s).*deterministic", category=UserWarning)
            torch.use_deterministic_algorithms(True, warn_only=True)
            det.fill_uninitialized_memory = True
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        det.fill_uninitialized_memory = fill


class Guarded:
    """An adapter object seen through the lane protocol: every operation call clones every tensor it is
    given (buffer and drafts fields included) and compares them bit for bit after the call; an argument
    the implementation declares it updates in place (``Implementation.in_place``) is exempt.  With
    ``layout`` (a ``random.Random``) every tensor argument that is not updated in place, and not a
    buffer, is passed as a non-contiguous or offset view (``layout_views``)."""

    def __init__(self, obj, in_place: dict, layout=None, returned: Optional[list] = None):
        self._obj, self._in_place, self._layout = obj, in_place, layout
        self.calls = 0
        #: (label, tensor, its bits) of every plain tensor an operation returned (``returned_changed``)
        self.returned = [] if returned is None else returned

    def __getattr__(self, attr):
        fn = getattr(self._obj, attr)
        if attr not in OPERATION_ATTRS or not callable(fn):
            return fn

        def call(*args, **kw):
            names = _POSITIONAL.get(attr, ("q", "k", "v"))
            given = dict(zip(names, args), **kw)
            free = set(self._in_place.get(attr, ()))
            back = {}
            if self._layout is not None:
                # an argument updated in place is passed as a view too, and what the call wrote through the view
                # is copied back to the caller's tensor: a kernel that updates a contiguous copy of a strided
                # argument (``state.contiguous()``) leaves the caller's tensor as it was; a kernel that raises on
                # the view (it requires a contiguous one) is called again with the caller's tensor
                views = layout_views({n: x for n, x in given.items() if n in free}, self._layout)
                back = {n: (given[n], x) for n, x in views.items()
                        if isinstance(x, torch.Tensor) and x is not given[n]}
                given = dict(layout_views(given, self._layout, skip=free), **views)
            before = {}
            for n, x in given.items():
                if n not in free:
                    before.update({lab: (t, _bits(t).clone()) for lab, t in _tensors_of(n, x).items()})
            self.calls += 1
            pos = [given[n] for n in names if n in given]
            try:
                with poisoned_allocations():  # what the call allocates and leaves unwritten is NaN
                    out = fn(*pos, **{n: x for n, x in given.items() if n not in names})
            except Exception:
                if not back:
                    raise
                # refusing a strided in-place argument (e.g. "state must be contiguous") is allowed: the call
                # is made again with the caller's own tensors
                given = dict(given, **{n: orig for n, (orig, _) in back.items()})
                back = {}
                pos = [given[n] for n in names if n in given]
                with poisoned_allocations():
                    out = fn(*pos, **{n: x for n, x in given.items() if n not in names})
            for orig, view in back.values():
                orig.copy_(view)
            for lab, (t, bits) in before.items():
                if not torch.equal(_bits(t), bits):
                    raise ContractViolation("inputs-changed", f"input {lab} changed by the call to {attr} "
                                            f"(shape {list(t.shape)}; the implementation declares in place only "
                                            f"{sorted(free) or 'nothing'} for it)")
            for lab, t in _returned_tensors(attr, out):
                for ilab, (x, _) in before.items():
                    if _shares_memory(t, x):
                        raise ContractViolation("state-leak", f"{lab} shares memory with the input {ilab} "
                                                f"(outputs are new memory, docs/conventions.md: a later in-place "
                                                f"update of the one changes the other)")
                self.returned.append((f"{lab} of call {self.calls}", t, _bits(t).clone()))
            return out
        return call


def _returned_tensors(attr: str, out) -> list:
    """(label, tensor) of the plain tensors an operation returned (a buffer or drafts object is not one)."""
    items = out if isinstance(out, tuple) else (out,)
    return [(f"{attr}'s returned value {i}" if len(items) > 1 else f"{attr}'s returned tensor", t)
            for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.numel()]


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` overlap (same storage, overlapping spans)."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1


def returned_changed(returned: list, since: int = 0) -> Optional[str]:
    """The first of ``returned[since:]`` (``Guarded.returned``) whose values changed after it was returned,
    or None: a later call that overwrites a tensor an earlier call returned (a workspace or an output buffer
    returned without a copy) changes the caller's result."""
    for lab, t, bits in returned[since:]:
        if not torch.equal(_bits(t), bits):
            return lab
    return None
