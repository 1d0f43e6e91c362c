"""Root conftest: Hypothesis settings profiles, chosen by HYPOTHESIS_PROFILE (dev by default), and
the `nightly` marker: tests too long for CI run only with --run-nightly (tox -e nightly)."""

import pytest

from harness.campaign.profiles import load_profile

load_profile()


def pytest_addoption(parser):
    parser.addoption("--run-nightly", action="store_true", help="also run the tests marked nightly")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-nightly"):
        return
    later = pytest.mark.skip(reason="nightly lane only (tox -e nightly, or pytest --run-nightly)")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(later)
