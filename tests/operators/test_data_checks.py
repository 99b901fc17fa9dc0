"""spectra.operators.data_checks: checks of a Keras model's data that run before any graph,
and graph errors with their root cause first. The digits checkpoint and data that gave raw
TensorFlow errors are regression tests."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra import FisherOperator, GGNOperator, HessianOperator
from spectra.analysis.landscape import loss_landscape
from spectra.cli import main
from spectra.operators import data_checks as D
from spectra.operators import keras_models
from spectra.operators.batching import Batches

DATA = Path(__file__).resolve().parents[2] / "data"
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def digits():
    """A digits checkpoint and its data: MLP 64-32-32-10 (softmax)."""
    model = keras.saving.load_model(DATA / "gd_trajectory" / "step_0100.keras", compile=False)
    data = np.load(DATA / "digits.npz")
    return model, data["x"], data["y"]


def check(model, loss, data, **kwargs):
    D.check_keras_data(model, loss, Batches(data, **kwargs))


def classifier(classes=3, features=4):
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(classes)])


def embedding_model(input_dim=10):
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(input_dim, 2),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


def counting_dataset(x, y, batch_size, produced):
    """A dataset that records every batch it yields (to prove what ran when)."""

    def generate():
        for start in range(0, len(y), batch_size):
            produced.append(start)
            yield x[start : start + batch_size], y[start : start + batch_size]

    return tf.data.Dataset.from_generator(
        generate,
        output_signature=(
            tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)),
            tf.TensorSpec([None, *y.shape[1:]], tf.as_dtype(y.dtype)),
        ),
    )


# -- the exact inputs that gave raw TensorFlow errors ---------------------------------------
def test_labels_out_of_range(digits):
    model, x, y = digits
    bad = y.copy()
    bad[7] = 10
    with pytest.raises(
        ValueError,
        match=r"sparse_categorical_crossentropy needs class indices in \[0, 10\) for a model "
        r"with 10 outputs, but y\[7\] = 10 is not below the number of classes, 10 "
        r"\(1 of 1797 labels out of range\)",
    ):
        check(model, "sparse_categorical_crossentropy", (x, bad))


def test_negative_labels(digits):
    model, x, y = digits
    bad = y.copy()
    bad[[3, 5]] = -1
    with pytest.raises(
        ValueError, match=r"but y\[3\] = -1 is negative \(2 of 1797 labels out of range\)"
    ):
        check(model, "sparse_categorical_crossentropy", (x, bad))


def test_float_labels_are_refused_not_truncated(digits):
    model, x, y = digits
    bad = y.astype("float32")
    bad[0] = 0.5
    with pytest.raises(
        ValueError,
        match=r"needs integer class indices, but y\[0\] = 0.5 \(1 of 1797 labels are not "
        r"integers; Keras would truncate them silently\)",
    ):
        check(model, "sparse_categorical_crossentropy", (x, bad))
    # Integral floats (labels read from a CSV file) are exact class indices: accepted.
    check(model, "sparse_categorical_crossentropy", (x, y.astype("float32")))


def test_mse_with_integer_class_labels(digits):
    model, x, y = digits
    with pytest.raises(
        ValueError,
        match=r"mse needs y shaped like the model's output, but y has shape \(1797,\) and the "
        r"model's output \(None, 10\)\. y holds integer class labels.*"
        r"loss='sparse_categorical_crossentropy'",
    ):
        check(model, "mse", (x, y))
    check(model, "mse", (x, np.eye(10)[y]))  # one-hot targets are what mse compares


def test_string_x(digits):
    model, x, y = digits
    with pytest.raises(
        TypeError, match=r"x holds strings, but the model's input 'pixels' expects float32"
    ):
        check(model, "sparse_categorical_crossentropy", (x.astype(str), y))


def test_embedding_index_outside_the_vocabulary():
    model = embedding_model(input_dim=10)
    x = np.arange(40).reshape(8, 5) % 10
    y = np.arange(8) % 3
    check(model, SCE, (x, y))
    outside = x.copy()
    outside[2, 4] = 10
    with pytest.raises(
        ValueError,
        match=r"x feeds Embedding layer 'embedding\w*' with input_dim=10, so its indices must "
        r"lie in \[0, 10\), but x\[2, 4\] = 10 \(range of x: \[0, 10\]\)",
    ):
        check(model, SCE, (outside, y))
    negative = x.copy()
    negative[1, 0] = -3
    with pytest.raises(ValueError, match=r"but x\[1, 0\] = -3 \(range of x: \[-3, 9\]\)"):
        check(model, SCE, (negative, y))


def test_float_embedding_indices_must_be_integral():
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Embedding(4, 2), keras.layers.Flatten()]
    )
    y = np.zeros((3, 4))
    check(model, "mse", (np.array([[0.0, 1.0], [2.0, 3.0], [3.0, 0.0]]), y))
    with pytest.raises(ValueError, match=r"needs integer indices, but x\[1, 1\] = 2.5"):
        check(model, "mse", (np.array([[0.0, 1.0], [2.0, 2.5], [3.0, 0.0]]), y))


def test_infinite_dataset(digits):
    model, x, y = digits
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(256).repeat()
    with pytest.raises(
        ValueError, match=r"infinite tf.data.Dataset \(e.g. made with .repeat\(\)\)"
    ):
        check(model, "sparse_categorical_crossentropy", dataset)


# -- labels: what Keras accepts, and what it would accept silently -------------------------
@pytest.mark.parametrize(
    "loss",
    [
        "sparse_categorical_crossentropy",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.sparse_categorical_crossentropy,
    ],
    ids=["name", "object", "function"],
)
def test_every_spelling_of_a_loss_is_checked(loss, rng):
    x = rng.standard_normal((6, 4))
    with pytest.raises(ValueError, match=r"y\[5\] = 3 is not below the number of classes, 3"):
        check(classifier(), loss, (x, np.array([0, 1, 2, 0, 1, 3])))


def test_label_shapes_for_sparse_losses(rng):
    x = rng.standard_normal((6, 4))
    labels = np.array([0, 1, 2, 0, 1, 2])
    check(classifier(), SCE, (x, labels))
    check(classifier(), SCE, (x, labels[:, None]))  # (n, 1) is squeezed by Keras
    with pytest.raises(ValueError, match=r"one class index per prediction.*looks one-hot"):
        check(classifier(), SCE, (x, np.eye(3)[labels]))
    # A sequence model: one class per time step.
    sequence = keras.Sequential([keras.Input((7, 4)), keras.layers.Dense(3)])
    steps = np.zeros((6, 7), "int32")
    check(sequence, SCE, (rng.standard_normal((6, 7, 4)), steps))
    with pytest.raises(ValueError, match=r"y of shape \(None, 7\) or \(None, 7, 1\)"):
        check(sequence, SCE, (rng.standard_normal((6, 7, 4)), steps[:, :3]))


def test_ignore_class_is_not_out_of_range(rng):
    x = rng.standard_normal((4, 4))
    loss = keras.losses.SparseCategoricalCrossentropy(ignore_class=-1)
    check(classifier(), loss, (x, np.array([0, -1, 2, -1])))
    with pytest.raises(ValueError, match=r"y\[1\] = -2 is negative"):
        check(classifier(), loss, (x, np.array([0, -2, 2, -1])))


def test_keras_reshaping_of_dense_labels_is_accepted(rng):
    x = rng.standard_normal((6, 4))
    single = classifier(classes=1)
    targets = rng.standard_normal(6)
    # Keras squeezes/expands a trailing 1: (n,) against (n, 1) is one target per example.
    keras_value = keras.losses.MeanSquaredError()(targets, single(x))
    assert np.isfinite(float(keras_value))
    for loss in ["mse", "binary_crossentropy", keras.losses.MeanAbsoluteError()]:
        check(single, loss, (x, (targets > 0).astype("float32")))
        check(single, loss, (x, (targets > 0).astype("float32")[:, None]))
    check(classifier(), "categorical_crossentropy", (x, np.eye(3)[[0, 1, 2, 0, 1, 2]]))


def test_broadcasting_that_keras_accepts_silently_is_refused(rng):
    x = rng.standard_normal((6, 4))
    column = rng.standard_normal((6, 1))
    # Keras broadcasts (n, 1) against (n, 3) without a word: every output gets one target.
    assert np.isfinite(float(keras.losses.MeanSquaredError()(column, classifier()(x))))
    with pytest.raises(ValueError, match=r"If y holds class indices, use loss="):
        check(classifier(), "mse", (x, column))
    with pytest.raises(ValueError, match=r"Reshape y to the output's shape"):
        check(classifier(), "mse", (x, rng.standard_normal((6, 2))))


def test_categorical_crossentropy_with_integer_labels(rng):
    x = rng.standard_normal((6, 4))
    with pytest.raises(
        ValueError,
        match=r"categorical_crossentropy needs y shaped like.*"
        r"loss='sparse_categorical_crossentropy'",
    ):
        check(classifier(), "categorical_crossentropy", (x, np.array([0, 1, 2, 0, 1, 2])))


def test_non_finite_labels_and_weights(rng):
    x = rng.standard_normal((4, 4))
    y = rng.standard_normal((4, 3))
    y[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"y holds 1 NaN or infinite values, first at y\[2, 1\]"):
        check(classifier(), "mse", (x, y))
    weights = np.array([1.0, np.inf, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"sample_weight holds NaN or infinite values"):
        check(classifier(), SCE, (x, np.array([0, 1, 2, 0]), weights))


def test_non_numeric_labels_and_weights(rng):
    x = rng.standard_normal((4, 4))
    with pytest.raises(TypeError, match=r"y has dtype string, but the loss .* needs numbers"):
        check(classifier(), SCE, (x, np.array(["a", "b", "a", "b"])))
    with pytest.raises(TypeError, match=r"sample_weight has dtype string"):
        check(classifier(), SCE, (x, np.array([0, 1, 2, 0]), np.array(["1"] * 4)))


def test_custom_callables_are_not_second_guessed(rng):
    x = rng.standard_normal((4, 4))

    def my_loss(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred - 7.0))

    check(classifier(), my_loss, (x, np.array([-5, 99, 0.5, 3])))
    D.check_labels(my_loss, np.array([-5]), (None, 3))


def test_check_labels_directly(rng):
    D.check_labels("sparse_categorical_crossentropy", np.array([0, 2]), (None, 3))
    D.check_labels("mse", tf.TensorSpec([None, 3], tf.float32), tf.TensorShape([None, 3]))
    with pytest.raises(ValueError, match=r"y\['cls'\]\[1\] = 3"):
        D.check_labels(SCE, np.array([0, 3]), keras.KerasTensor((None, 3)), name="y['cls']")
    with pytest.raises(ValueError, match=r"class scores along the output's last axis"):
        D.check_labels(SCE, np.array([0, 1]), (None,))


# -- datasets: specs now, values during the counting pass ----------------------------------
def test_dataset_label_shapes_are_checked_before_any_pass(rng):
    x, y = rng.standard_normal((8, 4)), np.arange(8) % 3
    produced = []
    with pytest.raises(ValueError, match=r"mse needs y shaped like the model's output"):
        check(classifier(), "mse", counting_dataset(x, y, 4, produced))
    assert produced == []


def test_dataset_label_values_are_checked_in_the_counting_pass(rng):
    x, y = rng.standard_normal((8, 4)), np.array([0, 1, 2, 0, 1, 2, 7, 0])
    produced = []
    batches = Batches(counting_dataset(x, y, 4, produced))
    D.check_keras_data(classifier(), SCE, batches)
    assert produced == []  # nothing read at construction
    with pytest.raises(
        ValueError, match=r"y\[2\] = 7 in batch 1 of the dataset is not below the number"
    ):
        _ = batches.num_examples
    assert produced == [0, 4]  # one pass, stopped at the bad batch


def test_dataset_of_embedding_indices(rng):
    x = np.arange(40).reshape(8, 5) % 10
    x[5, 1] = 11
    dataset = tf.data.Dataset.from_tensor_slices((x.astype("int32"), np.arange(8) % 3)).batch(4)
    batches = Batches(dataset)
    D.check_keras_data(embedding_model(), SCE, batches)
    with pytest.raises(ValueError, match=r"x\[1, 1\] = 11 in batch 1 of the dataset"):
        _ = batches.num_examples


def test_dataset_of_strings_is_refused_from_its_element_spec():
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.constant([["a"] * 4] * 4), tf.constant([0, 1, 2, 0]))
    ).batch(2)
    with pytest.raises(TypeError, match=r"x holds strings"):
        check(classifier(), SCE, dataset)


# -- models with several inputs or outputs, subclassed models ------------------------------
def two_input_model():
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    numbers = keras.Input((2,), name="numbers")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(6, 2, name="vocab")(tokens))
    hidden = keras.layers.Concatenate()([embedded, numbers])
    outputs = {
        "cls": keras.layers.Dense(3, name="cls")(hidden),
        "reg": keras.layers.Dense(1, name="reg")(hidden),
    }
    return keras.Model({"tokens": tokens, "numbers": numbers}, outputs)


def test_inputs_are_named_by_their_path(rng):
    model = two_input_model()
    numbers = rng.standard_normal((4, 2))
    y = {"cls": np.array([0, 1, 2, 0]), "reg": rng.standard_normal((4, 1))}
    losses = {"cls": SCE, "reg": "mse"}
    tokens = np.array([[0, 1, 2], [3, 4, 5], [5, 5, 5], [0, 0, 0]])
    check(model, losses, ({"tokens": tokens, "numbers": numbers}, y))
    with pytest.raises(TypeError, match=r"x\['tokens'\] holds strings, but the model's input "):
        check(model, losses, ({"tokens": tokens.astype(str), "numbers": numbers}, y))
    tokens[3, 2] = 6
    with pytest.raises(ValueError, match=r"x\['tokens'\] feeds Embedding layer 'vocab'.*\[3, 2\]"):
        check(model, losses, ({"tokens": tokens, "numbers": numbers}, y))


def test_labels_are_checked_per_output(rng):
    model = two_input_model()
    x = {"tokens": np.zeros((4, 3), "int32"), "numbers": rng.standard_normal((4, 2))}
    good = {"cls": np.array([0, 1, 2, 0]), "reg": rng.standard_normal(4)}
    check(model, {"cls": SCE, "reg": "mse"}, (x, good))
    with pytest.raises(ValueError, match=r"y\['cls'\]\[1\] = 5 is not below"):
        check(model, {"cls": SCE, "reg": "mse"}, (x, {**good, "cls": np.array([0, 5, 2, 0])}))
    with pytest.raises(ValueError, match=r"mse needs y\['reg'\] shaped like"):
        check(model, {"cls": SCE, "reg": "mse"}, (x, {**good, "reg": np.zeros((4, 3))}))
    # Outputs in a list, losses in a list (in the model's output order: cls, reg).
    inputs = keras.Input((4,))
    listed = keras.Model(inputs, [keras.layers.Dense(3)(inputs), keras.layers.Dense(1)(inputs)])
    z = rng.standard_normal((4, 4))
    check(listed, [SCE, "mse"], (z, [np.array([0, 1, 2, 0]), np.zeros(4)]))
    with pytest.raises(ValueError, match=r"y\[0\]\[3\] = -1 is negative"):
        check(listed, [SCE, "mse"], (z, [np.array([0, 1, 2, -1]), np.zeros(4)]))
    with pytest.raises(ValueError, match=r"has 2 outputs but y is a single array"):
        check(listed, "mse", (z, np.zeros((4, 3))))


def test_subclassed_model_outputs_are_inferred(rng):
    class Scores(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Scores()
    x = rng.standard_normal((4, 4))
    model(x)
    check(model, SCE, (x, np.array([0, 1, 2, 0])))
    with pytest.raises(ValueError, match=r"y\[0\] = 3 is not below the number of classes, 3"):
        check(model, SCE, (x, np.array([3, 1, 2, 0])))
    check(model, SCE, (x.astype(str), np.array([0, 1, 2, 0])))  # no declared inputs: not checked


def test_string_input_models_may_take_strings():
    words = keras.Input((1,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["a", "b"])(words)
    out = keras.layers.Dense(2)(keras.layers.Flatten()(keras.layers.Embedding(3, 2)(ids)))
    check(keras.Model(words, out), SCE, (np.array([["a"], ["b"], ["c"]]), np.array([0, 1, 1])))


# -- check_data_fits_model: arrays against a model, before the CLI builds anything ----------
def test_fitting_data_passes():
    model, x = softmax_classifier(), np.zeros((5, 4), np.float32)
    D.check_data_fits_model(model, x, np.array([0, 1, 2, 0, 1]), "sparse_categorical_crossentropy")
    D.check_data_fits_model(model, x, np.eye(3)[[0, 1, 2, 0, 1]], "categorical_crossentropy")
    D.check_data_fits_model(model, x, np.zeros((5, 3)), keras.losses.MeanSquaredError())
    D.check_data_fits_model(model, x, np.array([0, 1, 2, 0, 1]))  # no loss: no label check


def softmax_classifier():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])


def test_data_that_does_not_fit_the_input_or_the_model():
    with pytest.raises(ValueError, match=r"expects inputs of shape \(None, 4\).*\(5, 7\)"):
        D.check_data_fits_model(softmax_classifier(), np.zeros((5, 7)), np.zeros(5))
    with pytest.raises(ValueError, match="x has 4 examples but y has 3"):
        D.check_data_fits_model(softmax_classifier(), np.zeros((4, 4)), np.zeros(3))

    class Picky(keras.Model):
        def call(self, x):
            return keras.ops.reshape(x, (-1, 3))

    with pytest.raises(ValueError, match=r"failed on 2 examples.*x has shape \(5, 4\)"):
        D.check_data_fits_model(Picky(), np.zeros((5, 4), np.float32), np.zeros(5))


@pytest.mark.parametrize(
    ("y", "loss", "message"),
    [
        (
            np.array([0, 7]),
            keras.losses.SparseCategoricalCrossentropy(),
            r"class indices in \[0, 3\) for a model with 3 outputs, but y\[1\] = 7 is not "
            r"below the number of classes",
        ),
        (
            np.eye(3)[[0, 1]],
            "sparse_categorical_crossentropy",
            r"one class index per prediction.*y has shape \(2, 3\).*one-hot encoded",
        ),
        (
            np.array([0.5, 1.0]),
            "sparse_categorical_crossentropy",
            r"needs integer class indices, but y\[0\] = 0.5",
        ),
        (
            np.array([0, 1]),
            "categorical_crossentropy",
            r"categorical_crossentropy needs y shaped like the model's output, but y has shape "
            r"\(2,\) and the model's output \(None, 3\).*sparse_categorical_crossentropy",
        ),
        (
            np.zeros((2, 2)),
            "mse",
            r"mse needs y shaped like the model's output, but y has shape \(2, 2\)",
        ),
    ],
)
def test_labels_are_checked_against_the_output(y, loss, message):
    with pytest.raises(ValueError, match=message):
        D.check_data_fits_model(softmax_classifier(), np.zeros((2, 4)), y, loss)


def test_binary_labels_must_lie_in_zero_one():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    x = np.zeros((3, 4))
    D.check_data_fits_model(model, x, np.array([0.0, 1.0, 0.25]), "binary_crossentropy")
    with pytest.raises(ValueError, match=r"labels in \[0, 1\].*y\[2\] = 2 \(1 of 3 labels"):
        D.check_data_fits_model(model, x, np.array([0, 1, 2]), "binary_crossentropy")
    with pytest.raises(ValueError, match=r"labels in \[0, 1\].*y\[0, 0\] = -1.0"):
        D.check_labels("binary_crossentropy", np.array([[-1.0], [1.0]]), (None, 1))


# -- graph errors: the root cause first ------------------------------------------------------
@tf.function
def gather_out_of_range(index):
    return tf.gather(tf.constant([1.0, 2.0, 3.0]), index)


def test_graph_error_is_reraised_with_its_root_cause_first():
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        with D.root_cause_first():
            gather_out_of_range(tf.constant([7]))
    message = str(caught.value)
    assert message.splitlines()[0] == "indices[0] = 7 is not in [0, 3)"
    assert "TensorFlow op GatherV2" in message and "Graph execution error" not in message
    original = caught.value.__cause__
    assert isinstance(original, tf.errors.InvalidArgumentError)
    assert str(original).startswith("Graph execution error:")


def test_root_cause_of_a_failing_hessian_product():
    # A loss whose gather runs out of range inside spectra's compiled products.
    table = tf.Variable([1.0, 2.0, 3.0], dtype=tf.float64)
    data = (np.array([0, 1, 5]),)

    def loss_fn(batch):
        return tf.reduce_sum(tf.gather(table, batch[0]) ** 2)

    op = HessianOperator(loss_fn, [table], data)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"^batch 0: indices\[2\] = 5 is not in \[0, 3\)"
    ):
        with D.root_cause_first():
            op.matvec(np.ones(3))


def test_other_error_classes_keep_their_class():
    @tf.function
    def cast_strings(values):
        return tf.cast(values, tf.float32)

    with pytest.raises(tf.errors.UnimplementedError, match=r"^Cast string to float is not supp"):
        with D.root_cause_first():
            cast_strings(tf.constant(["1"]))


def test_errors_that_are_not_graph_errors_pass_unchanged():
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        with D.root_cause_first():
            tf.gather(tf.constant([1.0, 2.0]), tf.constant([4]))  # eager: already clear
    assert caught.value.__cause__ is None
    with pytest.raises(KeyError, match="unrelated"):
        with D.root_cause_first():
            raise KeyError("unrelated")

    @D.root_cause_first()
    def decorated():
        return gather_out_of_range(tf.constant([9]))

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"^indices\[0\] = 9 is not in"):
        decorated()


def test_root_cause_parsing():
    assert D.root_cause("plain message") is None
    message = (
        "Graph execution error:\n\n2 root error(s) found.\n"
        "  (0) INVALID_ARGUMENT:  Received a label value of 5 which is outside the valid range "
        "of [0, 3).  Label values: 0 5\n\t [[{{node loss/xent}}]]\n"
        "  (1) INVALID_ARGUMENT:  same\n0 successful operations.\n0 derived errors ignored."
    )
    cause = D.root_cause(message)
    assert cause.splitlines()[0] == (
        "Received a label value of 5 which is outside the valid range of [0, 3).  Label values: 0 5"
    )
    assert "Class labels must be indices" in cause
    long = "Graph execution error:\n\n" + "x" * 2000
    assert len(D.root_cause(long)) == 500


# Errors of the operator API name their cause in one line (regression tests of the
# reported inputs): data that do not fit the model, variables that are not the model's,
# datasets that fail while producing a batch, and a landscape whose graph raises.

N = 30


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "Graph execution error" not in text
    assert "function_node" not in text
    assert "numpy=" not in text
    return text.splitlines()[0]


@pytest.fixture(scope="module")
def mlp():
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    return model, x, y


def test_a_feature_count_that_does_not_fit_the_model(mlp):
    model, _, y = mlp
    x5 = np.ones((N, 5), "float32")
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", (x5, y))
    assert _one_line(info.value).startswith(
        "x has examples of shape (5,) but the model's input expects (4,)"
    )
    assert len(str(info.value).splitlines()) == 1


def test_a_feature_count_that_does_not_fit_a_subclassed_model(mlp):
    _, _, y = mlp

    class Regressor(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Regressor()
    model(np.ones((2, 4), "float32"))
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", (np.ones((N, 5), "float32"), y))
    first = _one_line(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert first.startswith("calling model 'regressor' on a batch of x failed: Input 0")
    assert "expected axis -1 of input shape to have value 4" in first
    assert "\x1b" not in first


def test_a_variable_that_is_not_the_models(mlp):
    model, x, y = mlp
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(
            model, "mse", (x, y), variables=[tf.Variable(np.ones(3, "float32"))]
        )
    first = _one_line(info.value)
    assert first.startswith("variables[0] ('Variable:0', a ResourceVariable, shape (3,))")
    assert "is not a weight of model" in first


def test_a_weight_given_twice_through_its_tf_variable(mlp):
    model, x, y = mlp
    k = model.layers[0].kernel
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", (x, y), variables=[k, k.value])
    first = _one_line(info.value)
    assert "variables[1]" in first and "already given as variables[0]" in first
    # k.value alone is k: the same block of the Hessian.
    by_value = HessianOperator.from_keras(model, "mse", (x, y), variables=[k.value])
    by_weight = HessianOperator.from_keras(model, "mse", (x, y), variables=[k])
    np.testing.assert_array_equal(by_value @ np.eye(12), by_weight @ np.eye(12))


def test_a_dataset_of_x_only(mlp):
    model, x, _ = mlp
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(10)
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", dataset)
    assert _one_line(info.value).startswith(
        "data is a tf.data.Dataset whose elements are a single tensor of shape (None, 4); "
        "for a Keras model it must be (x, y) or (x, y, sample_weight) (a dataset must "
        "yield such tuples)."
    )


def test_a_failing_assertion_in_a_dataset_map(mlp):
    model, x, y = mlp
    x = x.copy()
    x[:20, 0] = np.minimum(x[:20, 0], 0.5)
    x[25, 0] = 3.0  # batch 2

    def checked(features, labels):
        tf.debugging.assert_less(features[:, 0], 1.0)
        return features, labels

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).map(checked)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        HessianOperator.from_keras(model, "mse", dataset).loss()
    first = _one_line(info.value)
    assert first.startswith("batch 2 of the dataset: ")
    assert "assertion failed: [Condition x < y did not hold element-wise:]" in first


def test_a_raising_generator(mlp):
    model, x, y = mlp

    def generate():
        yield x[:10], y[:10]
        raise RuntimeError("the source file is truncated")

    spec = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    dataset = tf.data.Dataset.from_generator(generate, output_signature=spec)
    with pytest.raises(tf.errors.OpError) as info:
        HessianOperator.from_keras(model, "mse", dataset).loss()
    assert (
        _one_line(info.value)
        == "batch 1 of the dataset: RuntimeError: the source file is truncated"
    )


def test_loss_landscape_on_a_model_whose_graph_raises(mlp):
    _, x, y = mlp

    class NonNegative(keras.layers.Layer):
        def call(self, t):
            tf.debugging.assert_non_negative(t)
            return t

    model = keras.Sequential([keras.Input((4,)), NonNegative(), keras.layers.Dense(1)])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        loss_landscape(model, "mse", (x, y), {"d": np.ones(5)}, [0.0, 1.0], batch_size=10)
    first = _one_line(info.value)
    assert first.startswith("batch 0: assertion failed: [] [Condition x >= 0 did not hold")
    assert len(str(info.value).splitlines()) <= 2


# NaN, infinite or huge inputs are named as the cause, never blamed on the weights.
#
# The review's case: NaN (or huge) values in x, with finite weights, reached the user as
# "Load finite weights (e.g. an earlier checkpoint)" or as a non-finite batch whose cause
# was left to guess. Now the operators built by ``from_keras`` refuse them before any graph
# runs, naming the array, the first bad entry and the count; a loss computed from finite
# weights that is not finite names the data (``check_finite(..., inputs=x)``).

SCE_NAME = "sparse_categorical_crossentropy"


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)


NAN_MESSAGE = (
    "x holds 1 NaN or infinite values, first x[5, 2] = nan: the model's outputs, the loss "
    "and its derivatives are undefined there. Remove or repair those examples."
)


@pytest.mark.parametrize("operator", [HessianOperator, GGNOperator, FisherOperator])
def test_nan_in_x_is_named_with_its_index(operator):
    x, y = _data()
    x[5, 2] = np.nan
    with pytest.raises(ValueError) as raised:
        operator.from_keras(_model(), SCE_NAME, (x, y))
    assert str(raised.value) == NAN_MESSAGE


def test_a_value_that_overflows_the_compute_dtype_is_named():
    x, y = _data()
    x = x.astype(np.float64)
    x[7, 1] = 1e300
    with pytest.raises(ValueError) as raised:
        HessianOperator.from_keras(_model(), SCE_NAME, (x, y))
    assert str(raised.value) == (
        "x holds 1 NaN or infinite values, first x[7, 1] = inf (or a value beyond "
        "±3.4e+38, which the float32 the operator computes in cannot hold: rescale x, or "
        "compute in float64): the model's outputs, the loss and its derivatives are "
        "undefined there. Remove or repair those examples."
    )


def test_a_dataset_names_the_batch_and_a_dict_input_its_key():
    x, y = _data()
    x[13, 0] = -np.inf
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.raises(ValueError, match=r"^x holds 1 NaN or infinite values in batch 1 "):
        # A dataset is checked during its counting pass, before the first batch is used.
        HessianOperator.from_keras(_model(), SCE_NAME, dataset).loss()
    inputs = {"a": keras.Input((2,), name="a"), "b": keras.Input((2,), name="b")}
    joined = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(joined))
    with pytest.raises(
        ValueError, match=r"^x\['a'\] holds 1 NaN .* first x\['a'\]\[13, 0\] = -inf"
    ):
        HessianOperator.from_keras(model, SCE_NAME, ({"a": x[:, :2], "b": x[:, 2:]}, y))


def test_a_non_finite_loss_from_finite_weights_blames_the_data():
    x, _ = _data()
    x[7, 1] = 3e38
    with pytest.raises(ValueError) as raised:
        keras_models.check_finite(
            tf.constant(np.inf, tf.float32), "the batch loss", inputs=x, where="batch 0"
        )
    assert str(raised.value) == (
        "the batch loss of batch 0 has 1 non-finite entries (0 NaN, 1 Inf) out of 1 although "
        "the weights are finite: the data are the cause (x[7, 1] = 3e+38 is the input of "
        "largest magnitude). Remove or rescale those examples."
    )
    x[2, 3] = np.nan
    assert D.describe_inputs(x) == "x[2, 3] = nan (1 NaN or infinite values in x)"
    # A weight is still a weight.
    with pytest.raises(ValueError, match="^variable 'dense/kernel' has 1 non-finite.*Load finite"):
        keras_models.check_finite(tf.constant([np.nan, 1.0]), "dense/kernel")


# A probabilistic loss given logits is said, and a compiled ``from_logits`` is recorded.
#
# The review's case: the string ``"sparse_categorical_crossentropy"`` (probabilities) on a
# model that ends without a softmax gave a λ1 thousands of times too large with no warning,
# and ``results.json`` recorded ``"compiled_loss": "sparse_categorical_crossentropy"`` for a
# model compiled with ``SparseCategoricalCrossentropy(from_logits=True)``.


def _logits_data(n=20, classes=3):
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
    x, y = _logits_data()
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
    x, y = _logits_data()
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
    x, _ = _logits_data()
    with pytest.warns(UserWarning, match=r"the model's output 'scores' has negative values"):
        D.warn_if_not_probabilities(model, "sparse_categorical_crossentropy", x)
    found = _warnings_of(
        lambda: D.warn_if_not_probabilities(
            model, {"probs": "sparse_categorical_crossentropy", "scores": "mse"}, x
        )
    )
    assert found == []


def _analyze(tmp_path, model, loss_option):
    x, y = _logits_data()
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
