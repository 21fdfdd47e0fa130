"""The oracle's properties (docs/testing.md) as plain functions over any implementation.

An *implementation* is any object (a module, a namespace) with some of the attributes
``recurrent_gated_delta_rule``, ``chunk_gated_delta_rule``, ``direct_gated_delta_rule``,
``buffered_decode``, ``flush``, ``verify``, ``accept``, ``prefill``, following the conventions of
docs/conventions.md.  Each ``check_*`` runs one property on one ``Case`` and returns the list of
``Comparison`` verdicts (output by output, against the float64 recurrent truth, with the correct forms
in the compute dtype and the lane's arithmetic as the baseline: ``truth_and_baseline``).  pytest (tests/property) and ``kvbuffer
validate`` both call these.

Token layout of a case with a buffer: tokens ``0..P-1`` are the history (folded / buffered by the
float64 oracle's prefill, each request with its own buffer length), then the tokens the operation
under test consumes.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

import kvbuffer_ref as ref
from kvbuffer_ref.buffer import KVBuffer
from kvbuffer_ref.checks import RESET_GATE
from kvbuffer_ref.engine_inputs import NORM_EPS, SOFTPLUS_THRESHOLD
from kvbuffer_ref.speculative import path_to

from .cases import Case, l2norm_qk, upcast_inputs
from .contracts import baseline_recurrent, segment_ways, correct_forms, emulate, segmented_forms, key_orders
from .tolerances import Comparison, compare, compute_dtype, current_contract

__all__ = [
    "ValidatorFault",
    "buffer_to",
    "stack_buffers",
    "ragged_buffer",
    "truth_and_baseline",
    "worst_rows",
    "FORM_CHUNK",
    "check_recurrent",
    "check_chunk",
    "check_direct",
    "check_decode",
    "check_verify_accept",
    "along_path",
    "check_prefill",
    "poison_unused",
    "poison_unused_",
    "poison_padding",
    "INDEX_DTYPES",
    "owned_state",
    "check_materialize",
    "LEDGER",
    "informative",
    "engine_case_inputs",
    "engine_map_in",
    "check_engine_inputs",
]

#: (comparison, informative) of every comparison made since the runner last cleared it: a comparison
#: whose truth is all zero or constant (e.g. beta = 0 with no state) is not informative: an
#: implementation returning zeros or a constant would pass it, so it is not counted as a check.
LEDGER: list = []


def informative(truth: torch.Tensor, valid=None) -> bool:
    t = truth.detach()
    if valid is not None:
        valid = valid.to(t.device)
        t = t[valid.expand_as(t)] if valid.dim() == t.dim() else t
    t = t[torch.isfinite(t)]
    return t.numel() > 0 and bool((t.max() - t.min()) > 0)


def _scale(case: Case) -> dict:
    """The explicit scale of ``case`` as a keyword (nothing when it uses the default K ** -0.5)."""
    return {} if case.scale is None else {"scale": float(case.scale)}


def _state0(case: Case, dtype, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed + 1)
    S0 = torch.randn(case.B, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.5
    return S0.to(device=device, dtype=torch.promote_types(dtype, torch.float32))


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
            return x.to(device, copy=True)
        dt = {"k": key_dtype, "state": state_dtype}.get(name, dtype)
        return x.to(device=device, dtype=dt, copy=True).contiguous()

    return KVBuffer(**{f: cv(f, x) for f, x in buffer.tensors().items()})


def stack_buffers(buffers: Sequence[KVBuffer]) -> KVBuffer:
    """Concatenate single-request buffers (same capacity and form) into one batch."""
    def cat(name):
        xs = [getattr(b, name) for b in buffers]
        return None if xs[0] is None else torch.cat(xs, dim=0)
    return KVBuffer(**{f: cat(f) for f in KVBuffer.fields()})


def ragged_buffer(x64: dict, lengths: Sequence[int], capacity: int, form: str = "u",
                  compute: torch.dtype = torch.float64) -> KVBuffer:
    """A float64 buffer after each request's history ``x64`` (all P tokens), request b keeping the
    last ``lengths[b]`` tokens buffered (0..min(P, C)) and the rest folded into its state.  A request
    whose whole history is buffered owns no state (direct mode).  Requests of equal length are
    prefilled together (one batched call each).  compute: the dtype of the implementation the buffer is
    for: its gates below ``-RESET_GATE[compute]`` (a reset; ``kvbuffer_ref.checks``) are taken as that, as
    an implementation computing in ``compute`` takes them, so the stored cumulative gates are those it
    would hold (a float64 reset of -2000 rounded to float32 would leave a cumulative gate no float32
    implementation forms, and whose later differences have lost their low bits)."""
    if compute != torch.float64:
        x64 = dict(x64, g=x64["g"].clamp(min=-RESET_GATE[compute]))
    rows = [None] * len(lengths)
    for n in sorted(set(int(n) for n in lengths)):
        idx = [b for b, m in enumerate(lengths) if int(m) == n]
        sel = torch.tensor(idx, dtype=torch.long, device=x64["q"].device)
        _, buf = ref.prefill(**{k: t[sel] for k, t in x64.items()}, capacity=capacity, tail=n, form=form)
        for j, b in enumerate(idx):
            rows[b] = KVBuffer(**{f: None if t is None else t[j : j + 1] for f, t in buf.tensors().items()})
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


#: The index dtypes drawn for the integer arguments of the buffer operations (parents, num_drafts, flush and
#: accept counts, accepted nodes): any integer dtype is accepted (docs/conventions.md, "Domain").
INDEX_DTYPES = {"int64": torch.int64, "int32": torch.int32}


def _index(values, index_dtype: str, device) -> torch.Tensor:
    """``values`` as an integer tensor of the drawn index dtype (``INDEX_DTYPES``)."""
    return torch.as_tensor(values, device=device).to(INDEX_DTYPES[index_dtype])


def _scalar_or(values: torch.Tensor, scalar: bool):
    """A per-request count or node argument: the Python int every request shares when ``scalar`` and all values
    are equal (the int form of the argument, docs/conventions.md), else the tensor itself."""
    flat = values.cpu().tolist()
    if scalar and flat and len(set(flat)) == 1:
        return int(flat[0])
    return values


def poison_padding(x: dict, num_drafts: Sequence[int]) -> dict:
    """Copies of verify's token inputs with NaN in every padding row (draft index >= num_drafts[b]): rows that
    are never read (docs/conventions.md, "Domain"), so a kernel that lets a padding row reach a verified one
    (a dense product that masks by multiplying by 0, 0 * NaN = NaN) fails."""
    out = {}
    for n, t in x.items():
        t = t.clone()
        for b, m in enumerate(num_drafts):
            t[b, int(m):] = float("nan")
        out[n] = t
    return out


def owned_state(buffer: KVBuffer) -> torch.Tensor:
    """The state every request owns, 0 for requests in direct mode (their storage is garbage)."""
    m = buffer.has_state.to(torch.bool).reshape(-1, 1, 1, 1)
    return torch.where(m, buffer.state, torch.zeros((), dtype=buffer.state.dtype, device=buffer.state.device))


#: The chunk of a chunkwise baseline form besides the operation's own (a buffer's capacity, a ``chunk_size``
#: argument, a whole sequence in direct mode): 64 tokens, the chunk of this family's production chunked
#: kernels (flash-linear-attention's ``chunk_gated_delta_rule``), which may ignore a smaller argument.
FORM_CHUNK = 64


def worst_rows(truth: torch.Tensor, forms: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """One tensor shaped like ``truth`` holding, for every row (an index over its first ``rows`` dimensions:
    3 for outputs [B, T, HV, V], a token's head; 2 for states [B, HV, K, V], a head's state), the row of the
    form in ``forms`` that is furthest from ``truth``.  Any (request, head) slice of it, over any tokens, is at
    least as far from the truth as each form is: the baseline of the worst of the forms."""
    if len(forms) == 1:
        return forms[0]
    t = truth.to(forms[0].device, torch.float64)
    err = torch.stack([(f.to(torch.float64) - t).square().flatten(rows).sum(-1) for f in forms])
    pick = err.nan_to_num(nan=float("inf")).argmax(0)
    pick = pick.reshape(1, *pick.shape, *([1] * (truth.dim() - rows))).expand(1, *truth.shape)
    return torch.stack(list(forms)).gather(0, pick)[0]


class ValidatorFault(RuntimeError):
    """The validator's own computation of a case's truth or budget raised: a defect of the validator (or of
    the machine it runs on: memory), never the implementation's; the lane is an ERROR, not a FAIL."""


