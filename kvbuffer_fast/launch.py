"""Launch tables: how each kvbuffer_fast operation launches its kernels, as data.

Every operation has one frozen config class (its tile sizes, warps and launch choices) and one table.
``config_for(op, key)`` starts from the class's defaults and applies, in order, every table row whose
conditions hold for ``key`` (what the choice depends on: buffer capacity, how many state columns the
launch covers, the input dtype, scalar or per-channel gates, the device's compute capability).  The
operations call it when no ``config`` is passed; a benchmark that wants another launch passes
``config=dataclasses.replace(config_for(op, key), ...)`` and never edits module state.

The rows record measurements on an NVIDIA H200 at Qwen3-Next heads (H = 16, HV = 32, K = V = 128);
docs/kernels.md and docs/speculative.md give the numbers, and the options that were measured and
rejected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "Key", "Row", "RecurrentConfig", "DecodeConfig", "FlushConfig", "VerifyConfig", "AcceptConfig",
    "PerDraftStateConfig", "ChunkConfig", "DirectConfig", "PrefillConfig", "CONFIGS", "TABLES", "config_for", "key_of",
    "chunk_smem_bytes", "fit_chunk_tiles", "SM90_SHARED_BYTES", "SIXTEEN_BIT",
]

_INF = float("inf")


@dataclass(frozen=True)
class Key:
    """What a launch choice may depend on.

    C: buffer capacity (0 where the operation has no buffer); columns: B * HV * V, the state columns
    the launch covers (proportional to its programs for any column tile that divides V); dtype: the
    dtype of q and k; channel: per-channel (KDA) gates; capability: (major, minor) of the CUDA device,
    None under the Triton interpreter; state: the dtype of the stored state the launch streams.
    """

    C: int = 0
    columns: int = 0
    dtype: torch.dtype = torch.float32
    channel: bool = False
    capability: Optional[tuple[int, int]] = None
    state: torch.dtype = torch.float32


def key_of(x: torch.Tensor, *, C: int = 0, B: int, HV: int, V: int, channel: bool = False,
           dtype: Optional[torch.dtype] = None, state: Optional[torch.dtype] = None) -> Key:
    """The :class:`Key` of a launch on ``x``'s device (``state``: the stored state's dtype, float32 if None)."""
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    return Key(C=int(C), columns=int(B) * int(HV) * int(V), dtype=dtype or x.dtype, channel=bool(channel),
               capability=cap, state=state or torch.float32)


@dataclass(frozen=True)
class Row:
    """One table row: ``set`` (field -> value) applies where every condition holds.

    Ranges are inclusive (lo, hi), None meaning unbounded; ``dtypes`` (of q and k) and ``states`` (of the
    stored state) None mean any; ``channel`` None means either gate kind; ``capability`` is a range of
    (major, minor), never matching the interpreter unless it is None.
    """

    set: dict
    why: str = ""
    C: tuple = (None, None)
    columns: tuple = (None, None)
    dtypes: Optional[tuple] = None
    channel: Optional[bool] = None
    capability: Optional[tuple] = None
    states: Optional[tuple] = None

    def matches(self, key: Key) -> bool:
        def inside(x, rng):
            lo, hi = rng
            return (lo is None or x >= lo) and (hi is None or x <= hi)

        if not inside(key.C, self.C) or not inside(key.columns, self.columns):
            return False
        if self.dtypes is not None and key.dtype not in self.dtypes:
            return False
        if self.states is not None and key.state not in self.states:
            return False
        if self.channel is not None and key.channel != self.channel:
            return False
        if self.capability is not None:
            if key.capability is None or not inside(key.capability, self.capability):
                return False
        return True


@dataclass(frozen=True)
class RecurrentConfig:
    """recurrent_gated_delta_rule / the recurrent decode step: BV state columns per program."""

    BV: int = 64
    num_warps: int = 2


@dataclass(frozen=True)
class DecodeConfig:
    """buffered_decode: the decode launch ([KB, BV] state blocks, NS stages), the fold launch before it
    (``fold`` 'group': fold_FH value heads per program, [fold_KB, fold_BV] blocks, fold_NS stages,
    serving the tokens of the requests it folds; 'tile': one program per [K, fold_BV] tile, not
    serving) and the bookkeeping launch after it.  ``pdl``: the launches chained by programmatic
    dependent launch (sm_90+; behind the serving fold launch the decode launch waits at its end).
    ``dot``: the decode launch forms S0^T k and S0^T q by one tl.dot per state block where its products
    are exact (a 16-bit state of q's dtype, scalar gates; ``kvbuffer_fast.decode.state_dot``), else by
    fp32 sums."""

    BV: int = 64
    num_warps: int = 2
    KB: int = 32
    NS: int = 1
    pdl: bool = True
    dot: bool = False
    fold: str = "group"
    fold_FH: int = 8
    fold_BV: int = 64
    fold_KB: int = 32
    fold_NS: int = 2
    fold_warps: int = 2


@dataclass(frozen=True)
class FlushConfig:
    """flush: BV state columns per program, FB entries per fold step (one tl.dot).  BV = 64 with 8 warps
    compiles without spills for sm_90 (``scripts/aot_regs.py flush``: 165 registers with scalar gates, 182
    per-channel); BV = 128 with 4 warps spills there (12 and 416 bytes)."""

    BV: int = 64
    num_warps: int = 8
    FB: int = 16


@dataclass(frozen=True)
class VerifyConfig:
    """verify: phase 1 (``prep_warps`` warps, from 32 drafts at least BD / 8 for BD = the draft count rounded up
    to a power of two; a register cap of ``prep_maxnreg``, 0 for none, where the warps are ``prep_warps``) and phase 2
    ([KB, BV] state blocks, NS stages; ``early``: the draft values and u rows loaded before the state
    loop; ``pdl``: phase 2 a programmatic dependent launch of phase 1 on sm_90+; ``prep_per_sm``, scalar
    gates: 0, one phase-1 program per (request, q/k head), phase 2 waiting for the whole launch; N > 0, N
    phase-1 programs per SM taking the pairs in turn and flagging each pair's results ready, each phase-2
    program waiting for its own pair's flag, so that with PDL phase 2 streams the state beside phase 1).
    Its key's ``columns`` count phase 2's programs, 128 columns each, and its dtype is float32 unless q and
    k share a dtype."""

    BV: int = 128
    num_warps: int = 4
    KB: int = 32
    NS: int = 3
    early: bool = False
    pdl: bool = True
    prep_warps: int = 1
    prep_maxnreg: int = 128
    prep_per_sm: int = 0


@dataclass(frozen=True)
class AcceptConfig:
    """accept: the fold launch (``FH`` value heads per program, ``num_warps`` warps, each head's [K, BV] state
    tile in [KB, BV] blocks through ``NS`` pipeline stages; its programs return at once for requests that
    cannot overflow) and the copy launch (P programs per request, P = the request's share of ``programs``,
    the launch's total over requests and, on a pool, layers; at least 1, at most the request's q/k heads,
    the unit a program owns; rows in chunks of at most ``CH`` elements; ``copy_warps`` warps); ``pdl``: each
    launch a programmatic dependent launch of the one before it (sm_90+; it waits for its predecessor
    first, so only the launch latency overlaps)."""

    FH: int = 4
    BV: int = 64
    KB: int = 32
    NS: int = 2
    num_warps: int = 2
    programs: int = 1024
    CH: int = 512
    copy_warps: int = 2
    pdl: bool = True


@dataclass(frozen=True)
class PerDraftStateConfig:
    """The per-draft-state baseline: verify (BV state columns per program, writing one state per draft)
    and accept (copying one back in blocks of accept_block elements)."""

    BV: int = 64
    num_warps: int = 2
    accept_block: int = 2048
    accept_warps: int = 4


@dataclass(frozen=True)
class ChunkConfig:
    """chunk_gated_delta_rule's three launches: the per-chunk prep (``prep_warps`` warps per (chunk,
    value head)), the sequential state pass (``BV`` state columns per (sequence, value head) program,
    ``num_warps`` warps, ``stages`` software-pipeline stages of its chunk loop) and the parallel output
    launch (``out_BV`` columns per (chunk, value head) program, ``out_warps`` warps)."""

    BV: int = 16
    num_warps: int = 4
    stages: int = 1
    prep_warps: int = 4
    out_BV: int = 64
    out_warps: int = 4
    #: 16-bit q, k and v on CUDA: W and U~ (prep) and the output's two products also take 16-bit operands,
    #: h and U are stored in that dtype (the state pass's products always do); False keeps those fp32
    fast16: bool = True


@dataclass(frozen=True)
class DirectConfig(ChunkConfig):
    """direct_gated_delta_rule: the chunk launches from a zero state (fields as :class:`ChunkConfig`)."""


@dataclass(frozen=True)
class PrefillConfig(ChunkConfig):
    """prefill: the chunk launches with the tail written into the buffer (fields as :class:`ChunkConfig`)."""


CONFIGS = {
    "recurrent": RecurrentConfig,
    "decode": DecodeConfig,
    "flush": FlushConfig,
    "verify": VerifyConfig,
    "accept": AcceptConfig,
    "per_draft_state": PerDraftStateConfig,
    "chunk": ChunkConfig,
    "direct": DirectConfig,
    "prefill": PrefillConfig,
}

#: The 16-bit floating dtypes (of q and k, or of a stored state) the tables and launchers key on.
SIXTEEN_BIT = (torch.bfloat16, torch.float16)

#: The chunk launches' rows (chunk, direct and prefill launch the same kernels).
_CHUNK_ROWS: tuple[Row, ...] = (
    Row(dict(prep_warps=8), dtypes=(torch.float32,), capability=((9, 0), None),
        why="fp32 inputs: the per-chunk launch's fp32 [64, 128] tiles with 3xTF32 products spill 11.5 KB per "
            "thread on 4 warps (ptxas for sm_90, Triton 3.9), 0.5 KB on 8"),
    Row(dict(BV=32), dtypes=(torch.float32,), capability=((9, 0), None),
        why="fp32 inputs: the state launch with 32 columns per program took 176 / 682 / 2857 / 5853 against "
            "178 / 730 / 3144 / 6409 us at B = 1, T = 1k / 4k / 16k / 32k"),
    Row(dict(stages=2), dtypes=(torch.float32,), capability=((9, 0), None),
        why="fp32 inputs: the state launch's chunk loop (arithmetic chunk addresses) in 2 stages took 150.0 "
            "against 167.6 us at B = 1, T = 1k (whole call 435.0 against 449.8); 3 stages do not fit at BV = 32"),
    Row(dict(prep_warps=8), dtypes=SIXTEEN_BIT, capability=((0, 0), None),
        why="16-bit inputs: the per-chunk launch on 4 warps, compiled (sm_90, Triton 3.6), computed wrong W / U~ at "
            "K = 16 (direct mode 8.3e-2 / 6.8e-2 off the float64 recurrence in float16 with per-channel / scalar gates "
            "at T = 129, against 4.8e-4 on 8 warps, which is what the interpreter computes) and corrupted memory "
            "(an illegal address on the next launch); docs/kernels.md, Known defects"),
    Row(dict(out_BV=128), dtypes=SIXTEEN_BIT, capability=((9, 0), None),
        why="16-bit inputs: the output launch with 128 columns per program took 20.5 / 57.9 / 199 / 412 against "
            "28.2 / 81.0 / 294 / 607 us at B = 1, T = 1k / 4k / 16k / 32k (57.7 against 81.0 at B = 4, T = 1k)"),
    Row(dict(BV=32), dtypes=SIXTEEN_BIT, capability=((9, 0), None),
        why="16-bit inputs: the state launch with 32 columns per program took 51.3 / 179.8 against 54.0 / 186.7 "
            "us (16 columns, 2 stages) at B = 1, T = 1k / 4k, and 161 against 216 us at B = 4, T = 1k (1 stage)"),
    Row(dict(stages=3), dtypes=SIXTEEN_BIT, capability=((9, 0), None),
        why="16-bit inputs: the state launch's chunk loop in 3 stages took 45.6 / 148.8 / 584.1 / 1137.0 against "
            "51.2 / 180.0 / 699.2 / 1390.2 us (2 stages) at B = 1, T = 1k / 4k / 16k / 32k, and 153.7 / 552.2 / "
            "2163.6 / 4311.2 against 157.2 / 593.3 / 2340.5 / 4674.1 us (1 stage) at B = 4; whole calls 94.3 / "
            "326.2 / 1275.5 / 2559.4 against 98.4 / 358.2 / 1395.9 / 2804.9 us at B = 1"),
)

TABLES: dict[str, tuple[Row, ...]] = {
    "recurrent": (),
    "decode": (
        Row(dict(fold="tile", fold_BV=64, fold_warps=4), C=(33, None),
            why="the grouped fold holds the u rows of all C entries per program: at C = 64 the tile fold "
                "kernel was 2x faster"),
        Row(dict(fold_FH=4), columns=(None, 8 * 1024 * 64 - 1),
            why="fewer than 1024 eight-head fold programs (B < 128 at Qwen3-Next heads): 4 value heads "
                "per program, 50.2 -> 49.5 us per step at B = 64"),
        Row(dict(BV=128), states=SIXTEEN_BIT, capability=((9, 0), None),
            why="a 16-bit state: 128 state columns per program took 45.8 / 159.4 / 308.0 against 51.3 / 184.9 / "
                "359.9 us per step at B = 64 / 256 / 512 (H100); with 2 stages, KB = 16 or 64, 8 warps or a "
                "128-column fold it was slower; a float32 state gains nothing from it (62.0 against 62.6 us)"),
        Row(dict(dot=True), states=SIXTEEN_BIT, capability=((9, 0), None),
            why="a 16-bit state with q and k of its dtype: the state sums by tl.dot took 41.8 / 76.3 / 143.2 / "
                "273.2 against 45.8 / 84.2 / 160.1 / 309.3 us per step at B = 64 / 128 / 256 / 512 (H100, bf16); "
                "1 warp, 2 or 3 stages or KB = 64 were within 5 % (up to 2 % faster at B = 512, up to 5 % slower "
                "at B = 64), the cached keys' scores by tl.dot too slower, 4 warps 1.8x slower"),
    ),
    "flush": (),
    "verify": (
        Row(dict(early=True), columns=(None, 2048 * 128),
            why="at most 2048 phase-2 programs (B = 64): the early loads were faster, 74.5 against 77.0 us"),
        Row(dict(early=True), dtypes=SIXTEEN_BIT, channel=False,
            why="16-bit q and k take the two-piece TF32 X S0 product, with which the early loads are faster "
                "on an fp32 state (H200: 60.0 against 61.9 us at B = 64, 394.7 against 401.5 at B = 512) and "
                "within 1.2 % on a bf16 one (282.1 against 284.0 at B = 512, 44.5 against 44.0 at B = 64)"),
        Row(dict(KB=16, NS=4), C=(None, 16), columns=(None, 2048 * 128), dtypes=SIXTEEN_BIT, channel=False,
            why="the two-piece product, at most 2048 programs and <= 16 buffer rows: 70.4 against 72.5 us "
                "at B = 64; slower at B = 128 and with C = 32"),
        Row(dict(KB=32, NS=3), columns=(None, 2048 * 128), dtypes=SIXTEEN_BIT, channel=False,
            states=SIXTEEN_BIT, capability=((9, 0), None),
            why="a 16-bit state, at most 2048 programs: 32-row state blocks in 3 stages took verify to 55.1 "
                "against 58.5 us with 16-row blocks (B = 64, H100, bf16; phase 1 then uncapped)"),
    ),
    "accept": (),
    "per_draft_state": (),
    "chunk": _CHUNK_ROWS,
    "direct": _CHUNK_ROWS,
    "prefill": _CHUNK_ROWS,
}


#: Shared memory per block on the devices the tables target (NVIDIA H100 / H200, sm_90: 227 KB opt-in).
SM90_SHARED_BYTES = 232448


def chunk_smem_bytes(launch: str, cfg, *, dtype: torch.dtype, K: int = 128, V: int = 128, BT: int = 64) -> int:
    """Shared memory of one chunk launch ("prep", "state" or "output") for q/k dtype ``dtype`` on sm_90: the
    operand tiles of its products staged at once (fp32 inputs take 3xTF32 products, whose split operands
    double them; the state launch: W [BT, K], the [K, BV] state, for 16-bit inputs U, and with a pipelined
    chunk loop (stages > 1) a bound: every stage holding a chunk's W, K and U~).  Fitted to the sizes
    Triton 3.9 allocates when compiling for sm_90 at K = V = 128, BT = 64, where it is exact with one
    stage: state 73728 / 81920 / 98304 B (fp32, BV = 16 / 32 / 64), 45056 / 57344 / 81920 B (bf16); with
    2 stages 106496 / 102400 B (fp32 / bf16, BV = 16) against bounds of 212992 / 151552 B; output 98304 / 131072 B (fp32, out_BV = 32 / 64), 65536 /
    98304 B (bf16, out_BV = 64 / 128); prep 131072 / 49152 B (fp32 / bf16, scalar gates; 98304 B for
    fp32 per-channel gates, below the estimate)."""
    from triton import next_power_of_2 as p2
    BK, BVF = p2(max(16, K)), p2(max(16, V))
    split = 2 if dtype == torch.float32 else 1
    if launch == "prep":
        e = 4 if dtype == torch.float32 else 2
        return split * max(2 * BT * BK * e, (BT * BT + BT * max(BK, BVF)) * 4)
    if launch == "state":
        BV = max(16, min(cfg.BV, BVF))
        one = split * BT * BK * 4 + BK * BV * 4 + (0 if split == 2 else BT * BV * 4)
        if cfg.stages <= 1:
            return one
        e = 4 if dtype == torch.float32 else 2
        return one + cfg.stages * (BT * BK * 4 + BT * BK * e + BT * BV * 4)  # per stage: W, K, U~ of a chunk
    if launch == "output":
        BV = max(16, min(cfg.out_BV, BVF))
        return split * (BT * BK + BK * BV) * 4
    raise ValueError(f"launch: expected 'prep', 'state' or 'output', got {launch!r}")


def fit_chunk_tiles(cfg, *, dtype: torch.dtype, K: int, V: int, BT: int, limit: int):
    """``cfg`` (a chunk, direct or prefill config) with its tiles clamped to the head sizes and lowered until
    the state and output launches fit ``limit`` bytes of shared memory per block by ``chunk_smem_bytes``:
    the state launch's pipeline stages first (its per-stage chunk buffers grow with K), then its value tile
    ``BV``, then the output's ``out_BV``, each down to 1 stage / 16 columns.  The table's rows are measured
    at K = V = 128; wider heads (K or V above 128) take this path.  ValueError naming the launch when even
    the smallest does not fit.  ``dtype``: bfloat16 for 16-bit inputs, float32 for fp32 inputs' split
    products (``chunk_smem_bytes``)."""
    from triton import next_power_of_2 as p2
    BVF = p2(max(16, V))
    c = dataclasses.replace(cfg, BV=max(16, min(cfg.BV, BVF)), out_BV=max(16, min(cfg.out_BV, BVF)))

    def need(name):
        return chunk_smem_bytes(name, c, dtype=dtype, K=K, V=V, BT=BT)

    while c.stages > 1 and need("state") > limit:
        c = dataclasses.replace(c, stages=c.stages - 1)
    while c.BV > 16 and need("state") > limit:
        c = dataclasses.replace(c, BV=c.BV // 2)
    while c.out_BV > 16 and need("output") > limit:
        c = dataclasses.replace(c, out_BV=c.out_BV // 2)
    for name, smallest in (("state", "stages = 1 and BV = 16"), ("output", "out_BV = 16")):
        if need(name) > limit:
            raise ValueError(f"config: the chunk {name} launch needs about {need(name)} B of shared memory at "
                             f"K = {K}, V = {V}, chunk {BT} ({cfg}), the device has {limit} B per block even with "
                             f"{smallest}; use 16-bit inputs or smaller heads")
    return c


def config_for(op: str, key: Key):
    """The launch of ``op`` for ``key``: the config class's defaults with every matching row applied."""
    if op not in CONFIGS:
        raise ValueError(f"op: expected one of {sorted(CONFIGS)}, got {op!r}")
    changes: dict = {}
    for row in TABLES[op]:
        if row.matches(key):
            changes.update(row.set)
    return CONFIGS[op](**changes)


def check_config(op: str, config):
    """``config`` if it is ``op``'s config class, else a TypeError naming the expected class."""
    cls = CONFIGS[op]
    if type(config) is not cls:
        raise TypeError(f"config: expected a kvbuffer_fast.launch.{cls.__name__} (or None for the launch "
                        f"table's choice), got {type(config).__name__}")
    return config
