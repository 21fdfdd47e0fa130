"""kvbuffer.validate: the validator, checking any implementation against the oracle.

* ``Case``, ``make_inputs``: deterministic inputs from a few shrinkable fields and a seed (``cases``);
* ``TOLERANCES``, ``compare``, ``assert_matches``: the error policy, one table (``tolerances``);
* ``strategies``: hypothesis strategies of cases, buffers and drafts; ``properties``: each property
  of the oracle as a function over any implementation; ``load_profile``: the hypothesis profiles;
* ``Implementation``, ``describe``: the adapter protocol (``adapters``); the ready implementations and
  ``resolve`` are ``kvbuffer.implementations``;
  ``Sizes`` (``NORMAL``, ``SMALL``, ``GPU``): the size budgets an adapter declares (``cases``);
* ``CLASSES``: the bug classes a failure is attributed to (``runner``);
* ``run_validation``: ``kvbuffer validate`` as a function (``lanes``, ``runner``, ``parallel``, ``report``);
  its command line is ``kvbuffer.cli``, its pytest plugin ``kvbuffer.pytest_plugin``.

See docs/testing.md and docs/validate-your-kernel.md.
"""

from . import properties, strategies
from .adapters import AdapterError, Guarded, Implementation, describe, stepwise_recurrent
from .cases import BETA_REGIMES, GATE_REGIMES, GPU, NORM_REGIMES, NORMAL, SMALL, Case, Sizes, cast_inputs, make_inputs, \
    upcast_inputs
from .lanes import OP_KEYS, OPS, ValidationError, plan, select_ops
from .profiles import load_profile, register_profiles
from .report import LaneResult, Report
from .runner import CLASSES, NothingToRun, run_validation
from .tolerances import TOLERANCES, Comparison, Tolerance, assert_matches, compare, rel_rms_slices, tolerance_for

__all__ = [
    "TOLERANCES", "Tolerance", "tolerance_for", "Comparison", "compare", "assert_matches",
    "rel_rms_slices",
    "Case", "make_inputs", "cast_inputs", "upcast_inputs", "GATE_REGIMES", "BETA_REGIMES", "NORM_REGIMES",
    "Sizes", "NORMAL", "SMALL", "GPU", "CLASSES", "Guarded",
    "strategies", "properties", "load_profile", "register_profiles",
    "Implementation", "AdapterError", "describe", "stepwise_recurrent",
    "OPS", "OP_KEYS", "ValidationError", "select_ops", "plan", "run_validation", "NothingToRun", "Report",
    "LaneResult",
]
