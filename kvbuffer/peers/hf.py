"""HF transformers' pure-PyTorch gated-delta-rule and KDA functions behind the adapter protocol (``--impl hf``).

transformers ships, in each linear-attention model's modeling module, the torch functions its layers run
when no kernel package serves the inputs' device: ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule`` (Qwen3-Next; Qwen3.5, Qwen3.5-MoE, OLMo-hybrid and others carry
copies whose code is the same), and Kimi Linear's ``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention`` (KDA, per-channel gates).  transformers wraps each in a dispatcher
that calls fla's Triton kernel instead where fla is installed and the inputs are on a GPU; the adapter
calls the torch function under that wrapper (``integrations.transformers.torch_function_behind``), so
``--impl hf`` validates transformers' own code on every device, never fla's.

transformers is imported when the adapter is built (the ``hf`` extra's range, ``TRANSFORMERS_RANGE``).

How each call is mapped (the layouts are the oracle's: q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV]
or [B, T, HV, K], beta [B, T, HV], states [B, HV, K, V]):

* scalar gates -> the Qwen3-Next functions, every argument by keyword, ``use_qk_l2norm_in_kernel=False``
  (the caller normalises, as our convention says); grouped value heads are theirs (they repeat q and k
  to the value heads, head i using q/k head i // (HV // H)).
* per-channel gates -> the Kimi Linear functions, which take one head count: q and k are repeated to the
  value heads here (``repeat_interleave``, exact copies), as Kimi Linear's layer has H = HV.
* ``scale``: the functions have no scale argument (they multiply q by K ** -0.5 in float32).  For another
  scale s, q is passed in float32 multiplied by s * sqrt(K) (one float32 rounding of q) and the output
  cast back to the input dtype, which is what the functions do to their own float32 output.
* chunk size: 64, the functions' default and what the layers pass.
* the state comes back in float32 whatever the input dtype (the functions compute in float32).
* not provided: varlen (the torch path raises ``ValueError`` for ``cu_seqlens``: it cannot keep packed
  sequences apart), the decode step (``recurrent_decode``: the recurrent function at T = 1 with the state
  copied back, as the layer calls it, is mapped), the buffer operations.
"""

from __future__ import annotations

import math

import torch

from ..validate.adapters import AdapterError, describe

__all__ = ["HFAdapter", "hf", "load_functions"]

#: The modeling modules whose torch functions are called: (module, chunk name, recurrent name).
GDN_MODULE = ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule",
              "torch_recurrent_gated_delta_rule")
KDA_MODULE = ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention",
              "recurrent_kimi_delta_attention")


def load_functions():
    """(version, {"gdn_chunk", "gdn_recurrent", "kda_chunk", "kda_recurrent"}: the plain torch functions).
    AdapterError naming the package and the supported range when transformers is missing or outside it."""
    import importlib

    from ..integrations import transformers as integ

    lo, hi = integ.TRANSFORMERS_RANGE
    try:
        tf = integ._transformers()
        fns = {}
        for kind, (mod_name, chunk, rec) in (("gdn", GDN_MODULE), ("kda", KDA_MODULE)):
            mod = importlib.import_module(mod_name)
            fns[f"{kind}_chunk"] = integ.torch_function_behind(getattr(mod, chunk), chunk)
            fns[f"{kind}_recurrent"] = integ.torch_function_behind(getattr(mod, rec), rec)
    except (ImportError, AttributeError) as e:
        raise AdapterError(f"--impl hf needs HF transformers>={lo},<{hi} (pip install 'kvbuffer[hf]'): "
                           f"{type(e).__name__}: {e}") from None
    for name, fn in fns.items():
        if not getattr(fn, "__module__", "").startswith("transformers."):
            raise AdapterError(f"--impl hf: {name} resolved to {fn!r}, not transformers' torch function")
    return tf.__version__, fns


class HFAdapter:
    """transformers' torch gated-delta-rule (Qwen3-Next) and KDA (Kimi Linear) functions (module docstring)."""

    forms = ("u",)
    channel_gate = True
    contract = "ieee"  # float32 torch arithmetic (CPU; on CUDA, float32 matmuls unless TF32 is enabled globally)

    def __init__(self, version: str, fns: dict):
        self._f = fns
        self.version = version
        self.name = f"transformers {version} torch"
        self.interpreted = False
        self.dtypes = (torch.float32, torch.float16, torch.bfloat16)
        self.not_provided = {
            "direct_gated_delta_rule": "transformers has no stateless (direct) form",
            "buffered_decode": "transformers has no buffered decode (the layer reads and writes the state every step)",
            "flush": "transformers has no buffer", "materialize_state": "transformers has no buffer",
            "verify": "transformers has no speculative verification",
            "accept": "transformers has no speculative verification",
            "prefill": "transformers has no buffer hand-off",
        }

    # recurrent_varlen / chunk_varlen: not declared (no cu_seqlens on the torch path)
    varlen = ()

    def _args(self, q, k, v, g, scale):
        K = q.shape[-1]
        HV = v.shape[2]
        if scale is not None and scale != K ** -0.5:
            q = q.float() * (scale * math.sqrt(K))
        if q.shape[2] != HV:  # the functions take one head count: the layers repeat q and k before the call
            rep = HV // q.shape[2]
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return q, k

    def recurrent_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False):
        dtype = v.dtype
        q, k = self._args(q, k, v, g, scale)
        if g.dim() == 4:
            o, S = self._f["kda_recurrent"](q, k, v, g, beta, initial_state, output_final_state,
                                            use_qk_l2norm_in_kernel=False)
        else:
            o, S = self._f["gdn_recurrent"](query=q, key=k, value=v, g=g, beta=beta, initial_state=initial_state,
                                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=False)
        return o.to(dtype), S

    def recurrent_decode(self, q, k, v, *, g, beta, state, scale=None):
        """One decode step as the layer takes it: the recurrent function at T = 1, the state in, its final
        state copied back in place."""
        o, new = self.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
                                                 output_final_state=True)
        state.copy_(new)
        return o

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=False,
                               chunk_size=64):
        dtype = v.dtype
        q, k = self._args(q, k, v, g, scale)
        fn = self._f["kda_chunk" if g.dim() == 4 else "gdn_chunk"]
        o, S = fn(query=q, key=k, value=v, g=g, beta=beta, chunk_size=64, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=False)
        return o.to(dtype), S


def hf():
    """``--impl hf``: transformers' torch GDN / KDA functions (recurrent, recurrent_decode, chunk)."""
    version, fns = load_functions()
    return describe(HFAdapter(version, fns))
