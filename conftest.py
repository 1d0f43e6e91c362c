"""Root conftest: Hypothesis settings profiles, chosen by HYPOTHESIS_PROFILE (dev by default)."""

from harness.hypothesis_profiles import load_profile

load_profile()
