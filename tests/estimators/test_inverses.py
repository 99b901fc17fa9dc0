"""spectra.inverse: (C + λI)⁻¹ products by CG, MINRES, LSMR and the Neumann series, against
numpy.linalg.solve on SPD and indefinite matrices and on a Keras model's dense Hessian;
never an unconverged answer without an error or a warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _matrices import random_symmetric, with_spectrum

import spectra
from spectra.estimators.inverses import ConvergenceError, ConvergenceWarning, inverse
from spectra.estimators.results import InverseSolve, load

N = 60
DAMPING = 1e-2
TOL = 1e-8
METHODS = ("cg", "minres", "lsmr", "neumann")


@pytest.fixture(scope="module")
def spd():
    """An SPD matrix with eigenvalues 0.1..10 (κ(A + λI) ≈ 100) and a right-hand side."""
    matrix = with_spectrum(np.linspace(0.1, 10.0, N), seed=1)
    rhs = np.random.default_rng(0).standard_normal(N)
    return matrix, rhs


@pytest.fixture(scope="module")
def indefinite():
    """A semicircle spectrum on about [−1.4, 1.4], shifted by 0.05: indefinite, nonsingular."""
    matrix = random_symmetric(N, seed=2)
    rhs = np.random.default_rng(3).standard_normal(N)
    return matrix, rhs


def _system(matrix, damping):
    return matrix + damping * np.eye(matrix.shape[0])


def _check_solution(x, matrix, damping, rhs, tol, record, method):
    """The stated guarantee: relative residual <= tol (reported truthfully), hence a
    relative error <= κ·tol against numpy.linalg.solve."""
    system = _system(matrix, damping)
    residual = np.linalg.norm(system @ x - rhs) / np.linalg.norm(rhs)
    assert residual <= tol, (method, residual)
    np.testing.assert_allclose(record.relative_residuals, [residual], rtol=1e-3, atol=1e-15)
    exact = np.linalg.solve(system, rhs)
    kappa = np.linalg.cond(system)
    error = np.linalg.norm(x - exact) / np.linalg.norm(exact)
    assert error <= kappa * tol, (method, error, kappa * tol)


@pytest.mark.parametrize("method", METHODS)
def test_spd_solves_meet_the_tolerance(spd, method):
    matrix, rhs = spd
    inv = inverse(matrix, DAMPING, method=method, tol=TOL, maxiter=5000)
    x = inv @ rhs
    record = inv.last
    assert record.all_converged and record.reason is None, record.reason
    _check_solution(x, matrix, DAMPING, rhs, TOL, record, method)
    # ½·√κ·ln(2/tol) ≈ 100 for CG and MINRES; LSMR and Neumann ≈ κ·ln(1/tol).
    limit = {"cg": 100, "minres": 100, "lsmr": 400, "neumann": 2500}[method]
    assert 0 < record.iterations[0] <= limit, (method, record.iterations)
    assert record.num_products >= record.iterations[0] + 1  # + the true residual
    assert inv.history == [record]
    assert inv.num_products == inv.setup_products + record.num_products


@pytest.mark.parametrize("method", ("minres", "lsmr"))
def test_indefinite_solves_meet_the_tolerance(indefinite, method):
    matrix, rhs = indefinite
    assert np.linalg.eigvalsh(_system(matrix, 0.05))[0] < -1.0
    inv = inverse(matrix, 0.05, method=method, tol=TOL, maxiter=5000)
    x = inv @ rhs
    _check_solution(x, matrix, 0.05, rhs, TOL, inv.last, method)


def test_cg_detects_negative_curvature(indefinite):
    matrix, rhs = indefinite
    inv = inverse(matrix, 0.05, method="cg", tol=TOL)
    with pytest.raises(
        ConvergenceError, match=r"negative curvature: a direction p has pᵀ\(C \+ λI\)p/pᵀp = -"
    ) as info:
        inv @ rhs
    assert "use method='minres', or a damping above" in str(info.value)
    assert not inv.last.converged[0] and "negative curvature" in inv.last.reason
    # The damping it suggests is a lower bound on the one needed: −λ_min(C).
    suggested = float(str(info.value).split("a damping above ")[1].split(" ")[0])
    lowest = np.linalg.eigvalsh(matrix)[0]
    assert 0.05 < suggested <= -lowest
    # A damping above the most negative eigenvalue's magnitude makes it positive definite.
    damping = 0.5 - lowest
    x = inverse(matrix, damping, method="cg", tol=TOL) @ rhs
    np.testing.assert_allclose(_system(matrix, damping) @ x, rhs, atol=1e-6)


def test_neumann_divergence_is_reported(indefinite):
    matrix, rhs = indefinite
    with pytest.raises(ConvergenceError, match="the Neumann series diverges"):
        inverse(matrix, 0.05, method="neumann", tol=TOL) @ rhs
    # An explicit scale above 2/λ_max diverges on an SPD matrix too.
    spd_matrix = with_spectrum(np.linspace(1.0, 10.0, 20), seed=4)
    with pytest.raises(ConvergenceError, match=r"scale=0\.3 is above 2/λ_max"):
        inverse(spd_matrix, 0.0, method="neumann", scale=0.3) @ np.ones(20)


def test_default_neumann_scale_comes_from_a_certified_top_eigenvalue(spd):
    matrix, rhs = spd
    inv = inverse(matrix, DAMPING, method="neumann", tol=1e-6, maxiter=5000)
    top = np.linalg.eigvalsh(matrix)[-1] + DAMPING
    bound = inv.settings["lambda_max_bound"]
    assert top <= bound <= top * (1 + 1e-2)
    assert inv.scale == pytest.approx(1.0 / bound)
    assert inv.setup_products > 0
    x = inv @ rhs
    _check_solution(x, matrix, DAMPING, rhs, 1e-6, inv.last, "neumann")
    # A given scale is used as is, with no eigenvalue run.
    given = inverse(matrix, DAMPING, method="neumann", scale=0.15, tol=1e-6, maxiter=5000)
    assert given.scale == 0.15 and given.setup_products == 0
    _check_solution(given @ rhs, matrix, DAMPING, rhs, 1e-6, given.last, "neumann")


def test_non_convergence_raises_or_warns_never_silently(spd):
    matrix, rhs = spd
    inv = inverse(matrix, DAMPING, tol=1e-10, maxiter=3)
    with pytest.raises(
        ConvergenceError,
        match=r"inverse \(cg\): 1 of 1 right-hand side\(s\) not solved to tol=1e-10: "
        r"maxiter=3 iterations reached with a relative residual .* > tol=1e-10",
    ):
        inv @ rhs
    assert inv.last.iterations[0] == 3 and not inv.last.all_converged
    for method in METHODS:
        inv = inverse(matrix, DAMPING, method=method, tol=1e-10, maxiter=3, on_failure="warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = inv @ rhs
        assert len(caught) == 1 and caught[0].category is ConvergenceWarning, method
        assert caught[0].filename == __file__  # points at the user's line
        # The recorded residual is the true one of the returned iterate.
        residual = np.linalg.norm(_system(matrix, DAMPING) @ x - rhs) / np.linalg.norm(rhs)
        assert residual > 1e-10
        np.testing.assert_allclose(inv.last.relative_residuals[0], residual, rtol=1e-6)
        assert not inv.last.converged[0] and "maxiter=3" in inv.last.reason


def test_stagnation_of_a_float32_operator_is_reported(spd):
    matrix, rhs = spd
    inv = inverse(matrix.astype(np.float32), DAMPING, tol=1e-13, maxiter=2000)
    with pytest.raises(ConvergenceError, match="stagnates|maxiter"):
        inv @ rhs
    # at float32's resolution it converges
    x = inverse(matrix.astype(np.float32), DAMPING, tol=1e-4) @ rhs
    assert np.linalg.norm(_system(matrix, DAMPING) @ x - rhs) <= 2e-4 * np.linalg.norm(rhs)


@pytest.mark.parametrize("method", METHODS)
def test_matmat_solves_columns_in_lock_step(spd, method):
    matrix, rhs = spd
    block = np.stack([rhs, np.zeros(N), np.arange(N, dtype=float)], axis=1)
    inv = inverse(matrix, DAMPING, method=method, tol=TOL, maxiter=5000)
    solution = inv @ block
    exact = np.linalg.solve(_system(matrix, DAMPING), block)
    np.testing.assert_allclose(solution, exact, atol=1e-5 * np.abs(exact).max())
    np.testing.assert_array_equal(solution[:, 1], 0.0)
    record = inv.last
    assert record.converged.tolist() == [True, True, True]
    assert record.iterations[1] == 0 and record.relative_residuals[1] == 0.0
    if method != "lsmr":  # one matmat per iteration for all columns
        assert record.num_operator_calls <= record.iterations.max() + 2
        assert record.num_products > record.num_operator_calls


@pytest.mark.parametrize("method", METHODS)
def test_both_ends_of_floating_point(spd, method):
    matrix, rhs = spd
    exact = np.linalg.solve(_system(matrix, DAMPING), rhs)
    for factor in (1e-300, 1e300):
        inv = inverse(matrix * factor, DAMPING * factor, method=method, tol=TOL, maxiter=5000)
        x = inv @ rhs
        assert inv.last.relative_residuals[0] <= TOL, (method, factor)
        np.testing.assert_allclose(x * factor, exact, rtol=1e-5, err_msg=f"{method} {factor}")


def test_zero_operator_and_zero_rhs():
    inv = inverse(np.zeros((5, 5)), 2.0)
    np.testing.assert_allclose(inv @ np.arange(5.0), np.arange(5.0) / 2.0)
    np.testing.assert_array_equal(inv @ np.zeros(5), 0.0)
    assert inv.last.num_products == 0 and inv.last.all_converged


def test_the_record_round_trips(spd, tmp_path):
    matrix, rhs = spd
    inv = inverse(matrix, DAMPING, method="minres", tol=TOL)
    inv @ rhs
    path = tmp_path / "solve.json"
    inv.last.to_json(path)
    loaded = load(path)
    assert isinstance(loaded, InverseSolve)
    np.testing.assert_array_equal(loaded.converged, inv.last.converged)
    assert loaded.iterations.dtype == np.int64 and loaded.reason is None
    assert loaded.settings["method"] == "minres"


def test_public_names():
    assert spectra.inverse is inverse
    assert spectra.InverseSolve is InverseSolve
    assert issubclass(spectra.ConvergenceError, RuntimeError)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"damping": -1.0}, ValueError, r"damping must be >= 0 .*got -1\.0"),
        ({"damping": "1"}, TypeError, r"damping must be a number, got '1' \(str\)"),
        ({"damping": float("nan")}, ValueError, "damping must be a finite number"),
        (
            {"method": "gmres"},
            ValueError,
            r"method must be one of 'cg', 'minres', 'lsmr', 'neumann'",
        ),
        ({"tol": 0.0}, ValueError, "tol must be a positive finite number and < 1"),
        ({"tol": 1.0}, ValueError, "tol must be a positive finite number and < 1"),
        ({"maxiter": 0}, ValueError, "maxiter must be an integer >= 1, got 0"),
        ({"maxiter": 2.0}, TypeError, "maxiter must be an integer or None"),
        ({"on_failure": "ignore"}, ValueError, "on_failure must be one of 'raise', 'warn'"),
        ({"scale": 0.1}, ValueError, "scale is the Neumann series' step, for method='neumann'"),
        ({"method": "neumann", "scale": -0.1}, ValueError, "scale must be a positive"),
        ({"check_symmetry": 1}, TypeError, "check_symmetry must be True or False"),
        ({"seed": -1}, ValueError, "seed must be a non-negative integer"),
        ({"seed": 1.5}, TypeError, "seed must be None, a non-negative integer"),
    ],
)
def test_arguments_are_checked(spd, kwargs, error, message):
    matrix, _ = spd
    arguments = {"damping": DAMPING, **kwargs}
    with pytest.raises(error, match=message):
        inverse(matrix, **arguments)


def test_operators_and_right_hand_sides_are_checked(spd):
    matrix, _ = spd
    with pytest.raises(ValueError, match="operator must be square"):
        inverse(np.ones((3, 4)), 0.1)
    with pytest.raises(ValueError, match="not symmetric"):
        inverse(np.triu(np.ones((4, 4))) + np.eye(4), 0.1) @ np.arange(4.0)
    inv = inverse(matrix, DAMPING)
    with pytest.raises(ValueError, match="must be finite"):
        inv @ np.full(N, np.nan)
    with pytest.raises(ValueError, match="dimension mismatch|shape"):
        inv @ np.ones(N + 1)
    with pytest.raises(ValueError, match="top eigenvalue of C \\+ λI is about .* <= 0"):
        inverse(-matrix, 0.0, method="neumann")


# -- on a Keras model's Hessian ---------------------------------------------------------
@pytest.fixture(scope="module")
def hessian_problem():
    """A float64 MLP on 60 examples (three unequal batches), its operator and dense Hessian
    (as in tests/truths/test_estimators_on_hessian.py)."""
    keras = pytest.importorskip("keras")
    from _dense import dense_hessian

    from spectra.operators import HessianOperator

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
    hessian = dense_hessian(lambda: loss(y, model(x)), model.trainable_variables)
    return op, hessian


def test_damped_inverse_hessian_products(hessian_problem):
    op, hessian = hessian_problem
    n = hessian.shape[0]
    gradient_like = np.random.default_rng(5).standard_normal((n, 2))
    lowest = np.linalg.eigvalsh(hessian)[0]
    # MINRES with a small damping (the Hessian at a random point is indefinite)...
    damping = 1e-3
    inv = inverse(op, damping, method="minres", tol=1e-10, maxiter=2000)
    solution = inv @ gradient_like
    exact = np.linalg.solve(_system(hessian, damping), gradient_like)
    kappa = np.linalg.cond(_system(hessian, damping))
    errors = np.linalg.norm(solution - exact, axis=0) / np.linalg.norm(exact, axis=0)
    assert np.all(errors <= kappa * 1e-10), errors
    assert inv.last.all_converged
    # ...and CG with a damping that makes it positive definite, one matmat per iteration.
    damping = max(0.0, -lowest) + 0.1
    inv = inverse(op, damping, method="cg", tol=1e-10)
    solution = inv @ gradient_like
    exact = np.linalg.solve(_system(hessian, damping), gradient_like)
    np.testing.assert_allclose(solution, exact, rtol=1e-7, atol=1e-9 * np.abs(exact).max())
    assert inv.last.num_operator_calls <= inv.last.iterations.max() + 2


# -- singular C + λI: never an iterate worse than x = 0 ------------------------------------
def _least_squares_residual(matrix, rhs):
    """min_x ‖Cx − b‖/‖b‖ from eigh: the part of b outside C's numerical range."""
    values, vectors = np.linalg.eigh(matrix)
    kept = vectors[:, np.abs(values) > 1e-10 * np.abs(values).max()]
    return np.linalg.norm(rhs - kept @ (kept.T @ rhs)) / np.linalg.norm(rhs)


