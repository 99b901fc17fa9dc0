"""Fixtures several files of tests/cli use: Adam-trained checkpoints with their dense truths,
built once per test process (session-scoped; the tests only read them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _npz(path: Path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def _adam_run(
    directory: Path, name: str, x: np.ndarray, y: np.ndarray, layers: list, dense_steps=(2, 4)
) -> tuple:
    """A float64 classifier compiled with its loss and Adam (η = 0.05), saved before
    training (step 0, no optimizer state) and after 2 and 4 full-batch steps, with the
    dense Hessian H and D = P^{-1/2} of the live optimizer at the ``dense_steps``."""
    import keras
    import tensorflow as tf
    from _dense import dense_hessian

    from spectra.analysis.preconditioning import preconditioner_diagonal

    run = directory / "run"
    run.mkdir()
    data = _npz(directory / "data.npz", x=x, y=y)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(layers, name=name)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def loss():
        logits = model(x, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    model.save(run / "step_0000.keras")
    truth = {}
    for step in (2, 4):
        model.fit(x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
        model.save(run / f"step_{step:04d}.keras")
        if step not in dense_steps:
            continue
        variables = model.trainable_variables
        diagonal = preconditioner_diagonal(model.optimizer, variables)
        truth[step] = {
            "H": dense_hessian(loss, variables),
            "D": 1.0 / np.sqrt(diagonal),
            "loss": float(loss()),
        }
    return run, data, truth


@pytest.fixture(scope="session")
def adam_lstm_run(tmp_path_factory):
    """Embedding → LSTM → Dense on token sequences (61 parameters)."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, size=(24, 5)).astype(np.int32)
    y = rng.integers(0, 3, size=24)
    layers = [
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(6, 2, mask_zero=True, dtype="float64", name="embedding"),
        keras.layers.LSTM(2, dtype="float64", name="lstm"),
        keras.layers.Dense(3, dtype="float64", name="logits"),
    ]
    directory = tmp_path_factory.mktemp("lstm")
    return _adam_run(directory, "lstm_classifier", x, y, layers, dense_steps=(4,))


@pytest.fixture(scope="session")
def adam_mlp_run(tmp_path_factory):
    """A 4-5-3 tanh MLP (43 parameters)."""
    import keras

    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 4))
    y = rng.integers(0, 3, size=30)
    layers = [
        keras.Input((4,), dtype="float64"),
        keras.layers.Dense(5, activation="tanh", dtype="float64"),
        keras.layers.Dense(3, dtype="float64"),
    ]
    return _adam_run(tmp_path_factory.mktemp("mlp"), "adam_mlp", x, y, layers)
