"""The benchmark harness: modes, DEVICE-time measurement, the oracle check, rows, machine info.

Modes (env ``KVBUFFER_BENCH``; default ``gpu`` when CUDA is available, else ``smoke``):

* ``gpu``: Qwen3-Next shapes (H=16, HV=32, K=V=128), bf16 tokens, fp32 state and u-cache, batches
  64..512.  Time = device time: the op is captured in a CUDA graph (its launches back to back, no
  host gaps) and the replay is timed with ``triton.testing.do_bench`` (CUDA events, L2 cleared
  before every replay, median); one pytest-benchmark *round* is one such median.
* ``smoke``: tiny shapes under the Triton interpreter on the CPU, wall-clock of one call: it proves
  the suites, the checks and the report work; it measures nothing (the JSON and report say so).

pytest-benchmark's own clock is replaced (marker ``timer=``) by a *device clock* that advances by
the measured device time only, so ``stats.median`` / ``stats.min`` ... in the JSON are device
seconds per operation (per decode step for the cycle rows), never host time of asynchronous
launches.  ``extra_info`` holds the same in microseconds (``device_us``) plus the IO model's bytes,
the achieved bandwidth and its share of the copy bandwidth measured in the same session.

Every benchmark first checks its result on two requests of the batch (rows 0 and B-1) against the
float64 recurrent truth with ``kvbuffer_ref.testing.compare`` (the one tolerance table) and
``pytest.fail``s before timing anything if it is wrong.  docs/benchmarks.md describes all fields.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import pytest

try:
    import torch

    _CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _CUDA = False

MODE = os.environ.get("KVBUFFER_BENCH", "gpu" if _CUDA else "smoke")
if MODE not in ("gpu", "smoke"):
    raise pytest.UsageError(f"KVBUFFER_BENCH: expected 'gpu' or 'smoke', got {MODE!r}")
if MODE == "gpu" and not _CUDA:
    raise pytest.UsageError("KVBUFFER_BENCH=gpu needs a CUDA device (use KVBUFFER_BENCH=smoke on a CPU)")
if MODE == "smoke":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from bench.io_model import Shapes  # noqa: E402


def _ints(name: str, default: Sequence[int]) -> tuple[int, ...]:
    raw = os.environ.get(name)
    return tuple(int(x) for x in raw.split(",") if x.strip()) if raw else tuple(default)


@dataclass(frozen=True)
class Config:
    """What one mode runs; list-valued fields can be overridden by env vars (docs/benchmarks.md)."""

    mode: str
    shapes: Shapes
    dtype_name: str
    batches: tuple
    capacities: tuple
    verify_batches: tuple
    drafts: tuple
    tree_drafts: tuple
    verify_capacity: int
    verify_fill: int       # n: entries buffered when verify runs
    history_folded: int    # tokens folded into the state before the buffered ones (so a state exists)
    rounds: int
    warmup_ms: float
    rep_ms: float

    @property
    def dtype(self):
        return getattr(torch, self.dtype_name)


def _config() -> Config:
    if MODE == "gpu":
        return Config(
            mode="gpu", shapes=Shapes(H=16, HV=32, K=128, V=128, key_bytes=2), dtype_name="bfloat16",
            batches=_ints("KVBUFFER_BENCH_BATCHES", (64, 128, 256, 512)),
            capacities=_ints("KVBUFFER_BENCH_CAPACITIES", (16, 32, 64)),
            verify_batches=_ints("KVBUFFER_BENCH_VERIFY_BATCHES", (64, 256)),
            drafts=_ints("KVBUFFER_BENCH_DRAFTS", range(1, 9)),
            tree_drafts=_ints("KVBUFFER_BENCH_TREE_DRAFTS", range(2, 9)),
            verify_capacity=32, verify_fill=16, history_folded=4,
            rounds=int(os.environ.get("KVBUFFER_BENCH_ROUNDS", 3)), warmup_ms=10.0,
            rep_ms=float(os.environ.get("KVBUFFER_BENCH_REP_MS", 50.0)),
        )
    return Config(
        mode="smoke", shapes=Shapes(H=1, HV=2, K=16, V=16, key_bytes=4), dtype_name="float32",
        batches=_ints("KVBUFFER_BENCH_BATCHES", (2, 3)), capacities=_ints("KVBUFFER_BENCH_CAPACITIES", (4, 8)),
        verify_batches=_ints("KVBUFFER_BENCH_VERIFY_BATCHES", (2,)), drafts=_ints("KVBUFFER_BENCH_DRAFTS", (1, 3)),
        tree_drafts=_ints("KVBUFFER_BENCH_TREE_DRAFTS", (3,)), verify_capacity=8, verify_fill=2, history_folded=2,
        rounds=1, warmup_ms=0.0, rep_ms=0.0,
    )


CFG = _config()
DEVICE = "cuda" if MODE == "gpu" else "cpu"
#: Filled during the session, written into the JSON by pytest_benchmark_update_json.
SESSION: dict = {"mode": MODE}

TIMING_DOC = (
    "stats.* and extra_info.device_us are DEVICE time per operation (per decode step for cycle rows): "
    "the op is captured in a CUDA graph and its replay timed by triton.testing.do_bench (CUDA events, "
    "L2 cleared before each replay, median); one round = one do_bench median"
    if MODE == "gpu" else
    "SMOKE: wall-clock of one call under the Triton interpreter on the CPU; no performance meaning"
)


# ----------------------------------------------------------------------------- the device clock
_NOW = [0.0]


def device_clock() -> float:
    """pytest-benchmark's timer for these suites: it only moves when a measurement advances it."""
    return _NOW[0]


