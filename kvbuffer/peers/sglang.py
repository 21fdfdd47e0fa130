"""SGLang's gated-delta-rule Triton kernels behind the validator (never copied into this repository).

The kernel files are loaded from where the user has them: the wheel or tree given with ``--peer-path``
(``$KVBUFFER_PEER_PATH``: a ``sglang-*.whl``, a folder holding one, a folder holding the ``sglang``
package such as site-packages or an unpacked wheel, or an SGLang checkout with ``python/sglang``), else an
installed ``sglang`` package (found, not imported).  Only the kernel files run: ``sglang/__init__`` and the
rest of SGLang are never imported.  Their imports from the rest of SGLang are served by shims written to
a temporary folder, each answering as SGLang answers on the machine it runs on:

    sglang.srt.utils           is_cuda, is_hip, get_device_sm, is_sm90_supported, is_gfx95_supported, ...
    sglang.srt.utils.common    torch_release
    sglang.srt.environ         envs.SGLANG_USE_AITER (read by triton_gdn_fused_proj.py at import; from the
                               environment, default False, as SGLang reads it)
    sglang.kernels.jit.utils   is_arch_support_pdl (CUDA capability >= 9: the kernels launch with PDL there)

Under the Triton interpreter (a CPU, ``TRITON_INTERPRET=1``) more adjustments, none changing what is
computed: fla's module-level aliases of Triton builtins (``exp = tl.exp`` in ``fla/op.py``, which the
interpreter does not patch) become jitted functions calling the same builtin, and ``input_guard``'s device
context (``torch.cpu.device``, absent in torch) becomes a null context (``_sources.interpreter_fixes``); with
the chunk kernel or the prefill preprocessing loaded, their kernels also get tensor loop indices, one
autotune config and block pointers (``tl.make_block_ptr``, ``tl.advance``, ``boundary_check``: removed from
triton 3.9, used by SGLang's fla copy; ``_block_ptr``), as ``_sources.interpretable_chunk_kernels`` does.

The kernels (SGLang 0.5.23: ``sglang/kernels/ops/attention/{fla,linear}``) and the lanes each serves:

``sglang``          ``fla.fused_recurrent.fused_recurrent_gated_delta_rule``: q, k, v, log gate g and beta as
                    the oracle has them, states [N, HV, V, K] (transposed on the way in and out, exact),
                    ``cu_seqlens`` (int64): recurrent, recurrent_decode (T = 1, the final state copied back),
                    recurrent_varlen
``sglang-decode``   ``linear.fused_sigmoid_gating_recurrent.fused_sigmoid_gating_delta_rule_update``: what
                    SGLang's Triton GDN backend calls per decode step (``TritonGDNKernel.decode``)
``sglang-packed``   ``fla.fused_recurrent.fused_recurrent_gated_delta_rule_packed_decode``: the packed decode
                    the backend takes on CUDA (``TritonGDNKernel.packed_decode``)
``sglang-pool``     ``fla.fused_recurrent.fused_recurrent_gated_delta_rule_update``: whole sequences into a
                    state pool (its Jet-Nemotron layer)
``sglang-chunk``    ``fla.chunk.chunk_gated_delta_rule``: the prefill (``TritonGDNKernel.extend``), float16 and
                    bfloat16 only (it asserts q is not float32), states in a pool by slot, written in place
``sglang-inputs``   the prefill's preprocessing (``GDNAttnBackend.forward_extend``): ``triton_gdn_fused_proj.
                    fused_qkv_split_gdn_prefill`` (the split of the convolved q|k|v), ``linear.fused_gdn_gating``
                    (g, beta) and ``fla.l2norm.l2norm_fwd`` (q and k, called by ``fla.chunk``): the
                    ``engine_inputs`` lane (``SGLangInputs``)

The three pooled kernels are validated in SGLang's convention (``engine.engine_adapter``): raw gating
(``A_log``, ``dt_bias``, ``a``, ``b`` in float32, softplus threshold 20) where the kernel gates itself,
q and k L2-normalised in the kernel (``use_qk_l2norm_in_kernel=True``, as the backend calls them), a
float32 pool [slots, HV, V, K] addressed by int32 slot indices with ``-1`` pads (SGLang's
``PAD_SLOT_ID``: the kernels skip a negative slot) and ``cu_seqlens`` where the kernel takes it.  For whole
sequences without an initial state the adapter zeroes the request's slot first, as SGLang clears a fresh
request's slot before its forward (``mamba_clear_indices``): these kernels have no has-initial-state flag.

Contracts: the recurrent kernels are elementwise float32 (``tl.sum`` of products, no ``tl.dot``):
"ieee".  The chunk kernel multiplies operands in the inputs' 16-bit dtype in ``tl.dot``: "fp16" for float16 inputs,
"bf16" for bfloat16.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Optional

import torch

from kvbuffer_ref.engine_inputs import check_engine_inputs

from ..validate.adapters import AdapterError, describe, interpreter_active, unavailable
from ._sources import (dist_version, dtypes, extract, find, interpretable_chunk_kernels, interpreter_fixes, shims_first,
                       version_in, write_shims)
from .engine import InputsAdapter, engine_adapter, token_rows

__all__ = ["load_kernels", "locate", "KERNELS", "sglang", "sglang_decode", "sglang_packed", "sglang_pool",
           "sglang_chunk", "sglang_inputs", "SGLangRecurrent", "SGLangChunk", "SGLangInputs", "decode_step",
           "packed_step", "pool_step", "FUSED_SPLIT_MAX"]

#: Where the kernels live inside the ``sglang`` package.
KERNELS = Path("kernels/ops/attention")
_NEEDED = ("fla/fused_recurrent.py", "linear/fused_sigmoid_gating_recurrent.py")
_MODULES = {"fused_recurrent": "fla.fused_recurrent", "fused_sigmoid": "linear.fused_sigmoid_gating_recurrent"}
#: The modules of the GDN backend's prefill preprocessing (``load_kernels(inputs=True)``): the split of the
#: convolved q|k|v, the gating, fla's L2 norm (called by ``fla.chunk`` on q and k).
_INPUT_MODULES = {"split": "triton_gdn_fused_proj", "gating": "linear.fused_gdn_gating", "l2norm": "fla.l2norm"}

_SHIM_UTILS = '''"""Shim of sglang.srt.utils (kvbuffer validate): the queries SGLang's GDN kernel files make."""
import torch


