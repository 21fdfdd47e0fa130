"""A plain-PyTorch "engine kernel" in vLLM's fused sigmoid-gating decode convention, and realistic wrong
variants of it, for the tests of ``kvbuffer.peers.engine``.

Convention (vLLM's ``fused_sigmoid_gating_delta_rule_update`` for decode): q, k [1, N, H, K], v [1, N, HV, V]
(varlen: one token per sequence, ``cu_seqlens``), raw gating (A_log, dt_bias [HV]; a, b [1, N, HV]),
q and k L2-normalised in the kernel (in float32, whatever the input dtype), the state pool [slots, HV, V, K] float32 addressed by
``ssm_state_indices`` with -1 for a padded row, updated in place.
"""

import torch

from kvbuffer.peers.engine import engine_adapter


def sigmoid_gating_decode(A_log, a, b, dt_bias, q, k, v, *, scale, initial_state, cu_seqlens, ssm_state_indices,
                          threshold=20.0, bug=None, null_slot=-1, _cache={}):
    N, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    assert cu_seqlens.tolist() == list(range(N + 1)), "decode: one token per sequence"
    if bug == "int64-as-int32" and ssm_state_indices.dtype == torch.int64:  # int64 indices read as int32 words
        idx = ssm_state_indices.view(torch.int32)[:N].long()
    else:
        idx = ssm_state_indices.long()
    pad = torch.zeros_like(idx, dtype=torch.bool) if bug == "pads" else (idx < 0) | (idx == null_slot)
    if bug == "null-block":  # bug: pads tested as slot < 0 though the engine pads with the null block (slot 0)
        pad = idx < 0
    if bug == "zero-is-pad":  # bug: slot 0 taken for the null block though the engine pads with -1
        pad = idx <= 0
    rows = torch.nonzero(~pad).flatten()  # bug "pads": pads not skipped
    if bug == "last-row-dropped":  # bug: the grid covers N - 1 rows
        rows = rows[rows < N - 1]
    if bug == "block-tail":  # bug: rows in blocks of 2, the grid N // 2 blocks: an odd batch loses its last row
        rows = rows[rows < (N // 2) * 2]
    o = torch.zeros(1, N, HV, V, dtype=v.dtype)
    if rows.numel() == 0:
        return o
    slot = idx[rows]
    x = a[0, rows].float() + dt_bias.float()
    if bug == "dt-bias-half":  # bug: the second half of the heads take softplus(a) without dt_bias
        x[:, HV // 2:] = a[0, rows, HV // 2:].float()
    if bug == "softplus":  # the threshold branch returns the threshold, not x
        sp = torch.where(x <= threshold, torch.log1p(torch.exp(x)), torch.full_like(x, threshold))
    else:
        sp = torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)
    g = -(A_log.float() if bug == "A_log-as-A" else torch.exp(A_log.float())) * sp  # [R, HV]
    beta = torch.sigmoid(b[0, rows].float())
    if bug == "beta-twice":
        beta = torch.sigmoid(beta)
    rep = HV // H
    if bug == "gqa-mod":  # bug: value head hv reads q/k head hv % H instead of hv // (HV / H)
        qq = q[0, rows].float()[:, torch.arange(HV) % H]
        kk = k[0, rows].float()[:, torch.arange(HV) % H]
    else:
        qq = q[0, rows].float().repeat_interleave(rep, dim=1)  # [R, HV, K]
        kk = k[0, rows].float().repeat_interleave(rep, dim=1)
    if bug != "no-norm":  # bug: the rows taken as they come, as if the caller had normalised them
        eps = 1e-3 if bug == "eps" else 1e-6  # bug: an epsilon that shrinks every row by about 5e-4
        if bug == "eps-outside":  # bug: x / (sqrt(sum x^2) + eps)
            qq = qq / (qq.norm(dim=-1, keepdim=True) + eps)
            kk = kk / (kk.norm(dim=-1, keepdim=True) + eps)
        else:
            qq = qq * torch.rsqrt((qq * qq).sum(-1, keepdim=True) + eps)
            if bug != "k-unnormalised":  # bug: the norm applied to q only
                kk = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + eps)
    if bug == "mutates-q":  # bug: q normalised into the caller's tensor
        q[0, rows] = qq[:, ::rep].to(q.dtype)
    if bug == "scale-twice":
        qq = qq * scale
    if bug == "default-scale":  # bug: the scale passed ignored, K ** -0.5 used
        scale = K ** -0.5
    if bug != "no-scale":
        qq = qq * scale
    if bug == "slot-reuse":  # keeps the last state it wrote per slot, and trusts it when the slot comes again
        h = torch.stack([_cache[int(s)] if int(s) in _cache else initial_state[s].float() for s in slot])
    else:
        h = initial_state[slot].float()  # [R, HV, V, K]
    if bug == "bf16-read":  # bug: the fp32 state read through a bf16 load
        h = h.bfloat16().float()
    if bug == "transposed":  # reads and writes the pool as [K, V]
        h = h.transpose(-1, -2).reshape(h.shape)
    if bug != "gate-after":
        h = h * torch.exp(g)[..., None, None]
    vv = (v[0, rows].float() - torch.einsum("rhvk,rhk->rhv", h, kk)) * beta[..., None]
    h = h + vv[..., None] * kk[:, :, None, :]
    if bug == "gate-after":  # bug: the decay applied after the update
        h = h * torch.exp(g)[..., None, None]
    o[0, rows] = torch.einsum("rhvk,rhk->rhv", h, qq).to(v.dtype)
    if bug == "transposed":
        h = h.reshape(h.shape[0], HV, K, V).transpose(-1, -2)
    if bug == "state-in-io-dtype":  # bug: the new state rounded through the input dtype before it is stored
        h = h.to(v.dtype).float()
    if bug == "state-on-copy":  # bug: the update written into a copy of the pool
        initial_state = initial_state.clone()
    if bug == "first-n-1-written":  # bug: the state written back for all but the last request
        slot, h = slot[:-1], h[:-1]
    initial_state[slot] = h.to(initial_state.dtype)
    if bug == "slot-reuse":
        for s, hs in zip(slot.tolist(), h):
            _cache[s] = hs.clone()
    return o


def make(bug=None, name="engine-decode", **convention):
    """The adapter a kernel author writes: under 20 lines (docs/validate-your-kernel.md shows it)."""
    cache = {}
    conv = dict(gating="raw", qk_l2norm=True, state_layout="VK", pool=True, pad_slot=-1, varlen=True)
    conv.update(convention)
    null_slot = conv["pad_slot"]

    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, cu_seqlens, scale):
        return sigmoid_gating_decode(A_log, a, b, dt_bias, q, k, v, scale=scale, initial_state=state,
                                     cu_seqlens=cu_seqlens, ssm_state_indices=slots, bug=bug, null_slot=null_slot,
                                     _cache=cache)

    return engine_adapter(step, name=name, **conv)


