"""FisherOperator against dense references: the Monte Carlo Fisher with its documented
draws (exactly) and in expectation (the GGN, statistically), the empirical Fisher against
per-example gradients.

References are float64 and independent of spectra: Jacobians of the split points by
``tf.GradientTape.jacobian``, output gradients by tapes on constant copies of the
points, per-example gradients by one tape per example.
"""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import relative_error
from _gauss_newton import (
    head_model,
    log_cosh,
    per_example_gradients,
    point_jacobian,
    point_model,
    random_labels,
    symmetric_eigenvalues,
)

import spectra
from spectra.operators import FisherOperator, GGNOperator

F64 = "float64"
N, BATCH = 11, 4
SEED = 7


def _batches():
    for index, start in enumerate(range(0, N, BATCH)):
        yield index, start, min(start + BATCH, N)


def _draws(family: str, point: np.ndarray, from_logits: bool, samples: int, seed) -> np.ndarray:
    """The documented draws: a stateless generator seeded with fold_in([seed, batch
    index], output position); draw s of example i is row s·B + i (here: [s, i])."""
    point = tf.constant(point)
    if family == "categorical":
        logits = point if from_logits else tf.math.log(point)
        draws = tf.random.stateless_categorical(logits, samples, seed, dtype=tf.int64)
        return tf.transpose(draws).numpy()
    shape = [samples, *point.shape]
    if family == "bernoulli":
        p = tf.sigmoid(point) if from_logits else point
        return (tf.random.stateless_uniform(shape, seed, dtype=point.dtype) < p).numpy()
    return (point + tf.random.stateless_normal(shape, seed, dtype=point.dtype)).numpy()


def _scores(per_example_loss, labels: np.ndarray, point: np.ndarray) -> np.ndarray:
    """Row i: ∇_z of example i's loss at the point (unweighted, unreduced)."""
    z = tf.constant(point)
    with tf.GradientTape() as tape:
        tape.watch(z)
        total = tf.reduce_sum(per_example_loss(tf.constant(labels), z))
    return tape.gradient(total, z).numpy()


# name: (units, head, loss for the operator, family, labels kind, the per-example loss
# at the split point, κ, whether draws come from logits)
def _mc_cases():
    f = keras.losses
    return {
        "sparse-ce-logits": (
            3, "logits", f.SparseCategoricalCrossentropy(from_logits=True), "categorical",
            "sparse", lambda y, z: f.sparse_categorical_crossentropy(y, z, from_logits=True),
            1.0, True,
        ),
        "onehot-ce-softmax": (
            3, "softmax", "categorical_crossentropy", "categorical", "onehot",
            lambda y, z: f.categorical_crossentropy(y, z, from_logits=True), 1.0, True,
        ),
        "sparse-ce-probabilities": (
            3, "probabilities", "sparse_categorical_crossentropy", "categorical", "sparse",
            f.sparse_categorical_crossentropy, 1.0, False,
        ),
        "bce-sigmoid": (
            2, "sigmoid", f.BinaryCrossentropy(), "bernoulli", "binary",
            lambda y, z: f.binary_crossentropy(y, z, from_logits=True), 1 / 2, True,
        ),
        "mse": (2, "logits", "mse", "gaussian", "real", f.mean_squared_error, 2 / 2, True),
    }  # fmt: skip


def _as_labels(kind: str, draws: np.ndarray, units: int) -> np.ndarray:
    if kind == "onehot":
        return np.eye(units)[draws]
    return draws.astype(F64) if kind == "binary" else draws


