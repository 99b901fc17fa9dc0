"""The estimators on a HessianOperator of a small Keras model, against its dense Hessian."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _dense import FD_TRUTH_RTOL, dense_hessian, relative_error

import spectra
from spectra.operators import HessianOperator


@pytest.fixture(scope="module")
def problem():
    """A float64 MLP on 60 examples (three unequal batches) and its dense Hessian."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64"),
            keras.layers.Dense(4, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 6))
    y = rng.integers(0, 4, 60)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = HessianOperator.from_keras(model, loss, (x, y), batch_size=25)
    H = dense_hessian(lambda: loss(y, model(x)), model.trainable_variables)
    return op, H


def test_extreme_eigenvalues_by_every_method(problem):
    op, H = problem
    exact = np.linalg.eigvalsh(H)
    # The bounds (~1e-15 here) are claims about the operator's own eigenvalues, below the
    # finite-difference truth's accuracy (~1e-11·‖H‖): check them against eigh of the
    # operator's dense matrix, and that matrix against the truth.
    dense = op @ np.eye(op.shape[0])
    assert relative_error(dense, H) < FD_TRUTH_RTOL
    exact_op = np.linalg.eigvalsh((dense + dense.T) / 2)
    for method in ("lanczos", "power", "lobpcg"):
        # Power iteration converges like (λ_{i+1}/λ_i)^m; two pairs keep it within budget.
        k = 2 if method == "power" else 3
        top = spectra.eigenvalues(op, k=k, method=method, tol=1e-10, seed=1)
        np.testing.assert_allclose(top.eigenvalues, exact[::-1][:k], rtol=1e-7, err_msg=method)
        errors = np.abs(top.eigenvalues - exact_op[::-1][:k])
        assert np.all(errors <= top.error_bounds * (1 + 1e-9)), method
        # Power iteration's values are as accurate, but it cannot rule out a larger
        # eigenvalue to 1e-10 at failure probability 1e-4 within its budget: it says so.
        assert top.all_converged == (method != "power"), method
    bottom = spectra.eigenvalues(op, k=2, which="smallest", tol=1e-10, seed=1)
    np.testing.assert_allclose(bottom.eigenvalues, exact[:2], rtol=1e-7, atol=1e-9)


def test_eigenvectors_are_hessian_eigenvectors(problem):
    op, H = problem
    result = spectra.eigenvalues(op, k=2, return_eigenvectors=True, tol=1e-10, seed=3)
    V = result.eigenvectors
    # tol bounds the eigenvalue error (≈ r²/gap), so the residual r itself is larger;
    # the reported residuals are the true ones and the vectors are the exact ones.
    residuals = np.linalg.norm(H @ V - V * result.eigenvalues, axis=0)
    np.testing.assert_allclose(result.residual_norms, residuals, rtol=1e-6, atol=1e-12)
    exact_vectors = np.linalg.eigh(H)[1][:, ::-1][:, :2]
    overlaps = np.abs(np.sum(V * exact_vectors, axis=0))
    np.testing.assert_allclose(overlaps, 1.0, atol=1e-8)
    # Back to per-layer arrays: one per variable, with the variables' shapes.
    layers = op.unflatten(V[:, 0])
    assert [a.shape for a in layers] == op.variable_shapes


def test_trace_estimators_cover_the_exact_trace(problem):
    op, H = problem
    exact = np.trace(H)
    for method in ("hutchinson", "hutch++", "xtrace"):
        result = spectra.trace(op, method=method, num_products=60, seed=2)
        # A bug (e.g. a batch weighted twice) moves the estimate far outside 5 stderr. By
        # chance: |t| > 5 with at least 19 degrees of freedom (Hutch++'s remainder) has
        # probability < 1e-4 per method (false alarm < 3e-4; seed fixed).
        assert abs(result.estimate - exact) <= 5 * result.stderr + 1e-8 * abs(exact), method
    # With the whole dimension in the Hutch++ sketch the estimate is exact.
    n = op.shape[0]
    exact_sketch = spectra.trace(op, method="hutch++", num_products=3 * n + 3, seed=0)
    assert exact_sketch.estimate == pytest.approx(exact, rel=1e-8)


