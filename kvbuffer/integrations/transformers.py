"""HF transformers' Qwen3-Next, Qwen3.5 (dense and MoE) and Kimi Linear with their linear-attention
recurrence served by KVBuffer through a serving pool (docs/models.md).

What is served: the *core recurrence* of every linear-attention layer, i.e. the call the layer makes to
its gated-delta (Qwen) or KDA (Kimi) function once the model has formed q, k, v, g and beta.  Everything
else stays the model's own code, run unchanged: the projections, the short convolution and its conv
state (carried by the model's own cache class), the gating ``g = -exp(A_log) * softplus(a + dt_bias)``
(Kimi: per channel) and ``beta = sigmoid(b)``, the q/k L2 norm (the model module's own ``l2norm``, which
the model asks its core function to apply), the grouped heads, the gated RMS norm, the output
projection, the full-attention layers and their KV cache, the MoE blocks.

How: while a ``KVBufferRunner`` runs a forward, each linear-attention module's ``forward`` is wrapped
(instance attribute, removed afterwards) so that the runner knows which layer calls, and the model
module's two core names (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``, Kimi:
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``) are pointed at the runner for the
duration of that forward only.  The core call then goes to the pool:

* a prompt (the first forward of a request) -> ``pool.admit`` (the prefill hand-off), one call per
  distinct prompt length (left padding stripped: the pool holds each request's own tokens only);
* each generated token -> ``pool.decode``;
* draft tokens (a chain, or a tree given by ``parents``) -> ``pool.verify``; then ``accept`` commits the
  accepted path in every layer (``pool.accept(nodes=...)``) and trims the model's cache (conv states,
  full-attention KV) to the same path.

For a tree of drafts the model's short convolution must see each node's own ancestors, not the flattened
order: during a tree verify the model module's ``causal_conv1d_fn`` is pointed at a wrapper that gathers
each node's window along its path and calls the model's own function on it.  The full-attention layers
get per-node positions and, for a tree, the model's own mask for a chain of as many tokens with the
drafts' block replaced by the tree (``_tree_mask``: the form the attention implementation takes; the
model's forward takes a mask per layer type); where there is no such dense mask, the tree's first path
is verified as a chain.

The model's cache gets a zero-size placeholder as its "recurrent state": the state lives in the pool.
One pool per model holds all its linear layers: pool layer i is the model's i-th linear-attention layer.
``pool_cls`` is ``kvbuffer_ref.KVPool`` (CPU, any dtype) or ``kvbuffer_fast.pool.KVPool`` (GPU; float32
states); both take the same arguments.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from kvbuffer_ref.pool import KVPool
from kvbuffer_ref.recurrent import recurrent_gated_delta_rule

__all__ = ["FAMILIES", "Family", "family_of", "tiny_config", "build_model", "KVBufferRunner", "model_own_path",
           "greedy_reference", "oracle_logits", "prompt_lookup_chain", "prompt_lookup_tree", "SpecStats",
           "TRANSFORMERS_RANGE", "torch_function_behind"]


# transformers versions served: [lowest, first unsupported), the ``hf`` extra's range: no wider than the releases
# the tests have passed with (docs/models.md lists them; scripts/check_newest.sh tries the newest).  The
# integration reads the model code's conventions that changed inside it (the cache argument's name, where
# q/k are repeated to the value heads, the mask the attention takes).
TRANSFORMERS_RANGE = ("5.17.0", "5.26")


def _transformers():
    """The transformers module, once its version is checked against ``TRANSFORMERS_RANGE``."""
    import transformers
    from packaging.version import Version

    lo, hi = TRANSFORMERS_RANGE
    if not Version(lo) <= Version(transformers.__version__) < Version(hi):
        raise ImportError(f"kvbuffer.integrations.transformers: transformers {transformers.__version__} is not "
                          f"supported; it needs transformers>={lo},<{hi} (the hf extra: pip install -e '.[hf]')")
    return transformers


# ------------------------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """Where a model family keeps its linear-attention layer and core functions, and its pool heads."""

    model_type: str
    module: str               # the modeling module
    layer_class: str          # the linear-attention nn.Module
    chunk_name: str           # the core functions the layer calls
    recurrent_name: str
    channel_gate: bool        # KDA: per-channel gates [B, T, HV, K]
    causal_lm: str            # the ForCausalLM class
    config: str               # the (text) config class

    def heads(self, config) -> tuple[int, int, int, int]:
        """(H, HV, K, V): q/k heads, value heads, key and value head dims of the linear layers."""
        if self.channel_gate:
            return config.linear_num_heads, config.linear_num_heads, config.linear_head_dim, config.linear_head_dim
        return (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                config.linear_value_head_dim)

    def modeling(self):
        _transformers()
        return importlib.import_module(self.module)


_GDN = dict(chunk_name="torch_chunk_gated_delta_rule", recurrent_name="torch_recurrent_gated_delta_rule",
            channel_gate=False)
FAMILIES: dict[str, Family] = {
    "qwen3_next": Family("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next",
                         "Qwen3NextGatedDeltaNet", causal_lm="Qwen3NextForCausalLM", config="Qwen3NextConfig", **_GDN),
    "qwen3_5": Family("qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet",
                      causal_lm="Qwen3_5ForCausalLM", config="Qwen3_5TextConfig", **_GDN),
    "qwen3_5_moe": Family("qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                          "Qwen3_5MoeGatedDeltaNet", causal_lm="Qwen3_5MoeForCausalLM",
                          config="Qwen3_5MoeTextConfig", **_GDN),
    "kimi_linear": Family("kimi_linear", "transformers.models.kimi_linear.modeling_kimi_linear",
                          "KimiLinearDeltaAttention", chunk_name="chunk_kimi_delta_attention",
                          recurrent_name="recurrent_kimi_delta_attention", channel_gate=True,
                          causal_lm="KimiLinearForCausalLM", config="KimiLinearConfig"),
}
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def family_of(model) -> Family:
    t = model.config.model_type
    t = _TEXT_TYPES.get(t, t)
    if t not in FAMILIES:
        raise ValueError(f"model: model_type {t!r} is not served; expected one of {sorted(FAMILIES)}")
    return FAMILIES[t]


def tiny_config(model_type: str, *, vocab_size: int = 256, layers: int = 4):
    """A small config of ``model_type`` (random weights are fine for equality tests): hidden 64, ``layers``
    layers whose last is full attention (the models' own 3:1 pattern for 4 layers), grouped linear heads
    (Qwen: 2 q/k heads, 4 value heads of 16), small MoE blocks where the family has them."""
    fam = FAMILIES[model_type]
    cls = getattr(_transformers(), fam.config)
    types = ["linear_attention"] * (layers - 1) + ["full_attention"]
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=types, max_position_embeddings=4096, pad_token_id=0,
                  eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    if fam.channel_gate:  # MLA: its expanded keys have one head per attention head
        common["num_key_value_heads"] = common["num_attention_heads"]
        return cls(**common, intermediate_size=128, moe_intermediate_size=32, num_local_experts=4,
                   num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=None,
                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_head_dim=16, linear_num_heads=4,
                   linear_conv_kernel_dim=4, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    lin = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
    if model_type == "qwen3_next":
        return cls(**common, **lin, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1)
    if model_type == "qwen3_5_moe":
        return cls(**common, **lin, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32)
    return cls(**common, **lin, intermediate_size=128)


def build_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, checkpoint: Optional[str] = None,
                device=None, attn_implementation: str = "sdpa", **config_kw):
    """A causal LM of ``model_type``: from ``checkpoint`` (a local directory, ``from_pretrained`` with
    ``local_files_only``) or from ``tiny_config`` with random weights drawn under ``seed``; eval mode,
    ``attn_implementation`` (default SDPA), ``dtype`` on ``device``."""
    transformers = _transformers()

    if checkpoint is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=dtype,
                                                                  attn_implementation=attn_implementation)
    else:
        cfg = tiny_config(model_type, **config_kw)
        cfg._attn_implementation = attn_implementation
        cfg._experts_implementation = "eager"  # the per-expert loop: also runs in float64 (grouped_mm does not)
        torch.manual_seed(seed)
        model = getattr(transformers, FAMILIES[model_type].causal_lm)(cfg)
    model = model.to(dtype=dtype, device=device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# --------------------------------------------------------------------------- patching, scoped to a call
@contextlib.contextmanager
def _patched(module, **names):
    """Point ``module``'s globals ``names`` at new objects for the block's duration."""
    old = {n: getattr(module, n) for n in names}
    try:
        for n, fn in names.items():
            setattr(module, n, fn)
        yield
    finally:
        for n, fn in old.items():
            setattr(module, n, fn)


def torch_function_behind(obj, name: str):
    """The plain torch function ``name`` under transformers' kernel-dispatch wrapper (which picks fla where
    installed): ``obj`` itself, a functools.wraps wrapper of it (``__wrapped__``), or, where the ``kernels``
    package is installed (a dependency from transformers 5.25 on), an ``nn.Module`` whose ``forward``
    closes over such a wrapper."""
    forward = getattr(type(obj), "forward", None)
    if forward is not None and not callable(getattr(obj, "__wrapped__", None)):
        inner = [c.cell_contents for c in (forward.__closure__ or ()) if callable(c.cell_contents)
                 and getattr(inspect.unwrap(c.cell_contents), "__name__", None) == name]
        if len(inner) == 1:
            obj = inner[0]
    return inspect.unwrap(obj)


@contextlib.contextmanager
def model_own_path(model):
    """Run ``model``'s linear layers through the model module's own torch fallbacks (the functions the
    module defines), whatever kernel package transformers would otherwise dispatch to (fla's Triton
    kernels need a GPU).  Without such a package this changes nothing."""
    fam = family_of(model)
    m = fam.modeling()
    names = {n: torch_function_behind(getattr(m, n), n) for n in (fam.chunk_name, fam.recurrent_name, "causal_conv1d_fn",
                                                        "causal_conv1d_update")}
    with _patched(m, **names):
        yield


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0 at each row's first real token (pads: 1), as generate forms them."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


@torch.no_grad()
def greedy_reference(model, input_ids, attention_mask, max_new_tokens: int):
    """transformers' own greedy generation (``model.generate``, the module's torch fallbacks): (tokens
    [B, N], logits [B, N, vocab] float64 of the step that chose each token)."""
    with model_own_path(model):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, num_beams=1, output_logits=True,
                             return_dict_in_generate=True, use_cache=True)
    n = input_ids.shape[1]
    return out.sequences[:, n:], torch.stack(out.logits, dim=1).double()


# --------------------------------------------------------------------------------------------- runner
@dataclass
class SpecStats:
    """What a speculative run did: verify calls, drafts proposed and accepted, tokens emitted."""

    verifies: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    bytes_per_request: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted / self.verifies if self.verifies else 0.0


class KVBufferRunner:
    """A causal LM of a served family whose linear layers' recurrence runs in one ``pool_cls`` pool.

    capacity C, ``max_requests`` (buffer slots; also state slots: each request holds at most one per
    layer), ``max_drafts`` (verify's draft room: the root token plus the drafts), ``dtype`` of the pool
    (default the model's; float32 or float64), ``device`` (default the model's).  The pool is
    ``self.pool``; ``self.layers`` the linear modules in pool-layer order.
    """

    def __init__(self, model, *, capacity: int, pool_cls=KVPool, dtype: Optional[torch.dtype] = None,
                 device=None, max_requests: int = 8, max_drafts: int = 16, chunk_size: int = 64,
                 oracle: bool = False):
        self.model, self.family = model, family_of(model)
        self.oracle = oracle  # the truth: the float64 recurrence with explicit states instead of the pool
        self._states: dict = {}
        self.modeling = self.family.modeling()
        cls = getattr(self.modeling, self.family.layer_class)
        self.layers = sorted((m for m in model.modules() if isinstance(m, cls)), key=lambda m: m.layer_idx)
        if not self.layers:
            raise ValueError(f"model: no {self.family.layer_class} layers found")
        p = next(model.parameters())
        self.dtype = dtype or p.dtype
        self.device = torch.device(device) if device is not None else p.device
        H, HV, K, V = self.family.heads(model.config)
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.capacity, self.chunk_size = capacity, chunk_size
        self.pool = pool_cls(layers=len(self.layers), num_state_slots=max_requests, num_buffer_slots=max_requests,
                             capacity=capacity, max_drafts=max_drafts, num_heads=H, num_value_heads=HV, head_k_dim=K,
                             head_v_dim=V, channel_gate=self.family.channel_gate, dtype=self.dtype, device=self.device)
        self._qk_checked = False  # the layer's repeat of q/k to the value heads checked (_qk_heads)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._mode: Optional[str] = None  # admit / decode / verify, for the forward in progress
        self._layer: Optional[int] = None
        self._slots: Optional[torch.Tensor] = None
        self._lengths: Optional[list] = None   # admit: each row's prompt length (its left pads stripped)
        self._parents: Optional[torch.Tensor] = None  # verify: [B, D'] tree (None: chain)

    # ---------------------------------------------------------------- the served core
    def _core(self, query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **_):
        """Stands in for the model's core function: same arguments, (o, placeholder state) back."""
        dt = self.dtype
        q, k, v, g, beta = (x.to(dt) for x in (query, key, value, g, beta))
        group = self.HV // self.H
        if group > 1 and q.shape[2] == self.HV:  # q and k repeated to the value heads by the caller
            q, k = self._qk_heads(q, group), self._qk_heads(k, group)
        if use_qk_l2norm_in_kernel:  # the model module's own L2 norm, as its core function applies it
            q, k = self.modeling.l2norm(q, dim=-1, eps=1e-6), self.modeling.l2norm(k, dim=-1, eps=1e-6)
        x = dict(g=g, beta=beta, layer=self._layer, scale=self.K ** -0.5)
        if self.oracle:  # pads are exact no-ops of the recurrence (zero k and v from a zero state)
            o, self._states[self._layer] = recurrent_gated_delta_rule(
                q, k, v, g=g, beta=beta, scale=self.K ** -0.5, initial_state=self._states.get(self._layer),
                output_final_state=True)
        elif self._mode == "admit":
            T = q.shape[1]
            o = torch.zeros(*v.shape, dtype=dt, device=v.device)
            for n in sorted(set(self._lengths)):  # one admit per distinct prompt length
                rows = torch.tensor([i for i, m in enumerate(self._lengths) if m == n], device=v.device)
                sl = lambda t: t[rows, T - n:]  # noqa: E731
                o[rows, T - n:] = self.pool.admit(sl(q), sl(k), sl(v), g=sl(g), beta=sl(beta), layer=self._layer,
                                                  slots=self._slots[rows.to(self._slots.device)],
                                                  scale=x["scale"], chunk_size=self.chunk_size).to(dt)
        elif self._mode == "decode":
            o = self.pool.decode(q, k, v, slots=self._slots, **x)
        elif self._mode == "verify":
            o = self.pool.verify(q, k, v, slots=self._slots, parents=self._parents, **x)
        else:
            raise RuntimeError(f"no KVBuffer step in progress (mode {self._mode!r})")
        return o.to(query.dtype), query.new_zeros(query.shape[0], 0)

    def _qk_heads(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """q or k [B, T, HV, K] that the model's layer repeated to the value heads (transformers before 5.23
        does, later ones repeat inside the core function) back to its H heads: value head i reads head
        i // group, so each group of ``group`` equal heads gives one.  The first such call checks that the
        heads are repeated that way (exactly equal within each group)."""
        heads = x[:, :, ::group].contiguous()
        if not self._qk_checked:
            if not torch.equal(heads.repeat_interleave(group, dim=2), x):
                raise ValueError(f"model: its q/k come with {self.HV} heads, not grouped as value head i reads "
                                 f"q/k head i // {group}; KVBuffer serves that grouping only")
            self._qk_checked = True
        return heads

    def _tree_conv(self, original):
        """The model's causal_conv1d_fn applied to each tree node's window along its root-to-node path."""

        def conv(hidden_states, weight, bias=None, activation=None, **kw):
            x = hidden_states  # [B, channels, hist + D']: the conv state followed by the drafts
            parents = self._parents
            Dn = parents.shape[1]
            width = weight.shape[-1]
            hist = x.shape[-1] - Dn
            idx = torch.empty(Dn, width, dtype=torch.long)
            for i in range(Dn):
                path, node = [], i
                while node >= 0 and len(path) < width:
                    path.append(hist + node)
                    node = int(parents[0, node])
                back = hist - 1
                while len(path) < width:
                    path.append(back)
                    back -= 1
                idx[i] = torch.tensor(path[::-1])
            valid = (idx >= 0).to(x.device)
            win = x[:, :, idx.clamp(min=0).to(x.device)] * valid.to(x.dtype)  # [B, ch, D', width]
            B, ch = x.shape[:2]
            win = win.permute(0, 2, 1, 3).reshape(B * Dn, ch, width)
            out = original(win, weight, bias, activation=activation, **kw)[..., -1]  # [B * D', ch]
            return out.reshape(B, Dn, ch).transpose(1, 2)

        return conv

    @contextlib.contextmanager
    def _step(self, mode: str, slots=None, lengths=None, parents=None):
        """One forward with the core served in ``mode``; the patches live for this block only."""
        self._mode, self._slots, self._lengths, self._parents = mode, slots, lengths, parents
        names = {self.family.chunk_name: self._core, self.family.recurrent_name: self._core}
        if parents is not None:
            names["causal_conv1d_fn"] = self._tree_conv(torch_function_behind(self.modeling.causal_conv1d_fn,
                                                                                   "causal_conv1d_fn"))
        for n in ("causal_conv1d_fn", "causal_conv1d_update"):  # the model's own torch convolution
            names.setdefault(n, torch_function_behind(getattr(self.modeling, n), n))
        wrapped = []
        for i, layer in enumerate(self.layers):
            fwd = layer.forward

            def forward(*a, _i=i, _fwd=fwd, **kw):
                self._layer = _i
                return _fwd(*a, **kw)

            layer.forward = forward
            wrapped.append(layer)
        try:
            with _patched(self.modeling, **names):
                yield
        finally:
            for layer in wrapped:
                del layer.forward  # back to the class's forward
            self._mode = self._layer = self._slots = self._lengths = self._parents = None

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        """The model's forward with ``cache`` under the name its signature gives it (``cache``, or
        ``past_key_values`` before transformers 5.24)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **{self._cache_kw: cache})

    def _tree_mask(self, cache, parents: Sequence[int], past: int) -> Optional[torch.Tensor]:
        """The full-attention layers' mask for verifying the tree ``parents`` after ``past`` cached tokens:
        the model's own causal mask for a chain of as many tokens (built by the modeling module's
        ``create_causal_mask``, so its shape, dtype and device are what the model's attention takes: bool
        under SDPA, additive float under eager), with the drafts' block replaced by the tree's ancestor
        relation (each node sees the past, its ancestors and itself).  None where that builder gives no
        dense [B, 1, q, kv] mask (e.g. flash or flex attention)."""
        n = len(parents)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = parents[j]
        emb = self.model.get_input_embeddings().weight
        embeds = emb.new_zeros(1, n, emb.shape[-1])
        dev = emb.device
        chain = self.modeling.create_causal_mask(self.model.config, embeds,
                                                 torch.ones(1, past + n, dtype=torch.long, device=dev), cache,
                                                 torch.arange(past, past + n, device=dev)[None],
                                                 allow_is_causal_skip=False)
        if not isinstance(chain, torch.Tensor) or chain.dim() != 4 or tuple(chain.shape[-2:]) != (n, past + n):
            return None
        mask = chain.clone(memory_format=torch.contiguous_format)
        anc = anc.to(mask.device)
        if mask.dtype == torch.bool:
            mask[..., past:] = anc
        else:
            mask[..., past:] = torch.zeros(n, n, dtype=mask.dtype, device=mask.device).masked_fill(
                ~anc, torch.finfo(mask.dtype).min)
        return mask

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    # ---------------------------------------------------------------- greedy generation
    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens: int, choose: Optional[Callable] = None,
                 progress: Optional[Callable] = None):
        """Greedy generation through KVBuffer of a left-padded batch: (tokens [B, N], logits [B, N, vocab]
        float64).  ``choose(step, logits [B, vocab]) -> [B] tokens`` replaces argmax (the tests use it to
        continue from the reference's token at a genuine tie); ``progress(tokens done)`` after each step."""
        B = input_ids.shape[0]
        mask = attention_mask.to(input_ids.device)
        lengths = mask.sum(-1).tolist()
        slots = self.pool.acquire(B)
        cache = self.new_cache()
        pos = _positions(mask)
        self._states = {}
        toks, logits = [], []
        try:
            with self._step("admit", slots=slots, lengths=lengths):
                out = self._forward(input_ids, mask, pos, cache)
            for step in range(max_new_tokens):
                last = out.logits[:, -1].double()
                nxt = last.argmax(-1) if choose is None else choose(step, last)
                toks.append(nxt)
                logits.append(last)
                if progress is not None:
                    progress(step + 1)
                if step == max_new_tokens - 1:
                    break
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                pos = pos[:, -1:] + 1
                with self._step("decode", slots=slots):
                    out = self._forward(nxt[:, None], mask, pos, cache)
        finally:
            self.pool.release(slots)
        return torch.stack(toks, 1), torch.stack(logits, 1)

    # ---------------------------------------------------------------- speculative decoding
    def bytes_held(self, slots: torch.Tensor) -> list:
        """What each request of ``slots`` holds in the pool, over all layers, in bytes: ``state`` (its state
        slots, taken at its first fold), ``buffer`` (its buffer slot's C entries) and ``drafts`` (its draft
        room), as dicts."""
        t = self.pool.tensors()
        size = lambda names: sum(t[n][0, 0].numel() * t[n].element_size() for n in names)  # noqa: E731
        per_state, per_buf, per_draft = size(["state"]), size(["k", "u", "G"]), size(["dk", "du", "dG"])
        out = []
        for b in slots.tolist():
            held = sum(int(t["state_slot"][layer, b]) >= 0 for layer in range(self.pool.layers))
            out.append(dict(state=held * per_state, buffer=self.pool.layers * per_buf,
                            drafts=self.pool.layers * per_draft))
        return out

    @torch.no_grad()
    def speculative_generate(self, input_ids: torch.Tensor, max_new_tokens: int, drafter: Callable,
                             stats: Optional[SpecStats] = None, progress: Optional[Callable] = None) -> torch.Tensor:
        """Greedy generation of one request (input_ids [1, T]) with drafts: ``drafter(history list) ->
        (tokens, parents)`` proposes draft tokens following the last token (parents[i] = -1 for a child of
        the last token, else an earlier draft's index).  Each round verifies [last token] + drafts through
        ``pool.verify``, accepts the longest path whose tokens equal the model's greedy choices
        (``pool.accept(nodes=...)`` and the model's cache trimmed to the path) and emits the path plus the
        model's next token; ``progress(tokens done)`` after each round.  Returns the N generated tokens [1, N]."""
        stats = stats if stats is not None else SpecStats()
        slots = self.pool.acquire(1)
        cache = self.new_cache()
        T = input_ids.shape[1]
        hist = input_ids[0].tolist()
        dev = input_ids.device
        try:
            with self._step("admit", slots=slots, lengths=[T]):
                out = self._forward(input_ids, torch.ones_like(input_ids), torch.arange(T, device=dev)[None], cache)
            _record_past(cache)  # conv states keep the verified tokens until trimmed to the path
            nxt = int(out.logits[0, -1].argmax())
            gen = [nxt]
            while len(gen) < max_new_tokens:
                hist_all = hist + gen
                d_tok, d_par = drafter(hist_all)
                room = min(self.pool.max_drafts - 1, max_new_tokens - len(gen))
                keep = [i for i in range(len(d_tok)) if i < room]
                d_tok, d_par = [d_tok[i] for i in keep], [d_par[i] for i in keep]
                toks = [nxt] + list(d_tok)
                parents = [-1] + [p + 1 for p in d_par]  # node 0: the last token, a child of the buffer's tail
                past = len(hist_all) - 1
                mask = None
                if any(parents[i] != i - 1 for i in range(len(parents))):  # a tree
                    mask = self._tree_mask(cache, parents, past)
                    if mask is None:  # the attention implementation takes no dense mask: the tree's first path
                        path = _first_path(parents)
                        toks, parents = [toks[i] for i in path], list(range(-1, len(path) - 1))
                n = len(toks)
                depth = [0] * n
                for i in range(1, n):
                    depth[i] = depth[parents[i]] + 1
                ids = torch.tensor([toks], device=dev)
                pos = torch.tensor([[past + d for d in depth]], device=dev)
                if mask is None:  # a chain: the model's own causal mask
                    with self._step("verify", slots=slots):
                        out = self._forward(ids, torch.ones(1, past + n, dtype=torch.long, device=dev), pos, cache)
                else:
                    par = torch.tensor([parents], dtype=torch.long, device=self.device)
                    with self._step("verify", slots=slots, parents=par):
                        out = self._forward(ids, {"full_attention": mask, "linear_attention": None}, pos, cache)
                choice = out.logits[0].argmax(-1).tolist()
                node, path = 0, [0]
                while True:  # the longest path whose every token is the model's greedy choice
                    kids = [i for i in range(1, n) if parents[i] == node and toks[i] == choice[node]]
                    if not kids:
                        break
                    node = kids[0]
                    path.append(node)
                self.pool.accept(slots=slots, nodes=torch.tensor([node], device=self.device))  # every layer
                _keep_path(cache, n, path)
                stats.verifies += 1
                stats.proposed += n - 1
                stats.accepted += len(path) - 1
                new = [toks[i] for i in path[1:]] + [choice[node]]
                stats.emitted += len(new)
                gen.extend(new)
                nxt = gen[-1]
                if progress is not None:
                    progress(min(len(gen), max_new_tokens))
            stats.bytes_per_request.extend(self.bytes_held(slots))
        finally:
            self.pool.release(slots)
        return torch.tensor([gen[:max_new_tokens]], device=dev)


def _record_past(cache) -> None:
    """Make the model's cache keep the conv states of the tokens a verify adds, so ``_keep_path`` can trim
    them to the accepted path.  The recurrent state lives in the pool, so the model's cache keeps no
    intermediate recurrent states: transformers 5.25 reads ``recurrent_states_to_keep`` in the linear
    layers' forward and takes ``min`` of it and the token count, so it must be 0, not its default None."""
    layers = [layer for layer in cache.layers if hasattr(layer, "activate_past_recording")]
    takes_count = any("recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters
                      for layer in layers)
    cache.activate_past_recording(**({"recurrent_states_to_keep": 0} if takes_count else {}))


def _first_path(parents: Sequence[int]) -> list:
    """The nodes of a tree's first root-to-leaf path (each node's first child, from node 0)."""
    path = [0]
    while True:
        kids = [i for i in range(len(parents)) if parents[i] == path[-1]]
        if not kids:
            return path
        path.append(kids[0])


def _keep_path(cache, n_new: int, path: Sequence[int]) -> None:
    """Keep, of the last forward's ``n_new`` tokens, only ``path`` in the model's cache: the conv states
    (recorded past) and the full-attention keys / values (sequence axis -2)."""
    idx = list(path)
    for layer in cache.layers:
        cs = getattr(layer, "conv_states", None)
        if cs:
            for i, x in cs.items():
                if x is None:
                    continue
                kept = torch.cat([x[..., :-n_new], x[..., -n_new:][..., idx]], dim=-1)
                cs[i] = kept[..., -layer.conv_kernel_size[i]:]
        for name in ("keys", "values"):
            x = getattr(layer, name, None)
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] >= n_new:
                setattr(layer, name, torch.cat([x[..., :-n_new, :], x[..., -n_new:, :][..., idx, :]], dim=-2))


@torch.no_grad()
def oracle_logits(model, input_ids, attention_mask, tokens) -> torch.Tensor:
    """The float64 truth of a greedy run: a float64 copy of ``model`` whose linear layers' recurrence is
    ``kvbuffer_ref.recurrent_gated_delta_rule`` in float64 with its state carried from call to call
    (everything else the model's own code), run on the same schedule as ``KVBufferRunner.generate`` (the
    padded prompt, then one token per step) and teacher-forced with ``tokens`` [B, N].  The same schedule
    matters: some models' own code computes in float32 (Kimi's MoE router), and a float32 product can
    round differently when the number of rows differs.  Returns the logits [B, N, vocab] float64 of the
    steps that chose ``tokens``."""
    m64 = copy.deepcopy(model).double()
    m64.config._experts_implementation = "eager"  # grouped_mm takes no float64
    runner = KVBufferRunner(m64, capacity=1, dtype=torch.float64, max_requests=input_ids.shape[0], oracle=True)
    tokens = tokens.to(input_ids.device)
    return runner.generate(input_ids, attention_mask, tokens.shape[1], choose=lambda step, _: tokens[:, step])[1]


# ------------------------------------------------------------------------------------------- drafters
def _continuations(history: Sequence[int], max_ngram: int, length: int) -> list:
    """Prompt lookup: for the longest n-gram (n = max_ngram..1) ending ``history`` that occurred before, the
    continuations of its earlier occurrences, most recent first (distinct, each up to ``length`` tokens)."""
    h = list(history)
    for n in range(min(max_ngram, len(h) - 1), 0, -1):
        tail = h[-n:]
        found, seen = [], set()
        for s in range(len(h) - n - 1, -1, -1):
            if h[s:s + n] == tail:
                cont = tuple(h[s + n:s + n + length])
                if cont and cont not in seen:
                    seen.add(cont)
                    found.append(list(cont))
        if found:
            return found
    return []


def prompt_lookup_chain(max_ngram: int = 3, length: int = 4) -> Callable:
    """A drafter needing no second model: the continuation of the most recent earlier occurrence of the
    history's last n-gram, as a chain of up to ``length`` tokens."""

    def draft(history):
        c = _continuations(history, max_ngram, length)
        if not c:
            return [], []
        return c[0], list(range(-1, len(c[0]) - 1))

    return draft


def prompt_lookup_tree(max_ngram: int = 3, length: int = 4, branches: int = 3) -> Callable:
    """The tree of the top ``branches`` prompt-lookup continuations (most recent first), merged as a trie:
    shared prefixes are one node.  Returns (tokens, parents) in topological order."""

    def draft(history):
        toks, parents, child = [], [], {}
        for cont in _continuations(history, max_ngram, length)[:branches]:
            node = -1
            for t in cont:
                key = (node, t)
                if key not in child:
                    child[key] = len(toks)
                    toks.append(t)
                    parents.append(node)
                node = child[key]
        return toks, parents

    return draft
