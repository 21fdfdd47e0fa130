"""FlashInfer's gated-delta-rule (GDN) kernels as benchmark peers and validator implementations, called
through FlashInfer's public API.

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

The validator's implementations (``kvbuffer validate --impl NAME --peer-path DIR``; FlashInfer from
``locate``: the prefix ``DIR``, else an installed flashinfer), engine adapters (``engine.engine_adapter``)
with raw gates ``a``, ``b`` in bfloat16 (``raw_gate_dtype``: the cases' gates are those of the rounded raw
gates), q/k L2-normalised in the kernel, bfloat16 q, k, v, int32 slots with -1 pads, K and V zero-padded
to a multiple of ``TILE`` (exact):

``flashinfer``       ``gated_delta_rule_decode_pretranspose``, float32 pool: ``recurrent_decode``; "ieee"
``flashinfer-bf16``  the same with a bfloat16 pool (K = V = 128; a case with K or V above 128 is declined,
                     ``declines``), slot 0 its null slot for -1: ``recurrent_decode``; "bf16-state"
``flashinfer-mtp``   ``gated_delta_rule_mtp`` (pool frozen, every token's state into
                     ``intermediate_states_buffer``) then the engine's accept: ``recurrent`` (all T tokens
                     accepted) and ``recurrent_varlen`` (sequence b's n_b tokens accepted from a row of
                     rejected drafts after them); "ieee"

Tested on the CPU through a fake flashinfer package (``tests/validate/test_flashinfer_peers.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
import random
import site
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..validate.adapters import AdapterError, ContractViolation, describe, unavailable
from .engine import engine_adapter, to_raw_gates
from ._sources import PEER_ENV

__all__ = ["VERSION", "PACKAGE", "FlashInfer", "load", "to_pool", "from_pool", "raw_gates", "pack",
           "oracle_inputs", "accept_into_pool", "FUNCTIONS", "locate", "flashinfer", "flashinfer_bf16",
           "flashinfer_mtp", "decode_step", "mtp_step", "CONVENTIONS", "TILE"]

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


def _missing(why: str, option: str = "--flashinfer-path") -> AdapterError:
    return AdapterError(
        f"FlashInfer ({PACKAGE} {VERSION}) is not importable: {why}. Its GDN kernels need {PACKAGE}=={VERSION} "
        f"with nvidia-cutlass-dsl (the cu13 libs), apache-tvm-ffi and cuda-python: build the prefix with "
        f"'bash scripts/flashinfer_wheels.sh' and pass it with {option}, or pip install {PACKAGE}=={VERSION}")


def load(path: Optional[str] = None, *, option: str = "--flashinfer-path") -> FlashInfer:
    """FlashInfer's GDN functions: from the prefix ``path`` (a folder of installed packages, added with
    ``site.addsitedir``) or, without one, an installed ``flashinfer``.  Raises ``AdapterError`` naming the
    package and version when it cannot be imported (``option``: the command-line option its message names)."""
    _missing_here = functools.partial(_missing, option=option)
    source = "installed"
    if path:
        p = Path(path).expanduser().resolve()
        if not (p / "flashinfer").is_dir():
            raise _missing_here(f"{p} holds no flashinfer package (expected {p}/flashinfer/)")
        if str(p) not in sys.path:
            site.addsitedir(str(p))  # its .pth files (nvidia_cutlass_dsl's dsl_packages) included
        source = str(p)
    try:
        fi = importlib.import_module("flashinfer")
        gdn = importlib.import_module("flashinfer.gdn_decode")
    except Exception as e:  # noqa: BLE001 - any import failure is a skip with its reason
        raise _missing_here(f"{type(e).__name__}: {e}") from None
    missing = [f for f in FUNCTIONS if not hasattr(gdn, f)]
    if missing:
        raise _missing_here(f"flashinfer {getattr(fi, '__version__', '?')} has no {missing} in flashinfer.gdn_decode")
    # its kernels import behind try/except: a missing CuTe-DSL install shows here, not at the first call
    off = [flag for flag in ("_PRETRANSPOSE_AVAILABLE", "_NONTRANSPOSE_AVAILABLE", "_MTP_AVAILABLE")
           if not getattr(gdn, flag, True)]
    if off:
        raise _missing_here(f"flashinfer.gdn_decode imported but its CuTe-DSL kernels did not ({', '.join(off)}"
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


# ----------------------------------------------------------------------------- the validator's implementations
#: K and V are zero-padded to a multiple of this for the kernels (its float32 kernels take K, V >= 128, V a
#: multiple of its V tile; its bfloat16-state kernel K = V = 128 exactly).  The padding is exact: q and k
#: rows keep their norm, a zero key or value column of the state stays zero, the output's padded columns
#: are dropped.
TILE = 128


def locate() -> FlashInfer:
    """FlashInfer for ``kvbuffer validate``: from ``--peer-path DIR`` (``$KVBUFFER_PEER_PATH``: a prefix that
    ``scripts/flashinfer_wheels.sh`` prepares, ``.whl-fi/site``) when given, that place only; else an installed
    ``flashinfer``.  AdapterError naming what was looked for."""
    given = os.environ.get(PEER_ENV)
    if given:
        return load(given, option="--peer-path")
    try:
        return load(option="--peer-path")
    except AdapterError as e:
        raise AdapterError(f"no --peer-path given ($KVBUFFER_PEER_PATH unset) and no installed flashinfer: {e}") \
            from None


def _padded(n: int) -> int:
    return max(TILE, -(-int(n) // TILE) * TILE)


def _pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with its last dimension zero-padded to ``n`` (a new contiguous tensor)."""
    return torch.nn.functional.pad(x, (0, n - x.shape[-1])).contiguous()


