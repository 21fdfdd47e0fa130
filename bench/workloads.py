"""What the benchmarks measure: each operation at one batch, over L layers, checked against the oracle.

Both harnesses build their rows here: the GPU runner (``bench/gpu.py``: CUDA graphs, device time) and
the pytest-benchmark suites (``bench/test_bench_*.py``, on the CPU).  A *case* is one operation at one
batch: its inputs for ``layers`` layers of distinct states and buffers (layer 0 from an oracle history,
the others copies of it with their own tokens), a ``run()`` that performs the operation on every layer
in the order a model does (a decode cycle is step-major: step t on layer 0, 1, ..., then step t + 1),
and the comparisons of layer 0's eager result with the float64 recurrence, made when the case is built,
before anything is timed.

Operations (``OPS``), grouped with the peers they are compared with:

========  ===============================  ============================================================
group     op                               what one operation is
========  ===============================  ============================================================
decode    ``read_state``                   each layer's fp32 state read once and nothing else
                                           (``bench/read_state.py``): the measured floor of a state read
decode    ``recurrent_decode``             the recurrent baseline: one token, the state updated in place
decode    ``fla_fused_recurrent``          fla's ``fused_recurrent_gated_delta_rule``, one token
decode    ``buffered_decode``              one step, averaged over a whole cycle of C steps from full
                                           buffers (the fold of the C entries included)
decode    ``buffered_decode_bf16``         ``buffered_decode`` on buffers whose state is stored in bf16 (the
                                           history's state rounded to it; the bf16-state contract; float16
                                           under --smoke, whose interpreter mishandles bf16)
verify    ``verify``                       buffered verify of d tokens (a chain) over n entries
verify    ``per_draft_state_verify``       the per-draft-state baseline: one state written per token
verify    ``fla_fused_recurrent_tokens``   fla's fused_recurrent over the same d tokens (final state only)
verify    ``fla_chunk_tokens``             fla's ``chunk_gated_delta_rule`` over the same d tokens
accept    ``accept``                       buffered accept of m drafts (lengths reset to n first)
accept    ``per_draft_state_accept``       the baseline's accept: intermediate m - 1 copied over the state
accept    ``flush``                        a fold on demand: every entry of full buffers (C) folded into the
                                           state (lengths reset to C first)
round     ``round``                        a speculative round: verify of every layer, then accept
round     ``per_draft_state_round``        the baseline's round
round     ``round_cycle``                  a cycle of C // m + 1 rounds from empty buffers, one accept folding
round     ``round_cycle_fold``             ``round_cycle`` with that round's verify folding (fold=True) instead,
                                           and every accept told so (fold=False: no fold launch)
round     ``round_cycle_fold_bf16``        ``round_cycle_fold`` on buffers whose state is stored in bf16 (as
                                           ``buffered_decode_bf16``)
round     ``pool_round_cycle``             ``round_cycle`` through the serving pool (every layer's accept in
                                           one call, the last folding)
round     ``pool_round_cycle_fold``        ``pool_round_cycle`` with that round's verify folding (fold=True),
                                           every accept with fold=False
round     ``tree_round``                   verify of a 16-node draft tree, then accept of one node's path
round     ``per_draft_state_tree_round``   the baseline's tree round (a parent's state read back per branch)
decode,   ``pool_*``                       the same through the serving pool (``kvbuffer_fast.pool``)
round
decode,   ``replayssm_*``                  ReplaySSM's kernels from ``--peer-path`` (decode, round, cycle)
round
decode    ``sglang_decode``                SGLang's packed decode from ``--sglang-path`` (default: the
                                           checkout's ``.whl/sglang/``): one token, its fp32 state pool
                                           updated in place by slot
decode,   ``flashinfer_*``                 FlashInfer's GDN kernels (``--flashinfer-path``, default the
verify,                                    checkout's ``.fi-site/``, else an installed flashinfer): decode
round                                      (fp32 pool, bf16 pool, K-major state), MTP verify, and a round
                                           (MTP verify, then the accepted state copied into the pool)
========  ===============================  ============================================================

Each package root (this one, and ``--before``'s older one) is driven through ``Api``: ``config=`` objects from
``kvbuffer_fast.launch``, baselines in ``kvbuffer_fast.baselines``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import kvbuffer_ref as ref
from bench import replayssm as replayssm_io
from bench.catalog import GROUPS, OPS, PEERS
from bench.timing import device_ms
from kvbuffer.validate.adapters import AdapterError
from kvbuffer.validate.properties import truth_and_baseline
from kvbuffer.validate.tolerances import active_contract, compare
import torch.nn.functional as F

from bench import io_model as io

__all__ = ["Plan", "GPU", "SMOKE", "Api", "Workload", "Case", "Skip", "OPS", "GROUPS", "PEERS", "build",
           "parse_overrides", "SGLANG_PATH", "FLASHINFER_PATH"]

#: Where ``sglang_decode`` looks for SGLang's wheel by default: the checkout's ``.whl/sglang/`` (a folder
#: holding a ``sglang-*.whl``; its kernel files are read from the wheel, SGLang is never installed).
SGLANG_PATH = str(Path(__file__).resolve().parents[1] / ".whl" / "sglang")
#: Where the ``flashinfer_*`` ops look for FlashInfer first: the prefix ``scripts/flashinfer_wheels.sh``
#: prepares and the GPU call unpacks (``.fi-site/``); where it is absent, an installed flashinfer.
FLASHINFER_PATH = str(Path(__file__).resolve().parents[1] / ".fi-site")


@dataclass(frozen=True)
class Plan:
    """Shapes and sizes of one benchmark run."""

    shapes: io.Shapes
    dtype: str            # token dtype (q, k, v; cached keys)
    batches: tuple
    C: int                # buffer capacity
    fill: int             # entries buffered when verify runs (n)
    drafts: int           # tokens verified per round (d)
    accepted: int         # drafts accepted per round (m)
    layers: int           # layers of distinct states, run in turn
    folded: int = 4       # history tokens folded into the state before the buffered ones
    state16: str = "bfloat16"  # the 16-bit state of the ``*_bf16`` ops (float16 under the interpreter)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shapes"] = self.shapes.as_dict()
        return d


#: Qwen3-Next's linear-attention layer, bf16 tokens, fp32 state and u-cache, bf16 cached keys.
GPU = Plan(shapes=io.Shapes(H=16, HV=32, K=128, V=128), dtype="bfloat16", batches=(64, 128, 256, 512), C=16,
           fill=8, drafts=5, accepted=3, layers=4)
#: Tiny shapes for the Triton interpreter (which mishandles bf16): proves the code, measures nothing.
SMOKE = Plan(shapes=io.Shapes(H=1, HV=2, K=16, V=16, key_bytes=4), dtype="float32", batches=(2,), C=4, fill=2,
             drafts=3, accepted=2, layers=2, folded=2, state16="float16")


class Skip(Exception):
    """A case that cannot be built here (fla not importable, an operation this package lacks)."""


# ----------------------------------------------------------------------------- the API of one package root
def parse_overrides(items: Sequence[str]) -> dict:
    """``["decode.fold_FH=4", "verify.early=True"]`` -> ``{"decode": {"fold_FH": 4}, "verify": {"early": True}}``."""
    out: dict = {}
    for item in items:
        name, sep, raw = item.partition("=")
        op, dot, fld = name.partition(".")
        if not sep or not dot or not op or not fld:
            raise ValueError(f"--set: expected OP.FIELD=VALUE (e.g. decode.fold_FH=4), got {item!r}")
        value: object = {"True": True, "False": False}.get(raw, raw)
        if isinstance(value, str):
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        out.setdefault(op, {})[fld] = value
    return out


class Api:
    """The operations the benchmarks time, over the ``kvbuffer_fast`` found on ``sys.path``.

    ``overrides`` (op -> {field: value}, config API only) change launch-table choices for one run:
    each call gets ``config=dataclasses.replace(config_for(op, key), **fields)``; module state is
    never written.
    """

    def __init__(self, overrides: Optional[dict] = None, peer_path: Optional[str] = None,
                 sglang_path: Optional[str] = SGLANG_PATH, flashinfer_path: Optional[str] = FLASHINFER_PATH):
        import kvbuffer_fast as fast  # here: it imports triton, which --smoke must not import first

        self.fast = fast
        self.peer_path = peer_path
        self.sglang_path = sglang_path
        self.flashinfer_path = flashinfer_path
        self._replayssm = None
        self._sglang = None
        self._flashinfer = None
        here = os.path.dirname(fast.__file__)  # not find_spec: an editable install maps names to its own tree
        if not os.path.exists(os.path.join(here, "launch.py")):
            raise ImportError(f"{here}: this kvbuffer_fast has no launch tables (kvbuffer_fast.launch); the benchmarks "
                              f"drive the config API only")
        self.overrides = overrides or {}
        self.baselines = importlib.import_module("kvbuffer_fast.baselines")
        self.launch = importlib.import_module("kvbuffer_fast.launch")
        for op, fields in self.overrides.items():
            if op not in self.launch.CONFIGS:
                raise ValueError(f"--set: no launch table {op!r}; expected one of {sorted(self.launch.CONFIGS)}")
            known = {f.name for f in dataclasses.fields(self.launch.CONFIGS[op])}
            unknown = sorted(set(fields) - known)
            if unknown:
                raise ValueError(f"--set: {self.launch.CONFIGS[op].__name__} has no field {unknown}; "
                                 f"it has {sorted(known)}")

    def pool_class(self):
        """kvbuffer_fast.pool.KVPool, the serving pool engines call (Skip where this package has none)."""
        try:
            return importlib.import_module("kvbuffer_fast.pool").KVPool
        except (ImportError, AttributeError) as e:
            raise Skip(f"this kvbuffer_fast has no serving pool (kvbuffer_fast.pool.KVPool): {e}") from None

    def engine_inputs(self):
        """kvbuffer_fast.engine_inputs (Skip where this package has none)."""
        fn = getattr(importlib.import_module("kvbuffer_fast"), "engine_inputs", None)
        if fn is None:
            raise Skip("this kvbuffer_fast has no engine_inputs")
        return fn

    def replayssm(self, device: str):
        """(decode module, speculative module) of ReplaySSM's kernels from ``--peer-path`` (Skip: none given,
        or the Triton interpreter, which rejects their masks)."""
        if device == "cpu":
            raise Skip("ReplaySSM's kernels do not run under the Triton interpreter (triton 3.9: 'mask has "
                       "unsupported dtype'): run bench.gpu on the GPU with --peer-path <checkout>")
        if not self.peer_path:
            raise Skip("no --peer-path: give a ReplaySSM checkout (github.com/Johnny-Liou/ReplaySSM) to time its "
                       "kernels; they are loaded from there, never copied here")
        if self._replayssm is None:
            try:
                self._replayssm = replayssm_io.load(self.peer_path)
            except AdapterError as e:
                raise Skip(str(e)) from None
        return self._replayssm

    def sglang(self, device: str):
        """SGLang's GDN kernel modules (``kvbuffer.peers.sglang.load_kernels``) from ``--sglang-path``
        only: a ``sglang-*.whl``, a folder holding one, or a tree holding the ``sglang`` package.  Skip where
        none is given or it holds no kernels.  Under the Triton interpreter (``device == "cpu"``) the
        loader adds its interpreter stand-ins; on CUDA the kernel files run as SGLang ships them."""
        if self._sglang is None:
            self._sglang = self._load_sglang()
        if isinstance(self._sglang, Skip):
            raise Skip(str(self._sglang))
        return self._sglang

    def _load_sglang(self):
        if not self.sglang_path:
            return Skip("no --sglang-path: give SGLang's wheel (python3 -m pip download --no-deps sglang -d DIR, "
                        "then --sglang-path DIR) to time its packed decode; nothing of SGLang is installed")
        try:
            sg = importlib.import_module("kvbuffer.peers.sglang")
        except ImportError as e:
            return Skip(f"this kvbuffer_ref has no SGLang loader (kvbuffer.peers.sglang): {e}")
        if "path" not in inspect.signature(sg.load_kernels).parameters:
            return Skip("this kvbuffer_ref's SGLang loader takes no path (load_kernels(path=)): sglang_decode "
                        "runs against a package root that has it")
        try:
            return sg.load_kernels(path=self.sglang_path)
        except AdapterError as e:
            return Skip(f"--sglang-path: {e}")

    def flashinfer(self, device: str):
        """FlashInfer's GDN functions (``kvbuffer.peers.flashinfer.load``): from ``--flashinfer-path`` where
        that folder exists, else an installed flashinfer.  Skip on the CPU (CuTe-DSL kernels, CUDA only),
        where ``--flashinfer-path ''`` turns the ops off, or where it cannot be imported (the reason names
        the package and version)."""
        if device == "cpu":
            raise Skip("FlashInfer's GDN kernels are CuTe-DSL CUDA kernels (SM90+): run bench.gpu on the GPU")
        if self.flashinfer_path == "":
            raise Skip("--flashinfer-path '': the flashinfer_* ops are off")
        if self._flashinfer is None:
            try:
                fi = importlib.import_module("kvbuffer.peers.flashinfer")
            except ImportError as e:
                self._flashinfer = Skip(f"this kvbuffer has no FlashInfer peer (kvbuffer.peers.flashinfer): {e}")
            else:
                path = self.flashinfer_path if self.flashinfer_path and os.path.isdir(self.flashinfer_path) else None
                try:
                    self._flashinfer = fi.load(path)
                except AdapterError as e:
                    self._flashinfer = Skip(str(e))
        if isinstance(self._flashinfer, Skip):
            raise Skip(str(self._flashinfer))
        return self._flashinfer

    def kwargs(self, op: str, fn: Callable, x: dict, C: int = 0, state: Optional[torch.dtype] = None) -> dict:
        """The launch keywords of one call of ``fn`` (launch table ``op``) on tokens ``x`` (``state``: the
        stored state's dtype, None for float32): the ``config`` override of ``op``, if any."""
        params = inspect.signature(fn).parameters
        kw = {}
        fields = self.overrides.get(op)
        if fields:
            if "config" not in params:
                raise ValueError(f"--set {op}.*: {fn.__module__}.{fn.__name__} takes no config")
            B, HV, V = x["q"].shape[0], x["v"].shape[2], x["v"].shape[3]
            key = self.launch.key_of(x["q"], C=C, B=B, HV=HV, V=V, channel=x["g"].dim() == 4, state=state)
            kw["config"] = dataclasses.replace(self.launch.config_for(op, key), **fields)
        return kw

    @staticmethod
    def takes(fn: Callable, name: str) -> bool:
        return name in inspect.signature(fn).parameters


# ----------------------------------------------------------------------------- inputs and the oracle
def _map_buffer(buf, fn):
    """A KVBuffer whose every tensor field is ``fn(name, tensor)`` (None stays None)."""
    return type(buf)(**{f.name: (None if getattr(buf, f.name) is None else fn(f.name, getattr(buf, f.name)))
                        for f in dataclasses.fields(buf)})


def _shared_lengths(bufs: list) -> tuple:
    """(lengths [L, B], the buffers with their lengths as its rows): a timed round restores every layer's
    buffer to n entries with one fill, as the peer's round restores its cursors once for all layers."""
    lengths = torch.stack([b.lengths for b in bufs])
    return lengths, [dataclasses.replace(b, lengths=lengths[i]) for i, b in enumerate(bufs)]


def _round_run(verify, accept, lengths, n: int, xs: list, bufs: list, kw: dict, akw: dict) -> Callable:
    """A timed round: every layer's lengths back to n (one fill), verify on every layer, then accept on every
    layer (``akw``: accept's keywords, counts= or nodes= included)."""
    def run():
        lengths.fill_(n)
        drafts = [verify(**x, buffer=buf, **kw)[1] for x, buf in zip(xs, bufs)]
        for buf, dr in zip(bufs, drafts):
            accept(buf, dr, **akw)
    return run


def _replayssm_round(spec, pairs, qsl, blocks, cur: dict, accepted, *, Lc: int, T: int, Rb: int, scale: float):
    """One ReplaySSM round as vLLM runs it: its spec decode on every layer (``pairs``: (the layer's ring and
    gating parameters, the round's tokens)), then one commit of the accepted counts for all layers."""
    for ly, tok in pairs:
        spec.gdn_replayssm_spec_decode(tok["mixed"], tok["a"], tok["b"], ly["A_log"], ly["dt_bias"], ly["h"], ly["d"],
                                       ly["k"], ly["g"], tok["out"], qsl, blocks, cur["write_pos"], cur["cache_base"],
                                       cur["is_flush"], max_cache_len=Lc, max_spec_len=T, scale=scale,
                                       use_qk_l2norm_in_kernel=False)
    spec.commit_gdn_replayssm_spec(cur["write_pos"], cur["cache_base"], cur["is_flush"], accepted, blocks,
                                   max_cache_len=Lc, max_spec_len=T, cache_buf_len=Rb)


def clone_buffer(buf):
    return _map_buffer(buf, lambda _, t: t.clone())


@dataclass
class History:
    """Two base histories (tokens on the CPU, token dtype; ``P`` tokens each) and the batch's device
    buffer after them (request b has base b % 2's: its last ``buffered`` tokens buffered, the rest
    folded into its state)."""

    x: dict
    buffer: object
    P: int
    S0: Optional[torch.Tensor] = None  # the float64 state [2, HV, K, V] ``x`` starts from (None: zero)


@dataclass
class Truth:
    """Float64 outputs over the new tokens and final state of the check rows, and the fp32 baseline of
    both (the correct forms in the compute dtype, row by row the worst)."""

    o: torch.Tensor
    base_o: Optional[torch.Tensor]
    S: torch.Tensor
    base_S: Optional[torch.Tensor]
    contract: str = "ieee"  # the arithmetic the baselines were computed in


class Workload:
    """The inputs of one batch on one device, and the float64 truth of its check rows (0 and B - 1)."""

    def __init__(self, plan: Plan, B: int, device: str):
        self.plan, self.B, self.device = plan, B, device
        self.s, self.dtype = plan.shapes, plan.torch_dtype
        self.rows = sorted({0, B - 1})

    def _draw(self, B: int, T: int, gen: torch.Generator, device) -> dict:
        s = self.s
        q = F.normalize(torch.randn(B, T, s.H, s.K, device=device, generator=gen), dim=-1).to(self.dtype)
        k = F.normalize(torch.randn(B, T, s.H, s.K, device=device, generator=gen), dim=-1).to(self.dtype)
        v = torch.randn(B, T, s.HV, s.V, device=device, generator=gen).to(self.dtype)
        g = -0.5 * torch.rand(B, T, s.HV, device=device, generator=gen)  # mild decays
        beta = torch.rand(B, T, s.HV, device=device, generator=gen)
        return dict(q=q, k=k, v=v, g=g, beta=beta)

    def tokens(self, T: int, seed: int) -> dict:
        """q, k (unit norm), v in the token dtype; g in [-0.5, 0], beta in [0, 1] in fp32: [B, T, ...]."""
        return self._draw(self.B, T, torch.Generator(device=self.device).manual_seed(seed), self.device)

    @staticmethod
    def steps(x: dict) -> list[dict]:
        """[B, T, ...] tokens as T contiguous one-token dicts (sliced before timing, not inside it)."""
        return [{n: t[:, j:j + 1].contiguous() for n, t in x.items()} for j in range(x["q"].shape[1])]

    def history(self, buffered: int, folded: Optional[int] = None, seed: int = 100,
                state_dtype: Optional[torch.dtype] = None) -> History:
        """The batch's buffer after ``folded + buffered`` history tokens (default ``folded``: the
        plan's), the last ``buffered`` of them buffered: a float64 oracle prefill of two base requests,
        stored as the kernels store it (keys in the token dtype, the rest fp32).  With ``state_dtype``
        (e.g. bfloat16) the state after the folded tokens is rounded to it and stored in it, and the
        buffered tokens are prefilled from that rounded state: the history is then the buffered tokens
        alone, starting from the rounded state (``History.S0``, float64), so that a truth over it is
        exact for the state the buffer holds."""

        folded = self.plan.folded if folded is None else folded
        P = folded + buffered
        x = self._draw(2, P, torch.Generator().manual_seed(seed), "cpu")
        x64 = {n: t.double() for n, t in x.items()}
        S0 = None
        if state_dtype is None:
            two = [ref.prefill(**{n: t[b:b + 1] for n, t in x64.items()}, capacity=self.plan.C, tail=buffered)[1]
                   for b in range(2)]
        else:
            two = []
            for b in range(2):
                head = {n: t[b:b + 1, :folded] for n, t in x64.items()}
                S = ref.prefill(**head, capacity=self.plan.C, tail=0)[1].state
                S = S.to(state_dtype).double()  # rounded to nearest even, as the kernels store a state
                two.append(ref.prefill(**{n: t[b:b + 1, folded:] for n, t in x64.items()}, capacity=self.plan.C,
                                       tail=buffered, initial_state=S)[1])
            S0 = torch.cat([b.state for b in two])
            x, P = {n: t[:, folded:] for n, t in x.items()}, buffered
        dtypes = {"k": self.dtype, "lengths": None, "has_state": None, "state": state_dtype or torch.float32}
        idx = torch.arange(self.B, device=self.device) % 2

        def to_device(name, _):
            t = torch.cat([getattr(b, name) for b in two])
            dt = dtypes.get(name, torch.float32)
            t = t.to(self.device) if dt is None else t.to(self.device, dt)
            return t.index_select(0, idx).contiguous()

        return History(x=x, buffer=_map_buffer(two[0], to_device), P=P, S0=S0)

    def truth(self, new: dict, hist: History, upto: Optional[int] = None, contract: str = "ieee") -> Truth:
        """The recurrence over each check row's history followed by its new tokens (the first
        ``upto`` of them, or all), and the baseline of the budgets: the correct forms in float32
        (``truth_and_baseline``: the recurrence and the chunkwise form with the buffer's capacity as its chunk),
        under the arithmetic ``contract`` of the kernel checked (``kvbuffer.validate.contracts``); from the
        history's ``S0`` where it has one."""

        rows = torch.tensor(self.rows)
        x = {n: torch.cat([hist.x[n].index_select(0, rows % 2),
                           t[:, :upto].detach().cpu().index_select(0, rows)], dim=1) for n, t in new.items()}
        S0 = None if hist.S0 is None else hist.S0.index_select(0, rows % 2)
        with active_contract(contract):
            (o64, S64), (ob, Sb) = truth_and_baseline(x, initial_state=S0, chunk=self.plan.C)
        P = hist.P
        return Truth(o64[:, P:], ob[:, P:].to(self.dtype), S64, Sb, contract)

    def compare(self, name: str, actual: torch.Tensor, truth: Truth, *, state: bool = False,
                dtype: Optional[torch.dtype] = None) -> dict:
        """One comparison of the check rows of ``actual`` (an output [B, T, HV, V] or, with ``state``,
        a state [B, HV, K, V]) with the truth, under the tolerance table's row for ``dtype`` (default:
        the token dtype for outputs, at least fp32 for states)."""
        a = actual.detach().index_select(0, torch.tensor(self.rows, device=actual.device)).cpu()
        if state:
            dt = dtype or torch.promote_types(self.dtype, torch.float32)
            c = compare(a, truth.S, truth.base_S, name=name, dtype=dt, head_axis=1, contract=truth.contract)
        else:
            c = compare(a, truth.o, truth.base_o, name=name, dtype=self.dtype, head_axis=2, contract=truth.contract)
        return dict(name=c.name, dtype=str(c.dtype).replace("torch.", ""), passed=bool(c.passed),
                    worst_rel=c.worst_rel, baseline_rel=c.baseline_rel, budget=c.budget, max_abs=c.max_abs,
                    text=str(c))


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One operation at one batch, ready to time: ``run()`` performs ``count`` operations (every layer,
    in model order); ``checks`` are layer 0's comparisons with the oracle, made before any timing."""

    op: str
    group: str
    B: int
    run: Callable[[], object]
    count: int
    io_bytes: float
    checks: list
    info: dict = field(default_factory=dict)
    note: str = ""
    peer: bool = False  # another project's kernel: timed even where its error is past our budget (recorded)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)


def _fla(name: str):
    try:
        with warnings.catch_warnings():  # fla's import warns where it finds no GPU backend and no flash-attn
            warnings.simplefilter("ignore", (UserWarning, ImportWarning, DeprecationWarning))
            mod = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # noqa: BLE001 - fla is optional: its rows say why they are missing
        raise Skip(f"fla is not importable: {type(e).__name__}: {e}") from None
    return getattr(mod, name)


def _fla_call(fn, x, state, scale):
    # keywords only (fla's positional order differs between its functions); state [B, HV, K, V]
    return fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=scale, initial_state=state,
              output_final_state=True, use_qk_l2norm_in_kernel=False)


