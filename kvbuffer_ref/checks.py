"""Input validation for every public operation, in one place.

Each check raises ``ValueError`` (wrong shape, value or device) or ``TypeError``
(wrong kind of object or dtype) with a message that names the argument, what was
expected and what was given.  Both packages (``kvbuffer_ref`` and
``kvbuffer_fast``) call these functions, so the two cannot drift apart.

Shapes follow DESIGN.md §2 / docs/conventions.md::

    q, k : [B, T, H, K]      v : [B, T, HV, V]      HV % H == 0
    g    : [B, T, HV] (scalar GDN gate) or [B, T, HV, K] (per-channel KDA gate)
    beta : [B, T, HV]        state : [B, HV, K, V]
"""

from __future__ import annotations

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
    "check_counts",
    "check_nodes",
    "check_capacity",
    "check_buffer",
    "check_flush_count",
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


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def _require_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _require_float(name: str, x: torch.Tensor) -> None:
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")


def _require_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got rank {x.dim()} with shape {_shape(x)}")


def _require_dim(name: str, x: torch.Tensor, axis: int, expected: int, what: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name}: dimension {axis} ({what}) must be {expected} to match the other inputs, "
            f"got {x.shape[axis]} (shape {_shape(x)})"
        )


def _require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on device {device} (the device of q), got one on {x.device}")


