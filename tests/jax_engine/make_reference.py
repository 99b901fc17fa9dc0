"""Write the reference files that tie the JAX engine to the TensorFlow one.

Run with the TensorFlow environment, from the repository root:

    .venv/bin/python tests/jax_engine/make_reference.py

It builds a tiny float32 MLP (Dense, tanh, LayerNormalization, Dense logits; compiled with
a sparse cross-entropy from logits) and a tiny CNN (Conv2D, tanh, max pooling, a softmax
output; compiled with a sparse cross-entropy of the probabilities, which TensorFlow
computes from the logits behind the softmax), saves them as ``tests/data/jax_reference_
{mlp,cnn}.keras``, and stores in ``tests/data/jax_reference.npz`` their data, fixed
vectors V and the TensorFlow operators' products H V and G V (Hessian and generalized
Gauss-Newton, compiled loss; the MLP's 12 examples in batches of 5, so the last one is
short, the CNN's 8 in one) in float32 and float64. ``tests/jax_engine/test_jax_reference.py``
(JAX) checks that the same files give the same products on JAX;
``tests/operators/test_jax_reference.py`` (TensorFlow) that they still give the stored
ones on TensorFlow.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

DATA = Path(__file__).resolve().parents[1] / "data"
NAMES = ("mlp", "cnn")
#: Batches of the MLP's 12 examples (5, 5 and a short last one of 2); the CNN's 8 examples
#: are one batch.
BATCH_SIZE = {"mlp": 5, "cnn": None}
NUM_VECTORS = 3


def model_path(name: str) -> Path:
    return DATA / f"jax_reference_{name}.keras"


REFERENCE = DATA / "jax_reference.npz"


def build(name: str):
    """The model ``name``, built and compiled (float32, seeded)."""
    import keras

    keras.utils.set_random_seed(7)
    layers = keras.layers
    if name == "mlp":
        model = keras.Sequential(
            [
                keras.Input((4,)),
                layers.Dense(5, activation="tanh"),
                layers.LayerNormalization(),
                layers.Dense(3),
            ],
            name="reference_mlp",
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model = keras.Sequential(
            [
                keras.Input((6, 6, 1)),
                layers.Conv2D(2, 3, activation="tanh"),
                layers.MaxPooling2D(2),
                layers.Flatten(),
                layers.Dense(3, activation="softmax"),
            ],
            name="reference_cnn",
        )
        loss = keras.losses.SparseCategoricalCrossentropy()
    model.compile(optimizer="sgd", loss=loss)
    return model


def data(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11 if name == "mlp" else 12)
    if name == "mlp":
        x = rng.normal(size=(12, 4)).astype(np.float32)
        y = rng.integers(0, 3, size=12)
    else:
        x = rng.normal(size=(8, 6, 6, 1)).astype(np.float32)
        y = rng.integers(0, 3, size=8)
    return x, y


def products(name, model, x, y, vectors, operator_class, dtype) -> np.ndarray:
    """The operator's products with ``vectors`` (compiled loss, batches of
    ``BATCH_SIZE[name]``)."""
    operator = operator_class.from_keras(
        model, None, (x, y), batch_size=BATCH_SIZE[name], dtype=dtype
    )
    return operator.matmat(vectors.astype(dtype))


def compute(models: dict) -> dict[str, np.ndarray]:
    """The stored arrays: per model, x, y, V and the four products."""
    from spectra import GGNOperator, HessianOperator

    arrays: dict[str, np.ndarray] = {}
    for name, model in models.items():
        x, y = data(name)
        n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        vectors = np.random.default_rng(13).normal(size=(n, NUM_VECTORS))
        arrays[f"{name}_x"], arrays[f"{name}_y"], arrays[f"{name}_v"] = x, y, vectors
        for label, operator_class in (("hessian", HessianOperator), ("ggn", GGNOperator)):
            for dtype in (np.float32, np.float64):
                key = f"{name}_{label}_{np.dtype(dtype).name}"
                arrays[key] = products(name, model, x, y, vectors, operator_class, dtype)
    return arrays


def main() -> None:
    import keras

    models = {}
    for name in NAMES:
        build(name).save(model_path(name))
        models[name] = keras.saving.load_model(model_path(name))
    np.savez_compressed(REFERENCE, **compute(models))
    for path in (*map(model_path, NAMES), REFERENCE):
        print(f"{path.relative_to(DATA.parent.parent)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
