"""JacobianOperator and its transpose against dense float64 Jacobians from
``tf.GradientTape.jacobian`` of the stacked outputs (example-major, the outputs of an
example concatenated in the model's order), built independently of spectra.

Models: an MLP, a small CNN and a model with two outputs (one of per-example shape
(2, 2)); 11 examples in batches of 4 (a smaller last batch).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import relative_error
from _gauss_newton import point_jacobian

from spectra.operators import GGNOperator, HessianOperator
from spectra.operators.jacobian import JacobianOperator, TransposedJacobianOperator

F64 = "float64"
N, BATCH = 11, 4


def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(5, activation="tanh", dtype=F64),
            keras.layers.Dense(3, dtype=F64),
        ]
    )


def _cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((5, 5, 1), dtype=F64),
            keras.layers.Conv2D(2, 3, activation="tanh", dtype=F64),
            keras.layers.Flatten(dtype=F64),
            keras.layers.Dense(2, dtype=F64),
        ]
    )


def _two_outputs() -> keras.Model:
    inputs = keras.Input((4,), dtype=F64)
    hidden = keras.layers.Dense(5, activation="tanh", dtype=F64)(inputs)
    first = keras.layers.Dense(3, name="first", dtype=F64)(hidden)
    square = keras.layers.Dense(4, dtype=F64)(hidden)
    second = keras.layers.Reshape((2, 2), name="second", dtype=F64)(square)
    return keras.Model(inputs, [first, second])


def _example_major(outputs) -> tf.Tensor:
    """(N, C): each output flattened per example, concatenated in order."""
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    count = int(outputs[0].shape[0])
    return tf.concat([tf.reshape(o, [count, -1]) for o in outputs], axis=1)


def _reference(model: keras.Model, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The outputs z (flat, example-major) and the dense J (N·C, n)."""
    values, J = point_jacobian(lambda: [_example_major(model(x))], model.trainable_variables)
    return values[0].reshape(-1), J


class Case:
    def __init__(self, model: keras.Model, x: np.ndarray) -> None:
        self.model = model
        self.x = x
        self.z, self.J = _reference(model, x)
        self.op = JacobianOperator.from_keras(model, x, batch_size=BATCH)
        self.dense = self.op.matmat(np.eye(self.op.shape[1]))
        self.dense_t = self.op.T.matmat(np.eye(self.op.shape[0]))


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(5)
    return {
        "mlp": Case(_mlp(), rng.standard_normal((N, 4))),
        "cnn": Case(_cnn(), rng.standard_normal((N, 5, 5, 1))),
        "two-outputs": Case(_two_outputs(), rng.standard_normal((N, 4))),
    }


@pytest.mark.parametrize("name", ["mlp", "cnn", "two-outputs"])
def test_jacobian_and_transpose_match_the_tape_jacobian(cases, name, rng):
    case = cases[name]
    J, op = case.J, case.op
    assert op.shape == J.shape
    assert np.max(np.abs(case.dense - J)) <= 1e-12 * np.max(np.abs(J))
    assert np.max(np.abs(case.dense_t - J.T)) <= 1e-12 * np.max(np.abs(J))
    np.testing.assert_allclose(op.outputs(), case.z, rtol=0, atol=1e-13)
    u, v = rng.standard_normal(op.shape[0]), rng.standard_normal(op.shape[1])
    assert abs(u @ op.matvec(v) - op.rmatvec(u) @ v) <= 1e-12 * abs(u @ J @ v)
    assert isinstance(op.T, TransposedJacobianOperator) and op.T.T is op


def test_row_order_and_output_layout(cases):
    case = cases["two-outputs"]
    op = case.op
    assert op.output_names == ["first", "second"]
    assert op.output_shapes == [(3,), (2, 2)] and op.num_outputs == 7
    first, second = case.model(case.x)
    parts = op.unflatten_outputs(op.outputs())
    np.testing.assert_allclose(parts[0], first.numpy(), atol=1e-13)
    np.testing.assert_allclose(parts[1], second.numpy(), atol=1e-13)
    assert np.array_equal(op.flatten_outputs(parts), op.outputs())
    # Row 7·i + 3 + 2·r + c is entry (r, c) of example i's second output.
    i, r, c = 6, 1, 0
    np.testing.assert_allclose(op.outputs()[7 * i + 3 + 2 * r + c], second.numpy()[i, r, c])