def check_tokens(q, k, v, g, beta) -> Dims:
    """Check the per-token inputs of any operation and return their sizes.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K]; beta: [B, T, HV].
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(name, x)
        _require_float(name, x)
    _require_rank("q", q, 4, "[B, T, H, K]")
    _require_rank("k", k, 4, "[B, T, H, K]")
    _require_rank("v", v, 4, "[B, T, HV, V]")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {_shape(q)} ([B, T, H, K]), got {_shape(k)}")
    _require_dim("v", v, 0, B, "batch B")
    _require_dim("v", v, 1, T, "tokens T")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(
            f"v: the number of value heads HV={HV} must be a positive multiple of the q/k heads H={H} "
            f"(value head i uses q/k head i // (HV // H))"
        )
    if g.dim() == 3:
        channel = False
        if tuple(g.shape) != (B, T, HV):
            raise ValueError(f"g: expected [B, T, HV] = [{B}, {T}, {HV}] (scalar gate) or "
                             f"[B, T, HV, K] = [{B}, {T}, {HV}, {K}] (per-channel gate), got {_shape(g)}")
    elif g.dim() == 4:
        channel = True
        if tuple(g.shape) != (B, T, HV, K):
            raise ValueError(f"g: expected [B, T, HV] = [{B}, {T}, {HV}] (scalar gate) or "
                             f"[B, T, HV, K] = [{B}, {T}, {HV}, {K}] (per-channel gate), got {_shape(g)}")
    else:
        raise ValueError(f"g: expected rank 3 [B, T, HV] (scalar gate) or rank 4 [B, T, HV, K] "
                         f"(per-channel gate), got rank {g.dim()} with shape {_shape(g)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta: expected [B, T, HV] = [{B}, {T}, {HV}], got {_shape(beta)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_device(name, x, q.device)
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, channel_gate=channel)


def check_state(name: str, state, dims: Dims, device: torch.device) -> Optional[torch.Tensor]:
    """Check an optional state [B, HV, K, V]."""
    if state is None:
        return None
    _require_tensor(name, state)
    _require_float(name, state)
    expected = (dims.B, dims.HV, dims.K, dims.V)
    if tuple(state.shape) != expected:
        raise ValueError(f"{name}: expected [B, HV, K, V] = [{', '.join(map(str, expected))}], got {_shape(state)}")
    _require_device(name, state, device)
    return state


def check_scale(scale, K: int) -> float:
    """Return the query scale: ``scale`` if given (a positive finite number), else K ** -0.5."""
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    return float(scale)


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


def _require_int_tensor(name: str, x, shape: tuple, layout: str, device: torch.device) -> torch.Tensor:
    _require_tensor(name, x)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected {layout} = [{', '.join(map(str, shape))}], got {_shape(x)}")
    _require_device(name, x, device)
    return x


def check_parents(parents, B: int, D: int, device: torch.device) -> torch.Tensor:
    """Check draft parent indices [B, D]: parents[b, i] in -1..i-1 (-1 = the buffer's tail).

    Parents must precede their children, so the drafts are in topological order.
    Returns the default chain (-1, 0, 1, ..., D-2) when ``parents`` is None.
    """
    if parents is None:
        chain = torch.arange(-1, D - 1, device=device, dtype=torch.long)
        return chain.expand(B, D).clone()
    _require_int_tensor("parents", parents, (B, D), "[B, D]", device)
    idx = torch.arange(D, device=device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"parents: entry [{b}, {i}] is {int(parents[b, i])}, expected a value in -1..{i - 1} "
            f"(-1 = the buffer's tail; a parent must come before its child)"
        )
    return parents.long()


def check_num_drafts(num_drafts, B: int, D: int, device: torch.device) -> torch.Tensor:
    """Check per-request draft counts [B] in 0..D; the default is D for every request."""
    if num_drafts is None:
        return torch.full((B,), D, dtype=torch.long, device=device)
    _require_int_tensor("num_drafts", num_drafts, (B,), "[B]", device)
    bad = (num_drafts < 0) | (num_drafts > D)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"num_drafts: entry [{b}] is {int(num_drafts[b])}, expected a value in 0..{D} (D = q.shape[1])")
    return num_drafts.long()


def check_counts(counts, num_drafts: torch.Tensor, is_chain: torch.Tensor) -> torch.Tensor:
    """Check per-request accepted counts [B]: counts[b] in 0..num_drafts[b], for chain drafts only."""
    B = num_drafts.shape[0]
    device = num_drafts.device
    if isinstance(counts, int) and not isinstance(counts, bool):
        counts = torch.full((B,), counts, dtype=torch.long, device=device)
    _require_int_tensor("counts", counts, (B,), "[B]", device)
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
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        nodes = torch.full((B,), nodes, dtype=torch.long, device=device)
    _require_int_tensor("nodes", nodes, (B,), "[B]", device)
    bad = (nodes < -1) | (nodes >= num_drafts)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"nodes: entry [{b}] is {int(nodes[b])}, expected -1 (accept none) or a draft index in "
            f"0..{int(num_drafts[b]) - 1} (request {b} verified {int(num_drafts[b])} drafts)"
        )
    return nodes.long()


def check_buffer(buffer, dims: Optional[Dims] = None, device: Optional[torch.device] = None) -> None:
    """Check a KVBuffer's own consistency and, when ``dims`` is given, that it fits the tokens."""
    from .buffer import KVBuffer

    if not isinstance(buffer, KVBuffer):
        raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
    k, lengths = buffer.k, buffer.lengths
    _require_rank("buffer.k", k, 4, "[B, C, H, K]")
    B, C, H, K = k.shape
    has_u = buffer.u is not None or buffer.G is not None
    has_raw = buffer.v is not None or buffer.g is not None or buffer.beta is not None
    if has_u == has_raw:
        raise ValueError("buffer: expected exactly one form populated: (u, G) for the u-cache or (v, g, beta) for raw")
    if has_u and (buffer.u is None or buffer.G is None):
        raise ValueError("buffer: the u-cache form needs both u and G")
    if has_raw and (buffer.v is None or buffer.g is None or buffer.beta is None):
        raise ValueError("buffer: the raw form needs v, g and beta")
    vals = buffer.values
    _require_rank(f"buffer.{'u' if has_u else 'v'}", vals, 4, "[B, C, HV, V]")
    HV, V = vals.shape[2], vals.shape[3]
    if tuple(vals.shape[:2]) != (B, C):
        raise ValueError(f"buffer.{'u' if has_u else 'v'}: expected leading dims [B, C] = [{B}, {C}], got {_shape(vals)}")
    if HV % H != 0:
        raise ValueError(f"buffer: value heads HV={HV} must be a multiple of key heads H={H}")
    gname = "buffer.G" if has_u else "buffer.g"
    gates = buffer.gates
    if tuple(gates.shape) not in ((B, C, HV), (B, C, HV, K)):
        raise ValueError(f"{gname}: expected [B, C, HV] = [{B}, {C}, {HV}] or [B, C, HV, K] = [{B}, {C}, {HV}, {K}], "
                         f"got {_shape(gates)}")
    if has_raw and tuple(buffer.beta.shape) != (B, C, HV):
        raise ValueError(f"buffer.beta: expected [B, C, HV] = [{B}, {C}, {HV}], got {_shape(buffer.beta)}")
    _require_int_tensor("buffer.lengths", lengths, (B,), "[B]", k.device)
    bad = (lengths < 0) | (lengths > C)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"buffer.lengths: entry [{b}] is {int(lengths[b])}, expected a value in 0..{C} (the capacity)")
    hs = buffer.has_state
    _require_tensor("buffer.has_state", hs)
    if hs.dtype != torch.bool or tuple(hs.shape) != (B,):
        raise ValueError(f"buffer.has_state: expected a bool tensor [B] = [{B}], got {hs.dtype} {_shape(hs)}")
    if buffer.state is None:
        if bool(hs.any()):
            raise ValueError("buffer.has_state: a request is marked as owning a state but buffer.state is None")
    else:
        st = buffer.state
        _require_float("buffer.state", st)
        if tuple(st.shape) != (B, HV, K, V):
            raise ValueError(f"buffer.state: expected [B, HV, K, V] = [{B}, {HV}, {K}, {V}], got {_shape(st)}")
    for name in ("u", "G", "v", "g", "beta", "state", "has_state", "lengths"):
        x = getattr(buffer, name)
        if x is not None:
            _require_device(f"buffer.{name}", x, k.device)
            if name not in ("has_state", "lengths"):
                _require_float(f"buffer.{name}", x)
    if dims is not None:
        got = dict(B=B, H=H, HV=HV, K=K, V=V)
        want = dict(B=dims.B, H=dims.H, HV=dims.HV, K=dims.K, V=dims.V)
        for key in got:
            if got[key] != want[key]:
                raise ValueError(f"buffer: its {key}={got[key]} does not match the tokens' {key}={want[key]}")
        if buffer.channel_gate != dims.channel_gate:
            kinds = {False: "scalar [B, T, HV]", True: "per-channel [B, T, HV, K]"}
            raise ValueError(f"g: the buffer holds {kinds[buffer.channel_gate]} gates but g is {kinds[dims.channel_gate]}")
    if device is not None:
        _require_device("buffer", k, device)


def check_flush_count(count, lengths: torch.Tensor, check_values: bool = True) -> torch.Tensor:
    """Check ``flush``'s count (None = every entry, an int, or an integer tensor [B], each in
    0..lengths[b]) and return it as a [B] int64 tensor on the lengths' device.

    ``check_values=False`` skips the range check, which reads device values (a host sync).
    """
    B = lengths.shape[0]
    if count is None:
        return lengths.clone()
    if isinstance(count, int) and not isinstance(count, bool):
        count = torch.full((B,), count, dtype=torch.long, device=lengths.device)
    if not isinstance(count, torch.Tensor) or count.dtype.is_floating_point or count.dtype == torch.bool \
            or tuple(count.shape) != (B,):
        desc = f"{count.dtype} {list(count.shape)}" if isinstance(count, torch.Tensor) else type(count).__name__
        raise ValueError(f"count: expected None, an int or an integer tensor [B] = [{B}], got {desc}")
    count = count.to(device=lengths.device, dtype=torch.long)
    if check_values:
        bad = (count < 0) | (count > lengths)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"count: entry [{b}] is {int(count[b])}, expected a value in 0..{int(lengths[b])} "
                             f"(request {b}'s buffer length)")
    return count.contiguous()
