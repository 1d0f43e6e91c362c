"""Root conftest: Hypothesis settings profiles, chosen by HYPOTHESIS_PROFILE (dev by default), the
`nightly` marker: tests too long for CI run only with --run-nightly (tox -e nightly), and one
directory of engine-worker zygotes for the whole session, the CLIs it runs included."""

import os
import shutil
import tempfile

import pytest

from harness.campaign.profiles import load_profile

load_profile()


def pytest_configure(config):
    """Engine workers fork from zygotes the whole session shares, the CLIs it runs included
    ($HARNESS_ZYGOTES, harness.engines.zygote): torch and transformers are imported once per
    environment, not once per command. Removing the directory at the end sends each zygote away."""
    if "HARNESS_ZYGOTES" not in os.environ:
        config.zygotes = tempfile.mkdtemp(prefix="harness-zygotes-")
        os.environ["HARNESS_ZYGOTES"] = config.zygotes


def pytest_unconfigure(config):
    if getattr(config, "zygotes", None):
        shutil.rmtree(config.zygotes, ignore_errors=True)
        del os.environ["HARNESS_ZYGOTES"]


def pytest_addoption(parser):
    parser.addoption("--run-nightly", action="store_true", help="also run the tests marked nightly")


def pytest_collection_modifyitems(config, items):
    # regenerating goldens (--update-golden) runs every gate, the nightly half of the matrix included
    if config.getoption("--run-nightly") or config.getoption("--update-golden", default=False):
        return
    later = pytest.mark.skip(reason="nightly lane only (tox -e nightly, or pytest --run-nightly)")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(later)