def is_hip():
    return torch.version.hip is not None


def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda is not None


def is_cpu():
    return False


def is_npu():
    return False


def is_xpu():
    return False


def get_device_sm():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    return 0


def is_gfx95_supported():
    return bool(torch.version.hip) and "gfx95" in torch.cuda.get_device_properties(0).gcnArchName


def is_sm90_supported():
    return is_cuda() and torch.cuda.get_device_capability()[0] == 9


def cdiv(a, b):
    return -(a // -b)


def next_power_of_2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def cpu_has_amx_support():
    return False
'''
_SHIM_COMMON = '''"""Shim of sglang.srt.utils.common (kvbuffer validate)."""
import torch
from packaging import version

torch_release = version.parse(torch.__version__).release
'''
_SHIM_ENVIRON = '''"""Shim of sglang.srt.environ (kvbuffer validate): the one switch triton_gdn_fused_proj.py reads at import."""
import os


class _Bool:
    def __init__(self, name, default):
        self.name, self.default = name, default

    def get(self):
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        if value.lower() in ("true", "1", "yes", "y"):
            return True
        if value.lower() in ("false", "0", "no", "n"):
            return False
        raise ValueError(f'"{value}" is not a valid boolean value')


class _Envs:
    SGLANG_USE_AITER = _Bool("SGLANG_USE_AITER", False)


envs = _Envs()
'''
_SHIM_JIT = '''"""Shim of sglang.kernels.jit.utils (kvbuffer validate): SGLang's PDL rule (CUDA, capability >= 9)."""
import torch


def is_arch_support_pdl():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability()[0] >= 9
'''


# ----------------------------------------------------------------------------- finding the kernel files
def _version_of_tree(pkg: Path) -> str:
    """The version of the sglang package folder ``pkg``: its _version.py or version.py, else the sglang
    dist-info beside it, else '?'."""
    for f in (pkg / "_version.py", pkg / "version.py"):
        if f.is_file():
            v = version_in(f.read_text())
            if v:
                return v
    return dist_version(pkg.parent, "sglang") or "?"


def _from_wheel(whl: Path) -> tuple:
    """The wheel's kernel folders extracted to a temporary folder (only the .py files of fla/ and linear/, and
    triton_gdn_fused_proj.py, the split of the GDN backend's prefill), with its METADATA (the version)."""
    root = extract(whl, (r"sglang/kernels/ops/attention/((fla|linear)/[^/]+|triton_gdn_fused_proj)\.py",
                         r"sglang-[^/]+\.dist-info/METADATA"), "kvbuffer-sglang-wheel-")
    return root / "sglang" / KERNELS, dist_version(root, "sglang") or "?"


def _tree(path: Path) -> Optional[tuple]:
    """(kernel folder, version) of a wheel, a folder holding one, or a folder holding the sglang package."""
    if path.is_file() and path.suffix == ".whl":
        return _from_wheel(path)
    if not path.is_dir():
        return None
    for pkg in (path / "sglang", path / "python" / "sglang", path):
        if all((pkg / KERNELS / f).is_file() for f in _NEEDED):
            return pkg / KERNELS, _version_of_tree(pkg)
    wheels = sorted(path.glob("sglang-*.whl"))
    if wheels:
        return _from_wheel(wheels[-1])
    return None


def _complete(found: Optional[tuple]) -> Optional[tuple]:
    """``found`` ((kernel folder, version) or None) where the folder holds every file of ``_NEEDED``, else None."""
    return found if found and all((found[0] / f).is_file() for f in _NEEDED) else None


def locate(path=None) -> tuple:
    """(kernel folder, version, where from) of SGLang's kernels: ``$KVBUFFER_PEER_PATH`` (``--peer-path``)
    when it holds them, else the installed ``sglang`` package.  AdapterError with what was looked at
    when neither has them.  ``path`` (a wheel, a folder holding one, or a tree, as ``--peer-path``): that
    place only, nothing else looked at (the benchmark's ``--sglang-path``)."""
    return find(path, lambda p: _complete(_tree(p)), "sglang",
                lambda pkg: ((pkg / KERNELS, _version_of_tree(pkg))
                             if all((pkg / KERNELS / f).is_file() for f in _NEEDED) else None),
                not_at=lambda p: (f"SGLang's kernels not found: {p} holds no sglang-*.whl and no sglang kernel "
                                  f"files ({', '.join(_NEEDED)} under sglang/{KERNELS}). Get the wheel without "
                                  f"SGLang's dependencies: python3 -m pip download --no-deps sglang -d {p}"),
                not_in_env=lambda given: (f"--peer-path {given} holds no sglang kernel files ({', '.join(_NEEDED)} "
                                          f"under sglang/{KERNELS})"),
                not_in_package=lambda pkg: (f"the installed sglang ({pkg}) has no {KERNELS}/{_NEEDED[0]} (SGLang "
                                            f"0.5.23's layout)"),
                not_found=lambda looked: (f"SGLang's kernels not found: {looked}. Get them without SGLang's "
                                          "dependencies: python3 -m pip download --no-deps sglang -d DIR, then "
                                          "--peer-path DIR (or pip install --no-deps sglang)"))


# ----------------------------------------------------------------------------- loading them
def _shims(kernels: Path) -> Path:
    """A temporary folder with a minimal ``sglang`` package whose kernel packages are SGLang's own folders."""
    files = {
        "sglang/__init__.py": '"""Shim of sglang (kvbuffer validate): only its GDN kernel files load."""\n',
        "sglang/srt/__init__.py": "", "sglang/srt/utils/__init__.py": _SHIM_UTILS,
        "sglang/srt/utils/common.py": _SHIM_COMMON, "sglang/srt/environ.py": _SHIM_ENVIRON,
        "sglang/kernels/__init__.py": "", "sglang/kernels/jit/__init__.py": "",
        "sglang/kernels/jit/utils/__init__.py": _SHIM_JIT,
        "sglang/kernels/ops/__init__.py": "",
        # the attention package: its fla/ and linear/ shims here first, then SGLang's own folder (its modules,
        # triton_gdn_fused_proj.py among them)
        "sglang/kernels/ops/attention/__init__.py": f"__path__.append({str(kernels)!r})\n",
        # the kernel packages: their files are SGLang's own, read where they are
        "sglang/kernels/ops/attention/fla/__init__.py": f"__path__ = [{str(kernels / 'fla')!r}]\n",
        "sglang/kernels/ops/attention/linear/__init__.py": f"__path__ = [{str(kernels / 'linear')!r}]\n",
    }
    return write_shims("kvbuffer-sglang-shims-", files)


def load_kernels(chunk: bool = False, path=None, inputs: bool = False) -> types.SimpleNamespace:
    """SGLang's kernel modules (``locate(path)``), imported with the shims first on sys.path, the process's own
    ``sglang`` modules (if any) set aside meanwhile and restored after.  ``chunk``: also ``fla.chunk``;
    ``inputs``: also the GDN backend's prefill preprocessing (``_INPUT_MODULES``)."""
    kernels, version, source = locate(path)
    shims = _shims(kernels)
    loaded = {}
    with shims_first(shims, "sglang"):
        try:
            import warnings
            with warnings.catch_warnings():  # fla/utils.py warns when it finds no GPU driver
                warnings.simplefilter("ignore")
                names = dict(_MODULES, **({"chunk": "fla.chunk"} if chunk else {}),
                             **(_INPUT_MODULES if inputs else {}))
                for key, rel in names.items():
                    loaded[key] = importlib.import_module(f"sglang.{KERNELS.as_posix().replace('/', '.')}.{rel}")
            prefix = f"sglang.{KERNELS.as_posix().replace('/', '.')}."
            modules = {n[len(prefix):]: m for n, m in sys.modules.items() if n.startswith(prefix)}
            if interpreter_active():
                interpreter_fixes(modules)
                if chunk or inputs:  # their kernels' loop indices and block pointers
                    interpretable_chunk_kernels(modules)
        except Exception as e:
            raise AdapterError(f"SGLang's kernels from {source}: importing them failed: {type(e).__name__}: {e}") \
                from None
    fr, fs = loaded["fused_recurrent"], loaded["fused_sigmoid"]
    return types.SimpleNamespace(
        version=version, source=source,
        fused_recurrent_gated_delta_rule=fr.fused_recurrent_gated_delta_rule,
        fused_recurrent_gated_delta_rule_update=fr.fused_recurrent_gated_delta_rule_update,
        fused_recurrent_gated_delta_rule_packed_decode=fr.fused_recurrent_gated_delta_rule_packed_decode,
        fused_sigmoid_gating_delta_rule_update=fs.fused_sigmoid_gating_delta_rule_update,
        chunk_gated_delta_rule=loaded["chunk"].chunk_gated_delta_rule if chunk else None,
        fused_qkv_split_gdn_prefill=loaded["split"].fused_qkv_split_gdn_prefill if inputs else None,
        fused_gdn_gating=loaded["gating"].fused_gdn_gating if inputs else None,
        l2norm_fwd=loaded["l2norm"].l2norm_fwd if inputs else None)


_NOT_BUFFERED = {
    "direct_gated_delta_rule": "SGLang has no stateless (direct) form",
    "buffered_decode": "not an SGLang kernel (its decode reads and writes the state every step)",
    "flush": "SGLang has no buffer", "materialize_state": "SGLang has no buffer",
    "verify": "SGLang's speculative verify keeps a state per draft (not mapped here)",
    "accept": "SGLang's speculative verify keeps a state per draft (not mapped here)",
    "prefill": "SGLang has no buffer hand-off",
}


# ----------------------------------------------------------------------------- sglang: the oracle's convention
class SGLangRecurrent:
    """``fused_recurrent_gated_delta_rule`` of SGLang's fla copy in the oracle's convention (the module
    docstring): every argument by keyword, states [N, HV, V, K] in float32 (transposed here), q/k
    normalisation in the kernel off (the caller normalises), int64 ``cu_seqlens``, grouped value heads
    native, scalar gates only (the kernel is launched with IS_KDA=False)."""

    contract = "ieee"
    channel_gate = False
    forms = ("u",)
    varlen = ("recurrent_gated_delta_rule",)

    def __init__(self, kernels):
        self._k = kernels
        self.version = kernels.version
        self.name = f"sglang {kernels.version}"
        self.interpreted = interpreter_active()
        self.dtypes = dtypes(torch.float32, torch.float16)
        self.not_provided = dict(_NOT_BUFFERED, chunk_gated_delta_rule="SGLang's chunk kernel takes 16-bit inputs "
                                 "only and a state pool: --impl sglang-chunk")

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   cu_seqlens=None):
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.to(torch.float32).transpose(-1, -2).contiguous()
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(torch.int64)}
        o, S = self._k.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                                        output_final_state=output_final_state,
                                                        use_qk_l2norm_in_kernel=False, **kw)
        return o, (None if S is None else S.transpose(-1, -2))

    def recurrent_decode(self, q, k, v, *, g, beta, state, scale=None):
        """One decode step: the state in, its final state copied back in place."""
        o, new = self.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                                 output_final_state=True)
        state.copy_(new)
        return o


class SGLangChunk:
    """``chunk_gated_delta_rule`` of SGLang's fla copy (its prefill): float16 / bfloat16 q, k, v (it refuses
    float32), states in a float32 pool [N + 1, HV, V, K] addressed by ``initial_state_indices`` (int32,
    slot 0 left NaN, never addressed) and written in place (``inplace_update=True``), q/k normalisation in
    the kernel off, its own chunk size 64, int64 ``cu_seqlens``.  Without an initial state the slots
    start at zero, as SGLang clears a fresh request's slot."""

    contract = {"float16": "fp16", "bfloat16": "bf16"}  # tl.dot of operands in the input dtype
    channel_gate = False
    forms = ("u",)
    varlen = ("chunk_gated_delta_rule",)

    def __init__(self, kernels):
        self._k = kernels
        self.name = f"sglang {kernels.version} chunk"
        self.interpreted = interpreter_active()
        self.dtypes = dtypes(torch.float16)
        self.not_provided = dict(_NOT_BUFFERED, recurrent_gated_delta_rule="the chunk kernel only: --impl sglang",
                                 recurrent_decode="the chunk kernel only: --impl sglang, sglang-decode, sglang-packed")

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                               chunk_size=64, cu_seqlens=None):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        pool = torch.zeros(N + 1, HV, V, K, dtype=torch.float32, device=q.device)
        pool[0] = float("nan")
        if initial_state is not None:
            pool[1:] = initial_state.to(torch.float32).transpose(-1, -2)
        idx = torch.arange(1, N + 1, dtype=torch.int32, device=q.device)
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(torch.int64)}
        o, _, _ = self._k.chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                                                 beta.contiguous(), scale=scale, initial_state=pool,
                                                 initial_state_indices=idx, use_qk_l2norm_in_kernel=False,
                                                 inplace_update=True, **kw)
        return o, (pool[1:].transpose(-1, -2).contiguous() if output_final_state else None)


# ----------------------------------------------------------------------------- sglang-inputs: the prefill's preprocessing
#: ``MAX_FUSED_QKV_SPLIT_DIM`` of SGLang's ``gdn_backend.py``: up to this q|k|v width (2 H K + HV V) the backend
#: splits with ``fused_qkv_split_gdn_prefill`` (on CUDA, HIP and XPU), past it with ``torch.split``.
FUSED_SPLIT_MAX = 8192


class SGLangInputs(InputsAdapter):
    """``engine_inputs`` through the calls SGLang's GDN backend makes between the convolution and the chunk
    kernel of a prefill (``GDNAttnBackend.forward_extend``, not a target verify; ``TritonGDNKernel.extend``)::

        query, key, value = fused_qkv_split_gdn_prefill(mixed_qkv [L, D], H, H, HV, K, K, V)   # D <= 8192
        g, beta = fused_gdn_gating(A_log, a [L, HV], b [L, HV], dt_bias)                      # _prefill_gates
        q, k = l2norm_fwd(query), l2norm_fwd(key)   # in fla.chunk's forward (use_qk_l2norm_in_kernel=True)

    Three Triton kernels: the split (q [1, L, H, K], k, v [1, L, HV, V], fresh, in mixed_qkv's dtype), the
    gating (g, beta [1, L, HV] in float32; softplus beta 1 and threshold 20, its defaults), the L2 norm (eps
    1e-6, its default, in float32, the result in q's dtype).  Past ``FUSED_SPLIT_MAX`` the backend splits in
    plain torch, inline in ``forward_extend`` (``torch.split(mixed_qkv, [H K, H K, HV V], dim=-1)`` then
    ``.view(1, L, H, K)`` / ``(1, L, HV, V)``), and fla's ``input_guard`` makes the views contiguous before
    the norm: both done here as those torch operations.  ``qk_l2norm=False``: the norm is not called (the
    chunk kernel's ``use_qk_l2norm_in_kernel=False``).

    Inputs: mixed_qkv [N, D] or [B, T, D], a, b as the backend's token rows (``engine.token_rows``: the split
    kernel takes both strides of mixed_qkv; the gating kernel only a row stride); ``A_log`` in float32 (the
    layer's parameter), ``dt_bias`` in the lane's dtype (the layer's: the model's dtype), both contiguous as
    the layer's parameters are (the gating kernel reads them with unit stride).  Returns what the
    kernels return, reshaped to [B, T, ..]: q, k, v in mixed_qkv's dtype (16-bit q and k for 16-bit inputs),
    g, beta in float32.
    """

    def __init__(self, kernels):
        super().__init__(kernels, f"sglang {kernels.version} prefill inputs",
                         "the GDN backend's prefill preprocessing only (engine_inputs): --impl sglang, "
                         "sglang-decode, sglang-packed, sglang-pool, sglang-chunk")

    def engine_inputs(self, mixed_qkv, a, b, *, A_log, dt_bias, num_heads, head_k_dim, qk_l2norm=True):
        B, T, H, HV, K, V = check_engine_inputs(mixed_qkv, a, b, A_log, dt_bias, num_heads, head_k_dim,
                                                check_values=False)
        L, D = B * T, mixed_qkv.shape[-1]
        if D <= FUSED_SPLIT_MAX:
            q, k, v = self._k.fused_qkv_split_gdn_prefill(mixed_qkv.reshape(L, D), H, H, HV, K, K, V)
        else:
            q, k, v = torch.split(token_rows(mixed_qkv), [H * K, H * K, HV * V], dim=-1)
            q, k, v = (x.view(1, L, n, d).contiguous() for x, n, d in ((q, H, K), (k, H, K), (v, HV, V)))
        if qk_l2norm:
            q, k = self._k.l2norm_fwd(q), self._k.l2norm_fwd(k)
        g, beta = self._k.fused_gdn_gating(A_log.to(torch.float32).contiguous(), token_rows(a), token_rows(b),
                                           dt_bias.contiguous())
        return tuple(t.reshape(B, T, *t.shape[2:]) for t in (q, k, v, g, beta))


# ----------------------------------------------------------------------------- the pooled kernels' steps
def decode_step(kernels):
    """``fused_sigmoid_gating_delta_rule_update`` as SGLang's Triton GDN backend calls it per decode step
    (``TritonGDNKernel.decode``): q, k, v [1, N, H|HV, K|V], a, b [1, N, HV], ``cu_seqlens`` (its
    query_start_loc), the pool and its slot indices, softplus_beta 1 and threshold 20, q/k L2-normalised
    in the kernel."""
    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, cu_seqlens, scale):
        return kernels.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0, q=q, k=k, v=v, b=b,
            initial_state_source=state, initial_state_indices=slots, scale=scale, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens)
    return step


def packed_step(kernels):
    """``fused_recurrent_gated_delta_rule_packed_decode`` as ``TritonGDNKernel.packed_decode`` calls it:
    ``mixed_qkv`` [N, 2 H K + HV V], a, b [N, HV], the output [N, 1, HV, V] allocated by the caller."""
    def step(*, mixed_qkv, A_log, dt_bias, a, b, state, slots, scale):
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], 1, state.shape[1], state.shape[2])
        kernels.fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=state, out=out,
            ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
        return out
    return step


def pool_step(kernels):
    """``fused_recurrent_gated_delta_rule_update``: whole sequences (``cu_seqlens``) from and into the pool
    by slot, log gates; a request without an initial state gets its slot zeroed first (SGLang clears a fresh
    request's slot before its forward: the kernel reads every slot it is given)."""
    def step(*, q, k, v, g, beta, state, slots, cu_seqlens, scale, has_initial_state):
        fresh = slots[(~has_initial_state.to(slots.device)) & (slots >= 0)].long()
        state[fresh] = 0
        return kernels.fused_recurrent_gated_delta_rule_update(
            q, k, v, g=g, beta=beta, scale=scale, initial_state_source=state, initial_state_indices=slots,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    return step


#: The engine conventions of the three pooled kernels (engine.Convention fields).
CONVENTIONS = {
    "decode": dict(tokens="decode", qkv="separate", gating="raw", qk_l2norm=True, state_layout="VK", pool=True,
                   pad_slot=-1, varlen=True),
    "packed": dict(tokens="decode", qkv="packed", gating="raw", qk_l2norm=True, state_layout="VK", pool=True,
                   pad_slot=-1, varlen=False),
    "pool": dict(tokens="sequence", qkv="separate", gating="log", qk_l2norm=True, state_layout="VK", pool=True,
                 pad_slot=-1, varlen=True),
}


# ----------------------------------------------------------------------------- the factories (--impl names)
def _load(name: str, chunk: bool = False):
    """The kernels, or None and an Implementation whose lanes are NOT RUN with the reason."""
    try:
        return load_kernels(chunk=chunk), None
    except AdapterError as e:
        return None, unavailable(name, str(e))


def sglang():
    """``--impl sglang``: SGLang's ``fused_recurrent_gated_delta_rule`` (recurrent, recurrent_decode,
    recurrent_varlen)."""
    k, missing = _load("sglang")
    return missing or describe(SGLangRecurrent(k))


def _engine(kind: str, label: str, step_of):
    k, missing = _load(f"sglang-{kind}")
    if missing:
        return missing
    adapter = engine_adapter(step_of(k), name=f"sglang {k.version} {label}", contract="ieee", **CONVENTIONS[kind])
    adapter.interpreted = interpreter_active()
    # SGLang runs these kernels on bfloat16 q, k, v (the model's dtype); the interpreter mishandles bfloat16
    adapter.dtypes = dtypes(*adapter.dtypes)
    if kind == "pool":  # log gates, one per value head: the kernel has no per-channel gate
        adapter.channel_gate = False
    return describe(adapter)


def sglang_decode():
    """``--impl sglang-decode``: ``fused_sigmoid_gating_delta_rule_update`` in SGLang's decode convention."""
    return _engine("decode", "fused_sigmoid_gating decode", decode_step)


def sglang_packed():
    """``--impl sglang-packed``: ``fused_recurrent_gated_delta_rule_packed_decode`` (packed mixed_qkv)."""
    return _engine("packed", "packed decode", packed_step)


def sglang_pool():
    """``--impl sglang-pool``: ``fused_recurrent_gated_delta_rule_update`` (sequences into a slot pool)."""
    return _engine("pool", "pooled recurrent", pool_step)


def sglang_chunk():
    """``--impl sglang-chunk``: SGLang's ``chunk_gated_delta_rule``."""
    k, missing = _load("sglang-chunk", chunk=True)
    return missing or describe(SGLangChunk(k))


def sglang_inputs():
    """``--impl sglang-inputs``: the GDN backend's prefill preprocessing (split, gating, L2 norm: engine_inputs)."""
    try:
        k = load_kernels(inputs=True)
    except AdapterError as e:
        return unavailable("sglang-inputs", str(e))
    return describe(SGLangInputs(k))
