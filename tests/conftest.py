"""Test-wide setup: the hypothesis profile (HYPOTHESIS_PROFILE=ci|thorough|gpu, default ci) with fresh
examples every run, NaN-poisoned library outputs (KVBUFFER_POISON=1: every output kvbuffer_fast allocates
starts as NaN, so an element a kernel forgets to write fails), `kvbuffer validate` without worker processes
(KVBUFFER_JOBS=1), each pytest-xdist worker's share of the cores as torch's thread count and, on a machine
without CUDA, the Triton interpreter (set before anything imports triton), its launches run as
tests/interpreter_launches.py says, here and in the programs the tests start ($KVBUFFER_INTERPRETER_SETUP, which
kvbuffer_fast honours on import).

Seeds: the run's seed is $KVBUFFER_SEED, else a random one (exported to $KVBUFFER_SEED before the
pytest-xdist workers start, so they share it); it is printed in the pytest header.  Every hypothesis
test draws from ``profiles.seed_for(its node id)``, so ``KVBUFFER_SEED=<seed> pytest <node id>`` draws the
same examples again, alone or in the whole suite, on any worker.  ``--hypothesis-seed=N`` also works
(hypothesis' own option: the same seed for every test, and no example database).

Before drawing, each test replays the failing examples kept in the committed database tests/.hypothesis-db
(read-only; KVBUFFER_SAVE_EXAMPLES=1 records new failures there).
"""

import atexit
import os
import shutil
import tempfile
import random
from pathlib import Path

# a pytest-xdist worker computes with its share of the cores, not with all of them: the workers already run
# side by side, and the default (a thread per core in every worker, in torch and in numpy's BLAS, which the
# Triton interpreter's dots use) oversubscribes them; the tests' small tensors lose more to thread hand-offs
# than they gain.  Set before torch and numpy load; the programs a test starts inherit it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _threads)

try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _cuda = False
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # numpy or a plugin may have loaded torch first
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from .interpreter_launches import install as _install_interpreter_launches

    _install_interpreter_launches()  # each launch on a fresh frame stack; see tests/interpreter_launches.py
    # and so in the programs the tests start: kvbuffer_fast runs its install() on import (kvbuffer_fast._common)
    os.environ.setdefault("KVBUFFER_INTERPRETER_SETUP", str(Path(__file__).resolve().parent
                                                            / "interpreter_launches.py"))
os.environ.setdefault("KVBUFFER_POISON", "1")
# `kvbuffer validate` runs one lane at a time in the test's own process (pytest -n already spreads the tests over
# the cores); tests/validate/test_jobs.py runs it with --jobs
os.environ.setdefault("KVBUFFER_JOBS", "1")
# `kvbuffer validate` keeps its last report in the cache dir: tests write to a temporary one, not ~/.cache
if "KVBUFFER_CACHE_DIR" not in os.environ:
    os.environ["KVBUFFER_CACHE_DIR"] = _cache = tempfile.mkdtemp(prefix="kvbuffer-tests-")
    _pid = os.getpid()
    atexit.register(lambda: os.getpid() == _pid and shutil.rmtree(_cache, ignore_errors=True))

import pytest  # noqa: E402

from kvbuffer.validate import load_profile  # noqa: E402
from kvbuffer.validate import profiles  # noqa: E402

EXAMPLE_DB = Path(__file__).resolve().parent / ".hypothesis-db"
SEED = profiles.run_seed()
PROFILE = load_profile(database=profiles.example_database(EXAMPLE_DB))


def pytest_report_header(config):
    forced = config.getoption("hypothesis_seed", default=None)
    seed = (f"--hypothesis-seed={forced} (every test; no example database)" if forced is not None else
            f"{profiles.SEED_ENV}={SEED} (replay: {profiles.SEED_ENV}={SEED} python3 -m pytest ...)")
    saving = "read-write" if os.environ.get(profiles.SAVE_ENV) == "1" else "read-only"
    return [f"hypothesis profile: {PROFILE}; seed {seed}; example database tests/.hypothesis-db ({saving})",
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; "
            f"KVBUFFER_POISON={os.environ.get('KVBUFFER_POISON', '0')}"]


def _seed_hypothesis(nodeid: str) -> None:
    """Draw this test's examples from seed_for(nodeid): hypothesis takes a test's seed from its
    per-thread random generator when no seed is forced (which would also turn the database off)."""
    from hypothesis import core

    local = getattr(core, "threadlocal", None)
    if local is not None and hasattr(local, "_hypothesis_global_random"):
        local._hypothesis_global_random = random.Random(profiles.seed_for(nodeid, SEED))
    elif core.global_force_seed is None:  # pragma: no cover - another hypothesis layout: one seed for all
        core.global_force_seed = SEED


@pytest.fixture(autouse=True)
def _hypothesis_seed(request):
    _seed_hypothesis(request.node.nodeid)
    yield


#: the files holding the longest single tests (interpreted kernels over many steps, whole validation lanes,
#: programs started), in that order: pytest-xdist hands tests out in collection order, so a long test collected
#: late runs alone at the end while the other workers idle.  Scheduled first; the rest keep their order.
SLOW_FIRST = (
    "tests/pool/test_pool_stateful.py",
    "tests/validate/test_sglang.py",
    "tests/validate/test_fla_kda.py",
    "tests/bench/test_bench_peers.py",
    "tests/bench/test_bench_smoke.py",
    "tests/validate/test_mutate.py",
    "tests/property/test_fast_verify.py",
    "tests/validate/test_jobs.py",
    "tests/validate/test_cli.py",
    "tests/hostile/test_hostile.py",
    "tests/pool/test_tp_gloo.py",
)


#: test files whose tests all run on one pytest-xdist worker under ``--dist loadgroup`` (they share a costly
#: module fixture: the gloo process group).  xdist's ``xdist_group`` mark cannot do it with pytest 9.2: xdist
#: tags the group onto ``item._nodeid``, which pytest 9.2 no longer reads, so the grouped tests spread over
#: the workers and each starts the fixture; the scheduler below groups these files itself.
ONE_WORKER = ("tests/pool/test_tp_gloo.py",)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist ignores it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``'s scheduler, with each ONE_WORKER file one work unit (other dist modes: xdist's)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerFiles(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER else super()._split_scope(nodeid)

    return OneWorkerFiles(config, log)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))
