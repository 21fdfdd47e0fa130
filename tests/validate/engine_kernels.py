"""A plain-PyTorch "engine kernel" in vLLM's fused sigmoid-gating decode convention, and realistic wrong
variants of it, for the tests of ``kvbuffer_ref.validate.engine``.

Convention (vLLM's ``fused_sigmoid_gating_delta_rule_update`` for decode): q, k [1, N, H, K], v [1, N, HV, V]
(varlen: one token per sequence, ``cu_seqlens``), raw gating (A_log, dt_bias [HV]; a, b [1, N, HV]),
q and k L2-normalised in the kernel (in float32, whatever the input dtype), the state pool [slots, HV, V, K] float32 addressed by
``ssm_state_indices`` with -1 for a padded row, updated in place.
"""

import torch

from kvbuffer_ref.validate.engine import engine_adapter


def sigmoid_gating_decode(A_log, a, b, dt_bias, q, k, v, *, scale, initial_state, cu_seqlens, ssm_state_indices,
                          threshold=20.0, bug=None, _cache={}):
    N, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    assert cu_seqlens.tolist() == list(range(N + 1)), "decode: one token per sequence"
    idx = ssm_state_indices.long()
    rows = torch.arange(N) if bug == "pads" else torch.nonzero(idx >= 0).flatten()  # bug: pads not skipped
    o = torch.zeros(1, N, HV, V, dtype=v.dtype)
    if rows.numel() == 0:
        return o
    slot = idx[rows]
    x = a[0, rows].float() + dt_bias.float()
    if bug == "softplus":  # the threshold branch returns the threshold, not x
        sp = torch.where(x <= threshold, torch.log1p(torch.exp(x)), torch.full_like(x, threshold))
    else:
        sp = torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)
    g = -torch.exp(A_log.float()) * sp  # [R, HV]
    beta = torch.sigmoid(b[0, rows].float())
    rep = HV // H
    qq = q[0, rows].float().repeat_interleave(rep, dim=1)  # [R, HV, K]
    kk = k[0, rows].float().repeat_interleave(rep, dim=1)
    if bug != "no-norm":  # bug: the rows taken as they come, as if the caller had normalised them
        eps = 1e-3 if bug == "eps" else 1e-6  # bug: an epsilon that shrinks every row by about 5e-4
        qq = qq * torch.rsqrt((qq * qq).sum(-1, keepdim=True) + eps)
        kk = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + eps)
    qq = qq * scale
    if bug == "slot-reuse":  # keeps the last state it wrote per slot, and trusts it when the slot comes again
        h = torch.stack([_cache[int(s)] if int(s) in _cache else initial_state[s].float() for s in slot])
    else:
        h = initial_state[slot].float()  # [R, HV, V, K]
    if bug == "transposed":  # reads and writes the pool as [K, V]
        h = h.transpose(-1, -2).reshape(h.shape)
    h = h * torch.exp(g)[..., None, None]
    vv = (v[0, rows].float() - torch.einsum("rhvk,rhk->rhv", h, kk)) * beta[..., None]
    h = h + vv[..., None] * kk[:, :, None, :]
    o[0, rows] = torch.einsum("rhvk,rhk->rhv", h, qq).to(v.dtype)
    if bug == "transposed":
        h = h.reshape(h.shape[0], HV, K, V).transpose(-1, -2)
    initial_state[slot] = h.to(initial_state.dtype)
    if bug == "slot-reuse":
        for s, hs in zip(slot.tolist(), h):
            _cache[s] = hs.clone()
    return o


def make(bug=None, name="engine-decode"):
    """The adapter a kernel author writes: under 20 lines (docs/validate-your-kernel.md shows it)."""
    cache = {}

    def step(*, q, k, v, A_log, dt_bias, a, b, state, slots, cu_seqlens, scale):
        return sigmoid_gating_decode(A_log, a, b, dt_bias, q, k, v, scale=scale, initial_state=state,
                                     cu_seqlens=cu_seqlens, ssm_state_indices=slots, bug=bug, _cache=cache)

    return engine_adapter(step, name=name, gating="raw", qk_l2norm=True, state_layout="VK", pool=True,
                          pad_slot=-1, varlen=True)


correct = make(name="engine-decode")
wrong_pads = make("pads", "engine-decode-pads")
transposed = make("transposed", "engine-decode-transposed")
softplus = make("softplus", "engine-decode-softplus")
slot_reuse = make("slot-reuse", "engine-decode-slot-reuse")
wrong_eps = make("eps", "engine-decode-eps")
no_norm = make("no-norm", "engine-decode-no-norm")
