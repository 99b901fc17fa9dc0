"""HessianOperator against dense Hessians from tf.GradientTape.jacobian (float64)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import scipy.sparse.linalg as spla
import tensorflow as tf
from _dense import FD_TRUTH_RTOL, batch_weighted, dense_hessian, flat_gradient, relative_error

from spectra.operators import HessianOperator

F64_RTOL = 1e-11  # float64 gradients agree with the dense reference's to round-off
# float64 products against the finite-difference truth (~1e-11 relative, tests/_dense.py)


# -- small models, built in any dtype ----------------------------------------------------
def mlp(dtype="float64", activation="tanh", regularizer=None):
    return keras.Sequential(
        [
            keras.Input((5,), dtype=dtype),
            keras.layers.Dense(
                6, activation=activation, dtype=dtype, kernel_regularizer=regularizer
            ),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def cnn(dtype="float64"):
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype=dtype),
            keras.layers.Conv2D(3, 3, activation="tanh", dtype=dtype),
            keras.layers.MaxPooling2D(2, dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def multi_input(dtype="float64"):
    a = keras.Input((3,), name="a", dtype=dtype)
    b = keras.Input((2,), name="b", dtype=dtype)
    h = keras.layers.Concatenate(dtype=dtype)(
        [keras.layers.Dense(4, activation="tanh", dtype=dtype)(a), b]
    )
    out = keras.layers.Dense(3, dtype=dtype)(h)
    return keras.Model({"a": a, "b": b}, out)


def batchnorm_model(dtype="float64"):
    return keras.Sequential(
        [
            keras.Input((5,), dtype=dtype),
            keras.layers.Dense(4, dtype=dtype),
            keras.layers.BatchNormalization(dtype=dtype),
            keras.layers.Activation("tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def shared_weights_model(dtype="float64"):
    inp = keras.Input((4,), dtype=dtype)
    shared = keras.layers.Dense(4, activation="tanh", dtype=dtype)
    out = keras.layers.Dense(3, dtype=dtype)(shared(shared(inp)))
    return keras.Model(inp, out)


@tf.custom_gradient
def _log1pexp(x):
    e = tf.exp(x)

    def grad(upstream):
        # Built from differentiable ops, so second derivatives are correct.
        return upstream * (1.0 - 1.0 / (1.0 + e))

    return tf.math.log1p(e), grad


class Log1pExp(keras.layers.Layer):
    def call(self, x):
        return _log1pexp(x)


def custom_gradient_model(dtype="float64", use_custom=True):
    act = Log1pExp(dtype=dtype) if use_custom else keras.layers.Activation("softplus", dtype=dtype)
    return keras.Sequential(
        [
            keras.Input((5,), dtype=dtype),
            keras.layers.Dense(4, dtype=dtype),
            act,
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def classification_data(rng, n=13, shape=(5,), classes=3, dtype="float64"):
    x = rng.standard_normal((n, *shape)).astype(dtype)
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def keras_dense_reference(model, loss, data, batch_size=None, training=False):
    """Dense Hessian of Σ_b (n_b/N) L_b with Keras' own loss reduction per batch."""
    x, y = data[0], data[1]
    sw = data[2] if len(data) == 3 else None
    # Keras loss objects compute in float32 unless told otherwise.
    loss = type(loss).from_config({**loss.get_config(), "dtype": model.weights[0].dtype})
    n = len(y)
    bs = n if batch_size is None else batch_size
    terms = []
    for s in range(0, n, bs):

        def take(a, s=s):
            return tf.nest.map_structure(lambda t: t[s : s + bs], a)

        def batch_loss(s=s, take=take):
            value = loss(
                take(y),
                model(take(x), training=training),
                sample_weight=None if sw is None else take(sw),
            )
            return value + (tf.add_n(model.losses) if model.losses else 0.0)

        terms.append((batch_loss, min(bs, n - s) / n))
    fn = batch_weighted(terms)
    variables = model.trainable_variables
    return dense_hessian(fn, variables), flat_gradient(fn, variables), float(fn())


def check_against_dense(op, H, rng, k=4):
    V = rng.standard_normal((op.shape[0], k))
    assert relative_error(op.matmat(V), H @ V) < FD_TRUTH_RTOL
    v = V[:, 0]
    assert relative_error(op.matvec(v), H @ v) < FD_TRUTH_RTOL
    assert relative_error(op.rmatvec(v), H @ v) < FD_TRUTH_RTOL
    assert relative_error(op @ v, H @ v) < FD_TRUTH_RTOL


SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SCE64 = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")


@pytest.mark.parametrize(
    "build, shape",
    [(mlp, (5,)), (cnn, (6, 6, 2)), (batchnorm_model, (5,)), (shared_weights_model, (4,))],
    ids=["mlp", "cnn", "batchnorm", "shared-weights"],
)
@pytest.mark.parametrize("batch_size", [None, 5], ids=["one-batch", "unequal-batches"])
def test_products_match_dense_hessian(build, shape, batch_size, rng):
    model = build()
    if build is batchnorm_model:
        # Non-trivial moving statistics, so inference mode differs from training mode.
        bn = model.layers[1]
        bn.moving_mean.assign(rng.standard_normal(4))
        bn.moving_variance.assign(rng.uniform(0.5, 2.0, 4))
    data = classification_data(rng, shape=shape)
    op = HessianOperator.from_keras(model, SCE, data, batch_size=batch_size)
    H, g, loss = keras_dense_reference(model, SCE, data, batch_size)
    assert op.shape == H.shape and op.dtype == np.float64
    check_against_dense(op, H, rng)
    assert relative_error(op.gradient(), g) < F64_RTOL
    assert op.loss() == pytest.approx(loss, rel=1e-12)
    # The Hessian of the dataset loss does not depend on how the data is batched.
    if batch_size is not None:
        assert op.num_examples == 13


def test_multi_input_model_with_dict_inputs(rng):
    model = multi_input()
    x = {"a": rng.standard_normal((9, 3)), "b": rng.standard_normal((9, 2))}
    y = rng.integers(0, 3, 9)
    op = HessianOperator.from_keras(model, SCE, (x, y), batch_size=4)
    H, _, _ = keras_dense_reference(model, SCE, (x, y), batch_size=4)
    check_against_dense(op, H, rng)


def test_custom_gradient_layer_gives_exact_second_derivatives(rng):
    custom = custom_gradient_model(use_custom=True)
    reference = custom_gradient_model(use_custom=False)
    reference.set_weights(custom.get_weights())
    data = classification_data(rng)
    op = HessianOperator.from_keras(custom, SCE, data, batch_size=6)
    H_softplus, _, _ = keras_dense_reference(reference, SCE, data)
    check_against_dense(op, H_softplus, rng)


def test_sample_weights_and_regularization(rng):
    model = mlp(regularizer=keras.regularizers.L2(0.0625))
    x, y = classification_data(rng, n=10)
    sw = rng.uniform(0.1, 2.0, 10)
    op = HessianOperator.from_keras(model, SCE, (x, y, sw), batch_size=3)
    H, _g, loss = keras_dense_reference(model, SCE, (x, y, sw), batch_size=3)
    check_against_dense(op, H, rng)
    assert op.loss() == pytest.approx(loss, rel=1e-12)
    without = HessianOperator.from_keras(model, SCE, (x, y, sw), include_regularization=False)
    v = rng.standard_normal(op.shape[0])
    # The L2 term adds 2·0.0625 on the first kernel's diagonal block only.
    diff = op.matvec(v) - without.matvec(v)
    kernel = model.layers[0].kernel
    k = int(np.prod(kernel.shape))
    np.testing.assert_allclose(diff[:k], 0.125 * v[:k], rtol=1e-10)
    np.testing.assert_allclose(diff[k:], 0.0, atol=1e-12)


def test_tf_data_dataset_matches_arrays(rng):
    model = mlp()
    x, y = classification_data(rng, n=11)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    op = HessianOperator.from_keras(model, SCE, dataset)
    H, _, _ = keras_dense_reference(model, SCE, (x, y), batch_size=4)
    check_against_dense(op, H, rng)
    assert op.num_examples == 11


def test_variable_subset_is_the_hessian_block(rng):
    model = mlp()
    data = classification_data(rng)
    kernel = model.layers[1].kernel
    op = HessianOperator.from_keras(model, SCE, data, variables=[kernel])
    H, _, _ = keras_dense_reference(model, SCE, data)
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    start = sum(sizes[:2])
    block = H[start : start + sizes[2], start : start + sizes[2]]
    check_against_dense(op, block, rng)


