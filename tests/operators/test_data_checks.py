"""spectra.operators.data_checks: checks of a Keras model's data that run before any graph,
and graph errors with their root cause first. The digits checkpoint and data that gave raw
TensorFlow errors are regression tests."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.operators import HessianOperator
from spectra.operators import data_checks as D
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
