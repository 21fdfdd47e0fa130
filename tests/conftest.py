"""Test-wide setup: the hypothesis profile (HYPOTHESIS_PROFILE=ci|thorough|gpu, default ci) with fresh
examples every run, NaN-poisoned library outputs (KVBUFFER_POISON=1: every output kvbuffer_fast allocates
starts as NaN, so an element a kernel forgets to write fails), `kvbuffer validate` without worker processes
(KVBUFFER_JOBS=1), each pytest-xdist worker's share of the cores as torch's thread count and, on a machine
without CUDA, the Triton interpreter (set before anything imports triton).

Seeds: the run's seed is $KVBUFFER_SEED, else a random one (exported to $KVBUFFER_SEED before the
pytest-xdist workers start, so they share it); it is printed in the pytest header.  Every hypothesis
test draws from ``profiles.seed_for(its node id)``, so ``KVBUFFER_SEED=<seed> pytest <node id>`` draws the
same examples again, alone or in the whole suite, on any worker.  ``--hypothesis-seed=N`` also works
(hypothesis' own option: the same seed for every test, and no example database).

Before drawing, each test replays the failing examples kept in the committed database tests/.hypothesis-db
(read-only; KVBUFFER_SAVE_EXAMPLES=1 records new failures there).
"""

import os
import tempfile
import random
from pathlib import Path

try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVBUFFER_POISON", "1")
# `kvbuffer validate` runs one lane at a time in the test's own process (pytest -n already spreads the tests over
# the cores); tests/validate/test_jobs.py runs it with --jobs
os.environ.setdefault("KVBUFFER_JOBS", "1")
# `kvbuffer validate` keeps its last report in the cache dir: tests write to a temporary one, not ~/.cache
os.environ.setdefault("KVBUFFER_CACHE_DIR", tempfile.mkdtemp(prefix="kvbuffer-tests-"))
# a pytest-xdist worker computes with its share of the cores, not with all of them: the workers already run
# side by side, and torch's default (a thread per core in every worker) oversubscribes them; the tests' small
# tensors lose more to thread hand-offs than they gain (2.2x faster measured on 2 cores, 2 workers)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # the programs a test starts (CLI, bench, mutants)

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