@pytest.mark.parametrize("case", list(_mc_cases()))
def test_mc_fisher_is_its_formula_with_the_documented_draws(case, rng):
    """F = Σ_b (n_b/N) Σ_i (w_i/n_b) J_iᵀ [(1/S) Σ_s ∇ℓ(ŷ_is)∇ℓ(ŷ_is)ᵀ / κ] J_i, exactly."""
    units, head, loss, family, kind, per_example, kappa, from_logits = _mc_cases()[case]
    samples = 3
    model = head_model(units, head)
    x, y, sw = (
        rng.standard_normal((N, 4)),
        random_labels(kind, units, rng, N),
        rng.uniform(0.5, 2, N),
    )
    op = FisherOperator.from_keras(
        model, loss, (x, y, sw), batch_size=BATCH, num_samples=samples, seed=SEED
    )
    assert op.curvature == "fisher-mc" and op.kind == "mc" and op.product_path == "split"
    F = op.matmat(np.eye(op.shape[0]))
    points = point_model(model, head)
    reference = np.zeros_like(F)
    for index, start, stop in _batches():
        (point,), J = point_jacobian(
            lambda s=start, e=stop: [points(x[s:e])], points.trainable_variables
        )
        seed = tf.random.experimental.stateless_fold_in(tf.constant([SEED, index], tf.int64), 0)
        draws = _draws(family, point, from_logits, samples, seed)
        J = J.reshape(stop - start, units, -1)
        for s in range(samples):
            scores = _scores(per_example, _as_labels(kind, draws[s], units), point)
            for i in range(stop - start):
                g = J[i].T @ scores[i]
                reference += sw[start + i] / N * np.outer(g, g) / (kappa * samples)
    assert relative_error(F, reference) < 1e-9
    eigenvalues = symmetric_eigenvalues(F)
    assert eigenvalues[0] >= -1e-10 * eigenvalues[-1]


def test_mc_fisher_of_several_outputs_is_block_diagonal_with_the_loss_weights(rng):
    inputs = keras.Input((4,), dtype=F64)
    hidden = keras.layers.Dense(5, activation="tanh", dtype=F64)(inputs)
    logits = keras.layers.Dense(3, dtype=F64)(hidden)
    value = keras.layers.Dense(2, dtype=F64)(hidden)
    model = keras.Model(inputs, [logits, value])
    model.compile(
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        loss_weights=[0.7, 2.0],
    )
    x = rng.standard_normal((N, 4))
    y = [rng.integers(0, 3, N), rng.standard_normal((N, 2))]
    op = FisherOperator.from_keras(model, None, (x, y), batch_size=BATCH, num_samples=2, seed=SEED)
    F = op.matmat(np.eye(op.shape[0]))
    reference = np.zeros_like(F)

    def sce(labels, logits):
        return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)

    # (family, per-example loss, κ, loss weight) per output
    heads = [
        ("categorical", sce, 1.0, 0.7),
        ("gaussian", keras.losses.mean_squared_error, 1.0, 2.0),
    ]
    for index, start, stop in _batches():
        outputs, J = point_jacobian(
            lambda s=start, e=stop: model(x[s:e]), model.trainable_variables
        )
        J = J.reshape(-1, J.shape[1])
        offset = 0
        for position, ((family, per_example, kappa, weight), point) in enumerate(
            zip(heads, outputs)
        ):
            units = point.shape[1]
            rows = J[offset : offset + point.size].reshape(stop - start, units, -1)
            offset += point.size
            seed = tf.random.experimental.stateless_fold_in(
                tf.constant([SEED, index], tf.int64), position
            )
            draws = _draws(family, point, True, 2, seed)
            for s in range(2):
                scores = _scores(per_example, draws[s], point)
                for i in range(stop - start):
                    g = rows[i].T @ scores[i]
                    reference += weight / N * np.outer(g, g) / (kappa * 2)
    assert relative_error(F, reference) < 1e-9


def _outcomes(family: str, point: np.ndarray, units: int):
    """Every outcome of one draw for each example: (probabilities (N, K), output
    gradients ∇ℓ (K entries of (N, units))) and κ (ℓ = κ·(−log p))."""
    if family == "categorical":
        p = tf.nn.softmax(point).numpy()
        return p, [p - np.eye(units)[k] for k in range(units)], 1.0
    s = 1 / (1 + np.exp(-point))
    probabilities, scores = [], []
    for labels in itertools.product([0.0, 1.0], repeat=units):
        labels = np.array(labels)
        probabilities.append(np.prod(np.where(labels == 1, s, 1 - s), axis=1))
        scores.append((s - labels) / units)
    return np.stack(probabilities, axis=1), scores, 1.0 / units


