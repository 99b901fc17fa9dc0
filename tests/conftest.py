"""Shared test setup: quiet TensorFlow, a non-interactive matplotlib, deterministic seeds."""

import os
import sys

from _workers import WORKER_THREAD_VARIABLES

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MPLBACKEND", "Agg")
# Under pytest-xdist (make test runs one worker per core) each worker keeps TensorFlow and
# BLAS to one thread: two workers then share the cores instead of fighting over them (most
# tests are small models whose time is Python, not arithmetic). Set before TensorFlow loads;
# a test that measures the default threading removes them from its subprocess's environment.
if "PYTEST_XDIST_WORKER" in os.environ:
    for _name in WORKER_THREAD_VARIABLES:
        os.environ.setdefault(_name, "1")

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True)
def _keras_seed():
    """Seed Keras (initializers, dropout) before each test that has imported it."""
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.utils.set_random_seed(1234)
    yield


# The longest tests first: the notebooks (each in its own kernel, up to 40 s), the docs
# build, the localhost cluster and the statistical truths. pytest-xdist hands each worker a
# contiguous share of the collected tests and moves short ones between them at the end; a
# long test collected last keeps one core busy after the other has run out of work.
_LONG_FIRST = (
    "tests/test_notebooks.py",
    "tests/test_docs.py",
    "tests/operators/test_distributed.py",
    "tests/truths/",
)


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))
