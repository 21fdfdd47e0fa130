"""Hypothesis profiles: ``ci`` (bounded, derandomized, fast), ``thorough`` (many examples) and
``gpu`` (few examples: every new shape is a Triton compile, for the compiled lane on a GPU).

``load_profile()`` picks the profile named by the environment variable HYPOTHESIS_PROFILE
(default ``ci``).  Both print the blob that replays a failure (``@reproduce_failure``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

__all__ = ["register_profiles", "load_profile", "PROFILES"]

PROFILES = ("ci", "thorough", "gpu")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def register_profiles() -> None:
    settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
                              suppress_health_check=_SUPPRESS,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True,
                              suppress_health_check=_SUPPRESS)
    settings.register_profile("gpu", max_examples=4, deadline=None, derandomize=True, print_blob=True,
                              suppress_health_check=_SUPPRESS)


def load_profile(name: str | None = None) -> str:
    """Register both profiles and load ``name`` (default: $HYPOTHESIS_PROFILE or 'ci')."""
    register_profiles()
    name = name or os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE: expected one of {PROFILES}, got {name!r}")
    settings.load_profile(name)
    return name