class Timer:
    """Measures one operation ``fn`` (which may be several launches) in device time."""

    def __init__(self, fn: Callable[[], object], per: int = 1):
        self.fn, self.per = fn, per
        self.graph = None
        self.method = "wall-clock, interpreter (smoke)"
        if MODE == "gpu":
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream, as graph capture wants
                fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                torch.cuda.synchronize()
                self.graph = graph
                self.method = "cuda_graph replay, triton.testing.do_bench median (L2 cleared)"
            except Exception as e:  # noqa: BLE001 - time the eager launches instead, and say so
                torch.cuda.synchronize()
                self.method = (f"eager launches, triton.testing.do_bench median (L2 cleared; host gaps between "
                               f"launches included: graph capture failed: {type(e).__name__}: {str(e)[:200]})")

    def ms(self) -> float:
        """Device milliseconds per operation (per ``per`` of the captured calls)."""
        if MODE == "gpu":
            import triton.testing

            ms = triton.testing.do_bench(self.graph.replay if self.graph is not None else self.fn,
                                         warmup=CFG.warmup_ms, rep=CFG.rep_ms, return_mode="median")
        else:
            t = time.perf_counter()
            self.fn()
            ms = (time.perf_counter() - t) * 1e3
        return float(ms) / self.per

    def close(self):
        self.graph = None


# ----------------------------------------------------------------------------- checks
def check_rows(B: int) -> list[int]:
    """The requests whose results are compared with the oracle: the first and the last."""
    return sorted({0, B - 1})


def require(comparisons) -> list[dict]:
    """pytest.fail (no time is reported) unless every comparison passed; else their summaries."""
    out = []
    for c in comparisons:
        if not c.passed:
            pytest.fail(f"wrong result, not timed: {c}", pytrace=False)
        out.append(dict(name=c.name, dtype=str(c.dtype).replace("torch.", ""), worst_rel=c.worst_rel,
                        baseline_rel=c.baseline_rel, budget=c.budget, max_abs=c.max_abs))
    return out


# ----------------------------------------------------------------------------- rows
@dataclass
class History:
    """Two base histories (tokens on the CPU in the benchmark dtype) and the tiled device buffer."""

    x: dict
    buffer: object
    P: int


@dataclass
class Truth:
    """Float64 truth (o over the new tokens, final state), the compute-dtype baseline of both, and
    the gates behind them (for the tolerance's gate-span term)."""

    o: torch.Tensor
    base_o: Optional[torch.Tensor]
    S: torch.Tensor
    base_S: Optional[torch.Tensor]
    g: torch.Tensor


