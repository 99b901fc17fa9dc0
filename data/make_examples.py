"""Regenerate the example assets in data/ (deterministic; about 30 s on a 2-core CPU).

    python data/make_examples.py            # writes data/digits.npz, data/digits_mlp.keras,
                                            # data/gd_trajectory/
    python data/make_examples.py --out DIR  # somewhere else

See data/README.md for what each asset is. The sharpness (top eigenvalue of the Hessian of the
full-batch training loss) along the gradient-descent trajectory is computed here independently
of spectra: a float64 re-implementation of the MLP, Hessian-vector products by nested gradient
tapes, and scipy's eigsh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import scipy.sparse.linalg
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spectra.io.datasets import load_data

SEED = 0
LOSS = "sparse_categorical_crossentropy"

MLP_HIDDEN = (256, 256)
MLP_LEARNING_RATE = 1e-3
MLP_EPOCHS = 10
MLP_BATCH_SIZE = 32

GD_HIDDEN = (32, 32)
GD_LEARNING_RATE = 0.2
GD_STEPS = 200
GD_CHECKPOINT_EVERY = 20


def build_mlp(hidden: tuple[int, ...], name: str) -> keras.Model:
    """64 -> hidden (ReLU) ... -> 10 softmax."""
    layers = [keras.Input((64,), name="pixels")]
    layers += [
        keras.layers.Dense(units, activation="relu", name=f"hidden_{index}")
        for index, units in enumerate(hidden, start=1)
    ]
    layers.append(keras.layers.Dense(10, activation="softmax", name="probabilities"))
    return keras.Sequential(layers, name=name)


def full_batch_metrics(model: keras.Model, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean training loss (Keras' sparse categorical cross-entropy) and accuracy on all of x."""
    probabilities = model(x, training=False)
    loss = keras.losses.SparseCategoricalCrossentropy()(y, probabilities)
    accuracy = np.mean(np.argmax(np.asarray(probabilities), axis=1) == y)
    return float(loss), float(accuracy)


def save_uncompiled(model: keras.Model, hidden: tuple[int, ...], path: Path) -> None:
    """Save architecture and weights only: no optimizer state, no compile settings.

    A compiled copy with an unbuilt optimizer would make ``load_model(compile=True)`` warn about
    mismatched optimizer variables; the loss to use is in data/README.md and trajectory.json.
    """
    copy = build_mlp(hidden, model.name)
    copy.set_weights(model.get_weights())
    copy.save(path)


def make_digits(out: Path) -> tuple[np.ndarray, np.ndarray]:
    data = load_data("digits")
    np.savez_compressed(out / "digits.npz", x=data.x, y=data.y)
    return data.x, data.y


def make_digits_mlp(out: Path, x: np.ndarray, y: np.ndarray) -> dict:
    keras.utils.set_random_seed(SEED)
    model = build_mlp(MLP_HIDDEN, "digits_mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(MLP_LEARNING_RATE), loss=LOSS, metrics=["accuracy"]
    )
    model.fit(x, y, batch_size=MLP_BATCH_SIZE, epochs=MLP_EPOCHS, shuffle=True, verbose=0)
    loss, accuracy = full_batch_metrics(model, x, y)
    save_uncompiled(model, MLP_HIDDEN, out / "digits_mlp.keras")
    return {"loss": loss, "accuracy": accuracy, "parameters": model.count_params()}