class _Builder:
    """Builds the cases of one batch (one method per operation)."""

    def __init__(self, api: Api, wl: Workload):
        self.api, self.wl, self.p, self.s = api, wl, wl.plan, wl.plan.shapes
        self.L, self.B = wl.plan.layers, wl.B
        self.scale = self.s.K ** -0.5

    def _layers(self, make: Callable[[int], object]) -> list:
        return [make(layer) for layer in range(self.L)]

    def _states(self, hist: History) -> list:
        return [hist.buffer.state] + [hist.buffer.state.clone() for _ in range(self.L - 1)]

    def _buffers(self, hist: History) -> list:
        return [hist.buffer] + [clone_buffer(hist.buffer) for _ in range(self.L - 1)]

    def _tokens(self, T: int, seed: int) -> list:
        return self._layers(lambda layer: self.wl.tokens(T, seed + 1000 * layer))

    def case(self, op, group, run, count, io_bytes, checks, **info) -> Case:
        return Case(op=op, group=group, B=self.B, run=run, count=count, io_bytes=io_bytes, checks=checks, info=info)

    # ------------------------------------------------------------------ decode
    def recurrent_decode(self) -> Case:
        step = self.api.baselines.recurrent_decode
        hist = self.wl.history(buffered=0)
        states, xs = self._states(hist), self._tokens(1, seed=1)
        kw = self.api.kwargs("recurrent", step, xs[0])
        truth = self.wl.truth(xs[0], hist)
        o = step(**xs[0], state=states[0], **kw)
        checks = [self.wl.compare("recurrent_decode.o", o, truth),
                  self.wl.compare("recurrent_decode.state", states[0], truth, state=True)]

        def run():
            for x, st in zip(xs, states):
                step(**x, state=st, **kw)
        return self.case("recurrent_decode", "decode", run, self.L, io.recurrent_step(self.s, self.B), checks)

    def fla_fused_recurrent(self) -> Case:
        return self._fla_case("fused_recurrent_gated_delta_rule", "fla_fused_recurrent", "decode", T=1)

    def _fla_case(self, fn_name: str, op: str, group: str, T: int) -> Case:
        """fla's ``fn_name`` over T tokens from each layer's state (a new final state, nothing in place)."""
        fn = _fla(fn_name)
        hist = self.wl.history(buffered=0) if T == 1 else self._state_history()
        states, xs = self._states(hist), self._tokens(T, seed=1 if T == 1 else 3)
        # fla's chunk kernel multiplies 16-bit tokens in 16-bit tensor-core products: judged under that
        # contract ("bf16"); its fused_recurrent kernel keeps IEEE float32
        chunk16 = fn_name.startswith("chunk") and self.wl.dtype in (torch.float16, torch.bfloat16)
        truth = self.wl.truth(xs[0], hist, contract="bf16" if chunk16 else "ieee")
        try:
            o, S = _fla_call(fn, xs[0], states[0], self.scale)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here (e.g. autotuning under the interpreter)
            raise Skip(f"fla {fn_name} does not run here: {type(e).__name__}: {str(e)[:200]}") from None
        # fla's chunk kernel forms its state with tensor-core products of the 16-bit tokens: its state is
        # held to the token dtype's row of the tolerance table (its fused_recurrent state to fp32's)
        state_dtype = self.wl.dtype if fn_name.startswith("chunk") else None
        checks = [self.wl.compare(f"{op}.o", o, truth),
                  self.wl.compare(f"{op}.state", S, truth, state=True, dtype=state_dtype)]

        def run():
            for x, st in zip(xs, states):
                _fla_call(fn, x, st, self.scale)
        return self.case(op, group, run, self.L, io.recurrent_step(self.s, self.B), checks, d=T)

    def buffered_decode(self) -> Case:
        return self._buffered_decode("buffered_decode")

    def buffered_decode_bf16(self) -> Case:
        """``buffered_decode`` on buffers whose state is stored in bfloat16 (the history's state rounded to it;
        each fold rounds the state it writes once); the plan's ``state16`` (float16 under --smoke)."""
        return self._buffered_decode("buffered_decode_bf16", self._state16())

    def _state16(self) -> torch.dtype:
        """The plan's 16-bit state dtype, if this package root stores one (``_common.STATE_DTYPES``), else Skip."""
        dt = getattr(torch, self.p.state16)
        try:
            allowed = importlib.import_module("kvbuffer_fast._common").STATE_DTYPES
        except (ImportError, AttributeError):
            allowed = (torch.float32,)
        if dt not in allowed:
            raise Skip(f"this kvbuffer_fast stores no {self.p.state16} buffer state (_common.STATE_DTYPES)")
        return dt

    def _stored(self, state_dtype: Optional[torch.dtype]) -> tuple:
        """(the plan's shapes with the state's bytes at ``state_dtype``'s size, the row's ``state_dtype`` field):
        the plan's shapes and no field for None (float32)."""
        if state_dtype is None:
            return self.s, {}
        return (dataclasses.replace(self.s, state_bytes=torch.empty(0, dtype=state_dtype).element_size()),
                dict(state_dtype=str(state_dtype).removeprefix("torch.")))

    def _buffered_decode(self, op: str, state_dtype: Optional[torch.dtype] = None) -> Case:
        """One step of ``buffered_decode``, averaged over a cycle of C steps from full buffers (the fold of the C
        entries fused into the first step); with ``state_dtype`` the buffers' state is stored in it (the
        history's state rounded to it, the truth starting from the rounded state), the outputs judged under the
        bf16-state contract and the state the fold writes checked in that dtype."""
        decode, C = self.api.fast.buffered_decode, self.p.C
        s, info = self._stored(state_dtype)
        hist = self.wl.history(buffered=C, state_dtype=state_dtype)
        bufs = self._buffers(hist)
        xs = self._tokens(C, seed=2)
        steps = [self.wl.steps(x) for x in xs]
        kw = self.api.kwargs("decode", decode, xs[0], C=C, state=state_dtype)
        # a 16-bit state: the budgets' correct forms round their state to it after every token (the kernel
        # rounds it once per fold, every C tokens: within that contract)
        contract = "ieee" if state_dtype is None else "bf16-state"
        truth = self.wl.truth(xs[0], hist, contract=contract)
        outs = [decode(**st, buffer=bufs[0], **kw)[0] for st in steps[0]]
        checks = [self.wl.compare(f"{op}[C={C}] cycle.o", torch.cat(outs, dim=1), truth)]
        if state_dtype is not None:  # the state the cycle's fold wrote: the history's C entries folded
            checks.append(self.wl.compare(f"{op}[C={C}] fold.state", bufs[0].state,
                                          self.wl.truth(xs[0], hist, upto=0, contract=contract), state=True,
                                          dtype=state_dtype))
        if not bool((bufs[0].lengths == C).all()):
            checks.append(dict(name=f"{op}: every buffer full again after a cycle", passed=False,
                               text=f"lengths {bufs[0].lengths.tolist()} after a cycle, expected all {C}"))

        def run():
            for t in range(C):
                for layer in range(self.L):
                    decode(**steps[layer][t], buffer=bufs[layer], **kw)
        c = self.case(op, "decode", run, self.L * C, io.buffered_cycle_step(s, self.B, C), checks, C=C, **info)
        if state_dtype is not None:
            name = info["state_dtype"]
            c.note = (f"kvbuffer_fast.buffered_decode on buffers whose state is stored in {name} "
                      f"(the history's state rounded to it; the truth starts from the rounded state); the fold rounds "
                      f"the state it writes once per cycle of C = {C} tokens, and the outputs are judged under the "
                      f"bf16-state contract (the budgets' correct forms round their state after every token: looser "
                      f"than once per fold), the folded state in {name}")
        return c

    def read_state(self) -> Case:
        """The measured floor of a state read: each layer's fp32 state [B, HV, K, V] read once by
        ``bench/read_state.py``'s kernel, every layer in turn.  Each of its tilings is checked (its tile sums
        against torch's) and timed as the runner times a case; the case runs the fastest."""
        from bench import read_state as RS  # here: it imports triton, which --smoke must not import first

        s, B, dev = self.s, self.B, self.wl.device
        gen = torch.Generator(device=dev).manual_seed(17)
        states = self._layers(lambda _: torch.randn(B, s.HV, s.K, s.V, device=dev, generator=gen))
        checks, runs, us = [], {}, {}
        for t in dict.fromkeys(RS.fit(x, s.K, s.V) for x in RS.TILINGS):  # distinct tilings, in order
            outs = [torch.empty(B * s.HV, s.V // t.BV, device=dev) for _ in states]
            RS.launch(states[0], outs[0], t)
            checks.append(RS.sums_check(f"read_state[{t}].sums", states[0], outs[0], t.BV))

            def run(t=t, outs=outs):
                for st, o in zip(states, outs):
                    RS.launch(st, o, t)
            runs[t], us[t] = run, device_ms(run, smoke=dev == "cpu")[0] * 1e3 / self.L
        best = min(us, key=us.get)
        c = self.case("read_state", "decode", runs[best], self.L, io.read_state(s, B, best.BV), checks,
                      tiling=str(best), tilings_us={str(t): u for t, u in us.items()})
        c.note = ("a kernel that only reads each layer's state (one fp32 sum written per [K, BV] tile), tiling "
                  f"{best}" + (f" (the fastest of {len(us)})" if len(us) > 1 else ""))
        return c

    # ------------------------------------------------------------------ verify
    def _state_history(self) -> History:
        """The per-draft-state side's history: the buffered side's tokens, all of them folded."""
        return self.wl.history(buffered=0, folded=self.p.folded + self.p.fill)

    def _verify_layers(self, seed: int):
        hist = self.wl.history(buffered=self.p.fill)
        bufs, xs = self._buffers(hist), self._tokens(self.p.drafts, seed=seed)
        return hist, bufs, xs, self._verify_kwargs(xs[0])

    def _verify_kwargs(self, x: dict, state_dtype: Optional[torch.dtype] = None) -> dict:
        """verify's keywords for tokens ``x`` (``state_dtype``: the buffers' stored state's, None for
        float32): one draft tree per step, passed to every layer, as an engine does (the chain of d drafts)."""
        kw = self.api.kwargs("verify", self.api.fast.verify, x, C=self.p.C, state=state_dtype)
        d, dev = self.p.drafts, self.wl.device
        kw["parents"] = torch.arange(-1, d - 1, device=dev, dtype=torch.long).expand(self.B, d).contiguous()
        kw["num_drafts"] = torch.full((self.B,), d, device=dev, dtype=torch.long)
        return kw

    def verify(self) -> Case:
        verify, n, d = self.api.fast.verify, self.p.fill, self.p.drafts
        hist, bufs, xs, kw = self._verify_layers(seed=3)
        truth = self.wl.truth(xs[0], hist)
        o, _ = verify(**xs[0], buffer=bufs[0], **kw)
        checks = [self.wl.compare(f"verify[d={d}].o", o, truth)]

        def run():
            for x, buf in zip(xs, bufs):
                verify(**x, buffer=buf, **kw)
        return self.case("verify", "verify", run, self.L, io.buffered_verify(self.s, self.B, n, d), checks,
                         C=self.p.C, n=n, d=d)

    def _per_draft_layers(self, seed: int):
        pd_verify = self.api.baselines.per_draft_state_verify
        hist = self._state_history()
        states, xs = self._states(hist), self._tokens(self.p.drafts, seed=seed)
        kw = self.api.kwargs("per_draft_state", pd_verify, xs[0])
        if self.api.takes(pd_verify, "intermediate"):  # preallocated: not an allocation inside the timing
            s = self.s
            inter = self._layers(lambda _: torch.empty(self.B, self.p.drafts, s.HV, s.K, s.V, device=self.wl.device))
            kws = [dict(kw, intermediate=i) for i in inter]
        else:
            kws = [kw] * self.L
        return hist, states, xs, kws

    def per_draft_state_verify(self) -> Case:
        pd_verify, d = self.api.baselines.per_draft_state_verify, self.p.drafts
        hist, states, xs, kws = self._per_draft_layers(seed=3)
        truth = self.wl.truth(xs[0], hist)
        o, inter = pd_verify(**xs[0], state=states[0], **kws[0])
        checks = [self.wl.compare(f"per_draft_state_verify[d={d}].o", o, truth),
                  self.wl.compare(f"per_draft_state_verify[d={d}].last_state", inter[:, d - 1], truth, state=True)]

        def run():
            for x, st, kw in zip(xs, states, kws):
                pd_verify(**x, state=st, **kw)
        return self.case("per_draft_state_verify", "verify", run, self.L, io.per_draft_verify(self.s, self.B, d),
                         checks, d=d)

    def fla_fused_recurrent_tokens(self) -> Case:
        return self._fla_case("fused_recurrent_gated_delta_rule", "fla_fused_recurrent_tokens", "verify",
                              T=self.p.drafts)

    def fla_chunk_tokens(self) -> Case:
        return self._fla_case("chunk_gated_delta_rule", "fla_chunk_tokens", "verify", T=self.p.drafts)

    # ------------------------------------------------------------------ accept
    def _counts(self) -> torch.Tensor:
        return torch.full((self.B,), self.p.accepted, dtype=torch.long, device=self.wl.device)

    def _accept_check(self, name, o, buf, xs0, hist) -> list:
        checks = [] if o is None else [self.wl.compare(f"{name}.o", o, self.wl.truth(xs0, hist))]
        truth_m = self.wl.truth(xs0, hist, upto=self.p.accepted)
        return checks + [self.wl.compare(f"{name}.state_after_accept", self.api.fast.materialize_state(buf), truth_m,
                                         state=True)]

    def accept(self) -> Case:
        verify, accept, n, m = self.api.fast.verify, self.api.fast.accept, self.p.fill, self.p.accepted
        hist, bufs, xs, kw = self._verify_layers(seed=7)
        akw = self.api.kwargs("accept", accept, xs[0], C=self.p.C)
        counts = self._counts()
        lengths, bufs = _shared_lengths(bufs)
        drafts = [verify(**x, buffer=buf, **kw)[1] for x, buf in zip(xs, bufs)]
        accept(bufs[0], drafts[0], counts=counts, **akw)
        checks = self._accept_check(f"accept[m={m}]", None, bufs[0], xs[0], hist)

        def run():
            lengths.fill_(n)
            for buf, dr in zip(bufs, drafts):
                accept(buf, dr, counts=counts, **akw)
        c = self.case("accept", "accept", run, self.L, io.buffered_accept(self.s, self.B, m), checks, n=n, m=m,
                      d=self.p.drafts)
        c.note = "each replay first fills every layer's lengths back to n (one tiny kernel for all layers)"
        return c

    def flush(self) -> Case:
        flush, C = self.api.fast.flush, self.p.C
        hist = self.wl.history(buffered=C)
        lengths, bufs = _shared_lengths(self._buffers(hist))
        x = self._tokens(1, seed=11)[0]
        kw = self.api.kwargs("flush", flush, x, C=C)
        flush(bufs[0], **kw)
        checks = [self.wl.compare(f"flush[n={C}].state", bufs[0].state, self.wl.truth(x, hist, upto=0), state=True)]

        def run():
            lengths.fill_(C)
            for buf in bufs:
                flush(buf, **kw)
        c = self.case("flush", "accept", run, self.L, io.buffered_flush(self.s, self.B, C), checks, n=C)
        c.note = "each replay first fills every layer's lengths back to C (one tiny kernel for all layers)"
        return c

    def per_draft_state_accept(self) -> Case:
        pd_verify, pd_accept, m = self.api.baselines.per_draft_state_verify, self.api.baselines.per_draft_state_accept, \
            self.p.accepted
        hist, states, xs, kws = self._per_draft_layers(seed=7)
        inter = [pd_verify(**x, state=st, **kw)[1] for x, st, kw in zip(xs, states, kws)]
        counts = self._counts()
        pd_accept(states[0], inter[0], counts)
        checks = [self.wl.compare(f"per_draft_state_accept[m={m}].state", states[0],
                                  self.wl.truth(xs[0], hist, upto=m), state=True)]

        def run():
            for st, i in zip(states, inter):
                pd_accept(st, i, counts)
        return self.case("per_draft_state_accept", "accept", run, self.L, io.per_draft_accept(self.s, self.B), checks,
                         m=m, d=self.p.drafts)

    # ------------------------------------------------------------------ round
    def round(self) -> Case:
        verify, accept, n, d, m = self.api.fast.verify, self.api.fast.accept, self.p.fill, self.p.drafts, \
            self.p.accepted
        hist, bufs, xs, kw = self._verify_layers(seed=9)
        akw = self.api.kwargs("accept", accept, xs[0], C=self.p.C)
        counts = self._counts()
        lengths, bufs = _shared_lengths(bufs)
        o, dr = verify(**xs[0], buffer=bufs[0], **kw)
        accept(bufs[0], dr, counts=counts, **akw)
        checks = self._accept_check(f"round[d={d}, m={m}]", o, bufs[0], xs[0], hist)

        run = _round_run(verify, accept, lengths, n, xs, bufs, kw, dict(akw, counts=counts))
        c = self.case("round", "round", run, self.L,
                      io.buffered_verify(self.s, self.B, n, d) + io.buffered_accept(self.s, self.B, m), checks,
                      C=self.p.C, n=n, d=d, m=m)
        c.note = "each replay first fills every layer's lengths back to n (one tiny kernel for all layers)"
        return c

    # ------------------------------------------------------------------ a round over a draft tree
    #: The draft tree of the tree rounds: 16 nodes as a binary heap (node i's parent (i - 1) // 2, node 0
    #: the root, node 15 under node 7), so depth 5 and at most 2 children; the sampler accepts node 3, the
    #: path 0, 1, 3 (m = 3 tokens, as the chain rounds).
    TREE = [-1] + [(i - 1) // 2 for i in range(1, 16)]
    TREE_NODE = 3

    def _tree_paths(self) -> tuple:
        """(the deepest path, root to node 15; the accepted node's path) as lists of node indices."""

        par = torch.tensor(self.TREE)
        return ref.path_to(par, len(self.TREE) - 1), ref.path_to(par, self.TREE_NODE)

    def _tree_parents(self) -> torch.Tensor:
        """TREE as every request's parents [B, 16] (int64, on the device)."""
        D = len(self.TREE)
        return torch.tensor(self.TREE, device=self.wl.device, dtype=torch.long).expand(self.B, D).contiguous()

    def _tree_checks(self, name: str, o, state, xs0: dict, hist) -> list:
        """The outputs along the deepest path (root to node 15) and the state after accepting TREE_NODE, against
        the recurrence over each path."""
        deep, path = self._tree_paths()
        along = lambda p: {n: t[:, p] for n, t in xs0.items()}  # noqa: E731
        checks = [] if o is None else [self.wl.compare(f"{name}.o along the path {deep}", o[:, deep],
                                                       self.wl.truth(along(deep), hist))]
        return checks + [self.wl.compare(f"{name}.state after accepting node {self.TREE_NODE}", state,
                                         self.wl.truth(along(path), hist), state=True)]

    def tree_round(self) -> Case:
        verify, accept, n = self.api.fast.verify, self.api.fast.accept, self.p.fill
        D, dev = len(self.TREE), self.wl.device
        hist = self.wl.history(buffered=n)
        bufs, xs = self._buffers(hist), self._tokens(D, seed=13)
        kw = self.api.kwargs("verify", verify, xs[0], C=self.p.C)
        kw["parents"] = self._tree_parents()
        kw["num_drafts"] = torch.full((self.B,), D, device=dev, dtype=torch.long)
        akw = self.api.kwargs("accept", accept, xs[0], C=self.p.C)
        nodes = torch.full((self.B,), self.TREE_NODE, dtype=torch.long, device=dev)
        lengths, bufs = _shared_lengths(bufs)
        o, dr = verify(**xs[0], buffer=bufs[0], **kw)
        accept(bufs[0], dr, nodes=nodes, **akw)
        checks = self._tree_checks("tree_round", o, self.api.fast.materialize_state(bufs[0]), xs[0], hist)
        m = len(self._tree_paths()[1])

        run = _round_run(verify, accept, lengths, n, xs, bufs, kw, dict(akw, nodes=nodes))
        c = self.case("tree_round", "round", run, self.L,
                      io.buffered_verify(self.s, self.B, n, D) + io.buffered_accept(self.s, self.B, m), checks,
                      C=self.p.C, n=n, d=D, m=m, tree="binary heap of 16 nodes, node 3 accepted")
        c.note = ("verify of a 16-node draft tree (a binary heap, depth 5) + accept of node 3's path (3 tokens); "
                  "each replay first fills every layer's lengths back to n (one tiny kernel for all layers)")
        return c

    def per_draft_state_tree_round(self) -> Case:
        pd_verify, pd_accept = self.api.baselines.per_draft_state_verify, self.api.baselines.per_draft_state_accept
        if "parents" not in inspect.signature(pd_verify).parameters:
            raise Skip("this package root's per_draft_state_verify takes no parents (chains only)")
        D, dev, s = len(self.TREE), self.wl.device, self.s
        hist = self._state_history()
        states, xs = self._states(hist), self._tokens(D, seed=13)
        kw = self.api.kwargs("per_draft_state", pd_verify, xs[0])
        kw["parents"] = self._tree_parents()
        inter = self._layers(lambda _: torch.empty(self.B, D, s.HV, s.K, s.V, device=dev))
        counts = torch.full((self.B,), self.TREE_NODE + 1, dtype=torch.long, device=dev)  # node n: intermediate[n]
        o, _ = pd_verify(**xs[0], state=states[0], intermediate=inter[0], **kw)
        pd_accept(states[0], inter[0], counts)
        checks = self._tree_checks("per_draft_state_tree_round", o, states[0], xs[0], hist)

        def run():
            for x, st, i in zip(xs, states, inter):
                pd_verify(**x, state=st, intermediate=i, **kw)
            for st, i in zip(states, inter):
                pd_accept(st, i, counts)
        return self.case("per_draft_state_tree_round", "round", run, self.L,
                         io.per_draft_tree_verify(s, self.B, self.TREE) + io.per_draft_accept(s, self.B), checks,
                         d=D, m=len(self._tree_paths()[1]), tree="binary heap of 16 nodes, node 3 accepted")

    # ------------------------------------------------------------------ cycles of rounds, folds included
    def _cycle(self) -> tuple:
        """(R rounds, the entries n each starts from): from an empty buffer, m accepted per round, R = C // m + 1
        rounds, so that exactly one round's accept folds (the buffer passes C) and a replay is a whole cycle."""
        C, m = self.p.C, self.p.accepted
        R, n, starts = C // m + 1, 0, []
        for _ in range(R):
            starts.append(n)
            n = n + m if n + m <= C else m  # the fold keeps the path entries past the old ones
        return R, starts

    @staticmethod
    def _round_tokens(x: dict, r: int, d: int) -> dict:
        return {n: t[:, r * d:(r + 1) * d].contiguous() for n, t in x.items()}

    def _accepted_tokens(self, x: dict, R: int) -> dict:
        """The tokens a cycle commits: the first m of each round's d."""
        d, m = self.p.drafts, self.p.accepted
        return {n: torch.cat([t[:, r * d:r * d + m] for r in range(R)], dim=1) for n, t in x.items()}

    def _cycle_checks(self, name: str, outs: list, state, hist, rounds: list, xs: list, m: int,
                      folded: Optional[int], state_dtype: Optional[torch.dtype] = None) -> list:
        """A round cycle's checks on layer 0: round 0's outputs, the state after the R rounds (``state``, as the
        op reads it back) and, when round ``folded``'s verify folded, that round's outputs against the tokens
        rounds 0..folded-1 committed followed by its own.  A 16-bit ``state_dtype``: the state after the cycle
        (folded, so rounded to it) under the bf16-state contract and compared in that dtype; the outputs stay
        under IEEE float32, since both read the history's state, which the truth starts from exactly, and
        fp32 entries (the folding verify reads the state before its fold)."""
        R = len(outs)
        c = "ieee" if state_dtype is None else "bf16-state"
        checks = [self.wl.compare(f"{name}[R={R}] round 0.o", outs[0], self.wl.truth(rounds[0][0], hist)),
                  self.wl.compare(f"{name}[R={R}, m={m}].state_after_cycle", state,
                                  self.wl.truth(self._accepted_tokens(xs[0], R), hist, contract=c), state=True,
                                  dtype=state_dtype)]
        if folded is not None:
            r = folded
            before = self._accepted_tokens(xs[0], r)  # the tokens rounds 0..r-1 committed, then round r's
            t = self.wl.truth({n: torch.cat([before[n], rounds[0][r][n]], dim=1) for n in before}, hist)
            t = dataclasses.replace(t, o=t.o[:, r * m:], base_o=None if t.base_o is None else t.base_o[:, r * m:])
            checks.append(self.wl.compare(f"{name}[R={R}] round {r}.o (the folding verify)", outs[r], t))
        return checks

    def round_cycle(self) -> Case:
        return self._round_cycle("round_cycle", fold=False)

    def round_cycle_fold(self) -> Case:
        """``round_cycle`` with the buffer folded by the verify of the round whose accept would fold
        (``verify(fold=True)``, the buffer's entries folded in verify's state stream), so no accept folds."""
        return self._round_cycle("round_cycle_fold", fold=True)

    def round_cycle_fold_bf16(self) -> Case:
        """``round_cycle_fold`` on buffers whose state is stored in bfloat16 (the plan's ``state16``; as
        ``buffered_decode_bf16``: the history's state rounded to it, the bf16-state contract)."""
        return self._round_cycle("round_cycle_fold_bf16", fold=True, state_dtype=self._state16())

    def _round_cycle(self, name: str, *, fold: bool, state_dtype: Optional[torch.dtype] = None) -> Case:
        """A cycle of R rounds from empty buffers (``_cycle``); the one round whose accept passes C folds the
        buffer: in that accept, or (``fold``) in that round's verify (Skip where this package root's verify
        has no fold).  ``state_dtype``: the buffers' state stored in it (``_cycle_checks``; its bytes counted
        at its size)."""
        if fold and "fold" not in inspect.signature(self.api.fast.verify).parameters:
            raise Skip("this package root's verify has no fold")
        verify, accept, d, m = self.api.fast.verify, self.api.fast.accept, self.p.drafts, self.p.accepted
        R, starts = self._cycle()
        folding = [r for r in range(R) if starts[r] + m > self.p.C]  # the round whose accept would fold
        hist = self.wl.history(buffered=0, state_dtype=state_dtype)
        bufs = self._buffers(hist)
        lengths, bufs = _shared_lengths(bufs)
        xs = self._tokens(R * d, seed=11)
        rounds = [[self._round_tokens(x, r, d) for r in range(R)] for x in xs]
        kw = self._verify_kwargs(rounds[0][0], state_dtype)
        akw = self.api.kwargs("accept", accept, rounds[0][0], C=self.p.C)
        if fold and self.api.takes(accept, "fold"):
            akw["fold"] = False  # the verify of the round that would pass C folded it: no accept folds
        counts = self._counts()

        def cycle():
            lengths.fill_(0)
            outs = []
            for r in range(R):
                drafts = []
                fk = dict(fold=True) if fold and r in folding else {}
                for layer, buf in enumerate(bufs):
                    o, dr = verify(**rounds[layer][r], buffer=buf, **kw, **fk)[:2]
                    drafts.append(dr)
                    if layer == 0:
                        outs.append(o)
                for buf, dr in zip(bufs, drafts):
                    accept(buf, dr, counts=counts, **akw)
            return outs
        outs = cycle()
        checks = self._cycle_checks(name, outs, self.api.fast.materialize_state(bufs[0]), hist, rounds, xs, m,
                                    folding[-1] if fold else None, state_dtype)
        s, info = self._stored(state_dtype)
        nbytes = sum(io.buffered_verify(s, self.B, n, d) + io.buffered_accept(s, self.B, m) for n in starts)
        # the one fold: in an accept, the state read and written; in verify, which reads it anyway, written
        nbytes += (1 if fold else 2) * io.state_bytes(s, self.B)
        # per round (the time is per round and layer): the cycle's bytes over its R rounds
        c = self.case(name, "round", cycle, self.L * R, nbytes / R, checks, C=self.p.C, d=d, m=m, R=R, **info)
        where = f"round {folding[-1]}'s verify folding (fold=True)" if fold else "the last accept folding"
        c.note = (f"a cycle of {R} rounds from empty buffers (n = {', '.join(map(str, starts))}), {where}; each "
                  "replay first empties every layer's buffer (one fill); µs per round and layer")
        return c

    def per_draft_state_round(self) -> Case:
        pd_verify, pd_accept, d, m = self.api.baselines.per_draft_state_verify, \
            self.api.baselines.per_draft_state_accept, self.p.drafts, self.p.accepted
        hist, states, xs, kws = self._per_draft_layers(seed=9)
        counts = self._counts()
        o, inter = pd_verify(**xs[0], state=states[0], **kws[0])
        pd_accept(states[0], inter, counts)
        checks = [self.wl.compare(f"per_draft_state_round[d={d}].o", o, self.wl.truth(xs[0], hist)),
                  self.wl.compare(f"per_draft_state_round[d={d}, m={m}].state", states[0],
                                  self.wl.truth(xs[0], hist, upto=m), state=True)]

        def run():
            inters = [pd_verify(**x, state=st, **kw)[1] for x, st, kw in zip(xs, states, kws)]
            for st, i in zip(states, inters):
                pd_accept(st, i, counts)
        return self.case("per_draft_state_round", "round", run, self.L,
                         io.per_draft_verify(self.s, self.B, d) + io.per_draft_accept(self.s, self.B), checks, d=d, m=m)

    # ------------------------------------------------------------------ the serving pool (kvbuffer_fast.pool)
    def _pool(self, buffered: int):
        """A KVPool of every layer holding the batch after the history (prompts admitted, the last
        ``buffered`` tokens buffered), and the slots as an engine passes them: int32, in the batch's order
        (a permutation of the acquired slots, not 0..B-1)."""
        KVPool = self.api.pool_class()
        s, B, dev = self.s, self.B, self.wl.device
        pool = KVPool(layers=self.L, num_state_slots=B, num_buffer_slots=B, capacity=self.p.C,
                      max_drafts=self.p.drafts, num_heads=s.H, num_value_heads=s.HV, head_k_dim=s.K, head_v_dim=s.V,
                      dtype=torch.float32, key_dtype=self.wl.dtype, device=dev)
        got = pool.acquire(B)
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(5)).to(got.device)
        slots = got[perm].to(torch.int32)
        hist = self.wl.history(buffered=buffered)
        rows = torch.arange(B) % 2
        # the prompts admitted as fp32 (exact for bf16 values): the prefill then keeps fp32 products and the
        # state is as exact as the other ops' histories (16-bit prompts would take 16-bit products)
        x = {n: t.index_select(0, rows).to(dev).float() for n, t in hist.x.items()}
        for layer in range(self.L):
            pool.admit(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], layer=layer, slots=slots, tail=buffered)
        return pool, slots, hist

    def pool_decode(self) -> Case:
        C = self.p.C
        pool, slots, hist = self._pool(buffered=C)
        xs = self._tokens(C, seed=2)
        steps = [self.wl.steps(x) for x in xs]
        truth = self.wl.truth(xs[0], hist)

        def step(layer, st):
            return pool.decode(st["q"], st["k"], st["v"], g=st["g"], beta=st["beta"], layer=layer, slots=slots)
        outs = [step(0, st) for st in steps[0]]
        checks = [self.wl.compare(f"pool_decode[C={C}] cycle.o", torch.cat(outs, dim=1), truth)]
        lengths = pool.tensors()["lengths"][0].index_select(0, slots.long())
        if not bool((lengths == C).all()):
            checks.append(dict(name="pool_decode: every buffer full again after a cycle", passed=False,
                               text=f"lengths {lengths.tolist()} after a cycle, expected all {C}"))

        def run():
            for t in range(C):
                for layer in range(self.L):
                    step(layer, steps[layer][t])
        return self.case("pool_decode", "decode", run, self.L * C, io.buffered_cycle_step(self.s, self.B, C), checks,
                         C=C)

    def pool_decode_engine(self) -> Case:
        """``pool_decode`` as an engine runs it: each step starts from the packed rows ``mixed_qkv`` and the
        raw gates (``A_log``, ``dt_bias`` per layer, ``a``, ``b`` per token), turned into q, k (L2-normalised),
        v, g, beta by ``kvbuffer_fast.engine_inputs`` (one launch), then the pool's decode: the work
        ``sglang_decode``'s one kernel does, for a like-for-like comparison."""

        prep = self.api.engine_inputs()
        C, s = self.p.C, self.s
        pool, slots, hist = self._pool(buffered=C)
        xs = self._tokens(C, seed=2)
        raw = []  # per layer, per step: the engine's inputs
        for layer, x in enumerate(xs):
            A_log, dt_bias, a, b = replayssm_io.raw_gates(x["g"], x["beta"], seed=500 + layer)  # a, b [B, C, HV]
            rows = replayssm_io.pack(x).view(self.B, C, -1)
            raw.append([dict(mixed_qkv=rows[:, t].contiguous(), a=a[:, t].contiguous(), b=b[:, t].contiguous(),
                             A_log=A_log, dt_bias=dt_bias) for t in range(C)])

        def step(layer, r):
            q, k, v, g, beta = prep(**r, num_heads=s.H, head_k_dim=s.K)
            return pool.decode(q, k, v, g=g, beta=beta, layer=layer, slots=slots)
        outs = [step(0, r) for r in raw[0]]
        # the oracle's inputs: the reference map of the same rows and gates, in float64
        r64 = [ref.engine_inputs(**{n: t.double() for n, t in r.items()}, num_heads=s.H, head_k_dim=s.K)
               for r in raw[0]]
        x64 = {n: torch.cat([r[i] for r in r64], dim=1) for i, n in enumerate(("q", "k", "v", "g", "beta"))}
        checks = [self.wl.compare(f"pool_decode_engine[C={C}] cycle.o", torch.cat(outs, dim=1),
                                  self.wl.truth(x64, hist))]

        def run():
            for t in range(C):
                for layer in range(self.L):
                    step(layer, raw[layer][t])
        nbytes = io.buffered_cycle_step(self.s, self.B, C) + io.engine_inputs_step(self.s, self.B,
                                                                                     self.wl.dtype.itemsize)
        c = self.case("pool_decode_engine", "decode", run, self.L * C, nbytes, checks, C=C)
        c.note = "engine_inputs (packed rows, raw gates, q/k norm) then the pool's decode, every step"
        return c

    def _pool_round(self, op: str, per_layer: bool, parts: tuple = ("verify", "accept")) -> Case:
        n, d, m, B, dev = self.p.fill, self.p.drafts, self.p.accepted, self.B, self.wl.device
        pool, slots, hist = self._pool(buffered=n)
        xs = self._tokens(d, seed=9)
        parents = torch.arange(-1, d - 1, device=dev, dtype=torch.int32).expand(B, d).contiguous()
        num_drafts = torch.full((B,), d, device=dev, dtype=torch.int32)
        counts = torch.full((B,), m, device=dev, dtype=torch.int32)
        t = pool.tensors()
        lengths, pending, room_drafts, s64 = t["lengths"], t["pending"], t["num_drafts"], slots.long()
        # --set verify.* / accept.* reach the pool's calls too
        vkw = self.api.kwargs("verify", pool.verify, xs[0], C=self.p.C)
        akw = self.api.kwargs("accept", pool.accept, xs[0], C=self.p.C)

        def verify_all():
            return [pool.verify(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], layer=layer, slots=slots,
                                parents=parents, num_drafts=num_drafts, **vkw) for layer, x in enumerate(xs)]

        def accept_all():
            if per_layer:
                for layer in range(self.L):
                    pool.accept(slots=slots, counts=counts, layer=layer, **akw)
            else:
                pool.accept(slots=slots, counts=counts, **akw)  # every layer in one launch (layer=None)
        o = verify_all()[0]
        accept_all()
        truth_m = self.wl.truth(xs[0], hist, upto=m)
        checks = [self.wl.compare(f"{op}[d={d}].o", o, self.wl.truth(xs[0], hist)),
                  self.wl.compare(f"{op}[d={d}, m={m}].state_after_accept", pool.state_of(layer=0, slots=slots),
                                  truth_m, state=True)]

        def run():
            lengths.index_fill_(1, s64, n)  # every layer back to n entries
            if "verify" in parts:
                verify_all()
            else:  # accept alone: the drafts of the first verify stay in the rooms, marked pending again
                pending.index_fill_(1, s64, True)
                room_drafts.index_fill_(1, s64, d)
            if "accept" in parts:
                accept_all()
        nbytes = ((io.buffered_verify(self.s, B, n, d) if "verify" in parts else 0)
                  + (io.buffered_accept(self.s, B, m) if "accept" in parts else 0))
        kind = "round" if len(parts) == 2 else parts[0]
        c = self.case(op, kind, run, self.L, nbytes, checks, C=self.p.C, n=n, d=d, m=m)
        notes = ["one fill of every layer's lengths back to n per replay (one tiny kernel)"]
        if "accept" in parts:
            notes.append("accept " + ("per layer (layer=l)" if per_layer else "of every layer in one call (layer=None)"))
        if "verify" not in parts:
            notes.append("the rooms marked pending again with their draft counts (two tiny kernels)")
        c.note = "; ".join(notes)
        return c

    def pool_round_cycle(self) -> Case:
        """``round_cycle`` through the serving pool, as an engine runs it: R = C // m + 1 rounds from empty
        buffers (prompts admitted into the states), each verify on every layer by int32 slots then one
        accept of every layer (layer=None), the last round's accept folding."""
        return self._pool_round_cycle("pool_round_cycle", fold=False)

    def pool_round_cycle_fold(self) -> Case:
        """``pool_round_cycle`` with the buffers folded by the verify of the round whose accept would fold
        (``pool.verify(fold=True)`` on every layer: the entries folded in verify's state stream, into the
        requests' state slots), so no accept folds: ``round_cycle_fold`` through the pool."""
        if "fold" not in inspect.signature(self.api.pool_class().verify).parameters:
            raise Skip("this package root's pool verify has no fold")
        return self._pool_round_cycle("pool_round_cycle_fold", fold=True)

    def _pool_round_cycle(self, name: str, *, fold: bool) -> Case:
        """A cycle of R rounds from empty buffers through the pool (``_cycle``); the one round whose accept
        passes C folds the buffers: in that accept, or (``fold``) in that round's verify."""
        d, m, B, dev = self.p.drafts, self.p.accepted, self.B, self.wl.device
        R, starts = self._cycle()
        folding = [r for r in range(R) if starts[r] + m > self.p.C]  # the round whose accept would fold
        pool, slots, hist = self._pool(buffered=0)
        xs = self._tokens(R * d, seed=11)
        rounds = [[self._round_tokens(x, r, d) for r in range(R)] for x in xs]
        parents = torch.arange(-1, d - 1, device=dev, dtype=torch.int32).expand(B, d).contiguous()
        num_drafts = torch.full((B,), d, device=dev, dtype=torch.int32)
        counts = torch.full((B,), m, device=dev, dtype=torch.int32)
        lengths, s64 = pool.tensors()["lengths"], slots.long()
        vkw = self.api.kwargs("verify", pool.verify, rounds[0][0], C=self.p.C)
        akw = self.api.kwargs("accept", pool.accept, rounds[0][0], C=self.p.C)
        if fold and self.api.takes(pool.accept, "fold"):
            akw["fold"] = False  # the verify of the round that would pass C folded it: no accept folds

        def cycle():
            lengths.index_fill_(1, s64, 0)  # every layer's buffers empty
            outs = []
            for r in range(R):
                fk = dict(fold=True) if fold and r in folding else {}
                for layer in range(self.L):
                    x = rounds[layer][r]
                    o = pool.verify(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], layer=layer, slots=slots,
                                    parents=parents, num_drafts=num_drafts, **vkw, **fk)
                    if layer == 0:
                        outs.append(o)
                pool.accept(slots=slots, counts=counts, **akw)
            return outs
        outs = cycle()
        checks = self._cycle_checks(name, outs, pool.state_of(layer=0, slots=slots), hist, rounds, xs, m,
                                    folding[-1] if fold else None)
        nbytes = sum(io.buffered_verify(self.s, B, n, d) + io.buffered_accept(self.s, B, m) for n in starts)
        # the one fold: in an accept, the state read and written; in verify, which reads it anyway, written
        nbytes += (1 if fold else 2) * io.state_bytes(self.s, B)
        c = self.case(name, "round", cycle, self.L * R, nbytes / R, checks, C=self.p.C, d=d, m=m, R=R)  # per round
        where = f"round {folding[-1]}'s verify folding (fold=True)" if fold else "the last accept folding"
        c.note = (f"a cycle of {R} rounds from empty buffers (n = {', '.join(map(str, starts))}), {where}; each "
                  "replay first empties every layer's buffers (one fill); accept of every layer in one call; µs per "
                  "round and layer")
        return c

    def pool_verify(self) -> Case:
        return self._pool_round("pool_verify", per_layer=False, parts=("verify",))

    def pool_accept(self) -> Case:
        return self._pool_round("pool_accept", per_layer=False, parts=("accept",))

    def pool_round(self) -> Case:
        return self._pool_round("pool_round", per_layer=False)

    def pool_round_per_layer(self) -> Case:
        return self._pool_round("pool_round_per_layer", per_layer=True)

    # ------------------------------------------------------------------ SGLang (--sglang-path)
    def sglang_decode(self) -> Case:
        """SGLang's ``fused_recurrent_gated_delta_rule_packed_decode`` as its Triton GDN backend calls it
        (``TritonGDNKernel.packed_decode``): packed ``mixed_qkv``, raw gates, q/k L2-normalised in the kernel,
        each layer's float32 pool [B, HV, V, K] updated in place by int32 slot indices (a shuffled
        permutation, as an engine's slots are).  One token per request per layer, the layers in turn."""

        kern = self.api.sglang(self.wl.device)
        fn = kern.fused_recurrent_gated_delta_rule_packed_decode
        s, B, dev, dt = self.s, self.B, self.wl.device, self.wl.dtype
        hist = self.wl.history(buffered=0)
        xs = self._tokens(1, seed=1)
        slots = torch.randperm(B, generator=torch.Generator().manual_seed(7)).to(device=dev, dtype=torch.int32)
        sl = slots.long()
        layers = []
        for layer, x in enumerate(xs):
            pool = torch.empty(B, s.HV, s.V, s.K, device=dev)
            pool[sl] = hist.buffer.state.float().transpose(-1, -2)  # request b's state in slot slots[b]
            A_log, dt_bias, a, b = replayssm_io.raw_gates(x["g"][:, 0], x["beta"][:, 0], seed=400 + layer)
            layers.append(dict(mixed_qkv=replayssm_io.pack(x), a=a, b=b, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                               out=torch.empty(B, 1, s.HV, s.V, device=dev, dtype=dt)))
        scale = self.scale

        def step(ly):
            fn(**ly, scale=scale, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
        ly0 = layers[0]
        step(ly0)
        # the oracle's inputs: the reference map of the kernel's packed rows and raw gates (q and k normalised as
        # the kernel normalises them, softplus threshold 20 as SGLang launches it), in float64
        q, k, v, g, beta = ref.engine_inputs(*(ly0[n].double() for n in ("mixed_qkv", "a", "b")),
                                             A_log=ly0["A_log"].double(), dt_bias=ly0["dt_bias"].double(),
                                             num_heads=s.H, head_k_dim=s.K)
        truth = self.wl.truth(dict(q=q, k=k, v=v, g=g, beta=beta), hist)
        checks = [self.wl.compare("sglang_decode.o", ly0["out"], truth),
                  self.wl.compare("sglang_decode.state", ly0["initial_state"][sl].transpose(-1, -2), truth,
                                  state=True)]

        def run():
            for ly in layers:
                step(ly)
        nbytes = io.packed_decode_step(s, B, token_bytes=torch.empty(0, dtype=dt).element_size())
        c = self.case("sglang_decode", "decode", run, self.L, nbytes, checks, sglang=kern.version)
        c.peer, c.note = True, (f"SGLang {kern.version}'s fused_recurrent_gated_delta_rule_packed_decode (from "
                                f"{kern.source}): packed mixed_qkv, raw gates, q/k L2 norm in the kernel, each "
                                "layer's fp32 pool [B, HV, V, K] in place by shuffled int32 slots")
        return c

    # ------------------------------------------------------------------ FlashInfer (--flashinfer-path)
    def _fi_layers(self, T: int, seed: int, gate_seed: int, hist: History, *, pool_size: int, slots: torch.Tensor,
                   state_dtype=torch.float32, v_major: bool = True):
        """Per layer: the tokens, FlashInfer's raw gates (a, b in bf16) and a state pool holding the history's
        state of request b in slot ``slots[b]`` (V-major [pool_size, HV, V, K] or K-major), built once."""
        from kvbuffer.peers import flashinfer as FI

        s, B, dev = self.s, self.B, self.wl.device
        xs, layers = self._tokens(T, seed=seed), []
        for layer, x in enumerate(xs):
            A_log, dt_bias, a, b = FI.raw_gates(x["g"].reshape(B * T, s.HV), x["beta"].reshape(B * T, s.HV),
                                                seed=gate_seed + layer)
            pool = FI.to_pool(hist.buffer.state.float(), slots, pool_size, dtype=state_dtype, v_major=v_major)
            layers.append(dict(q=x["q"], k=x["k"], v=x["v"], A_log=A_log, dt_bias=dt_bias,
                               a=a.view(B, T, s.HV), b=b.view(B, T, s.HV), pool=pool,
                               out=torch.empty(B, T, s.HV, s.V, device=dev, dtype=self.wl.dtype)))
        return layers

    def _fi_truth(self, ly: dict, hist: History, upto: Optional[int] = None, contract: str = "ieee") -> Truth:
        """The float64 truth over the history and the tokens as FlashInfer's kernel reads them (q, k normalised,
        the gates of its raw inputs as rounded); the budgets' baseline under ``contract`` ("bf16-state" for its
        bf16 pool: the correct forms with their state rounded to bf16 after every token)."""
        from kvbuffer.peers import flashinfer as FI

        x = FI.oracle_inputs(*(ly[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")))
        return self.wl.truth(x, hist, upto=upto, contract=contract)

    def _fi_slots(self, null_slot: bool) -> torch.Tensor:
        """int32 slots in a shuffled order, as an engine's are: 0..B-1, or 1..B where slot 0 is the null slot
        (FlashInfer's bf16 pool redirects -1 pads to slot 0)."""
        perm = torch.randperm(self.B, generator=torch.Generator().manual_seed(7)) + int(null_slot)
        return perm.to(device=self.wl.device, dtype=torch.int32)

    def _fi_decode(self, op: str, kind: str, state_dtype) -> Case:
        fi = self.api.flashinfer(self.wl.device)
        from kvbuffer.peers import flashinfer as FI

        s, B = self.s, self.B
        bf16 = state_dtype == torch.bfloat16
        hist = self.wl.history(buffered=0)
        slots = self._fi_slots(null_slot=bf16)
        v_major = kind == "pretranspose"
        layers = self._fi_layers(1, 1, 500 + 10 * bf16 + 20 * (not v_major), hist, pool_size=B + int(bf16),
                                 slots=slots if v_major else torch.arange(B, device=self.wl.device),
                                 state_dtype=state_dtype, v_major=v_major)
        fn = fi.decode_pretranspose if v_major else fi.decode_kmajor
        kws = [FI.decode_kwargs(kind, **{n: ly[n] for n in ("q", "k", "v", "A_log", "dt_bias", "a", "b", "pool",
                                                             "out")}, slots=slots, scale=self.scale)
               for ly in layers]
        fn(**kws[0])
        ly0 = layers[0]
        truth = self._fi_truth(ly0, hist, contract="bf16-state" if bf16 else "ieee")
        S = FI.from_pool(ly0["pool"], slots if v_major else torch.arange(B, device=self.wl.device), v_major=v_major)
        checks = [self.wl.compare(f"{op}.o", ly0["out"], truth),
                  self.wl.compare(f"{op}.state", S, truth, state=True, dtype=torch.bfloat16 if bf16 else None)]

        def run():
            for kw in kws:
                fn(**kw)
        nbytes = io.split_decode_step(s, B, state_elem_bytes=2 if bf16 else 4,
                                      token_bytes=torch.empty(0, dtype=self.wl.dtype).element_size(), indexed=v_major)
        c = self.case(op, "decode", run, self.L, nbytes, checks, flashinfer=fi.version, state_dtype=str(state_dtype)[6:],
                      layout="[slots, HV, V, K]" if v_major else "[B, HV, K, V]")
        c.peer = True
        c.note = (f"FlashInfer {fi.version} {fn.__name__} (backend='flashinfer', from {fi.source}): separate q, k, v, "
                  f"raw gates (a, b bf16), q/k L2 norm in the kernel, "
                  + (f"each layer's {str(state_dtype)[6:]} pool [B{' + 1' if bf16 else ''}, HV, V, K] in place by "
                     f"shuffled int32 slots{' (slot 0 its null slot)' if bf16 else ''}" if v_major else
                     "each layer's fp32 state [B, HV, K, V] (our layout) in place, no pool"))
        return c

    def flashinfer_decode(self) -> Case:
        """FlashInfer's ``gated_delta_rule_decode_pretranspose``, fp32 pool [B, HV, V, K] by int32 slots."""
        return self._fi_decode("flashinfer_decode", "pretranspose", torch.float32)

    def flashinfer_decode_bf16(self) -> Case:
        """The same with a bf16 pool (its BF16-state kernel, K = V = 128; slot 0 the null slot)."""
        return self._fi_decode("flashinfer_decode_bf16", "pretranspose", torch.bfloat16)

    def flashinfer_decode_kmajor(self) -> Case:
        """FlashInfer's ``gated_delta_rule_decode``: our layout [B, HV, K, V] fp32, one state per row."""
        return self._fi_decode("flashinfer_decode_kmajor", "kmajor", torch.float32)

    def _fi_mtp_layers(self, seed: int, gate_seed: int, hist: History, slots: torch.Tensor):
        from kvbuffer.peers import flashinfer as FI

        s, B, d = self.s, self.B, self.p.drafts
        layers = self._fi_layers(d, seed, gate_seed, hist, pool_size=B, slots=slots)
        kws = []
        for ly in layers:  # preallocated per layer, as an engine's per-layer cache: no allocation inside the timing
            ly["inter"] = torch.empty(B, d, s.HV, s.V, s.K, device=self.wl.device)
            kws.append(FI.mtp_kwargs(**{n: ly[n] for n in ("q", "k", "v", "A_log", "dt_bias", "a", "b", "pool", "out")},
                                     slots=slots, intermediate=ly["inter"], scale=self.scale))
        return layers, kws

    def flashinfer_mtp(self) -> Case:
        """FlashInfer's ``gated_delta_rule_mtp`` of the d = 5 tokens (a chain) from each layer's fp32 pool by
        slot: the pool frozen, every token's state written (the per-draft-state form)."""
        fi = self.api.flashinfer(self.wl.device)
        from kvbuffer.peers import flashinfer as FI

        d = self.p.drafts
        hist = self._state_history()
        slots = self._fi_slots(null_slot=False)
        layers, kws = self._fi_mtp_layers(3, 600, hist, slots)
        fi.mtp(**kws[0])
        ly0 = layers[0]
        truth = self._fi_truth(ly0, hist)
        checks = [self.wl.compare(f"flashinfer_mtp[d={d}].o", ly0["out"], truth),
                  self.wl.compare(f"flashinfer_mtp[d={d}].last_state", ly0["inter"][:, d - 1].transpose(-1, -2),
                                  truth, state=True),
                  self.wl.compare(f"flashinfer_mtp[d={d}].pool_frozen", FI.from_pool(ly0["pool"], slots),
                                  self._fi_truth(ly0, hist, upto=0), state=True)]

        def run():
            for kw in kws:
                fi.mtp(**kw)
        c = self.case("flashinfer_mtp", "verify", run, self.L, io.per_draft_verify(self.s, self.B, d), checks, d=d,
                      flashinfer=fi.version)
        c.peer = True
        c.note = (f"FlashInfer {fi.version} gated_delta_rule_mtp (from {fi.source}): {d} tokens per request, the fp32 "
                  "pool [B, HV, V, K] frozen (disable_state_update=True), every token's state into a per-layer "
                  "intermediate_states_buffer [B, T, HV, V, K]; raw gates (a, b bf16), q/k L2 norm in the kernel")
        return c

    def flashinfer_round(self) -> Case:
        """A speculative round as an engine runs it on FlashInfer: ``gated_delta_rule_mtp`` of d tokens on every
        layer (pool frozen, every token's state kept), then on every layer the state after the m accepted
        tokens copied into the request's slot (one ``index_copy_`` per layer)."""
        fi = self.api.flashinfer(self.wl.device)
        from kvbuffer.peers import flashinfer as FI

        d, m = self.p.drafts, self.p.accepted
        hist = self._state_history()
        slots = self._fi_slots(null_slot=False)
        sl = slots.long()
        layers, kws = self._fi_mtp_layers(9, 700, hist, slots)
        fi.mtp(**kws[0])
        ly0 = layers[0]
        FI.accept_into_pool(ly0["pool"], ly0["inter"], sl, m)
        checks = [self.wl.compare(f"flashinfer_round[d={d}].o", ly0["out"], self._fi_truth(ly0, hist)),
                  self.wl.compare(f"flashinfer_round[d={d}, m={m}].state", FI.from_pool(ly0["pool"], slots),
                                  self._fi_truth(ly0, hist, upto=m), state=True)]

        def run():
            for kw in kws:
                fi.mtp(**kw)
            for ly in layers:
                FI.accept_into_pool(ly["pool"], ly["inter"], sl, m)
        c = self.case("flashinfer_round", "round", run, self.L,
                      io.per_draft_verify(self.s, self.B, d) + io.per_draft_accept(self.s, self.B), checks, d=d, m=m,
                      flashinfer=fi.version)
        c.peer = True
        c.note = (f"FlashInfer {fi.version} gated_delta_rule_mtp of {d} tokens on every layer (pool frozen, every "
                  f"token's state kept), then the state after {m} tokens copied into each request's slot "
                  "(index_copy_ per layer); FlashInfer's ReplaySSM commit needs SM100/SM120 and is not timed here")
        return c

    # ------------------------------------------------------------------ ReplaySSM (--peer-path)
    def _blocks(self) -> torch.Tensor:
        """vLLM's state indices: a block per request, 1..B in a shuffled order (block 0 is the null block)."""
        perm = torch.randperm(self.B, generator=torch.Generator().manual_seed(7)) + 1
        return perm.to(device=self.wl.device, dtype=torch.int32)

    def replayssm_decode(self) -> Case:

        dec, _ = self.api.replayssm(self.wl.device)
        fn = dec.fused_recurrent_gated_delta_rule_replayssm
        s, B, dev, dt, Lr = self.s, self.B, self.wl.device, self.wl.dtype, 16
        hist = self.wl.history(buffered=0)
        xs = self._tokens(Lr, seed=2)
        blocks = self._blocks()
        bl = blocks.long()
        layers = []
        for layer, x in enumerate(xs):
            h = torch.zeros(B + 1, s.HV, s.V, s.K, device=dev)
            h[bl] = hist.buffer.state.float().transpose(-1, -2)
            ring = dict(h=h, d=torch.zeros(B + 1, s.HV, Lr, s.V, device=dev, dtype=dt),
                        k=torch.zeros(B + 1, s.H, Lr, s.K, device=dev, dtype=dt),
                        g=torch.zeros(B + 1, s.HV, Lr, device=dev))
            steps = []
            for t, st in enumerate(self.wl.steps(x)):
                A_log, dt_bias, a, b = replayssm_io.raw_gates(st["g"][:, 0], st["beta"][:, 0], seed=100 + layer)
                steps.append(dict(mixed=replayssm_io.pack(st), a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                  out=torch.empty(B, s.HV, s.V, device=dev, dtype=dt),
                                  pos=torch.full((B,), t, device=dev, dtype=torch.int32)))
            layers.append((ring, steps))
        scale = s.K ** -0.5

        def step(ring, st):
            fn(st["mixed"], st["a"], st["b"], st["A_log"], st["dt_bias"], scale, ring["h"], ring["d"], ring["k"],
               ring["g"], st["out"], blocks, st["pos"], use_qk_l2norm_in_kernel=False)
        ring0, steps0 = layers[0]
        for st in steps0:
            step(ring0, st)
        truth = self.wl.truth(xs[0], hist)
        o = torch.stack([st["out"] for st in steps0], 1)
        S = replayssm_io.ring_state(ring0["h"], ring0["d"], ring0["k"], ring0["g"], blocks, [0] * B)
        checks = [self.wl.compare(f"replayssm_decode[L={Lr}] cycle.o", o, truth),
                  self.wl.compare(f"replayssm_decode[L={Lr}] cycle.state", S, truth, state=True)]

        def run():
            for t in range(Lr):
                for ring, steps in layers:
                    step(ring, steps[t])
        ent = replayssm_io.entry_bytes(s, B)
        nbytes = io.state_bytes(s, B) * (1 + 1 / Lr) + ent * (sum(range(Lr)) / Lr + (Lr - 1) / Lr)
        c = self.case("replayssm_decode", "decode", run, self.L * Lr, nbytes, checks, C=Lr)
        c.peer, c.note = True, (f"ReplaySSM's fused_recurrent_gated_delta_rule_replayssm, a cycle of its ring of {Lr} "
                                f"(the fold at cursor {Lr - 1}), cursors per row as vLLM passes them")
        return c

    def replayssm_round(self) -> Case:

        _, spec = self.api.replayssm(self.wl.device)
        s, B, dev, dt = self.s, self.B, self.wl.device, self.wl.dtype
        n, T, m, C = self.p.fill, self.p.drafts, self.p.accepted, self.p.C
        Lc = C + T  # vLLM: max_cache_len = replayssm_buffer_len + max_spec_len
        Rb = 1 << (Lc - 1).bit_length()  # its physical ring, next_pow2(L)
        hist = self.wl.history(buffered=n)
        hb = hist.buffer
        blocks = self._blocks()
        bl = blocks.long()
        base0 = (Rb - n // 2) % Rb  # the history wraps around the ring's end, as a running ring's does
        pos = (base0 + torch.arange(n, device=dev)) % Rb
        gg = torch.diff(hb.G[:, :n].double(), dim=1, prepend=torch.zeros_like(hb.G[:, :1].double())).float()
        xs = self._tokens(T, seed=9)
        layers = []
        for layer, x in enumerate(xs):
            h = torch.zeros(B + 1, s.HV, s.V, s.K, device=dev)
            h[bl] = hb.state.float().transpose(-1, -2)
            d = torch.zeros(B + 1, s.HV, Rb, s.V, device=dev, dtype=dt)
            k = torch.zeros(B + 1, s.H, Rb, s.K, device=dev, dtype=dt)
            g = torch.zeros(B + 1, s.HV, Rb, device=dev)
            d[bl[:, None], :, pos[None, :]] = hb.u[:, :n].to(dt)  # [B, n, HV, V] into [.., HV, pos, V]
            k[bl[:, None], :, pos[None, :]] = hb.k[:, :n].to(dt)
            g[bl[:, None], :, pos[None, :]] = gg
            A_log, dt_bias, a, b = replayssm_io.raw_gates(x["g"].reshape(B * T, s.HV), x["beta"].reshape(B * T, s.HV),
                                               seed=200 + layer)
            layers.append(dict(h=h, d=d, k=k, g=g, mixed=replayssm_io.pack(x), a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                               out=torch.empty(B * T, s.HV, s.V, device=dev, dtype=dt)))
        cur0 = dict(write_pos=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                    cache_base=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                    is_flush=torch.zeros(B + 1, dtype=torch.int8, device=dev))
        cur0["write_pos"][bl] = n
        cur0["cache_base"][bl] = base0
        cur0["is_flush"][bl] = int(n + 2 * T > Lc)  # as its cursor kernel sets it
        cur = {name: t.clone() for name, t in cur0.items()}
        qsl = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
        accepted = torch.full((B,), m, device=dev, dtype=torch.int32)
        scale = s.K ** -0.5

        def round_():
            _replayssm_round(spec, [(ly, ly) for ly in layers], qsl, blocks, cur, accepted, Lc=Lc, T=T, Rb=Rb,
                             scale=scale)
        round_()
        ly0 = layers[0]
        S = replayssm_io.ring_state(ly0["h"], ly0["d"], ly0["k"], ly0["g"], blocks, cur["write_pos"][bl].tolist(),
                         cur["cache_base"][bl].tolist())
        checks = [self.wl.compare(f"replayssm_round[T={T}].o", ly0["out"].view(B, T, s.HV, s.V),
                                  self.wl.truth(xs[0], hist)),
                  self.wl.compare(f"replayssm_round[T={T}, m={m}].state_after_commit", S,
                                  self.wl.truth(xs[0], hist, upto=m), state=True)]

        def run():
            for name, t in cur.items():  # back to n entries of history (three tiny copies)
                t.copy_(cur0[name])
            round_()
        ent = replayssm_io.entry_bytes(s, B)
        c = self.case("replayssm_round", "round", run, self.L, io.state_bytes(s, B) + (n + T) * ent, checks, C=C, n=n,
                      d=T, m=m)
        c.peer, c.note = True, (f"ReplaySSM's gdn_replayssm_spec_decode on every layer (L = C + T = {Lc}, ring "
                                f"{Rb}), then one commit_gdn_replayssm_spec for all layers; each replay first "
                                "restores the cursors to n entries (three tiny copies), so no round folds")
        return c


    def replayssm_round_cycle(self) -> Case:

        _, spec = self.api.replayssm(self.wl.device)
        s, B, dev, dt = self.s, self.B, self.wl.device, self.wl.dtype
        T, m, C = self.p.drafts, self.p.accepted, self.p.C
        R, _ = self._cycle()
        Lc = C + T  # vLLM: max_cache_len = replayssm_buffer_len + max_spec_len
        Rb = 1 << (Lc - 1).bit_length()
        hist = self.wl.history(buffered=0)
        blocks = self._blocks()
        bl = blocks.long()
        xs = self._tokens(R * T, seed=11)
        layers = []
        for layer, x in enumerate(xs):
            h = torch.zeros(B + 1, s.HV, s.V, s.K, device=dev)
            h[bl] = hist.buffer.state.float().transpose(-1, -2)
            A_log, dt_bias, a, b = replayssm_io.raw_gates(x["g"].reshape(B * R * T, s.HV), x["beta"].reshape(B * R * T, s.HV),
                                                seed=300 + layer)
            a, b = a.view(B, R * T, s.HV), b.view(B, R * T, s.HV)
            per_round = []
            for r in range(R):
                xr = self._round_tokens(x, r, T)
                per_round.append(dict(mixed=replayssm_io.pack(xr), a=a[:, r * T:(r + 1) * T].reshape(B * T, s.HV).contiguous(),
                                      b=b[:, r * T:(r + 1) * T].reshape(B * T, s.HV).contiguous(),
                                      out=torch.empty(B * T, s.HV, s.V, device=dev, dtype=dt)))
            layers.append(dict(h=h, d=torch.zeros(B + 1, s.HV, Rb, s.V, device=dev, dtype=dt),
                               k=torch.zeros(B + 1, s.H, Rb, s.K, device=dev, dtype=dt),
                               g=torch.zeros(B + 1, s.HV, Rb, device=dev), A_log=A_log, dt_bias=dt_bias,
                               rounds=per_round))
        cur = dict(write_pos=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                   cache_base=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                   is_flush=torch.zeros(B + 1, dtype=torch.int8, device=dev))
        qsl = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
        accepted = torch.full((B,), m, device=dev, dtype=torch.int32)
        scale = s.K ** -0.5

        def cycle():
            for t in cur.values():  # empty rings (three tiny fills)
                t.zero_()
            for r in range(R):
                _replayssm_round(spec, [(ly, ly["rounds"][r]) for ly in layers], qsl, blocks, cur, accepted, Lc=Lc,
                                 T=T, Rb=Rb, scale=scale)
        cycle()
        ly0 = layers[0]
        S = replayssm_io.ring_state(ly0["h"], ly0["d"], ly0["k"], ly0["g"], blocks, cur["write_pos"][bl].tolist(),
                          cur["cache_base"][bl].tolist())
        checks = [self.wl.compare(f"replayssm_round_cycle[R={R}] round 0.o",
                                  ly0["rounds"][0]["out"].view(B, T, s.HV, s.V),
                                  self.wl.truth(self._round_tokens(xs[0], 0, T), hist)),
                  self.wl.compare(f"replayssm_round_cycle[R={R}, m={m}].state_after_cycle", S,
                                  self.wl.truth(self._accepted_tokens(xs[0], R), hist), state=True)]
        flushes, wp, fl = 0, 0, False  # its cursor rule (commit_gdn_replayssm_spec): rounds that flush
        for _ in range(R):
            flushes += fl
            wp = m if fl else wp + m
            fl = wp + 2 * T > Lc
        ent = replayssm_io.entry_bytes(s, B)
        nbytes = R * (io.state_bytes(s, B) + T * ent) + flushes * io.state_bytes(s, B)
        c = self.case("replayssm_round_cycle", "round", cycle, self.L * R, nbytes / R, checks, C=C, d=T, m=m,
                      R=R)  # bytes per round, as the time
        c.peer, c.note = True, (f"ReplaySSM's round (spec decode on every layer, one commit) {R} times from empty "
                                f"rings (L = {Lc}, ring {Rb}); its {flushes} flush(es) happen inside, as its cursors "
                                "set them; "
                                "each replay first empties the cursors (three tiny fills); µs per round and layer")
        return c



def build(op: str, api: Api, wl: Workload) -> Case:
    """The case of ``op`` at ``wl``'s batch: inputs built, layer 0 run eagerly and compared with the oracle."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
    return getattr(_Builder(api, wl), op)()
