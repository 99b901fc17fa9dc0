import time
import tracemalloc

import numpy as np
import pytest
from _matrices import (
    BlockOperator,
    MatvecOnly,
    hessian_like_spectrum,
    random_symmetric,
    single_blas_thread,
    with_spectrum,
)
from scipy.sparse.linalg import LinearOperator

from spectra.estimators._products import as_symmetric_operator
from spectra.estimators.krylov import batched_lanczos, lanczos, tridiagonal_eigh


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


def test_tridiagonal_relation_and_orthonormal_basis():
    a = random_symmetric(120, seed=1)
    result = lanczos(a, 40, return_basis=True, seed=3)
    q = result.basis
    assert q.shape == (120, 40)
    assert np.abs(q.T @ q - np.eye(40)).max() < 1e-10
    t = result.tridiagonal()
    assert np.abs(q.T @ a @ q - t).max() < 1e-10 * np.linalg.norm(a, 2)
    # A Q = Q T + beta_m q_{m+1} e_m^T: the residual lies in the last column only
    residual = a @ q - q @ t
    assert np.abs(residual[:, :-1]).max() < 1e-10
    assert np.linalg.norm(residual[:, -1]) == pytest.approx(result.residual_norm, rel=1e-8)
    assert result.num_products == 40 and not result.breakdown  # symmetry check: free


def test_breakdown_on_rank_three_matrix_gives_exact_eigenvalues():
    eigenvalues = np.zeros(80)
    eigenvalues[:3] = [5.0, -2.0, 1.0]
    result = lanczos(with_spectrum(eigenvalues, seed=2), 30, seed=0)
    assert result.breakdown
    # Krylov space of a generic start: range(A) plus the start's null-space part
    assert result.num_steps_taken == 4
    assert np.all(np.isfinite(result.alpha)) and np.all(np.isfinite(result.beta))
    ritz = np.sort(result.ritz_values())
    np.testing.assert_allclose(ritz, [-2.0, 0.0, 1.0, 5.0], atol=1e-12)


def test_zero_matrix_and_size_one():
    zero = lanczos(np.zeros((30, 30)), 10)
    assert zero.breakdown and zero.num_steps_taken == 1
    assert zero.alpha[0] == 0.0 and zero.residual_norm == 0.0
    one = lanczos(np.array([[2.5]]), 5)
    np.testing.assert_allclose(one.ritz_values(), [2.5])
    assert one.num_steps_taken == 1


def test_num_steps_is_capped_at_dimension_and_recovers_spectrum():
    eigenvalues = np.linspace(-3, 4, 12)
    result = lanczos(with_spectrum(eigenvalues), 50)
    assert result.num_steps_taken == 12
    np.testing.assert_allclose(result.ritz_values(), eigenvalues, atol=1e-12)


def test_without_reorthogonalization_early_steps_agree():
    a = random_symmetric(100, seed=4)
    full = lanczos(a, 8, seed=1)
    plain = lanczos(a, 8, seed=1, reorthogonalize=False)
    np.testing.assert_allclose(plain.alpha, full.alpha, atol=1e-10)
    np.testing.assert_allclose(plain.beta, full.beta, atol=1e-10)
    assert plain.basis is None


def test_v0_and_operator_wrappers():
    a = random_symmetric(40, seed=5)
    v0 = np.ones(40)
    direct = lanczos(a, 10, v0=v0)
    wrapped = MatvecOnly(a)
    via_matvec = lanczos(wrapped, 10, v0=v0)
    np.testing.assert_allclose(via_matvec.alpha, direct.alpha, atol=1e-12)
    assert via_matvec.num_operator_calls == 10  # one per step, symmetry check included
    assert via_matvec.settings["v0_given"]


def test_tridiagonal_eigh_matches_dense():
    rng = np.random.default_rng(0)
    alpha, beta = rng.standard_normal(7), rng.random(6)
    theta, vectors = tridiagonal_eigh(alpha, beta)
    dense = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
    np.testing.assert_allclose(theta, np.linalg.eigvalsh(dense), atol=1e-12)
    np.testing.assert_allclose(dense @ vectors, vectors * theta, atol=1e-12)
    with pytest.raises(ValueError, match="length"):
        tridiagonal_eigh(alpha, beta[:3])


def test_batched_lanczos_matches_single_recurrences_with_one_call_per_step():
    a = random_symmetric(60, seed=6)
    starts = np.random.default_rng(1).standard_normal((60, 4))
    operator = BlockOperator(a)
    counter = as_symmetric_operator(operator, "test", check_symmetry=False)
    alpha, beta, steps = batched_lanczos(counter, starts, 15)
    assert operator.matmat_calls == 15 and operator.matvec_calls == 0
    assert counter.num_products == 60
    assert np.all(steps == 15)
    for probe in range(4):
        single = lanczos(a, 15, v0=starts[:, probe])
        np.testing.assert_allclose(alpha[probe], single.alpha, atol=1e-10)
        np.testing.assert_allclose(beta[probe, :14], single.beta, atol=1e-10)


