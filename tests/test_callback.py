"""SharpnessCallback: what it records, where, and that it leaves training alone."""

import json
import os
import random
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import dense_hessian, flat_gradient
from _events import event_files, expected_scalars, read_scalars

from spectra.analysis.preconditioning import preconditioner_diagonal
from spectra.callback import SharpnessCallback
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.stochastic_trace import trace
from spectra.operators import HessianOperator

LOSS = "sparse_categorical_crossentropy"
NUM_EXAMPLES = 40
BATCH_SIZE = 8  # 5 optimizer steps per epoch


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(0)
    x = generator.normal(size=(NUM_EXAMPLES, 5)).astype(np.float32)
    y = generator.integers(0, 3, size=NUM_EXAMPLES)
    return x, y


def _model(seed: int = 0, dropout: bool = False, loss=LOSS) -> keras.Model:
    """A compiled 5-8-3 MLP (optionally with Dropout), initialized from ``seed``."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((5,)), keras.layers.Dense(8, activation="tanh")]
    if dropout:
        layers.append(keras.layers.Dropout(0.3))
    layers.append(keras.layers.Dense(3, activation="softmax"))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss)
    return model


class _LogRecorder(keras.callbacks.Callback):
    """Keeps a copy of every epoch's logs (placed after the callback under test)."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_logs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs or {}))