def _pad_pool(state: torch.Tensor, Vp: int, Kp: int) -> torch.Tensor:
    """The pool [slots, HV, V, K] zero-padded to [slots, HV, Vp, Kp] (a new contiguous tensor)."""
    pool = state.new_zeros(*state.shape[:2], Vp, Kp)
    pool[..., :state.shape[2], :state.shape[3]] = state
    return pool


def _unpad_pool(pool: torch.Tensor, state: torch.Tensor, what: str) -> None:
    """Every slot of ``pool`` (padded) back into ``state`` [slots, HV, V, K] in place (a write into a slot no
    request owns then shows to the engine adapter's check); [pool-slots] when the kernel left anything but
    zeros in the padding."""
    V, K = state.shape[2], state.shape[3]
    pad = pool.clone()
    pad[..., :V, :K] = 0
    if not torch.equal(torch.nan_to_num(pad.float(), nan=1.0), torch.zeros_like(pad, dtype=torch.float32)):
        slots = sorted({int(i) for i in (pad.float().nan_to_num(nan=1.0) != 0).flatten(1).any(1).nonzero().flatten()})
        raise ContractViolation("pool-slots", f"{what}: the zero padding of state pool slots {slots} (K {K} -> "
                                f"{pool.shape[3]}, V {V} -> {pool.shape[2]}) is no longer zero")
    state.copy_(pool[..., :V, :K])


