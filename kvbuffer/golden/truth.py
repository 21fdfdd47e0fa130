"""The expected outputs of a golden case: the oracle's recurrence over each request's token history.

Every expected tensor comes from ``recurrent_gated_delta_rule`` (the float64 truth), never from the
buffered forms it is meant to check.  A buffered case is replayed per request as its history: the
stale state, the buffered entries, then the operation's tokens, one oracle step (T = 1) per token;
where the buffer folds (the rules of ``kvbuffer_ref.entries.fold_count``), the stale state becomes
the oracle's state after the folded tokens.  A u-cache entry holds each token's innovation
``u = beta (v - (exp(g) S)^T k)`` from the state S before it (docs/math.md, section 1): the
recurrence computes it but does not return it, so ``_step`` evaluates that one line beside the
oracle's step; every other expected value is the oracle's own output.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.entries import fold_count
from kvbuffer_ref.recurrent import recurrent_gated_delta_rule
from kvbuffer_ref.speculative import path_to
from .files import BUFFER_OPS, OPS

__all__ = ["truth", "derive_buffer", "torch_arrays"]

_TOKEN = ("q", "k", "v", "g", "beta")


def torch_arrays(arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """numpy arrays -> torch; floating ones cast to ``dtype`` (so a float32 run rounds its inputs once)."""
    out = {}
    for n, a in arrays.items():
        x = torch.from_numpy(np.array(a))
        out[n] = x.to(dtype) if x.dtype.is_floating_point else x
    return out


def _step(S: Optional[torch.Tensor], tok: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token through the oracle from state S [HV, K, V] (None = 0): (o [HV, V], S after, u [HV, V]).

    tok: q, k [H, K]; v [HV, V]; g [HV]*; beta [HV].  u is the token's innovation (what a u-cache stores).
    """
    one = {n: tok[n][None, None] for n in _TOKEN}
    o, S1 = recurrent_gated_delta_rule(one["q"], one["k"], one["v"], g=one["g"], beta=one["beta"], scale=scale,
                                       initial_state=None if S is None else S[None], output_final_state=True)
    HV = tok["v"].shape[0]
    k = tok["k"].to(S1.dtype).repeat_interleave(HV // tok["k"].shape[0], dim=0)  # [HV, K]
    g = tok["g"].to(S1.dtype)
    decay = g.exp()[..., None] if g.dim() == 2 else g.exp()[:, None, None]
    S_dec = torch.zeros_like(S1[0]) if S is None else decay * S.to(S1.dtype)
    u = tok["beta"].to(S1.dtype)[:, None] * (tok["v"].to(S1.dtype) - torch.einsum("hk,hkv->hv", k, S_dec))
    return o[0, 0], S1[0], u


class _History:
    """One request: its stale state (None = direct mode, S0 = 0), the entries committed since (each a
    token with its u and the state after it) and its current state."""

    def __init__(self, stale: Optional[torch.Tensor], scale: float):
        self.stale = stale
        self.current = stale
        self.scale = scale
        self.entries: list[dict] = []

    def commit(self, tok: dict) -> torch.Tensor:
        """Append one token; returns its output."""
        o, S, u = _step(self.current, tok, self.scale)
        self.entries.append(dict(tok, u=u, S_after=S))
        self.current = S
        return o

    def fold(self, m: int) -> None:
        """Fold the first m entries: the stale state becomes the state after them."""
        if m > 0:
            self.stale = self.entries[m - 1]["S_after"]
            self.entries = self.entries[m:]


def _tok(t: dict, b: int, i: int) -> dict:
    """Token i of request b: q, k [H, K]; v [HV, V]; g [HV]*; beta [HV]."""
    return {n: t[n][b, i] for n in _TOKEN}


def _from_buffer(t: dict, scale: float) -> list[_History]:
    """Each request's history from the buffer input: its stale state, then its raw entries replayed."""
    reqs = []
    for b in range(t["buffer_lengths"].shape[0]):
        owns = "buffer_state" in t and bool(t["buffer_has_state"][b])
        r = _History(t["buffer_state"][b] if owns else None, scale)
        for i in range(int(t["buffer_lengths"][b])):
            key = t["buffer_k"][b, i]  # the buffered tokens' outputs are not used: q = k
            r.commit({"q": key, "k": key, "v": t["buffer_v"][b, i], "g": t["buffer_g"][b, i],
                      "beta": t["buffer_beta"][b, i]})
        reqs.append(r)
    return reqs


def _export(reqs: list[_History], like: dict, capacity: int, prefix: str) -> dict[str, torch.Tensor]:
    """The buffer in both forms (NaN in unused slots) and the current state of every request."""
    B = len(reqs)
    H, K = like["k"].shape[-2:]
    HV, V = like["v"].shape[-2:]
    dims = dict(batch=B, num_heads=H, num_value_heads=HV, head_k_dim=K, head_v_dim=V, capacity=capacity,
                channel_gate=like["g"].dim() == 4, dtype=like["v"].dtype)
    out = KVBuffer.empty(**dims, form="u").tensors()
    out.update({f: x for f, x in KVBuffer.empty(**dims, form="raw").tensors().items() if x is not None})
    for f in KVBuffer.slot_fields():
        out[f].fill_(float("nan"))
    current = torch.zeros_like(out["state"])
    for b, r in enumerate(reqs):
        n = len(r.entries)
        assert n <= capacity, f"request {b}: {n} entries exceed the capacity {capacity}"
        out["lengths"][b] = n
        if r.stale is not None:
            out["state"][b] = r.stale
            out["has_state"][b] = True
        if r.current is not None:
            current[b] = r.current
        if n:
            g = torch.stack([e["g"] for e in r.entries])
            for f in KVBuffer.slot_fields():
                out[f][b, :n] = g.cumsum(dim=0) if f == "G" else torch.stack([e[f] for e in r.entries])
    res = {f"{prefix}buffer_{f}": x for f, x in out.items()}
    res[f"{prefix}state"] = current
    return res


def derive_buffer(inputs: dict[str, np.ndarray], params: dict) -> dict[str, np.ndarray]:
    """The u-cache fields ``buffer_u``, ``buffer_G`` (float64, NaN in unused slots) of a buffer given in
    raw form (``buffer_k, buffer_v, buffer_g, buffer_beta, buffer_lengths, buffer_has_state``, optional
    ``buffer_state``): each entry's u is the recurrence's own innovation for that token."""
    t = torch_arrays(inputs, torch.float64)
    like = {"k": t["buffer_k"], "v": t["buffer_v"], "g": t["buffer_g"]}
    out = _export(_from_buffer(t, float(params["scale"])), like, int(params["capacity"]), "")
    return {f"buffer_{f}": out[f"buffer_{f}"].numpy() for f in KVBuffer.form_fields("u")}


def _sequence(op: str, t: dict, scale: float) -> dict[str, torch.Tensor]:
    """recurrent, chunk, direct: one oracle call over the whole batch."""
    h0 = t.get("initial_state") if op != "direct" else None
    o, S = recurrent_gated_delta_rule(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], scale=scale,
                                      initial_state=h0, output_final_state=True)
    return {"expected_o": o} if op == "direct" else {"expected_o": o, "expected_final_state": S}