def test_non_trainable_variables(rng):
    model = mlp()
    model.layers[0].trainable = False  # its kernel and bias become non-trainable
    data = classification_data(rng)
    op = HessianOperator.from_keras(model, SCE, data)
    assert op.shape[0] == 6 * 3 + 3
    full_model = mlp()
    full_model.set_weights(model.get_weights())
    H, _, _ = keras_dense_reference(full_model, SCE, data)
    check_against_dense(op, H[-21:, -21:], rng)
    # A non-trainable variable can still be asked for explicitly.
    frozen_kernel = model.layers[0].kernel
    op_frozen = HessianOperator.from_keras(model, SCE, data, variables=[frozen_kernel])
    check_against_dense(op_frozen, H[:30, :30], rng)


def test_float64_products_on_a_float32_model(rng):
    model32 = mlp("float32")
    model64 = mlp("float64")
    model64.set_weights([w.astype(np.float64) for w in model32.get_weights()])
    x, y = classification_data(rng, dtype="float64")
    before = [w.copy() for w in model32.get_weights()]
    op = HessianOperator.from_keras(
        model32, "sparse_categorical_crossentropy", (x.astype("float32"), y), dtype=np.float64
    )
    # The float32 model's inputs are float32; the reference uses the same values in float64.
    x64 = x.astype("float32").astype("float64")
    loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
    model64_softmax = keras.Sequential([model64, keras.layers.Softmax(dtype="float64")])
    H, _, _ = keras_dense_reference(model64_softmax, loss, (x64, y))
    assert op.dtype == np.float64
    # The string loss expects probabilities; give it the same softmax on both sides.
    assert op.shape == H.shape
    op_probs = HessianOperator.from_keras(
        keras.Sequential([model32, keras.layers.Softmax()]),
        "sparse_categorical_crossentropy",
        (x.astype("float32"), y),
        dtype=np.float64,
    )
    check_against_dense(op_probs, H, rng)
    for a, b in zip(before, model32.get_weights()):
        np.testing.assert_array_equal(a, b)
        assert b.dtype == np.float32


def test_float32_products_agree_with_float64_dense(rng):
    model32 = mlp("float32")
    model64 = mlp("float64")
    model64.set_weights([w.astype(np.float64) for w in model32.get_weights()])
    x, y = classification_data(rng, dtype="float32")
    op = HessianOperator.from_keras(model32, SCE, (x, y), batch_size=5)
    H, _, _ = keras_dense_reference(model64, SCE, (x.astype("float64"), y), batch_size=5)
    assert op.dtype == np.float32
    V = rng.standard_normal((op.shape[0], 3))
    out = op.matmat(V)
    assert out.dtype == np.float32
    # float32 round-off is ~1e-7; a weighting or indexing bug is O(1).
    assert relative_error(out.astype(np.float64), H @ V) < 2e-5


def test_symmetry_of_products(rng):
    model = cnn("float32")
    op = HessianOperator.from_keras(
        model, SCE, classification_data(rng, shape=(6, 6, 2), dtype="float32")
    )
    u, v = rng.standard_normal((2, op.shape[0]))
    a, b = u @ op.matvec(v), v @ op.matvec(u)
    assert abs(a - b) <= 1e-5 * (abs(a) + abs(b))
    assert op.adjoint() is op and op.T is op


def test_eigsh_matches_eigh_of_dense(rng):
    model = mlp()
    data = classification_data(rng, n=20)
    op = HessianOperator.from_keras(model, SCE, data)
    H, _, _ = keras_dense_reference(model, SCE, data)
    top = spla.eigsh(op, k=3, which="LA", return_eigenvectors=False, tol=1e-12)
    np.testing.assert_allclose(np.sort(top), np.linalg.eigh(H)[0][-3:], rtol=1e-9)


def test_streaming_and_cached_paths_agree(rng):
    model = mlp()
    data = classification_data(rng, n=17)
    cached = HessianOperator.from_keras(model, SCE, data, batch_size=5, cache=True)
    streaming = HessianOperator.from_keras(model, SCE, data, batch_size=5, cache=False)
    auto_tiny = HessianOperator.from_keras(model, SCE, data, batch_size=5, cache_bytes=100)
    H, _, _ = keras_dense_reference(model, SCE, data, batch_size=5)
    for op in (cached, streaming, auto_tiny):
        check_against_dense(op, H, rng)
    assert cached.is_cached and cached.cache_nbytes > 0
    assert not streaming.is_cached and not auto_tiny.is_cached


