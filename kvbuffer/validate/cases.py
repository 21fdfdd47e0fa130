"""Deterministic test inputs: a ``Case`` names shapes and regimes plus a seed; tensors come from the seed.

Hypothesis draws the (small, shrinkable) ``Case`` fields; the tensors are generated from them, so a
failing case prints as a short line and replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbuffer_ref.engine_inputs import NORM_EPS

__all__ = ["GATE_REGIMES", "BETA_REGIMES", "NORM_REGIMES", "QK_L2NORM_EPS", "Case", "make_inputs", "cast_inputs",
           "upcast_inputs", "l2norm_qk", "Sizes", "NORMAL", "SMALL", "GPU", "GPU_HEAD_SHAPES", "reset_positions",
           "RAW_GATE_DTYPES", "raw_gate_params", "softplus_inv", "raw_gates_in", "gates_of_raw", "snap_to_raw_gates"]

#: log-gate regimes: exactly 0 (no decay), mild [-0.5, 0], strong [-8, -1], underflowing [-120, -104]
#: (exp(g) is exactly 0 in float32 and below 1e-45 in float64), a per-element mix of those four, the
#: band (-104, -8) where exp(g) is tiny or a float32 subnormal ("band"), a per-element mix ("wide")
#: of everything from 0 down to -200 per token, and resets ("reset": mild gates with one token per
#: request and head a full reset, g = -inf, -1e30 or -300: exp(g) is exactly 0, docs/conventions.md
#: "Reset gates").  Every regime reaches every position in every dtype: a reset's token is any token,
#: half of the time one at a block boundary (``reset_positions``: the first and last tokens and those on
#: either side of every multiple of 16, where a chunked kernel's cumulative gates restart).
GATE_REGIMES = ("zero", "mild", "strong", "underflow", "mixed", "band", "wide", "reset")
#: write-strength regimes: exactly 0, exactly 1, uniform in [0, beta_max], a mix of all three.
BETA_REGIMES = ("zero", "one", "uniform", "mixed")
#: q/k norm regimes: "unit" (L2-normalised rows) or "any" (rows of norm in [0.25, 4] for q and
#: [0.4, 1.25 / sqrt(beta_max)] for k, so the delta rule stays contractive; a zero row stays possible).
NORM_REGIMES = ("unit", "any")
#: (with ``Case.qk_l2norm``, "any" also makes one token per request tiny: q and k rows of norm 10^-3.5 .. 10^-2,
#: where the in-kernel norm's epsilon is visible)
#: The epsilon of the in-kernel q/k L2 norm ``x / sqrt(sum x^2 + eps)`` (``use_qk_l2norm_in_kernel`` of
#: fla, vLLM, SGLang; the models' own ``l2norm``): what ``Case.qk_l2norm`` computes the truth with, the
#: same as ``kvbuffer_ref.engine_inputs``'.
QK_L2NORM_EPS = NORM_EPS


@dataclass(frozen=True)
class Sizes:
    """Bounds of the drawn cases, and the boundary cases every lane checks once per run.

    An implementation declares its size budget (``Implementation.sizes``): ``NORMAL`` for plain PyTorch
    and compiled kernels, ``SMALL`` for the Triton interpreter (~1000x slower), ``GPU`` (the ``gpu``
    profile) for production shapes.  The ``edge_*`` fields are the shapes of the boundary cases: each
    crosses one usual tile size (requests past a 64-request batch tile, value heads past a 32-head tile
    with groups, tokens past 64 and 128, buffered rows past 64, K and V of 256 and a non-power-of-two
    above 256, chunk sizes 16/32/64 with T crossing chunks)."""

    name: str = "normal"
    max_B: int = 3
    max_T: int = 12
    max_H: int = 2
    max_group: int = 3
    dims: tuple = (1, 2, 3, 5, 7, 8, 12, 16, 40, 72, 136)  # > 32, > 64, > 128: more than one tile of BV columns
    max_capacity: int = 6
    max_history: int = 10
    max_new: int = 6
    max_chain: int = 6
    max_tree: int = 10
    max_after: int = 3
    max_prompt: int = 12
    big_capacity: int = 20  # drawn now and then: more cached rows than a kernel's row tile (16)
    edge_base: tuple = (1, 1, 2, 8, 8)  # (B, H, HV, K, V) of the boundary cases, but for the one crossed
    edge_B: int = 70  # > 64 requests (0: no such case)
    edge_HV: tuple = (4, 36)  # (H, HV): > 32 value heads, 9 per q/k head
    edge_T: int = 136  # > 128 (and > 64)
    edge_rows: int = 70  # buffered rows > 64
    edge_dims: tuple = ((256, 264), (264, 256))  # (K, V): 256, and a non-power-of-two above 256
    edge_chunks: tuple = (16, 32, 64)
    edge_tree: int = 12  # draft nodes of the boundary verify cases
    sequences: bool = True  # every drawn example and anchor is a call sequence (state-leak); False: the first anchor only
    #: chunk-boundary lengths: the chunk-like lanes (chunk, chunk_varlen, direct, prefill) also draw T (a prompt's
    #: length) around every multiple of 16, 32 and 64 and of the lane's ``chunk_size`` c (c - 1, c, c + 1,
    #: 2c - 1, 2c, 2c + 1) up to ``long_T`` (``strategies.boundary_lengths``); a drawn case longer than
    #: ``max_T`` keeps B <= long_B, HV <= long_HV (H = 1 or a group of 2) and K, V in ``long_dims``.  The
    #: boundary cases cross c - 1 .. 2c + 1 for every c of ``edge_chunks`` (``lanes.edge_params``).
    long_T: int = 129
    #: the longest case of the direct lane (drawn and boundary): direct mode serves short contexts, and its
    #: float64 truth and baselines hold a decay for every pair of tokens (per-channel gates: B T^2 HV K of
    #: them, 1 TiB at T = 4096 with Qwen3-Next's heads), so its lengths stop at two chunks of 64 and one
    direct_T: int = 129
    long_B: int = 2
    long_HV: int = 4
    long_dims: tuple = (3, 8, 16, 24)
    #: (H, HV, K, V) drawn together from this list (the ``gpu`` profile: few head shapes, so compiled kernels
    #: share their compiles while the lengths vary); empty: H, the group and K, V drawn independently
    head_shapes: tuple = ()


#: Plain PyTorch and compiled kernels: small drawn cases (K and V up to 72; a V of 136 in the anchors),
#: boundary cases at every usual tile size.
NORMAL = Sizes(dims=(1, 2, 3, 5, 7, 8, 12, 16, 24, 40, 72))
#: The Triton interpreter (about 1000x slower than PyTorch): smaller drawn cases and boundary cases that
#: cross kvbuffer_fast's own tiles only (its grids have one program per request and value head, so no
#: batch case; 10 value heads cross the fold's group of 8; K = 40 crosses the 32-row key block, V = 264
#: the 64-, 128- and 256-column tiles; 66 rows the grouped fold's limit of 32 and a 64-row tile).
SMALL = Sizes(name="small (Triton interpreter)", max_B=3, max_T=8, max_H=2, max_group=2, max_capacity=5,
              max_history=6, max_new=4, max_chain=4, max_tree=6, max_after=2, max_prompt=8, big_capacity=18,
              dims=(1, 2, 3, 5, 7, 8, 12, 16, 40, 72), edge_B=0, edge_HV=(2, 10), edge_T=66, edge_rows=66,
              edge_dims=((40, 264),), edge_chunks=(16, 32, 64), edge_tree=8, sequences=False,
              long_T=129, long_B=1, long_HV=2, long_dims=(2, 5, 8))
#: The head shapes (H, HV, K, V) the ``gpu`` profile draws: head groups HV / H of 1, 2, 4 and 8, more than
#: 32 value heads (a 32-head tile crossed: 48 and 64), K = V = 128 (Qwen3-Next: H = 16, HV = 32), and one
#: non-power-of-two V.  Few of them: every new (H, HV, K, V) is a Triton compile; the lengths vary freely.
GPU_HEAD_SHAPES = ((16, 32, 128, 128), (16, 16, 128, 128), (16, 64, 128, 128), (8, 64, 128, 128),
                   (6, 48, 128, 128), (4, 8, 128, 136))
#: Production shapes (Qwen3-Next: H = 16, HV = 32, K = V = 128; B up to 256, T up to 4096, C up to 64,
#: trees up to 64 nodes): the ``gpu`` profile, with the float64 oracle on the device as well.  Drawn
#: cases take their heads from ``GPU_HEAD_SHAPES`` (groups 1 to 8, up to 64 value heads) and lengths up to
#: 1025 around multiples of 64; boundary cases are each production-sized in one dimension (64 value heads
#: in groups of 8 among them), and the operation's other anchors run at those head shapes too.
GPU = Sizes(name="gpu (production)", max_B=8, max_T=64, max_H=16, max_group=8, dims=(64, 128, 136, 256),
            max_capacity=64, max_history=96, max_new=8, max_chain=16, max_tree=64, max_after=4, max_prompt=512,
            big_capacity=64, edge_base=(2, 16, 32, 128, 128), edge_B=256, edge_HV=(8, 64), edge_T=4096,
            edge_rows=64, edge_dims=((256, 264),), edge_chunks=(16, 32, 64), edge_tree=64,
            long_T=1025, long_B=4, long_HV=64, long_dims=(128,), head_shapes=GPU_HEAD_SHAPES)


@dataclass(frozen=True)
class Case:
    """Shapes, regimes and a seed: everything needed to rebuild one test's inputs."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    channel_gate: bool = False
    gate: str = "mild"
    beta: str = "uniform"
    zero_key: bool = False
    seed: int = 0
    norm: str = "unit"  # NORM_REGIMES
    v_scale: float = 1.0  # v ~ N(0, v_scale^2)
    scale: float | None = None  # the explicit `scale` passed to every call (None: the default K ** -0.5)
    beta_max: float = 1.0  # the top of the beta domain ("uniform" draws in [0, beta_max])
    #: the implementation L2-normalises q and k itself (``l2norm_qk``): it receives the rows as drawn (rounded
    #: to the dtype), and the truth and the baseline are computed on their normalisation
    qk_l2norm: bool = False
    #: the implementation takes raw gates rounded to this dtype ("float32", "bfloat16"; ``RAW_GATE_DTYPES``): g and beta
    #: are those of the rounded raw gates (``raw_gates_in``, ``gates_of_raw``), so the truth computes with
    #: what the kernel is handed; "" (the default): g and beta as drawn
    raw_gate_dtype: str = ""

    def inputs(self, dtype: torch.dtype = torch.float64, device="cpu") -> dict:
        """q, k, v, g, beta for this case (see ``make_inputs``)."""
        return make_inputs(self, dtype, device)