def _prefill(t: dict, params: dict, scale: float) -> tuple[torch.Tensor, list[_History]]:
    """The prompt committed token by token; its head (all but the tail) folded."""
    B, T = t["q"].shape[:2]
    h0 = t.get("initial_state")
    reqs = [_History(None if h0 is None else h0[b], scale) for b in range(B)]
    o = torch.stack([torch.stack([r.commit(_tok(t, b, i)) for i in range(T)]) for b, r in enumerate(reqs)])
    for r in reqs:
        r.fold(T - int(params["tail_resolved"]))
    return o, reqs


def _decode(t: dict, reqs: list[_History], C: int) -> torch.Tensor:
    """One token per step and request; a full buffer folds before the token is appended."""
    o = torch.zeros_like(t["v"])
    for j in range(t["v"].shape[1]):
        for b, r in enumerate(reqs):
            r.fold(fold_count(len(r.entries), 1, C))
            o[b, j] = r.commit(_tok(t, b, j))
    return o


def _verify(op: str, t: dict, reqs: list[_History], C: int) -> torch.Tensor:
    """Every draft from its parent's state (parents precede children); then the accepted path committed."""
    o = torch.zeros_like(t["v"])
    parents = t["parents"]
    for b, r in enumerate(reqs):
        after: list[torch.Tensor] = []
        for i in range(int(t["num_drafts"][b])):
            p = int(parents[b, i])
            o[b, i], S, _ = _step(r.current if p < 0 else after[p], _tok(t, b, i), r.scale)
            after.append(S)
        node = int(t["counts"][b]) - 1 if op == "verify_chain" else int(t["nodes"][b])
        path = path_to(parents[b], node)
        n_old = len(r.entries)
        for i in path:
            r.commit(_tok(t, b, i))
        r.fold(fold_count(n_old, len(path), C))
    return o


def truth(op: str, params: dict, inputs: dict[str, np.ndarray], dtype: torch.dtype = torch.float64
          ) -> dict[str, torch.Tensor]:
    """Expected outputs of a case from the recurrent oracle over its token history, in ``dtype``.

    At float64 these are the stored ``expected_*`` tensors; at a narrower dtype they are the baseline
    of the tolerance rule (the plain recurrence in that dtype on the same, rounded, inputs).
    """
    if op not in OPS:
        raise ValueError(f"op: unknown operation {op!r}, expected one of {OPS}")
    t = torch_arrays(inputs, dtype)
    scale = float(params["scale"])
    if op in ("recurrent", "chunk", "direct"):
        return _sequence(op, t, scale)
    if op == "prefill":
        o, reqs = _prefill(t, params, scale)
        return {"expected_o": o} | _export(reqs, {"k": t["q"], "v": t["v"], "g": t["g"]}, int(params["capacity"]),
                                           "expected_")
    assert op in BUFFER_OPS
    C = int(params["capacity"])
    reqs = _from_buffer(t, scale)
    like = {"k": t["buffer_k"], "v": t["buffer_v"], "g": t["buffer_g"]}
    if op == "flush":
        for b, r in enumerate(reqs):
            r.fold(int(t["count"][b]) if "count" in t else len(r.entries))
        return _export(reqs, like, C, "expected_")
    o = _decode(t, reqs, C) if op == "decode" else _verify(op, t, reqs, C)
    return {"expected_o": o} | _export(reqs, like, C, "expected_")
