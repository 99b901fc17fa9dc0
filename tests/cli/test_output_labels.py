"""Labels of a model with dict outputs go to the outputs by name, never by position.

The review's case: a functional model with dict outputs ``{"zeta", "alpha"}``, compiled
with MSE and loss weights 1 (zeta) and 0.01 (alpha), both outputs of the same shape. Keras
takes a dict's outputs in sorted key order (alpha, zeta), not the order the dict was
written in, so labels ``y0, y1`` written "in this order" (zeta, alpha) went to the wrong
outputs and gave another eigenvalue without a word. Now positional labels are refused
for such a model (through the API and the command line), named labels give the top
eigenvalue of the Hessian computed here by central finite differences of the float64
gradient of a hand-written copy of the model, and ``results.json`` records which array
went to which output.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import central_difference_hessian

from spectra import HessianOperator, eigenvalues
from spectra.cli import main

POSITIONAL = (
    "the model's outputs are a dict (alpha, zeta), so labels given by position (a list, or "
    "y0, y1, ... in a .npz file) could go to the wrong output: give them by output name, as "
    "a dict {'alpha': ..., 'zeta': ...} (in a .npz file y_alpha, y_zeta)."
)


@pytest.fixture(scope="module")
def zeta_alpha(tmp_path_factory):
    """The model (saved compiled), its data as .npz files by name and by position, and
    the top eigenvalue of the Hessian of mean MSE(zeta) + 0.01 · mean MSE(alpha)."""
    tmp = tmp_path_factory.mktemp("zeta_alpha")
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    zeta = keras.layers.Dense(2, name="zeta")(hidden)
    alpha = keras.layers.Dense(2, name="alpha")(hidden)
    model = keras.Model(inputs, {"zeta": zeta, "alpha": alpha})
    model.compile(optimizer="sgd", loss="mse", loss_weights={"zeta": 1.0, "alpha": 0.01})
    model.save(tmp / "model.keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype(np.float32)
    y_zeta = (3 * rng.normal(size=(24, 2))).astype(np.float32)
    y_alpha = (0.1 * rng.normal(size=(24, 2))).astype(np.float32)
    np.savez(tmp / "named.npz", x=x, y_zeta=y_zeta, y_alpha=y_alpha)
    np.savez(tmp / "positional.npz", x=x, y0=y_zeta, y1=y_alpha)

    variables = {v.path: v.numpy().astype(np.float64) for v in model.trainable_variables}
    order = [v.path for v in model.trainable_variables]
    shapes = [variables[p].shape for p in order]
    sizes = [int(np.prod(s)) for s in shapes]
    x64 = x.astype(np.float64)

    def gradient(theta: np.ndarray) -> np.ndarray:
        t = tf.constant(theta)
        with tf.GradientTape() as tape:
            tape.watch(t)
            parts = dict(zip(order, (tf.reshape(p, s) for p, s in zip(tf.split(t, sizes), shapes))))
            h = tf.tanh(x64 @ parts["hidden/kernel"] + parts["hidden/bias"])
            z = h @ parts["zeta/kernel"] + parts["zeta/bias"]
            a = h @ parts["alpha/kernel"] + parts["alpha/bias"]
            value = tf.reduce_mean((z - y_zeta) ** 2) + 0.01 * tf.reduce_mean((a - y_alpha) ** 2)
        return tape.gradient(value, t).numpy()

    theta = np.concatenate([variables[p].ravel() for p in order])
    top = float(np.linalg.eigvalsh(central_difference_hessian(gradient, theta))[-1])
    return {"dir": tmp, "model": model, "x": x, "y_zeta": y_zeta, "y_alpha": y_alpha, "top": top}


def test_the_api_takes_labels_by_name_and_refuses_positions(zeta_alpha):
    model, x = zeta_alpha["model"], zeta_alpha["x"]
    named = {"zeta": zeta_alpha["y_zeta"], "alpha": zeta_alpha["y_alpha"]}
    op = HessianOperator.from_keras(model, None, (x, named), dtype=np.float64)
    top = eigenvalues(op, k=1, tol=1e-10, seed=0).eigenvalues[0]
    # Finite differences with step 1e-5 in float64: errors of order 1e-9 relative.
    assert top == pytest.approx(zeta_alpha["top"], rel=1e-6)
    for positional in ([named["zeta"], named["alpha"]], (named["zeta"], named["alpha"])):
        with pytest.raises(ValueError) as raised:
            HessianOperator.from_keras(model, None, (x, positional), dtype=np.float64)
        assert str(raised.value) == POSITIONAL
    # Positional sample weights would be as ambiguous.
    weights = [np.ones(24, np.float32), np.ones(24, np.float32)]
    with pytest.raises(ValueError, match="sample_weight given by position"):
        HessianOperator.from_keras(model, None, (x, named, weights))


def _analyze(zeta_alpha, data: str, out) -> int:
    directory = zeta_alpha["dir"]
    arguments = [
        "analyze",
        str(directory / "model.keras"),
        "--data",
        str(directory / data),
        "--out",
        str(out),
        "--top-k",
        "1",
        "--tol",
        "1e-10",
        "--float64",
        "--no-progress",
        "--quiet",
    ]
    try:
        return main(arguments)
    except SystemExit as exit_info:
        return int(exit_info.code)


def test_the_command_line_takes_labels_by_name_and_records_them(zeta_alpha, tmp_path, capsys):
    status = _analyze(zeta_alpha, "named.npz", tmp_path / "out")
    assert status == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(zeta_alpha["top"], rel=1e-6)
    assert results["data"]["labels"] == {"alpha": "y_alpha", "zeta": "y_zeta"}
    assert list(results["data"]["labels"]) == ["alpha", "zeta"]  # Keras' order


def test_the_command_line_refuses_positional_labels_for_dict_outputs(zeta_alpha, tmp_path, capsys):
    status = _analyze(zeta_alpha, "positional.npz", tmp_path / "out")
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("spectra: error: ") and err.count("\n") == 1, err
    assert POSITIONAL in err, err
    assert not (tmp_path / "out" / "results.json").exists()
