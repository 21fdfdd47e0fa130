"""FlashInfer's gated-delta-rule (GDN) kernels as benchmark peers, called through FlashInfer's public API.

FlashInfer is never copied here and is imported only when asked for (``load``): from an installed
``flashinfer-python`` or from a prefix that ``scripts/flashinfer_wheels.sh`` prepares (``path=``: a
folder of installed packages, processed with ``site.addsitedir``, so its ``.pth`` files count).  Written
against flashinfer-python 0.7.4 (``VERSION``); the version found is recorded with every row.

Its GDN kernels are CuTe-DSL kernels (``nvidia-cutlass-dsl``), compiled on first use for the device in
the process and loaded through TVM-FFI (``apache-tvm-ffi``); no nvcc.  What is called here
(``flashinfer.gdn_decode``):

``gated_delta_rule_decode_pretranspose``  T = 1; state "pretransposed" (V-major, K last) [slots, HV, V, K],
                                          a pool addressed by ``initial_state_indices``; float32 state (its
                                          legacy kernel) or bfloat16 state with K = V = 128 (its BF16
                                          kernel, pool slot 0 reserved as a null slot for -1 pads)
``gated_delta_rule_decode``               T = 1; state K-major [B, HV, K, V] float32, our layout, one state
                                          per batch row (no pool, no indices)
``gated_delta_rule_mtp``                  T > 1 (speculative verify); float32 pool [slots, HV, V, K] by
                                          ``initial_state_indices``; ``disable_state_update=True`` keeps the
                                          pool frozen and ``intermediate_states_buffer`` [B, T, HV, V, K]
                                          receives the state after every token (the per-draft-state form)

Every one takes the gates raw, as an engine's GDN layer has them: ``A_log``, ``dt_bias`` [HV] (float32)
and per token ``a``, ``b`` [B, T, HV]; the kernel forms g = -exp(A_log) softplus(a + dt_bias) (softplus
threshold 20) and beta = sigmoid(b).  The BF16-state and MTP kernels convert a and b to bfloat16 inside
FlashInfer's Python wrapper, so ``a`` and ``b`` are handed over in bfloat16 throughout (as an engine's
projections produce them) and the oracle reads the same rounded values.  q and k are L2-normalised in
the kernel (``use_qk_l2norm=True``, x / sqrt(sum x^2 + 1e-6)), as engines call it.

Our conventions: q, k [B, T, H, K], v [B, T, HV, V], log-gates g and beta [B, T, HV], state
[B, HV, K, V] float32.  Everything here that converts between the two (``to_pool``, ``from_pool``,
``raw_gates``, ``oracle_inputs``, ``accept_into_pool``) is plain torch, run once at setup or after
the timed calls, never inside them, and is tested on the CPU (``tests/bench/test_flashinfer_peer.py``).
"""

from __future__ import annotations

import importlib
import random
import site
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..validate.adapters import AdapterError
from .engine import to_raw_gates

__all__ = ["VERSION", "PACKAGE", "FlashInfer", "load", "to_pool", "from_pool", "raw_gates", "pack",
           "oracle_inputs", "accept_into_pool", "FUNCTIONS"]

#: The FlashInfer release the peer is written against (and ``scripts/flashinfer_wheels.sh`` fetches).
VERSION = "0.7.4"
#: Its distribution on PyPI.
PACKAGE = "flashinfer-python"
#: The public functions of ``flashinfer.gdn_decode`` the peer calls.
FUNCTIONS = ("gated_delta_rule_decode_pretranspose", "gated_delta_rule_decode", "gated_delta_rule_mtp")
#: The raw-gate constants FlashInfer's GDN kernels launch with (the oracle's are the same).
SOFTPLUS_THRESHOLD = 20.0
NORM_EPS = 1e-6


@dataclass
class FlashInfer:
    """FlashInfer's GDN entry points, as loaded: the functions, its version, and where it came from."""

    decode_pretranspose: object
    decode_kmajor: object
    mtp: object
    version: str
    source: str


