"""vLLM's own gated-delta-rule Triton kernels (its copy of fla) behind the validator, never copied here.

The kernel files are read from where the user has them: ``--peer-path`` (``$KVBUFFER_PEER_PATH``: a vLLM
checkout, a folder holding the ``vllm`` package such as site-packages or an unpacked wheel, a
``vllm-*.whl`` or a folder holding one), else an installed ``vllm`` (found, not imported).  vLLM keeps
the files under ``vllm/third_party/flash_linear_attention/ops/`` (0.34) or
``vllm/model_executor/layers/fla/ops/`` (earlier releases); both are looked for.  Only the kernel files
run: ``vllm/__init__`` and the rest of vLLM are never imported.  Their imports of the rest of vLLM are
served by shims written to a temporary folder (the ops package itself is vLLM's folder, reached through
the shim package's ``__path__``):

    vllm.triton_utils            triton, tl, tldevice (libdevice): vLLM's own re-exports of Triton
    vllm.platforms               current_platform: is_cuda, is_rocm, is_cuda_alike, get_device_name,
                                 get_device_capability, is_device_capability(_family): the queries the
                                 files make at import and launch, answered from torch.cuda as vLLM does
    vllm.utils.platform_utils    cuda_get_device_properties, num_compute_units (imported by utils.py)
    vllm.utils.gpu_sync_debug    gpu_sync_allowed (index.py, around its host read of the sequence lengths): a
                                 context that changes nothing, vLLM's answer with its GPU-sync check off
                                 (VLLM_GPU_SYNC_CHECK unset, its default)
    vllm.utils.torch_utils       async_tensor_h2d (index.py: the chunk indices to the device): a plain copy
                                 (vLLM stages them in pinned memory, without a host wait: the same values)
    vllm.model_executor.warmup   jit_warmup.WarmupChoices, jit_warmup_triton_helper.DispatchSpec,
                                 TritonWarmupTensor, triton_kernel_dispatcher_with_warmup: the names
                                 l2norm.py (imported by chunk.py) needs to load.  They serve only
                                 l2norm_fwd, the in-kernel q/k L2 norm, which the adapters never request
                                 (use_qk_l2norm_in_kernel=False): its launcher raises NotImplementedError
                                 rather than launch without vLLM's dispatcher; no warm-up runs

Not served: ``vllm.platforms.rocm`` (``on_gfx1x``), which ``chunk_scaled_dot_kkt.py`` imports on ROCm only;
there ``--impl vllm-chunk`` is NOT RUN with the import error.

Under the Triton interpreter fla's module-level aliases of Triton builtins (``exp = tl.exp`` in
``op.py``, which the interpreter does not patch) become jitted calls of the same builtin, as for SGLang.

The kernels and the lanes each serves (vLLM's convention: states [slots, HV, V, K] float32 in a pool
addressed by int32 ``ssm_state_indices``, slot 0 the null block the kernels skip, ``cu_seqlens`` int32 as
vLLM's ``query_start_loc``):

``vllm``         ``fused_recurrent_gated_delta_rule`` (``inplace_final_state=True``) with q, k, v, log gate
                 g and beta as the oracle has them: ``recurrent`` and ``recurrent_varlen`` through vLLM's
                 multi-token layout (2-D indices [N, T]: the initial state read from column 0, the state
                 after token t written to column t, as its speculative path calls it), the final state read
                 from column T_n - 1; ``recurrent_decode`` through its decode layout (1-D indices, T = 1)
``vllm-decode``  ``fused_sigmoid_gating_delta_rule_update``: the decode step of vLLM's Qwen3-Next / Qwen3.5
                 GDN layer (``qwen_gdn_linear_attn.py``), in that convention (``engine.engine_adapter``)
``vllm-packed``  ``fused_recurrent_gated_delta_rule_packed_decode``: the packed decode the same layer takes
                 (``mixed_qkv`` [N, 2 H K + HV V], ``out`` [N, 1, HV, V])
``vllm-chunk``   ``chunk_gated_delta_rule`` (``chunk.py``, the prefill of the same layers): ``chunk`` and
                 ``chunk_varlen``, called as fla's chunk is (``VLLMChunk``); float16 and bfloat16 only (it
                 asserts q is not float32); K <= 256 (``chunk_delta_h.py`` asserts it: larger K is declined)
``vllm-inputs``  ``fused_post_conv_prep`` (``fused_gdn_prefill_post_conv.py``, 0.34): the one kernel with
                 which the same layer's prefill (``_forward_core``, ``num_prefills > 0``) turns the convolved
                 ``mixed_qkv`` [L, 2 H K + HV V] and ``a``, ``b`` [L, HV] into q, k (L2-normalised), v, g and
                 beta: the ``engine_inputs`` lane (``VLLMInputs``)

Contracts: the recurrent kernels are elementwise float32 (``tl.sum`` of products, no ``tl.dot``): "ieee".
The chunk kernel multiplies 16-bit operands in ``tl.dot`` (q, k, v and its WY factors in the inputs' dtype,
its per-chunk states cast to it) with float32 accumulation: "fp16" for float16 inputs, "bf16" for bfloat16,
as SGLang's copy of the same kernel.  Under
the Triton interpreter the chunk kernels run with each autotuner on its first config and tensor loop indices
(``_sources.interpretable_chunk_kernels``).  Not mapped: the KDA kernels and the speculative decode's post-conv kernel
(``fused_gdn_decode_post_conv_mtp``).
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path
from typing import Optional

import torch

from kvbuffer_ref.engine_inputs import check_engine_inputs

from ..validate.adapters import AdapterError, describe, interpreter_active, unavailable
from ._sources import (dtypes, extract, find, git_version, interpretable_chunk_kernels, interpreter_fixes, shims_first,
                       version_in, write_shims)
from .engine import InputsAdapter, engine_adapter, next_pow2, token_rows

__all__ = ["locate", "load_kernels", "VLLMRecurrent", "VLLMInputs", "vllm", "vllm_decode", "vllm_packed",
           "vllm_inputs", "vllm_chunk", "VLLMChunk", "decode_step", "packed_step", "OPS_DIRS"]

#: Where vLLM keeps its fla copy, newest layout first.
OPS_DIRS = (Path("vllm/third_party/flash_linear_attention/ops"), Path("vllm/model_executor/layers/fla/ops"))
_NEEDED = ("fused_recurrent.py", "fused_sigmoid_gating.py", "op.py", "utils.py")
#: The module of ``fused_post_conv_prep`` (split, L2 norm and gating of the Qwen GDN layer's prefill).
_POST_CONV = "fused_gdn_prefill_post_conv"

_SHIM_TRITON = '''"""Shim of vllm.triton_utils (kvbuffer validate): vLLM's re-exports of Triton."""
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice
'''
_SHIM_PLATFORMS = '''"""Shim of vllm.platforms (kvbuffer validate): the queries vLLM's fla files make, from torch.cuda."""
from collections import namedtuple

