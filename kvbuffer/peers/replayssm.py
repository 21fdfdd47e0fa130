"""Peer adapters loaded from a checkout the user points to (never copied into this repository).

``replayssm``: ReplaySSM's GDN kernels (github.com/Johnny-Liou/ReplaySSM, a vLLM fork; kernels under
vllm/model_executor/layers/fla/ops/): a ring of recent delta-rule update vectors replayed instead of a
state write per step.  Loaded from ``--peer-path CHECKOUT`` (or $KVBUFFER_PEER_PATH) without importing
vllm: the kernel files' vllm imports (``vllm.triton_utils``: triton and tl; the launch table
``...mamba.ops.replayssm_config``, itself importing ``vllm.platforms``) are served by shims written to a
temporary folder; the launch table is the checkout's own file (its tuned configs), ``vllm.platforms``
shimmed by the one capability query it makes.

    kvbuffer validate --impl replayssm --peer-path <checkout> --profile gpu --device cuda

How each protocol operation is mapped (vLLM's convention throughout: packed ``mixed_qkv`` [tokens,
2 H K + HV V], raw gating ``A_log``, ``dt_bias``, ``a``, ``b`` drawn so that -exp(A_log) softplus(a +
dt_bias) = g and sigmoid(b) = beta, a reset gate (-inf) taken as -200 as this library's convention does,
q/k normalisation in the kernel off, K and V zero-padded to the kernels' tl.dot tiles, which is exact):

* ``recurrent`` -> the decode kernel ``fused_recurrent_gated_delta_rule_replayssm``: T decode steps, one
  call each, a ring of 4 (every case wraps around it and folds at cursor 3), the per-row cursor advanced
  as vLLM advances it.  The final state is the checkpoint plus the ring replayed in float64 (what the
  kernel's next call reconstructs).
* ``verify`` (chains) -> the speculative kernel ``gdn_replayssm_spec_decode`` (both launches: verify,
  and flush for the blocks whose is_flush is set), request b's first num_drafts[b] tokens as its window
  (vLLM's packed query_start_loc).  The buffer becomes ReplaySSM's storage: its n_b entries the ring's
  history (d = u, k = k, g = the differences of G) from a rotated origin (so history and window wrap
  around the ring's end), its stale state the fp32 checkpoint [slots, HV, V, K] of block B - b (block 0
  the null block, never the identity map), every unused ring row, the null block and a spare block NaN.
  The ring is sized as ReplaySSM's backend sizes it for a base history of C (the buffer's capacity):
  L = C + T (T = the drafts' width), physical buf = next_pow2(L); is_flush as its cursor kernel sets it
  (n_b + 2T > L).  A draft tree is refused (NotImplementedError): its window is one chain per request.
* ``accept`` (counts, or nodes of a chain) -> its cursor kernel ``commit_gdn_replayssm_spec`` (num_accepted
  = counts) on a copy of the cursors; the returned buffer is the ring read back from the new cursors (its
  capacity grows to the accepted count where that exceeds C: ReplaySSM's ring holds L = C + T rows).
* ``buffered_decode`` -> a round of a one-token window, committed (ReplaySSM's decode in its speculative
  regime; the round of a full buffer is a flush round).
* ``flush`` -> the oracle's fold of the ring's contents in float64: ReplaySSM folds only inside a round.
* not provided: materialize_state, prefill (vLLM's chunk kernel), chunk and direct forms, trees.

Its arithmetic contract is declared "tf32": ``tl.dot`` of float32 operands multiplies in TF32 on a GPU.
``emulation()`` is a float64 PyTorch model of the three kernels as their source reads; the CPU tests
validate the mapping through it, so a GPU run only has to show that the kernels compute what it does.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import types
from pathlib import Path

import torch

import kvbuffer_ref as ref
from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import RESET_GATE

from ..validate.adapters import AdapterError, describe, interpreter_active
from ..validate.cases import Sizes, raw_gates_in
from ._sources import PEER_ENV, shims_first, write_shims
from .engine import next_pow2

__all__ = ["replayssm", "ReplaySSMDecode", "PEER_ENV", "load_kernel_module"]

_OPS = Path("vllm/model_executor/layers/fla/ops")
_CONFIG = Path("vllm/model_executor/layers/mamba/ops/replayssm_config.py")
_SHIM_CONFIG = '''"""Shim of ReplaySSM's launch configuration (kvbuffer validate): (block_v, num_warps, num_stages, nk)."""
def get_replayssm_config(kind, L=None, **kw):
    return (None, 4, 2, 1)
'''
_SHIM_TRITON = '''"""Shim of vllm.triton_utils (kvbuffer validate): triton and tl only."""
import triton
import triton.language as tl
'''
_SHIM_PLATFORMS = '''"""Shim of vllm.platforms (kvbuffer validate): the one query ReplaySSM's launch table makes."""
import torch