def make_gd_trajectory(out: Path, x: np.ndarray, y: np.ndarray) -> dict:
    """Full-batch gradient descent (SGD without momentum, one batch = all of x)."""
    directory = out / "gd_trajectory"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir()

    keras.utils.set_random_seed(SEED)
    model = build_mlp(GD_HIDDEN, "digits_gd_mlp")
    optimizer = keras.optimizers.SGD(GD_LEARNING_RATE, momentum=0.0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    x_all, y_all = tf.constant(x), tf.constant(y)

    @tf.function
    def gradient_step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y_all, model(x_all, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss

    train_loss = []
    checkpoints = []
    for step in range(GD_STEPS + 1):
        if step % GD_CHECKPOINT_EVERY == 0:
            file_name = f"step_{step:04d}.keras"
            save_uncompiled(model, GD_HIDDEN, directory / file_name)
            loss, accuracy = full_batch_metrics(model, x, y)
            checkpoints.append(
                {"step": step, "file": file_name, "loss": loss, "accuracy": accuracy}
            )
        if step < GD_STEPS:
            train_loss.append(float(gradient_step()))
        else:
            train_loss.append(full_batch_metrics(model, x, y)[0])

    for checkpoint in checkpoints:
        saved = keras.models.load_model(directory / checkpoint["file"], compile=False)
        checkpoint["sharpness"] = top_hessian_eigenvalue(saved.get_weights(), x, y)

    notes = {
        "description": (
            "Full-batch gradient descent on the digits data: SGD without momentum, the whole "
            "data set as one batch, constant learning rate. Made by data/make_examples.py."
        ),
        "architecture": "MLP 64-" + "-".join(map(str, GD_HIDDEN)) + "-10, ReLU, softmax output",
        "parameters": model.count_params(),
        "optimizer": "SGD",
        "momentum": 0.0,
        "learning_rate": GD_LEARNING_RATE,
        "two_over_learning_rate": 2.0 / GD_LEARNING_RATE,
        "loss": LOSS,
        "batch_size": len(x),
        "data": "data/digits.npz",
        "subset": None,
        "num_examples": len(x),
        "seed": SEED,
        "num_steps": GD_STEPS,
        "checkpoint_every": GD_CHECKPOINT_EVERY,
        "train_loss": train_loss,
        "checkpoints": checkpoints,
        "notes": (
            "train_loss[t] is the full-batch loss at step t (before the t-th update). "
            "sharpness is the top eigenvalue of the Hessian of the mean full-batch loss "
            "(exact cross-entropy, float64), computed by make_examples.py. The data path is "
            "relative to the repository root; subset null means all examples of that file."
        ),
    }
    (directory / "trajectory.json").write_text(json.dumps(notes, indent=2) + "\n")
    return notes


def top_hessian_eigenvalue(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Largest Hessian eigenvalue of the mean cross-entropy of a ReLU MLP, in float64."""
    shapes = [w.shape for w in weights]
    sizes = [int(np.prod(shape)) for shape in shapes]
    theta = tf.constant(np.concatenate([w.ravel() for w in weights]).astype(np.float64))
    inputs = tf.constant(x, tf.float64)
    labels = tf.constant(y, tf.int64)

    def loss_of(flat: tf.Tensor) -> tf.Tensor:
        parts = tf.split(flat, sizes)
        params = [tf.reshape(part, shape) for part, shape in zip(parts, shapes, strict=True)]
        hidden = inputs
        for kernel, bias in zip(params[0:-2:2], params[1:-2:2], strict=True):
            hidden = tf.nn.relu(hidden @ kernel + bias)
        logits = hidden @ params[-2] + params[-1]
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        )

    @tf.function(input_signature=[tf.TensorSpec([sum(sizes)], tf.float64)])
    def hessian_vector_product(vector: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as outer:
            outer.watch(theta)
            with tf.GradientTape() as inner:
                inner.watch(theta)
                loss = loss_of(theta)
            gradient = inner.gradient(loss, theta)
            directional = tf.reduce_sum(gradient * vector)
        return outer.gradient(directional, theta)

    operator = scipy.sparse.linalg.LinearOperator(
        (sum(sizes), sum(sizes)),
        dtype=np.float64,
        matvec=lambda v: hessian_vector_product(tf.constant(np.ravel(v))).numpy(),
    )
    start = np.random.default_rng(SEED).standard_normal(sum(sizes))
    eigenvalues = scipy.sparse.linalg.eigsh(
        operator, k=1, which="LA", tol=1e-8, v0=start, return_eigenvectors=False
    )
    return float(eigenvalues[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="output directory (default: the data/ directory of this script)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tf.config.experimental.enable_op_determinism()
    start = time.perf_counter()

    x, y = make_digits(args.out)
    print(f"digits.npz: x {x.shape} {x.dtype} in [{x.min()}, {x.max()}], y {y.shape} {y.dtype}")

    mlp = make_digits_mlp(args.out, x, y)
    print(
        f"digits_mlp.keras: {mlp['parameters']} parameters, full-batch train loss "
        f"{mlp['loss']:.4f}, train accuracy {mlp['accuracy']:.4f}"
    )

    notes = make_gd_trajectory(args.out, x, y)
    print(
        f"gd_trajectory/: {notes['parameters']} parameters, lr {notes['learning_rate']}, "
        f"2/lr = {notes['two_over_learning_rate']:g}"
    )
    print("  step    loss  accuracy  sharpness")
    for checkpoint in notes["checkpoints"]:
        print(
            f"  {checkpoint['step']:4d}  {checkpoint['loss']:.4f}  {checkpoint['accuracy']:.4f}"
            f"  {checkpoint['sharpness']:9.4f}"
        )
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