import torch

_Capability = namedtuple("DeviceCapability", "major minor")


class _Platform:
    def is_cuda(self):
        return torch.cuda.is_available() and torch.version.cuda is not None

    def is_rocm(self):
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_cuda_alike(self):
        return torch.cuda.is_available()

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"

    def get_device_capability(self, device_id=0):
        if not torch.cuda.is_available():
            return _Capability(0, 0)
        return _Capability(*torch.cuda.get_device_capability(device_id))

    def is_device_capability(self, capability, device_id=0):
        c = self.get_device_capability(device_id or 0)
        return c.major * 10 + c.minor == int(capability)

    def is_device_capability_family(self, capability, device_id=0):
        c = self.get_device_capability(device_id or 0)
        return c.major == int(capability) // 10

    def num_compute_units(self, device_id=0):
        return torch.cuda.get_device_properties(device_id).multi_processor_count


current_platform = _Platform()
'''
_SHIM_PLATFORM_UTILS = '''"""Shim of vllm.utils.platform_utils (kvbuffer validate)."""
import torch


def cuda_get_device_properties(device, names, init_cuda=False):
    props = torch.cuda.get_device_properties(device)
    return tuple(getattr(props, n) for n in names)


def num_compute_units(device_id=0):
    return torch.cuda.get_device_properties(device_id).multi_processor_count
