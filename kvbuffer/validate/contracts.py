"""Arithmetic contracts: the precision a kernel declares it keeps, and a plain-PyTorch emulation of each.

A kernel of this family rarely computes float32 inputs in IEEE float32 throughout: on a GPU, Triton's
``tl.dot`` of float32 operands multiplies in TF32 by default (10-bit mantissa), bf16 kernels multiply
bf16 operands and accumulate in float32, and some engines keep the recurrent state in bf16.  An
adapter states which of these it keeps (``contract = "tf32"``); every comparison of its lanes is then
judged against correct forms computed in that arithmetic (``correct_forms``, ``tolerances``).

The contracts, and their emulation (``emulate``):

    ieee        every product and sum in the compute dtype (float32), the default
    tf32x3      every product as three TF32 products (a_hi b_hi + a_hi b_lo + a_lo b_hi, each operand split
                into a TF32 head and a TF32 tail: Triton's ``input_precision="tf32x3"``), float32 accumulation;
                the chunkwise forms also once with the products summed as a tensor core sums them
                (``TC_WAY``, ``_tc_product``: not IEEE, measured on an H100)
    tf32        the operands of every matrix / vector product cut to TF32 (10-bit mantissa) as an NVIDIA tensor
                core takes a float32 operand: the 13 low mantissa bits dropped (truncated toward zero;
                Triton's ``tl.dot`` hands float32 operands to the MMA as they are), accumulated in float32.
                A kernel that rounds to nearest first (cuBLAS's ``cvt.rna``) makes about half that error
    fp16        the operands of every product rounded to float16 (10-bit mantissa, and float16's range: a
                magnitude below its smallest subnormal, 6e-8, becomes 0, as in a kernel that multiplies
                float16 operands), float32 accumulation
    bf16        the operands of every product rounded to bfloat16 (8-bit mantissa), float32 accumulation
    bf16-state  IEEE float32 products, the recurrent state rounded to bfloat16 after every token

``emulate(contract)`` is a torch function mode (``_Arithmetic``): inside it, every ``torch.einsum`` (the
reference's forms take all their products through einsum) rounds its operands as the contract says;
``recurrent_bf16_state`` runs the recurrence with its state rounded to bfloat16 after every token, and
``segmented_form`` the chunkwise form (rounding the state after every chunk under bf16-state).
``correct_forms`` runs the forms a comparison's budget is taken from, in the contract's arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch.overrides import TorchFunctionMode

import kvbuffer_ref as ref
from kvbuffer_ref.chunk import _wy_chunk
from kvbuffer_ref.core import fold_state
from kvbuffer_ref.inputs import prepare_tokens

__all__ = ["CONTRACTS", "CONTRACT_TEXT", "round_tf32", "trunc_tf32", "round_bf16", "emulate", "recurrent_bf16_state",
           "round_fp16", "check_contract", "baseline_recurrent", "correct_forms", "segmented_form", "segmented_forms", "exp_ex2",
           "LOG2E_F32", "under_contract", "raw_gating", "current_raw_gating", "kernel_gates", "key_permutations", "key_orders"]

#: The contracts an adapter may declare, tightest first (``ieee`` is the default).
CONTRACTS = ("ieee", "tf32x3", "tf32", "fp16", "bf16", "bf16-state")
#: How the report names a contract ("FAIL as fp32; PASS as tf32: error consistent with TF32 products").
CONTRACT_TEXT = {
    "ieee": ("fp32", "IEEE float32 arithmetic"),
    "tf32x3": ("tf32x3", "three-TF32 products"),
    "tf32": ("tf32", "TF32 products"),
    "fp16": ("fp16", "float16 products with float32 accumulation"),
    "bf16": ("bf16", "bfloat16 products with float32 accumulation"),
    "bf16-state": ("bf16-state", "a bfloat16 recurrent state"),
}


_ACTIVE = ["ieee"]


def current_contract() -> str:
    """The contract the baselines are computed under when none is passed (``active_contract``; default "ieee")."""
    return _ACTIVE[-1]


class active_contract:
    """``with active_contract("tf32"):`` every baseline computed inside follows that contract's arithmetic and
    every ``compare`` is labelled with it (the runner sets the lane's declared contract this way)."""

    def __init__(self, contract: str):
        if contract not in CONTRACTS:
            raise ValueError(f"contract: expected one of {', '.join(CONTRACTS)}, got {contract!r}")
        self.contract = contract

    def __enter__(self):
        _ACTIVE.append(self.contract)
        return self

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return False


_RAW_GATING = [""]


def current_raw_gating() -> str:
    """The raw-gate dtype of the implementation whose lane runs (``raw_gating``; "" when it takes g and beta)."""
    return _RAW_GATING[-1]


@contextlib.contextmanager
def raw_gating(dtype: str):
    """``with raw_gating("float32"):`` the implementation computes g and beta itself from raw gates ``a``, ``b``
    handed over in that dtype (an engine kernel's in-kernel gating, ``Case.raw_gate_dtype``): ``correct_forms``
    then adds the recurrence on the gates a float32 kernel computes from them (``kernel_gates``).  The runner
    sets it around every lane of such an implementation; "" changes nothing."""
    _RAW_GATING.append(dtype or "")
    try:
        yield
    finally:
        _RAW_GATING.pop()


def kernel_gates(g: torch.Tensor, beta: torch.Tensor, dtype: str) -> tuple:
    """(g, beta) [.., HV] float32 as a correct float32 kernel computes them from the raw gates an engine adapter
    hands it for ``g``, ``beta`` (``cases.raw_gates_in``: the same function on the same values, so the same
    ``a``, ``b``): x = a + dt_bias, g = -exp(A_log) log1p(exp(x)) (x past the threshold 20: -exp(A_log) x),
    beta = 1 / (1 + exp(-b)), every operation rounded to float32 and every exponential as a GPU takes it
    (``exp_ex2``).  Each of those roundings is a few float32 steps of g, and a decay exp(g) carries g's
    absolute error, |g| times its relative one: for |g| of 8 the decay of such a kernel is a few times further
    from the truth than the decay of the gate rounded once, which a budget relative to the latter alone would
    count against a correct kernel."""
    from .cases import SOFTPLUS_THRESHOLD, raw_gates_in

    A_log, dt_bias, a, b = raw_gates_in(g, beta, dtype)
    x = a.float() + dt_bias.float()
    big = x > SOFTPLUS_THRESHOLD
    sp = torch.where(big, x, torch.log1p(exp_ex2(torch.where(big, torch.zeros_like(x), x))))
    gk = -(exp_ex2(A_log.float()) * sp)
    bk = 1.0 / (1.0 + exp_ex2(-b.float()))
    return gk.to(g.device), bk.to(beta.device)


def check_contract(name, label: str = "contract") -> str:
    """``name`` if it is a known contract (also accepts 'fp32' for 'ieee'); ValueError naming the argument."""
    if name in ("fp32", "float32", None):
        return "ieee"
    if name not in CONTRACTS:
        raise ValueError(f"{label}: expected one of {', '.join(CONTRACTS)}, got {name!r}")
    return name


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32 (10 explicit mantissa bits, round to nearest even), kept in its dtype (float64
    through float32: TF32 has float32's range)."""
    if x.dtype == torch.float64:
        return round_tf32(x.float()).double()
    if x.dtype != torch.float32:
        return x
    b = x.contiguous().view(torch.int32)
    lsb = (b >> 13) & 1
    r = (b + 0xFFF + lsb) & ~0x1FFF
    out = r.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def trunc_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` cut to TF32 as an NVIDIA tensor core takes a float32 operand of a TF32 MMA: its 13 low mantissa
    bits dropped (toward zero), kept in its dtype (float64 through float32).  The error is one-signed, up to a
    TF32 step (2^-10 relative, 2^-11 on average): every product shrinks, so a sum of products of one sign keeps
    a bias of about 2^-10 of itself where rounding to nearest (``round_tf32``) averages out."""
    if x.dtype == torch.float64:
        return trunc_tf32(x.float()).double()
    if x.dtype != torch.float32:
        return x
    out = (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (round to nearest even, with its range), kept in its own dtype."""
    if not x.is_floating_point() or x.dtype == dtype:
        return x
    return x.to(dtype).to(x.dtype)


def round_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float16 (round to nearest even, float16's subnormals, 0 below them, inf past 65504),
    kept in its dtype."""
    return _round_to(x, torch.float16)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 (round to nearest even), kept in its dtype."""
    return _round_to(x, torch.bfloat16)


#: The operand rounding of each product contract (tf32x3 splits its operands as Triton does: ``_split_product``).
_ROUND = {"tf32": trunc_tf32, "fp16": round_fp16, "bf16": round_bf16}


#: log2(e) as a float32 kernel holds it.
LOG2E_F32 = float(torch.tensor(1.4426950408889634, dtype=torch.float32))


def exp_ex2(x: torch.Tensor, ftz: bool = False) -> torch.Tensor:
    """``exp(x)`` of a float32 ``x`` as a GPU kernel computes it: ``2 ** fl32(x * log2 e)`` (Triton's ``tl.exp``
    and CUDA's ``__expf`` lower to ``ex2.approx.f32`` of that product).  The product's rounding leaves a
    relative error of about ``|x| * 2^-24 * ln 2`` in the result, 3e-6 at x = -50; the power itself is taken
    correctly rounded here (``ex2.approx`` is within 2 ulp of that).  ftz: a result below float32's smallest
    normal number is 0, as Triton's ``tl.exp2`` returns it (``ex2.approx.ftz.f32``; measured on an H100 with
    Triton 3.6: ``tl.exp2`` of -87.6 / ln 2 and below gives 0 where ``tl.exp`` keeps the subnormal; kernels
    that take their decays as ``exp2`` of log2-scaled gates, fla's chunk kernels among them, lose a decay
    below about exp(-87.3)).  Other dtypes: ``torch.exp``."""
    if x.dtype != torch.float32:
        return torch.exp(x)
    y = x * torch.tensor(LOG2E_F32, dtype=torch.float32, device=x.device)
    r = torch.exp2(y.double()).float()
    return torch.where(r.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(r), r) if ftz else r


def _sequential_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Cumulative sum of ``x`` along ``dim`` as a loop of additions in its dtype, one rounding after each."""
    x = x.movedim(dim, 0)
    out = torch.empty_like(x)
    acc = torch.zeros_like(x[0])
    for i in range(x.shape[0]):
        acc = acc + x[i]
        out[i] = acc
    return out.movedim(0, dim)


def _scan_cumsum(x: torch.Tensor, dim: int, lanes: int = 32) -> torch.Tensor:
    """Cumulative sum of ``x`` along ``dim`` in its dtype as a GPU scan forms it (Triton's ``tl.cumsum``, one
    element per lane): within each run of ``lanes`` elements a Hillis-Steele scan (element i adds element
    i - 2^s, s = 0, 1, ...: log2(lanes) rounded additions per element, in a tree order), then each run adds
    the running total of the runs before it."""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    out = torch.empty_like(x)
    carry = torch.zeros_like(x[0])
    for a in range(0, n, lanes):
        run = x[a : a + lanes].clone()
        step = 1
        while step < run.shape[0]:
            run[step:] = run[step:] + run[:-step].clone()
            step *= 2
        out[a : a + lanes] = run + carry if a else run
        carry = out[a + run.shape[0] - 1]
    return out.movedim(0, dim)


#: The bits of a token's index within its chunk that ``_stepped_cumsum`` steps on: any two positions fewer than
#: 2^3 apart differ in one of them.
STEP_BITS = (0, 1, 2)


def _stepped_cumsum(x: torch.Tensor, dim: int, bit: int) -> torch.Tensor:
    """Cumulative sum of float32 ``x`` along ``dim``, each partial sum correctly rounded, then moved one float32
    step down (towards -inf) at the positions whose index has ``bit`` set: a cumulative sum as a tree-ordered
    scan leaves it, each sum within about a step of the exact one in a pattern of the order's own, so that the
    difference of two nearby sums (the exponent of the decay between those tokens) carries a step of their size
    even where a loop of additions carries none (a gate of 0 between them)."""
    x = x.movedim(dim, 0)
    G = x.double().cumsum(0).float()
    on = ((torch.arange(G.shape[0], device=G.device) >> bit) & 1).bool().view(-1, *[1] * (G.dim() - 1))
    G = torch.where(on, torch.nextafter(G, torch.full_like(G, -math.inf)), G)
    return G.movedim(0, dim)


def _split_product(func, eq, a, b, **kwargs):
    """A two-operand einsum as three TF32 products: each operand split into a TF32 head rounded to nearest and
    its tail, the tail x tail product dropped (Triton's ``input_precision="tf32x3"``: ``cvt.rna`` makes the
    head; the tail goes to the tensor core as a float32 value, which cuts it to TF32: ``trunc_tf32``)."""
    ah, bh = round_tf32(a), round_tf32(b)
    al, bl = trunc_tf32(a - ah), trunc_tf32(b - bh)
    return func(eq, ah, bh, **kwargs) + (func(eq, ah, bl, **kwargs) + func(eq, al, bh, **kwargs))


#: How an NVIDIA tensor core sums the products of a float32 ``tl.dot`` (TF32 operands, float32 accumulator), as
#: measured bit for bit on an H100 (Triton 3.6, ``mma`` and ``wgmma`` tiles, K = 16 to 128: 94-99 % of the
#: outputs of plain TF32 and of three-TF32 dots equal, the rest one float32 step apart): the exact products of
#: ``TC_GROUP`` consecutive terms of the contraction and the accumulator are aligned to the largest of them,
#: each cut toward zero to ``TC_BITS`` bits below that one's leading bit, added exactly, and the sum cut toward
#: zero to float32.  Both cuts drop low bits always in the same direction, so over a contraction of 128 terms
#: a three-TF32 dot on the tensor core is about twice as far from the exact result as the same products summed
#: in IEEE float32, and more where the sum cancels (a q . k of nearly orthogonal rows).
TC_GROUP, TC_BITS = 8, 25


def _trunc_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` cut to float32 toward zero."""
    f = x.float()
    return torch.where(f.double().abs() > x.abs(), torch.nextafter(f, torch.zeros_like(f)), f)


def _tc_sum(groups, acc) -> torch.Tensor:
    """The tensor core's sum (``TC_GROUP``, ``TC_BITS``) of exact float64 products onto the float32 accumulator
    ``acc`` [...] (None: zeros): ``groups`` yields the products of each group of ``TC_GROUP`` consecutive terms
    of the contraction in order, [..., TC_GROUP] (the contracted index last).  Returns [...] float32."""
    for terms in groups:
        if acc is None:
            acc = torch.zeros(terms.shape[:-1], dtype=torch.float64, device=terms.device)
        _, e = torch.frexp(torch.maximum(terms.abs().amax(-1), acc.abs()))  # largest = m 2^e, m in [0.5, 1)
        step = torch.exp2((e - 1 - TC_BITS).double())  # a power of two (float64: no underflow at float32's range)
        acc = _trunc_f32(((terms / step[..., None]).trunc().sum(-1) + (acc / step).trunc()) * step).double()
    return acc.float()


def _dim_of(spec: str, index: str) -> int:
    """The dimension of einsum index ``index`` in an operand's ``spec`` (counted from the end after an ellipsis)."""
    if "..." in spec:
        head, tail = spec.split("...")
        return head.index(index) if index in head else tail.index(index) - len(tail)
    return spec.index(index)


def _tc_product(func, eq, a, b, **kwargs):
    """A two-operand float32 einsum as Triton's ``input_precision="tf32x3"`` computes it on a tensor core: the
    three TF32 products of ``_split_product`` as three dots in Triton's order (tail x head, head x tail, then
    head x head, each onto the one before), the head x head dot summed as the tensor core sums (``_tc_sum``),
    group by group of the contracted index.  An equation without exactly one contracted index (an outer
    product): ``_split_product``."""
    lhs, out = eq.replace(" ", "").split("->")
    x, y = lhs.split(",")
    cut = [c for c in x if c in y and c not in out and c != "."]
    if len(cut) != 1:
        return _split_product(func, eq, a, b, **kwargs)
    ah, bh = round_tf32(a), round_tf32(b)
    al, bl = trunc_tf32(a - ah), trunc_tf32(b - bh)
    # the two tail products are 2^-11 of the head product: how their dots round moves the result by about
    # 2^-35 of it, so they are summed in float64 and rounded once (a third of the cost), then the head
    # product is summed onto them as the tensor core sums
    small = (func(eq, ah.double(), bl.double(), **kwargs) + func(eq, al.double(), bh.double(), **kwargs)).float()
    return _tc_head(func, (x, y, out, cut[0]), ah.double(), bh.double(), small, **kwargs)


#: Bytes of float64 products ``_tc_head`` holds at once (one group of each output element).
TC_BYTES = 1 << 28


def _tc_head(func, specs, ah, bh, acc, **kwargs):
    """The head x head dot of ``_tc_product`` summed onto ``acc`` (its output, float32) as the tensor core sums;
    ``specs``: the operands', the output's and the contracted index's einsum letters.  Every output element
    is summed on its own, so the output is split along its longest index held by an operand into pieces whose
    products fit ``TC_BYTES`` (a state-sized output of a batch of 256 would hold gigabytes)."""
    x, y, out, c = specs
    da, db = _dim_of(x, c), _dim_of(y, c)
    n = ah.shape[da]
    g = min(TC_GROUP, n)
    letters = [i for i in out.replace("...", "") if i in x or i in y]
    if acc.numel() * g * 8 > TC_BYTES and letters:
        i = max(letters, key=lambda i: acc.shape[_dim_of(out, i)])
        do = _dim_of(out, i)
        m = acc.shape[do]
        step = max(1, m * TC_BYTES // (acc.numel() * g * 8))
        if step < m:
            cut = lambda t, spec, s: (t.narrow(_dim_of(spec, i), s, min(step, m - s))
                                       if i in spec and t.shape[_dim_of(spec, i)] == m else t)  # 1: broadcast
            return torch.cat([_tc_head(func, specs, cut(ah, x, s), cut(bh, y, s), acc.narrow(do, s, min(step, m - s)),
                                       **kwargs) for s in range(0, m, step)], dim=do)
    each = f"{x},{y}->{out}{c}"  # the products, the contracted index kept last: exact in float64
    return _tc_sum((func(each, ah.narrow(da, s, min(g, n - s)), bh.narrow(db, s, min(g, n - s)), **kwargs)
                    for s in range(0, n, g)), acc)


class _Arithmetic(TorchFunctionMode):
    """The arithmetic of one correct form, as a torch function mode over the reference's own code.

    products: None (as computed), "tf32x3" (``_split_product``), "tf32x3-tc" (the same, summed as a tensor core
    sums: ``_tc_product``) or a rounding applied to the operands of every ``torch.einsum`` (the reference's
    forms take all their products through einsum).
    cumsum: None (as computed), "sequential" (every float32 cumulative sum a loop of float32 additions: a
    kernel carrying its running sum in a register, on any device; ``torch.cumsum`` accumulates float32 in
    float64 on a CPU and in a parallel scan on CUDA), "scan" (the tree order of a GPU scan, ``tl.cumsum``:
    ``_scan_cumsum``), "rounded" (every float32 partial sum correctly rounded, computed in float64) or "step0",
    "step1", "step2" (rounded, then one float32 step down where that bit of the index is set: ``_stepped_cumsum``).
    Kernels sum their cumulative gates each of these ways; a decay ``exp(G_i - G_j)`` of large ``|G|`` (after
    a reset gate of -200, say) keeps only the low bits the way leaves, which differ: on one head a scan
    leaves 15x the error of a loop, on the next a loop leaves the more.
    exp: None (correctly rounded), "ex2" (every float32 exponential as a GPU kernel takes it, ``exp_ex2``) or
    "ex2-ftz" (the same, a result below float32's normal range 0, as ``tl.exp2`` returns it).
    One mode for all three: each torch call inside it pays one Python dispatch, not one per concern."""

    def __init__(self, products=None, cumsum=None, exp=None):
        super().__init__()
        self.products, self.cumsum, self.exp = products, cumsum, exp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.einsum:
            if self.products is not None and args and isinstance(args[0], str):
                if self.products in ("tf32x3", "tf32x3-tc"):
                    if len(args) == 3 and all(isinstance(a, torch.Tensor) and a.dtype == torch.float32
                                              for a in args[1:]):
                        return (_split_product if self.products == "tf32x3" else _tc_product)(func, *args, **kwargs)
                else:
                    args = (args[0], *[self.products(a) if isinstance(a, torch.Tensor) else a for a in args[1:]])
        elif func in (torch.cumsum, torch.Tensor.cumsum):
            if self.cumsum is not None and args and isinstance(args[0], torch.Tensor) \
                    and args[0].dtype == torch.float32:
                if self.cumsum == "rounded":
                    return func(args[0].double(), *args[1:], **kwargs).float()
                dim = args[1] if len(args) > 1 else kwargs["dim"]
                if self.cumsum.startswith("step"):
                    return _stepped_cumsum(args[0], dim, int(self.cumsum[4:]))
                if self.cumsum == "scan":
                    return _scan_cumsum(args[0], dim)
                return _sequential_cumsum(args[0], dim)
        elif func in (torch.exp, torch.Tensor.exp):
            if self.exp in ("ex2", "ex2-ftz") and args and isinstance(args[0], torch.Tensor) and not kwargs:
                return exp_ex2(args[0], ftz=self.exp == "ex2-ftz")
        return func(*args, **kwargs)


def _products(contract: str):
    """The ``products`` argument of ``_Arithmetic`` for ``contract``."""
    contract = check_contract(contract)
    if contract == "tf32x3":
        return "tf32x3"
    return _ROUND.get(contract)


def emulate(contract: str):
    """A context in which the reference's products follow ``contract`` ("tf32x3", "tf32" or "bf16"; "ieee"
    and "bf16-state" change no product: a no-op)."""
    products = _products(contract)
    return _Arithmetic(products=products) if products is not None else contextlib.nullcontext()


def under_contract(fn, contract: str):
    """``fn`` called inside ``emulate(contract)``: an operation of the reference computed in that contract's
    products, a correct implementation of it (the scripts and tests that check the validator use it)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with emulate(contract):
            return fn(*args, **kwargs)
    return call


def recurrent_bf16_state(q, k, v, *, g, beta, scale=None, initial_state=None):
    """The plain recurrence (in the inputs' compute dtype) with its state rounded to bfloat16 after every
    token: (o, S)."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    dt = torch.promote_types(q.dtype, torch.float32)
    S = (torch.zeros(B, HV, K, V, dtype=dt, device=q.device) if initial_state is None
         else round_bf16(initial_state.to(dt)))
    outs = []
    for t in range(T):
        sl = slice(t, t + 1)
        o, S = ref.recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl],
                                              scale=scale, initial_state=S, output_final_state=True)
        S = round_bf16(S)
        outs.append(o)
    return torch.cat(outs, 1) if outs else v.new_zeros(B, 0, HV, V), S


def baseline_recurrent(q, k, v, *, g, beta, scale=None, initial_state=None, output_final_state=True,
                       contract=None, exp=None):
    """The plain recurrence under ``contract`` (default: the active one, ``tolerances.current_contract``):
    the baseline every comparison's budget is relative to (``ieee``: the plain recurrence itself).
    exp="ex2": its exponentials as a GPU kernel takes them (``exp_ex2``; not under bf16-state)."""
    contract = check_contract(current_contract() if contract is None else contract)
    if contract == "bf16-state":
        o, S = recurrent_bf16_state(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state)
        return o, (S if output_final_state else None)
    products = _products(contract)
    mode = _Arithmetic(products=products, exp=exp) if products is not None or exp else contextlib.nullcontext()
    with mode:
        return ref.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                              output_final_state=output_final_state)


def correct_forms(q, k, v, *, g, beta, scale=None, initial_state=None, chunks=(), contract=None, qk_ways=()):
    """[(o, S), ...]: what correct implementations compute on these inputs in their compute dtype under
    ``contract`` (default: the active one): the plain recurrence with its exponentials correctly rounded and,
    in float32, a second time with them as a GPU kernel takes them (``exp_ex2``), and, when the implementation
    takes raw gates (``raw_gating``), on the gates a float32 kernel computes from them (``kernel_gates``) and on
    those moved one float32 step either way, and on each (q, k) of ``qk_ways`` (the rows normalised another
    way), and with its K key channels summed in other orders (``key_orders``); and for each size in
    ``chunks`` the chunkwise forms with chunks of that many tokens (cumulative gates local to each chunk, as
    production kernels keep them; ``segmented_forms``).
    The budget of a comparison is a small multiple of the worst of them (``tolerances``).  Outputs are in
    the compute dtype (float32 for float32 and narrower inputs); states too."""
    contract = check_contract(current_contract() if contract is None else contract)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    forms = [baseline_recurrent(**x, scale=scale, initial_state=initial_state, contract=contract)]
    if torch.promote_types(q.dtype, torch.float32) == torch.float32 and contract != "bf16-state":
        gates = [(g, beta)]
        raw = current_raw_gating()
        if raw and g.dim() == beta.dim():  # the kernel computes its gates from raw ones: as a float32 kernel does,
            # and one float32 step of g either way (how it takes exp(A_log) and the softplus moves its g by that)
            gk, bk = kernel_gates(g, beta, raw)
            gates += [(gs, bk) for gs in (gk, torch.nextafter(gk, torch.zeros_like(gk)),
                                          torch.nextafter(gk, torch.full_like(gk, -1e38)))]
        runs = [dict(g=gg, beta=bb) for gg, bb in gates] + [dict(q=qq, k=kk) for qq, kk in qk_ways]
        forms += _recurrences_ex2(x, runs, scale=scale, initial_state=initial_state, contract=contract)
        forms += key_orders(x, scale=scale, initial_state=initial_state, contract=contract)
    for chunk in chunks:
        forms += segmented_forms(**x, scale=scale, initial_state=initial_state, starts=range(0, q.shape[1], int(chunk)),
                                 contract=contract)
    return forms


def key_permutations(K: int) -> list:
    """The orders ``key_orders`` sums the K key channels in: reversed, and the odd channels before the even
    ones (each [K] long tensors, permutations of 0..K-1; none for K = 1)."""
    if K < 2:
        return []
    idx = torch.arange(K)
    return [idx.flip(0), torch.cat([idx[1::2], idx[0::2]])]


def key_orders(x: dict, *, scale=None, initial_state=None, contract=None) -> list:
    """[(o, S), ...]: the plain recurrence with the K key channels of q, k, per-channel gates and the initial
    state taken in each of ``key_permutations``' orders, the state's channels put back: the same exact
    math, every sum over K (q^T S, S^T k) rounded in another order, as a kernel that splits or reorders
    K does.  Where such a sum cancels (|q . k| far below |q| |k|) its rounding error moves with the order by
    several times, and one order alone can be lucky; the worst of the orders is what a correct kernel may
    do.  Run as one batch (the requests of every order side by side).  Float32 arithmetic only (none for
    float64 inputs, whose floor covers their rounding, or under the bf16-state contract)."""
    contract = check_contract(current_contract() if contract is None else contract)
    perms = key_permutations(x["q"].shape[-1])
    if not perms or torch.promote_types(x["q"].dtype, torch.float32) != torch.float32 or contract == "bf16-state":
        return []
    channel = x["g"].dim() == x["q"].dim()
    perms = [p.to(x["q"].device) for p in perms]
    xs = [{f: t.index_select(-1, p) if f in ("q", "k") or (f == "g" and channel) else t for f, t in x.items()}
          for p in perms]
    s0 = None if initial_state is None else [initial_state.index_select(2, p) for p in perms]
    forms = _side_by_side(xs, s0, scale=scale, contract=contract)
    return [(o, S.index_select(2, torch.argsort(p))) for (o, S), p in zip(forms, perms)]


def _side_by_side(xs: list, states: list | None, *, scale, contract, exp=None) -> list:
    """[(o, S), ...]: ``baseline_recurrent`` on each of the inputs ``xs`` (dicts of equal shapes) from each of
    ``states`` (None: no initial state), run as one batch (the requests of every run side by side): one pass
    of the recurrence's loop over the tokens."""
    if len(xs) == 1:
        return [baseline_recurrent(**xs[0], scale=scale, initial_state=None if states is None else states[0],
                                   contract=contract, exp=exp)]
    B = xs[0]["q"].shape[0]
    o, S = baseline_recurrent(**{f: torch.cat([x[f] for x in xs]) for f in xs[0]}, scale=scale,
                              initial_state=None if states is None else torch.cat(states), contract=contract, exp=exp)
    return [(o[i * B:(i + 1) * B], S[i * B:(i + 1) * B]) for i in range(len(xs))]


def _recurrences_ex2(x: dict, runs: list, *, scale, initial_state, contract) -> list:
    """[(o, S), ...]: the recurrence with GPU exponentials on ``x`` with each of ``runs`` (a dict of inputs
    that replace x's: other gates, other normalised q and k) applied, run as one batch (the requests of every
    run side by side, ``_side_by_side``)."""
    s0 = None if initial_state is None else [initial_state] * len(runs)
    return _side_by_side([dict(x, **r) for r in runs], s0, scale=scale, contract=contract, exp="ex2")


#: How a kernel sums its cumulative gates and takes its exponentials: ``segmented_forms`` computes each.
#: The scan way is fla's chunk kernels' arithmetic (``chunk_local_cumsum``, ``exp2`` of log2-scaled gates, the
#: decays on the innovations u before the state pass's product).
#: The stepped ways stand for the other orders a scan can take (``_stepped_cumsum``), with correctly rounded
#: exponentials.
SEGMENT_WAYS = (dict(cumsum="sequential", exp="ex2-ftz"), dict(cumsum="scan", exp="ex2-ftz", decay_on="u"),
                dict(cumsum="rounded")) + tuple(dict(cumsum=f"step{b}") for b in STEP_BITS)


#: The way a three-TF32 tensor-core kernel adds under the tf32x3 contract: correctly rounded sums and exponentials,
#: its products as the tensor core sums them (``_tc_product``).
TC_WAY = dict(cumsum="rounded", products="tf32x3-tc")


def segment_ways(dtype: torch.dtype, contract=None) -> tuple:
    """``SEGMENT_WAYS`` for inputs of ``dtype`` under ``contract`` (default: the active one): in float64 the ways
    are one (the ways differ only in float32 sums and exponentials, which float64 inputs never take), so one
    form stands for them; under tf32x3 also ``TC_WAY`` (a chunk kernel's products are a tensor core's)."""
    if torch.promote_types(dtype, torch.float32) == torch.float64:
        return SEGMENT_WAYS[:1]
    contract = check_contract(current_contract() if contract is None else contract)
    return SEGMENT_WAYS + ((TC_WAY,) if contract == "tf32x3" else ())


def segmented_forms(q, k, v, *, g, beta, scale=None, initial_state=None, starts=(0,), carried=(), contract=None,
                    initial_states=None):
    """[(o, S), ...]: ``segmented_form`` the ways a kernel computes its decays (``SEGMENT_WAYS``): cumulative gates summed by
    a loop of float32 additions (a kernel carrying its sum in a register) and by a GPU scan (``tl.cumsum``), both
    with GPU exponentials that flush below float32's normal range (``tl.exp2``; a kernel taking ``tl.exp`` keeps
    those subnormal decays, as the correctly rounded way does), the scan way with the decays scaling u rather
    than k in the fold (fla's chunk kernels), as correctly rounded sums with correctly rounded
    exponentials, and so with the sums stepped as a tree-ordered scan leaves them (``_stepped_cumsum``, one
    form per bit of ``STEP_BITS``); under tf32x3 also with the products a tensor core's (``TC_WAY``); with
    ``carried`` boundaries, also each way with the gates rebased at those boundaries (a buffer's accept or
    partial flush) instead of summed afresh.  ``initial_states``: a start state per form (in the order returned)
    in place of ``initial_state``, each form resuming from its own, as a call over the tokens before a segment
    boundary leaves them: a segment never spans a call's start, so without ``carried`` boundaries (whose gates
    are summed from the frame before them) the two calls give the numbers of one."""
    ways = list(segment_ways(q.dtype, contract))
    if any(0 < int(c) < q.shape[1] for c in carried):
        ways += [dict(w, carried=carried) for w in ways]
    if initial_states is not None and len(initial_states) != len(ways):
        raise ValueError(f"initial_states: {len(ways)} forms, got {len(initial_states)} states")
    out = [None] * len(ways)
    kinds = dict.fromkeys((w.get("exp"), w.get("products")) for w in ways)
    for exp, products in kinds:  # the ways that share their exponentials and products: one batch
        idx = [i for i, w in enumerate(ways) if (w.get("exp"), w.get("products")) == (exp, products)]
        sums = [(ways[i]["cumsum"], ways[i].get("carried", ()), ways[i].get("decay_on", "k")) for i in idx]
        S0 = initial_state if initial_states is None else [initial_states[i] for i in idx]
        for i, r in zip(idx, _segmented_batch(q, k, v, g=g, beta=beta, scale=scale, initial_state=S0,
                                              starts=starts, sums=sums, contract=contract, exp=exp,
                                              products=products)):
            out[i] = r
    return out


def _segment_gates(g: torch.Tensor, edges: list, carried: set) -> list:
    """The cumulative gates of each segment ``edges[i]..edges[i+1]`` of ``g`` [B, T, HV]*: summed from the
    segment's first token, or, where the segment starts at a ``carried`` boundary, summed on from the start of
    the frame it continues (the last boundary not carried) and rebased by one subtraction, ``G - G_{start-1}``:
    the gates a buffer holds after an accept or a partial flush, which rebase its entries' stored sums."""
    out, frame = [], 0
    for a, b in zip(edges, edges[1:]):
        if a not in carried:
            frame = a
        G = g[:, frame:b].cumsum(dim=1)
        out.append(G[:, a - frame:] - G[:, a - frame - 1 : a - frame] if a > frame else G)
    return out


def segmented_form(q, k, v, *, g, beta, scale=None, initial_state=None, starts=(0,), cumsum: str = "sequential",
                   carried=(), contract=None, exp=None):
    """(o, S) of the chunkwise form with chunk boundaries at ``starts`` (sorted token positions, the first 0),
    in the inputs' compute dtype under ``contract``: the tokens between two boundaries form one chunk, whose
    cumulative gates start at its first token (``carried`` boundaries: rebased from the frame before it,
    ``_segment_gates``).  A buffer computes exactly this way between its folds (its cumulative gates run from
    the buffer's start), so it is the buffer operations' own form.  cumsum: how its float32 cumulative gates
    are summed, "sequential", "scan" or "rounded" (``_Arithmetic``'s ``cumsum``); exp="ex2":
    exponentials as a GPU kernel takes them (``exp_ex2``).
    bf16-state rounds the state at every boundary.  Batch of any B, the same boundaries for every request."""
    return _segmented_batch(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state, starts=starts,
                            sums=[(cumsum, carried, "k")], contract=contract, exp=exp)[0]


def _fold(S, k, u, G, decay_on: str) -> torch.Tensor:
    """``fold_state`` of one chunk (G its cumulative gates) with the scalar decays scaling k ("k") or u ("u": the
    transposed fold, the same sum with the decays on the other operand of the product); per-channel decays
    scale k."""
    if decay_on not in ("k", "u"):
        raise ValueError(f"decay_on: expected 'k' or 'u', got {decay_on!r}")
    if decay_on == "u" and G.dim() < k.dim():
        return fold_state(S.transpose(-1, -2), u, k, G, G[:, -1]).transpose(-1, -2)
    return fold_state(S, k, u, G, G[:, -1])


def _fold_ways(S, k, u, G, decay_on: list, B: int) -> torch.Tensor:
    """The fold of a batch of len(decay_on) x B requests, the j-th B rows with the decays on ``decay_on[j]``."""
    if len(set(decay_on)) == 1:
        return _fold(S, k, u, G, decay_on[0])
    return torch.cat([_fold(*(t[j * B:(j + 1) * B] for t in (S, k, u, G)), d) for j, d in enumerate(decay_on)])


def _segmented_batch(q, k, v, *, g, beta, scale, initial_state, starts, sums, contract, exp, products=None) -> list:
    """[(o, S), ...]: ``segmented_form`` once per (cumsum, carried, decay_on) of ``sums``, all with exponentials
    ``exp`` and products ``products`` (``_Arithmetic``'s; None: the contract's), computed as one batch of len(sums) x B requests (each way's cumulative gates summed its own way and
    its fold's decays on its own factor, the chunk arithmetic batched).  ``initial_state``: one state for every
    way, or a list of one per way."""
    contract = check_contract(current_contract() if contract is None else contract)
    T, n = q.shape[1], len(sums)
    per_way = isinstance(initial_state, (list, tuple))
    if not T:  # no tokens: the state as it was (zeros without one)
        S = initial_state if initial_state is not None else torch.zeros(
            q.shape[0], v.shape[2], k.shape[-1], v.shape[3], dtype=torch.promote_types(q.dtype, torch.float32),
            device=q.device)
        o = v.new_zeros(v.shape[0], 0, v.shape[2], v.shape[3])
        return [(o, s) for s in S] if per_way else [(o, S)] * n
    edges = sorted(set(int(s) for s in starts if 0 < int(s) < T) | {0}) + [T]
    x = prepare_tokens(q, k, v, g, beta, scale)
    gates = []  # per way, the cumulative gates of each segment
    for cumsum, carried, _ in sums:
        with _Arithmetic(cumsum=cumsum):
            gates.append(_segment_gates(x.g, edges, {int(c) for c in carried}))
    rep = (lambda t: t) if n == 1 else (lambda t: torch.cat([t] * n))  # noqa: E731
    B = x.dims.B
    if per_way:
        S = torch.cat(list(initial_state)).to(x.v.dtype)
    else:
        S = rep(torch.zeros(B, x.dims.HV, x.dims.K, x.dims.V, dtype=x.v.dtype, device=q.device)
                if initial_state is None else initial_state.to(x.v.dtype))
    outs = []
    with _Arithmetic(products=products or _products(contract), exp=exp):
        for i, (a, b) in enumerate(zip(edges, edges[1:])):
            sl = slice(a, b)
            G = torch.cat([gw[i] for gw in gates]) if n > 1 else gates[0][i]
            k_sl = rep(x.k[:, sl])
            o, u = _wy_chunk(rep(x.q[:, sl]), k_sl, rep(x.v[:, sl]), rep(x.beta[:, sl]), G, S)
            S = _fold_ways(S, k_sl, u, G, [w[2] for w in sums], B)
            if contract == "bf16-state":
                S = round_bf16(S)
            outs.append(o.to(x.out_dtype))
    o = torch.cat(outs, 1)
    return [(o[j * B : (j + 1) * B], S[j * B : (j + 1) * B]) for j in range(n)]
