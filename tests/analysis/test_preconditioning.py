"""The optimizer-preconditioned Hessian P^{-1/2} H P^{-1/2} against dense truth.

P is checked twice against Keras itself: against the second moments recomputed from
the recorded gradients, and against the step the optimizer actually took
(θ_t − θ_{t−1} = −η·(direction)/P, elementwise).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import scipy.linalg
import tensorflow as tf
from _dense import FD_TRUTH_RTOL, dense_hessian

import spectra
from spectra.analysis.preconditioning import preconditioner_diagonal

LEARNING_RATE = 0.05
STEPS = 3


def _mlp(name: str = "net", hidden: int = 7) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,), dtype="float64"),
            keras.layers.Dense(hidden, activation="tanh", dtype="float64", name="hidden"),
            keras.layers.Dense(4, dtype="float64", name="logits"),
        ],
        name=name,
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((60, 6)), rng.integers(0, 4, 60)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def _train(optimizer, steps: int = STEPS, seed: int = 7):
    """Full-batch steps of ``optimizer`` on a fresh float64 MLP.

    Returns the model and a record: the flat gradients of every step, the flat weights
    before and after the last step.
    """
    keras.utils.set_random_seed(seed)
    model = _mlp()
    x, y = _data()
    gradients, before = [], None
    for _ in range(steps):
        with tf.GradientTape() as tape:
            value = LOSS(y, model(x))
        grads = tape.gradient(value, model.trainable_variables)
        gradients.append(_flat([g.numpy() for g in grads]))
        before = _flat([v.numpy() for v in model.trainable_variables])
        optimizer.apply(grads, model.trainable_variables)
    after = _flat([v.numpy() for v in model.trainable_variables])
    return model, {"gradients": gradients, "before": before, "after": after}


def _ema(values, decay: float) -> np.ndarray:
    """Keras' exponential moving average from zero: s ← decay·s + (1 − decay)·value."""
    state = np.zeros_like(values[0])
    for value in values:
        state = decay * state + (1 - decay) * value
    return state


CASES = {
    "adam": lambda: keras.optimizers.Adam(LEARNING_RATE, beta_2=0.99, epsilon=1e-3),
    "adam_amsgrad": lambda: keras.optimizers.Adam(LEARNING_RATE, amsgrad=True, epsilon=1e-3),
    "adamw": lambda: keras.optimizers.AdamW(LEARNING_RATE, weight_decay=0.1, epsilon=1e-3),
    "rmsprop": lambda: keras.optimizers.RMSprop(LEARNING_RATE, rho=0.8, epsilon=1e-3),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(
        LEARNING_RATE, rho=0.8, epsilon=1e-3, centered=True
    ),
    # 0.125 is exact in float32, the dtype of Keras' initializer constants.
    "adagrad": lambda: keras.optimizers.Adagrad(
        LEARNING_RATE, epsilon=1e-3, initial_accumulator_value=0.125
    ),
}


def _expected(case: str, optimizer, record) -> tuple[np.ndarray, np.ndarray]:
    """P recomputed from the gradients, and the update direction d with Δθ = −η d / P."""
    grads = record["gradients"]
    squares = [g**2 for g in grads]
    t = len(grads)
    eps = optimizer.epsilon
    if case.startswith("adam"):
        if case == "adam_amsgrad":
            second = np.max([_ema(squares[: s + 1], optimizer.beta_2) for s in range(t)], axis=0)
        else:
            second = _ema(squares, optimizer.beta_2)
        p = (np.sqrt(second) + eps) / np.sqrt(1 - optimizer.beta_2**t)
        direction = _ema(grads, optimizer.beta_1) / (1 - optimizer.beta_1**t)
    elif case.startswith("rmsprop"):
        second = _ema(squares, optimizer.rho)
        if optimizer.centered:
            second = second - _ema(grads, optimizer.rho) ** 2
        p = np.sqrt(second + eps)
        direction = grads[-1]
    else:
        accumulator = optimizer.initial_accumulator_value + np.sum(squares, axis=0)
        p = np.sqrt(accumulator + eps)
        direction = grads[-1]
    return p, direction