'''
_SHIM_GPU_SYNC = '''"""Shim of vllm.utils.gpu_sync_debug (kvbuffer validate): vLLM's answer with its GPU-sync check off
(VLLM_GPU_SYNC_CHECK unset, its default), a context that changes nothing."""
import contextlib


def gpu_sync_allowed(*args, **kwargs):
    return contextlib.nullcontext()
'''
_SHIM_TORCH_UTILS = '''"""Shim of vllm.utils.torch_utils (kvbuffer validate): async_tensor_h2d, the host-to-device
copy of index.py's chunk indices (vLLM stages it in pinned memory and copies without a host wait: the same
values)."""
import torch


def async_tensor_h2d(data, device, dtype=None):
    return torch.as_tensor(data, dtype=dtype).to(device=device, dtype=dtype)
'''
_SHIM_WARMUP = '''"""Shim of vllm.model_executor.warmup.jit_warmup (kvbuffer validate): WarmupChoices, the choice
set l2norm.py names in its warm-up inputs; vLLM's warm-up never runs here, so nothing reads it."""


class WarmupChoices:
    def __init__(self, *choices):
        self.choices = choices
'''
_SHIM_WARMUP_TRITON = '''"""Shim of vllm.model_executor.warmup.jit_warmup_triton_helper (kvbuffer validate): the
names l2norm.py imports.  Its only use of them is l2norm_fwd_block, the launch of the in-kernel q/k L2 norm
(use_qk_l2norm_in_kernel=True), which kvbuffer's adapters never request: the decorated launcher raises
rather than launch without vLLM's dispatcher."""
from typing import Any

DispatchSpec = Any


class TritonWarmupTensor:
    def __init__(self, dtype, aligned=True, shape=(1,), strides=None, init=0):
        self.dtype, self.aligned, self.shape, self.strides, self.init = dtype, aligned, shape, strides, init


def triton_kernel_dispatcher_with_warmup(*, warmup_inputs, kernel=None):
    def decorate(dispatch):
        def launch(*args, **kwargs):
            raise NotImplementedError(
                f"{dispatch.__qualname__}: vLLM's Triton dispatcher is not loaded by kvbuffer validate (only its fla "
                "kernel files are); the adapters call the kernels with use_qk_l2norm_in_kernel=False")
        launch.__name__ = launch.__qualname__ = dispatch.__qualname__
        return launch
    return decorate