def reset_positions(T: int) -> list[int]:
    """The token positions a reset is drawn at half of the time: 0, T - 1, and m - 1, m around every
    multiple m of 16 below T (the last token of a 16-, 32- or 64-token block and the first of the next)."""
    marks = {0, T - 1} | {m + d for m in range(16, T, 16) for d in (-1, 0)}
    return sorted(t for t in marks if 0 <= t < T)


def _gates(shape, regime: str, gen: torch.Generator) -> torch.Tensor:
    r = torch.rand(shape, generator=gen, dtype=torch.float64)
    by = {
        "zero": torch.zeros(shape, dtype=torch.float64),
        "mild": -0.5 * r,
        "strong": -(1.0 + 7.0 * r),
        "underflow": -(104.0 + 16.0 * r),
        "band": -(8.0 + 96.0 * r),
        "deep": -(120.0 + 80.0 * r),
    }
    if regime == "reset":  # one reset per (request, head[, channel]) at any token, mild gates elsewhere: a
        # uniform position, or (half of the time) one at a block boundary
        B, T = shape[0], shape[1]
        at = torch.randint(0, max(T, 1), (B, 1, *shape[2:]), generator=gen)
        marks = torch.tensor(reset_positions(T) or [0])
        near = marks[torch.randint(0, len(marks), at.shape, generator=gen)]
        at = torch.where(torch.rand(at.shape, generator=gen) < 0.5, near, at)
        resets = torch.tensor([float("-inf"), -1e30, -300.0], dtype=torch.float64)[
            torch.randint(0, 3, (B, 1, *shape[2:]), generator=gen)]
        hit = torch.arange(T).view(1, T, *([1] * (len(shape) - 2))) == at
        return torch.where(hit, resets.expand(shape), by["mild"])
    if regime not in ("mixed", "wide"):
        return by[regime]
    names = ["zero", "mild", "strong", "underflow"] + (["band", "deep", "mild"] if regime == "wide" else [])
    pick = torch.randint(0, len(names), shape, generator=gen)
    return torch.stack([by[n] for n in names], dim=-1).gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def _betas(shape, regime: str, gen: torch.Generator, beta_max: float = 1.0) -> torch.Tensor:
    r = torch.rand(shape, generator=gen, dtype=torch.float64) * beta_max
    by = {"zero": torch.zeros(shape, dtype=torch.float64), "one": torch.ones(shape, dtype=torch.float64), "uniform": r}
    if regime != "mixed":
        return by[regime]
    pick = torch.randint(0, 3, shape, generator=gen)
    return torch.stack([by["zero"], by["one"], by["uniform"]], dim=-1).gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def make_inputs(case: Case, dtype: torch.dtype = torch.float64, device="cpu") -> dict:
    """Inputs of ``case``: L2-normalised q and k (one zero key row if ``zero_key``), Gaussian v,
    gates and betas by regime.  Drawn in float64 on the CPU from ``case.seed``, then cast."""
    if case.gate not in GATE_REGIMES:
        raise ValueError(f"case.gate: expected one of {GATE_REGIMES}, got {case.gate!r}")
    if case.beta not in BETA_REGIMES:
        raise ValueError(f"case.beta: expected one of {BETA_REGIMES}, got {case.beta!r}")
    if case.norm not in NORM_REGIMES:
        raise ValueError(f"case.norm: expected one of {NORM_REGIMES}, got {case.norm!r}")
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    # every regime at every position whatever the dtype: the inputs are a function of the case alone (drawn in
    # float64, then rounded to ``dtype``)
    g = _gates((B, T, HV, K) if case.channel_gate else (B, T, HV), case.gate, gen)
    beta = _betas((B, T, HV), case.beta, gen, case.beta_max)
    if case.norm == "any":
        q = q * (0.25 * 16.0 ** torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64))
        top = 1.25 / max(1.0, case.beta_max) ** 0.5
        k = k * (0.4 + (top - 0.4) * torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64))
    if case.v_scale != 1.0:
        v = v * case.v_scale
    if case.zero_key and T > 0:
        t = int(torch.randint(0, T, (1,), generator=gen))
        k[:, t] = 0.0
    if case.qk_l2norm and case.norm == "any" and T > 0:
        # one token per request whose q and k rows are tiny (norm 10^-3.5 .. 10^-2), where the epsilon of the
        # in-kernel norm is visible: x / sqrt(|x|^2 + eps) differs from x / (|x| + eps) or x / |x| by up to 70%
        t = torch.randint(0, T, (B,), generator=gen)
        tiny = 10.0 ** (-3.5 + 1.5 * torch.rand(B, 2, generator=gen, dtype=torch.float64))
        rows = torch.arange(B)
        q[rows, t] = q[rows, t] / q[rows, t].norm(dim=-1, keepdim=True).clamp(min=1e-300) * tiny[:, :1, None]
        k[rows, t] = k[rows, t] / k[rows, t].norm(dim=-1, keepdim=True).clamp(min=1e-300) * tiny[:, 1:, None]
    if case.raw_gate_dtype:
        g, beta = snap_to_raw_gates(g, beta, case.raw_gate_dtype)
    return cast_inputs(dict(q=q, k=k, v=v, g=g, beta=beta), dtype, device)