def decode_step(fi: FlashInfer):
    """``gated_delta_rule_decode_pretranspose`` as an engine calls it per decode step: q, k [N, H, K], v
    [N, HV, V], a, b [N, HV] (bfloat16) given one token each ([N, 1, ..]), the pool [slots, HV, V, K] (float32:
    its legacy kernel; bfloat16: its BF16-state kernel) updated in place by ``initial_state_indices``
    (``slots``, int32, -1 for a pad), ``output`` [N, 1, HV, V] bfloat16 allocated here, q/k L2-normalised in
    the kernel, ``backend="flashinfer"``.  K and V zero-padded to ``TILE`` multiples around the call."""
    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, scale):
        N, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        Kp, Vp = _padded(K), _padded(V)
        pool = _pad_pool(state, Vp, Kp)
        out = torch.empty(N, 1, HV, Vp, dtype=torch.bfloat16, device=q.device)
        kw = decode_kwargs("pretranspose", q=_pad_last(q, Kp).unsqueeze(1), k=_pad_last(k, Kp).unsqueeze(1),
                           v=_pad_last(v, Vp).unsqueeze(1), A_log=A_log, dt_bias=dt_bias,
                           a=a.unsqueeze(1).contiguous(), b=b.unsqueeze(1).contiguous(), pool=pool, slots=slots,
                           out=out, scale=scale)
        o, _ = fi.decode_pretranspose(**kw)
        _unpad_pool(pool, state, "gated_delta_rule_decode_pretranspose")
        return o[..., :V]
    return step


def mtp_step(fi: FlashInfer, accepted: dict):
    """``gated_delta_rule_mtp`` as an engine's speculative verify calls it, then the engine's accept: q, k
    [N, T, H, K], v [N, T, HV, V], a, b [N, T, HV] (bfloat16), the float32 pool [slots, HV, V, K] read by
    ``initial_state_indices`` (``slots``, int32, -1 for a pad) and kept frozen (``disable_state_update=True``:
    [pool-slots] if any slot changes), every token's state into ``intermediate_states_buffer`` [N, T, HV, V, K]
    float32.  The accept (``accept_into_pool``'s copy): request row i's state after its ``accepted["m"][i]``-th
    token (all T without a list) into its slot; 0 keeps the slot.  A request without an initial state gets its
    slot zeroed first (an engine clears a fresh request's slot)."""
    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, scale, has_initial_state):
        N, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        Kp, Vp = _padded(K), _padded(V)
        fresh = slots[(~has_initial_state.to(slots.device)) & (slots >= 0)].long()
        state[fresh] = 0
        pool = _pad_pool(state, Vp, Kp)
        before = pool.clone()
        out = torch.empty(N, T, HV, Vp, dtype=torch.bfloat16, device=q.device)
        inter = torch.empty(N, T, HV, Vp, Kp, dtype=torch.float32, device=q.device)
        kw = mtp_kwargs(q=_pad_last(q, Kp), k=_pad_last(k, Kp), v=_pad_last(v, Vp), A_log=A_log, dt_bias=dt_bias,
                        a=a.contiguous(), b=b.contiguous(), pool=pool, slots=slots, out=out, intermediate=inter,
                        scale=scale)
        o, _ = fi.mtp(**kw)
        if not torch.equal(torch.nan_to_num(pool, nan=7.0), torch.nan_to_num(before, nan=7.0)):
            changed = (torch.nan_to_num(pool, nan=7.0) != torch.nan_to_num(before, nan=7.0)).flatten(1).any(1)
            raise ContractViolation("pool-slots", f"gated_delta_rule_mtp with disable_state_update=True changed "
                                    f"state pool slots {changed.nonzero().flatten().tolist()} (slots "
                                    f"{slots.tolist()})")
        live = [i for i, s in enumerate(slots.tolist()) if s >= 0]
        m = accepted.get("m") or [T] * len(live)
        if len(m) != len(live):
            raise AdapterError(f"flashinfer-mtp: {len(m)} accepted counts for {len(live)} requests")
        for i, n in zip(live, m):
            if n:
                pool[int(slots[i])] = inter[i, n - 1]
        _unpad_pool(pool, state, "gated_delta_rule_mtp")
        return o[..., :V]
    return step