def test_matmat_is_the_columns_of_matvec(cases, rng):
    op = cases["mlp"].op
    V = rng.standard_normal((op.shape[1], 3))
    U = rng.standard_normal((op.shape[0], 3))
    JV, JtU = op.matmat(V), op.rmatmat(U)
    for j in range(3):
        np.testing.assert_allclose(JV[:, j], op.matvec(V[:, j]), rtol=0, atol=1e-13)
        np.testing.assert_allclose(JtU[:, j], op.T.matvec(U[:, j]), rtol=0, atol=1e-13)
    assert op.matvec(V[:, :1]).shape == (op.shape[0], 1)  # scipy keeps a column a column
    passes = op.num_data_passes
    op.matmat(V)
    assert op.num_data_passes == passes + 1  # one pass for the block


@pytest.mark.parametrize("batch_size", [None, 3, 5, 11])
def test_batching_changes_nothing(cases, batch_size):
    case = cases["mlp"]
    op = JacobianOperator.from_keras(case.model, (case.x, np.zeros(N)), batch_size=batch_size)
    assert np.max(np.abs(op.matmat(np.eye(op.shape[1])) - case.J)) <= 1e-12
    assert np.max(np.abs(op.T.matmat(np.eye(op.shape[0])) - case.J.T)) <= 1e-12


def test_a_dataset_of_batches(cases):
    case = cases["cnn"]
    y = np.zeros((N, 2))
    for data in (
        tf.data.Dataset.from_tensor_slices((case.x, y)).batch(BATCH),
        tf.data.Dataset.from_tensor_slices(case.x).batch(3),
    ):
        op = JacobianOperator.from_keras(case.model, data)
        assert op.shape == case.J.shape
        assert np.max(np.abs(op.matmat(np.eye(op.shape[1])) - case.J)) <= 1e-12
        assert np.max(np.abs(op.T.matmat(np.eye(op.shape[0])) - case.J.T)) <= 1e-12


def test_the_flat_layout_is_the_hessians(cases, rng):
    case = cases["mlp"]
    H = HessianOperator.from_keras(case.model, "mse", (case.x, np.zeros((N, 3))))
    op = case.op
    assert op.shape[1] == H.shape[0]
    assert op.variable_names == H.variable_names
    assert op.variable_shapes == H.variable_shapes
    v = rng.standard_normal(op.shape[1])
    for a, b in zip(op.unflatten(v), H.unflatten(v)):
        assert np.array_equal(a, b)
    assert np.array_equal(op.flatten(op.unflatten(v)), v)
    kernel = case.model.trainable_variables[0].numpy()
    w = np.zeros(op.shape[1])
    w[: kernel.size] = kernel.reshape(-1)
    assert np.array_equal(op.unflatten(w)[0], kernel)