def _ours(fn):
    """``fn`` computes the validator's side of a check: an exception inside it is a ``ValidatorFault``."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValidatorFault:
            raise
        except Exception as e:
            raise ValidatorFault(f"the validator's {fn.__name__} raised {type(e).__name__}: {e}") from e
    return wrapped


@_ours
def truth_and_baseline(x_dtype: dict, initial_state: Optional[torch.Tensor] = None,
                       compute_baseline: bool = True, scale: Optional[float] = None, qk_l2norm: bool = False,
                       chunk: Optional[int] = None):
    """(o, S) of the float64 recurrence on the (already rounded) inputs, and the baseline (o, S): what a
    correct implementation computes in the compute dtype under the lane's arithmetic contract, row by row the
    worst of ``contracts.correct_forms``: the plain recurrence, and with ``chunk`` the chunkwise forms with
    chunks of ``chunk`` and of ``FORM_CHUNK`` tokens (pass the operation's own chunk; None for the stepwise
    operations, which form no cumulative gate; the baseline is then None for float64 inputs under IEEE
    arithmetic, where the recurrence is the truth itself).  Outputs are
    rounded to the output dtype.  qk_l2norm: the implementation L2-normalises q and k itself
    (``Case.qk_l2norm``): the truth runs on their normalisation in float64, the baseline on their
    normalisation in the compute dtype."""
    x64 = upcast_inputs(x_dtype, device=None)
    if qk_l2norm:
        x64 = l2norm_qk(x64, torch.float64)
    s64 = None if initial_state is None else initial_state.detach().to(torch.float64)
    truth = ref.recurrent_gated_delta_rule(**x64, initial_state=s64, output_final_state=True, scale=scale)
    if not compute_baseline or (chunk is None and x_dtype["q"].dtype == torch.float64 and current_contract() == "ieee"):
        return truth, None  # the float64 recurrence is the truth itself: only the floor counts
    xc = {n: t.detach() for n, t in x_dtype.items()}
    compute = torch.promote_types(xc["q"].dtype, torch.float32)
    sc = None if initial_state is None else initial_state.detach().to(compute)
    ways = ()
    if qk_l2norm:
        if compute == torch.float32:  # the other way kernels normalise
            r = l2norm_qk(xc, compute, way="rsqrt")
            ways = ((r["q"], r["k"]),)
        xc = l2norm_qk(xc, compute)
    forms = correct_forms(**xc, initial_state=sc, scale=scale, qk_ways=ways,
                          chunks=() if chunk is None else sorted({FORM_CHUNK, int(chunk)}))
    out = x_dtype["v"].dtype
    return truth, (worst_rows(truth[0], [o.to(out) for o, _ in forms], 3),
                   worst_rows(truth[1], [S for _, S in forms], 2))


@_ours
def _buffer_form(x: dict, b: int, first: int, last: int, state: Optional[torch.Tensor], starts: Sequence[int],
                 dtype: torch.dtype, scale: Optional[float], carried: Sequence[int] = ()) -> list:
    """Request b's tokens ``first..last-1`` of ``x`` as a buffer computes them: ``contracts.segmented_forms``
    from ``state`` (the state stored at the buffer's start, [1, HV, K, V]; None: none) with chunk boundaries
    at ``starts`` (absolute positions: the buffer's start and every fold; at those in ``carried``, an accept's
    or a partial flush's, the entries kept are rebased rather than summed afresh), in the compute dtype under
    the lane's arithmetic contract, its cumulative gates summed both ways: [(o [1, n, HV, V] in ``dtype``, S), ...]."""
    xb = {n: t[b : b + 1, first:last] for n, t in x.items()}
    S0 = None if state is None else state.to(torch.promote_types(dtype, torch.float32))
    rel = [int(p) - first for p in starts if first <= int(p) < last]
    kept = [int(p) - first for p in carried if first < int(p) < last]
    return [(o.to(dtype), S) for o, S in segmented_forms(**xb, initial_state=S0, starts=rel, carried=kept, scale=scale)]


@_ours
def _oracle_run(dtype: torch.dtype, run):
    """``run()``: the operation's calls made with ``kvbuffer_ref`` as the implementation, on a copy of the same
    buffer in the implementation's dtypes, under the lane's arithmetic contract (products emulated): the
    operation exactly as a correct implementation in that arithmetic computes it, the rounding of its
    cumulative gates across folds, accepts and rebases included.  None for float64 (the oracle's own
    arithmetic: there the baseline is the independent forms only, so the oracle's lanes stay a check of its
    math) and under bf16-state (whose baseline forms round the state as the contract says)."""
    contract = current_contract()
    if dtype == torch.float64 or contract == "bf16-state":
        return None
    with emulate(contract):
        return run()


def _stored_state(buf: KVBuffer, b: int) -> Optional[torch.Tensor]:
    """Request b's stored state [1, HV, K, V] (None when it owns none)."""
    if buf.state is None or not bool(buf.has_state[b]):
        return None
    return buf.state[b : b + 1]


def _decode_folds(start: int, n: int, steps: range, capacity: int, flushes: Optional[dict] = None,
                  carried: Optional[list] = None) -> list:
    """The positions a buffer starts at: from ``start`` holding ``n`` entries, through the decode steps at the
    positions ``steps`` (a flush of ``count`` entries before step i when ``flushes[i]`` says so, a full buffer
    folding all its entries before the step that finds it full).  ``carried``: a list the positions of partial
    flushes are appended to (their kept entries are rebased, not summed afresh)."""
    starts = [start]
    for i, t in enumerate(steps):
        if flushes and i in flushes:
            m = n if flushes[i] is None else min(int(flushes[i]), n)
            start, n = start + m, n - m
            starts.append(start)
            if carried is not None and 0 < m and n > 0:
                carried.append(start)
        if n >= capacity:
            start, n = t, 0
            starts.append(start)
        n += 1
    return starts


def _stack_forms(rows: list) -> tuple:
    """Per-request forms ``rows[b] = [(o, S), ...]`` (one entry per form, batches of one) as the batch:
    ([o of each form], [S of each form]); a request with fewer forms repeats its last one."""
    R = max((len(r) for r in rows), default=0)
    rows = [r + [r[-1]] * (R - len(r)) for r in rows]
    return ([torch.cat([r[i][0] for r in rows]) for i in range(R)],
            [torch.cat([r[i][1] for r in rows]) for i in range(R)])


def _forms(truth: torch.Tensor, *forms, rows: int = 3) -> Optional[torch.Tensor]:
    """The worst of the baseline ``forms`` row by row (``worst_rows``: ``rows`` 3 for outputs [B, T, HV, V],
    2 for states [B, HV, K, V]; None entries skipped), or None when there is none."""
    forms = [f for f in forms if f is not None]
    if not forms:
        return None
    return worst_rows(truth, [f.to(forms[0].device) for f in forms], rows)


def _caller_normalised(case: Case, what: str) -> None:
    """The buffer operations take keys from the oracle's buffers, normalised by the caller: refuse a case
    whose implementation normalises q and k itself."""
    if case.qk_l2norm:
        raise ValueError(f"{what}: case.qk_l2norm (q and k normalised in the kernel) applies to the recurrent, "
                         f"chunk and direct forms only")


def _cmp(name, actual, truth, base, dtype, **kw) -> Comparison:
    """``compare`` of one output and its record in the ledger."""
    if actual is None:
        raise AssertionError(f"[arguments] {name}: the implementation returned None (expected a tensor of shape "
                             f"{list(truth.shape)})")
    truth, valid = truth.detach(), kw.pop("valid", None)  # compared on the truth's device
    c = compare(actual.detach(), truth, None if base is None else base.detach(), name=name, dtype=dtype,
                valid=valid, **kw)
    LEDGER.append((c, informative(truth, valid)))
    return c


# ----------------------------------------------------------------------------- properties
def check_recurrent(impl, case: Case, dtype: torch.dtype, device="cpu", *, initial: bool = True,
                    final: bool = True) -> list[Comparison]:
    """recurrent(impl) == the float64 recurrence (output, and final state when ``final``), from a random
    initial state (``initial``) or none; ``case.scale`` passed explicitly when set."""
    x = case.inputs(dtype, device)
    S0d = _state0(case, dtype, device) if initial else None
    (o64, S64), base = truth_and_baseline(x, S0d, scale=case.scale, qk_l2norm=case.qk_l2norm)
    o, S = impl.recurrent_gated_delta_rule(**x, initial_state=S0d, output_final_state=final, **_scale(case))
    tag = f"recurrent[initial_state={'S0' if initial else None},output_final_state={final}]"
    res = [_cmp(f"{tag}.o", o, o64, base and base[0], dtype)]
    if final:
        res.append(_cmp(f"{tag}.state", S, S64, base and base[1], torch.promote_types(dtype, torch.float32),
                        head_axis=1))
    elif S is not None:
        raise AssertionError(f"[arguments] {tag}: output_final_state=False must return None for the state, got a "
                             f"tensor of shape {list(S.shape)}")
    return res


def check_varlen(impl, case: Case, dtype: torch.dtype, *, lengths, chunk_size: Optional[int] = None, device="cpu",
                 initial: bool = True, final: bool = True) -> list[Comparison]:
    """A variable-length batch, as engines pass prefill: the B requests of ``case`` cut to ``lengths``
    (0 allowed: an empty sequence) and concatenated along T (q [1, sum(lengths), H, K], ``cu_seqlens``
    int32 [B + 1]), through ``recurrent_gated_delta_rule`` (``chunk_size`` None) or
    ``chunk_gated_delta_rule``; each sequence's outputs and final state equal the float64 recurrence of
    that sequence alone, from its own initial state (``initial``) or none.  A state leaking from one
    sequence into the next, or an offset off by a sequence, fails."""
    x = case.inputs(dtype, device)
    lengths = [int(n) for n in lengths]
    if len(lengths) != case.B or any(not 0 <= n <= case.T for n in lengths):
        raise ValueError(f"lengths: expected {case.B} values in 0..{case.T}, got {lengths}")
    packed = {n: torch.cat([t[b, :lengths[b]] for b in range(case.B)], 0)[None] for n, t in x.items()}
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    S0d = _state0(case, dtype, device) if initial else None
    kw = dict(initial_state=S0d, output_final_state=final, cu_seqlens=cu, **_scale(case))
    if chunk_size is None:
        fn, tag = impl.recurrent_gated_delta_rule, "recurrent"
    else:
        fn, tag = impl.chunk_gated_delta_rule, f"chunk[{chunk_size}]"
        kw["chunk_size"] = chunk_size
    o, S = fn(**packed, **kw)
    tag = f"{tag}[cu_seqlens={offsets},initial_state={'S0' if initial else None},output_final_state={final}]"
    res, states, bases = [], [], []
    for b, (a, e) in enumerate(zip(offsets, offsets[1:])):
        xb = {n: t[b:b + 1, :lengths[b]] for n, t in x.items()}
        S0b = None if S0d is None else S0d[b:b + 1]
        (o64, S64), base = truth_and_baseline(xb, S0b, scale=case.scale, qk_l2norm=case.qk_l2norm, chunk=chunk_size)
        states.append(S64)
        bases.append(None if base is None else base[1])
        if e > a:
            res.append(_cmp(f"{tag}.o[sequence {b}]", o[:, a:e], o64, base and base[0], dtype))
    if final:
        base = None if bases[0] is None else torch.cat(bases, 0)
        res.append(_cmp(f"{tag}.state", S, torch.cat(states, 0), base, torch.promote_types(dtype, torch.float32),
                        head_axis=1))
    elif S is not None:
        raise AssertionError(f"[arguments] {tag}: output_final_state=False must return None for the state, got a "
                             f"tensor of shape {list(S.shape)}")
    return res


def check_chunk(impl, case: Case, dtype: torch.dtype, *, chunk_size: int, device="cpu",
                with_initial_state: bool = True, final: bool = True) -> list[Comparison]:
    """chunk(impl) == recurrence for any T and chunk size (output, and final state when ``final``)."""
    x = case.inputs(dtype, device)
    S0d = _state0(case, dtype, device) if with_initial_state else None
    (o64, S64), base = truth_and_baseline(x, S0d, scale=case.scale, qk_l2norm=case.qk_l2norm, chunk=chunk_size)
    o, S = impl.chunk_gated_delta_rule(**x, initial_state=S0d, output_final_state=final, chunk_size=chunk_size,
                                       **_scale(case))
    tag = f"chunk[{chunk_size},initial_state={'S0' if with_initial_state else None},output_final_state={final}]"
    res = [_cmp(f"{tag}.o", o, o64, base and base[0], dtype)]
    if final:
        res.append(_cmp(f"{tag}.state", S, S64, base and base[1], torch.promote_types(dtype, torch.float32),
                        head_axis=1))
    return res


def check_direct(impl, case: Case, dtype: torch.dtype, device="cpu") -> list[Comparison]:
    """direct(impl) == recurrence from a zero state."""
    x = case.inputs(dtype, device)
    (o64, _), base = truth_and_baseline(x, scale=case.scale, qk_l2norm=case.qk_l2norm, chunk=case.T)
    o = impl.direct_gated_delta_rule(**x, **_scale(case))
    return [_cmp("direct.o", o, o64, base and base[0], dtype)]


def check_decode(impl, case: Case, dtype: torch.dtype, *, capacity: int, history: int, lengths: Sequence[int],
                 form: str = "u", flushes: Optional[dict] = None, device="cpu",
                 cache_dtype: Optional[torch.dtype] = None, poison: bool = False, index_dtype: str = "int64",
                 scalar: bool = False, stateless: bool = False) -> list[Comparison]:
    """Buffered decode of tokens ``history..T-1`` after a ragged buffer == recurrence over all T.

    flushes: {step: counts} flushes ``counts`` ([B] ints, each <= the length at that point, or None
    for all) before decode step ``step``, passed as a tensor of ``index_dtype`` ("int64", "int32"), or with
    ``scalar`` as the Python int every request shares when the counts are equal.  Also compares the final
    state (flush of everything).  poison: start from ``poison_unused(buffer)``.  stateless: when no request
    owns a state, the buffer has no state storage (``state=None``); a decode step into a full buffer is then
    preceded by ``flush(count=0)``, which allocates it.  The final state compared is ``owned_state``: a
    request that owns no state has S = 0 whatever its storage row holds.
    """
    _caller_normalised(case, "decode")
    x = case.inputs(dtype, device)
    P = history
    (o64, S64), base = truth_and_baseline(x, scale=case.scale, chunk=capacity)
    buf = buffer_to(ragged_buffer(upcast_inputs(_sl(x, slice(0, P)), device=None), lengths, capacity, form,
                                  compute_dtype(dtype)),
                    dtype=cache_dtype or torch.promote_types(dtype, torch.float32), device=device,
                    key_dtype=dtype)
    def prepared(buf):
        return buf.replace(state=None) if stateless and not bool(buf.has_state.any()) else buf

    def run(impl, buf):
        outs = []
        for t in range(P, case.T):
            if flushes and (t - P) in flushes:
                counts = flushes[t - P]
                if counts is not None:
                    counts = torch.minimum(torch.as_tensor(counts, device=buf.lengths.device), buf.lengths)
                left = (torch.zeros_like(buf.lengths) if counts is None else buf.lengths - counts).cpu().tolist()
                arg = None if counts is None else _scalar_or(_index(counts, index_dtype, buf.lengths.device), scalar)
                buf = impl.flush(buf, count=arg)
                if buf.lengths.cpu().tolist() != left:  # flush folds exactly the first `count` entries
                    shown = arg.tolist() if torch.is_tensor(arg) else arg
                    raise AssertionError(f"[partial-flush] flush(count={shown}) "
                                         f"left buffer lengths {buf.lengths.cpu().tolist()}, expected {left}")
            if buf.state is None and bool((buf.lengths >= capacity).any()):
                # the contract's way to give a buffer without storage somewhere to fold: flush(count=0) allocates it
                buf = impl.flush(buf, count=_scalar_or(_index([0] * case.B, index_dtype, buf.lengths.device), scalar))
                if buf.state is None:
                    raise AssertionError("[arguments] flush(count=0) of a buffer without state storage (state=None) "
                                         "returned no state storage; flush allocates it (docs/conventions.md)")
            o, buf = impl.buffered_decode(**_sl(x, slice(t, t + 1)), buffer=buf, **_scale(case))
            outs.append(o)
        return (torch.cat(outs, dim=1) if outs else None), owned_state(impl.flush(buf))

    # the buffer's own form: per request, from its stored state, chunk boundaries at its start and its folds
    rows = []
    for b in range(case.B):
        n = int(lengths[b])
        fl = None if not flushes else {i: (None if c is None else int(torch.as_tensor(c).reshape(-1)[b]))
                                       for i, c in flushes.items()}
        carried = []
        starts = _decode_folds(P - n, n, range(P, case.T), capacity, fl, carried)
        rows.append([(o[:, n:], S) for o, S in _buffer_form(x, b, P - n, case.T, _stored_state(buf, b), starts, dtype,
                                                               case.scale, carried)])
    own = _stack_forms(rows)
    oracle = _oracle_run(dtype, lambda: run(ref, prepared(KVBuffer(**buf.cloned()))))
    if oracle is not None:
        own = (own[0] + ([oracle[0]] if oracle[0] is not None else []), own[1] + [oracle[1]])
    o, final = run(impl, prepared(poison_unused(buf) if poison else buf))
    name = f"decode[C={capacity},{form}]"
    res = []
    if o is not None:
        res.append(_cmp(f"{name}.o", o, o64[:, P:], _forms(o64[:, P:], base and base[0][:, P:], *own[0]), dtype))
    res.append(_cmp(f"{name}.state", final, S64, _forms(S64, base and base[1], *own[1], rows=2),
                    torch.promote_types(dtype, torch.float32), head_axis=1))
    return res


def _path_truth(nodes_x: dict, b: int, path: list[int], S_hist: torch.Tensor, scale=None,
                contract: str = "ieee") -> torch.Tensor:
    """Recurrent outputs [len(path), HV, V] along one root-to-node path of request b, starting from the
    history's final state ``S_hist`` [B, HV, K, V]; computed in the dtype of ``nodes_x``."""
    idx = torch.tensor(path, dtype=torch.long)
    toks = {n: t[b : b + 1, idx.to(t.device)] for n, t in nodes_x.items()}
    state_dtype = torch.promote_types(toks["q"].dtype, torch.float32)
    o, _ = baseline_recurrent(**toks, initial_state=S_hist[b : b + 1].to(toks["q"].device, state_dtype), scale=scale,
                              contract=contract)
    return o[0]


def along_path(x: dict, b: int, path: Sequence[int], history: int = 0) -> dict:
    """Request b's tokens of ``x`` along one root-to-node path: its first ``history`` tokens, then the drafts
    ``path`` (draft i = token ``history + i``), as a batch of one."""
    idx = torch.tensor(list(range(history)) + [history + int(i) for i in path], dtype=torch.long)
    return {n: t[b : b + 1, idx.to(t.device)] for n, t in x.items()}


def check_verify_accept(impl, case: Case, dtype: torch.dtype, *, capacity: int, history: int,
                        lengths: Sequence[int], parents: Sequence[Sequence[int]], num_drafts: Sequence[int],
                        nodes: Sequence[int], after: int, form: str = "u", device="cpu",
                        use_counts: bool = False, poison: bool = False, index_dtype: str = "int64",
                        scalar: bool = False, defaults: bool = False) -> list[Comparison]:
    """Verify D drafts (a tree per request), accept one node per request, then decode ``after`` tokens.

    Token layout: history ``0..P-1``, drafts ``P..P+D-1`` (node i = token P+i), then ``after`` tokens.
    Checks: every verified node's output == the recurrence along its root-to-node path; after
    ``accept``, decoding == the recurrence over history + accepted path + the new tokens (rejected
    drafts leave no trace), and the final state matches.  poison: as in ``check_decode``, and verify's
    padding rows (past ``num_drafts[b]``) hold NaN (``poison_padding``).  index_dtype: the dtype of
    ``parents``, ``num_drafts`` and accept's ``counts`` / ``nodes`` ("int64", "int32"); scalar: accept's
    argument as the Python int every request shares when they are equal; defaults: ``parents=None,
    num_drafts=None`` (the full chain of D drafts, which the case must then be).
    """
    P, D, B = history, len(parents[0]), case.B
    assert case.T == P + D + after, "case.T must be history + drafts + after"
    _caller_normalised(case, "verify")
    x = case.inputs(dtype, device)
    x64 = upcast_inputs(x, device=None)
    xd = torch.promote_types(dtype, torch.float32)
    hist = _sl(x64, slice(0, P))
    nodes_x = _sl(x64, slice(P, P + D))
    _, S_hist = ref.recurrent_gated_delta_rule(**hist, output_final_state=True)
    S_hist_c = None
    if dtype != torch.float64 or current_contract() != "ieee":
        _, S_hist_c = baseline_recurrent(**_sl(x, slice(0, P)), output_final_state=True)
    buf = buffer_to(ragged_buffer(hist, lengths, capacity, form, compute_dtype(dtype)), dtype=xd, device=device,
                    key_dtype=dtype)
    par = torch.tensor(parents, dtype=torch.long, device=device)
    nd = torch.tensor(num_drafts, dtype=torch.long, device=device)
    if defaults and (par.tolist() != [list(range(-1, D - 1))] * B or nd.tolist() != [D] * B):
        raise ValueError("defaults: parents=None, num_drafts=None stand for the full chain of D drafts")
    toks = _sl(x, slice(P, P + D))
    drafts_kw = {} if defaults else dict(parents=_index(par, index_dtype, device),
                                         num_drafts=_index(nd, index_dtype, device))
    node_t = torch.tensor(nodes, dtype=torch.long, device=device)

    def run(impl, buf, toks):
        """verify, accept one node per request, decode the remaining tokens: (verify's o, decode's o, state)."""
        o, drafts = impl.verify(**toks, buffer=buf, **drafts_kw, **_scale(case))
        if use_counts:
            buf = impl.accept(buf, drafts, counts=_scalar_or(_index(node_t + 1, index_dtype, device), scalar))
        else:
            buf = impl.accept(buf, drafts, nodes=_scalar_or(_index(node_t, index_dtype, device), scalar))
        outs = []
        for t in range(P + D, case.T):
            ot, buf = impl.buffered_decode(**_sl(x, slice(t, t + 1)), buffer=buf, **_scale(case))
            outs.append(ot)
        return o, (torch.cat(outs, dim=1) if outs else None), owned_state(impl.flush(buf))

    stored = [_stored_state(buf, b) for b in range(B)]  # before verify may write its drafts into the buffer
    oracle = _oracle_run(dtype, lambda: run(ref, KVBuffer(**buf.cloned()), toks))
    if poison:
        buf, toks = poison_unused(buf), poison_padding(toks, num_drafts)
    o, o_after, final = run(impl, buf, toks)
    # expected verify outputs, path by path; the baseline: the recurrence along the path from the history's
    # state, and the buffer's own form (its entries and the path as one chunk from its stored state)
    exp = torch.zeros(B, D, case.HV, case.V, dtype=torch.float64)
    bas = [torch.zeros_like(exp) for _ in range(1 + len(segment_ways(dtype)))]  # the recurrence, the buffer's forms
    bas_k = {}  # the recurrence along each path with its K channels in other orders (contracts.key_orders)
    drafts_x = _sl(x, slice(P, P + D))
    for b in range(B):
        first = P - int(lengths[b])
        done = set()
        for i in reversed(range(num_drafts[b])):  # one run per leaf: a path's outputs hold for every node on it
            if i in done:
                continue
            p = path_to(par[b].cpu(), i)
            done.update(p)
            exp[b, p] = _path_truth(nodes_x, b, p, S_hist, case.scale).cpu()
            if S_hist_c is not None:
                rec = _path_truth(drafts_x, b, p, S_hist_c, case.scale, current_contract())
                bas[0][b, p] = rec.to(dtype).to("cpu", torch.float64)
                orders = key_orders(along_path(drafts_x, b, p), scale=case.scale, initial_state=S_hist_c[b : b + 1])
                for r, (ok, _) in enumerate(orders):
                    bas_k.setdefault(r, torch.zeros_like(exp))[b, p] = ok[0].to(dtype).to("cpu", torch.float64)
            for r, (ob, _) in enumerate(_buffer_form(along_path(x, b, p, P), 0, first, P + len(p), stored[b], [first],
                                                     dtype, case.scale)):
                bas[1 + r][b, p] = ob[0, -len(p):].to("cpu", torch.float64)
    valid = (torch.arange(D)[None, :] < nd.cpu()[:, None])[:, :, None, None]
    if S_hist_c is None:  # float64 under IEEE arithmetic: the recurrence is the truth itself, no baseline form
        bas = bas[1:]
    bas += list(bas_k.values())
    if oracle is not None:  # its padding rows are no output
        bas.append(torch.where(valid, oracle[0].to("cpu", torch.float64), torch.zeros((), dtype=torch.float64)))
    res = [_cmp(f"verify[C={capacity},{form}].o", o, exp, _forms(exp, *bas), dtype, valid=valid)]
    # after accept: the truth per request over its own committed history
    exp_o, exp_S, bas_o, bas_S, rows = [], [], [], [], []
    for b in range(B):
        path = path_to(par[b].cpu(), int(nodes[b]))
        keep = list(range(P)) + [P + i for i in path] + list(range(P + D, case.T))
        idx = torch.tensor(keep, dtype=torch.long)
        xb = {n: t[b : b + 1, idx.to(t.device)] for n, t in x.items()}
        (o64, S64), base = truth_and_baseline(xb, scale=case.scale, chunk=capacity)
        exp_o.append(o64[:, len(keep) - after:])
        exp_S.append(S64)
        if base is not None:
            bas_o.append(base[0][:, len(keep) - after:])
            bas_S.append(base[1])
        # the buffer after accept: m entries appended; past the capacity the old ones (and for m > C the
        # oldest accepted ones) fold first; then the decode steps' folds
        first, n, m = P - int(lengths[b]), int(lengths[b]), len(path)
        start, held = (first, n + m) if n + m <= capacity else (first + n + max(0, m - capacity), min(m, capacity))
        starts = [first] + _decode_folds(start, held, range(P + m, len(keep)), capacity)
        carried = [start] if n + m > capacity else []  # accept's fold rebases the entries it keeps
        rows.append([(ob[:, len(keep) - first - after:], Sb)
                     for ob, Sb in _buffer_form(xb, 0, first, len(keep), stored[b], starts, dtype, case.scale,
                                                carried)])
    exp_o, exp_S = torch.cat(exp_o), torch.cat(exp_S)
    bas_o, bas_S = (torch.cat(bas_o), torch.cat(bas_S)) if bas_S else (None, None)
    own = _stack_forms(rows)
    if oracle is not None:
        own = (own[0] + ([oracle[1]] if oracle[1] is not None else []), own[1] + [oracle[2]])
    if after:
        res.append(_cmp(f"accept+decode[C={capacity},{form}].o", o_after, exp_o, _forms(exp_o, bas_o, *own[0]), dtype))
    res.append(_cmp(f"accept+decode[C={capacity},{form}].state", final, exp_S,
                    _forms(exp_S, bas_S, *own[1], rows=2), xd, head_axis=1))
    return res


def check_prefill(impl, case: Case, dtype: torch.dtype, *, capacity: int, prompt: int, tail: Optional[int],
                  form: str = "u", chunk_size: int = 64, device="cpu", initial: bool = False) -> list[Comparison]:
    """prefill(impl) of the first ``prompt`` tokens (any split), from a random initial state when
    ``initial``, then decode of the rest == recurrence."""
    _caller_normalised(case, "prefill")
    x = case.inputs(dtype, device)
    S0d = _state0(case, dtype, device) if initial else None
    (o64, S64), base = truth_and_baseline(x, S0d, scale=case.scale, chunk=max(capacity, chunk_size))
    kw = dict(_scale(case), **({"initial_state": S0d} if initial else {}))
    want = [ref.default_tail(prompt, capacity) if tail is None else tail] * case.B

    def run(impl):
        o, buf = impl.prefill(**_sl(x, slice(0, prompt)), capacity=capacity, tail=tail, form=form,
                              chunk_size=chunk_size, **kw)
        if buf.capacity != capacity or buf.lengths.cpu().tolist() != want:  # the hand-off keeps exactly `tail` tokens
            raise AssertionError(f"[arguments] prefill(T={prompt}, capacity={capacity}, tail={tail}) returned a buffer "
                                 f"of capacity {buf.capacity} holding {buf.lengths.cpu().tolist()} entries, expected "
                                 f"{want}" + (" (the default tail: T while T <= C, else T mod C)" if tail is None else ""))
        outs = [o]
        for t in range(prompt, case.T):
            ot, buf = impl.buffered_decode(**_sl(x, slice(t, t + 1)), buffer=buf, **_scale(case))
            outs.append(ot)
        return torch.cat(outs, dim=1), owned_state(impl.flush(buf))

    head = prompt - want[0]  # folded by prefill in chunks of chunk_size; the rest is the buffer's
    starts = list(range(0, head, chunk_size)) + _decode_folds(head, want[0], range(prompt, case.T), capacity)
    own = _stack_forms([_buffer_form(x, b, 0, case.T, None if S0d is None else S0d[b : b + 1], starts, dtype,
                                     case.scale) for b in range(case.B)])
    oracle = _oracle_run(dtype, lambda: run(ref))
    if oracle is not None:
        own = (own[0] + [oracle[0]], own[1] + [oracle[1]])
    o, final = run(impl)
    name = f"prefill[C={capacity},tail={tail},chunk={chunk_size},initial_state={'S0' if initial else None},{form}]"
    return [_cmp(f"{name}.o", o, o64, _forms(o64, base and base[0], *own[0]), dtype),
            _cmp(f"{name}.state", final, S64, _forms(S64, base and base[1], *own[1], rows=2),
                 torch.promote_types(dtype, torch.float32), head_axis=1)]


def check_materialize(impl, case: Case, dtype: torch.dtype, *, capacity: int, lengths: Sequence[int],
                      form: str = "u", device="cpu", poison: bool = False, stateless: bool = False) -> list[Comparison]:
    """materialize_state(impl) of a ragged buffer holding all T tokens == the recurrence's final state,
    twice in a row (the first call must leave the buffer as it was).  poison: unused slots and the
    state storage of direct-mode requests hold NaN (it must never be read, nor returned).  stateless: when no
    request owns a state, the buffer has no state storage (``state=None``)."""
    _caller_normalised(case, "materialize_state")
    x = case.inputs(dtype, device)
    xd = torch.promote_types(dtype, torch.float32)
    (_, S64), base = truth_and_baseline(x, chunk=capacity)
    buf = buffer_to(ragged_buffer(upcast_inputs(x, device=None), lengths, capacity, form, compute_dtype(dtype)),
                    dtype=xd, device=device,
                    key_dtype=dtype)
    prepared = lambda b: b.replace(state=None) if stateless and not bool(b.has_state.any()) else b  # noqa: E731
    own = _stack_forms([[(S, S) for _, S in _buffer_form(x, b, case.T - int(lengths[b]), case.T, _stored_state(buf, b),
                                                         [case.T - int(lengths[b])], dtype, None)]
                        for b in range(case.B)])
    oracle = _oracle_run(dtype, lambda: ref.materialize_state(prepared(KVBuffer(**buf.cloned()))))
    if oracle is not None:
        own = (own[0], own[1] + [oracle])
    buf = prepared(poison_unused(buf) if poison else buf)
    name = f"materialize_state[C={capacity},{form}]"
    res = []
    for i in range(2):
        S = impl.materialize_state(buf)
        res.append(_cmp(f"{name}.call{i + 1}", S, S64, _forms(S64, base and base[1], *own[1], rows=2), xd,
                        head_axis=1))
    return res


# ----------------------------------------------------------------------------- engine inputs
#: The five results of ``engine_inputs``, in order.
ENGINE_OUTPUTS = ("q", "k", "v", "g", "beta")


def engine_case_inputs(case: Case, dtype: torch.dtype, device="cpu", decode: bool = False) -> dict:
    """mixed_qkv, a, b, A_log, dt_bias of ``case`` for ``engine_inputs``, drawn in float64 on the CPU from
    ``case.seed``, then rounded to ``dtype`` (every one of them).  decode: mixed_qkv [N, D] and a, b [N, HV] with
    N = case.B (``case.T`` must be 1); else [B, T, D] and [B, T, HV].

    q and k heads: rows of unit norm (``case.norm`` "unit"), or ("any") of norm 10^-1 .. 10 with a quarter of
    them tiny (10^-3.5 .. 10^-2, where the norm's eps = 1e-6 under the square root is visible; one such q row and
    k row in every request at least) and an eighth large (10^2 .. 10^3); at one token of every request q and k
    of head 0 point opposite ways (swapped q and k differ at any K); v of one drawn scale 10^-2 .. 10^2.
    Gates by ``case.gate``: "mild": a in [-3, 3], A_log in [-2, 0.5], dt_bias in [-1, 1]; any other regime the
    ranges engines see: a in [-30, 40] with a quarter of a + dt_bias within 1 of the softplus threshold (20),
    A_log in [-5, 3], dt_bias in [-5, 5] (g down to -20 * 45, past every reset gate); "reset" also puts
    +inf or -inf at a third of the elements of a and of b (at most 8 each; none where there are fewer than 3).
    In every regime one gate per request has a + dt_bias in [-5, 5] (a decay no dtype rounds to 0).  b: in [-20, 20] half of
    the time, N(0, 2^2) else."""
    if decode and case.T != 1:
        raise ValueError(f"decode: mixed_qkv [N, D] is one token per request, got case.T = {case.T}")
    f64 = torch.float64
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V

    def uni(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f64)

    qk = torch.randn(B, T, 2, H, K, generator=gen, dtype=f64)
    qk = qk / qk.norm(dim=-1, keepdim=True).clamp(min=1e-300)
    if T > 0:  # q and k of head 0 antiparallel at one token of every request: a q/k mix-up shows at any K (K = 1 too)
        t = torch.randint(0, T, (B,), generator=gen)
        qk[torch.arange(B), t, 1, 0] = -qk[torch.arange(B), t, 0, 0]
    if case.norm == "any":
        r = torch.rand(B, T, 2, H, 1, generator=gen, dtype=f64)
        n = torch.where(r < 0.25, 10.0 ** uni(-3.5, -2.0, B, T, 2, H, 1),
                        torch.where(r < 0.375, 10.0 ** uni(2.0, 3.0, B, T, 2, H, 1), 10.0 ** uni(-1.0, 1.0, B, T, 2, H, 1)))
        if T > 0:
            t = torch.randint(0, T, (B,), generator=gen)
            n[torch.arange(B), t, :, 0] = 10.0 ** uni(-3.5, -2.0, B, 2, 1)
        qk = qk * n
    v = torch.randn(B, T, HV, V, generator=gen, dtype=f64) * 10.0 ** float(uni(-2.0, 2.0, 1))
    mixed = torch.cat([qk[:, :, 0].flatten(-2), qk[:, :, 1].flatten(-2), v.flatten(-2)], dim=-1)
    if case.gate == "mild":
        A_log, dt_bias, a = uni(-2.0, 0.5, HV), uni(-1.0, 1.0, HV), uni(-3.0, 3.0, B, T, HV)
    else:
        A_log, dt_bias, a = uni(-5.0, 3.0, HV), uni(-5.0, 5.0, HV), uni(-30.0, 40.0, B, T, HV)
        near = torch.rand(B, T, HV, generator=gen, dtype=f64) < 0.25
        a = torch.where(near, SOFTPLUS_THRESHOLD - dt_bias + uni(-1.0, 1.0, B, T, HV), a)
    b = torch.where(torch.rand(B, T, HV, generator=gen, dtype=f64) < 0.5, uni(-20.0, 20.0, B, T, HV),
                    2.0 * torch.randn(B, T, HV, generator=gen, dtype=f64))
    if case.gate == "reset":  # +-inf at a third of the elements (at most 8) of a and of b: the rest stay finite
        for x in (a, b):
            n = min(x.numel() // 3, 8)
            at = torch.randperm(x.numel(), generator=gen)[:n]
            x.view(-1)[at] = torch.where(torch.rand(n, generator=gen) < 0.5, float("inf"), float("-inf")).to(f64)
    if T > 0:  # one gate per request of a moderate decay (a + dt_bias in [-5, 5]: g above -100, never clamped)
        t, h = torch.randint(0, T, (B,), generator=gen), torch.randint(0, HV, (B,), generator=gen)
        a[torch.arange(B), t, h] = uni(-5.0, 5.0, B) - dt_bias[h]
    if decode:
        mixed, a, b = mixed[:, 0], a[:, 0], b[:, 0]
    out = dict(mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    return {n: t.to(device=device, dtype=dtype) for n, t in out.items()}


def engine_map_in(x: dict, compute: torch.dtype, num_heads: int, head_k_dim: int, qk_l2norm: bool = True) -> tuple:
    """``kvbuffer_ref.engine_inputs``' map on the (already rounded) inputs ``x`` with every operation in
    ``compute`` (float32 for float32 and 16-bit inputs): what a correct implementation computing in that dtype
    returns, (q, k, v, g, beta) shaped as the oracle's, all in ``compute``."""
    m = x["mixed_qkv"].detach()
    H, K, HV = num_heads, head_k_dim, x["A_log"].shape[0]
    B, T = (m.shape[0], 1) if m.dim() == 2 else tuple(m.shape[:2])
    xm = m.reshape(B, T, m.shape[-1]).to(compute)
    q = xm[..., :H * K].unflatten(-1, (H, K))
    k = xm[..., H * K:2 * H * K].unflatten(-1, (H, K))
    v = xm[..., 2 * H * K:].unflatten(-1, (HV, -1))
    if qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + NORM_EPS)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + NORM_EPS)
    z = x["a"].detach().reshape(B, T, HV).to(compute) + x["dt_bias"].detach().to(compute)
    sp = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z)))
    g = -torch.exp(x["A_log"].detach().to(compute)) * sp
    g = torch.where(sp == 0, torch.zeros_like(g), torch.where(torch.isinf(sp), torch.full_like(g, -torch.inf), g))
    g = g.clamp(min=-RESET_GATE[compute])
    beta = torch.sigmoid(x["b"].detach().reshape(B, T, HV).to(compute))
    return q, k, v, g, beta


