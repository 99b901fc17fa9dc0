"""Write the test zoo's truths for the JAX engine: the architectures of ``tests/_zoo.py``
made of Keras layers only, saved as ``.keras`` files, with their data and finite-difference
Hessian products.

Run with the TensorFlow environment, from the repository root:

    .venv/bin/python tests/jax_engine/make_zoo_reference.py

For each entry of :data:`NAMES` (``tests/_zoo.py``: float32 model, data, batches, kwargs)
it saves the model, compiled with the entry's loss and loss weights, as
``tests/data/jax_zoo/<name>.keras`` and stores in ``tests/data/jax_zoo.npz`` the data,
three fixed vectors V and H V, H the float64 Hessian of the dataset loss by central
finite differences of the float64 gradient (``_zoo.dense_reference``, never TensorFlow's
second derivatives), with the gradient and the loss. It checks that TensorFlow's float64
operator agrees with that truth before writing. The entries left out need classes of
their own (``ScanRecurrence``, custom gradients, ``tf.cond``) or draw Dropout masks, which
JAX draws from another generator. ``tests/jax_engine/test_jax_zoo.py`` compares the JAX
engine's float64 products with the stored truth.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"
DIRECTORY = DATA / "jax_zoo"
REFERENCE = DATA / "jax_zoo.npz"
NAMES = (
    "mlp",
    "cnn",
    "batchnorm",
    "attention",
    "layernorm",
    "groupnorm",
    "batchnorm-training",
    "batchnorm-training-batches",
    "transformer",
    "lstm-masked",
    "gru",
    "bidirectional-lstm",
    "multi-io-compiled",
)
NUM_VECTORS = 3


def model_path(name: str) -> Path:
    return DIRECTORY / f"{name}.keras"


def _flatten_data(prefix: str, tree, arrays: dict) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            arrays[f"{prefix}.{key}"] = np.asarray(value)
    else:
        arrays[prefix] = np.asarray(tree)


def main() -> None:
    sys.path.insert(0, str(TESTS))
    import _zoo
    import keras
    from _dense import relative_error

    entries = {entry.name: entry for entry in _zoo.ZOO}
    DIRECTORY.mkdir(exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for name in NAMES:
        entry = entries[name]
        rng = np.random.default_rng(12345)
        model, _, op64, _, (H, gradient, loss) = _zoo.zoo_case(entry, rng)
        vectors = np.random.default_rng(13).standard_normal((H.shape[0], NUM_VECTORS))
        products = H @ vectors
        error = relative_error(op64.matmat(vectors), products)
        assert error < 1e-8, (name, error)
        model.compile(loss=entry.loss, loss_weights=entry.loss_weights)
        model.save(model_path(name))
        x, y = entry.data(np.random.default_rng(12345), _zoo.N, 4)
        _flatten_data(f"{name}/x", x, arrays)
        _flatten_data(f"{name}/y", y, arrays)
        arrays[f"{name}/v"] = vectors
        arrays[f"{name}/hv"] = products
        arrays[f"{name}/gradient"] = gradient
        arrays[f"{name}/loss"] = np.asarray(loss)
        print(f"{name}: n = {H.shape[0]}, TensorFlow's float64 operator within {error:.1e}")
        keras.backend.clear_session()
    np.savez_compressed(REFERENCE, **arrays)
    sizes = sum(p.stat().st_size for p in DIRECTORY.iterdir())
    print(
        f"{REFERENCE.relative_to(TESTS.parent)}: {REFERENCE.stat().st_size} bytes; models {sizes}"
    )


if __name__ == "__main__":
    main()