def _output_hessian(loss: str, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """H_z = blockdiag_i((1/N) ∇²ℓ_i(z_i)), written out: softmax cross-entropy
    diag(p) − ppᵀ; Keras' MSE (mean over the C entries) (2/C) I."""
    count, C = z.shape
    blocks = []
    for i in range(count):
        if loss == "ce":
            p = np.exp(z[i] - z[i].max())
            p /= p.sum()
            blocks.append(np.diag(p) - np.outer(p, p))
        else:
            blocks.append(2.0 / C * np.eye(C))
    H = np.zeros((count * C, count * C))
    for i, block in enumerate(blocks):
        H[i * C : (i + 1) * C, i * C : (i + 1) * C] = block / count
    return H


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_ggn_is_jt_hz_j(cases, loss, rng):
    case = cases["mlp"]
    if loss == "ce":
        y = rng.integers(0, 3, N)
        keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        y = rng.standard_normal((N, 3))
        keras_loss = "mse"
    op = case.op
    Hz = _output_hessian(loss, op.outputs().reshape(N, 3), y)
    G = op.T.matmat(Hz @ op.matmat(np.eye(op.shape[1])))
    reference = GGNOperator.from_keras(case.model, keras_loss, (case.x, y), batch_size=BATCH)
    expected = reference.matmat(np.eye(reference.shape[0]))
    assert relative_error(G, expected) < 1e-10
    # The plain Jacobian: without the 1/N in H_z the product is N times the GGN.
    assert relative_error(op.T.matmat(N * Hz @ case.dense), N * expected) < 1e-10


def test_ntk_product(cases, rng):
    case = cases["mlp"]
    op = case.op
    u = rng.standard_normal(op.shape[0])
    ntk = case.J @ case.J.T
    product = (op @ op.T).matvec(u)
    assert relative_error(product, ntk @ u) < 1e-12


def test_snapshot_at_construction(rng):
    model = _mlp()
    x = rng.standard_normal((5, 4))
    op = JacobianOperator.from_keras(model, x)
    before = op.matmat(np.eye(op.shape[1]))
    outputs = op.outputs()
    for variable in model.trainable_variables:
        variable.assign(variable.numpy() + 1.0)
    np.testing.assert_array_equal(op.matmat(np.eye(op.shape[1])), before)
    np.testing.assert_array_equal(op.outputs(), outputs)
    changed = _reference(model, x)[1]
    assert relative_error(changed, before) > 1e-3  # the model did change
    # A new operator (sharing the compiled functions) is J at the new weights.
    after = JacobianOperator.from_keras(model, x)
    assert np.max(np.abs(after.matmat(np.eye(after.shape[1])) - changed)) <= 1e-12


def test_float32_and_float64(rng):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    )
    x = rng.standard_normal((N, 4)).astype(np.float32)
    single = JacobianOperator.from_keras(model, x, batch_size=BATCH)
    double = JacobianOperator.from_keras(model, x, batch_size=BATCH, dtype=np.float64)
    assert single.dtype == np.float32 and double.dtype == np.float64
    # The names HessianOperator gives in that dtype (float64 runs on a clone).
    hessian = HessianOperator.from_keras(model, "mse", (x, np.zeros((N, 3))), dtype=np.float64)
    assert double.variable_names == hessian.variable_names
    again = JacobianOperator.from_keras(model, x, dtype=np.float64)  # the same clone
    assert again.variable_names == double.variable_names
    eye = np.eye(single.shape[1])
    J32, J64 = single.matmat(eye), double.matmat(eye)
    assert J32.dtype == np.float32 and J64.dtype == np.float64
    assert 0 < relative_error(J32, J64) < 1e-6
    Jt32 = single.T.matmat(np.eye(single.shape[0]))
    assert Jt32.dtype == np.float32 and relative_error(Jt32, J64.T) < 1e-6


def test_refusals(cases, rng):
    case = cases["mlp"]
    model, x, op = case.model, case.x, case.op
    with pytest.raises(ValueError, match="training=True is not supported by JacobianOperator"):
        JacobianOperator.from_keras(model, x, training=True)
    with pytest.raises(TypeError, match="training must be True or False"):
        JacobianOperator.from_keras(model, x, training="yes")
    with pytest.raises(ValueError, match="data is required"):
        JacobianOperator.from_keras(model, None)
    with pytest.raises(TypeError, match="model must be a keras.Model"):
        JacobianOperator.from_keras(lambda t: t, x)
    with pytest.raises(TypeError, match="JacobianOperator.from_keras"):
        JacobianOperator()
    with pytest.raises(TypeError, match="jacobian must be a JacobianOperator"):
        TransposedJacobianOperator(np.eye(3))
    with pytest.raises(ValueError, match=r"matvec: expected a vector of length 43"):
        op.matvec(np.ones(33))
    with pytest.raises(ValueError, match=r"rmatvec: expected a vector of length 33"):
        op.T.matvec(np.ones(43))
    with pytest.raises(ValueError, match="matvec: the input contains NaN or Inf"):
        op.matvec(np.full(43, np.nan))
    with pytest.raises(TypeError, match="matmat: expected real numbers"):
        op.matmat(np.ones((43, 2), complex))
    with pytest.raises(ValueError, match="data is a tuple of 4 parts"):
        JacobianOperator.from_keras(model, (x, x, x, x))
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="the inputs x hold 1 NaN/Inf entries"):
        JacobianOperator.from_keras(model, bad)
    with pytest.raises(ValueError, match="batch_size cannot be used with a tf.data.Dataset"):
        JacobianOperator.from_keras(model, tf.data.Dataset.from_tensor_slices(x), batch_size=2)
    inputs = keras.Input((4,), dtype=F64)
    classes = keras.layers.Lambda(lambda t: keras.ops.argmax(t, axis=-1), dtype=F64)(
        keras.layers.Dense(3, dtype=F64)(inputs)
    )
    with pytest.raises(TypeError, match="integer .or boolean. outputs have no Jacobian"):
        JacobianOperator.from_keras(keras.Model(inputs, classes), x)