@pytest.fixture(scope="module")
def rank_five():
    """The reviewer's dense rank-5 20 × 20 PSD matrix U Uᵀ and right-hand side."""
    rng = np.random.default_rng(0)
    rhs = rng.standard_normal(20)
    u = rng.standard_normal((20, 5))
    return u @ u.T, rhs


@pytest.mark.parametrize("maxiter", [6, 7, 20, 50])
def test_minres_on_a_singular_matrix_stops_at_the_least_squares_residual(rank_five, maxiter):
    matrix, rhs = rank_five
    inv = inverse(matrix, 0.0, method="minres", tol=1e-8, maxiter=maxiter, on_failure="warn")
    with pytest.warns(ConvergenceWarning, match=r"C \+ λI is singular \(or numerically so\)"):
        x = inv @ rhs
    residual = np.linalg.norm(matrix @ x - rhs) / np.linalg.norm(rhs)
    # Before: 1.7e14 at maxiter 50 (scipy's minres: 0.85); the truth is 0.8394.
    assert residual == pytest.approx(_least_squares_residual(matrix, rhs), rel=1e-8)
    np.testing.assert_allclose(inv.last.relative_residuals, [residual], rtol=1e-6)
    with pytest.raises(ConvergenceError, match=r"singular \(or numerically so\).*add a damping"):
        inverse(matrix, 0.0, method="minres", tol=1e-8, maxiter=maxiter) @ rhs


