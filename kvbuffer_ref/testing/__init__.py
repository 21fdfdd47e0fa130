"""kvbuffer_ref.testing: what the project's tests use, public for other projects' tests.

* ``TOLERANCES``, ``compare``, ``assert_matches``, ``rel_rms_slices``: the error policy (one table).
* ``Case``, ``make_inputs``: deterministic inputs from a few shrinkable fields and a seed.
* ``strategies``: hypothesis strategies (``cases``, ``buffer_lengths``, ``draft_tree``, ...).
* ``properties``: each property of DESIGN.md §4 as a function over any implementation.
* ``load_profile``: the ``ci`` / ``thorough`` hypothesis profiles.

See docs/testing.md.
"""

from . import properties, strategies
from .cases import BETA_REGIMES, GATE_REGIMES, Case, cast_inputs, make_inputs, upcast_inputs
from .profiles import load_profile, register_profiles
from .tolerances import TOLERANCES, Comparison, Tolerance, assert_matches, compare, rel_rms_slices, tolerance_for

__all__ = [
    "TOLERANCES", "Tolerance", "tolerance_for", "Comparison", "compare", "assert_matches", "rel_rms_slices",
    "Case", "make_inputs", "cast_inputs", "upcast_inputs", "GATE_REGIMES", "BETA_REGIMES",
    "strategies", "properties", "load_profile", "register_profiles",
]