def test_block_larger_than_max_block_size_is_split(rng):
    model = mlp()
    data = classification_data(rng)
    op = HessianOperator.from_keras(model, SCE, data, max_block_size=3)
    H, _, _ = keras_dense_reference(model, SCE, data)
    V = rng.standard_normal((op.shape[0], 8))
    assert relative_error(op.matmat(V), H @ V) < FD_TRUTH_RTOL
    assert op.num_hvps == 8
    assert op.num_data_passes == 2  # the pass that filled the cache, then one matmat


def test_counters(rng):
    op = HessianOperator.from_keras(mlp(), SCE, classification_data(rng), batch_size=4)
    op.matvec(rng.standard_normal(op.shape[0]))
    op.matmat(rng.standard_normal((op.shape[0], 5)))
    assert op.num_hvps == 6
    assert op.num_data_passes == 3


def test_training_mode_uses_batch_statistics_and_leaves_the_model_unchanged(rng):
    model = batchnorm_model()
    bn = model.layers[1]
    bn.moving_mean.assign(rng.standard_normal(4))
    data = classification_data(rng, n=12)
    before = [w.copy() for w in model.get_weights()]
    op = HessianOperator.from_keras(model, SCE, data, batch_size=6, training=True)
    H, _, _ = keras_dense_reference(model, SCE, data, batch_size=6, training=True)
    # The reference call in training mode updated the moving statistics; restore them.
    model.set_weights(before)
    op.reset_cache()
    check_against_dense(op, H, rng)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_dropout_in_training_mode_is_a_fixed_symmetric_operator(rng):
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3),
        ]
    )
    before = [w.copy() for w in model.get_weights()]
    data = classification_data(rng, dtype="float32")
    op = HessianOperator.from_keras(model, SCE, data, training=True)
    u, v = rng.standard_normal((2, op.shape[0]))
    first = op.matvec(v)
    # Without its cache the operator recomputes the forward pass: the same mask, so the
    # same matrix (a fresh mask per pass would change the product by O(1)).
    op.reset_cache()
    np.testing.assert_allclose(op.matvec(v), first, rtol=1e-5, atol=1e-6 * np.abs(first).max())
    a, b = u @ op.matvec(v), v @ op.matvec(u)
    assert abs(a - b) <= 1e-4 * (abs(a) + abs(b))
    # The same model on the same data in inference mode (no mask) is another matrix:
    # an operator that ignored training=True would give the same product.
    inference = HessianOperator.from_keras(model, SCE, data)
    assert relative_error(first, inference.matvec(v)) > 0.05
    for x, y in zip(before, model.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_plain_loss_fn_and_variables(rng):
    A = rng.standard_normal((4, 4))
    A = A + A.T
    w = tf.Variable(rng.standard_normal(4))
    b = tf.Variable(rng.standard_normal((2, 1)))

    def loss_fn():
        return 0.5 * tf.tensordot(w, tf.linalg.matvec(A, w), 1) + tf.reduce_sum(b**4)

    op = HessianOperator(loss_fn, [w, b])
    H = np.zeros((6, 6))
    H[:4, :4] = A
    H[4:, 4:] = np.diag(12 * b.numpy().ravel() ** 2)
    check_against_dense(op, H, rng)
    parts = op.unflatten(np.arange(6.0))
    assert [p.shape for p in parts] == [(4,), (2, 1)]
    np.testing.assert_array_equal(op.flatten(parts), np.arange(6.0))


def test_plain_loss_fn_with_data_structure(rng):
    x = rng.standard_normal((10, 3))
    t = rng.standard_normal(10)
    w = tf.Variable(rng.standard_normal(3))

    def loss_fn(batch):
        xb, tb = batch
        return tf.reduce_mean((tf.linalg.matvec(xb, w) - tb) ** 2)

    op = HessianOperator(loss_fn, [w], (x, t), batch_size=3)
    np.testing.assert_allclose(op.matmat(np.eye(3)), 2 * x.T @ x / 10, rtol=1e-12)


def test_reusing_traced_functions_across_operators(rng):
    calls = []

    class Counting(keras.layers.Layer):
        def call(self, x):
            calls.append(1)
            return tf.tanh(x)

    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4), Counting(), keras.layers.Dense(3)]
    )
    data = classification_data(rng, dtype="float32")
    first = HessianOperator.from_keras(model, SCE, data, batch_size=4)
    traced = len(calls)
    assert traced >= 1
    for _ in range(3):
        first.matvec(rng.standard_normal(first.shape[0]))
        first.matmat(rng.standard_normal((first.shape[0], 7)))
    assert len(calls) == traced, "products must not retrace"
    # Training moves the weights; a new operator reuses the compiled functions ...
    model.layers[0].kernel.assign(model.layers[0].kernel * 1.5)
    data2 = classification_data(rng, dtype="float32")
    second = HessianOperator.from_keras(model, SCE, data2, batch_size=4)
    second.matvec(rng.standard_normal(second.shape[0]))
    assert len(calls) == traced
    assert second._engine is first._engine
    # ... and sees the new weights.
    model64 = keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(4, dtype="float64"),
            keras.layers.Activation("tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    model64.set_weights([w.astype(np.float64) for w in model.get_weights()])
    H, _, _ = keras_dense_reference(model64, SCE, (data2[0].astype("float64"), data2[1]))
    v = rng.standard_normal(second.shape[0])
    assert relative_error(second.matvec(v).astype(np.float64), H @ v) < 2e-5


def test_memory_does_not_grow_over_many_products(rng):
    import resource

    op = HessianOperator.from_keras(
        mlp("float32"), SCE, classification_data(rng, n=64, dtype="float32")
    )
    v = rng.standard_normal(op.shape[0]).astype(np.float32)
    for _ in range(200):
        op.matvec(v)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2000):
        op.matvec(v)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start
    assert grown_kib < 30 * 1024, f"peak memory grew by {grown_kib} KiB over 2000 products"