@pytest.fixture(scope="module")
def singular_ggn():
    """The reviewer's GGN of 3 examples (rank 6 of 31), dense, and a right-hand side."""
    keras = pytest.importorskip("keras")
    from spectra.operators import GGNOperator

    keras.utils.set_random_seed(0)
    legacy = np.random.RandomState(0)  # the reviewer's stream: np.random after that seed
    x = legacy.randn(3, 3)
    y = legacy.randint(0, 3, 3)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, activation="softmax", dtype="float64"),
        ]
    )
    op = GGNOperator.from_keras(model, "sparse_categorical_crossentropy", (x, y))
    rhs = legacy.randn(op.shape[0])
    dense = op.matmat(np.eye(op.shape[0]))
    return op, (dense + dense.T) / 2, rhs


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_singular_ggn_is_named_singular_and_the_best_iterate_returned(singular_ggn, method):
    op, dense, rhs = singular_ggn
    assert np.linalg.matrix_rank(dense) == 6
    inv = inverse(op, 0.0, method=method, on_failure="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = inv @ rhs
    message = str(caught[0].message)
    assert "C + λI is singular (or numerically so)" in message, message
    assert "not positive definite" not in message and "add a damping ≳ " in message
    residual = np.linalg.norm(dense @ x - rhs) / np.linalg.norm(rhs)
    # Before: MINRES returned a relative residual 1.7e15 (‖x‖ 3e17), CG one of 7.7.
    assert residual <= 1.0
    if method == "minres":  # the least-squares residual, 0.9113
        assert residual == pytest.approx(_least_squares_residual(dense, rhs), rel=1e-6)
    np.testing.assert_allclose(inv.last.relative_residuals, [residual], rtol=1e-6)


def test_lsmr_reports_stagnation_on_a_float32_ggn():
    keras = pytest.importorskip("keras")
    from spectra.operators import GGNOperator

    keras.utils.set_random_seed(0)
    legacy = np.random.RandomState(0)  # the reviewer's stream: np.random after that seed
    x = legacy.randn(20, 3).astype("float32")
    y = legacy.randint(0, 3, 20)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    op = GGNOperator.from_keras(model, "sparse_categorical_crossentropy", (x, y), batch_size=7)
    rhs = legacy.randn(op.shape[0])
    inv = inverse(op, 1e-3, method="lsmr", tol=1e-9)
    # Before: "maxiter=310 iterations reached ...: raise maxiter" after 1250 products.
    with pytest.raises(ConvergenceError, match="the residual stagnates at"):
        inv @ rhs
    assert not inv.last.reason.startswith("maxiter=")


def test_lsmr_on_a_singular_matrix_names_it_singular(rank_five):
    matrix, rhs = rank_five
    inv = inverse(matrix, 0.0, method="lsmr", tol=1e-8, on_failure="warn")
    # Before: LSMR ran to maxiter=200 and said "raise maxiter or damping".
    with pytest.warns(ConvergenceWarning, match=r"C \+ λI is singular \(or numerically so\)"):
        x = inv @ rhs
    residual = np.linalg.norm(matrix @ x - rhs) / np.linalg.norm(rhs)
    assert residual == pytest.approx(_least_squares_residual(matrix, rhs), rel=1e-8)
    assert inv.last.iterations[0] < 200


# -- advice that works when followed --------------------------------------------------------
def _advised(message):
    return float(message.split("add a damping ≳ ")[1].split(" ")[0])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("method", ["cg", "minres", "lsmr"])
def test_the_damping_a_singular_matrix_is_told_to_add_works(rank_five, method, dtype):
    """Before: "add a damping ≳ 1e-8·λ_max" (4e-7 here): CG then needed ½·√κ·ln(2/tol)
    ≈ 1.6e4 iterations against maxiter 200, and in float32 that damping is below the
    products' rounding (eps32·λ_max = 5e-6), still singular."""
    matrix, rhs = rank_five
    op = matrix.astype(dtype)
    tol = 1e-5 if dtype == np.float64 else 1e-3
    # singular, or (LSMR in float32) stagnating at the products' rounding
    with pytest.raises(ConvergenceError, match=r"singular \(or numerically so\)|stagnates") as info:
        inverse(op, 0.0, method=method, tol=tol) @ rhs
    damping = _advised(str(info.value))
    top = np.linalg.eigvalsh(matrix)[-1]
    assert damping > 1e3 * np.finfo(dtype).eps * top  # above the products' rounding
    inv = inverse(op, damping, method=method, tol=tol)
    x = inv @ rhs  # no ConvergenceError: the advice works
    damped = op.astype(np.float64) + damping * np.eye(len(rhs))
    assert np.linalg.norm(damped @ x - rhs) <= 1.01 * tol * np.linalg.norm(rhs)


def test_cg_on_a_singular_system_points_to_a_least_squares_method(rank_five):
    """CG's residual grows from its first step on an inconsistent singular system, so its
    best iterate is x = 0: its message names LSMR for a least-squares answer, not
    on_failure='warn' (which returned x = 0 when the message suggested it)."""
    matrix, rhs = rank_five
    with pytest.raises(ConvergenceError) as info:
        inverse(matrix, 0.0, method="cg") @ rhs
    assert "use method='lsmr' with on_failure='warn'" in str(info.value)
    with pytest.warns(ConvergenceWarning, match="singular"):
        x = inverse(matrix, 0.0, method="lsmr", tol=1e-8, on_failure="warn") @ rhs
    residual = np.linalg.norm(matrix @ x - rhs) / np.linalg.norm(rhs)
    assert residual == pytest.approx(_least_squares_residual(matrix, rhs), rel=1e-8)


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_warn_returns_the_best_iterate_of_a_nearly_consistent_singular_system(method):
    """b = C x₀ + 1e-6·noise: the iterates approach x₀'s residual before the singular
    directions stop them; "warn" returns that iterate (residual ≈ 1e-6), not x = 0."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal((20, 5))
    matrix = u @ u.T
    rhs = matrix @ rng.standard_normal(20) + 1e-6 * rng.standard_normal(20)
    inv = inverse(matrix, 0.0, method=method, tol=1e-12, on_failure="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        x = inv @ rhs
    residual = np.linalg.norm(matrix @ x - rhs) / np.linalg.norm(rhs)
    assert residual <= 2 * _least_squares_residual(matrix, rhs) + 1e-12, residual


@pytest.mark.parametrize("method", ["cg", "minres", "lsmr", "neumann"])
def test_a_huge_damping_is_a_scaled_identity_not_singular(rank_five, method):
    """Before: inverse(C, 1e200) said "singular ... add a damping ≳ inf" (‖C + λI‖
    overflowed in the norms of its products)."""
    matrix, rhs = rank_five
    x = inverse(matrix, 1e200, method=method) @ rhs
    np.testing.assert_allclose(x, np.linalg.solve(matrix + 1e200 * np.eye(20), rhs), rtol=1e-10)