@pytest.mark.slow
@pytest.mark.parametrize("family", ["categorical", "bernoulli", "gaussian"])
def test_mc_fisher_converges_to_the_ggn(family, rng):
    """E[F] = G (cross-entropy on logits, binary cross-entropy on logits, MSE), and
    vᵀFv − vᵀGv = Σ_{i,s} X_is is a sum of independent zero-mean terms, one per example
    and draw. Bounds, each exceeded with probability ≤ δ = 2e-5: Hoeffding for the
    bounded categorical and Bernoulli terms (ranges from every outcome), Laurent-Massart
    for the weighted χ²₁ terms of the Gaussian. 3 families × 3 vectors × 2 sample
    counts = 18 checks: false-alarm probability ≤ 3.6e-4 (any seed). At S = 1024 every
    bound is below 10% of vᵀGv, so a bias of that size (a wrong κ, weights counted
    twice, the wrong distribution) fails."""
    delta, n = 2e-5, 40
    units = 3 if family == "categorical" else 2
    model = head_model(units, "logits")
    x, sw = rng.standard_normal((n, 4)), rng.uniform(0.5, 2.0, n)
    loss = {
        "categorical": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "bernoulli": keras.losses.BinaryCrossentropy(from_logits=True),
        "gaussian": "mse",
    }[family]
    y = random_labels(
        {"categorical": "sparse", "bernoulli": "binary"}.get(family, "real"), units, rng, n
    )
    data = (x, y, sw)
    ggn = GGNOperator.from_keras(model, loss, data, batch_size=16)
    V = rng.standard_normal((ggn.shape[0], 3))
    exact = np.einsum("ij,ij->j", V, ggn.matmat(V))
    (point,), J = point_jacobian(lambda: [model(x)], model.trainable_variables)
    tangents = np.einsum("ikp,pj->jik", J.reshape(n, units, -1), V)  # (vector, example, unit)
    weights = sw / n
    for samples in (4, 1024):
        op = FisherOperator.from_keras(model, loss, data, batch_size=16, num_samples=samples)
        estimate = np.einsum("ij,ij->j", V, op.matmat(V))
        for j, u in enumerate(tangents):
            if family == "gaussian":
                # X = (c_i (2/d) ‖u_i‖² / S)(χ²₁ − 1) per draw.
                a = np.repeat(weights * (2 / units) * np.sum(u**2, axis=1) / samples, samples)
                mean = np.sum(a)
                t = np.log(2 / delta)
                bound = 2 * np.linalg.norm(a) * np.sqrt(t) + 2 * a.max() * t
            else:
                probabilities, scores, kappa = _outcomes(family, point, units)
                q = np.stack([np.sum(s * u, axis=1) ** 2 for s in scores], axis=1)
                mean = np.sum(weights / kappa * np.sum(probabilities * q, axis=1))
                ranges = weights / (kappa * samples) * (q.max(axis=1) - q.min(axis=1))
                bound = np.sqrt(np.log(2 / delta) / 2 * samples * np.sum(ranges**2))
            assert mean == pytest.approx(exact[j], rel=1e-9)  # E[F] = G
            assert abs(estimate[j] - exact[j]) <= bound
            if samples == 1024:
                assert bound < 0.1 * exact[j]


def test_mc_fisher_is_fixed_per_batch_and_seeded(rng):
    model = head_model(3, "softmax")
    x, y = rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    loss = "sparse_categorical_crossentropy"
    V = rng.standard_normal((model.count_params(), 4))

    def fisher(**kwargs):
        return FisherOperator.from_keras(model, loss, (x, y), batch_size=BATCH, **kwargs)

    cached, streaming = fisher(cache=True), fisher(cache=False)
    first = cached.matmat(V)
    np.testing.assert_array_equal(cached.matmat(V), first)  # a second pass
    np.testing.assert_allclose(streaming.matmat(V), first, rtol=1e-13, atol=1e-16)
    np.testing.assert_array_equal(streaming.matmat(V), streaming.matmat(V))
    np.testing.assert_array_equal(fisher(seed=0).matmat(V), first)  # seed=0 is the default
    assert relative_error(fisher(seed=1).matmat(V), first) > 1e-3
    # Snapshot: the weights at construction, whatever happens to the model afterwards.
    model.set_weights([w + 0.5 for w in model.get_weights()])
    np.testing.assert_array_equal(cached.matmat(V), first)
    np.testing.assert_allclose(streaming.matmat(V), first, rtol=1e-13, atol=1e-16)


def _per_example_reference(losses, model, sw=None) -> np.ndarray:
    """(1/N) Σ_i w_i g_i g_iᵀ from per-example gradients."""
    g = per_example_gradients(losses, model.trainable_variables)
    w = np.ones(len(losses)) if sw is None else sw
    return (g.T * w) @ g / len(losses)


