"""Hypothesis settings per lane: dev (fast, random), ci (derandomized), nightly (long, saved database)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=SLOW_DATA)
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=SLOW_DATA,
    print_blob=True,
)
settings.register_profile(
    "nightly",
    max_examples=500,
    deadline=None,
    suppress_health_check=SLOW_DATA,
    database=DirectoryBasedExampleDatabase(".hypothesis/nightly"),
    print_blob=True,
)


def load_profile(default: str = "dev") -> str:
    name = os.environ.get("HYPOTHESIS_PROFILE", default)
    settings.load_profile(name)
    return name