correct = make(name="engine-decode")
wrong_pads = make("pads", "engine-decode-pads")
transposed = make("transposed", "engine-decode-transposed")
softplus = make("softplus", "engine-decode-softplus")
slot_reuse = make("slot-reuse", "engine-decode-slot-reuse")
wrong_eps = make("eps", "engine-decode-eps")
no_norm = make("no-norm", "engine-decode-no-norm")

# vLLM's convention: pads carry the null block, slot 0; slots given as int64
NULL_BLOCK = dict(pad_slot=0, reserved_slots=(0,))
correct_null_block = make(name="engine-decode-null-block", **NULL_BLOCK)
correct_int64 = make(name="engine-decode-int64", index_dtype=torch.int64)
NEW_BUGS = {"null_block": ("null-block", NULL_BLOCK), "last_row_dropped": ("last-row-dropped", {}),
            "block_tail": ("block-tail", {}), "first_n_1_written": ("first-n-1-written", {}),
            "dt_bias_half": ("dt-bias-half", {}), "A_log_as_A": ("A_log-as-A", {}), "beta_twice": ("beta-twice", {}),
            "gqa_mod": ("gqa-mod", {}), "eps_outside": ("eps-outside", {}), "k_unnormalised": ("k-unnormalised", {}),
            "mutates_q": ("mutates-q", {}), "scale_twice": ("scale-twice", {}), "no_scale": ("no-scale", {}),
            "default_scale": ("default-scale", {}), "bf16_read": ("bf16-read", {}), "gate_after": ("gate-after", {}),
            "state_on_copy": ("state-on-copy", {}), "zero_is_pad": ("zero-is-pad", {}),
            "state_in_io_dtype": ("state-in-io-dtype", {}), "int64_as_int32": ("int64-as-int32", {"index_dtype": torch.int64})}
for _n, (_bug, _conv) in NEW_BUGS.items():
    globals()[_n] = make(_bug, "engine-decode-" + _bug, **_conv)