def test_invalid_arguments():
    a = random_symmetric(10)
    with pytest.raises(ValueError, match="num_steps"):
        lanczos(a, 0)
    with pytest.raises(ValueError, match="v0 must have length 10"):
        lanczos(a, 3, v0=np.ones(4))
    with pytest.raises(ValueError, match="nonzero"):
        lanczos(a, 3, v0=np.zeros(10))
    with pytest.raises(ValueError, match=r"square, got shape \(3, 4\)"):
        lanczos(np.ones((3, 4)), 2)
    with pytest.raises(ValueError, match="not symmetric"):
        lanczos(np.triu(np.ones((10, 10))), 2)


def test_reorthogonalization_keeps_the_basis_orthonormal_where_plain_lanczos_loses_it():
    """On a Hessian-like spectrum (outliers that converge fast over a dense bulk) plain
    Lanczos loses orthogonality within 40 steps (Paige 1971); full reorthogonalization
    keeps it at working precision, and T then has no spurious copies of λ₁."""
    spectrum = hessian_like_spectrum(300, seed=0)
    a = with_spectrum(spectrum, seed=0)
    full = lanczos(a, 60, return_basis=True, seed=1)
    q = full.basis
    assert np.abs(q.T @ q - np.eye(60)).max() < 1e-12
    plain = lanczos(a, 60, return_basis=True, reorthogonalize=False, seed=1)
    p = plain.basis
    assert np.abs(p.T @ p - np.eye(60)).max() > 0.5
    # Ghost copies: plain Lanczos shows λ₁ = 40 more than once, the reorthogonalized T once.
    assert np.sum(np.abs(plain.ritz_values() - 40.0) < 1e-6) >= 2
    assert np.sum(np.abs(full.ritz_values() - 40.0) < 1e-6) == 1
    # The density's batched recurrence reorthogonalizes as well.
    counter = as_symmetric_operator(a, "test", check_symmetry=False)
    alpha, beta, _ = batched_lanczos(
        counter, np.random.default_rng(1).standard_normal((300, 2)), 60
    )
    for probe in range(2):
        theta = tridiagonal_eigh(alpha[probe], beta[probe, :59], eigenvectors=False)[0]
        assert np.sum(np.abs(theta - 40.0) < 1e-6) == 1


# -- contracts that mutation testing (make mutate) found untested -------------------------
def _rank_three(n=80):
    eigenvalues = np.zeros(n)
    eigenvalues[:3] = [5.0, -2.0, 1.0]
    return with_spectrum(eigenvalues, seed=2)


def test_breakdown_means_stopped_before_the_requested_steps():
    """The Krylov space of the rank-3 matrix is exhausted after 4 steps: asked for 4 it is
    no breakdown, asked for 5 it is, at the same 4 steps."""
    a = _rank_three()
    exact = lanczos(a, 4, seed=0)
    early = lanczos(a, 5, seed=0)
    assert exact.num_steps_taken == early.num_steps_taken == 4
    assert not exact.breakdown and early.breakdown


@pytest.mark.parametrize("scale", [1e-14, 1e14])
def test_lanczos_is_invariant_to_the_scale_of_the_matrix(scale):
    """Breakdown is relative to ‖T‖: a matrix scaled by 1e-14 or 1e14 takes the same
    steps and its tridiagonal scales with it."""
    a = random_symmetric(60, seed=9)
    reference = lanczos(a, 20, seed=2)
    scaled = lanczos(scale * a, 20, seed=2)
    assert scaled.num_steps_taken == 20 and not scaled.breakdown
    np.testing.assert_allclose(scaled.alpha, scale * reference.alpha, rtol=1e-9, atol=0)
    np.testing.assert_allclose(scaled.beta, scale * reference.beta, rtol=1e-9)
    low = lanczos(scale * _rank_three(), 30, seed=0)
    assert low.breakdown and low.num_steps_taken == 4
    counter = as_symmetric_operator(scale * _rank_three(), "test", check_symmetry=False)
    starts = np.random.default_rng(3).standard_normal((80, 3))
    _, _, steps = batched_lanczos(counter, starts, 30)
    assert np.all((steps >= 4) & (steps <= 5)), steps