@pytest.mark.parametrize("case", sorted(CASES))
def test_preconditioner_is_what_keras_divides_by(case):
    optimizer = CASES[case]()
    model, record = _train(optimizer)
    p = preconditioner_diagonal(optimizer, model.trainable_variables)
    expected, direction = _expected(case, optimizer, record)
    np.testing.assert_allclose(p, expected, rtol=1e-10)
    # The last step Keras took: Δθ = −η·direction/P (AdamW first decays θ by η·wd·θ).
    step = record["after"] - record["before"]
    if case == "adamw":
        step = step + LEARNING_RATE * optimizer.weight_decay * record["before"]
    moved = np.abs(step) > 1e-8
    assert moved.mean() > 0.9
    # Keras turns η and the β's into float32 constants before casting them to the
    # variables' float64: with β₂ = 0.999 at t = 3 that moves its step by 7e-6 (relative).
    np.testing.assert_allclose(-LEARNING_RATE * direction[moved] / step[moved], p[moved], rtol=3e-5)


@pytest.fixture(scope="module")
def adam_problem():
    """A float64 MLP after three Adam steps, its Hessian operator and dense Hessian."""
    optimizer = CASES["adam"]()
    model, record = _train(optimizer)
    x, y = _data()
    op = spectra.HessianOperator.from_keras(model, LOSS, (x, y), batch_size=25)
    H = dense_hessian(lambda: LOSS(y, model(x)), model.trainable_variables)
    p, _ = _expected("adam", optimizer, record)
    op.loss()  # the first pass fills the cache; pass counts below start after it
    return model, optimizer, op, H, p


def test_operator_is_dense_DHD_with_the_eigenvalues_of_P_inverse_H(adam_problem):
    _, optimizer, op, H, p = adam_problem
    pop = spectra.preconditioned(op, optimizer)
    d = 1 / np.sqrt(p)
    dense = d[:, None] * H * d[None, :]
    n = H.shape[0]
    passes = op.num_data_passes
    product = pop.matmat(np.eye(n))
    assert op.num_data_passes == passes + 1  # one pass for the whole block
    np.testing.assert_allclose(product, dense, atol=1e-12 * np.abs(dense).max())
    vector = np.random.default_rng(1).standard_normal(n)
    # The finite-difference truth: ~1e-11 relative per component (FD_TRUTH_RTOL).
    np.testing.assert_allclose(pop @ vector, dense @ vector, rtol=FD_TRUTH_RTOL)
    # Eigenvalues of P⁻¹H: the generalized problem H x = λ P x.
    exact = scipy.linalg.eigh(H, np.diag(p), eigvals_only=True)[::-1]
    top = spectra.eigenvalues(pop, k=3, tol=1e-10, return_eigenvectors=True, seed=0)
    np.testing.assert_allclose(top.eigenvalues, exact[:3], rtol=1e-8)
    # D u is an eigenvector of P⁻¹H: P⁻¹H·Du − λ·Du = D(DHD·u − λu), so its residual is
    # at most max(D) times the reported one.
    x = pop.to_parameters(top.eigenvectors)
    residuals = np.linalg.norm((H @ x) / p[:, None] - x * top.eigenvalues, axis=0)
    # The truth's error δH (‖δH‖ ≲ FD_TRUTH_RTOL·‖H‖) moves a residual by ‖δH x‖/min(p).
    truth = FD_TRUTH_RTOL * np.linalg.norm(H) * np.linalg.norm(x, axis=0) / p.min()
    assert np.all(residuals <= d.max() * top.residual_norms * (1 + 1e-6) + truth + 1e-12)
    assert np.all(top.residual_norms < 1e-3 * exact[0])
    # The gradient in the coordinates u = P^{1/2}θ.
    np.testing.assert_allclose(pop.gradient(), d * op.gradient(), rtol=1e-12)
    assert pop.variables is op.variables and pop.variable_shapes == op.variable_shapes
    assert pop.loss() == op.loss()


def test_user_diagonal_and_per_layer_preconditioned_blocks(adam_problem):
    *_, op, H, _ = adam_problem
    p = np.random.default_rng(2).uniform(0.5, 3.0, H.shape[0])
    pop = spectra.preconditioned(op, p)
    dense = H / np.sqrt(p)[:, None] / np.sqrt(p)[None, :]
    np.testing.assert_allclose(pop.matmat(np.eye(H.shape[0])), dense, atol=1e-12)
    exact = scipy.linalg.eigh(H, np.diag(p), eigvals_only=True)[-1]
    assert spectra.eigenvalues(pop, tol=1e-10).eigenvalues[0] == pytest.approx(exact, rel=1e-8)
    # Per-layer spectra of the preconditioned operator: its variables pass through.
    per_layer = spectra.layerwise(pop, k=2, tol=1e-10)
    assert per_layer.groups == ["hidden", "logits"]
    for i, indices in enumerate((np.arange(0, 49), np.arange(49, 81))):
        block = dense[np.ix_(indices, indices)]
        np.testing.assert_allclose(
            per_layer.eigenvalues[i], np.linalg.eigvalsh(block)[::-1][:2], rtol=1e-8
        )