'''


# ----------------------------------------------------------------------------- finding the kernel files
def _version_of(root: Path) -> str:
    """'0.34.0 (commit 62d4bc3c7)' from vllm/_version.py, else the checkout's git HEAD, else '?'."""
    f = root / "vllm" / "_version.py"
    if f.is_file():
        text = f.read_text()
        v = version_in(text)
        c = version_in(text, "__commit_id__", "commit_id", form="[0-9a-f]+", prefix="g?")
        if v:
            return v + (f" (commit {c})" if c else "")
    return git_version(root) or "?"


def _from_wheel(whl: Path) -> Path:
    """The wheel's fla kernel folder and _version.py extracted to a temporary folder (a tree root)."""
    pats = [re.escape(d.as_posix()) + r"/[^/]+\.py" for d in OPS_DIRS] + [r"vllm/_version\.py"]
    return extract(whl, pats, "kvbuffer-vllm-wheel-")


def _ops_of(root: Path) -> Optional[Path]:
    for d in OPS_DIRS:
        if all((root / d / f).is_file() for f in _NEEDED):
            return root / d
    return None


def _tree(path: Path) -> Optional[tuple]:
    """(ops folder, version) of a checkout / a folder holding the vllm package / a wheel / a folder with one."""
    if path.is_file() and path.suffix == ".whl":
        root = _from_wheel(path)
        ops = _ops_of(root)
        return (ops, _version_of(root)) if ops else None
    if not path.is_dir():
        return None
    ops = _ops_of(path)
    if ops:
        return ops, _version_of(path)
    wheels = sorted(path.glob("vllm-*.whl"))
    return _tree(wheels[-1]) if wheels else None


def locate(path=None) -> tuple:
    """(ops folder, version, where from) of vLLM's fla kernels: ``path`` when given (that place only), else
    ``$KVBUFFER_PEER_PATH``, else an installed ``vllm``.  AdapterError saying what was looked at."""
    where = [d.as_posix() for d in OPS_DIRS]
    hint = ("Get them without vLLM's dependencies: git clone https://github.com/vllm-project/vllm (then "
            "--peer-path vllm), or python3 -m pip download --no-deps vllm -d DIR (then --peer-path DIR)")

    def in_package(pkg: Path) -> Optional[tuple]:
        ops = _ops_of(pkg.parent)
        return (ops, _version_of(pkg.parent)) if ops else None

    return find(path, _tree, "vllm", in_package,
                not_at=lambda p: (f"vLLM's kernels not found: {p} holds none of {', '.join(where)} with "
                                  f"{', '.join(_NEEDED)}. {hint}"),
                not_in_env=lambda given: f"--peer-path {given} holds no vLLM fla kernels ({' or '.join(where)})",
                not_in_package=lambda pkg: f"the installed vllm ({pkg}) has none of {', '.join(where)}",
                not_found=lambda looked: f"vLLM's kernels not found: {looked}. {hint}")


# ----------------------------------------------------------------------------- loading them
def _shims(ops: Path) -> tuple:
    """A temporary folder with a minimal ``vllm`` package whose fla ops package is vLLM's own folder; and
    the dotted name of that ops package."""
    rel = next(d for d in OPS_DIRS if ops.as_posix().endswith(d.as_posix()))
    files = {"vllm/__init__.py": '"""Shim of vllm (kvbuffer validate): only its fla kernel files load."""\n',
             "vllm/triton_utils/__init__.py": _SHIM_TRITON, "vllm/platforms/__init__.py": _SHIM_PLATFORMS,
             "vllm/utils/__init__.py": "", "vllm/utils/platform_utils.py": _SHIM_PLATFORM_UTILS,
             "vllm/utils/gpu_sync_debug.py": _SHIM_GPU_SYNC, "vllm/utils/torch_utils.py": _SHIM_TORCH_UTILS,
             "vllm/model_executor/__init__.py": "", "vllm/model_executor/warmup/__init__.py": "",
             "vllm/model_executor/warmup/jit_warmup.py": _SHIM_WARMUP,
             "vllm/model_executor/warmup/jit_warmup_triton_helper.py": _SHIM_WARMUP_TRITON}
    parts = rel.parts
    for i in range(2, len(parts)):
        files.setdefault("/".join(parts[:i]) + "/__init__.py", "")
    files[rel.as_posix() + "/__init__.py"] = f"__path__ = [{str(ops)!r}]\n"
    return write_shims("kvbuffer-vllm-shims-", files), ".".join(parts)


def load_kernels(path=None, chunk: bool = False) -> types.SimpleNamespace:
    """vLLM's fla kernel modules (``locate(path)``), imported with the shims first on sys.path, the
    process's own ``vllm`` modules (if any) set aside meanwhile and restored after.  ``chunk``: also
    ``chunk.py`` (``chunk_gated_delta_rule``, None where the folder has no chunk.py)."""
    ops, version, source = locate(path)
    shims, pkg = _shims(ops)
    with shims_first(shims, "vllm"):
        try:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fr = importlib.import_module(f"{pkg}.fused_recurrent")
                fs = importlib.import_module(f"{pkg}.fused_sigmoid_gating")
                # the Qwen GDN layer's prefill preprocessing (0.34; earlier releases have no such file)
                pc = importlib.import_module(f"{pkg}.{_POST_CONV}") if (ops / f"{_POST_CONV}.py").is_file() else None
                ch = importlib.import_module(f"{pkg}.chunk") if chunk and (ops / "chunk.py").is_file() else None
            if interpreter_active():
                mods = {n: m for n, m in sys.modules.items() if n.startswith(pkg + ".")}
                interpreter_fixes(mods)
                if ch is not None:
                    interpretable_chunk_kernels(mods)
        except Exception as e:
            raise AdapterError(f"vLLM's kernels from {source} ({ops}): importing them failed: {type(e).__name__}: "
                               f"{e}") from None
    return types.SimpleNamespace(
        version=version, source=source, ops=ops,
        fused_recurrent_gated_delta_rule=fr.fused_recurrent_gated_delta_rule,
        fused_recurrent_gated_delta_rule_packed_decode=getattr(fr, "fused_recurrent_gated_delta_rule_packed_decode",
                                                               None),
        fused_sigmoid_gating_delta_rule_update=fs.fused_sigmoid_gating_delta_rule_update,
        fused_post_conv_prep=None if pc is None else pc.fused_post_conv_prep,
        chunk_gated_delta_rule=None if ch is None else ch.chunk_gated_delta_rule)


_NOT_BUFFERED = {
    "direct_gated_delta_rule": "vLLM has no stateless (direct) form",
    "buffered_decode": "not a vLLM kernel (its decode reads and writes the state every step)",
    "flush": "vLLM has no buffer", "materialize_state": "vLLM has no buffer",
    "verify": "vLLM's speculative decode keeps a state per draft (not mapped here)",
    "accept": "vLLM's speculative decode keeps a state per draft (not mapped here)",
    "prefill": "vLLM has no buffer hand-off",
}


# ----------------------------------------------------------------------------- vllm: the oracle's convention
class VLLMRecurrent:
    """``fused_recurrent_gated_delta_rule`` of vLLM's fla copy in the oracle's signature (module docstring).

    The state pool is float32 [1 + slots, HV, V, K], NaN wherever no state is placed (slot 0, the null
    block, is never addressed); the slots are a shuffled range starting at 1.  q/k normalisation in the
    kernel off (the caller normalises), scalar gates only (the kernel is launched with IS_KDA=False)."""

    contract = "ieee"
    channel_gate = False
    forms = ("u",)
    varlen = ("recurrent_gated_delta_rule",)

    def __init__(self, kernels):
        self._k = kernels
        self.version = kernels.version
        self.name = f"vllm {kernels.version}"
        self.interpreted = interpreter_active()
        self.dtypes = dtypes(torch.float32, torch.float16)
        self.not_provided = dict(_NOT_BUFFERED, chunk_gated_delta_rule="vLLM's chunk kernel takes 16-bit inputs "
                                 "only: --impl vllm-chunk")
        self._gen = torch.Generator().manual_seed(0)

    def _slots(self, n: int, device) -> torch.Tensor:
        return (torch.randperm(n, generator=self._gen) + 1).to(device=device, dtype=torch.int32)

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   cu_seqlens=None):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        if cu_seqlens is None:
            lengths = [T] * B
        else:
            lengths = [int(b - a) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
        N, width = len(lengths), max(1, max(lengths, default=1))
        idx = self._slots(N * width, q.device).view(N, width)
        pool = torch.full((N * width + 1, HV, V, K), float("nan"), dtype=torch.float32, device=q.device)
        first = idx[:, 0].long()
        pool[first] = 0.0 if initial_state is None else initial_state.to(torch.float32).transpose(-1, -2)
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(torch.int32).contiguous()}
        o, _ = self._k.fused_recurrent_gated_delta_rule(
            q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), beta=beta.contiguous(), scale=scale,
            initial_state=pool, inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=False, **kw)
        if not output_final_state:
            return o, None
        last = idx[torch.arange(N, device=q.device), torch.tensor([max(n - 1, 0) for n in lengths],
                                                                   device=q.device)].long()
        return o, pool[last].transpose(-1, -2)

    def recurrent_decode(self, q, k, v, *, g, beta, state, scale=None):
        """One decode step as vLLM's GDN layer takes it: 1-D slot indices, one token per sequence (flattened,
        ``cu_seqlens`` = 0..N), the pool updated in place; the new state copied back into ``state``."""
        B, HV, K, V = state.shape
        idx = self._slots(B, q.device)
        pool = torch.full((B + 1, HV, V, K), float("nan"), dtype=torch.float32, device=q.device)
        pool[idx.long()] = state.to(torch.float32).transpose(-1, -2)
        flat = [t.reshape(1, B, *t.shape[2:]).contiguous() for t in (q, k, v, g, beta)]
        cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        o, _ = self._k.fused_recurrent_gated_delta_rule(
            flat[0], flat[1], flat[2], g=flat[3], beta=flat[4], scale=scale, initial_state=pool,
            inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=idx, use_qk_l2norm_in_kernel=False)
        state.copy_(pool[idx.long()].transpose(-1, -2))
        return o.reshape(v.shape)


# ----------------------------------------------------------------------------- vllm-chunk: the prefill
class VLLMChunk:
    """``chunk_gated_delta_rule`` of vLLM's fla copy (``chunk.py``: the prefill of its GDN layers) in the oracle's
    signature, called as fla's chunk is called (``FlaAdapter``)::

        o, S = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=S0 [N, HV, V, K],
                                      output_final_state=..., cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=False)

    q, k, v float16 / bfloat16 (the kernel asserts q is not float32); g and beta in float32, as the Qwen GDN
    layer hands them over (``fused_post_conv_prep`` returns them so; from 16-bit inputs the conversion is exact);
    the initial state float32 [N, HV, V, K] (vLLM's layout: the oracle's [K, V] transposed here, exact) or none,
    the final state read back the same way; ``cu_seqlens`` int32 (the layer's ``query_start_loc``); q/k
    normalisation in the kernel off (the caller normalises); grouped value heads native (its ``Hg``); its own
    chunk size 64 (``FLA_CHUNK_SIZE``: the requested size is a property of our reference form); scalar gates
    only.  ``chunk_indices``, ``chunk_offsets`` and ``core_attn_out`` are left to the kernel, which derives
    the first two from ``cu_seqlens`` and allocates the output."""

    contract = {"float16": "fp16", "bfloat16": "bf16"}  # tl.dot of operands in the input dtype
    channel_gate = False
    forms = ("u",)
    varlen = ("chunk_gated_delta_rule",)

    def __init__(self, kernels):
        self._k = kernels
        self.version = kernels.version
        self.name = f"vllm {kernels.version} chunk"
        self.interpreted = interpreter_active()
        self.dtypes = dtypes(torch.float16)
        self.not_provided = dict(_NOT_BUFFERED, recurrent_gated_delta_rule="the chunk kernel only: --impl vllm",
                                 recurrent_decode="the chunk kernel only: --impl vllm, vllm-decode, vllm-packed")

    @staticmethod
    def declines(case, op: str = "") -> str:
        """The kernel takes key heads of K <= 256 only (``chunk_delta_h.py`` asserts so: the state is kept in at
        most four blocks of 64 keys)."""
        if case.K > 256:
            return (f"K = {case.K}: vLLM's chunk_gated_delta_rule takes key heads of K <= 256 only "
                    f"(chunk_delta_h.py asserts K <= 256)")
        return ""

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                               chunk_size=64, cu_seqlens=None):
        h0 = None if initial_state is None else initial_state.to(torch.float32).transpose(-1, -2).contiguous()
        # a fresh tensor per call: index.py caches the chunk indices by the identity of cu_seqlens (tensor_cache)
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(torch.int32, copy=True).contiguous()}
        o, S = self._k.chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                                              beta.float().contiguous(), scale=scale, initial_state=h0,
                                              output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                                              **kw)
        return o, (None if S is None else S.transpose(-1, -2))


# ----------------------------------------------------------------------------- vllm-inputs: the layer's preprocessing
class VLLMInputs(InputsAdapter):
    """``engine_inputs`` through ``fused_post_conv_prep``, called as the Qwen3-Next / Qwen3.5 GDN layer's
    prefill calls it (``qwen_gdn_linear_attn.py``, ``_forward_core``)::

        q, k, v, g, beta = fused_post_conv_prep(conv_output=mixed_qkv [L, 2 H K + HV V], a=a [L, HV], b=b [L, HV],
                                                A_log=A_log, dt_bias=dt_bias, num_k_heads=H, head_k_dim=K,
                                                head_v_dim=V, apply_l2norm=True, output_g_exp=False)

    One Triton kernel does the split of q | k | v, the L2 norm of q and k (eps 1e-6, in float32), the gating
    g = -exp(A_log) softplus(a + dt_bias) (threshold 20) and beta = sigmoid(b); no piece is plain torch.
    ``output_g_exp`` is the layer's ``gdn_prefill_backend == "flashinfer"``: False on its Triton backend.

    Inputs: mixed_qkv [N, D] (L = N) or [B, T, D] (L = B T) flattened to the layer's token rows
    (``token_rows``); ``A_log`` handed over in float32 (the layer's parameter is float32; the lane's rounded
    values convert exactly), ``dt_bias`` in the lane's dtype (the layer's parameter is in the model's dtype),
    both contiguous as the layer's parameters are (the kernel reads them with unit stride).
    Returns what the kernel returns, reshaped to [B, T, ..]: q, k [B, T, H, K] and v [B, T, HV, V] in
    mixed_qkv's dtype (16-bit q and k for 16-bit inputs: the layer hands them to the chunk kernel so), g and
    beta [B, T, HV] in float32.  The decode steps (``fused_sigmoid_gating_delta_rule_update``, the packed
    decode) gate and normalise inside the recurrent kernel: ``vllm-decode``, ``vllm-packed``.
    """

    def __init__(self, kernels):
        super().__init__(kernels, f"vllm {kernels.version} fused_post_conv_prep",
                         "fused_post_conv_prep is the layer's preprocessing only (engine_inputs): --impl vllm, "
                         "vllm-decode, vllm-packed")

    def engine_inputs(self, mixed_qkv, a, b, *, A_log, dt_bias, num_heads, head_k_dim, qk_l2norm=True):
        B, T, H, HV, K, V = check_engine_inputs(mixed_qkv, a, b, A_log, dt_bias, num_heads, head_k_dim,
                                                check_values=False)
        q, k, v, g, beta = self._k.fused_post_conv_prep(
            conv_output=token_rows(mixed_qkv), a=token_rows(a), b=token_rows(b),
            A_log=A_log.to(torch.float32).contiguous(), dt_bias=dt_bias.contiguous(), num_k_heads=H, head_k_dim=K, head_v_dim=V, apply_l2norm=bool(qk_l2norm),
            output_g_exp=False)
        return tuple(t.reshape(B, T, *t.shape[1:]) for t in (q, k, v, g, beta))

    @staticmethod
    def declines(case) -> str:
        """Compiled, the kernel takes only K and V of one power-of-two block: its ``mask_2d`` is [BLOCK_T, BK] in
        the q/k branch and [BLOCK_T, BV] in the v branch of one ``if``, which Triton compiles only when the two
        agree (the interpreter does not check).  Every model vLLM serves with it has K = V."""
        if interpreter_active() or next_pow2(case.K) == next_pow2(case.V):
            return ""
        return (f"K = {case.K}, V = {case.V}: vLLM's fused_post_conv_prep compiles only when K and V round up to the "
                f"same power of two (its mask_2d takes [BLOCK_T, {next_pow2(case.K)}] and [BLOCK_T, {next_pow2(case.V)}] in "
                f"the two branches of one if; Triton: 'Mismatched type for mask_2d')")


# ----------------------------------------------------------------------------- the engine-convention steps
def decode_step(kernels):
    """``fused_sigmoid_gating_delta_rule_update`` as vLLM's GDN layer calls it per decode step: q, k, v
    [1, N, H|HV, K|V], a, b [1, N, HV], ``cu_seqlens`` (its query_start_loc), the pool updated in place
    (``inplace_final_state=True``) by ``ssm_state_indices``, q/k L2-normalised in the kernel."""
    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, cu_seqlens, scale):
        o, _ = kernels.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, scale=scale, initial_state=state,
            inplace_final_state=True, cu_seqlens=cu_seqlens, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
        return o
    return step


def packed_step(kernels):
    """``fused_recurrent_gated_delta_rule_packed_decode`` as the layer calls it: ``mixed_qkv`` [N, 2 H K +
    HV V], a, b [N, HV], ``out`` [N, 1, HV, V] allocated by the caller, the scale given (K ** -0.5)."""
    def step(*, mixed_qkv, A_log, dt_bias, a, b, state, slots, scale):
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], 1, state.shape[1], state.shape[2])
        kernels.fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
            scale=state.shape[-1] ** -0.5 if scale is None else scale, initial_state=state, out=out,
            ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
        return out
    return step


#: vLLM's engine conventions: slot 0 is the null block (NULL_BLOCK_ID), which the kernels skip.
CONVENTIONS = {
    "decode": dict(tokens="decode", qkv="separate", gating="raw", qk_l2norm=True, state_layout="VK", pool=True,
                   pad_slot=0, reserved_slots=(0,), varlen=True),
    "packed": dict(tokens="decode", qkv="packed", gating="raw", qk_l2norm=True, state_layout="VK", pool=True,
                   pad_slot=0, reserved_slots=(0,), varlen=False),
}


# ----------------------------------------------------------------------------- the factories (--impl names)
def _load(name: str, chunk: bool = False):
    try:
        return load_kernels(chunk=chunk), None
    except AdapterError as e:
        return None, unavailable(name, str(e))


def vllm():
    """``--impl vllm``: vLLM's ``fused_recurrent_gated_delta_rule`` (recurrent, recurrent_decode, recurrent_varlen)."""
    k, missing = _load("vllm")
    return missing or describe(VLLMRecurrent(k))


def _engine(kind: str, label: str, step_of):
    k, missing = _load(f"vllm-{kind}")
    if missing:
        return missing
    if kind == "packed" and k.fused_recurrent_gated_delta_rule_packed_decode is None:
        return unavailable(f"vllm {k.version} packed decode",
                           f"{k.ops}/fused_recurrent.py has no fused_recurrent_gated_delta_rule_packed_decode")
    adapter = engine_adapter(step_of(k), name=f"vllm {k.version} {label}", contract="ieee", **CONVENTIONS[kind])
    adapter.interpreted = interpreter_active()
    adapter.dtypes = dtypes(*adapter.dtypes)
    return describe(adapter)


def vllm_decode():
    """``--impl vllm-decode``: ``fused_sigmoid_gating_delta_rule_update`` in vLLM's decode convention."""
    return _engine("decode", "fused_sigmoid_gating decode", decode_step)


def vllm_packed():
    """``--impl vllm-packed``: ``fused_recurrent_gated_delta_rule_packed_decode`` (packed mixed_qkv)."""
    return _engine("packed", "packed decode", packed_step)


def vllm_inputs():
    """``--impl vllm-inputs``: ``fused_post_conv_prep``, the GDN layer's prefill preprocessing (engine_inputs)."""
    k, missing = _load("vllm-inputs")
    if missing:
        return missing
    if k.fused_post_conv_prep is None:
        return unavailable(f"vllm {k.version} fused_post_conv_prep",
                           f"{k.ops} has no {_POST_CONV}.py (vLLM 0.34's prefill preprocessing; earlier releases "
                           f"split, gate and normalise in other places)")
    return describe(VLLMInputs(k))


def vllm_chunk():
    """``--impl vllm-chunk``: vLLM's ``chunk_gated_delta_rule`` (chunk, chunk_varlen)."""
    k, missing = _load("vllm-chunk", chunk=True)
    if missing:
        return missing
    if k.chunk_gated_delta_rule is None:
        return unavailable(f"vllm {k.version} chunk", f"{k.ops} has no chunk.py")
    return describe(VLLMChunk(k))
