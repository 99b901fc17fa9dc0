"""GGNOperator against dense Jᵀ (∇²_z ℓ) J built independently, for every supported loss.

The references take Jacobians of the split points (the model's outputs, or the logits
behind a softmax/sigmoid output that Keras' cross-entropies read) with
``tf.GradientTape.jacobian`` and Hessians of the loss in the points with nested tapes, on
float64 models, batch by batch with weights n_b/N (unequal batches: 11 examples in
batches of 4).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import batch_weighted, dense_hessian, relative_error
from _gauss_newton import (
    dense_ggn,
    head_model,
    log_cosh,
    point_model,
    random_labels,
    symmetric_eigenvalues,
    take,
)

import spectra
from spectra.operators import FisherOperator, GGNOperator, HessianOperator, keras_models

N, BATCH = 11, 4
F64 = "float64"


# name: (units, head, the loss given to the operator, labels, the reference loss at the
# split point, whether the split point is the logits layer)
def _cases():
    sce = keras.losses.SparseCategoricalCrossentropy
    cce = keras.losses.CategoricalCrossentropy
    bce = keras.losses.BinaryCrossentropy
    return {
        "sparse-ce-logits": (3, "logits", sce(from_logits=True), "sparse", sce(True, dtype=F64)),
        "onehot-ce-logits": (3, "logits", cce(from_logits=True), "onehot", cce(True, dtype=F64)),
        "sparse-ce-softmax": (
            3, "softmax", "sparse_categorical_crossentropy", "sparse", sce(True, dtype=F64)
        ),
        "onehot-ce-softmax": (3, "softmax", cce(), "onehot", cce(True, dtype=F64)),
        "sparse-ce-probabilities": (
            3, "probabilities", sce(), "sparse", sce(dtype=F64)
        ),
        "bce-logits": (2, "logits", bce(from_logits=True), "binary", bce(True, dtype=F64)),
        "bce-sigmoid": (2, "sigmoid", "binary_crossentropy", "binary", bce(True, dtype=F64)),
        "bce-probabilities": (
            2, "sigmoid-probabilities", bce(), "binary", bce(dtype=F64)
        ),
        "mse": (2, "logits", "mse", "real", keras.losses.MeanSquaredError(dtype=F64)),
        "custom-callable": (2, "logits", log_cosh, "real", log_cosh),
    }  # fmt: skip


def _reference(point_model, reference_loss, data, weighted: bool) -> np.ndarray:
    x, y, sw = data
    batches = []
    for start in range(0, N, BATCH):
        stop = min(start + BATCH, N)

        def points(start=start, stop=stop):
            return [point_model(x[start:stop])]

        def loss(pts, start=start, stop=stop):
            if weighted:
                return reference_loss(y[start:stop], pts[0], sample_weight=sw[start:stop])
            return reference_loss(y[start:stop], pts[0])

        batches.append((points, loss, (stop - start) / N))
    return dense_ggn(batches, point_model.trainable_variables)


@pytest.mark.parametrize("case", list(_cases()))
def test_ggn_matches_dense_for_every_loss(case, rng):
    units, head, loss, label_kind, reference_loss = _cases()[case]
    model = head_model(units, head)
    x = rng.standard_normal((N, 4))
    y = random_labels(label_kind, units, rng, N)
    weighted = case != "custom-callable"  # a plain callable cannot weight examples
    sw = rng.uniform(0.5, 2.0, N)
    data = (x, y, sw) if weighted else (x, y)
    op = GGNOperator.from_keras(model, loss, data, batch_size=BATCH)
    assert op.product_path == "split" and op.curvature == "ggn"
    G = op.matmat(np.eye(op.shape[0]))
    reference = _reference(point_model(model, head), reference_loss, (x, y, sw), weighted)
    assert relative_error(G, reference) < 1e-9
    # Convex losses: G is PSD.
    eigenvalues = symmetric_eigenvalues(G)
    assert eigenvalues[0] >= -1e-10 * eigenvalues[-1]


def test_probability_split_is_the_empirical_fisher(rng):
    """ℓ(z) = −log z_y has ∇²ℓ = ∇ℓ∇ℓᵀ: split at probabilities the GGN is the empirical
    Fisher, a different matrix from the GGN split at the logits (the softmax head)."""
    x, y = rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    probabilities = head_model(3, "probabilities")
    softmax = head_model(3, "softmax")
    softmax.set_weights(probabilities.get_weights())
    loss = "sparse_categorical_crossentropy"
    G = GGNOperator.from_keras(probabilities, loss, (x, y), batch_size=BATCH)
    E = FisherOperator.from_keras(probabilities, loss, (x, y), batch_size=BATCH, kind="empirical")
    logit_split = GGNOperator.from_keras(softmax, loss, (x, y), batch_size=BATCH)
    eye = np.eye(G.shape[0])
    assert relative_error(G.matmat(eye), E.matmat(eye)) < 1e-9
    assert relative_error(G.matmat(eye), logit_split.matmat(eye)) > 0.1


@pytest.mark.parametrize("loss", ["sce", "mse"])
def test_ggn_equals_hessian_for_a_linear_model(loss, rng):
    model = keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.1), dtype=F64),
        ]
    )
    x = rng.standard_normal((N, 4))
    if loss == "sce":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        y = rng.integers(0, 3, N)
    else:
        y = rng.standard_normal((N, 3))
    G = GGNOperator.from_keras(model, loss, (x, y), batch_size=BATCH)
    H = HessianOperator.from_keras(model, loss, (x, y), batch_size=BATCH)
    eye = np.eye(G.shape[0])
    assert relative_error(G.matmat(eye), H.matmat(eye)) < 1e-10


def test_ggn_is_psd_where_the_hessian_is_not(rng):
    model = head_model(3, "logits")
    x, y = 3 * rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    eye = np.eye(model.count_params())
    G = GGNOperator.from_keras(model, loss, (x, y)).matmat(eye)
    H = HessianOperator.from_keras(model, loss, (x, y)).matmat(eye)
    g, h = symmetric_eigenvalues(G), symmetric_eigenvalues(H)
    assert h[0] < -1e-3 * h[-1]  # an indefinite Hessian here
    assert g[0] >= -1e-10 * g[-1]


def test_regularization_enters_with_its_exact_hessian(rng):
    """L2(λ) on the first kernel adds 2λ on its diagonal block, nothing elsewhere; the
    loss and gradient include it (λ = 0.25: Keras rounds the factor to float32)."""
    model = keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(
                5, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.25), dtype=F64
            ),
            keras.layers.Dense(3, dtype=F64),
        ]
    )
    x, y = rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    full = GGNOperator.from_keras(model, loss, (x, y), batch_size=BATCH)
    data_only = GGNOperator.from_keras(
        model, loss, (x, y), batch_size=BATCH, include_regularization=False
    )
    eye = np.eye(full.shape[0])
    difference = full.matmat(eye) - data_only.matmat(eye)
    expected = np.zeros_like(difference)
    expected[:20, :20] = 2 * 0.25 * np.eye(20)
    np.testing.assert_allclose(difference, expected, atol=1e-12)
    kernel = model.layers[0].kernel.numpy().ravel()
    np.testing.assert_allclose(
        (full.gradient() - data_only.gradient())[:20], 2 * 0.25 * kernel, rtol=1e-12
    )
    assert full.loss() - data_only.loss() == pytest.approx(0.25 * np.sum(kernel**2), rel=1e-12)


def _two_headed_model() -> tuple[keras.Model, keras.Model]:
    """Softmax classes and a linear value, and the model of their split points."""
    inputs = keras.Input((4,), dtype=F64)
    hidden = keras.layers.Dense(5, activation="tanh", dtype=F64)(inputs)
    logits = keras.layers.Dense(3, name="logits", dtype=F64)(hidden)
    classes = keras.layers.Activation("softmax", name="classes", dtype=F64)(logits)
    value = keras.layers.Dense(2, name="value", dtype=F64)(hidden)
    return keras.Model(inputs, {"classes": classes, "value": value}), keras.Model(
        inputs, [logits, value]
    )


def test_multi_output_compiled_loss_with_weights(rng):
    """z is both outputs; ∇²_zℓ is block diagonal with the loss weights."""
    model, points_model = _two_headed_model()
    model.compile(
        loss={"classes": "sparse_categorical_crossentropy", "value": "mse"},
        loss_weights={"classes": 0.7, "value": 2.0},
    )
    x = rng.standard_normal((N, 4))
    y = {"classes": rng.integers(0, 3, N), "value": rng.standard_normal((N, 2))}
    op = GGNOperator.from_keras(model, None, (x, y), batch_size=BATCH)
    points_model = keras.Model(
        model.inputs, [model.get_layer("logits").output, model.get_layer("value").output]
    )
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=F64)
    mse = keras.losses.MeanSquaredError(dtype=F64)
    batches = []
    for start in range(0, N, BATCH):
        part = take((x, y), start, start + BATCH)

        def points(part=part):
            return points_model([part[0]])

        def loss(pts, part=part):
            labels = part[1]
            return 0.7 * sce(labels["classes"], pts[0]) + 2.0 * mse(labels["value"], pts[1])

        batches.append((points, loss, len(part[0]) / N))
    reference = dense_ggn(batches, model.trainable_variables)
    assert relative_error(op.matmat(np.eye(op.shape[0])), reference) < 1e-9
    # The loss and gradient (from the backward pass that J v reuses) are the model's.
    hessian = HessianOperator.from_keras(model, None, (x, y), batch_size=BATCH)
    assert op.loss() == pytest.approx(hessian.loss(), rel=1e-13)
    assert relative_error(op.gradient(), hessian.gradient()) < 1e-12


def test_snapshot_and_cache_modes(rng):
    model = head_model(3, "softmax")
    x, y = rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    loss = "sparse_categorical_crossentropy"
    V = rng.standard_normal((model.count_params(), 3))
    cached = GGNOperator.from_keras(model, loss, (x, y), batch_size=BATCH, cache=True)
    streaming = GGNOperator.from_keras(model, loss, (x, y), batch_size=BATCH, cache=False)
    before = cached.matmat(V)
    assert cached.is_cached and not streaming.is_cached
    np.testing.assert_allclose(streaming.matmat(V), before, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(cached.matmat(V), before)  # a second pass
    model.set_weights([w + 0.5 for w in model.get_weights()])
    np.testing.assert_array_equal(cached.matmat(V), before)
    np.testing.assert_allclose(streaming.matmat(V), before, rtol=1e-12, atol=1e-15)
    after = GGNOperator.from_keras(model, loss, (x, y), batch_size=BATCH).matmat(V)
    assert relative_error(after, before) > 1e-2


def test_float32_model_in_float64(rng):
    """dtype=np.float64 computes on a float64 copy of a float32 model, exactly."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    x, y = rng.standard_normal((N, 4)).astype("float32"), rng.integers(0, 3, N)
    op = GGNOperator.from_keras(
        model, "sparse_categorical_crossentropy", (x, y), batch_size=BATCH, dtype=np.float64
    )
    assert op.dtype == np.float64
    copy = head_model(3, "softmax")
    copy.set_weights([w.astype(F64) for w in model.get_weights()])
    reference = _reference(
        point_model(copy, "softmax"),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=F64),
        (x.astype(F64), y, None),
        weighted=False,
    )
    assert relative_error(op.matmat(np.eye(op.shape[0])), reference) < 1e-9