#: FlashInfer's engine conventions (``engine.Convention`` fields): raw gates a, b handed in bfloat16, q/k
#: L2-normalised in the kernel, a pool [slots, HV, V, K] by int32 indices with -1 pads.  Its float32 kernels
#: skip a -1 row; its bfloat16-state kernel redirects it to slot 0, a null slot it reads and writes.
CONVENTIONS = {
    "decode": dict(tokens="decode", qkv="separate", gating="raw", raw_gate_dtype="bfloat16", qk_l2norm=True,
                   state_layout="VK", pool=True, pad_slot=-1, varlen=False),
    "bf16": dict(tokens="decode", qkv="separate", gating="raw", raw_gate_dtype="bfloat16", qk_l2norm=True,
                 state_layout="VK", state_dtype=torch.bfloat16, pool=True, pad_slot=-1, reserved_slots=(0,),
                 pad_writes=True, varlen=False),
    "mtp": dict(tokens="sequence", qkv="separate", gating="raw", raw_gate_dtype="bfloat16", qk_l2norm=True,
                state_layout="VK", pool=True, pad_slot=-1, varlen=False),
}

_NOT_BUFFERED = {
    "direct_gated_delta_rule": "FlashInfer has no stateless (direct) form",
    "chunk_gated_delta_rule": "FlashInfer's GDN prefill is not mapped (its decode and MTP kernels are)",
    "buffered_decode": "not a FlashInfer kernel (its decode reads and writes the state every step)",
    "flush": "FlashInfer has no buffer", "materialize_state": "FlashInfer has no buffer",
    "verify": "FlashInfer's MTP verify keeps a state per draft: --impl flashinfer-mtp (recurrent, recurrent_varlen)",
    "accept": "FlashInfer's MTP verify keeps a state per draft: --impl flashinfer-mtp (recurrent, recurrent_varlen)",
    "prefill": "FlashInfer has no buffer hand-off",
}


def _declines_bf16(case) -> str:
    """Why FlashInfer's bfloat16-state kernel cannot take ``case`` ("" where it can)."""
    if case.K > TILE or case.V > TILE:
        return (f"K = {case.K}, V = {case.V}: FlashInfer's bfloat16-state kernel takes K = V = 128 only (smaller K "
                f"and V are zero-padded to 128)")
    return ""


#: Set to 1 to hand FlashInfer's float32 kernels K or V above 128 anyway (``_declines_fp32``): reproduces its fault.
LARGE_HEADS_ENV = "KVBUFFER_FLASHINFER_LARGE_HEADS"


def _declines_fp32(case) -> str:
    """Why FlashInfer's float32 kernels are not handed ``case`` ("" where they are): K or V above 128.  FlashInfer
    0.7.4 documents its float32 decode for K, V >= 128 with V a multiple of 8, but on an H100 (CUDA 13, CuTe-DSL
    4.8.1) the first case of ``kvbuffer validate --impl flashinfer --profile ci --seed 11`` with K = 256
    (V = 264, zero-padded to 384) faulted: its compiler reported 10496 bytes of shared memory used against
    10016 allocated, and the launch ended in an illegal memory access, which loses the process's CUDA context
    (docs/peers.md, FlashInfer).  ``$KVBUFFER_FLASHINFER_LARGE_HEADS=1`` hands them over anyway."""
    if (case.K > TILE or case.V > TILE) and os.environ.get(LARGE_HEADS_ENV) != "1":
        return (f"K = {case.K}, V = {case.V}: FlashInfer 0.7.4's float32 GDN kernels faulted (illegal memory access) "
                f"at K = 256, V = 384 on an H100, so K or V above 128 is not handed to them "
                f"(${LARGE_HEADS_ENV}=1 does; docs/peers.md, FlashInfer)")
    return ""


def _engine(kind: str, label: str, step, fi: FlashInfer, contract: str):
    adapter = engine_adapter(step, name=f"flashinfer {fi.version} {label}", contract=contract, **CONVENTIONS[kind])
    adapter.version, adapter.source = fi.version, fi.source
    # its kernels take bfloat16 q, k, v (float16 is converted to bfloat16 inside its wrapper): bfloat16 only
    adapter.dtypes = (torch.bfloat16,)
    adapter.channel_gate = False
    adapter.not_provided = dict(adapter.not_provided, **_NOT_BUFFERED)
    return adapter