def test_diagonal_and_density_moments(problem):
    op, H = problem
    diag = spectra.diagonal(op, num_products=200, seed=4)
    # Each of the 81 entries is outside 4 stderr (t, 199 degrees of freedom) with
    # probability 9e-5; three of them (more than 3%): below 1e-7.
    within = np.abs(diag.estimate - np.diag(H)) <= 4 * diag.stderr + 1e-10
    assert within.mean() > 0.97
    density = spectra.spectral_density(op, num_steps=op.shape[0], num_probes=20, seed=5)
    moments = density.moments(max_order=2)
    assert list(moments.orders[-2:]) == [1, 2]
    first, second = moments.estimate[-2:]
    first_err, second_err = moments.stderr[-2:]
    n = op.shape[0]
    # With a full Krylov space each probe's quadrature is exact for its probe vector:
    # the moment estimates are Hutchinson-type estimates of tr(H^p)/n. Means of 20 probes:
    # |t| > 6 with 19 degrees of freedom has probability 9e-6 (false alarm < 2e-5).
    assert first == pytest.approx(np.trace(H) / n, abs=6 * first_err)
    assert second == pytest.approx(np.trace(H @ H) / n, abs=6 * second_err + 1e-12)


def test_operator_counters_match_estimator_counts(problem):
    op, _ = problem
    before_hvps, before_passes = op.num_hvps, op.num_data_passes
    result = spectra.trace(op, method="hutchinson", num_products=40, seed=0)
    assert op.num_hvps - before_hvps == result.num_products
    assert op.num_data_passes - before_passes == result.num_operator_calls


@pytest.fixture(scope="module")
def float32_problem():
    """The same kind of MLP in float32 (the default HVP dtype) and the float64 dense
    Hessian of a float64 twin with exactly the same weights."""
    keras.utils.set_random_seed(11)

    def mlp(dtype):
        return keras.Sequential(
            [
                keras.Input((6,), dtype=dtype),
                keras.layers.Dense(7, activation="tanh", dtype=dtype),
                keras.layers.Dense(4, dtype=dtype),
            ]
        )

    model32, model64 = mlp("float32"), mlp("float64")
    model64.set_weights([w.astype(np.float64) for w in model32.get_weights()])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 6))
    y = rng.integers(0, 4, 60)
    loss32 = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss64 = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = HessianOperator.from_keras(model32, loss32, (x.astype(np.float32), y), batch_size=25)
    H = dense_hessian(lambda: loss64(y, model64(x)), model64.trainable_variables)
    assert op.dtype == np.float32
    return op, H


@pytest.mark.parametrize("which", ["largest", "smallest", "magnitude"])
def test_float32_eigenvalues_hold_their_bounds_against_the_float64_truth(float32_problem, which):
    op, H = float32_problem
    exact = np.linalg.eigvalsh(H)
    truth = {"largest": exact[::-1], "smallest": exact, "magnitude": exact[np.argsort(-abs(exact))]}
    for tol in (1e-3, 1e-8):
        result = spectra.eigenvalues(op, k=3, which=which, tol=tol, seed=1)
        assert result.all_converged
        errors = np.abs(result.eigenvalues - truth[which][:3])
        # Probabilistic part at the default failure probability 1e-4 (false alarm
        # < 1e-3 over these 6 runs); the float32 rounding is inside the bound's floor.
        assert np.all(errors <= result.error_bounds), (which, tol, errors, result.error_bounds)
        # and the floor is not vacuous: 10·eps32·‖H‖
        assert np.all(result.error_bounds <= max(tol, 2e-6) * np.abs(exact).max())


def test_float32_trace_diagonal_and_density_against_the_float64_truth(float32_problem):
    op, H = float32_problem
    exact = np.trace(H)
    for method in ("hutchinson", "hutch++", "xtrace"):
        result = spectra.trace(op, method=method, num_products=80, seed=2)
        # t-like statistic: |t| > 5 has probability < 1e-4 per method (false alarm
        # < 1e-3); float32 rounding (~1e-7 relative) is far below the stderr.
        assert abs(result.estimate - exact) <= 5 * result.stderr, method
    diag = spectra.diagonal(op, num_products=200, seed=4)
    # Binomial(81, 0.954) below 69 (85%): probability < 1e-5.
    coverage = np.mean(np.abs(diag.estimate - np.diag(H)) <= 2 * diag.stderr)
    assert 0.85 <= coverage <= 1.0
    density = spectra.spectral_density(op, num_steps=op.shape[0], num_probes=20, seed=5)
    moments = density.moments(max_order=2)
    n = op.shape[0]
    # A mean of 20 probes: |t| > 5 with 19 degrees of freedom, probability 8e-5.
    assert abs(moments.estimate[1] - exact / n) <= 5 * moments.stderr[1] + 1e-6
    # Full Krylov space: every node is an eigenvalue of H up to float32 rounding.
    nodes = density.nodes[density.weights > 1e-6]
    distances = np.min(np.abs(nodes[:, None] - np.linalg.eigvalsh(H)[None, :]), axis=1)
    assert distances.max() <= 1e-5 * np.abs(np.linalg.eigvalsh(H)).max()
