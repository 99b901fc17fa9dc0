"""A probabilistic loss given logits is said, and a compiled ``from_logits`` is recorded.

The review's case: the string ``"sparse_categorical_crossentropy"`` (probabilities) on a
model that ends without a softmax gave a λ1 thousands of times too large with no warning,
and ``results.json`` recorded ``"compiled_loss": "sparse_categorical_crossentropy"`` for a
model compiled with ``SparseCategoricalCrossentropy(from_logits=True)``.
"""

from __future__ import annotations

import json
import warnings

import keras
import numpy as np
import pytest

from spectra import HessianOperator
from spectra.cli import main
from spectra.operators import data_checks as D


def _data(n=20, classes=3):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, classes, n)


def _logits_model(activation=None, units=3):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation=activation)])


def _warnings_of(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


LOGITS_SPARSE = (
    "the loss sparse_categorical_crossentropy takes probabilities (from_logits=False), but "
    "the model's output has negative values (the smallest {smallest}) on the first 20 "
    "examples: if the model outputs logits, pass "
    "keras.losses.SparseCategoricalCrossentropy(from_logits=True) (or end the model with a "
    "softmax); as it is, the curvature is that of clipped, renormalized logits."
)


def test_a_probabilistic_loss_on_logits_warns_once_in_one_line():
    x, y = _data()
    model = _logits_model()
    smallest = float(np.min(model(x)))
    found = _warnings_of(
        lambda: HessianOperator.from_keras(model, "sparse_categorical_crossentropy", (x, y))
    )
    assert found == [LOGITS_SPARSE.format(smallest=f"{smallest:.3g}")]
    assert "\n" not in found[0]


@pytest.mark.parametrize(
    ("activation", "loss", "units", "labels", "warned"),
    [
        (None, keras.losses.SparseCategoricalCrossentropy(from_logits=True), 3, "sparse", None),
        ("softmax", "sparse_categorical_crossentropy", 3, "sparse", None),
        ("softmax", "categorical_crossentropy", 3, "onehot", None),
        ("sigmoid", "binary_crossentropy", 1, "binary", None),
        (None, "mse", 3, "onehot", None),
        # Positive scores that are not a distribution: rows do not sum to 1.
        ("relu", "categorical_crossentropy", 3, "onehot", "rows summing to 1.8, not 1"),
        (None, "binary_crossentropy", 1, "binary", "BinaryCrossentropy(from_logits=True)"),
        (None, keras.losses.CategoricalCrossentropy(), 3, "onehot", "negative values"),
    ],
)
def test_only_outputs_that_are_not_probabilities_warn(activation, loss, units, labels, warned):
    x, y = _data()
    if activation == "relu":  # scores in [0, 1] whose rows sum to 1.8
        model = _logits_model("relu", units)
        model.layers[-1].kernel.assign(np.zeros((4, units), np.float32))
        model.layers[-1].bias.assign(np.full(units, 0.6, np.float32))
    else:
        model = _logits_model(activation, units)
    target = {
        "sparse": y,
        "onehot": np.eye(3, dtype=np.float32)[y],
        "binary": (y[:, None] > 0).astype(np.float32),
    }[labels]
    found = _warnings_of(lambda: HessianOperator.from_keras(model, loss, (x, target)))
    if warned is None:
        assert found == []
    else:
        assert len(found) == 1 and warned in found[0] and "from_logits=True" in found[0]


def test_not_probabilities_per_output_of_a_dict_model():
    inputs = keras.Input((4,))
    model = keras.Model(
        inputs,
        {
            "probs": keras.layers.Dense(3, activation="softmax", name="probs")(inputs),
            "scores": keras.layers.Dense(3, name="scores")(inputs),
        },
    )
    x, _ = _data()
    with pytest.warns(UserWarning, match=r"the model's output 'scores' has negative values"):
        D.warn_if_not_probabilities(model, "sparse_categorical_crossentropy", x)
    found = _warnings_of(
        lambda: D.warn_if_not_probabilities(
            model, {"probs": "sparse_categorical_crossentropy", "scores": "mse"}, x
        )
    )
    assert found == []


def _analyze(tmp_path, model, loss_option):
    x, y = _data()
    model.save(tmp_path / "model.keras")
    np.savez(tmp_path / "data.npz", x=x, y=y)
    arguments = [
        "analyze",
        str(tmp_path / "model.keras"),
        "--data",
        str(tmp_path / "data.npz"),
        "--out",
        str(tmp_path / "out"),
        "--top-k",
        "1",
        "--no-progress",
        "--quiet",
        *loss_option,
    ]
    try:
        return main(arguments)
    except SystemExit as exit_info:
        return int(exit_info.code)


def test_the_command_line_warns_in_one_line(tmp_path, capsys):
    status = _analyze(tmp_path, _logits_model(), ["--loss", "sparse_categorical_crossentropy"])
    err = capsys.readouterr().err
    assert status == 0, err
    lines = [line for line in err.splitlines() if "from_logits" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "spectra: warning: the loss sparse_categorical_crossentropy takes probabilities"
    )


def test_results_record_the_compiled_from_logits(tmp_path, capsys):
    model = _logits_model()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    status = _analyze(tmp_path, model, [])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "from_logits" not in err  # logits with from_logits=True: nothing to say
    recorded = json.loads((tmp_path / "out" / "results.json").read_text())["model"]
    assert recorded["compiled_loss"] == "sparse_categorical_crossentropy(from_logits=True)"
    config = recorded["compiled_loss_config"]
    assert config["class_name"] == "SparseCategoricalCrossentropy"
    assert config["config"]["from_logits"] is True
