"""SharpnessCallback(log_dir=...): the measurements as TensorBoard scalars, read back with
TensorFlow's event reader and compared with the callback's own records."""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf
from _events import event_files, expected_scalars, read_scalars

from spectra.callback import SharpnessCallback

LOSS = "sparse_categorical_crossentropy"


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(0)
    x = generator.normal(size=(40, 5)).astype(np.float32)
    y = generator.integers(0, 3, size=40)
    return x, y


def _model(optimizer=None, dropout: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5,)), keras.layers.Dense(8, activation="tanh")]
    layers += [keras.layers.Dropout(0.3)] if dropout else []
    model = keras.Sequential([*layers, keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss=LOSS)
    return model


def _fit(model, data, callbacks, epochs=2):
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
    _fit(_model(), data, [callback])
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
    _fit(_model(keras.optimizers.Adam(0.01)), data, [callback])
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
    _fit(_model(keras.optimizers.Adam(0.01)), data, [callback], epochs=1)
    written = read_scalars(tmp_path / "spectra")
    assert callback.history[0]["threshold_matrix"] == "preconditioned"
    assert "sharpness/threshold" not in written
    assert [step for step, _ in written["sharpness/lambda_1"]] == [0]


def _train(data, log_dir):
    """Two shuffled epochs with Dropout; the weights, losses and draws after training."""
    model = _model(dropout=True)
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
    _fit(_model(), data, [board, callback], epochs=1)
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
    _fit(_model(), data, [callback], epochs=1)
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if "TensorBoard scalars go to" in line]
    assert said == [
        f"SharpnessCallback: TensorBoard scalars go to {tmp_path / 'logs' / 'spectra'} "
        f"(view with: tensorboard --logdir {tmp_path / 'logs'})"
    ]
    assert len(lines) == 1 + len(callback.history)