@dataclass
class Bench:
    """What a benchmark test uses: the config, workloads, timing and the row it records."""

    cfg: Config
    copy: dict
    _timers: list = field(default_factory=list)

    # ------------------------------------------------------------------ workloads
    def tokens(self, B: int, T: int, seed: int) -> dict:
        """q, k (L2-normalised), v in the benchmark dtype; g (mild, in [-0.5, 0]) and beta (uniform [0, 1])
        in float32: [B, T, ...] on the device, drawn there (fast at any batch)."""
        import torch.nn.functional as F

        s, dt = self.cfg.shapes, self.cfg.dtype
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        q = F.normalize(torch.randn(B, T, s.H, s.K, device=DEVICE, generator=gen), dim=-1).to(dt)
        k = F.normalize(torch.randn(B, T, s.H, s.K, device=DEVICE, generator=gen), dim=-1).to(dt)
        v = torch.randn(B, T, s.HV, s.V, device=DEVICE, generator=gen).to(dt)
        g = -0.5 * torch.rand(B, T, s.HV, device=DEVICE, generator=gen)
        beta = torch.rand(B, T, s.HV, device=DEVICE, generator=gen)
        return dict(q=q, k=k, v=v, g=g, beta=beta)

    @staticmethod
    def steps(x: dict) -> list[dict]:
        """[B, T, ...] tokens as T contiguous one-token dicts (sliced before timing, not inside it)."""
        T = x["q"].shape[1]
        return [{n: t[:, j : j + 1].contiguous() for n, t in x.items()} for j in range(T)]

    def history(self, B: int, capacity: int, buffered: int, seed: int = 100) -> "History":
        """B requests whose buffers hold ``buffered`` entries after ``history_folded`` folded tokens.

        Two base histories (float64 oracle prefill of a ``Case``) are tiled over the batch (request
        b is base b % 2), so building a batch of 512 costs two prefills."""
        from kvbuffer_ref.testing import Case
        from kvbuffer_ref.testing.properties import buffer_to, ragged_buffer

        s = self.cfg.shapes
        P = self.cfg.history_folded + buffered
        x = Case(B=2, T=P, H=s.H, HV=s.HV, K=s.K, V=s.V, gate="mild", beta="uniform", seed=seed).inputs(self.cfg.dtype)
        x = {n: (t.float() if n in ("g", "beta") else t) for n, t in x.items()}
        x64 = {n: t.double() for n, t in x.items()}
        two = buffer_to(ragged_buffer(x64, [buffered, buffered], capacity), dtype=torch.float32, device=DEVICE,
                        key_dtype=self.cfg.dtype)
        idx = torch.arange(B, device=DEVICE) % 2  # tiled on the device, in the storage dtypes
        buf = type(two)(**{f: (None if getattr(two, f) is None else getattr(two, f).index_select(0, idx).contiguous())
                           for f in ("k", "lengths", "state", "has_state", "u", "G", "v", "g", "beta")})
        return History(x=x, buffer=buf, P=P)

    def truth(self, new: dict, rows: Sequence[int], hist: Optional["History"] = None,
              initial_state: Optional[torch.Tensor] = None, select: Optional[Sequence[int]] = None):
        """Float64 truth and compute-dtype baseline for requests ``rows``: the recurrence over each one's
        history (base ``r % 2`` of ``hist``) followed by its new tokens (``select``: only these
        token indices, e.g. a root-to-node path).  Returns a ``Truth`` whose outputs cover the new
        tokens only; initial_state: [B, HV, K, V] to start from instead of a history."""
        from kvbuffer_ref.testing.properties import truth_and_baseline

        idx = torch.as_tensor(rows, dtype=torch.long)
        x = {n: t.detach().index_select(0, idx.to(t.device)).cpu() for n, t in new.items()}
        if select is not None:
            sel = torch.as_tensor(list(select), dtype=torch.long)
            x = {n: t.index_select(1, sel) for n, t in x.items()}
        P = 0
        if hist is not None:
            base = idx % 2
            x = {n: torch.cat([hist.x[n].index_select(0, base), t], dim=1) for n, t in x.items()}
            P = hist.P
        s0 = None if initial_state is None else initial_state.detach().index_select(0, idx.to(initial_state.device)).cpu()
        (o64, S64), base = truth_and_baseline(x, s0)
        if base is None:
            return Truth(o64[:, P:], None, S64, None, x["g"])
        return Truth(o64[:, P:], base[0][:, P:], S64, base[1], x["g"])

    def compare(self, name: str, actual: torch.Tensor, rows: Sequence[int], truth: Truth, *,
                state: bool = False, o_slice=slice(None)):
        """``kvbuffer_ref.testing.compare`` of requests ``rows`` of ``actual`` (an output [B, T, HV, V],
        or a state [B, HV, K, V] with ``state=True``) with the truth; ``o_slice`` picks tokens of it."""
        from kvbuffer_ref.testing import compare

        a = actual.detach().index_select(0, torch.as_tensor(rows, dtype=torch.long, device=actual.device)).cpu()
        if state:
            exp, base = truth.S, truth.base_S
            dt = torch.promote_types(self.cfg.dtype, torch.float32)
        else:
            exp, base = truth.o[:, o_slice], None if truth.base_o is None else truth.base_o[:, o_slice]
            dt = self.cfg.dtype
        return compare(a, exp, base, name=name, dtype=dt, head_axis=1 if state else 2, g=truth.g)

    def measure(self, benchmark, fn: Callable[[], object], *, kind: str, impl: str, io_bytes: float,
                checks: list[dict], per: int = 1, **info) -> dict:
        """Time ``fn`` (``per`` operations per call) in device time and record the row."""
        timer = Timer(fn, per)
        self._timers.append(timer)
        rounds_ms: list[float] = []

        def one_round():
            ms = timer.ms()
            rounds_ms.append(ms)
            _NOW[0] += ms / 1e3

        benchmark.pedantic(one_round, rounds=self.cfg.rounds, warmup_rounds=0, iterations=1)
        us = statistics.median(rounds_ms) * 1e3
        tbps = io_bytes / (us * 1e-6) / 1e12
        row = dict(mode=MODE, kind=kind, impl=impl, device_us=us, device_us_rounds=[m * 1e3 for m in rounds_ms],
                   timing=timer.method, ops_per_measure=per, io_bytes=io_bytes, TBps=tbps,
                   copy_TBps=self.copy["TBps"], copy_share=tbps / self.copy["TBps"], checks=checks,
                   dtype=self.cfg.dtype_name, **self.cfg.shapes.as_dict(), **info)
        benchmark.extra_info.update(row)
        return row

    def close(self):
        for t in self._timers:
            t.close()
        self._timers.clear()
        if MODE == "gpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _copy_bandwidth() -> dict:
    """A large device-to-device copy: bytes read + written over device time (the roofline)."""
    n = (1 << 28) if MODE == "gpu" else (1 << 18)  # 1 GiB of fp32 on the GPU
    x = torch.randn(n, device=DEVICE)
    y = torch.empty_like(x)
    if MODE == "gpu":
        import triton.testing

        y.copy_(x)
        ms = float(triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=200, return_mode="median"))
        method = "torch copy_, triton.testing.do_bench median"
    else:
        t = time.perf_counter()
        y.copy_(x)
        ms = (time.perf_counter() - t) * 1e3
        method = "wall-clock (smoke)"
    nbytes = 2 * x.numel() * x.element_size()
    return dict(bytes=nbytes, ms=ms, TBps=nbytes / (ms * 1e-3) / 1e12, method=method)


