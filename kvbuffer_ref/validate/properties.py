"""The oracle's properties (docs/testing.md) as plain functions over any implementation.

An *implementation* is any object (a module, a namespace) with some of the attributes
``recurrent_gated_delta_rule``, ``chunk_gated_delta_rule``, ``direct_gated_delta_rule``,
``buffered_decode``, ``flush``, ``verify``, ``accept``, ``prefill``, following the conventions of
docs/conventions.md.  Each ``check_*`` runs one property on one ``Case`` and returns the list of
``Comparison`` verdicts (output by output, against the float64 recurrent truth, with the plain
recurrence in the compute dtype as the baseline).  pytest (tests/property) and ``kvbuffer
validate`` both call these.

Token layout of a case with a buffer: tokens ``0..P-1`` are the history (folded / buffered by the
float64 oracle's prefill, each request with its own buffer length), then the tokens the operation
under test consumes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import kvbuffer_ref as ref
from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.speculative import path_to

from .cases import Case, upcast_inputs
from .tolerances import Comparison, compare

__all__ = [
    "buffer_to",
    "stack_buffers",
    "ragged_buffer",
    "truth_and_baseline",
    "check_recurrent",
    "check_chunk",
    "check_direct",
    "check_decode",
    "check_verify_accept",
    "check_prefill",
    "poison_unused",
    "poison_unused_",
    "owned_state",
    "check_materialize",
]


# ----------------------------------------------------------------------------- helpers
def _sl(x: dict, sl) -> dict:
    return {n: t[:, sl] for n, t in x.items()}


def _row(x: dict, b: int) -> dict:
    return {n: t[b : b + 1] for n, t in x.items()}


def buffer_to(buffer: KVBuffer, *, dtype: torch.dtype, device="cpu", key_dtype: Optional[torch.dtype] = None,
              state_dtype: Optional[torch.dtype] = None) -> KVBuffer:
    """A copy of ``buffer`` on ``device`` with u/v/G/g/beta in ``dtype``, keys in ``key_dtype`` and
    the state in ``state_dtype`` (defaults: ``dtype``; the state at least float32)."""
    key_dtype = key_dtype or dtype
    state_dtype = state_dtype or torch.promote_types(dtype, torch.float32)

    def cv(name, x):
        if x is None:
            return None
        if not x.dtype.is_floating_point:  # lengths, has_state
            return x.to(device)
        dt = {"k": key_dtype, "state": state_dtype}.get(name, dtype)
        return x.to(device=device, dtype=dt).contiguous()

    return KVBuffer(**{f: cv(f, x) for f, x in buffer.tensors().items()})


def stack_buffers(buffers: Sequence[KVBuffer]) -> KVBuffer:
    """Concatenate single-request buffers (same capacity and form) into one batch."""
    def cat(name):
        xs = [getattr(b, name) for b in buffers]
        return None if xs[0] is None else torch.cat(xs, dim=0)
    return KVBuffer(**{f: cat(f) for f in KVBuffer.fields()})


def ragged_buffer(x64: dict, lengths: Sequence[int], capacity: int, form: str = "u") -> KVBuffer:
    """A float64 buffer after each request's history ``x64`` (all P tokens), request b keeping the
    last ``lengths[b]`` tokens buffered (0..min(P, C)) and the rest folded into its state.  A request
    whose whole history is buffered owns no state (direct mode)."""
    rows = []
    for b, n in enumerate(lengths):
        _, buf = ref.prefill(**_row(x64, b), capacity=capacity, tail=int(n), form=form)
        rows.append(buf)
    return stack_buffers(rows)


def poison_unused_(buffer: KVBuffer) -> KVBuffer:
    """Put NaN, IN PLACE, into the unused parts of ``buffer``: every slot at or past ``lengths[b]``
    (keys, u/G or v/g/beta) and the state storage of every request that owns no state (direct mode).
    Returns the same buffer (for implementations that update buffers in place).

    The contract says those are garbage that is never read (in serving, a reused slot holds another
    request's data); an implementation that reads them anyway, or masks a lane wrongly, turns the
    NaN into a failing output instead of silently reading zeros.
    """
    unused = torch.arange(buffer.capacity, device=buffer.lengths.device)[None, :] >= buffer.lengths[:, None]
    for f in buffer.slot_fields():
        x = getattr(buffer, f)
        if x is not None:
            x[unused] = float("nan")
    if buffer.state is not None:
        buffer.state[~buffer.has_state.to(torch.bool)] = float("nan")
    return buffer


def poison_unused(buffer: KVBuffer) -> KVBuffer:
    """A poisoned copy of ``buffer`` (see ``poison_unused_``); the buffer itself is untouched."""
    return poison_unused_(KVBuffer(**{f: None if x is None else x.contiguous() for f, x in buffer.cloned().items()}))


def owned_state(buffer: KVBuffer) -> torch.Tensor:
    """The state every request owns, 0 for requests in direct mode (their storage is garbage)."""
    m = buffer.has_state.to(torch.bool).reshape(-1, 1, 1, 1)
    return torch.where(m, buffer.state, torch.zeros((), dtype=buffer.state.dtype, device=buffer.state.device))


def truth_and_baseline(x_dtype: dict, initial_state: Optional[torch.Tensor] = None,
                       compute_baseline: bool = True):
    """(o, S) of the float64 recurrence on the (already rounded) inputs, and the same in the plain
    compute dtype (the baseline; None for float64 inputs)."""
    x64 = upcast_inputs(x_dtype)
    s64 = None if initial_state is None else initial_state.detach().to("cpu", torch.float64)
    truth = ref.recurrent_gated_delta_rule(**x64, initial_state=s64, output_final_state=True)
    if not compute_baseline or x_dtype["q"].dtype == torch.float64:
        return truth, None
    xc = {n: t.detach().cpu() for n, t in x_dtype.items()}
    sc = None if initial_state is None else initial_state.detach().cpu().float()
    base = ref.recurrent_gated_delta_rule(**xc, initial_state=sc, output_final_state=True)
    return truth, (base[0].to(x_dtype["v"].dtype), base[1])


def _cmp(name, actual, truth, base, dtype, g=None, **kw) -> Comparison:
    return compare(actual.detach().cpu(), truth, None if base is None else base.detach().cpu(),
                   name=name, dtype=dtype, g=g, **kw)


# ----------------------------------------------------------------------------- properties
def check_recurrent(impl, case: Case, dtype: torch.dtype, device="cpu") -> list[Comparison]:
    """recurrent(impl) == the float64 recurrence (output and final state), from a random initial state."""
    x = case.inputs(dtype, device)
    gen = torch.Generator().manual_seed(case.seed + 1)
    S0 = torch.randn(case.B, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.5
    S0d = S0.to(device=device, dtype=torch.promote_types(dtype, torch.float32))
    (o64, S64), base = truth_and_baseline(x, S0d)
    o, S = impl.recurrent_gated_delta_rule(**x, initial_state=S0d, output_final_state=True)
    return [_cmp("recurrent.o", o, o64, base and base[0], dtype),
            _cmp("recurrent.state", S, S64, base and base[1], torch.promote_types(dtype, torch.float32), head_axis=1)]


def check_chunk(impl, case: Case, dtype: torch.dtype, *, chunk_size: int, device="cpu",
                with_initial_state: bool = True) -> list[Comparison]:
    """chunk(impl) == recurrence for any T and chunk size (output and final state)."""
    x = case.inputs(dtype, device)
    S0d = None
    if with_initial_state:
        gen = torch.Generator().manual_seed(case.seed + 1)
        S0d = (torch.randn(case.B, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.5).to(
            device=device, dtype=torch.promote_types(dtype, torch.float32))
    (o64, S64), base = truth_and_baseline(x, S0d)
    o, S = impl.chunk_gated_delta_rule(**x, initial_state=S0d, output_final_state=True, chunk_size=chunk_size)
    return [_cmp(f"chunk[{chunk_size}].o", o, o64, base and base[0], dtype, g=x["g"]),
            _cmp(f"chunk[{chunk_size}].state", S, S64, base and base[1], torch.promote_types(dtype, torch.float32),
                 head_axis=1, g=x["g"])]


def check_direct(impl, case: Case, dtype: torch.dtype, device="cpu") -> list[Comparison]:
    """direct(impl) == recurrence from a zero state."""
    x = case.inputs(dtype, device)
    (o64, _), base = truth_and_baseline(x)
    o = impl.direct_gated_delta_rule(**x)
    return [_cmp("direct.o", o, o64, base and base[0], dtype, g=x["g"])]


def check_decode(impl, case: Case, dtype: torch.dtype, *, capacity: int, history: int, lengths: Sequence[int],
                 form: str = "u", flushes: Optional[dict] = None, device="cpu",
                 cache_dtype: Optional[torch.dtype] = None, poison: bool = False) -> list[Comparison]:
    """Buffered decode of tokens ``history..T-1`` after a ragged buffer == recurrence over all T.

    flushes: {step: counts} flushes ``counts`` ([B] ints, each <= the length at that point, or None
    for all) before decode step ``step``.  Also compares the final state (flush of everything).
    poison: start from ``poison_unused(buffer)``.  The final state compared is ``owned_state``: a
    request that owns no state has S = 0 whatever its storage row holds.
    """
    x = case.inputs(dtype, device)
    P = history
    (o64, S64), base = truth_and_baseline(x)
    buf = buffer_to(ragged_buffer(upcast_inputs(_sl(x, slice(0, P))), lengths, capacity, form),
                    dtype=cache_dtype or torch.promote_types(dtype, torch.float32), device=device,
                    key_dtype=dtype)
    if poison:
        buf = poison_unused(buf)
    outs = []
    for t in range(P, case.T):
        if flushes and (t - P) in flushes:
            counts = flushes[t - P]
            if counts is not None:
                counts = torch.minimum(torch.as_tensor(counts, device=buf.lengths.device), buf.lengths)
            buf = impl.flush(buf, count=counts)
        o, buf = impl.buffered_decode(**_sl(x, slice(t, t + 1)), buffer=buf)
        outs.append(o)
    name = f"decode[C={capacity},{form}]"
    res = []
    if outs:
        res.append(_cmp(f"{name}.o", torch.cat(outs, dim=1), o64[:, P:], base and base[0][:, P:], dtype, g=x["g"]))
    final = owned_state(impl.flush(buf))
    res.append(_cmp(f"{name}.state", final, S64, base and base[1], torch.promote_types(dtype, torch.float32),
                    head_axis=1, g=x["g"]))
    return res


def _path_truth(nodes_x: dict, b: int, path: list[int], S_hist: torch.Tensor) -> torch.Tensor:
    """Recurrent outputs [len(path), HV, V] along one root-to-node path of request b, starting from the
    history's final state ``S_hist`` [B, HV, K, V]; computed in the dtype of ``nodes_x``."""
    idx = torch.tensor(path, dtype=torch.long)
    toks = {n: t[b : b + 1, idx].cpu() for n, t in nodes_x.items()}
    state_dtype = torch.promote_types(toks["q"].dtype, torch.float32)
    o, _ = ref.recurrent_gated_delta_rule(**toks, initial_state=S_hist[b : b + 1].cpu().to(state_dtype))
    return o[0]


def check_verify_accept(impl, case: Case, dtype: torch.dtype, *, capacity: int, history: int,
                        lengths: Sequence[int], parents: Sequence[Sequence[int]], num_drafts: Sequence[int],
                        nodes: Sequence[int], after: int, form: str = "u", device="cpu",
                        use_counts: bool = False, poison: bool = False) -> list[Comparison]:
    """Verify D drafts (a tree per request), accept one node per request, then decode ``after`` tokens.

    Token layout: history ``0..P-1``, drafts ``P..P+D-1`` (node i = token P+i), then ``after`` tokens.
    Checks: every verified node's output == the recurrence along its root-to-node path; after
    ``accept``, decoding == the recurrence over history + accepted path + the new tokens (rejected
    drafts leave no trace), and the final state matches.  poison: as in ``check_decode``.
    """
    P, D, B = history, len(parents[0]), case.B
    assert case.T == P + D + after, "case.T must be history + drafts + after"
    x = case.inputs(dtype, device)
    x64 = upcast_inputs(x)
    xd = torch.promote_types(dtype, torch.float32)
    hist = _sl(x64, slice(0, P))
    nodes_x = _sl(x64, slice(P, P + D))
    _, S_hist = ref.recurrent_gated_delta_rule(**hist, output_final_state=True)
    S_hist_c = None
    if dtype != torch.float64:
        _, S_hist_c = ref.recurrent_gated_delta_rule(**{n: t.cpu() for n, t in _sl(x, slice(0, P)).items()},
                                                     output_final_state=True)
    buf = buffer_to(ragged_buffer(hist, lengths, capacity, form), dtype=xd, device=device, key_dtype=dtype)
    if poison:
        buf = poison_unused(buf)
    par = torch.tensor(parents, dtype=torch.long, device=device)
    nd = torch.tensor(num_drafts, dtype=torch.long, device=device)
    o, drafts = impl.verify(**_sl(x, slice(P, P + D)), buffer=buf, parents=par, num_drafts=nd)
    # expected verify outputs, path by path
    exp = torch.zeros(B, D, case.HV, case.V, dtype=torch.float64)
    bas = torch.zeros_like(exp) if S_hist_c is not None else None
    for b in range(B):
        for i in range(num_drafts[b]):
            p = path_to(par[b].cpu(), i)
            exp[b, i] = _path_truth(nodes_x, b, p, S_hist)[-1]
            if bas is not None:
                bas[b, i] = _path_truth(_sl(x, slice(P, P + D)), b, p, S_hist_c)[-1].to(torch.float64)
    valid = (torch.arange(D)[None, :] < nd.cpu()[:, None])[:, :, None, None]
    res = [_cmp(f"verify[C={capacity},{form}].o", o, exp, bas, dtype, valid=valid, g=x["g"])]
    # accept, then decode the remaining tokens; truth per request over its own committed history
    node_t = torch.tensor(nodes, dtype=torch.long, device=device)
    if use_counts:
        buf = impl.accept(buf, drafts, counts=node_t + 1)
    else:
        buf = impl.accept(buf, drafts, nodes=node_t)
    outs = []
    for t in range(P + D, case.T):
        ot, buf = impl.buffered_decode(**_sl(x, slice(t, t + 1)), buffer=buf)
        outs.append(ot)
    final = owned_state(impl.flush(buf))
    exp_o, exp_S, bas_o, bas_S = [], [], [], []
    for b in range(B):
        keep = list(range(P)) + [P + i for i in path_to(par[b].cpu(), int(nodes[b]))] + list(range(P + D, case.T))
        idx = torch.tensor(keep, dtype=torch.long)
        xb = {n: t[b : b + 1, idx] for n, t in x.items()}
        (o64, S64), base = truth_and_baseline({n: t.cpu() for n, t in xb.items()})
        exp_o.append(o64[:, len(keep) - after:])
        exp_S.append(S64)
        if base is not None:
            bas_o.append(base[0][:, len(keep) - after:])
            bas_S.append(base[1])
    if after:
        res.append(_cmp(f"accept+decode[C={capacity},{form}].o", torch.cat(outs, dim=1), torch.cat(exp_o),
                        torch.cat(bas_o) if bas_o else None, dtype, g=x["g"]))
    res.append(_cmp(f"accept+decode[C={capacity},{form}].state", final, torch.cat(exp_S),
                    torch.cat(bas_S) if bas_S else None, xd, head_axis=1, g=x["g"]))
    return res


def check_prefill(impl, case: Case, dtype: torch.dtype, *, capacity: int, prompt: int, tail: Optional[int],
                  form: str = "u", chunk_size: int = 64, device="cpu") -> list[Comparison]:
    """prefill(impl) of the first ``prompt`` tokens (any split) then decode of the rest == recurrence."""
    x = case.inputs(dtype, device)
    (o64, S64), base = truth_and_baseline(x)
    o, buf = impl.prefill(**_sl(x, slice(0, prompt)), capacity=capacity, tail=tail, form=form, chunk_size=chunk_size)
    outs = [o]
    for t in range(prompt, case.T):
        ot, buf = impl.buffered_decode(**_sl(x, slice(t, t + 1)), buffer=buf)
        outs.append(ot)
    final = owned_state(impl.flush(buf))
    name = f"prefill[C={capacity},tail={tail},{form}]"
    return [_cmp(f"{name}.o", torch.cat(outs, dim=1), o64, base and base[0], dtype, g=x["g"]),
            _cmp(f"{name}.state", final, S64, base and base[1], torch.promote_types(dtype, torch.float32),
                 head_axis=1, g=x["g"])]


def check_materialize(impl, case: Case, dtype: torch.dtype, *, capacity: int, lengths: Sequence[int],
                      form: str = "u", device="cpu", poison: bool = False) -> list[Comparison]:
    """materialize_state(impl) of a ragged buffer holding all T tokens == the recurrence's final state,
    twice in a row (the first call must leave the buffer as it was).  poison: unused slots and the
    state storage of direct-mode requests hold NaN (it must never be read, nor returned)."""
    x = case.inputs(dtype, device)
    xd = torch.promote_types(dtype, torch.float32)
    (_, S64), base = truth_and_baseline(x)
    buf = buffer_to(ragged_buffer(upcast_inputs(x), lengths, capacity, form), dtype=xd, device=device,
                    key_dtype=dtype)
    if poison:
        buf = poison_unused(buf)
    name = f"materialize_state[C={capacity},{form}]"
    res = []
    for i in range(2):
        S = impl.materialize_state(buf)
        res.append(_cmp(f"{name}.call{i + 1}", S, S64, base and base[1], xd, head_axis=1, g=x["g"]))
    return res
