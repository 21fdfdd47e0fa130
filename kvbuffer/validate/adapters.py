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
    engine_inputs(mixed_qkv, a, b, *, A_log, dt_bias, num_heads, head_k_dim, qk_l2norm=True) -> (q, k, v, g, beta)

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
    contract       str | dict  the arithmetic it keeps (kvbuffer.validate.contracts): "ieee" (IEEE float32,
                               the default), "tf32x3" (three TF32 products), "tf32" (TF32 products), "fp16"
                               (float16 products, float32 accumulation), "bf16" (bfloat16 products, float32
                               accumulation), "bf16-state" (a bfloat16 recurrent state); or one per input
                               dtype ({"float16": "fp16", "bfloat16": "bf16"}; a dtype not named: "ieee");
                               the baselines of its budgets are computed in that arithmetic, and the
                               verdict follows it
    convention     dict        an engine kernel's calling convention (kvbuffer.peers.engine): the
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
    raw_gate_dtype str         "float32" or "bfloat16": the kernel takes raw gates ``a``, ``b`` in that dtype
                               and computes g and beta itself (an engine kernel; FlashInfer's wrappers round
                               a, b to bfloat16): every case's g and beta are those of the rounded raw gates
                               (``cases.Case.raw_gate_dtype``), the truth computes with them, the budget
                               includes the gates a float32 kernel computes from them
                               (``contracts.kernel_gates``); the adapter derives its raw gates with
                               ``cases.raw_gates_in``
    declines       callable    ``declines(case) -> str`` or ``declines(case, op) -> str`` (``op`` the lane's
                               operation, "chunk" say): why the kernel cannot take the case's shapes (a
                               16-bit state kernel of K = V = 128 only, say), "" where it can; a declined case
                               is not run, and the lane's report counts the declined cases with the reason
                               (``LaneResult.declined``)
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

``kvbuffer.implementations.resolve("module:attr")`` loads an adapter; the ready ones (this project's two
packages and the peers) are listed there.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from kvbuffer_ref.checks import byte_range

from .cases import NORMAL, RAW_GATE_DTYPES, SMALL, Sizes
from .contracts import check_contract

__all__ = ["ContractViolation", "Guarded", "layout_views", "DEFAULT_IN_PLACE", "OPERATION_ATTRS", "AdapterError",
           "Implementation", "describe", "stepwise_recurrent", "interpreter_active", "POISON_ENV", "unavailable",
           "returned_changed", "GATE_DOMAINS", "poisoned_allocations"]

#: Every operation attribute the validator knows, in report order.
OPERATION_ATTRS = (
    "recurrent_gated_delta_rule", "recurrent_decode", "chunk_gated_delta_rule", "direct_gated_delta_rule",
    "buffered_decode", "flush", "materialize_state", "verify", "accept", "prefill", "engine_inputs",
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
    #: "float32", "bfloat16": it takes raw gates in that dtype (``Case.raw_gate_dtype``); "": g and beta as drawn
    raw_gate_dtype: str = ""
    #: ``declines(case, op) -> str``: why it cannot take the case's shapes in lane operation ``op`` ("" where it
    #: can); None: it takes every case
    declines: Optional[Callable] = None
    #: what ``kvbuffer.implementations.resolve`` made it from ("fast", "module:attr")
    spec: Optional[str] = None
    #: makes it again, in a worker process of ``run_validation(jobs=N)`` (set by ``resolve``: a picklable
    #: callable returning an Implementation; None: its lanes run in the calling process)
    rebuild: Optional[Callable] = None

    def contract_for(self, op: str, dtype) -> str:
        """The contract the lane (op, dtype) declares: its ``lane_contracts`` entry by the lane's name
        ("prefill[u]"), else by its operation ("prefill": every form of it), else by its dtype alone
        (``("*", dtype)``: an adapter's ``contract`` given per dtype), else ``contract``."""
        base = op.split("[", 1)[0]
        for key in ((op, dtype), (base, dtype), ("*", dtype)):
            if key in self.lane_contracts:
                return self.lane_contracts[key]
        return self.contract

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
    raw_gate_dtype = getattr(obj, "raw_gate_dtype", "") or ""
    if raw_gate_dtype not in ("", *RAW_GATE_DTYPES):
        raise AdapterError(f"adapter {label}: raw_gate_dtype must be one of {sorted(RAW_GATE_DTYPES)} or \"\", got "
                           f"{raw_gate_dtype!r}")
    declines = getattr(obj, "declines", None)
    if declines is not None and not callable(declines):
        raise AdapterError(f"adapter {label}: declines must be a callable declines(case) -> str, got "
                           f"{type(declines).__name__}")
    if declines is not None:
        declines = _declines_by_op(declines)
    declared = getattr(obj, "contract", "ieee")
    by_dtype = {}
    try:
        if isinstance(declared, dict):  # by input dtype: {"float16": "fp16", "bfloat16": "bf16"}
            by_dtype = {("*", _dtype(d)): check_contract(c, f"adapter {label}: contract[{d!r}]")
                        for d, c in declared.items()}
            declared = by_dtype.get(("*", torch.float32), "ieee")
        contract = check_contract(declared, f"adapter {label}: contract")
    except ValueError as e:
        raise AdapterError(str(e)) from None
    return Implementation(name=label, obj=obj, dtypes=dtypes, forms=forms, channel_gate=cg,
                          interpreted=interpreted,
                          not_provided=dict(getattr(obj, "not_provided", {}) or {}),
                          is_truth=bool(getattr(obj, "is_truth", False)),
                          sizes=_sizes(getattr(obj, "sizes", "small" if interpreted else "normal"), label),
                          in_place=in_place, beta_max=beta_max, contract=contract, lane_contracts=by_dtype,
                          qk_l2norm=bool(getattr(obj, "qk_l2norm", False)), gates=gates,
                          raw_gate_dtype=raw_gate_dtype, declines=declines,
                          varlen=tuple(getattr(obj, "varlen", ()) or ()))


def unavailable(name: str, reason: str) -> Implementation:
    """An implementation that cannot run here (``reason``): the report lists each of its lanes as NOT RUN."""
    return Implementation(name=name, obj=types.SimpleNamespace(), dtypes=(torch.float32,), forms=("u",),
                          unavailable=reason)


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
_POSITIONAL = {"flush": ("buffer",), "materialize_state": ("buffer",), "accept": ("buffer", "drafts"),
               "engine_inputs": ("mixed_qkv", "a", "b")}


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


def _declines_by_op(declines: Callable) -> Callable:
    """An adapter's ``declines`` as ``declines(case, op)``: as it is when it takes an ``op`` argument, else
    called with the case alone (the same answer in every lane)."""
    try:
        takes_op = "op" in inspect.signature(declines).parameters
    except (TypeError, ValueError):
        takes_op = False
    return declines if takes_op else (lambda case, op="": declines(case))