def test_multi_output_model_with_list_losses_weights_and_sample_weights(rng):
    inputs = keras.Input((3,), dtype="float64")
    hidden = keras.layers.Dense(4, activation="tanh", dtype="float64")(inputs)
    classes = keras.layers.Dense(3, dtype="float64")(hidden)
    values = keras.layers.Dense(2, dtype="float64")(hidden)
    model = keras.Model(inputs, [classes, values])
    x = rng.standard_normal((9, 3))
    y = [rng.integers(0, 3, 9), rng.standard_normal((9, 2))]
    sw = rng.uniform(0.2, 2.0, 9)
    mse = keras.losses.MeanSquaredError(dtype="float64")
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")

    def reference(weight):
        terms = []
        for s in range(0, 9, 4):
            b = slice(s, s + 4)

            def batch_loss(b=b):
                out = model(x[b])
                return sce(y[0][b], out[0], sample_weight=sw[b]) + weight * mse(
                    y[1][b], out[1], sample_weight=sw[b]
                )

            terms.append((batch_loss, len(x[b]) / 9))
        return dense_hessian(batch_weighted(terms), model.trainable_variables)

    model.compile(loss=[sce, "mse"], loss_weights=[1.0, 0.25])
    compiled = HessianOperator.from_keras(model, None, (x, y, sw), batch_size=4)
    check_against_dense(compiled, reference(0.25), rng)
    explicit = HessianOperator.from_keras(model, [sce, mse], (x, y, sw), batch_size=4)
    check_against_dense(explicit, reference(1.0), rng)
    with pytest.raises(ValueError, match="2 outputs but y is a single"):
        HessianOperator.from_keras(model, [sce, mse], (x, y[0]))


def test_add_loss_terms_follow_include_regularization(rng):
    from _zoo import add_loss

    model = add_loss("float64")
    x, y = classification_data(rng, n=10, shape=(4,))
    with_terms = HessianOperator.from_keras(model, SCE, (x, y))
    without = HessianOperator.from_keras(model, SCE, (x, y), include_regularization=False)

    def data_loss():
        return SCE64(y, model(x))

    def full_loss():
        value = data_loss()
        return value + tf.add_n(model.losses)

    variables = model.trainable_variables
    check_against_dense(with_terms, dense_hessian(full_loss, variables), rng)
    check_against_dense(without, dense_hessian(data_loss, variables), rng)


def _dropout_model():
    return keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(8, activation="tanh", dtype="float64"),
            keras.layers.Dropout(0.5, dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )


def test_dropout_seed_follows_its_documented_derivation(rng):
    model = _dropout_model()
    x, y = classification_data(rng, n=10)
    op = HessianOperator.from_keras(model, SCE, (x, y), training=True, seed=11, batch_size=6)
    state = model.layers[1].seed_generator.state

    def batch_loss(s, b):
        seed = tf.constant(np.array([11, 0], np.int64) + np.array([b, 0]), state.dtype)
        with keras.StatelessScope(state_mapping=[(state, seed)]):
            return SCE64(y[s : s + 6], model(x[s : s + 6], training=True))

    terms = [
        (lambda s=s, b=b: batch_loss(s, b), min(6, 10 - s) / 10)
        for b, s in enumerate(range(0, 10, 6))
    ]
    H = dense_hessian(batch_weighted(terms), model.trainable_variables)
    check_against_dense(op, H, rng)
    same = HessianOperator.from_keras(model, SCE, (x, y), training=True, seed=11, batch_size=6)
    other = HessianOperator.from_keras(model, SCE, (x, y), training=True, seed=12, batch_size=6)
    v = rng.standard_normal(op.shape[0])
    np.testing.assert_array_equal(same.matvec(v), op.matvec(v))
    assert not np.allclose(other.matvec(v), op.matvec(v))
    with pytest.raises(TypeError, match="seed must be None, a non-negative integer"):
        HessianOperator.from_keras(model, SCE, (x, y), training=True, seed=1.5)


def test_compiled_checkpoint_needs_no_loss(rng, tmp_path):
    # A masked embedding (its mask reaches the pooling) in a saved, compiled model: the
    # loaded model's compiled loss gives the same operator as the loss passed explicitly.
    # (A compiled LSTM checkpoint without --loss is analyzed against its dense Hessian by
    # tests/cli/test_analyze.py::test_analyze_a_compiled_lstm_checkpoint_without_loss.)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(6, 2, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer="sgd", loss=SCE)
    path = tmp_path / "masked.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    tokens = rng.integers(0, 6, (8, 5)).astype("int32")
    labels = rng.integers(0, 3, 8)
    from_checkpoint = HessianOperator.from_keras(loaded, None, (tokens, labels))
    explicit = HessianOperator.from_keras(model, SCE, (tokens, labels))
    v = rng.standard_normal(explicit.shape[0]).astype(np.float32)
    np.testing.assert_allclose(from_checkpoint.matvec(v), explicit.matvec(v), rtol=1e-5)
    assert from_checkpoint.loss() == pytest.approx(explicit.loss(), rel=1e-6)
    assert np.abs(explicit.matvec(v)).max() > 0


# -- bad input ---------------------------------------------------------------------------
@pytest.fixture
def small_op(rng):
    return HessianOperator.from_keras(mlp(), SCE, classification_data(rng))


def test_vector_of_wrong_length(small_op):
    with pytest.raises(ValueError, match="length 57, got length 5"):
        small_op.matvec(np.ones(5))
    with pytest.raises(ValueError, match=r"shape \(57, k\)"):
        small_op.matmat(np.ones((5, 2)))


def test_vector_of_wrong_ndim(small_op):
    with pytest.raises(ValueError, match="1-D or 2-D"):
        small_op.matvec(np.ones((57, 1, 1)))


def test_nan_or_inf_in_vector(small_op):
    v = np.ones(57)
    v[3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        small_op.matvec(v)
    v[3] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        small_op.matmat(v[:, None])


def test_loss_that_is_not_a_scalar(rng):
    w = tf.Variable(np.ones(3))
    with pytest.raises(ValueError, match="must return a scalar"):
        HessianOperator(lambda: w**2, [w])
    model = mlp()
    with pytest.raises(ValueError, match="not a scalar"):
        HessianOperator.from_keras(
            model, lambda y, p: tf.reduce_sum(p, axis=1), classification_data(rng)
        )


def test_empty_dataset(rng):
    x, y = classification_data(rng)
    with pytest.raises(ValueError, match="0 examples"):
        HessianOperator.from_keras(mlp(), SCE, (x[:0], y[:0]))
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0)
    op = HessianOperator.from_keras(mlp(), SCE, empty)
    with pytest.raises(ValueError, match="dataset is empty"):
        op.matvec(np.ones(op.shape[0]))