def test_transposed_from_keras(cases):
    case = cases["mlp"]
    transposed = TransposedJacobianOperator.from_keras(case.model, case.x)
    assert transposed.shape == case.J.T.shape
    assert np.max(np.abs(transposed.matmat(np.eye(transposed.shape[1])) - case.J.T)) <= 1e-12
    assert np.max(np.abs(transposed.T.matmat(np.eye(transposed.shape[0])) - case.J)) <= 1e-12


def _batch_norm() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(5, dtype=F64),
            keras.layers.BatchNormalization(dtype=F64),
            keras.layers.Activation("relu", dtype=F64),
            keras.layers.Dense(2, dtype=F64),
        ]
    )
    norm = model.layers[1]
    norm.moving_mean.assign(np.linspace(-1.0, 1.0, 5))
    norm.moving_variance.assign(np.linspace(0.5, 2.0, 5))
    return model


def _lstm() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3, 2), dtype=F64),
            keras.layers.LSTM(3, dtype=F64),
            keras.layers.Dense(2, dtype=F64),
        ]
    )


def _embedding() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(5, 2, dtype=F64),
            keras.layers.Flatten(dtype=F64),
            keras.layers.Dense(2, dtype=F64),
        ]
    )


@pytest.mark.parametrize("name", ["batch-norm", "lstm", "embedding"])
def test_other_layers(name, rng):
    """Inference-mode BatchNorm, a recurrent layer (a while loop) and an Embedding (whose
    gradient is IndexedSlices) against the tape Jacobian."""
    model, x = {
        "batch-norm": (_batch_norm, lambda: rng.standard_normal((7, 4))),
        "lstm": (_lstm, lambda: rng.standard_normal((7, 3, 2))),
        "embedding": (_embedding, lambda: rng.integers(0, 5, (7, 3)).astype(np.int32)),
    }[name]
    model, x = model(), x()
    op = JacobianOperator.from_keras(model, x, batch_size=3)
    _, J = _reference(model, x)
    assert np.max(np.abs(op.matmat(np.eye(op.shape[1])) - J)) <= 1e-12 * np.max(np.abs(J))
    assert np.max(np.abs(op.T.matmat(np.eye(op.shape[0])) - J.T)) <= 1e-12 * np.max(np.abs(J))


def test_an_overflowing_product_is_refused(rng):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = 1e30 * rng.standard_normal((5, 4)).astype(np.float32)
    op = JacobianOperator.from_keras(model, x)
    with pytest.raises(ValueError, match="the Jacobian product on batch 0 is not finite"):
        op.matvec(np.full(op.shape[1], 1e30))
    with pytest.raises(ValueError, match="the transposed Jacobian product on batch 0 is not"):
        op.rmatvec(np.full(op.shape[0], 1e30))


def test_several_inputs_as_a_list_a_dict_or_a_dataset(rng):
    first, second = keras.Input((2,), dtype=F64, name="a"), keras.Input((3,), dtype=F64, name="b")
    joined = keras.layers.Concatenate(dtype=F64)([first, second])
    outputs = keras.layers.Dense(2, activation="tanh", dtype=F64)(joined)
    by_position = keras.Model([first, second], outputs)
    by_name = keras.Model({"a": first, "b": second}, outputs)
    xa, xb = rng.standard_normal((5, 2)), rng.standard_normal((5, 3))
    _, J = _reference(by_position, [xa, xb])
    named = {"a": xa, "b": xb}
    for op in (
        JacobianOperator.from_keras(by_position, [xa, xb], batch_size=2),
        JacobianOperator.from_keras(by_name, (named, np.zeros(5)), batch_size=2),
        JacobianOperator.from_keras(by_name, tf.data.Dataset.from_tensor_slices((named,)).batch(2)),
    ):
        assert np.max(np.abs(op.matmat(np.eye(op.shape[1])) - J)) <= 1e-12
