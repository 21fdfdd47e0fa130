"""The implementations ``kvbuffer validate`` knows by name, and ``resolve``, which loads any other.

``resolve("module:attr")`` loads an adapter (docs/validate-your-kernel.md); ``attr`` may also be a factory (a
callable that is not itself an operation, called with no arguments).  Ready adapters: ``reference``
(kvbuffer_ref, float64 and float32, both forms), ``fast`` (kvbuffer_fast, the Triton kernels), ``fla``
(flash-linear-attention's fused_recurrent / chunk kernels, gated delta rule and KDA), ``fla-pool`` (fla's
pooled KDA decode step, in its engine convention), ``replayssm``, the ``sglang`` family, ``hf`` (HF transformers'
torch fallbacks), the ``vllm`` family and the ``flashinfer`` family (``kvbuffer.peers``).
Short names: ``ref``, ``fast``, ``fla``, ``fla-pool``.
"""

from __future__ import annotations

import importlib
import importlib.util
import functools
import os
import types

import torch

from .peers import flashinfer, hf, replayssm, sglang, vllm
from .peers.fla import fla, fla_pool
from .validate.adapters import (DEFAULT_IN_PLACE, OPERATION_ATTRS, POISON_ENV, AdapterError, Implementation,
                                _is_adapter, describe, interpreter_active, unavailable)
from .validate.cases import NORMAL, SMALL

__all__ = ["resolve", "builtin_names", "reference", "reference_from", "fast", "fast_from", "default_implementations",
           "FAST_IN_PLACE"]

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
    # under the interpreter IEEE everywhere, unless float16 takes the compiled 16-bit paths
    # ($KVBUFFER_FAST_16BIT_PATHS=1, ``_common.sixteen_bit_paths``): then judged as what they keep
    chunk_ops = ("chunk", "chunk_varlen", "direct", "prefill")
    if not interpreter_active():
        # float16 compiled: judged as bfloat16 products, since its products mix float16 and TF32 operands (as
        # float16 products alone, one chunk_varlen state of 18 CI-profile seeds was 5.1x its budget, H100)
        lane_contracts = {(op, dt): "tf32x3" if dt == torch.float32 else "bf16"
                          for op in chunk_ops for dt in (torch.float32, torch.float16, torch.bfloat16)}
    else:
        paths = getattr(importlib.import_module(f"{package}._common"), "sixteen_bit_paths", None) \
            if importlib.util.find_spec(f"{package}._common") is not None else None
        on = paths is not None and paths(torch.empty(0, dtype=torch.float16))
        lane_contracts = {(op, torch.float16): "fp16" for op in chunk_ops} if on else {}
    # bfloat16 only compiled: under the Triton interpreter bfloat16 arithmetic is not what the GPU computes
    dtypes = (torch.float32, torch.float16) + (() if interpreter_active() else (torch.bfloat16,))
    return Implementation(name=package, obj=types.SimpleNamespace(prepare=prepare, **ops),
                          dtypes=dtypes, forms=("u",), channel_gate=True,
                          interpreted=interpreter_active(), not_provided=missing,
                          sizes=SMALL if interpreter_active() else NORMAL, in_place=dict(FAST_IN_PLACE),
                          lane_contracts=lane_contracts, varlen=_VARLEN)


def default_implementations() -> list:
    """What ``kvbuffer validate`` checks without --impl: the reference's forms and kvbuffer_fast; without
    triton, kvbuffer_fast is listed as NOT RUN (with the reason) rather than dropped."""
    ref = reference()
    ref.spec, ref.rebuild = "reference", functools.partial(resolve, "reference")
    try:
        kernels = fast()
    except AdapterError as e:
        return [ref, unavailable("kvbuffer_fast", str(e))]
    kernels.spec, kernels.rebuild = "fast", functools.partial(resolve, "fast")
    return [ref, kernels]


def fast() -> Implementation:
    """This project's Triton kernels (kvbuffer_fast): compiled on CUDA, on the interpreter on the CPU."""
    return fast_from("kvbuffer_fast")


_SGLANG = {"sglang": sglang.sglang, "sglang-decode": sglang.sglang_decode, "sglang-packed": sglang.sglang_packed,
           "sglang-pool": sglang.sglang_pool, "sglang-chunk": sglang.sglang_chunk, "sglang-inputs": sglang.sglang_inputs}
_VLLM = {"vllm": vllm.vllm, "vllm-decode": vllm.vllm_decode, "vllm-packed": vllm.vllm_packed,
         "vllm-chunk": vllm.vllm_chunk, "vllm-inputs": vllm.vllm_inputs}
_FLASHINFER = {"flashinfer": flashinfer.flashinfer, "flashinfer-bf16": flashinfer.flashinfer_bf16,
               "flashinfer-mtp": flashinfer.flashinfer_mtp}
_BUILTIN = {"reference": reference, "ref": reference, "kvbuffer_ref": reference,
            "fast": fast, "kvbuffer_fast": fast, "fla": fla, "fla-pool": fla_pool, "replayssm": replayssm.replayssm,
            "hf": hf.hf, **_SGLANG, **_VLLM, **_FLASHINFER}


def builtin_names() -> list[str]:
    return ["reference", "fast", "fla", "fla-pool", "replayssm", *_SGLANG, "hf", *_VLLM, *_FLASHINFER]


def resolve(spec: str) -> Implementation:
    """An implementation from ``module:attr`` (an adapter object, module or factory), ``module`` (the
    module itself is the adapter) or a ready adapter's short name (``builtin_names``); its ``spec`` is
    ``spec`` (a worker process of ``run_validation(jobs=N)`` resolves it again)."""
    if not isinstance(spec, str) or not spec.strip():
        raise AdapterError(f"--impl: expected module:attr or one of {builtin_names()}, got {spec!r}")
    spec = spec.strip()
    impl = _resolve(spec)
    impl.spec, impl.rebuild = spec, functools.partial(resolve, spec)
    return impl


def _resolve(spec: str) -> Implementation:
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
                           f"{', '.join(OPERATION_ATTRS)} (see kvbuffer.validate.adapters)")
    return describe(obj, name=spec)