def test_variable_that_does_not_affect_the_loss(rng):
    w = tf.Variable(np.ones(3), name="used")
    unused = tf.Variable(np.ones(2), name="unused")
    with pytest.raises(ValueError, match="do not affect the loss.*unused"):
        HessianOperator(lambda: tf.reduce_sum(w**3), [w, unused])
    with pytest.warns(UserWarning, match="unused"):
        op = HessianOperator(lambda: tf.reduce_sum(w**3), [w, unused], allow_unused=True)
    np.testing.assert_allclose(op.matmat(np.eye(5)), np.diag([6.0, 6, 6, 0, 0]))


def test_non_floating_variables():
    counter = tf.Variable(3, name="counter")
    with pytest.raises(TypeError, match="floating-point"):
        HessianOperator(lambda: tf.cast(counter, tf.float32), [counter])


def test_model_that_is_not_built(rng):
    model = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        HessianOperator.from_keras(model, SCE, classification_data(rng))
    with pytest.raises(TypeError, match="keras.Model"):
        HessianOperator.from_keras(lambda x: x, SCE, classification_data(rng))


def test_data_errors(rng):
    x, y = classification_data(rng)
    with pytest.raises(ValueError, match="same number of examples"):
        HessianOperator.from_keras(mlp(), SCE, (x, y[:5]))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(ValueError, match="batch_size cannot be used"):
        HessianOperator.from_keras(mlp(), SCE, dataset, batch_size=2)
    with pytest.raises(ValueError, match=r"\(x, y\) or \(x, y, sample_weight\)"):
        HessianOperator.from_keras(mlp(), SCE, (x,))
    with pytest.raises(ValueError, match="unknown Keras loss"):
        HessianOperator.from_keras(mlp(), "not_a_loss", (x, y))
    with pytest.raises(ValueError, match="not a weight of model"):
        HessianOperator.from_keras(mlp(), SCE, (x, y), variables=[tf.Variable(1.0)])


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_model_gets_full_precision_products(policy, rng):
    keras.config.set_dtype_policy(policy)
    try:
        mixed = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)]
        )
    finally:
        keras.config.set_dtype_policy("float32")
    assert mixed.layers[0].compute_dtype != "float32"
    model64 = mlp("float64")
    model64.set_weights([w.astype(np.float64) for w in mixed.get_weights()])
    x, y = classification_data(rng, dtype="float32")
    H, _, _ = keras_dense_reference(model64, SCE, (x.astype("float64"), y))
    op32 = HessianOperator.from_keras(mixed, SCE, (x, y))
    op64 = HessianOperator.from_keras(mixed, SCE, (x, y), dtype=np.float64)
    V = rng.standard_normal((op32.shape[0], 3))
    assert op32.dtype == np.float32
    # Half precision would give errors of ~1e-3; float32 products are ~1e-7 accurate.
    assert relative_error(op32.matmat(V).astype(np.float64), H @ V) < 2e-5
    assert relative_error(op64.matmat(V), H @ V) < FD_TRUTH_RTOL
    assert mixed.layers[0].compute_dtype != "float32"  # the model keeps its policy
    with pytest.raises(TypeError, match="one of float32, float64, got float16"):
        HessianOperator.from_keras(mixed, SCE, (x, y), dtype="float16")