def _fit(model, data, callbacks, epochs=3, shuffle=False):
    """Train with batches of 8; shuffled arrays, or (faster in Keras) a fixed dataset."""
    if shuffle:
        return model.fit(
            *data,
            batch_size=BATCH_SIZE,
            epochs=epochs,
            shuffle=True,
            verbose=0,
            callbacks=callbacks,
        )
    batches = tf.data.Dataset.from_tensor_slices(data).batch(BATCH_SIZE)
    return model.fit(batches, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


# -- epoch mode ---------------------------------------------------------------------------
def test_epoch_mode_records_the_start_and_every_epoch(data):
    model = _model()
    callback = SharpnessCallback(data)
    history = _fit(model, data, [callback])
    assert [r["epoch"] for r in callback.history] == [0, 1, 2, 3]
    assert [r["step"] for r in callback.history] == [0, 5, 10, 15]
    assert callback.points == [0, 1, 2, 3]
    # Keras' per-epoch history holds the measurements after each epoch.
    assert history.history["sharpness"] == [r["eigenvalues"][0] for r in callback.history[1:]]
    assert "sharpness_2" not in history.history
    assert "hessian_trace" not in history.history
    record = callback.history[0]
    assert set(record) == {
        "step",
        "epoch",
        "loss",
        "eigenvalues",
        "residual_norms",
        "error_bounds",
        "converged",
        "trace",
        "trace_stderr",
        "num_parameters",
        "num_products",
        "num_data_passes",
        "wall_time",
        "seed",
        "warm_start",
        "eigenvector_overlap",
        "gradient_overlap",
        "failure_probability",
        "threshold",
        "threshold_matrix",
        "minibatch",
    }
    assert record["minibatch"] is None
    assert record["trace"] is None and record["trace_stderr"] is None
    assert record["num_products"] > 0 and record["wall_time"] > 0
    assert record["num_parameters"] == 5 * 8 + 8 + 8 * 3 + 3
    assert [r["seed"] for r in callback.history] == [0, 1, 2, 3]
    # Each eigensolve after the first starts from the previous eigenvector.
    assert [r["warm_start"] for r in callback.history] == [False, True, True, True]
    # SGD with momentum 0.9 and η = 0.1: (2 + 2β)/η, a threshold for H.
    assert record["threshold"] == pytest.approx(38.0, rel=1e-6)
    assert record["threshold_matrix"] == "hessian"
    # No previous point at the first measurement; overlaps in [0, 1] after it.
    assert record["eigenvector_overlap"] is None and record["gradient_overlap"] is None
    assert all(0 <= r["eigenvector_overlap"] <= 1 for r in callback.history[1:])


def test_per_batch_sharpness_matches_the_closed_form_of_the_same_batches(data, tmp_path):
    """A linear model under MSE: each mini-batch Hessian is (2/(b d)) X̃_BᵀX̃_B ⊗ I_d whatever
    the weights, so every measurement's per-batch λ₁ has a NumPy truth on the batches that
    ``draw_minibatches`` gives for that measurement's seed."""
    from spectra.analysis.minibatch import draw_minibatches

    x, _ = data
    targets = np.random.default_rng(1).normal(size=(NUM_EXAMPLES, 2)).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    log_file = tmp_path / "sharpness.json"
    callback = SharpnessCallback(
        (x, targets), seed=4, per_batch=3, per_batch_size=8, tol=1e-7, log_file=log_file
    )
    _fit(model, (x, targets), [callback], epochs=1)
    assert len(callback.history) == 2
    for index, record in enumerate(callback.history):
        minibatch = record["minibatch"]
        truth = []
        for rows in draw_minibatches(NUM_EXAMPLES, 8, 3, seed=4 + index):
            augmented = np.hstack([x[rows].astype(np.float64), np.ones((8, 1))])
            truth.append(2 / (8 * 2) * np.linalg.eigvalsh(augmented.T @ augmented)[-1])
        np.testing.assert_allclose(minibatch["sharpness"], truth, rtol=5e-6)
        assert minibatch["seed"] == 4 + index and minibatch["batch_size"] == 8
        assert minibatch["full_batch"] == record["eigenvalues"][0]
        assert minibatch["threshold"] == pytest.approx(2 / 0.05)
        assert minibatch["summary"]["fraction_above_threshold"] == 0.0
        np.testing.assert_allclose(minibatch["summary"]["q50"], np.median(truth), rtol=5e-6)
    stored = json.loads(log_file.read_text())
    assert stored["settings"]["per_batch"] == 3 and stored["settings"]["per_batch_size"] == 8
    assert (
        stored["history"][-1]["minibatch"]["sharpness"]
        == callback.history[-1]["minibatch"]["sharpness"]
    )


def test_every_two_epochs_skipped_epochs_have_no_key(data):
    model = _model()
    callback = SharpnessCallback(data, every=2, top_k=3)
    recorder = _LogRecorder()
    history = _fit(model, data, [callback, recorder], epochs=5)
    assert [r["epoch"] for r in callback.history] == [0, 2, 4]
    # History holds one value per measurement after an epoch, not per epoch.
    assert len(history.history["sharpness"]) == 2
    assert len(history.history["sharpness_3"]) == 2
    measured = [i + 1 for i, logs in enumerate(recorder.epoch_logs) if "sharpness" in logs]
    assert measured == [2, 4]
    for logs, record in zip([recorder.epoch_logs[1], recorder.epoch_logs[3]], callback.history[1:]):
        top = record["eigenvalues"]
        assert len(top) == 3 and top[0] >= top[1] >= top[2]
        assert [logs["sharpness"], logs["sharpness_2"], logs["sharpness_3"]] == top


def test_both_units_measure_at_the_start_and_at_multiples(data):
    """The same rule in both units: the start of each fit, then every multiple of every."""
    by_epoch = SharpnessCallback(data, every=2)
    by_step = SharpnessCallback(data, unit="step", every=10)
    _fit(_model(), data, [by_epoch], epochs=4)
    _fit(_model(), data, [by_step], epochs=4)
    assert by_epoch.points == [0, 2, 4]
    assert by_step.points == [0, 10, 20]
    # Same weights at the same points (both models start from seed 0, 5 steps per epoch).
    for a, b in zip(by_epoch.history, by_step.history):
        assert a["step"] == b["step"]
        assert a["eigenvalues"][0] == pytest.approx(b["eigenvalues"][0], rel=1e-4)


def test_epoch_mode_continues_with_initial_epoch(data):
    model = _model()
    callback = SharpnessCallback(data, every=2)
    _fit(model, data, [callback], epochs=2)
    batches = tf.data.Dataset.from_tensor_slices(data).batch(BATCH_SIZE)
    model.fit(batches, epochs=4, initial_epoch=2, shuffle=False, verbose=0, callbacks=[callback])
    # The start of the second fit (epoch 2) was measured already: not again.
    assert callback.points == [0, 2, 4]
    assert [r["step"] for r in callback.history] == [0, 10, 20]


def test_values_match_an_independent_computation_at_the_final_weights(data):
    model = _model()
    callback = SharpnessCallback(
        data, every=2, top_k=2, dtype=np.float64, tol=1e-10, trace=True, trace_products=30
    )
    _fit(model, data, [callback], epochs=4)
    final = callback.history[-1]
    assert final["epoch"] == 4
    operator = HessianOperator.from_keras(model, LOSS, data, dtype=np.float64)
    expected = eigenvalues(operator, k=2, tol=1e-10, seed=123)
    np.testing.assert_allclose(final["eigenvalues"], expected.eigenvalues, rtol=1e-6)
    # The same seed gives the same probes: the trace is reproduced to rounding.
    expected_trace = trace(operator, num_products=30, seed=final["seed"])
    assert final["trace"] == pytest.approx(expected_trace.estimate, rel=1e-9)
    assert final["trace_stderr"] == pytest.approx(expected_trace.stderr, rel=1e-6)
    assert final["loss"] == pytest.approx(operator.loss(), rel=1e-12)


def test_trace_keys_in_logs(data):
    model = _model()
    callback = SharpnessCallback(data, trace=True, trace_products=20)
    history = _fit(model, data, [callback], epochs=2)
    assert len(history.history["hessian_trace"]) == 2
    assert len(history.history["hessian_trace_stderr"]) == 2
    for record, value, stderr in zip(
        callback.history[1:],
        history.history["hessian_trace"],
        history.history["hessian_trace_stderr"],
    ):
        assert value == record["trace"] and stderr == record["trace_stderr"]
        assert stderr > 0


# -- step mode ----------------------------------------------------------------------------
def test_step_mode_measures_at_zero_and_every_k_steps(data):
    model = _model()
    callback = SharpnessCallback(data, unit="step", every=4)
    recorder = _LogRecorder()
    history = _fit(model, data, [callback, recorder], epochs=3)  # 15 steps
    assert callback.points == [0, 4, 8, 12]
    assert [r["epoch"] for r in callback.history] == [0, 0, 1, 2]
    # Step measurements are not per-epoch values: the epoch logs do not get them.
    assert "sharpness" not in history.history
    assert not any("sharpness" in logs for logs in recorder.epoch_logs)
    # A second fit continues counting the optimizer's steps; step 15 is measured at its start.
    _fit(model, data, [callback], epochs=1)
    assert callback.points == [0, 4, 8, 12, 15, 16, 20]


def test_step_mode_with_a_dataset(data):
    model = _model()
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(16)
    callback = SharpnessCallback(dataset, unit="step", every=5)
    _fit(model, data, [callback], epochs=2)
    assert [r["step"] for r in callback.history] == [0, 5, 10]
    array_operator = HessianOperator.from_keras(model, LOSS, data)
    expected = eigenvalues(array_operator, k=1, tol=1e-6).eigenvalues[0]
    assert callback.history[-1]["eigenvalues"][0] == pytest.approx(expected, rel=1e-4)


# -- log file -----------------------------------------------------------------------------
def test_log_file_holds_the_whole_history(data, tmp_path):
    path = tmp_path / "sharpness.json"
    model = _model()
    callback = SharpnessCallback(
        data, unit="step", every=5, trace=True, trace_products=10, log_file=path
    )
    _fit(model, data, [callback], epochs=2)
    content = json.loads(path.read_text())
    assert content["history"] == callback.history
    assert [r["step"] for r in content["history"]] == [0, 5, 10]
    assert content["settings"]["unit"] == "step"
    assert content["settings"]["every"] == 5
    assert content["settings"]["loss"] == LOSS
    assert os.listdir(tmp_path) == ["sharpness.json"]


def test_log_file_is_replaced_atomically(data, tmp_path, monkeypatch):
    path = tmp_path / "sharpness.json"
    model = _model()
    callback = SharpnessCallback(data, every=1, log_file=path)
    _fit(model, data, [callback], epochs=2)
    before = path.read_text()

    replaced = []
    real_replace = os.replace

    def recording_replace(source, target):
        replaced.append((os.fspath(source), os.fspath(target)))
        real_replace(source, target)

    monkeypatch.setattr("spectra.callback.os.replace", recording_replace)
    _fit(model, data, [callback], epochs=1)
    source, target = replaced[-1]
    assert target == os.fspath(path)
    assert os.path.dirname(source) == os.fspath(tmp_path) and not os.path.exists(source)
    after = path.read_text()
    assert len(json.loads(after)["history"]) == 4

    def failing_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr("spectra.callback.os.replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        _fit(model, data, [callback], epochs=1)
    # The previous file is intact and no temporary file is left behind.
    assert path.read_text() == after != before
    assert os.listdir(tmp_path) == ["sharpness.json"]


# -- training is not changed --------------------------------------------------------------
def _train_and_draw(data, with_callback: bool):
    model = _model(seed=7, dropout=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    callbacks = []
    if with_callback:
        callbacks = [
            SharpnessCallback(
                data, unit="step", every=3, top_k=2, trace=True, trace_products=8, dtype=np.float64
            )
        ]
    history = _fit(model, data, callbacks, epochs=3, shuffle=True)
    weights = [w.numpy() for w in model.weights]
    optimizer_variables = [v.numpy() for v in model.optimizer.variables]
    # Draws after training show whether the global random streams moved.
    draws = (tf.random.uniform((4,)).numpy(), np.random.rand(4), random.random())  # noqa: NPY002
    return weights, optimizer_variables, history.history["loss"], draws


def test_training_is_unchanged(data):
    weights, opt_vars, losses, draws = _train_and_draw(data, with_callback=False)
    weights_cb, opt_vars_cb, losses_cb, draws_cb = _train_and_draw(data, with_callback=True)
    assert len(weights) == len(weights_cb) and len(opt_vars) == len(opt_vars_cb)
    for a, b in zip(weights, weights_cb):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(opt_vars, opt_vars_cb):
        np.testing.assert_array_equal(a, b)
    assert losses == losses_cb
    for a, b in zip(draws, draws_cb):
        np.testing.assert_array_equal(a, b)


def test_measurement_leaves_global_random_states_alone(data):
    model = _model(dropout=True)
    callback = SharpnessCallback(data, unit="step", dtype=np.float64)
    callback.set_model(model)
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    callback.on_train_begin()  # builds the float64 clone, which draws layer seeds
    callback.on_epoch_begin(0)
    assert len(callback.history) == 1
    assert random.getstate() == python_state
    after = np.random.get_state()  # noqa: NPY002
    np.testing.assert_array_equal(after[1], numpy_state[1])
    assert after[2:] == numpy_state[2:]


# -- loss resolution, arguments, output ---------------------------------------------------
def test_compiled_loss_is_used_when_no_loss_is_given(data):
    by_name = _model()
    callback = SharpnessCallback(data)
    _fit(by_name, data, [callback], epochs=1)
    explicit = eigenvalues(HessianOperator.from_keras(by_name, LOSS, data), tol=1e-6)
    assert callback.history[-1]["eigenvalues"][0] == pytest.approx(
        explicit.eigenvalues[0], rel=1e-4
    )

    by_object = _model(loss=keras.losses.SparseCategoricalCrossentropy())
    callback = SharpnessCallback(data)
    _fit(by_object, data, [callback], epochs=1)
    assert callback.history[-1]["eigenvalues"][0] == pytest.approx(
        explicit.eigenvalues[0], rel=1e-4
    )


@pytest.mark.parametrize("problem", ["unknown loss", "log_file under a file", "wrong data"])
def test_problems_are_found_before_the_first_training_step(data, tmp_path, problem):
    model = _model()
    kwargs = {}
    if problem == "unknown loss":
        kwargs["loss"] = "not_a_loss"
        message = "not_a_loss"
    elif problem == "log_file under a file":
        (tmp_path / "file").write_text("")
        kwargs["log_file"] = tmp_path / "file" / "sharpness.json"
        message = "log_file"
    else:
        data = (np.zeros((NUM_EXAMPLES, 7), np.float32), data[1])
        message = "cannot measure the Hessian"
    callback = SharpnessCallback(data, **kwargs)
    before = [w.numpy() for w in model.weights]
    with pytest.raises((ValueError, OSError), match=message):
        _fit(model, (np.zeros((NUM_EXAMPLES, 5), np.float32), data[1]), [callback], epochs=1)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert callback.history == []
    for a, b in zip(before, model.weights):
        np.testing.assert_array_equal(a, b.numpy())


def test_error_when_no_loss_is_known(data):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    callback = SharpnessCallback(data)
    callback.set_model(model)
    with pytest.raises(ValueError, match="needs a loss"):
        callback.on_train_begin()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"unit": "batch"}, ValueError, "^unit must be one of 'epoch', 'step', got 'batch'$"),
        ({"every": 0}, ValueError, "^every must be an integer >= 1, got 0$"),
        ({"every": 1.5}, TypeError, r"^every must be an integer, got 1.5 \(float\)$"),
        ({"top_k": 0}, ValueError, "^top_k must be an integer >= 1, got 0$"),
        ({"top_k": True}, TypeError, r"^top_k must be an integer, got True \(bool\)$"),
        ({"tol": -1.0}, ValueError, "^tol must be a positive finite number, got -1.0$"),
        ({"seed": -1}, ValueError, r"^seed must be a non-negative integer below 2\*\*62, got -1$"),
        ({"seed": None}, TypeError, "^seed must be a non-negative integer, got None"),
        (
            {"trace": True, "trace_products": 1},
            ValueError,
            "^trace_products must be an integer >= 2, got 1$",
        ),
    ],
)
def test_invalid_arguments(data, kwargs, error, message):
    with pytest.raises(error, match=message):
        SharpnessCallback(data, **kwargs)