# ----------------------------------------------------------------------------- raw gates, rounded to a dtype
#: The dtypes a kernel may take its raw gates ``a``, ``b`` in, rounded (``Case.raw_gate_dtype``).
RAW_GATE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: The softplus threshold of engine kernels' raw gating (softplus(x) = x above it).
SOFTPLUS_THRESHOLD = 20.0


def raw_gate_params(HV: int) -> tuple:
    """(A_log, dt_bias) [HV] float32 of the rounded raw gates: fixed per HV (drawn from seed HV), half of
    the heads with a small exp(A_log) (A_log in [-4, -2]: a + dt_bias then often lies past the softplus
    threshold), the rest with A_log in [-1, 1]; dt_bias in [-1, 1].  Fixed, so that the raw gates an
    adapter derives from g and beta round to the same values ``snap_to_raw_gates`` rounded."""
    gen = torch.Generator().manual_seed(1_000_003 + int(HV))
    u = torch.rand(3, HV, generator=gen, dtype=torch.float64)
    A_log = torch.where(u[0] < 0.5, -1 + 2 * u[1], -4 + 2 * u[1])
    dt_bias = -1 + 2 * u[2]
    return A_log.float(), dt_bias.float()


def softplus_inv(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (y >= 0; 0 -> -inf, inf -> inf), in float64."""
    y = y.to(torch.float64)
    big = y > 30
    safe = torch.where(big | (y <= 0), torch.ones_like(y), y)
    x = torch.where(big, y, safe + torch.log(-torch.expm1(-safe)))
    return torch.where(y <= 0, torch.full_like(y, float("-inf")), x)


def raw_gates_in(g: torch.Tensor, beta: torch.Tensor, dtype: str) -> tuple:
    """(A_log, dt_bias [HV] float32, a, b [.., HV] in ``dtype``) with -exp(A_log) softplus(a + dt_bias) = g
    and sigmoid(b) = beta before ``a``, ``b`` are rounded to ``dtype`` (a name of ``RAW_GATE_DTYPES``);
    A_log and dt_bias from ``raw_gate_params``.  For g, beta that ``snap_to_raw_gates`` made, the rounding
    gives back the values it rounded to (float32 g and beta included: their error is far below half a
    bfloat16 step of a and b)."""
    if dtype not in RAW_GATE_DTYPES:
        raise ValueError(f"raw gate dtype: expected one of {sorted(RAW_GATE_DTYPES)}, got {dtype!r}")
    HV = g.shape[-1]
    if beta.shape != g.shape:
        raise ValueError(f"raw gates: g {list(g.shape)} and beta {list(beta.shape)} must have one shape [.., HV] "
                         f"(scalar gates)")
    A_log, dt_bias = raw_gate_params(HV)
    sp = -g.detach().to("cpu", torch.float64) / A_log.double().exp()
    a = (softplus_inv(sp) - dt_bias.double()).float()
    bb = beta.detach().to("cpu", torch.float64)
    b = torch.where(bb >= 1, torch.full_like(bb, float("inf")), torch.log(bb) - torch.log1p(-bb)).float()
    rd, dev = RAW_GATE_DTYPES[dtype], g.device
    return A_log.to(dev), dt_bias.to(dev), a.to(device=dev, dtype=rd), b.to(device=dev, dtype=rd)


def gates_of_raw(A_log, dt_bias, a, b) -> tuple:
    """(g, beta) in float64 of raw gates as given: g = -exp(A_log) softplus(a + dt_bias) (threshold 20),
    beta = sigmoid(b)."""
    x = a.double() + dt_bias.double()
    sp = torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
    return -A_log.double().exp() * sp, torch.sigmoid(b.double())


def snap_to_raw_gates(g: torch.Tensor, beta: torch.Tensor, dtype: str) -> tuple:
    """(g, beta) [.., HV] float64 moved onto the raw gates rounded to ``dtype``: the gates a kernel
    computes from ``raw_gates_in(g, beta, dtype)``."""
    A_log, dt_bias, a, b = raw_gates_in(g, beta, dtype)
    return gates_of_raw(A_log, dt_bias, a, b)


def cast_inputs(x: dict, dtype: torch.dtype, device="cpu", gate_dtype: torch.dtype | None = None) -> dict:
    """q, k, v in ``dtype``; g and beta in ``gate_dtype`` (default: float32 for half dtypes, as serving keeps them)."""
    if gate_dtype is None:
        gate_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return {n: t.to(device=device, dtype=gate_dtype if n in ("g", "beta") else dtype) for n, t in x.items()}


def l2norm_qk(x: dict, dtype: torch.dtype, way: str = "div") -> dict:
    """``x`` with q and k L2-normalised per row in ``dtype`` as kernels do it in-kernel, one of two ways:
    "div", ``x / sqrt(sum x^2 + QK_L2NORM_EPS)`` (vLLM's and SGLang's recurrent kernels), or "rsqrt",
    ``x * rsqrt(sum x^2 + QK_L2NORM_EPS)`` (fla's ``l2norm``); a zero row stays zero.  The two round
    differently, and a dot product of nearly orthogonal rows magnifies the difference.  v, g and beta as
    they are."""
    def norm(t):
        t = t.to(dtype)
        s = (t * t).sum(-1, keepdim=True) + QK_L2NORM_EPS
        return t / torch.sqrt(s) if way == "div" else t * torch.rsqrt(s)
    if way not in ("div", "rsqrt"):
        raise ValueError(f"l2norm_qk way: expected 'div' or 'rsqrt', got {way!r}")
    return dict(x, q=norm(x["q"]), k=norm(x["k"]))


def upcast_inputs(x: dict, device="cpu") -> dict:
    """The same (already rounded) inputs in float64 on ``device`` (None: where they are): what the truth
    is computed from."""
    return {n: t.detach().to(device=t.device if device is None else device, dtype=torch.float64)
            for n, t in x.items()}
