"""Checkpoints the command line opens beyond plain ``.keras`` files: a subclassed model's
``.keras`` file with ``--custom-objects``, and a compiled, trained model's ``.weights.h5``
(optimizer state included) with ``--builder``. Each eigenvalue is checked against the
dense Hessian of the same model and data (float64, ``numpy.linalg.eigh``)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from spectra.cli import main

MODULE = textwrap.dedent(
    """
    import keras

    @keras.saving.register_keras_serializable(package="spectra_test_formats")
    class SubNet(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(4, activation="tanh")
            self.out = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.out(self.hidden(x))

    def build():
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4, activation="tanh"),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
    """
)
REGISTERED = "spectra_test_formats>SubNet"
LOSS = "sparse_categorical_crossentropy"


def _status(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_info:
        return int(exit_info.code)


def _dense_top(model, x, y) -> float:
    """Largest eigenvalue of the explicit float64 Hessian of the mean cross-entropy."""
    import keras
    import tensorflow as tf

    variables = [tf.Variable(tf.cast(v, tf.float64)) for v in model.trainable_variables]
    sizes = [int(np.prod(v.shape)) for v in variables]

    def loss_of(theta):
        parts = tf.split(theta, sizes)
        w1, b1, w2, b2 = (tf.reshape(p, v.shape) for p, v in zip(parts, variables, strict=True))
        probabilities = tf.nn.softmax(tf.tanh(x @ w1 + b1) @ w2 + b2)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, probabilities))

    theta = tf.concat([tf.reshape(v, [-1]) for v in variables], 0)
    with tf.GradientTape() as outer:
        outer.watch(theta)
        with tf.GradientTape() as inner:
            inner.watch(theta)
            value = loss_of(theta)
        grad = inner.gradient(value, theta)
    hessian = outer.jacobian(grad, theta).numpy()
    return float(np.linalg.eigvalsh(hessian)[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The module file, the data, a subclassed model's .keras file and a compiled, trained
    Sequential model's .weights.h5, with the dense top eigenvalue of each."""
    import keras

    tmp = tmp_path_factory.mktemp("formats")
    module_file = tmp / "mymodels.py"
    module_file.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("_spectra_test_formats_save", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    np.savez(tmp / "data.npz", x=x, y=y)

    keras.utils.set_random_seed(1)
    subnet = module.SubNet()
    subnet(x[:2])
    subnet.save(tmp / "sub.keras")
    keras.saving.get_custom_objects().pop(REGISTERED, None)

    keras.utils.set_random_seed(2)
    trained = module.build()
    trained.compile(optimizer=keras.optimizers.Adam(0.05), loss=LOSS)
    trained.fit(x, y, epochs=1, batch_size=40, verbose=0)
    trained.save_weights(tmp / "trained.weights.h5")
    x64, y64 = x.astype(np.float64), y
    return {
        "dir": tmp,
        "module": module_file,
        "data": str(tmp / "data.npz"),
        "sub_top": _dense_top(subnet, x64, y64),
        "trained_top": _dense_top(trained, x64, y64),
    }


@pytest.fixture
def unregistered(files):
    """SubNet unknown to Keras (as in a fresh process), and the module not yet imported."""
    import keras

    registry = keras.saving.get_custom_objects()
    saved = registry.pop(REGISTERED, None)
    cached = {k: m for k, m in sys.modules.items() if k.startswith("_spectra_builder_")}
    for key in cached:
        del sys.modules[key]
    yield
    sys.modules.update(cached)
    if saved is not None:
        registry.setdefault(REGISTERED, saved)


def _analyze(files, out: Path, model: str, *extra: str) -> int:
    return _status(
        [
            "analyze",
            model,
            "--data",
            files["data"],
            "--out",
            str(out),
            "--top-k",
            "1",
            "--no-progress",
            "--quiet",
            *extra,
        ]
    )


def test_subclassed_keras_with_custom_objects(files, unregistered, tmp_path):
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        str(files["module"]),
    )
    assert status == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    top = results["eigenvalues"]["eigenvalues"][0]
    # float32 products: ~1e-6 relative.
    assert top == pytest.approx(files["sub_top"], rel=2e-5)


def test_subclassed_keras_in_float64(files, unregistered, tmp_path):
    """The float64 copy of a subclassed model whose layers are created in ``__init__``
    without a dtype: rebuilt under a float64 policy, it matches the dense Hessian."""
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        str(files["module"]),
        "--float64",
    )
    assert status == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(files["sub_top"], rel=1e-9)


def test_subclassed_keras_without_custom_objects(files, unregistered, tmp_path, capsys):
    status = _analyze(files, tmp_path / "out", str(files["dir"] / "sub.keras"), "--loss", LOSS)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("spectra: error: ") and err.count("\n") == 1, err
    assert "'SubNet'" in err and "--custom-objects" in err


def test_custom_objects_errors(files, tmp_path, capsys):
    missing = str(files["dir"] / "nowhere.py")
    status = _analyze(
        files,
        tmp_path / "a",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        missing,
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "nowhere.py" in err, err
    status = _analyze(
        files,
        tmp_path / "b",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        f"{files['module']}:nothing",
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "has no 'nothing'" in err, err


def test_trained_weights_with_builder(files, tmp_path, capsys):
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "trained.weights.h5"),
        "--loss",
        LOSS,
        "--builder",
        f"{files['module']}:build",
        "--float64",
    )
    assert status == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(files["trained_top"], rel=1e-6)
    # Adam after one step: iterations, learning rate and two moments for each of 4 weights.
    assert results["model"]["ignored_optimizer_weights"] == 10