def _missing(why: str) -> AdapterError:
    return AdapterError(
        f"FlashInfer ({PACKAGE} {VERSION}) is not importable: {why}. Its GDN kernels need {PACKAGE}=={VERSION} "
        f"with nvidia-cutlass-dsl (the cu13 libs), apache-tvm-ffi and cuda-python: build the prefix with "
        f"'bash scripts/flashinfer_wheels.sh' and pass it with --flashinfer-path, or pip install {PACKAGE}=={VERSION}")


def load(path: Optional[str] = None) -> FlashInfer:
    """FlashInfer's GDN functions: from the prefix ``path`` (a folder of installed packages, added with
    ``site.addsitedir``) or, without one, an installed ``flashinfer``.  Raises ``AdapterError`` naming the
    package and version when it cannot be imported."""
    source = "installed"
    if path:
        p = Path(path).expanduser().resolve()
        if not (p / "flashinfer").is_dir():
            raise _missing(f"{p} holds no flashinfer package (expected {p}/flashinfer/)")
        if str(p) not in sys.path:
            site.addsitedir(str(p))  # its .pth files (nvidia_cutlass_dsl's dsl_packages) included
        source = str(p)
    try:
        fi = importlib.import_module("flashinfer")
        gdn = importlib.import_module("flashinfer.gdn_decode")
    except Exception as e:  # noqa: BLE001 - any import failure is a skip with its reason
        raise _missing(f"{type(e).__name__}: {e}") from None
    missing = [f for f in FUNCTIONS if not hasattr(gdn, f)]
    if missing:
        raise _missing(f"flashinfer {getattr(fi, '__version__', '?')} has no {missing} in flashinfer.gdn_decode")
    # its kernels import behind try/except: a missing CuTe-DSL install shows here, not at the first call
    unavailable = [flag for flag in ("_PRETRANSPOSE_AVAILABLE", "_NONTRANSPOSE_AVAILABLE", "_MTP_AVAILABLE")
                   if not getattr(gdn, flag, True)]
    if unavailable:
        raise _missing(f"flashinfer.gdn_decode imported but its CuTe-DSL kernels did not ({', '.join(unavailable)}"
                       f" false: nvidia-cutlass-dsl missing or broken)")
    return FlashInfer(decode_pretranspose=gdn.gated_delta_rule_decode_pretranspose,
                      decode_kmajor=gdn.gated_delta_rule_decode, mtp=gdn.gated_delta_rule_mtp,
                      version=str(getattr(fi, "__version__", "?")), source=source)


# ----------------------------------------------------------------------------- conventions (plain torch)
def to_pool(state: torch.Tensor, slots: torch.Tensor, pool_size: int, *, dtype: torch.dtype = torch.float32,
            v_major: bool = True) -> torch.Tensor:
    """A state pool holding request b's state ``state[b]`` ([B, HV, K, V], ours) in slot ``slots[b]``:
    [pool_size, HV, V, K] (FlashInfer's "pretransposed" V-major layout, K contiguous) or, with
    ``v_major=False``, [pool_size, HV, K, V].  Slots not named are zero."""
    B, HV, K, V = state.shape
    shape = (pool_size, HV, V, K) if v_major else (pool_size, HV, K, V)
    pool = torch.zeros(shape, device=state.device, dtype=dtype)
    src = state.transpose(-1, -2) if v_major else state
    pool[slots.long()] = src.to(dtype)
    return pool


def from_pool(pool: torch.Tensor, slots: torch.Tensor, *, v_major: bool = True,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The states of the requests in ``slots`` in our layout [B, HV, K, V] (``dtype``), read from a pool
    in FlashInfer's layout (``to_pool``'s inverse on those slots)."""
    x = pool[slots.long()]
    return (x.transpose(-1, -2) if v_major else x).to(dtype)


def raw_gates(g: torch.Tensor, beta: torch.Tensor, seed: int, *, dtype: torch.dtype = torch.bfloat16):
    """FlashInfer's gate inputs for our log-gates ``g`` and betas ``beta`` [.., HV]: ``A_log``,
    ``dt_bias`` [HV] in float32 and ``a``, ``b`` [.., HV] in ``dtype`` (default bfloat16, what its
    wrappers hand the kernels), with -exp(A_log) softplus(a + dt_bias) = g and sigmoid(b) = beta before
    ``a``, ``b`` are rounded to ``dtype`` (the oracle reads the rounded values: ``oracle_inputs``)."""
    A_log, dt_bias, a, b = to_raw_gates(g.float(), beta.float(), random.Random(seed))
    return A_log.contiguous(), dt_bias.contiguous(), a.to(dtype).contiguous(), b.to(dtype).contiguous()


def pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rows [B * T, 2 H K + HV V] (q | k | v, heads flattened) of tokens [B, T, ...]: the form
    ``kvbuffer_ref.engine_inputs`` reads."""
    B, T, H, K = q.shape
    n = B * T
    return torch.cat([q.reshape(n, H * K), k.reshape(n, H * K), v.reshape(n, -1)], -1)