def test_data_is_required():
    with pytest.raises(ValueError, match="data is required"):
        SharpnessCallback(None)


def test_verbose_prints_one_line_per_measurement(data, capsys):
    model = _model()
    callback = SharpnessCallback(data, unit="step", every=5, verbose=1, trace=True, top_k=2)
    _fit(model, data, [callback], epochs=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 2
    assert lines[0].startswith("SharpnessCallback step 0 (epoch 0): λ₁ = ")
    assert "trace = " in lines[0] and "products" in lines[1]


# -- preconditioned sharpness and overlaps against dense truth ----------------------------
def _float64_adam_model(learning_rate: float = 0.05) -> keras.Model:
    """A compiled float64 5-6-3 MLP with logits, trained by Adam."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(6, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64"),
    )
    return model


class _DenseTruth(keras.callbacks.Callback):
    """At the steps given, the dense H, D = P^{-1/2}, and the gradient at the live weights
    (placed after the callback under test, so it sees the same weights)."""

    def __init__(self, data, steps) -> None:
        super().__init__()
        self.x, self.y = (np.asarray(a) for a in data)
        self.steps = set(steps)
        self.found: dict[int, dict[str, np.ndarray]] = {}

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step not in self.steps:
            return
        variables = self.model.trainable_variables

        def loss():
            logits = self.model(self.x, training=False)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(self.y, logits))

        diagonal = preconditioner_diagonal(self.model.optimizer, variables)
        self.found[step] = {
            "H": dense_hessian(loss, variables),
            "D": 1.0 / np.sqrt(diagonal),
            "g": flat_gradient(loss, variables),
        }


def _top(matrix: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    values, vectors = np.linalg.eigh(matrix)
    return values[::-1][:k], vectors[:, ::-1][:, :k]


def test_preconditioned_sharpness_and_overlaps_match_dense_truth(data):
    """λ(D H D), ⟨v_t, v_{t−1}⟩² and ‖Vᵀg‖²/‖g‖² against eigh of dense matrices (float64:
    Lanczos to tol 1e-10 gives the eigenvalues to ~1e-10 and the eigenvectors to about
    residual/gap, far below the 1e-6 asked)."""
    x, y = data[0].astype(np.float64), data[1]
    model = _float64_adam_model()
    measured_steps = [2, 4, 6]
    raw = SharpnessCallback((x, y), unit="step", every=2, top_k=2, tol=1e-10, gradient_overlap=True)
    pre = SharpnessCallback(
        (x, y), unit="step", every=2, top_k=2, tol=1e-10, preconditioned=True, gradient_overlap=True
    )
    truth = _DenseTruth((x, y), measured_steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(NUM_EXAMPLES)  # full batch
    history = model.fit(dataset, epochs=6, shuffle=False, verbose=0, callbacks=[raw, pre, truth])
    # Step 0 has no optimizer state: the preconditioned callback starts at step 2.
    assert raw.points == [0, *measured_steps] and pre.points == measured_steps
    previous = {"raw": None, "pre": None}
    for step in measured_steps:
        dense = truth.found[step]
        H, D, g = dense["H"], dense["D"], dense["g"]
        for name, callback, matrix, gradient in (
            ("raw", raw, H, g),
            ("pre", pre, D[:, None] * H * D[None, :], D * g),
        ):
            record = next(r for r in callback.history if r["step"] == step)
            values, vectors = _top(matrix, 2)
            np.testing.assert_allclose(record["eigenvalues"], values, rtol=1e-8)
            expected = np.sum((vectors.T @ gradient) ** 2) / (gradient @ gradient)
            assert record["gradient_overlap"] == pytest.approx(expected, abs=1e-6)
            if previous[name] is not None:
                old = previous[name]
                overlap = np.mean(np.sum((old.T @ vectors) ** 2, axis=0))
                assert record["eigenvector_overlap"] == pytest.approx(overlap, abs=1e-6)
            previous[name] = vectors
    record = pre.history[0]
    assert record["threshold"] == pytest.approx(38 / 0.05) and record["threshold_matrix"] == (
        "preconditioned"
    )
    assert raw.history[0]["eigenvector_overlap"] is None
    assert pre.history[0]["eigenvector_overlap"] is None
    # Epoch logs are per-epoch only in epoch mode; step mode leaves them alone.
    assert "preconditioned_sharpness" not in history.history


def test_preconditioned_logs_and_training_left_alone(data):
    """A preconditioned callback in epoch mode logs under its own names and changes
    neither the weights nor the optimizer's state."""
    x, y = data[0].astype(np.float64), data[1]

    def train(callbacks):
        model = _float64_adam_model()
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)
        history = model.fit(batches, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return model, history

    plain, _ = train([])
    pre = SharpnessCallback((x, y), preconditioned=True, gradient_overlap=True, top_k=2)
    raw = SharpnessCallback((x, y))
    model, history = train([pre, raw])
    for a, b in zip(plain.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(plain.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert pre.points == [1, 2] and raw.points == [0, 1, 2]
    assert history.history["preconditioned_sharpness"] == [r["eigenvalues"][0] for r in pre.history]
    assert history.history["preconditioned_sharpness_2"] == [
        r["eigenvalues"][1] for r in pre.history
    ]
    assert history.history["preconditioned_gradient_overlap"] == [
        r["gradient_overlap"] for r in pre.history
    ]
    assert history.history["sharpness"] == [r["eigenvalues"][0] for r in raw.history[1:]]


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (lambda: keras.optimizers.SGD(0.1), "SGD, whose P = I"),
        (lambda: keras.optimizers.Lion(0.1), "the model's optimizer is Lion."),
    ],
)
def test_preconditioned_needs_a_diagonal_preconditioner(data, optimizer, message):
    model = _model()
    model.compile(optimizer=optimizer(), loss=LOSS)
    callback = SharpnessCallback(data, preconditioned=True)
    with pytest.raises(ValueError, match=message):
        _fit(model, data, [callback], epochs=1)
    assert int(model.optimizer.iterations.numpy()) == 0


# -- numpy 2 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "optimizer, options",
    [
        ("sgd", {"unit": "step", "every": 2, "top_k": 2, "trace": True, "gradient_overlap": True}),
        ("adam", {"preconditioned": True}),
    ],
)
def test_no_deprecated_array_conversion_of_keras_variables(data, tmp_path, optimizer, options):
    # numpy 2 warns when np.array(x)/np.asarray(x) meets a Keras variable, whose __array__
    # takes no copy keyword ("__array__ implementation doesn't accept a copy keyword");
    # keras.ops.convert_to_numpy(optimizer.iterations) did so once per measurement.
    model = _model()
    if optimizer == "adam":
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    callback = SharpnessCallback(data, log_file=tmp_path / "log.json", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _fit(model, data, [callback], epochs=1)
    assert callback.history and np.isfinite(callback.history[-1]["eigenvalues"][0])


# SharpnessCallback(log_dir=...): the measurements as TensorBoard scalars, read back with
# TensorFlow's event reader and compared with the callback's own records.


def _tensorboard_model(optimizer=None, dropout: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5,)), keras.layers.Dense(8, activation="tanh")]
    layers += [keras.layers.Dropout(0.3)] if dropout else []
    model = keras.Sequential([*layers, keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss=LOSS)
    return model


def _tensorboard_fit(model, data, callbacks, epochs=2):
    batches = tf.data.Dataset.from_tensor_slices(data).batch(8)  # 5 steps per epoch
    model.fit(batches, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


@pytest.fixture(scope="module")
def epoch_run(data, tmp_path_factory):
    """Two epochs of SGD with top_k=2, a trace and the gradient overlap, into log_dir."""
    logs = tmp_path_factory.mktemp("logs")
    callback = SharpnessCallback(
        data,
        top_k=2,
        trace=True,
        trace_products=4,
        gradient_overlap=True,
        log_dir=logs,
    )
    _tensorboard_fit(_tensorboard_model(), data, [callback])
    return logs, callback


def test_every_measurement_is_in_the_spectra_run_at_its_epoch(epoch_run):
    logs, callback = epoch_run
    assert [path.name for path in logs.iterdir()] == ["spectra"]  # a run beside train/
    history = callback.history
    assert [record["epoch"] for record in history] == [0, 1, 2]
    expected = expected_scalars(history, [0, 1, 2], threshold=lambda record: record["threshold"])
    # SGD's threshold 2/η bounds H, so it is written; the first point has no overlap.
    assert expected["sharpness/threshold"][0][1] == np.float32(20.0)
    assert [step for step, _ in expected["sharpness/eigenvector_overlap"]] == [1, 2]
    assert set(expected) == {
        "sharpness/lambda_1",
        "sharpness/lambda_2",
        "sharpness/error_bound_1",
        "sharpness/error_bound_2",
        "sharpness/threshold",
        "sharpness/trace",
        "sharpness/trace_stderr",
        "sharpness/loss",
        "sharpness/eigenvector_overlap",
        "sharpness/gradient_overlap",
    }
    assert read_scalars(logs / "spectra") == expected


def test_the_file_is_closed_at_train_end(epoch_run, data):
    logs, callback = epoch_run
    assert callback._events._writer is None
    assert len(event_files(logs / "spectra")) == 1


def test_step_unit_and_preconditioned_tags(data, tmp_path):
    callback = SharpnessCallback(
        data,
        every=3,
        unit="step",
        preconditioned=True,
        per_batch=2,
        per_batch_size=16,
        log_dir=tmp_path / "new" / "logs",
    )
    _tensorboard_fit(_tensorboard_model(keras.optimizers.Adam(0.01)), data, [callback])
    steps = callback.points
    assert steps == [3, 6, 9]  # no point at step 0: P exists after the first step
    expected = expected_scalars(
        callback.history,
        steps,
        prefix="preconditioned_sharpness",
        threshold=lambda record: record["threshold"],
    )
    written = read_scalars(tmp_path / "new" / "logs" / "spectra")
    assert written == expected
    # The mini-batch distribution of λ₁(P⁻¹H) under the same prefix, at every point.
    assert [step for step, _ in written["preconditioned_sharpness/minibatch_lambda_1_q50"]] == steps
    # Adam's threshold bounds P⁻¹H: written with the preconditioned sharpness.
    assert written["preconditioned_sharpness/threshold"][0][1] == np.float32(
        (2 + 2 * 0.9) / ((1 - 0.9) * 0.01)
    )


def test_raw_sharpness_under_adam_has_no_threshold(data, tmp_path):
    callback = SharpnessCallback(data, every=2, log_dir=str(tmp_path))
    _tensorboard_fit(_tensorboard_model(keras.optimizers.Adam(0.01)), data, [callback], epochs=1)
    written = read_scalars(tmp_path / "spectra")
    assert callback.history[0]["threshold_matrix"] == "preconditioned"
    assert "sharpness/threshold" not in written
    assert [step for step, _ in written["sharpness/lambda_1"]] == [0]


def _train(data, log_dir):
    """Two shuffled epochs with Dropout; the weights, losses and draws after training."""
    model = _tensorboard_model(dropout=True)
    callbacks = [] if log_dir is None else [SharpnessCallback(data, trace=True, log_dir=log_dir)]
    history = model.fit(*data, batch_size=8, epochs=2, shuffle=True, verbose=0, callbacks=callbacks)
    draws = (tf.random.uniform((4,)).numpy(), np.random.rand(4), random.random())  # noqa: NPY002
    return [w.numpy() for w in model.weights], history.history["loss"], draws


def test_writing_events_leaves_training_and_random_streams_alone(data, tmp_path):
    weights, losses, draws = _train(data, None)
    weights_tb, losses_tb, draws_tb = _train(data, tmp_path)
    assert len(read_scalars(tmp_path / "spectra")["sharpness/lambda_1"]) == 3
    assert losses == losses_tb
    for a, b in zip([*weights, *draws], [*weights_tb, *draws_tb], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("log_dir", "error", "message"),
    [
        (5, TypeError, "log_dir must be a directory path (str or os.PathLike), got int"),
        ("", ValueError, "log_dir is empty"),
        ("FILE", ValueError, "is a file, not a directory"),
        ("FILE/logs", ValueError, "is a file, not a directory"),
    ],
)
def test_log_dir_that_is_not_a_directory_is_refused(data, tmp_path, log_dir, error, message):
    (tmp_path / "FILE").write_text("not a directory")
    if isinstance(log_dir, str) and log_dir:
        log_dir = str(tmp_path / log_dir)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        SharpnessCallback(data, log_dir=log_dir)


def test_beside_keras_tensorboard_and_read_by_event_accumulator(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = SharpnessCallback(data, log_dir=tmp_path)
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    _tensorboard_fit(_tensorboard_model(), data, [board, callback], epochs=1)
    assert {"train", "spectra"} <= {path.name for path in tmp_path.iterdir()}
    accumulator = EventAccumulator(str(tmp_path / "spectra"))
    accumulator.Reload()
    values = [
        (event.step, tf.make_ndarray(event.tensor_proto)[()])
        for event in accumulator.Tensors("sharpness/lambda_1")
    ]
    assert values == [
        (record["epoch"], np.float32(record["eigenvalues"][0])) for record in callback.history
    ]


def test_verbose_says_once_where_the_scalars_go(data, tmp_path, capsys):
    callback = SharpnessCallback(data, every=1, verbose=1, log_dir=tmp_path / "logs")
    _tensorboard_fit(_tensorboard_model(), data, [callback], epochs=1)
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if "TensorBoard scalars go to" in line]
    assert said == [
        f"SharpnessCallback: TensorBoard scalars go to {tmp_path / 'logs' / 'spectra'} "
        f"(view with: tensorboard --logdir {tmp_path / 'logs'})"
    ]
    assert len(lines) == 1 + len(callback.history)