def check_engine_inputs(impl, case: Case, dtype: torch.dtype, device="cpu", *, decode: bool = False
                        ) -> list[Comparison]:
    """engine_inputs(impl) == ``kvbuffer_ref.engine_inputs`` on the same inputs upcast to float64: q, k, v, g
    and beta each, under the one tolerance table (``engine_case_inputs`` draws them; ``decode``: the [N, D] form).

    Each output is judged in its own dtype's row (q, k, g, beta in float32 for 16-bit inputs, as the oracle
    returns them; v in mixed_qkv's dtype), the baseline the worst, row by row, of the oracle's float64 map
    rounded once to that dtype and the map run operation by operation in the compute dtype
    (``engine_map_in``), rounded to it (float64 lanes: none, only the floor counts).  Gates below
    ``-RESET_GATE`` of the compute dtype (their decay is 0 there, as every operation takes them) count as that
    value, in the truth and the result alike: -inf, -1e30 or -900 for a gate of -900 are all correct."""
    x = engine_case_inputs(case, dtype, device, decode)
    kw = dict(num_heads=case.H, head_k_dim=case.K, qk_l2norm=True)
    x64 = upcast_inputs(x, device=None)
    truth = ref.engine_inputs(x64["mixed_qkv"], x64["a"], x64["b"], A_log=x64["A_log"], dt_bias=x64["dt_bias"], **kw)
    got = impl.engine_inputs(x["mixed_qkv"], x["a"], x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"], **kw)
    tag = f"engine_inputs[{'[N, D]' if decode else '[B, T, D]'}]"
    if not isinstance(got, (tuple, list)) or len(got) != len(ENGINE_OUTPUTS):
        raise AssertionError(f"[wrong-result] {tag}: expected (q, k, v, g, beta), got "
                             f"{type(got).__name__}{'' if not isinstance(got, (tuple, list)) else f' of {len(got)}'}")
    compute = compute_dtype(dtype)
    forms = None if dtype == torch.float64 else engine_map_in(x, compute, **kw)
    low = -RESET_GATE[compute]
    res = []
    for i, (name, out, t) in enumerate(zip(ENGINE_OUTPUTS, got, truth)):
        if isinstance(out, torch.Tensor) and (not out.is_floating_point() or tuple(out.shape) != tuple(t.shape)):
            raise AssertionError(f"[wrong-result] {tag}.{name}: expected a floating tensor of shape {list(t.shape)} "
                                 f"(as kvbuffer_ref.engine_inputs), got {out.dtype} of shape {list(out.shape)}")
        t = t.detach().cpu()
        f = None if forms is None else forms[i].detach().cpu()
        if name == "g" and isinstance(out, torch.Tensor):
            t, out = t.clamp(min=low), out.clamp(min=low)
            f = None if f is None else f.clamp(min=low)
        od = out.dtype if isinstance(out, torch.Tensor) else dtype
        # row by row (a token's head; for g and beta each element) the form furthest from the truth
        e = (lambda y: y) if t.dim() == 4 else (lambda y: y[..., None])  # noqa: E731
        base = None if f is None else worst_rows(e(t), [e(t.to(od)), e(f.to(od))], 3).reshape(t.shape)
        res.append(_cmp(f"{tag}.{name}", out, t, base, od))
    return res