@pytest.fixture(scope="session")
def copy_bw() -> dict:
    res = _copy_bandwidth()
    SESSION["copy"] = res
    return res


@pytest.fixture
def bench(copy_bw):
    b = Bench(CFG, copy_bw)
    yield b
    b.close()


@pytest.fixture(scope="session")
def cfg() -> Config:
    return CFG


# ----------------------------------------------------------------------------- parametrisation
def pytest_generate_tests(metafunc):
    params = {
        "batch": (CFG.batches, "B{}"),
        "capacity": (CFG.capacities, "C{}"),
        "vbatch": (CFG.verify_batches, "B{}"),
        "drafts": (CFG.drafts, "d{}"),
        "tree_drafts": (CFG.tree_drafts, "d{}"),
    }
    for name, (values, fmt) in params.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values, ids=[fmt.format(v) for v in values])


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "benchmark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.benchmark(timer=device_clock, group=item.originalname))


def pytest_runtest_logreport(report):
    """Failed or skipped benchmarks go into the JSON too (pytest-benchmark only writes the timed ones)."""
    if report.failed or (report.skipped and report.when in ("setup", "call")):
        msg = report.longrepr
        if isinstance(msg, tuple):  # a skip: (path, line, reason)
            msg = msg[-1]
        text = str(getattr(report, "longreprtext", "") or msg or "")
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        key = "failures" if report.failed else "skips"
        SESSION.setdefault(key, []).append(dict(test=report.nodeid, when=report.when,
                                                message=(lines[-1] if lines else "")[:500]))


def pytest_report_header(config):
    return [f"kvbuffer benchmarks: mode={MODE} device={DEVICE} TRITON_INTERPRET="
            f"{os.environ.get('TRITON_INTERPRET', '0')}; {TIMING_DOC}"]


# ----------------------------------------------------------------------------- machine info / JSON
def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001 - no nvidia-smi: no driver version
        return None


def _versions() -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version())
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"unavailable: {e!r}"
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        info["fla"] = f"unavailable: {type(e).__name__}"
    return info


def pytest_benchmark_update_machine_info(config, machine_info):
    gpu = dict(name=None, driver=None, cuda=None, sm_count=None, memory_GiB=None)
    if _CUDA:
        p = torch.cuda.get_device_properties(0)
        gpu.update(name=p.name, driver=_driver_version(), cuda=torch.version.cuda, sm_count=p.multi_processor_count,
                   memory_GiB=round(p.total_memory / 2 ** 30, 1))
    machine_info["kvbuffer"] = dict(mode=MODE, gpu=gpu, **_versions(),
                                    triton_interpret=os.environ.get("TRITON_INTERPRET", "0"))


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["kvbuffer"] = dict(
        SESSION, mode=MODE, smoke=(MODE == "smoke"), timing=TIMING_DOC, time_field="stats.median (seconds) "
        "== extra_info.device_us (microseconds): device time per operation",
        config=dict(shapes=CFG.shapes.as_dict(), dtype=CFG.dtype_name, batches=CFG.batches, capacities=CFG.capacities,
                    verify_batches=CFG.verify_batches, drafts=CFG.drafts, tree_drafts=CFG.tree_drafts,
                    verify_capacity=CFG.verify_capacity, verify_fill=CFG.verify_fill, rounds=CFG.rounds,
                    warmup_ms=CFG.warmup_ms, rep_ms=CFG.rep_ms),
    )
