"""Peer adapters loaded from a checkout the user points to (never copied into this repository).

``replayssm``: ReplaySSM's GDN decode kernel (``fused_recurrent_gated_delta_rule_replayssm``, a ring of
recent update vectors replayed instead of a state write per step; github.com/Johnny-Liou/ReplaySSM, a
vLLM fork, kernels under vllm/model_executor/layers/fla/ops/), loaded from ``--peer-path CHECKOUT`` (or
$KVBUFFER_PEER_PATH) without importing vllm: the kernel file's two vllm imports (``vllm.triton_utils``:
triton and tl; ``...mamba.ops.replayssm_config``: the launch configuration) are served by shims written
to a temporary folder, the checkout's own ``replayssm_config.py`` used when it imports on its own.

    kvbuffer validate --impl replayssm --peer-path <checkout> --profile gpu --device cuda

The decode kernel is validated as ``recurrent`` (T decode steps, one kernel call each, from an initial
state or none): its convention is vLLM's (packed ``mixed_qkv`` [N, 2 H K + HV V], raw gating ``A_log``,
``dt_bias``, ``a``, ``b``, the checkpoint pool [slots, HV, V, K] with slot 0 the null block, the ring
caches d [slots, HV, L, V], k [slots, H, L, K], g [slots, HV, L] and the per-row cursor ``write_pos``;
the kernel folds the ring into the checkpoint when the cursor reaches L - 1).  The final state is the
checkpoint plus the ring replayed by this adapter in float64 (S = exp(G) S0 + sum_i exp(G - G_i) d_i k_i^T):
what the kernel's next call would reconstruct.  The ring is 4 entries long, so the cases wrap around it.
Its arithmetic contract is declared "tf32": ``tl.dot`` of float32 operands multiplies in TF32 on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

from .adapters import AdapterError, interpreter_active
from .cases import Sizes

__all__ = ["replayssm", "ReplaySSMDecode", "PEER_ENV", "load_kernel_module"]

PEER_ENV = "KVBUFFER_PEER_PATH"
_OPS = Path("vllm/model_executor/layers/fla/ops")
_SHIM_CONFIG = '''"""Shim of ReplaySSM's launch configuration (kvbuffer validate): (block_v, num_warps, num_stages, nk)."""
def get_replayssm_config(kind, L=None, **kw):
    return (None, 4, 2, 1)