def test_empirical_fisher_matches_per_example_gradients(rng):
    model = head_model(3, "softmax")
    x, y, sw = rng.standard_normal((N, 4)), rng.integers(0, 3, N), rng.uniform(0.5, 2, N)
    sce = keras.losses.SparseCategoricalCrossentropy(dtype=F64)
    op = FisherOperator.from_keras(
        model, "sparse_categorical_crossentropy", (x, y, sw), batch_size=BATCH, kind="empirical"
    )
    assert op.curvature == "fisher-empirical" and op.kind == "empirical"
    losses = [lambda i=i: sce(y[i : i + 1], model(x[i : i + 1])) for i in range(N)]
    reference = _per_example_reference(losses, model, sw)
    assert relative_error(op.matmat(np.eye(op.shape[0])), reference) < 1e-9


def test_empirical_fisher_of_several_outputs_and_of_a_custom_loss(rng):
    """g_i is the gradient of example i's whole loss: Σ_o λ_o ℓ_io, cross-output terms
    included; a custom callable loss works (it has no predictive distribution)."""
    inputs = keras.Input((4,), dtype=F64)
    hidden = keras.layers.Dense(5, activation="tanh", dtype=F64)(inputs)
    model = keras.Model(
        inputs, [keras.layers.Dense(3, dtype=F64)(hidden), keras.layers.Dense(2, dtype=F64)(hidden)]
    )
    model.compile(
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        loss_weights=[0.7, 2.0],
    )
    x, sw = rng.standard_normal((N, 4)), rng.uniform(0.5, 2, N)
    y = [rng.integers(0, 3, N), rng.standard_normal((N, 2))]
    op = FisherOperator.from_keras(model, None, (x, y, sw), batch_size=BATCH, kind="empirical")
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=F64)
    mse = keras.losses.MeanSquaredError(dtype=F64)

    def example_loss(i):
        logits, value = model(x[i : i + 1])
        return 0.7 * sce(y[0][i : i + 1], logits) + 2.0 * mse(y[1][i : i + 1], value)

    reference = _per_example_reference([lambda i=i: example_loss(i) for i in range(N)], model, sw)
    assert relative_error(op.matmat(np.eye(op.shape[0])), reference) < 1e-9

    single = head_model(2, "logits")
    target = rng.standard_normal((N, 2))
    op = FisherOperator.from_keras(
        single, log_cosh, (x, target), batch_size=BATCH, kind="empirical"
    )
    losses = [lambda i=i: log_cosh(target[i : i + 1], single(x[i : i + 1])) for i in range(N)]
    reference = _per_example_reference(losses, single)
    assert relative_error(op.matmat(np.eye(op.shape[0])), reference) < 1e-9


@pytest.mark.parametrize("kind", ["mc", "empirical"])
def test_regularization_enters_with_its_exact_hessian(kind, rng):
    model = head_model(3, "logits", regularizer=keras.regularizers.L2(0.25))
    x, y = rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    eye = np.eye(model.count_params())

    def fisher(**kwargs):
        return FisherOperator.from_keras(model, loss, (x, y), batch_size=BATCH, kind=kind, **kwargs)

    difference = fisher().matmat(eye) - fisher(include_regularization=False).matmat(eye)
    expected = np.zeros_like(difference)
    expected[:20, :20] = 2 * 0.25 * np.eye(20)
    np.testing.assert_allclose(difference, expected, atol=1e-12)