def test_mismatched_weights_still_refused(files, tmp_path, capsys):
    (tmp_path / "small.py").write_text(
        "import keras\n"
        "def build():\n"
        "    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])\n"
    )
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "trained.weights.h5"),
        "--loss",
        LOSS,
        "--builder",
        f"{tmp_path / 'small.py'}:build",
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "holds 4 weight arrays of the model" in err and "only 2 weights" in err, err


# --------------------------------------------------------------------------- several outputs


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """A functional model with outputs 'cls' (softmax, cross-entropy) and 'reg' (linear,
    MSE) saved compiled with both losses, its data, and the top eigenvalue of the explicit
    float64 Hessian of mean CE + mean MSE."""
    import keras
    import tensorflow as tf

    tmp = tmp_path_factory.mktemp("two_outputs")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(hidden)
    reg = keras.layers.Dense(1, name="reg")(hidden)
    model = keras.Model(inputs, [cls, reg])
    model.compile(optimizer="sgd", loss={"cls": LOSS, "reg": "mse"})
    model.save(tmp / "two.keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 5)).astype(np.float32)
    y_cls = rng.integers(0, 3, 30)
    y_reg = rng.normal(size=(30, 1)).astype(np.float32)
    np.savez(tmp / "named.npz", x=x, y_cls=y_cls, y_reg=y_reg)
    np.savez(tmp / "ordered.npz", x=x, y0=y_cls, y1=y_reg)
    np.savez(tmp / "missing.npz", x=x, y_cls=y_cls)
    np.savez(tmp / "extra.npz", x=x, y_cls=y_cls, y_reg=y_reg, y_aux=y_reg)
    np.savez(tmp / "single.npz", x=x, y=y_cls)

    shapes = [tuple(v.shape) for v in model.trainable_variables]
    sizes = [int(np.prod(s)) for s in shapes]
    x64 = x.astype(np.float64)

    def loss_of(theta):
        w1, b1, wc, bc, wr, br = (
            tf.reshape(p, s) for p, s in zip(tf.split(theta, sizes), shapes, strict=True)
        )
        h = tf.tanh(x64 @ w1 + b1)
        ce = keras.losses.sparse_categorical_crossentropy(y_cls, tf.nn.softmax(h @ wc + bc))
        mse = tf.reduce_mean((h @ wr + br - y_reg.astype(np.float64)) ** 2, axis=-1)
        return tf.reduce_mean(ce) + tf.reduce_mean(mse)

    names = [v.path for v in model.trainable_variables]
    assert [n.split("/")[0] for n in names] == ["hidden", "hidden", "cls", "cls", "reg", "reg"]
    theta = tf.constant(
        np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables]), tf.float64
    )
    with tf.GradientTape() as outer:
        outer.watch(theta)
        with tf.GradientTape() as inner:
            inner.watch(theta)
            value = loss_of(theta)
        grad = inner.gradient(value, theta)
    hessian = outer.jacobian(grad, theta).numpy()
    return {"dir": tmp, "top": float(np.linalg.eigvalsh(hessian)[-1])}


def _analyze_two(two_outputs, out: Path, data: str, *extra: str) -> int:
    directory = two_outputs["dir"]
    return _status(
        [
            "analyze",
            str(directory / "two.keras"),
            "--data",
            str(directory / data),
            "--out",
            str(out),
            "--top-k",
            "1",
            "--float64",
            "--no-progress",
            "--quiet",
            *extra,
        ]
    )


@pytest.mark.parametrize("data", ["named.npz", "ordered.npz"])
def test_two_output_labels(two_outputs, data, tmp_path, capsys):
    status = _analyze_two(two_outputs, tmp_path / "out", data)
    assert status == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(two_outputs["top"], rel=1e-7)
    shapes = results["data"]["y_shape"]
    assert shapes == ({"cls": [30], "reg": [30, 1]} if data == "named.npz" else [[30], [30, 1]])
    # Outputs in a list: positions follow the list; results.json says which array went where.
    labels = {"cls": "y_cls", "reg": "y_reg"} if data == "named.npz" else {"cls": "y0", "reg": "y1"}
    assert results["data"]["labels"] == labels


@pytest.mark.parametrize(
    "data, message",
    [
        ("missing.npz", "do not match the model's outputs (cls, reg): no labels for reg."),
        ("extra.npz", "do not match the model's outputs (cls, reg): labels y_aux match no output"),
        ("single.npz", "the model has 2 outputs (cls, reg) but the data has one label array y"),
    ],
)
def test_two_output_labels_that_do_not_match(two_outputs, data, message, tmp_path, capsys):
    status = _analyze_two(two_outputs, tmp_path / "out", data)
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("spectra: error: ") and err.count("\n") == 1, err
    assert message in err and "y_cls, y_reg" in err, err


def test_one_loss_for_two_outputs_checks_each(two_outputs, tmp_path, capsys):
    status = _analyze_two(two_outputs, tmp_path / "out", "named.npz", "--loss", "mse")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "labels of the model's output 'cls': the loss mse needs y_cls shaped like" in err
