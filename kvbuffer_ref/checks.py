"""Argument checks for every public operation, in one place.

Each check raises ``ValueError`` (wrong shape, value or device) or ``TypeError``
(wrong kind of object or dtype) with a message that names the argument, what was
expected and what was given.  Both packages (``kvbuffer_ref`` and
``kvbuffer_fast``) call these functions, so the two cannot drift apart.

Shapes (docs/conventions.md)::

    q, k : [B, T, H, K]      v : [B, T, HV, V]      HV % H == 0
    g    : [B, T, HV] (scalar GDN gate) or [B, T, HV, K] (per-channel KDA gate)
    beta : [B, T, HV]        state : [B, HV, K, V]
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "Dims",
    "check_tokens",
    "check_state",
    "check_scale",
    "check_chunk_size",
    "check_parents",
    "check_num_drafts",
    "check_fold",
    "check_accept_fold",
    "require_no_fold",
    "check_counts",
    "check_nodes",
    "check_capacity",
    "check_buffer",
    "check_flush_count",
    "check_gate_values",
    "check_count_arg",
    "RESET_GATE",
    "require_tensor",
    "require_float",
    "require_rank",
    "require_dim",
    "require_device",
    "require_int_tensor",
    "shape_str",
    "byte_range",
]


@dataclass(frozen=True)
class Dims:
    """The sizes shared by one call: batch, tokens, q/k heads, value heads, key and value dims."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    channel_gate: bool

    @property
    def group(self) -> int:
        """Value heads per q/k head (value head i reads q/k head i // group)."""
        return self.HV // self.H


def shape_str(x: torch.Tensor) -> str:
    """``[2, 3, 4]``: a shape as the error messages print it."""
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def require_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def require_float(name: str, x: torch.Tensor) -> None:
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")


def require_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got rank {x.dim()} with shape {shape_str(x)}")


def require_dim(name: str, x: torch.Tensor, axis: int, expected: int, what: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name}: dimension {axis} ({what}) must be {expected} to match the other inputs, "
            f"got {x.shape[axis]} (shape {shape_str(x)})"
        )