# -- bad models, bad weights, bad arguments ---------------------------------------------
class _Unbuilt(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_subclassed_model_never_built(rng):
    with pytest.raises(ValueError, match="not built.*model.build"):
        HessianOperator.from_keras(_Unbuilt(), SCE, classification_data(rng))


def test_loss_that_does_not_match_the_outputs(rng):
    x, y = classification_data(rng)
    with pytest.raises(ValueError, match=r"loss has keys \['foo'\].*outputs are named"):
        HessianOperator.from_keras(mlp(), {"foo": SCE}, (x, y))
    with pytest.raises(ValueError, match="2 entries but the model has 1 output"):
        HessianOperator.from_keras(mlp(), [SCE, SCE], (x, y))
    onehot5 = np.eye(5)[y % 5]
    with pytest.raises(ValueError, match=r"categorical_crossentropy.*5\).*\(None, 3\)"):
        HessianOperator.from_keras(mlp(), "categorical_crossentropy", (x, onehot5))
    model = multi_input()
    xs = {"a": rng.standard_normal((9, 3)), "b": rng.standard_normal((9, 2))}
    with pytest.raises(ValueError, match=r"\(9, 4\).*\(None, 3\)"):
        HessianOperator.from_keras(model, "mse", (xs, rng.standard_normal((9, 4))))

    # A loss of its own, unknown to the checks before the graph: the trace says it.
    def squared_error(y_true, y_pred):
        return tf.reduce_mean((y_true - y_pred) ** 2)

    with pytest.raises(ValueError, match=r"does not fit model output.*\(None, 4\).*\(None, 3\)"):
        HessianOperator.from_keras(model, squared_error, (xs, rng.standard_normal((9, 4))))


def test_model_with_integer_outputs(rng):
    inputs = keras.Input((5,), dtype="float64")
    logits = keras.layers.Dense(3, dtype="float64")(inputs)
    model = keras.Model(inputs, keras.ops.argmax(logits, axis=-1))
    with pytest.raises(TypeError, match="dtype int.*no derivative"):
        HessianOperator.from_keras(model, "mse", classification_data(rng))


def test_non_finite_weights_are_refused_naming_the_variable(rng):
    model = mlp()
    kernel = model.layers[0].kernel
    value = kernel.numpy()
    value[0, 0], value[1, 2], value[2, 2] = np.nan, np.nan, np.inf
    kernel.assign(value)
    with pytest.raises(ValueError, match=rf"{kernel.path}.*3 non-finite entries \(2 NaN, 1 Inf\)"):
        HessianOperator.from_keras(model, SCE, classification_data(rng))
    bn = batchnorm_model()
    bn.layers[1].moving_variance.assign([1.0, np.inf, 1.0, 1.0])
    with pytest.raises(ValueError, match="moving_variance.*1 non-finite"):
        HessianOperator.from_keras(bn, SCE, classification_data(rng))
    w = tf.Variable([1.0, np.nan], name="w")
    with pytest.raises(ValueError, match="'w.*1 non-finite entries"):
        HessianOperator(lambda: tf.reduce_sum(w**2), [w])


def test_non_finite_batch_is_named(rng):
    # A ReLU network: oneDNN's fused matmul+ReLU can turn a NaN into a finite loss, so
    # the gradient is checked too. NaN/Inf inputs are refused with the operator
    # (tests/operators/test_data_checks.py); a finite input that overflows inside
    # the model is found with the batch.
    model = mlp(activation="relu")
    x, y = classification_data(rng)
    x[8, 0] = np.nan
    with pytest.raises(ValueError, match=r"^x holds 1 NaN or infinite values, first x\[8, 0\]"):
        HessianOperator.from_keras(model, SCE, (x, y), batch_size=3)
    # Finite in float64, and the first unit's pre-activation max·Σ|w| overflows to +inf.
    x[8, :] = np.finfo(np.float64).max * np.sign(model.layers[0].kernel.numpy()[:, 0])
    op = HessianOperator.from_keras(model, SCE, (x, y), batch_size=3)
    with pytest.raises(ValueError, match=r"batch 2 \(3 examples\) gives a non-finite"):
        op.loss()
    streaming = HessianOperator.from_keras(model, SCE, (x, y), batch_size=3, cache=False)
    with pytest.raises(ValueError, match="batch 2"):
        streaming.matvec(np.ones(streaming.shape[0]))


def test_variable_listed_twice(rng):
    model = mlp()
    kernel = model.layers[0].kernel
    with pytest.raises(ValueError, match="listed twice"):
        HessianOperator.from_keras(model, SCE, classification_data(rng), variables=[kernel, kernel])
    w = tf.Variable([1.0, 2.0])
    with pytest.raises(ValueError, match=r"listed twice in variables \(positions 0 and 1\)"):
        HessianOperator(lambda: tf.reduce_sum(w**3), [w, w])


@pytest.mark.parametrize("value", [1, "yes", None, np.float64(1.0)])
def test_training_must_be_a_bool(value, rng):
    with pytest.raises(TypeError, match="training must be True or False"):
        HessianOperator.from_keras(mlp(), SCE, classification_data(rng), training=value)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32", "not-a-dtype"])
def test_dtype_errors_list_the_supported_dtypes(dtype, rng):
    with pytest.raises(TypeError, match="dtype must be one of float32, float64"):
        HessianOperator.from_keras(mlp(), SCE, classification_data(rng), dtype=dtype)


def test_data_is_required_and_the_compiled_loss_must_exist(rng):
    with pytest.raises(ValueError, match="data is required"):
        HessianOperator.from_keras(mlp(), SCE)
    with pytest.raises(ValueError, match="loss=None means the loss .* was compiled with"):
        HessianOperator.from_keras(mlp(), None, classification_data(rng))
