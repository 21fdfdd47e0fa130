"""Verification of draft tokens (chains and trees) from the stale state plus the buffer, and acceptance.

No state is formed per draft: every draft's output comes from S0, the buffered entries and
the draft's own ancestors, and what ``accept`` appends are the innovations ``verify`` already
computed (they are exact, because u_i depends only on the tokens on i's path).
"""

from __future__ import annotations

from typing import Optional

import torch

from .buffer import Drafts, KVBuffer
from .core import ancestors, cumulative_gates, innovations, outputs
from .checks import (check_accept_fold, check_buffer, check_count_arg, check_counts, check_fold, check_gate_values,
                     check_nodes, check_num_drafts, check_parents, require_float, require_no_fold, require_rank,
                     require_tensor)
from .decode import flush
from .entries import Entries, append, entries_of, memory_of, stale_state, tail_gate
from .inputs import prepare_tokens

__all__ = ["verify", "accept", "path_to"]


def verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    buffer: KVBuffer,
    parents: Optional[torch.Tensor] = None,
    num_drafts: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    fold=False,
):
    """Outputs for D draft tokens per request, all at once; nothing is committed.

    q, k: [B, D, H, K]; v: [B, D, HV, V]; g: [B, D, HV]*; beta: [B, D, HV].
    parents: [B, D] int, parent of each draft (-1 = the buffer's tail), each before its child;
    default the chain -1, 0, ..., D-2.  num_drafts: [B] int, drafts per request (default D);
    rows past it are padding, their outputs are 0.
    Returns o: [B, D, HV, V] and the ``Drafts`` that ``accept`` takes.

    ``fold``: False (default), True, or a bool tensor [B] (the requests that fold).  A folding request's
    buffered entries (committed history, not drafts) are folded into its state as well, whatever
    ``accept`` decides later: the call is ``flush`` of those requests' whole buffers followed by this
    verify on the flushed buffer, and returns ``(o, drafts, buffer)`` with the new buffer (lengths 0
    where folded; state storage allocated if the buffer had none).  o equals fold=False's (the same
    math), and Drafts.G is relative to the new buffer's (empty) tail.  The given buffer is not modified.
    """
    if fold is not False:
        check_buffer(buffer)
        fold = check_fold(fold, buffer.batch, buffer.k.device)
        count = None if fold is True else torch.where(fold, buffer.lengths, 0)
        buffer = flush(buffer, count=count)
        o, drafts = verify(q, k, v, g=g, beta=beta, buffer=buffer, parents=parents, num_drafts=num_drafts,
                           scale=scale)
        return o, drafts, buffer
    x = prepare_tokens(q, k, v, g, beta, scale, check_values=False)
    d = x.dims
    check_buffer(buffer, d, q.device)
    parents = check_parents(parents, d.B, d.T, q.device)
    num_drafts = check_num_drafts(num_drafts, d.B, d.T, q.device)
    check_gate_values(g, beta, valid=torch.arange(d.T, device=q.device)[None, :] < num_drafts[:, None])
    dt = x.v.dtype
    o = torch.zeros(d.B, d.T, d.HV, d.V, dtype=dt, device=q.device)
    u_all = torch.zeros_like(o)
    G_all = torch.zeros_like(x.g)
    for b in range(d.B):
        t = int(num_drafts[b])
        if t == 0:
            continue
        S0 = stale_state(buffer, b, dt)
        old = entries_of(buffer, b, dt)
        mem = memory_of(old, S0, d.HV)
        par = parents[b, :t]
        G = cumulative_gates(x.g[b, :t], par, tail_gate(old, x.g[b, 0]))
        anc = ancestors(par)
        u = innovations(x.k[b, :t], x.v[b, :t], x.beta[b, :t], G, anc, S0, mem)
        o[b, :t] = outputs(x.q[b, :t], x.k[b, :t], u, G, anc, S0, mem)
        u_all[b, :t], G_all[b, :t] = u, G
    if buffer.form == "u":
        drafts = Drafts(parents=parents, num_drafts=num_drafts, k=x.k_heads.clone(), u=u_all, G=G_all)
    else:
        drafts = Drafts(parents=parents, num_drafts=num_drafts, k=x.k_heads.clone(),
                        v=x.v.clone(), g=x.g.clone(), beta=x.beta.clone())
    return o.to(x.out_dtype), drafts


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Draft indices from the root down to ``node`` (empty for node -1). parents: [D], each in -1..i-1."""
    if isinstance(parents, (list, tuple)):
        parents = torch.tensor(parents, dtype=torch.long)
    require_tensor("parents", parents)
    require_rank("parents", parents, 1, "[D]")
    D = parents.shape[0]
    check_parents(parents[None], 1, D, parents.device)
    if isinstance(node, torch.Tensor) and node.dim() == 0:
        node = node[None]
    node = int(check_count_arg("node", node, 1, parents.device, f"-1..{D - 1}")[0])
    if not -1 <= node < D:
        raise ValueError(f"node: {node} is out of range, expected -1 (none) or a draft index in 0..{D - 1}")
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def _check_drafts(buffer: KVBuffer, drafts: Drafts) -> None:
    if not isinstance(drafts, Drafts):
        raise TypeError(f"drafts: expected the Drafts returned by verify, got {type(drafts).__name__}")
    if drafts.form != buffer.form:
        raise ValueError(f"drafts: computed for a {drafts.form!r}-form buffer, but buffer is {buffer.form!r}-form")
    for name in ("k",) + Drafts.form_fields(drafts.form):
        require_float(f"drafts.{name}", require_tensor(f"drafts.{name}", getattr(drafts, name)))
    require_rank("drafts.k", drafts.k, 4, "[B, D, H, K]")
    if drafts.k.shape[0] != buffer.batch or drafts.k.shape[2:] != buffer.k.shape[2:]:
        raise ValueError(f"drafts: keys of shape {list(drafts.k.shape)} do not fit the buffer's "
                         f"[B, C, H, K] = {list(buffer.k.shape)}")
    B, D = drafts.k.shape[:2]
    check_parents(drafts.parents, B, D, drafts.k.device, name="drafts.parents")
    check_num_drafts(drafts.num_drafts, B, D, drafts.k.device, name="drafts.num_drafts")


def accept(
    buffer: KVBuffer,
    drafts: Drafts,
    *,
    counts=None,
    nodes=None,
    fold: bool = True,
) -> KVBuffer:
    """Commit accepted drafts: append their cached entries (no recomputation); return a new buffer.

    Give exactly one of ``counts`` ([B] int or int: the first m drafts of a chain, 0..num_drafts)
    or ``nodes`` ([B] int or int: the accepted node, -1 for none; its root-to-node path is
    appended).  ``buffer`` must be the one ``verify`` saw.  When the entries would pass the
    capacity C, the old entries (and, for m > C, the oldest accepted ones) are folded into the
    state first and the rest stays buffered; that needs state storage (``buffer.state`` not None).
    ``fold=False`` is the caller's word that no request's n + m passes C (as after a ``verify(fold=...)``
    that emptied the buffers that could): ValueError, naming the request, where one does.  The result
    is the same; ``kvbuffer_fast.accept`` then makes no fold launch.
    """
    check_buffer(buffer)
    _check_drafts(buffer, drafts)
    if (counts is None) == (nodes is None):
        raise ValueError("accept: give exactly one of counts= (chain drafts) or nodes= (tree drafts)")
    if counts is not None:
        nodes = check_counts(counts, drafts.num_drafts, drafts.is_chain) - 1
    else:
        nodes = check_nodes(nodes, drafts.num_drafts)
    check_accept_fold(fold)
    dt = buffer.values.dtype
    fields = buffer.cloned()
    for b in range(buffer.batch):
        path = path_to(drafts.parents[b], int(nodes[b]))
        if not fold:
            require_no_fold(f"request {b}", int(buffer.lengths[b]), len(path), buffer.capacity)
        if not path:
            continue
        new = Entries(**drafts.slot(b, torch.tensor(path, dtype=torch.long, device=drafts.k.device)))
        append(fields, buffer, b, entries_of(buffer, b, dt), new, stale_state(buffer, b, dt))
    return KVBuffer(**fields)