def oracle_inputs(q, k, v, a, b, A_log, dt_bias) -> dict:
    """The float64 q, k, v, g, beta [B, T, ...] that FlashInfer's kernel computes with from the tokens and
    raw gates it is handed: q and k L2-normalised (eps 1e-6), g = -exp(A_log) softplus(a + dt_bias)
    (threshold 20), beta = sigmoid(b), from the values as passed (``a``, ``b`` as rounded);
    ``kvbuffer_ref.engine_inputs`` in float64."""
    import kvbuffer_ref as ref

    B, T, H, K = q.shape
    HV = v.shape[2]
    qq, kk, vv, g, beta = ref.engine_inputs(pack(q, k, v).double(), a.reshape(B * T, HV).double(),
                                            b.reshape(B * T, HV).double(), A_log=A_log.double(),
                                            dt_bias=dt_bias.double(), num_heads=H, head_k_dim=K)
    shape = lambda t: t.reshape(B, T, *t.shape[2:])  # noqa: E731 - engine_inputs reads rows as B*T, T = 1
    return dict(q=shape(qq), k=shape(kk), v=shape(vv), g=shape(g), beta=shape(beta))


def accept_into_pool(pool: torch.Tensor, intermediate: torch.Tensor, slots: torch.Tensor, m: int) -> None:
    """An engine's accept after FlashInfer's MTP verify: the state after the m-th token
    (``intermediate`` [B, T, HV, V, K], per batch row) copied into each request's slot of ``pool``
    [slots, HV, V, K] (one ``index_copy_``).  ``slots`` is int64 (converted once at setup)."""
    pool.index_copy_(0, slots, intermediate[:, m - 1])


# ----------------------------------------------------------------------------- the calls
def decode_kwargs(fi_fn_kind: str, *, q, k, v, A_log, dt_bias, a, b, pool, slots, out, scale: float) -> dict:
    """The keywords of one FlashInfer decode call, built once at setup.  ``fi_fn_kind``: ``"pretranspose"``
    (``pool`` [slots, HV, V, K] by int32 ``slots``) or ``"kmajor"`` (``pool`` is the dense [B, HV, K, V]
    state, ``slots`` unused).  FlashInfer's own backend is asked for (``backend="flashinfer"``): its
    "auto" may route a manifest row to the source-compiled Cake GDN backend, which needs nvcc."""
    kw = dict(q=q, k=k, v=v, A_log=A_log, a=a, dt_bias=dt_bias, b=b, scale=scale, output=out, use_qk_l2norm=True,
              backend="flashinfer")
    if fi_fn_kind == "pretranspose":
        kw.update(state=None, initial_state=pool, initial_state_indices=slots)
    elif fi_fn_kind == "kmajor":
        kw.update(state=pool)
    else:
        raise ValueError(f"decode kind: 'pretranspose' or 'kmajor', got {fi_fn_kind!r}")
    return kw


def mtp_kwargs(*, q, k, v, A_log, dt_bias, a, b, pool, slots, out, intermediate, scale: float) -> dict:
    """The keywords of one ``gated_delta_rule_mtp`` verify call, built once at setup: the pool frozen
    (``disable_state_update=True``), every token's state into ``intermediate`` [B, T, HV, V, K]."""
    return dict(q=q, k=k, v=v, initial_state=pool, initial_state_indices=slots, A_log=A_log, a=a, dt_bias=dt_bias,
                b=b, scale=scale, output=out, intermediate_states_buffer=intermediate, disable_state_update=True,
                use_qk_l2norm=True)