def test_tridiagonal_eigh_computes_in_float64_and_checks_its_input():
    rng = np.random.default_rng(3)
    alpha, beta = rng.standard_normal(40).astype(np.float32), rng.random(39).astype(np.float32)
    dense = np.diag(alpha.astype(float)) + np.diag(beta.astype(float), 1)
    dense += np.diag(beta.astype(float), -1)
    truth = np.linalg.eigvalsh(dense)  # float32 inputs are exact float64 numbers
    theta, vectors = tridiagonal_eigh(alpha, beta)
    assert theta.dtype == vectors.dtype == np.float64
    np.testing.assert_allclose(theta, truth, rtol=0, atol=1e-13 * np.abs(truth).max())
    np.testing.assert_allclose(dense @ vectors, vectors * theta, atol=1e-12)
    only, none = tridiagonal_eigh(alpha, beta, eigenvectors=False)
    assert none is None
    np.testing.assert_allclose(only, truth, rtol=0, atol=1e-13 * np.abs(truth).max())
    for bad_alpha, bad_beta in ((np.ones((2, 2)), np.ones(1)), (np.ones(0), np.ones(0))):
        with pytest.raises(ValueError, match="need alpha of length m >= 1 and beta of length"):
            tridiagonal_eigh(bad_alpha, bad_beta)


def test_result_records_its_settings_time_and_no_unrequested_basis():
    a = random_symmetric(30, seed=10)
    started = time.perf_counter()
    result = lanczos(a, 6, seed=4)
    elapsed = time.perf_counter() - started
    assert result.basis is None  # stored for reorthogonalization, not returned
    assert 0.0 <= result.wall_time <= elapsed
    assert result.settings == {
        "num_steps": 6,
        "reorthogonalize": True,
        "seed": 4,
        "v0_given": False,
        "dimension": 30,
    }
    assert lanczos(a, 6, reorthogonalize=False).settings["reorthogonalize"] is False
    # The default seed is 0.
    np.testing.assert_array_equal(lanczos(a, 6).alpha, lanczos(a, 6, seed=0).alpha)


def test_v0_is_taken_in_float64_whatever_its_dtype_and_shape():
    a = random_symmetric(30, seed=11)
    v0 = np.random.default_rng(5).standard_normal(30).astype(np.float32)
    reference = lanczos(a, 8, v0=v0.astype(np.float64))
    for same in (v0, v0.reshape(30, 1), v0.reshape(1, 30)):
        result = lanczos(a, 8, v0=same)
        np.testing.assert_allclose(result.alpha, reference.alpha, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(result.beta, reference.beta, rtol=1e-14, atol=1e-15)


def test_argument_messages_name_the_argument():
    a = random_symmetric(10)
    with pytest.raises(ValueError, match=r"^num_steps must be an integer >= 1, got 0"):
        lanczos(a, 0)
    with pytest.raises(ValueError, match=r"^v0 must be a finite, nonzero vector$"):
        lanczos(a, 3, v0=np.zeros(10))
    # check_symmetry=False is honoured: an asymmetric operator runs (at the caller's risk).
    asymmetric = np.triu(np.ones((10, 10)))
    assert lanczos(asymmetric, 2, check_symmetry=False).num_steps_taken == 2


def test_batched_lanczos_reports_integer_step_counts():
    counter = as_symmetric_operator(random_symmetric(20, seed=12), "test", check_symmetry=False)
    _, _, steps = batched_lanczos(counter, np.random.default_rng(6).standard_normal((20, 3)), 7)
    assert steps.dtype.kind == "i" and np.all(steps == 7)


def test_without_reorthogonalization_the_basis_is_not_stored():
    # Documented cost: plain Lanczos keeps three vectors, not the n × m basis (here 8 MB).
    n, steps = 50_000, 20
    diagonal = np.linspace(-1.0, 2.0, n)
    op = LinearOperator((n, n), matvec=lambda x: diagonal * x.ravel(), dtype=np.float64)
    tracemalloc.start()
    try:
        result = lanczos(op, steps, reorthogonalize=False, check_symmetry=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.alpha.shape == (steps,) and result.basis is None
    assert peak < 0.5 * steps * n * 8, peak


def test_tridiagonal_eigh_works_in_float64_whatever_it_is_given():
    from spectra.estimators.tridiagonal import tridiagonal_eigh

    rng = np.random.default_rng(2)
    alpha, beta = rng.standard_normal(30).astype(np.float32), rng.random(29).astype(np.float32)
    values, vectors = tridiagonal_eigh(alpha, beta)
    exact, exact_vectors = tridiagonal_eigh(alpha.astype(np.float64), beta.astype(np.float64))
    assert values.dtype == vectors.dtype == np.float64
    np.testing.assert_array_equal(values, exact)
    np.testing.assert_array_equal(np.abs(vectors), np.abs(exact_vectors))
    only_values, none = tridiagonal_eigh(alpha, beta.astype(np.float64), eigenvectors=False)
    assert none is None
    np.testing.assert_allclose(only_values, exact, rtol=0, atol=1e-13)