# The zoo: the GGN through convolutions, BatchNorm, loops, branches, add_loss (activity
# regularization, whose exact Hessian is added), several outputs, Dropout masks.
_ZOO_ENTRIES = (
    "cnn",
    "batchnorm",
    "tf-while-loop",
    "keras-cond",
    "add-loss",
    "multi-io-compiled",
    "dropout-training",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", _ZOO_ENTRIES)
def test_ggn_on_the_model_zoo(name, rng):
    import _zoo

    entry = next(e for e in _zoo.ZOO if e.name == name)
    keras.utils.set_random_seed(5)
    model = entry.build(F64)
    data = _zoo.cast(entry.data(rng, _zoo.N, 4), F64)
    if entry.compiled:
        model.compile(loss=entry.loss, loss_weights=entry.loss_weights)
    op = GGNOperator.from_keras(
        model,
        None if entry.compiled else entry.loss,
        data,
        batch_size=entry.batch_size,
        **entry.kwargs,
    )
    assert op.product_path == "split"
    reference = _zoo_reference(entry, model, data)
    assert relative_error(op.matmat(np.eye(op.shape[0])), reference) < 1e-9


def _zoo_reference(entry, model, data) -> np.ndarray:
    """Jᵀ ∇²_zℓ J at the zoo model's outputs (logits), plus the dense Hessian of its
    regularization terms, batch by batch with the operator's Dropout seeds."""
    import _zoo

    x, y = data
    training = entry.kwargs.get("training", False)
    structured = keras_models.StructuredLoss(entry.loss, entry.loss_weights, tf.float64)
    size = _zoo.N if entry.batch_size is None else entry.batch_size
    batches, regularization = [], []
    for index, start in enumerate(range(0, _zoo.N, size)):
        part = take((x, y), start, start + size)
        seeds = _zoo.seed_states(model, index) if training else []

        def forward(part=part, seeds=seeds):
            with keras.StatelessScope(state_mapping=seeds, collect_losses=True):
                outputs = model(part[0], training=training)
                extra = list(model.losses)
            return outputs, extra

        structure, extra = forward()
        weight = len(tf.nest.flatten(part[0])[0]) / _zoo.N

        def points(forward=forward):
            return tf.nest.flatten(forward()[0])

        def loss(pts, part=part, structure=structure):
            outputs = tf.nest.pack_sequence_as(structure, pts)
            return structured(model, part[1], outputs, None)

        batches.append((points, loss, weight))
        if extra:
            regularization.append((lambda forward=forward: tf.add_n(forward()[1]), weight))
    G = dense_ggn(batches, model.trainable_variables)
    if regularization:
        G = G + dense_hessian(batch_weighted(regularization), model.trainable_variables)
    return G


def test_bad_input():
    w = tf.Variable([1.0, 2.0])
    with pytest.raises(TypeError, match=r"GGNOperator.from_keras\(model, loss, data\)"):
        GGNOperator(lambda: tf.reduce_sum(w**2), [w])
    model = head_model(3, "logits")
    x, y = np.zeros((N, 4)), np.zeros(N, dtype=int)
    constant = lambda y_true, y_pred: tf.constant(1.0, F64)  # noqa: E731
    with pytest.raises(ValueError, match="do not affect the loss"):
        GGNOperator.from_keras(model, constant, (x, y))
    with (
        pytest.warns(UserWarning, match="do not affect the loss"),
        pytest.raises(ValueError, match="does not depend on the model's outputs"),
    ):
        GGNOperator.from_keras(model, constant, (x, y), allow_unused=True)
    with pytest.raises(ValueError, match="data is required"):
        GGNOperator.from_keras(model, "mse")
    assert spectra.GGNOperator is GGNOperator