class _Platform:
    def is_device_capability_family(self, family):
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major == int(family) // 10


current_platform = _Platform()
'''


def _shims(checkout: Path, config: str = "checkout") -> Path:
    """A folder with a minimal ``vllm`` package: triton_utils, platforms (the capability query) and the
    ReplaySSM launch table: the checkout's own ``replayssm_config.py`` (``config="checkout"``: the tuned
    configs ReplaySSM launches with) or a default one (``config="shim"``)."""
    pkgs = ["vllm", "vllm/triton_utils", "vllm/platforms", "vllm/model_executor", "vllm/model_executor/layers",
            "vllm/model_executor/layers/mamba", "vllm/model_executor/layers/mamba/ops"]
    files = {f"{p}/__init__.py": "" for p in pkgs}
    files["vllm/triton_utils/__init__.py"] = _SHIM_TRITON
    files["vllm/platforms/__init__.py"] = _SHIM_PLATFORMS
    cfg = _SHIM_CONFIG
    real = checkout / _CONFIG
    if config == "checkout" and real.is_file():
        cfg = real.read_text()
    files[_CONFIG.as_posix()] = cfg
    return write_shims("kvbuffer-replayssm-shims-", files)


def load_kernel_module(checkout, filename: str):
    """The kernel file ``filename`` of ``checkout``'s vllm/model_executor/layers/fla/ops, imported under a
    private name with the shims first on sys.path (AdapterError naming the path when it is not there).

    Its launch table is the checkout's own ``replayssm_config.py`` (with ``vllm.platforms`` shimmed), so
    the kernels run with the configurations ReplaySSM ships; if that file does not import, the default
    shim's.  ``module.__kvbuffer_config__`` says which ("checkout" or "shim: <why>")."""
    checkout = Path(checkout)
    path = checkout / _OPS / filename
    if not path.is_file():
        raise AdapterError(f"--peer-path {checkout}: no {_OPS / filename} there (a ReplaySSM checkout: "
                           f"github.com/Johnny-Liou/ReplaySSM)")
    try:
        mod = _import_with_shims(checkout, path, "checkout")
        mod.__kvbuffer_config__ = "checkout"
    except AdapterError as first:
        mod = _import_with_shims(checkout, path, "shim")
        mod.__kvbuffer_config__ = f"shim: the checkout's {_CONFIG.name} did not import ({first})"
    return mod


def _import_with_shims(checkout: Path, path: Path, config: str):
    shims = _shims(checkout, config)
    with shims_first(shims, "vllm"):
        try:
            spec = importlib.util.spec_from_file_location(f"_kvbuffer_peer_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if hasattr(mod, "get_replayssm_config"):  # the launch table resolves (its platform query included)
                mod.get_replayssm_config("gdn_decode", L=16)
        except Exception as e:
            raise AdapterError(f"--peer-path {checkout}: importing {path} failed: {type(e).__name__}: {e}") \
                from None
    return mod


def _finite_gates(g: torch.Tensor) -> torch.Tensor:
    """The log-gates as a raw-gated engine can receive them: a reset gate (below -RESET_GATE, -inf
    included) is taken as -RESET_GATE[float32] = -200, the library's own convention (docs/conventions.md,
    "Reset gates": the same exact zero decay), since no finite a gives -inf through -exp(A_log) softplus(a +
    dt_bias), and ReplaySSM's kernels sum gates (an -inf there is a NaN decay).  Every other gate unchanged."""
    return g.float().clamp(min=-float(RESET_GATE[torch.float32]))


class _Ring:
    """ReplaySSM's speculative-decode storage for one batch, as its kernels address it: the checkpoint
    pool [slots, HV, V, K] (float32, slot 0 the null block), the circular ring caches d [slots, HV, buf, V],
    k [slots, H, buf, K], g [slots, HV, buf] and the block-keyed cursors write_pos, cache_base (int32) and
    is_flush (int8) [slots]; request b lives in block ``idx[b]``.  ``L``: the logical flush threshold
    (ReplaySSM's max_cache_len), ``T``: its max_spec_len, ``buf = next_pow2(L)`` the physical ring."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def tensors(self) -> dict:  # the validator's guard compares these bit for bit around every call
        return {n: getattr(self, n) for n in ("h", "d", "k", "g", "write_pos", "cache_base", "is_flush", "idx")}


class ReplaySSM:
    """ReplaySSM's GDN kernels behind the protocol (see the module docstring): ``recurrent`` through its
    decode kernel, ``verify`` / ``accept`` / ``buffered_decode`` through its speculative-decode kernel and
    its cursor kernel, ``flush`` the oracle's fold of the ring's contents.

    ``kernels``: a namespace with ``fused_recurrent_gated_delta_rule_replayssm``,
    ``gdn_replayssm_spec_decode``, ``commit_gdn_replayssm_spec`` and ``get_replayssm_config`` (default: the
    checkout's kernel files); ``peers.emulation()`` is the pure-PyTorch model of them the CPU tests use."""

    contract = "tf32"
    channel_gate = False  # raw gating: scalar gates
    #: its kernels take float32 raw gates and compute g, beta themselves: the cases' g, beta are those of the
    #: raw gates ``cases.raw_gates_in`` derives, and the budget includes the gates a float32 kernel computes
    raw_gate_dtype = "float32"
    forms = ("u",)
    ring = 4  # the decode kernel's ring in the recurrent lane (every case wraps around it)

    def __init__(self, checkout=None, *, kernels=None, name="replayssm"):
        if kernels is None:
            dec = load_kernel_module(checkout, "fused_recurrent_replayssm.py")
            spec = load_kernel_module(checkout, "gdn_replayssm_spec_decode.py")
            kernels = types.SimpleNamespace(
                fused_recurrent_gated_delta_rule_replayssm=dec.fused_recurrent_gated_delta_rule_replayssm,
                gdn_replayssm_spec_decode=spec.gdn_replayssm_spec_decode,
                commit_gdn_replayssm_spec=spec.commit_gdn_replayssm_spec,
                get_replayssm_config=spec.get_replayssm_config,
                config_source=spec.__kvbuffer_config__)
        self._k = kernels
        self.name = name
        self.emulated = bool(getattr(kernels, "emulated", False))
        if self.emulated:  # the model computes in float64: held to IEEE float32's budget, the strictest
            self.contract = "ieee"
        self.interpreted = interpreter_active() and not self.emulated
        self.config_source = getattr(kernels, "config_source", "emulation" if self.emulated else "?")
        self.dtypes = (torch.float32,)
        small = self.interpreted or self.emulated  # (the gpu profile uses cases.GPU's production shapes instead)
        dims = (1, 3, 8, 16, 40, 64, 128)  # below the kernels' tl.dot tiles: zero-padded by the adapter
        self.sizes = Sizes(name="replayssm" + (" (emulated)" if self.emulated else " (Triton interpreter)"
                                               if self.interpreted else ""), max_B=2,
                           max_T=9, max_H=2, max_group=2, dims=dims[:5] if small else dims, edge_B=0,
                           max_capacity=5, max_history=6, max_new=4, max_chain=5, max_tree=4, max_after=2,
                           big_capacity=18, edge_rows=18, edge_tree=6,
                           edge_base=(1, 1, 2, 16, 16), edge_HV=(2, 4) if small else (16, 32),
                           edge_T=9 if small else 136, edge_dims=((32, 64),) if small else ((128, 128),),
                           sequences=not small)
        self.not_provided = {
            "recurrent_decode": "validated as recurrent: the ring must persist across steps",
            "chunk_gated_delta_rule": "not a ReplaySSM kernel", "direct_gated_delta_rule": "not a ReplaySSM kernel",
            "materialize_state": "ReplaySSM reconstructs the state inside its kernels only",
            "prefill": "ReplaySSM's prefill is vLLM's chunk kernel (no ring hand-off to map)",
            # read by the lane plan once it honours per-lane reasons (the verify_tree lane needs the same
            # attributes as verify_chain); until then verify raises NotImplementedError on a tree
            "verify_tree": "ReplaySSM's speculative kernel verifies one chain per request (a window of "
                           "consecutive tokens); draft trees are not mapped",
        }

    # ------------------------------------------------------------------ shapes
    def _nk(self, kind: str, **shape) -> int:
        """The K tiles of ReplaySSM's launch table for this call: its tl.dot tiles need K / nk >= 16."""
        cfg = self._k.get_replayssm_config(kind, **shape)
        nk = cfg[2] if kind.startswith("gdn_spec") else cfg[3]  # spec: (bv, nw, nk, ns); decode: (bv, nw, ns, nk)
        assert isinstance(nk, int) and nk >= 1, f"ReplaySSM launch table {kind}: nk={nk!r}"
        return nk

    @staticmethod
    def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
        """Zero-padded last dim to n (exact: a zero key column adds nothing to any dot product, a zero value
        column gives a zero output column, cut off afterwards)."""
        return torch.nn.functional.pad(x.float(), (0, n - x.shape[-1]))

    # ------------------------------------------------------------------ recurrent: the decode kernel
    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None,
                                   output_final_state=False):

        B, T, H, K0 = q.shape
        HV, V0 = v.shape[2], v.shape[3]
        dev, L = q.device, self.ring
        scale = K0 ** -0.5 if scale is None else float(scale)
        K, V = max(K0, 16 * self._nk("gdn_decode", L=L)), max(V0, 16)
        q, k, v = self._pad(q, K), self._pad(k, K), self._pad(v, V)
        slots = B + 1  # slot 0: the null block
        h0 = torch.zeros(slots, HV, V, K, device=dev)
        if initial_state is not None:
            h0[1:] = torch.nn.functional.pad(initial_state.float(), (0, V - V0, 0, K - K0)).transpose(-1, -2)
        d_cache = torch.zeros(slots, HV, L, V, device=dev)
        k_cache = torch.zeros(slots, H, L, K, device=dev)
        g_cache = torch.zeros(slots, HV, L, device=dev)
        idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
        pos = torch.zeros(B, dtype=torch.int32, device=dev)
        outs = []
        for t in range(T):
            A_log, dt_bias, a, b = raw_gates_in(_finite_gates(g[:, t]), beta[:, t].float(), self.raw_gate_dtype)
            mixed = torch.cat([q[:, t].reshape(B, H * K), k[:, t].reshape(B, H * K), v[:, t].reshape(B, HV * V)],
                              -1).float().contiguous()
            out = torch.empty(B, HV, V, device=dev)
            self._k.fused_recurrent_gated_delta_rule_replayssm(mixed, a.contiguous(), b.contiguous(), A_log, dt_bias,
                                                               scale, h0, d_cache, k_cache, g_cache, out, idx,
                                                               pos.clone())
            outs.append(out)
            pos = torch.where(pos == L - 1, torch.zeros_like(pos), pos + 1)  # the caller's cursor, as vLLM keeps it
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

    # ------------------------------------------------------------------ the speculative kernel
    def _ring_from(self, buffer, T: int) -> _Ring:
        """ReplaySSM's storage holding ``buffer`` (u-cache form), for windows of up to ``T`` tokens.

        Request b's n_b entries are its history (d = u, k = k, g = the per-token gates, G's differences),
        at a rotated origin (cache_base = buf - ceil(n_b / 2): the history and the window wrap around the
        ring's end); its checkpoint is the buffer's stale state (0 in direct mode).  The ring is sized as
        ReplaySSM sizes it for a base history of C (its replayssm_buffer_len): L = C + T, buf = next_pow2(L);
        is_flush is set as its cursor kernel sets it (n_b + 2T > L, i.e. the window does not fit the
        capacity: that round folds the history into the checkpoint first).  Every ring position that holds
        no entry, the null block and a spare block are NaN: a kernel that reads one fails."""
        assert buffer.form == "u", "ReplaySSM adapter: u-cache buffers only (its ring caches u as d)"
        assert buffer.gates.dim() == 3, "ReplaySSM adapter: scalar gates only (its raw gating has one per head)"
        B, C, H, K0 = buffer.k.shape
        HV, V0 = buffer.u.shape[2], buffer.u.shape[3]
        dev = buffer.k.device
        assert T >= 1, f"ReplaySSM adapter: a window of {T} tokens"
        L = C + T
        buf = next_pow2(L)
        BC = max(16, next_pow2(max(1, L - T)))  # the kernel's history block: it silently ignores entries past it
        n = [int(x) for x in buffer.lengths.tolist()]
        assert all(0 <= x <= C for x in n), f"ReplaySSM adapter: lengths {n} outside 0..{C}"
        assert max(n, default=0) <= BC and C + T <= buf, \
            f"ReplaySSM adapter: history {max(n)} > the kernel's block {BC} or C + T = {C + T} > its ring {buf}"
        K = max(K0, 16 * max(self._nk("gdn_spec_verify", max_spec_len=T), self._nk("gdn_spec_flush", max_spec_len=T)))
        V = max(V0, 16)
        slots = B + 2  # slot 0 the null block; the last one a spare no request uses
        idx = torch.tensor([B - b for b in range(B)], dtype=torch.int32, device=dev)  # not the identity
        nan = float("nan")
        h = torch.full((slots, HV, V, K), nan, device=dev)
        d = torch.full((slots, HV, buf, V), nan, device=dev)
        kc = torch.full((slots, H, buf, K), nan, device=dev)
        gc = torch.full((slots, HV, buf), nan, device=dev)
        write_pos = torch.zeros(slots, dtype=torch.int32, device=dev)
        cache_base = torch.zeros(slots, dtype=torch.int32, device=dev)
        is_flush = torch.zeros(slots, dtype=torch.int8, device=dev)
        has = buffer.has_state.to(torch.bool).tolist()
        for b in range(B):
            s = B - b
            S0 = buffer.state[b].float() if (has[b] and buffer.state is not None) else \
                torch.zeros(HV, K0, V0, device=dev)
            h[s] = torch.nn.functional.pad(S0, (0, V - V0, 0, K - K0)).transpose(-1, -2)
            base = (buf - (n[b] + 1) // 2) % buf
            if n[b]:
                pos = (base + torch.arange(n[b], device=dev)) % buf
                G = buffer.G[b, :n[b]].double()  # [n, HV] cumulative since the last fold
                gg = torch.diff(G, dim=0, prepend=torch.zeros_like(G[:1]))
                d[s][:, pos] = self._pad(buffer.u[b, :n[b]], V).transpose(0, 1)
                kc[s][:, pos] = self._pad(buffer.k[b, :n[b]], K).transpose(0, 1)
                gc[s][:, pos] = gg.float().transpose(0, 1)
            write_pos[s], cache_base[s] = n[b], base
            is_flush[s] = int(n[b] + 2 * T > L)
        return _Ring(h=h, d=d, k=kc, g=gc, write_pos=write_pos, cache_base=cache_base, is_flush=is_flush, idx=idx,
                     L=L, T=T, buf=buf, C=C, dims=(B, H, HV, K0, V0, K, V), lengths=list(n))

    def _buffer_from(self, r: _Ring, key_dtype, dtype):
        """The u-cache KVBuffer of the ring after a commit: request b's write_pos[idx[b]] entries from its
        cache_base on (circular), G their cumulative gates, its checkpoint as the state (owned by all)."""

        B, H, HV, K0, V0, K, V = r.dims
        dev = r.h.device
        n = [int(r.write_pos[B - b]) for b in range(B)]
        base = [int(r.cache_base[B - b]) for b in range(B)]
        C = max([r.C] + n)
        nan = float("nan")
        k = torch.full((B, C, H, K0), nan, device=dev)
        u = torch.full((B, C, HV, V0), nan, device=dev)
        G = torch.full((B, C, HV), nan, device=dev)
        state = torch.empty(B, HV, K0, V0, device=dev)
        for b in range(B):
            s = B - b
            state[b] = r.h[s].transpose(-1, -2)[:, :K0, :V0]
            if n[b]:
                pos = (base[b] + torch.arange(n[b], device=dev)) % r.buf
                k[b, :n[b]] = r.k[s][:, pos, :K0].transpose(0, 1)
                u[b, :n[b]] = r.d[s][:, pos, :V0].transpose(0, 1).float()
                G[b, :n[b]] = r.g[s][:, pos].double().cumsum(-1).transpose(0, 1).float()
        return KVBuffer(k=k.to(key_dtype), u=u.to(dtype), G=G.to(dtype), state=state,
                        lengths=torch.tensor(n, dtype=torch.long, device=dev),
                        has_state=torch.ones(B, dtype=torch.bool, device=dev))

    def _verify(self, q, k, v, g, beta, buffer, num_drafts, scale):
        """One round's verify: ReplaySSM's speculative kernel over request b's first num_drafts[b] tokens
        (packed, vLLM's query_start_loc), both launches (verify, and the folding flush launch for the
        blocks whose is_flush is set).  Returns (o [B, D, HV, V], the ring after the kernel)."""

        B, D, H, K0 = q.shape
        HV, V0 = v.shape[2], v.shape[3]
        r = self._ring_from(buffer, D)
        K, V = r.dims[5], r.dims[6]
        assert tuple(buffer.k.shape[2:]) == (H, K0) and tuple(buffer.u.shape[2:]) == (HV, V0), \
            "ReplaySSM adapter: the tokens' heads and dims must be the buffer's"
        nd = [int(x) for x in num_drafts.tolist()]
        assert all(0 <= x <= D for x in nd), f"ReplaySSM adapter: num_drafts {nd} outside 0..{D}"
        dev = q.device
        qsl = torch.tensor([0] + list(itertools.accumulate(nd)), dtype=torch.int32, device=dev)
        rows = [(b, t) for b in range(B) for t in range(nd[b])]
        pick = lambda x: torch.stack([x[b, t] for b, t in rows]) if rows else x.new_zeros((0, *x.shape[2:]))  # noqa: E731
        qq, kk, vv = self._pad(pick(q), K), self._pad(pick(k), K), self._pad(pick(v), V)
        total = len(rows)
        mixed = torch.cat([qq.reshape(total, H * K), kk.reshape(total, H * K), vv.reshape(total, HV * V)],
                          -1).contiguous()
        A_log, dt_bias, a, b_ = raw_gates_in(_finite_gates(pick(g)), pick(beta).float(), self.raw_gate_dtype)
        out = torch.full((total, HV, V), float("nan"), device=dev)
        sc = K0 ** -0.5 if scale is None else float(scale)
        if total:
            self._k.gdn_replayssm_spec_decode(
                mixed, a.contiguous(), b_.contiguous(), A_log.contiguous(), dt_bias.contiguous(), r.h, r.d, r.k, r.g,
                out, qsl, r.idx, r.write_pos, r.cache_base, r.is_flush, max_cache_len=r.L, max_spec_len=r.T,
                scale=sc, use_qk_l2norm_in_kernel=False, null_block_id=0, launch_mode="both")
        o = torch.zeros(B, D, HV, V0, device=dev, dtype=torch.float32)
        for i, (b, t) in enumerate(rows):
            o[b, t] = out[i, :, :V0]
        return o.to(q.dtype), r

    def _commit(self, r: _Ring, counts) -> _Ring:
        """ReplaySSM's cursor kernel on a copy of the ring's cursors: request b keeps counts[b] entries of its
        window (num_accepted; the caches themselves are not touched)."""
        B = r.dims[0]
        cnt = torch.as_tensor(counts, device=r.h.device).to(torch.int32).reshape(B).contiguous()
        c2 = _Ring(**dict(r.__dict__, write_pos=r.write_pos.clone(), cache_base=r.cache_base.clone(),
                          is_flush=r.is_flush.clone()))
        self._k.commit_gdn_replayssm_spec(c2.write_pos, c2.cache_base, c2.is_flush, cnt, r.idx, max_cache_len=r.L,
                                          max_spec_len=r.T, cache_buf_len=r.buf, null_block_id=0)
        return c2

    def verify(self, q, k, v, *, g, beta, buffer, parents=None, num_drafts=None, scale=None):
        B, D = q.shape[:2]
        if num_drafts is None:
            num_drafts = torch.full((B,), D, dtype=torch.long)
        if parents is not None:
            nd = [int(x) for x in num_drafts.tolist()]
            par = parents.tolist()
            for b in range(B):
                if any(par[b][i] != i - 1 for i in range(nd[b])):
                    raise NotImplementedError(self.not_provided["verify_tree"] + f" (request {b}: parents {par[b]})")
        o, r = self._verify(q, k, v, g, beta, buffer, num_drafts, scale)
        r.num_drafts = [int(x) for x in num_drafts.tolist()]
        return o, r

    def accept(self, buffer, drafts, *, counts=None, nodes=None):
        assert isinstance(drafts, _Ring), "ReplaySSM adapter: accept takes the drafts its verify returned"
        assert [int(x) for x in buffer.lengths.tolist()] == drafts.lengths, \
            "ReplaySSM adapter: accept must get the buffer its verify got"
        if (counts is None) == (nodes is None):
            raise ValueError("accept: give exactly one of counts= or nodes=")
        arg = counts if counts is not None else nodes
        # a Python int stands for every request
        arg = [int(arg)] * buffer.batch if isinstance(arg, int) else [int(x) for x in arg.tolist()]
        cnt = arg if counts is not None else [n + 1 for n in arg]
        bad = [b for b, (c, n) in enumerate(zip(cnt, drafts.num_drafts)) if not 0 <= c <= n]
        if bad:
            raise ValueError(f"accept: counts {cnt} outside 0..num_drafts {drafts.num_drafts}")
        return self._buffer_from(self._commit(drafts, cnt), buffer.k.dtype, buffer.u.dtype)

    def buffered_decode(self, q, k, v, *, g, beta, buffer, scale=None):
        """One token per request: a speculative round of a one-token window, committed (ReplaySSM's decode in
        its speculative regime; a full buffer's round is a flush round)."""
        B = q.shape[0]
        assert q.shape[1] == 1, "buffered_decode: one token per request"
        ones = torch.ones(B, dtype=torch.long)
        o, r = self._verify(q, k, v, g, beta, buffer, ones, scale)
        return o, self._buffer_from(self._commit(r, ones), buffer.k.dtype, buffer.u.dtype)

    def flush(self, buffer, *, count=None):
        """The oracle's fold of the buffer (the ring's contents) in float64: ReplaySSM has no fold of its own
        outside a round (its flush launch folds the history as part of one)."""
        f64 = KVBuffer(**{n: (None if t is None else (t.double() if t.is_floating_point() else t))
                          for n, t in buffer.tensors().items()})
        out = ref.flush(f64, count=count)
        like = buffer.tensors()
        return KVBuffer(**{n: (None if t is None else (t.to(like[n].dtype) if like.get(n) is not None else t.float()))
                           for n, t in out.tensors().items()})


# ----------------------------------------------------------------------------- the kernels' model, in PyTorch
def _softplus(x, threshold=20.0):
    return torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)


def _em_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
               ssm_state_indices, write_pos, use_qk_l2norm_in_kernel=False, **_launch):
    """What ``fused_recurrent_gated_delta_rule_replayssm`` computes, as read from its source (float64): per
    decode row i, block s = ssm_state_indices[i] (<= 0: zero output), cursor p = write_pos[i] (per ROW); the
    state S = exp(G) h0 + sum_{c<p} exp(G - G_c) d_c k_c^T over the ring, then the delta-rule step; at
    p = L - 1 the new state is written to h0 (the fold), else d, k, g are appended at p."""
    assert not use_qk_l2norm_in_kernel, "emulation: the adapter normalises nothing in the kernel"
    slots, HV, V, K = initial_state.shape
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    L = d_cache.shape[2]
    for i in range(mixed_qkv.shape[0]):
        s = int(ssm_state_indices[i])
        if s <= 0:
            out[i] = 0
            continue
        p = int(write_pos[i])
        row = mixed_qkv[i].double()
        for hv in range(HV):
            h = hv // (HV // H)
            q = row[h * K:(h + 1) * K] * scale
            k = row[H * K + h * K:H * K + (h + 1) * K]
            v = row[2 * H * K + hv * V:2 * H * K + (hv + 1) * V]
            g = -torch.exp(A_log[hv].double()) * _softplus(a[i, hv].double() + dt_bias[hv].double())
            beta = torch.sigmoid(b[i, hv].double())
            G = g_cache[s, hv, :p].double()
            tot = G.sum()
            dec = torch.exp(tot - G.cumsum(0))
            M = torch.exp(tot) * initial_state[s, hv].double() + \
                (d_cache[s, hv, :p].double() * dec[:, None]).T @ k_cache[s, h, :p].double()  # [V, K]
            M = torch.exp(g) * M
            dcur = beta * (v - M @ k)
            M = M + torch.outer(dcur, k)
            out[i, hv] = (M @ q).to(out.dtype)
            if p == L - 1:
                initial_state[s, hv] = M.to(initial_state.dtype)
            else:
                d_cache[s, hv, p] = dcur.to(d_cache.dtype)
                g_cache[s, hv, p] = g.to(g_cache.dtype)
                if hv == h * (HV // H):
                    k_cache[s, h, p] = k.to(k_cache.dtype)
    return out, initial_state


def _em_spec(mixed_qkv, a, b, A_log, dt_bias, checkpoint_state, d_cache, k_cache, g_cache, out, query_start_loc,
             ssm_state_indices, write_pos, cache_base, is_flush, max_cache_len, max_spec_len, scale=None,
             use_qk_l2norm_in_kernel=True, null_block_id=0, launch_mode="both"):
    """What ``gdn_replayssm_spec_decode`` computes, as read from its source (float64): per request n, block
    s = ssm_state_indices[n] (<= null: zero outputs); cursors keyed by the BLOCK; history: the write_pos[s]
    entries at physical (cache_base[s] + c) & (buf - 1); its window: tokens query_start_loc[n]..[n + 1].
    Verify launch (is_flush[s] = 0): outputs from checkpoint + history.  Flush launch (is_flush[s] = 1): the
    history is folded into the checkpoint first (written back), outputs from it.  Both then write the
    window's d, k, g at physical (cache_base + write_pos + t) & (buf - 1), for write_pos + t < buf only."""
    assert not use_qk_l2norm_in_kernel, "emulation: the adapter normalises nothing in the kernel"
    assert launch_mode == "both"
    slots, HV, V, K = checkpoint_state.shape
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    buf = d_cache.shape[2]
    assert buf & (buf - 1) == 0, "circular cache requires power-of-two buffer"
    BS = max(4, next_pow2(max_spec_len))
    BC = max(16, next_pow2(max(1, max_cache_len - max_spec_len)))
    scale = K ** -0.5 if scale is None else scale
    for n in range(query_start_loc.shape[0] - 1):
        bos, eos = int(query_start_loc[n]), int(query_start_loc[n + 1])
        assert eos - bos <= BS, "emulation: a window past the kernel's BS"
        s = int(ssm_state_indices[n])
        if s <= null_block_id:
            out[bos:eos] = 0
            continue
        wp, base, flush = int(write_pos[s]), int(cache_base[s]), bool(int(is_flush[s]))
        hist = min(wp, BC)  # the kernel's history block: entries past it are not read
        pc = [(base + c) & (buf - 1) for c in range(hist)]
        for hv in range(HV):
            h = hv // (HV // H)
            G = g_cache[s, hv, pc].double()
            tot = G.sum()
            dec = torch.exp(tot - G.cumsum(0))
            M = torch.exp(tot) * checkpoint_state[s, hv].double() + \
                (d_cache[s, hv, pc].double() * dec[:, None]).T @ k_cache[s, h, pc].double()  # [V, K]
            if flush:
                checkpoint_state[s, hv] = M.to(checkpoint_state.dtype)
            for j, t in enumerate(range(bos, eos)):
                row = mixed_qkv[t].double()
                q = row[h * K:(h + 1) * K] * scale
                k = row[H * K + h * K:H * K + (h + 1) * K]
                v = row[2 * H * K + hv * V:2 * H * K + (hv + 1) * V]
                g = -torch.exp(A_log[hv].double()) * _softplus(a[t, hv].double() + dt_bias[hv].double())
                beta = torch.sigmoid(b[t, hv].double())
                M = torch.exp(g) * M
                dcur = beta * (v - M @ k)
                M = M + torch.outer(dcur, k)
                out[t, hv] = (M @ q).to(out.dtype)
                if wp + j < buf:
                    ps = (base + wp + j) & (buf - 1)
                    d_cache[s, hv, ps] = dcur.to(d_cache.dtype)
                    g_cache[s, hv, ps] = g.to(g_cache.dtype)
                    if hv == h * (HV // H):
                        k_cache[s, h, ps] = k.to(k_cache.dtype)
    return out


def _em_commit(write_pos, cache_base, is_flush, num_accepted, state_batch_indices, max_cache_len, max_spec_len,
               cache_buf_len=None, null_block_id=0):
    """What ``commit_gdn_replayssm_spec`` (``_advance_gdn_spec_cursors_kernel``) does, as read from its
    source: per row with block s > null, accepted a: after a flush round the history restarts at the
    window (cache_base += write_pos when a > 0; write_pos = a), else write_pos += a; then
    is_flush = write_pos + 2 max_spec_len > max_cache_len."""
    buf = next_pow2(max_cache_len) if cache_buf_len is None else cache_buf_len
    for r in range(state_batch_indices.shape[0]):
        s = int(state_batch_indices[r])
        if s <= null_block_id:
            continue
        a, wp, base, fl = int(num_accepted[r]), int(write_pos[s]), int(cache_base[s]), int(is_flush[s]) != 0
        if a > 0 and fl:
            cache_base[s] = (base + wp) & (buf - 1)
        write_pos[s] = a if fl else wp + a
        is_flush[s] = int(int(write_pos[s]) + 2 * max_spec_len > max_cache_len)


def _em_config(kernel, **shape):
    """ReplaySSM's GDN launch tuples as its replayssm_config.py returns them off Blackwell (the emulation's
    tiles constrain the adapter's padding the same way)."""
    if kernel in ("gdn_spec_verify", "gdn_spec_flush"):
        return (64, 1, 4 if shape["max_spec_len"] >= 6 else 2, 2)  # (block_v, num_warps, nk, num_stages)
    return (64, 1, 3, 2)  # gdn_decode: (block_v, num_warps, num_stages, nk)


def emulation(**replace):
    """A pure-PyTorch model of ReplaySSM's kernels (float64, from reading their source): the namespace
    ``ReplaySSM(kernels=...)`` takes.  The CPU tests validate the adapter through it against the oracle,
    so the GPU run only has to show that the kernels compute what the model computes.  ``replace``
    swaps one function (the tests' deliberately wrong variants)."""
    ns = dict(fused_recurrent_gated_delta_rule_replayssm=_em_decode, gdn_replayssm_spec_decode=_em_spec,
              commit_gdn_replayssm_spec=_em_commit, get_replayssm_config=_em_config, emulated=True,
              config_source="emulation")
    ns.update(replace)
    return types.SimpleNamespace(**ns)


#: Kept for callers of the decode-only adapter: the same class.
ReplaySSMDecode = ReplaySSM


def replayssm():
    """ReplaySSM's kernels from ``$KVBUFFER_PEER_PATH`` (``--peer-path``); AdapterError (a clear message,
    exit 2) when no checkout is given or it lacks the kernel files."""

    path = os.environ.get(PEER_ENV)
    if not path:
        raise AdapterError("--impl replayssm: give the ReplaySSM checkout with --peer-path <checkout> (or "
                           f"${PEER_ENV}); its kernels are loaded from there, never copied here "
                           "(github.com/Johnny-Liou/ReplaySSM)")
    impl = describe(ReplaySSM(path))
    if impl.interpreted and os.environ.get("KVBUFFER_PEER_INTERPRET", "0") in ("", "0"):
        # measured with triton 3.9: the interpreter rejects the kernels' masks (InterpreterError: ValueError('mask
        # has unsupported dtype')); KVBUFFER_PEER_INTERPRET=1 tries anyway
        impl.unavailable = ("ReplaySSM's kernels do not run under the Triton interpreter (triton 3.9: "
                            "'mask has unsupported dtype'); run them with --device cuda (KVBUFFER_PEER_INTERPRET=1 "
                            "tries the interpreter anyway)")
    return impl