def test_bad_input(rng):
    model = head_model(3, "logits")
    x, y = rng.standard_normal((N, 4)), rng.integers(0, 3, N)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(loss=sce, data=(x, y), **kwargs):
        return FisherOperator.from_keras(model, loss, data, **kwargs)

    for kind in ("exact", None, 3, "MC"):
        with pytest.raises(ValueError, match=r"kind must be one of \('mc', 'empirical'\)"):
            build(kind=kind)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        build(num_samples=0)
    for value in (True, 2.0, "4"):
        with pytest.raises(TypeError, match="num_samples must be an integer"):
            build(num_samples=value)
    with pytest.raises(ValueError, match="num_samples is for kind='mc'"):
        build(kind="empirical", num_samples=4)
    with pytest.raises(ValueError, match="predictive distribution.*'empirical' or GGNOperator"):
        build(loss=lambda y_true, y_pred: tf.reduce_mean((y_true - y_pred) ** 2))
    with pytest.raises(ValueError, match="predictive distribution"):
        build(loss="categorical_hinge", data=(x, np.eye(3)[y]))
    with pytest.raises(ValueError, match="label_smoothing=0.1"):
        build(
            loss=keras.losses.CategoricalCrossentropy(label_smoothing=0.1), data=(x, np.eye(3)[y])
        )
    with pytest.raises(ValueError, match="reduction='sum'"):
        build(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"))
    two = keras.Model(model.input, [model.output, model.output])
    with pytest.raises(ValueError, match="one sample_weight array for all outputs"):
        FisherOperator.from_keras(
            two, [sce, sce], (x, [y, y], [np.ones(N), np.ones(N)]), kind="empirical"
        )
    with pytest.raises(TypeError, match=r"FisherOperator.from_keras\(model, loss, data"):
        FisherOperator(lambda: tf.constant(1.0), [])
    with pytest.raises(TypeError, match="model must be a keras.Model"):
        FisherOperator.from_keras(lambda t: t, sce, (x, y))
    assert spectra.FisherOperator is FisherOperator


# The empirical-Fisher convention, against per-example gradients computed densely.
#
# spectra's empirical Fisher is E = (1/N) Σ_i g_i g_iᵀ with g_i the gradient of Keras'
# per-example loss ℓ_i. For MSE Keras averages over the C output entries,
# ℓ_i = (1/C) Σ_c (z_ic − y_ic)²; curvlinops' convention (PyTorch's ``MSELoss``) takes the
# per-example loss summed over the outputs, ℓ'_i = Σ_c (z_ic − y_ic)² = C ℓ_i, with the
# reduction factor 1/(N·C) of the mean over all N·C entries, so its matrix is
# (1/(N·C)) Σ_i g'_i g'_iᵀ = (C²/(N·C)) Σ_i g_i g_iᵀ = C·E: exactly C times spectra's.
# For cross-entropy the per-example loss is the same in both (a sum over the classes)
# and the reduction factor 1/N, so the matrices agree: C plays no role.

N, BATCH = 11, 4


def _model(outputs: int) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(5, activation="tanh", dtype=F64),
            keras.layers.Dense(outputs, dtype=F64),
        ]
    )


def _gradients(model, x, per_example_loss) -> np.ndarray:
    """Row i: ∇_θ per_example_loss(i, z_i), one tape per example."""
    losses = [lambda i=i: per_example_loss(i, model(x[i : i + 1])[0]) for i in range(x.shape[0])]
    return per_example_gradients(losses, model.trainable_variables)


def _spectra_empirical_fisher(model, loss, x, y) -> np.ndarray:
    E = FisherOperator.from_keras(model, loss, (x, y), batch_size=BATCH, kind="empirical")
    return E.matmat(np.eye(E.shape[0]))


@pytest.mark.parametrize("outputs", [1, 3])
def test_mse_empirical_fisher_is_the_keras_per_example_mean_and_curvlinops_is_c_times(outputs, rng):
    C = outputs
    model = _model(C)
    x, y = rng.standard_normal((N, 4)), rng.standard_normal((N, C))
    E = _spectra_empirical_fisher(model, "mse", x, y)

    # Keras' per-example loss: the mean over the C outputs.
    keras_g = _gradients(
        model, x, lambda i, z: keras.losses.mean_squared_error(y[i : i + 1], z[None])[0]
    )
    assert relative_error(E, keras_g.T @ keras_g / N) < 1e-12

    # curvlinops: the per-example loss summed over the outputs, reduction factor 1/(N·C).
    summed_g = _gradients(model, x, lambda i, z: tf.reduce_sum((z - y[i]) ** 2))
    curvlinops = summed_g.T @ summed_g / (N * C)
    assert relative_error(curvlinops, C * E) < 1e-12
    if C > 1:
        assert relative_error(curvlinops, E) > 0.5  # the conventions differ


def test_cross_entropy_empirical_fisher_agrees_in_both_conventions(rng):
    C = 3
    model = _model(C)
    x, y = rng.standard_normal((N, 4)), rng.integers(0, C, N)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    E = _spectra_empirical_fisher(model, loss, x, y)

    # −log softmax(z)_y, written out: the same per-example loss in both conventions.
    g = _gradients(model, x, lambda i, z: tf.reduce_logsumexp(z) - z[y[i]])
    assert relative_error(E, g.T @ g / N) < 1e-12
