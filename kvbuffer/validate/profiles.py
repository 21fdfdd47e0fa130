"""Hypothesis profiles: ``ci`` (bounded, fresh examples every run), ``thorough`` (many examples) and
``gpu`` (few examples: every new shape is a Triton compile, for the compiled lane on a GPU).

In ``kvbuffer validate`` the profile also picks the size budget of a lane (``runner.lane_sizes``):
``ci`` and ``thorough`` use the implementation's declared budget (``cases.NORMAL``: plain PyTorch and
compiled kernels; ``cases.SMALL``: the Triton interpreter); ``gpu`` uses production shapes
(``cases.GPU``: Qwen3-Next's H = 16, HV = 32, K = V = 128, B up to 256, T up to 4096, C up to 64, trees
of 64 nodes) for every implementation that is not interpreted, with the float64 oracle computed on the
same device, the first anchor of each operation (its call sequence, strided and wide-domain variants),
the boundary cases at production size (lengths around every multiple of 16, 32 and 64 and of the chunk
size among them), the operation's other anchors at production head shapes, and 4 drawn examples per
lane.  Drawn cases take (H, HV, K, V) from ``cases.GPU_HEAD_SHAPES`` (head groups HV / H of 1, 2, 4 and
8, 48 and 64 value heads, K = V = 128): few shapes, so the compiled kernels share their compiles while
the lengths vary (up to 1025 tokens around multiples of 64)::

    kvbuffer validate --profile gpu --device cuda --impl fast
    kvbuffer validate --profile gpu --device cuda --impl fla

``load_profile()`` picks the profile named by the environment variable HYPOTHESIS_PROFILE
(default ``ci``).  Every profile prints the blob that replays a failure (``@reproduce_failure``).

No profile is derandomized: each run draws new examples.  What a run draws is fixed by its seed
(``run_seed()``: $KVBUFFER_SEED, else a fresh random one, exported to $KVBUFFER_SEED so that
subprocesses and pytest-xdist workers share it); ``seed_for(name)`` derives one test's seed from it,
so a test draws the same examples for the same seed whatever runs before it or on which worker.

``example_database(path)``: failing examples are kept in a directory database (committed with the
project).  It is read-only (replayed, never written) unless $KVBUFFER_SAVE_EXAMPLES is 1, so a run
never changes the tree by itself; record a failure with ``KVBUFFER_SAVE_EXAMPLES=1 KVBUFFER_SEED=<seed>``.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Optional

from hypothesis import HealthCheck, Phase, settings

__all__ = ["register_profiles", "load_profile", "PROFILES", "SEED_ENV", "SAVE_ENV", "run_seed", "seed_for",
           "example_database"]

PROFILES = ("ci", "thorough", "gpu")
SEED_ENV = "KVBUFFER_SEED"
SAVE_ENV = "KVBUFFER_SAVE_EXAMPLES"
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]


def run_seed() -> int:
    """This run's seed: $KVBUFFER_SEED (an int), else a new random one, which is then put in
    $KVBUFFER_SEED (processes started later, e.g. pytest-xdist workers, draw from the same seed)."""
    raw = os.environ.get(SEED_ENV)
    if raw is None or raw.strip() == "":
        seed = random.SystemRandom().randrange(2**32)
        os.environ[SEED_ENV] = str(seed)
        return seed
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{SEED_ENV}: expected an integer seed, got {raw!r}") from None


def seed_for(name: str, seed: Optional[int] = None) -> int:
    """The seed of one test (``name``: its pytest node id or qualified name) in the run of ``seed``
    (default ``run_seed()``): stable across processes and test orders."""
    seed = run_seed() if seed is None else seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:16], "big")


def example_database(path):
    """The committed database of failing examples at ``path``: replayed first by every test (the
    ``reuse`` phase); written only when $KVBUFFER_SAVE_EXAMPLES is 1."""
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

    db = DirectoryBasedExampleDatabase(str(path))
    return db if os.environ.get(SAVE_ENV) == "1" else ReadOnlyDatabase(db)


def register_profiles(database=None) -> None:
    """Register the profiles; ``database``: the example database they replay (None: none)."""
    common = dict(deadline=None, derandomize=False, print_blob=True, suppress_health_check=_SUPPRESS,
                  database=database)
    settings.register_profile("ci", max_examples=12, phases=_PHASES, **common)
    settings.register_profile("thorough", max_examples=300, **common)
    settings.register_profile("gpu", max_examples=4, **common)


def load_profile(name: str | None = None, database=None) -> str:
    """Register the profiles and load ``name`` (default: $HYPOTHESIS_PROFILE or 'ci')."""
    register_profiles(database)
    name = name or os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE: expected one of {PROFILES}, got {name!r}")
    settings.load_profile(name)
    return name
