"""Shared test setup: quiet TensorFlow, a non-interactive matplotlib, deterministic seeds."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MPLBACKEND", "Agg")

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