'''
_SHIM_TRITON = '''"""Shim of vllm.triton_utils (kvbuffer validate): triton and tl only."""
import triton
import triton.language as tl
'''


def _shims(checkout: Path) -> Path:
    """A folder with a minimal ``vllm`` package: triton_utils and the ReplaySSM config (the checkout's own
    when it imports without the rest of vllm, else a default)."""
    root = Path(tempfile.mkdtemp(prefix="kvbuffer-replayssm-shims-"))
    pkgs = ["vllm", "vllm/triton_utils", "vllm/model_executor", "vllm/model_executor/layers",
            "vllm/model_executor/layers/mamba", "vllm/model_executor/layers/mamba/ops"]
    for p in pkgs:
        (root / p).mkdir(parents=True, exist_ok=True)
        (root / p / "__init__.py").write_text("")
    (root / "vllm/triton_utils/__init__.py").write_text(_SHIM_TRITON)
    cfg = _SHIM_CONFIG
    real = checkout / "vllm/model_executor/layers/mamba/ops/replayssm_config.py"
    if real.is_file() and "import vllm" not in real.read_text() and "from vllm" not in real.read_text():
        cfg = real.read_text()
    (root / "vllm/model_executor/layers/mamba/ops/replayssm_config.py").write_text(cfg)
    return root


def load_kernel_module(checkout, filename: str):
    """The kernel file ``filename`` of ``checkout``'s vllm/model_executor/layers/fla/ops, imported under a
    private name with the shims first on sys.path (AdapterError naming the path when it is not there)."""
    checkout = Path(checkout)
    path = checkout / _OPS / filename
    if not path.is_file():
        raise AdapterError(f"--peer-path {checkout}: no {_OPS / filename} there (a ReplaySSM checkout: "
                           f"github.com/Johnny-Liou/ReplaySSM)")
    shims = _shims(checkout)
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    for n in saved:
        del sys.modules[n]
    sys.path.insert(0, str(shims))
    try:
        spec = importlib.util.spec_from_file_location(f"_kvbuffer_peer_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:
        raise AdapterError(f"--peer-path {checkout}: importing {path} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(str(shims))
        for n in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[n]
        sys.modules.update(saved)
    return mod


class ReplaySSMDecode:
    """ReplaySSM's GDN decode kernel behind the protocol (see the module docstring)."""

    contract = "tf32"
    channel_gate = False  # raw gating: scalar gates
    ring = 4

    def __init__(self, checkout):
        self._mod = load_kernel_module(checkout, "fused_recurrent_replayssm.py")
        self._fn = self._mod.fused_recurrent_gated_delta_rule_replayssm
        self.name = "replayssm-decode"
        self.interpreted = interpreter_active()
        self.dtypes = (torch.float32,)
        # the kernel needs K and V of at least 16 (tl.dot tiles of 16) and one K tile
        dims = (1, 3, 8, 16, 40, 64, 128)  # below 16: zero-padded to 16 by the adapter
        self.sizes = Sizes(name="replayssm" + (" (Triton interpreter)" if self.interpreted else ""), max_B=2,
                           max_T=9, max_H=2, max_group=2, dims=dims[:5] if self.interpreted else dims, edge_B=0,
                           edge_base=(1, 1, 2, 16, 16), edge_HV=(2, 4) if self.interpreted else (16, 32),
                           edge_T=9 if self.interpreted else 136, edge_dims=((32, 64),) if self.interpreted
                           else ((128, 128),), sequences=not self.interpreted)
        self.not_provided = {"recurrent_decode": "validated as recurrent: the ring must persist across steps",
                             "chunk_gated_delta_rule": "not a ReplaySSM kernel",
                             "direct_gated_delta_rule": "not a ReplaySSM kernel",
                             "buffered_decode": "its ring layout is not a KVBuffer (validated through recurrent)",
                             "flush": "folded inside its decode kernel", "materialize_state": "-",
                             "verify": "the speculative kernel (gdn_replayssm_spec_decode.py) is not mapped yet",
                             "accept": "the speculative kernel is not mapped yet", "prefill": "-"}
        self.unit_qk = False

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None,
                                   output_final_state=False):
        from .engine import to_raw_gates
        import random

        B, T, H, K0 = q.shape
        HV, V0 = v.shape[2], v.shape[3]
        dev, L = q.device, self.ring
        scale = K0 ** -0.5 if scale is None else float(scale)
        # the kernel's tl.dot tiles need K, V >= 16: smaller ones are zero-padded (exact: a zero key column
        # adds nothing to any dot product, a zero value column gives a zero output column, cut off below)
        K, V = max(K0, 16), max(V0, 16)
        pad = lambda x, n: torch.nn.functional.pad(x.float(), (0, n - x.shape[-1]))  # noqa: E731
        q, k, v = pad(q, K), pad(k, K), pad(v, V)
        if initial_state is not None:
            initial_state = torch.nn.functional.pad(initial_state.float(), (0, V - V0, 0, K - K0))
        slots = B + 1  # slot 0: the null block
        S0 = torch.zeros(B, HV, K, V, device=dev) if initial_state is None else initial_state.float()
        h0 = torch.zeros(slots, HV, V, K, device=dev)
        h0[1:] = S0.transpose(-1, -2)
        d_cache = torch.zeros(slots, HV, L, V, device=dev)
        k_cache = torch.zeros(slots, H, L, K, device=dev)
        g_cache = torch.zeros(slots, HV, L, device=dev)
        idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
        pos = torch.zeros(B, dtype=torch.int32, device=dev)
        rng = random.Random(int(q.detach().double().sum() * 1e6) % 2**31)
        outs = []
        for t in range(T):
            A_log, dt_bias, a, b = to_raw_gates(g[:, t].float(), beta[:, t].float(), rng)
            mixed = torch.cat([q[:, t].reshape(B, H * K), k[:, t].reshape(B, H * K), v[:, t].reshape(B, HV * V)],
                              -1).float().contiguous()
            out = torch.empty(B, HV, V, device=dev)
            self._fn(mixed, a.contiguous(), b.contiguous(), A_log, dt_bias, scale, h0, d_cache, k_cache, g_cache,
                     out, idx, pos.clone())
            outs.append(out)
            pos = torch.where(pos == L - 1, torch.zeros_like(pos), pos + 1)
        o = torch.stack(outs, 1)[..., :V0] if outs else v.new_zeros(B, 0, HV, V0)
        if not output_final_state:
            return o, None
        # the state the next call reconstructs: checkpoint + ring, replayed in float64
        S = h0[1:].double().transpose(-1, -2).clone()  # [B, HV, K, V]
        for bb in range(B):
            n = int(pos[bb])
            G = g_cache[bb + 1, :, :n].double()  # [HV, n]
            tot = G.sum(-1)
            S[bb] *= tot.exp()[:, None, None]
            dec = (tot[:, None] - G.cumsum(-1)).exp()  # [HV, n]
            kk = k_cache[bb + 1, :, :n].double().repeat_interleave(HV // H, 0)  # [HV, n, K]
            dd = d_cache[bb + 1, :, :n].double() * dec[..., None]  # [HV, n, V]
            S[bb] += torch.einsum("hnk,hnv->hkv", kk, dd)
        return o, S.float()[:, :, :K0, :V0]


def replayssm():
    """ReplaySSM's decode kernel from ``$KVBUFFER_PEER_PATH`` (``--peer-path``); AdapterError (a clear message,
    exit 2) when no checkout is given or it lacks the kernel files."""
    from .adapters import describe

    path = os.environ.get(PEER_ENV)
    if not path:
        raise AdapterError("--impl replayssm: give the ReplaySSM checkout with --peer-path <checkout> (or "
                           f"${PEER_ENV}); its kernels are loaded from there, never copied here "
                           "(github.com/Johnny-Liou/ReplaySSM)")
    impl = describe(ReplaySSMDecode(path))
    if impl.interpreted and os.environ.get("KVBUFFER_PEER_INTERPRET", "0") in ("", "0"):
        # measured with triton 3.9: the interpreter rejects the kernel's masks (InterpreterError: ValueError('mask
        # has unsupported dtype')); KVBUFFER_PEER_INTERPRET=1 tries anyway
        impl.unavailable = ("ReplaySSM's decode kernel does not run under the Triton interpreter (triton 3.9: "
                            "'mask has unsupported dtype'); run it with --device cuda (KVBUFFER_PEER_INTERPRET=1 "
                            "tries the interpreter anyway)")
    return impl