def test_epsilon_override_and_loss_scale_wrapper():
    optimizer = keras.optimizers.LossScaleOptimizer(CASES["adam"]())
    model, _ = _train(optimizer)
    inner = optimizer.inner_optimizer
    t = int(inner.iterations.numpy())
    base = preconditioner_diagonal(optimizer, model.trainable_variables)
    np.testing.assert_allclose(
        base, preconditioner_diagonal(inner, model.trainable_variables), rtol=0
    )
    larger = preconditioner_diagonal(optimizer, model.trainable_variables, epsilon=0.5)
    np.testing.assert_allclose(
        larger - base, (0.5 - inner.epsilon) / np.sqrt(1 - inner.beta_2**t), rtol=1e-9
    )


def test_slots_matched_by_path_for_a_model_with_the_same_names():
    optimizer = CASES["adam"]()
    trained, _ = _train(optimizer)
    twin = _mlp()  # same names, other variable objects
    x, y = _data()
    op = spectra.HessianOperator.from_keras(twin, LOSS, (x, y))
    expected = preconditioner_diagonal(optimizer, trained.trainable_variables)
    np.testing.assert_allclose(spectra.preconditioned(op, optimizer).preconditioner, expected)


def test_bad_optimizers_and_diagonals_are_refused_clearly(adam_problem):
    model, optimizer, op, H, _ = adam_problem
    n = H.shape[0]
    x, y = _data()
    with pytest.raises(ValueError, match="never been applied"):
        spectra.preconditioned(op, keras.optimizers.Adam())
    built = keras.optimizers.Adam()
    built.build(model.trainable_variables)
    with pytest.raises(ValueError, match="never been applied"):
        spectra.preconditioned(op, built)
    with pytest.raises(ValueError, match="SGD has no preconditioner"):
        spectra.preconditioned(op, keras.optimizers.SGD())
    with pytest.raises(ValueError, match="Nadam is not supported"):
        spectra.preconditioned(op, keras.optimizers.Nadam())
    stranger = _mlp(name="other", hidden=5)
    other_op = spectra.HessianOperator.from_keras(stranger, LOSS, (x, y))
    with pytest.raises(ValueError, match="'other/hidden/kernel' is not tracked"):
        spectra.preconditioned(other_op, optimizer)
    with pytest.raises(ValueError, match="no variables"):
        spectra.preconditioned(H, optimizer)
    with pytest.raises(ValueError, match="has length 80"):
        spectra.preconditioned(op, np.ones(n - 1))
    with pytest.raises(ValueError, match="positive and finite; 1 of its 81"):
        spectra.preconditioned(op, np.r_[np.ones(n - 1), 0.0])
    with pytest.raises(ValueError, match="positive and finite"):
        spectra.preconditioned(op, np.r_[np.ones(n - 1), np.nan])
    with pytest.raises(ValueError, match="flat vector"):
        spectra.preconditioned(op, np.ones((n, 1)))
    with pytest.raises(ValueError, match="epsilon applies to an optimizer"):
        spectra.preconditioned(op, np.ones(n), epsilon=1e-8)
    with pytest.raises(TypeError, match="Keras optimizer or a flat array"):
        spectra.preconditioned(op, "adam")
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        spectra.preconditioned(op, optimizer, epsilon=-1.0)


def test_state_missing_from_an_unknown_keras_layout_is_refused_clearly():
    optimizer = CASES["rmsprop"]()
    model, _ = _train(optimizer, steps=1)
    optimizer._velocities = []  # as if a Keras release kept the state elsewhere
    with pytest.raises(RuntimeError, match="cannot find the RMSprop state '_velocities'"):
        preconditioner_diagonal(optimizer, model.trainable_variables)


def test_zero_second_moment_with_zero_epsilon_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,), dtype="float64"), keras.layers.Dense(1)])
    x = np.c_[np.zeros(8), np.arange(8.0)]  # the first kernel entry never gets a gradient
    optimizer = keras.optimizers.Adam()
    model.compile(optimizer, "mse")
    model.fit(x, np.ones(8), verbose=0, epochs=1)
    assert preconditioner_diagonal(optimizer, model.trainable_variables).min() > 0
    with pytest.raises(ValueError, match="1 entries that are zero, negative"):
        preconditioner_diagonal(optimizer, model.trainable_variables, epsilon=0.0)