def _load(name: str):
    try:
        return locate(), None
    except AdapterError as e:
        return None, unavailable(name, str(e))


def flashinfer():
    """``--impl flashinfer``: ``gated_delta_rule_decode_pretranspose`` with a float32 pool (its legacy
    kernel): ``recurrent_decode`` in the engine convention (``decode_step``)."""
    fi, missing = _load("flashinfer")
    if missing:
        return missing
    adapter = _engine("decode", "decode_pretranspose (float32 pool)", decode_step(fi), fi, "ieee")
    adapter.declines = _declines_fp32
    return describe(adapter)


def flashinfer_bf16():
    """``--impl flashinfer-bf16``: ``gated_delta_rule_decode_pretranspose`` with a bfloat16 pool (its
    BF16-state kernel, K = V = 128; larger K or V declined), judged under "bf16-state"."""
    fi, missing = _load("flashinfer-bf16")
    if missing:
        return missing
    adapter = _engine("bf16", "decode_pretranspose (bfloat16 pool)", decode_step(fi), fi, "bf16-state")
    adapter.declines = _declines_bf16
    return describe(adapter)


def flashinfer_mtp():
    """``--impl flashinfer-mtp``: ``gated_delta_rule_mtp`` (verify, pool frozen, per-token states) then the
    engine's accept: ``recurrent`` (every token accepted) and ``recurrent_varlen`` (request b's first n_b
    tokens accepted, the rest of its row rejected drafts)."""
    fi, missing = _load("flashinfer-mtp")
    if missing:
        return missing
    accepted: dict = {}
    adapter = _engine("mtp", "mtp verify + accept", mtp_step(fi, accepted), fi, "ieee")
    whole = adapter.recurrent_gated_delta_rule

    def recurrent_gated_delta_rule(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   cu_seqlens=None):
        """Without ``cu_seqlens`` (q [B, T, H, K]): one verify of the T tokens per request, all accepted.  With
        it ([N + 1], a batch [1, total, ..]): sequence b is a row of max(n_b) tokens, its own n_b then finite
        rejected drafts, and the accept takes n_b (0: the slot keeps its initial state); the output of its n_b
        tokens.  A verify takes at least 2 tokens (``gated_delta_rule_mtp`` is for T > 1): shorter rows get
        rejected drafts to 2."""
        B, T = q.shape[0], q.shape[1]
        if cu_seqlens is None and T >= 2:
            return whole(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state)
        if cu_seqlens is None:
            seqs = [(b_, 0, T) for b_ in range(B)]  # (row of the input, first token, tokens)
        else:
            offs = [int(x) for x in cu_seqlens.tolist()]
            seqs = [(0, a_, e_ - a_) for a_, e_ in zip(offs, offs[1:])]
        lens = [n for _, _, n in seqs]
        W = max([2, *lens])

        def rows(x, fill):
            out = x.new_full((len(seqs), W, *x.shape[2:]), fill)
            for i, (r, a_, n) in enumerate(seqs):
                out[i, :n] = x[r, a_:a_ + n]
            return out
        xs = dict(q=rows(q, 0.5), k=rows(k, 0.5), v=rows(v, 0.5), g=rows(g, -0.1), beta=rows(beta, 0.5))
        accepted["m"] = lens
        try:
            o, S = whole(xs["q"], xs["k"], xs["v"], g=xs["g"], beta=xs["beta"], scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state)
        finally:
            accepted.clear()
        if cu_seqlens is None:
            return o[:, :T], S
        return torch.cat([o[i, :n] for i, n in enumerate(lens)]).unsqueeze(0) if lens else o[:0], S

    adapter.recurrent_gated_delta_rule = recurrent_gated_delta_rule
    adapter.varlen = ("recurrent_gated_delta_rule",)
    return describe(adapter)