def same_device(a, b) -> bool:
    """torch.device('cuda') and torch.device('cuda:0') are the same device when 0 is the current one."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (current if a.index is None else a.index) == (current if b.index is None else b.index)
    return a.index == b.index


def byte_range(x: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a (non-empty) tensor's elements span: from its sizes and strides (host
    arithmetic only: no device access, so it runs under CUDA graph capture too)."""
    start = x.data_ptr()
    return start, start + (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()


def require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if not same_device(x.device, device):
        raise ValueError(f"{name}: expected a tensor on device {device} (the device of q), got one on {x.device}")


def check_tokens(q, k, v, g, beta) -> Dims:
    """Check the per-token inputs of any operation and return their sizes.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K]; beta: [B, T, HV].
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require_tensor(name, x)
        require_float(name, x)
    require_rank("q", q, 4, "[B, T, H, K]")
    require_rank("k", k, 4, "[B, T, H, K]")
    require_rank("v", v, 4, "[B, T, HV, V]")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {shape_str(q)} ([B, T, H, K]), got {shape_str(k)}")
    require_dim("v", v, 0, B, "batch B")
    require_dim("v", v, 1, T, "tokens T")
    HV, V = v.shape[2], v.shape[3]
    if H == 0:
        raise ValueError(f"q: the number of q/k heads H (dimension 2) must be positive, got shape {shape_str(q)}")
    if K == 0:
        raise ValueError(f"q: the key dimension K (dimension 3) must be positive, got shape {shape_str(q)}")
    if V == 0:
        raise ValueError(f"v: the value dimension V (dimension 3) must be positive, got shape {shape_str(v)}")
    if HV == 0 or HV % H != 0:
        raise ValueError(
            f"v: the number of value heads HV={HV} must be a positive multiple of the q/k heads H={H} "
            f"(value head i uses q/k head i // (HV // H))"
        )
    if g.dim() == 3:
        channel = False
        if tuple(g.shape) != (B, T, HV):
            raise ValueError(f"g: expected [B, T, HV] = [{B}, {T}, {HV}] (scalar gate) or "
                             f"[B, T, HV, K] = [{B}, {T}, {HV}, {K}] (per-channel gate), got {shape_str(g)}")
    elif g.dim() == 4:
        channel = True
        if tuple(g.shape) != (B, T, HV, K):
            raise ValueError(f"g: expected [B, T, HV] = [{B}, {T}, {HV}] (scalar gate) or "
                             f"[B, T, HV, K] = [{B}, {T}, {HV}, {K}] (per-channel gate), got {shape_str(g)}")
    else:
        raise ValueError(f"g: expected rank 3 [B, T, HV] (scalar gate) or rank 4 [B, T, HV, K] "
                         f"(per-channel gate), got rank {g.dim()} with shape {shape_str(g)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta: expected [B, T, HV] = [{B}, {T}, {HV}], got {shape_str(beta)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        require_device(name, x, q.device)
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel)


def check_state(name: str, state, dims: Dims, device: torch.device) -> Optional[torch.Tensor]:
    """Check an optional state [B, HV, K, V]."""
    if state is None:
        return None
    require_tensor(name, state)
    require_float(name, state)
    expected = (dims.B, dims.HV, dims.K, dims.V)
    if tuple(state.shape) != expected:
        raise ValueError(f"{name}: expected [B, HV, K, V] = [{', '.join(map(str, expected))}], got {shape_str(state)}")
    require_device(name, state, device)
    return state


def check_scale(scale, K: int) -> float:
    """Return the query scale: ``scale`` if given (a positive finite number), else K ** -0.5."""
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or isinstance(scale, torch.Tensor):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    try:  # a Python or NumPy int or float (numpy.float32, numpy.int64 included)
        value = float(scale)
    except OverflowError:
        value = float("inf")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    return value


def check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    return chunk_size


def check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity: expected an int, got {type(capacity).__name__}")
    if capacity < 1:
        raise ValueError(f"capacity: expected a positive int, got {capacity}")
    return capacity


def require_int_tensor(name: str, x, shape: tuple, layout: str, device: torch.device) -> torch.Tensor:
    require_tensor(name, x)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected {layout} = [{', '.join(map(str, shape))}], got {shape_str(x)}")
    require_device(name, x, device)
    return x


def check_parents(parents, B: int, D: int, device: torch.device, name: str = "parents") -> torch.Tensor:
    """Check draft parent indices [B, D]: parents[b, i] in -1..i-1 (-1 = the buffer's tail).

    Parents must precede their children, so the drafts are in topological order.
    Returns the default chain (-1, 0, 1, ..., D-2) when ``parents`` is None.
    """
    if parents is None:
        chain = torch.arange(-1, D - 1, device=device, dtype=torch.long)
        return chain.expand(B, D).clone()
    require_int_tensor(name, parents, (B, D), "[B, D]", device)
    idx = torch.arange(D, device=device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: entry [{b}, {i}] is {int(parents[b, i])}, expected a value in -1..{i - 1} "
            f"(-1 = the buffer's tail; a parent must come before its child)"
        )
    return parents.long()


def check_num_drafts(num_drafts, B: int, D: int, device: torch.device, name: str = "num_drafts") -> torch.Tensor:
    """Check per-request draft counts [B] in 0..D; the default is D for every request."""
    if num_drafts is None:
        return torch.full((B,), D, dtype=torch.long, device=device)
    require_int_tensor(name, num_drafts, (B,), "[B]", device)
    bad = (num_drafts < 0) | (num_drafts > D)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}: entry [{b}] is {int(num_drafts[b])}, expected a value in 0..{D} (D = q.shape[1])")
    return num_drafts.long()


def check_counts(counts, num_drafts: torch.Tensor, is_chain: torch.Tensor) -> torch.Tensor:
    """Check per-request accepted counts [B]: counts[b] in 0..num_drafts[b], for chain drafts only."""
    B = num_drafts.shape[0]
    device = num_drafts.device
    counts = check_count_arg("counts", counts, B, device, "0..num_drafts[b]")
    bad = (counts < 0) | (counts > num_drafts)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"counts: entry [{b}] is {int(counts[b])}, expected a value in 0..{int(num_drafts[b])} "
            f"(the number of drafts verified for request {b})"
        )
    not_chain = (~is_chain) & (counts > 0)
    if bool(not_chain.any()):
        b = int(not_chain.nonzero()[0, 0])
        raise ValueError(
            f"counts: request {b}'s drafts form a tree, not a chain, so 'the first m drafts' is not a path; "
            f"pass nodes= (the accepted node per request) instead"
        )
    return counts.long()


def check_nodes(nodes, num_drafts: torch.Tensor) -> torch.Tensor:
    """Check per-request accepted nodes [B]: -1 (accept none) or a draft index below num_drafts[b]."""
    B = num_drafts.shape[0]
    device = num_drafts.device
    nodes = check_count_arg("nodes", nodes, B, device, "-1..num_drafts[b]-1")
    bad = (nodes < -1) | (nodes >= num_drafts)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"nodes: entry [{b}] is {int(nodes[b])}, expected -1 (accept none) or a draft index in "
            f"0..{int(num_drafts[b]) - 1} (request {b} verified {int(num_drafts[b])} drafts)"
        )
    return nodes.long()


def check_buffer(buffer, dims: Optional[Dims] = None, device: Optional[torch.device] = None, *,
                 values: bool = True) -> None:
    """Check a KVBuffer's own consistency and, when ``dims`` is given, that it fits the tokens
    (``values=False``: without the check that reads device memory).

    The invariants are the buffer's own (``KVBuffer.check`` in kvbuffer_ref/buffer.py); this module
    only checks that it is given a buffer, so it needs no import of the class.
    """
    check = getattr(buffer, "check", None)
    if not (callable(check) and callable(getattr(type(buffer), "slot_fields", None))):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    check(dims, device, values=values)


def check_flush_count(count, lengths: torch.Tensor, check_values: bool = True) -> torch.Tensor:
    """Check ``flush``'s count (None = every entry, an int, or an integer tensor [B], each in
    0..lengths[b]) and return it as a [B] int64 tensor on the lengths' device.

    ``check_values=False`` skips the range check, which reads device values (a host sync).
    """
    B = lengths.shape[0]
    if count is None:
        return lengths.clone()
    if isinstance(count, torch.Tensor) and (count.dtype.is_floating_point or count.dtype.is_complex
                                            or count.dtype == torch.bool or tuple(count.shape) != (B,)):
        raise ValueError(f"count: expected None, an int or an integer tensor [B] = [{B}], got {count.dtype} "
                         f"{shape_str(count)}")
    count = check_count_arg("count", count, B, lengths.device, "0..lengths[b]").long()
    if check_values:
        bad = (count < 0) | (count > lengths)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"count: entry [{b}] is {int(count[b])}, expected a value in 0..{int(lengths[b])} "
                             f"(request {b}'s buffer length)")
    return count.contiguous()


_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def check_fold(fold, B: int, device: torch.device):
    """``verify``'s ``fold``: a bool (False: nothing folded; True: every request) or a bool tensor [B] on
    ``device`` (the requests that fold).  Returned as False, True or the tensor (contiguous)."""
    if isinstance(fold, bool):
        return fold
    if not isinstance(fold, torch.Tensor):
        raise TypeError(f"fold: expected a bool or a bool tensor [B] = [{B}], got {type(fold).__name__}")
    if fold.dtype != torch.bool or tuple(fold.shape) != (B,):
        raise ValueError(f"fold: expected a bool or a bool tensor [B] = [{B}], got {fold.dtype} {shape_str(fold)}")
    require_device("fold", fold, device)
    return fold.contiguous()


def check_accept_fold(fold) -> bool:
    """``accept``'s ``fold``: True (requests past the capacity fold) or False (the caller's word that none
    does: ``require_no_fold``)."""
    if not isinstance(fold, bool):
        raise TypeError(f"fold: expected True or False, got {type(fold).__name__}")
    return fold


def require_no_fold(who: str, n: int, m: int, capacity: int) -> None:
    """``accept(fold=False)``'s condition for one request (``who``: "request 3", "slot 5 in layer 0"): its n
    buffered plus m accepted entries fit the capacity."""
    if n + m > capacity:
        raise ValueError(f"fold: False, but {who} has {n} entries and gets {m} more, past the capacity C={capacity}, "
                         f"so it must fold; pass fold=True (the default) or fold it first (verify(fold=...) or flush)")


def check_count_arg(name: str, x, B: int, device: torch.device, expected: str) -> torch.Tensor:
    """A per-request integer argument (accepted counts, nodes, flush counts): a Python int (broadcast to
    every request) or an integer tensor [B] on ``device``; returned as a tensor [B].  Booleans, floats and
    ints that do not fit int64 are rejected here; the caller checks the range (``expected`` describes it)."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        raise TypeError(f"{name}: expected an int or an integer tensor [B] = [{B}], got a bool "
                        f"(a value in {expected} is meant)")
    if isinstance(x, numbers.Integral):
        x = int(x)
        if not _INT64[0] <= x <= _INT64[1]:
            raise ValueError(f"{name}: {x} is out of range, expected a value in {expected}")
        return torch.full((B,), x, dtype=torch.long, device=device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an int or an integer tensor [B] = [{B}], got {type(x).__name__}")
    return require_int_tensor(name, x, (B,), "[B]", device)


#: Log-gates below ``-RESET_GATE[compute dtype]`` (-inf included) decay to exactly 0 in that dtype, as
#: ``exp`` underflows (float64: below -745; float32: below -104): the state is reset.  The cumulative-gate
#: forms (chunk, direct, buffered decode, verify) compute decays as ``exp(G_i - G_j)`` from sums ``G`` of
#: the gates; they take such a gate as ``-RESET_GATE``, which still decays to 0 (also behind positive gates
#: of a total below 1254 in float64, 96 in float32) but keeps ``G`` finite and small enough for the later
#: differences to be exact: -inf would give ``-inf - (-inf) = NaN``, and -1e30 would absorb every later gate.
RESET_GATE = {torch.float64: 2000.0, torch.float32: 200.0}


def check_gate_values(g: torch.Tensor, beta: torch.Tensor, valid: Optional[torch.Tensor] = None,
                      below: Optional[float] = None) -> bool:
    """The value domain of the gates and write strengths (docs/conventions.md, "Domain"): ``g`` any
    value but NaN and +inf (``-inf`` is an exact reset; ``g > 0``, a growing state, is defined and
    accepted), ``beta`` finite (normally in [0, 1]; any finite value is defined).  ``valid`` [B, T] bool:
    the token rows to check (verify's padding rows past num_drafts may hold anything).  Reads device
    values, with one host sync; returns whether some (valid) gate is below ``below`` (False for None)."""
    if valid is not None:
        keep = valid.view(*valid.shape, *([1] * (g.dim() - 2)))
        g = torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device))
        beta = torch.where(valid[..., None], beta, torch.zeros((), dtype=beta.dtype, device=beta.device))
    bad_g = torch.isnan(g) | (g == float("inf"))
    bad_beta = ~torch.isfinite(beta)
    flags = [bad_g.any(), bad_beta.any()] + ([(g < below).any()] if below is not None else [])
    flags = torch.stack(flags).tolist() if g.numel() or beta.numel() else [False] * len(flags)
    if flags[0]:
        idx = tuple(int(i) for i in bad_g.nonzero()[0])
        raise ValueError(f"g: entry {list(idx)} is {float(g[idx])}, expected a log-gate that is not NaN or +inf "
                         f"(any finite value, or -inf for a full reset)")
    if flags[1]:
        idx = tuple(int(i) for i in bad_beta.nonzero()[0])
        raise ValueError(f"beta: entry {list(idx)} is {float(beta[idx])}, expected a finite write strength "
                         f"(normally in [0, 1])")
    return bool(flags[2]) if below is not None else False
