"""Tests of spectra.estimators._preamble: what the estimators accept and refuse: finite
products, symmetric operators, type-strict arguments.
"""

from __future__ import annotations

import numpy as np
import pytest
from _matrices import BlockOperator, random_symmetric, single_blas_thread
from scipy.sparse.linalg import LinearOperator

from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.krylov import lanczos
from spectra.estimators.stochastic_diagonal import diagonal
from spectra.estimators.stochastic_trace import (
    frobenius_norm,
    hutchinson_trace,
    hutchpp_trace,
    trace,
    xtrace,
)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


class BrokenAfter(LinearOperator):
    """A symmetric matrix whose products turn non-finite from product ``first_bad`` on
    (counting columns), as a Hessian with a NaN weight would."""

    def __init__(self, matrix, first_bad, value=np.nan):
        self.matrix, self.first_bad, self.value = matrix, first_bad, value
        self.columns = 0
        super().__init__(dtype=matrix.dtype, shape=matrix.shape)

    def _matmat(self, x):
        out = self.matrix @ x
        for column in range(x.shape[1]):
            self.columns += 1
            if self.columns >= self.first_bad:
                out[3, column] = self.value
        return out

    def _matvec(self, x):
        return self._matmat(x.reshape(-1, 1)).reshape(-1)


ESTIMATORS = {
    "eigenvalues (lanczos)": lambda op: eigenvalues(op, k=2),
    "eigenvalues (power)": lambda op: eigenvalues(op, method="power"),
    "eigenvalues (lobpcg)": lambda op: eigenvalues(op, k=2, method="lobpcg"),
    "lanczos": lambda op: lanczos(op, 20),
    "trace (hutchinson)": lambda op: hutchinson_trace(op, num_products=40, block_size=4),
    "trace (hutch++)": lambda op: hutchpp_trace(op, num_products=40),
    "trace (xtrace)": lambda op: xtrace(op, num_products=40),
    "diagonal": lambda op: diagonal(op, num_products=40, block_size=4),
    "frobenius_norm": lambda op: frobenius_norm(op, num_products=40, block_size=4),
    "spectral_density": lambda op: spectral_density(op, num_steps=10, num_probes=3),
}


@pytest.mark.parametrize("label", sorted(ESTIMATORS))
@pytest.mark.parametrize("first_bad", [1, 7])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_products_are_refused_with_their_origin(label, first_bad, value):
    operator = BrokenAfter(random_symmetric(60, seed=1), first_bad, value)
    with pytest.raises(ValueError) as caught:
        ESTIMATORS[label](operator)
    message = str(caught.value)
    assert message.startswith(f"{label}: product")
    assert "non-finite value(s) (NaN or Inf)" in message
    assert "operator call" in message and "weights, the loss and the data" in message
    # The cause is not asymmetry: the message must not suggest skipping that check.
    assert "check_symmetry" not in message and "not symmetric" not in message


def test_non_finite_message_names_the_product_number():
    operator = BrokenAfter(random_symmetric(60, seed=1), 7)
    with pytest.raises(
        ValueError, match=r"^eigenvalues \(lanczos\): product 7 \(operator call 7\)"
    ):
        eigenvalues(operator)
    operator = BrokenAfter(random_symmetric(60, seed=1), 7)
    with pytest.raises(ValueError, match=r"products 5-8 \(operator call 2\)"):
        hutchinson_trace(operator, num_products=40, block_size=4)


@pytest.mark.parametrize("label", sorted(ESTIMATORS))
def test_asymmetric_operators_are_refused_without_extra_products(label):
    rng = np.random.default_rng(0)
    asymmetric = random_symmetric(60, seed=2) + 0.2 * rng.standard_normal((60, 60))
    with pytest.raises(ValueError, match="not symmetric.*check_symmetry=False"):
        ESTIMATORS[label](asymmetric)
    # The test rides on the estimator's own products: a symmetric operator costs nothing
    # extra (each column the operator sees is one the estimator asked for).
    operator = BlockOperator(random_symmetric(60, seed=2))
    result = ESTIMATORS[label](operator)
    assert operator.columns == result.num_products


def test_symmetry_check_is_sensitive_and_tolerates_float32_rounding():
    rng = np.random.default_rng(3)
    base = random_symmetric(80, seed=4)
    for estimator in (lambda op: eigenvalues(op), lambda op: trace(op, num_products=20)):
        # an asymmetry of 1e-6 relative is found in float64 (tolerance 1e-8)
        with pytest.raises(ValueError, match="not symmetric"):
            estimator(base + 1e-5 * np.triu(rng.standard_normal((80, 80))))
        estimator(base.astype(np.float32))  # float32 rounding passes (tolerance 1e-3)
        estimator(np.zeros((80, 80)))
    # The check can be skipped.
    eigenvalues(np.triu(np.ones((10, 10))), check_symmetry=False, max_products=20)


def test_a_single_product_still_gets_its_symmetry_check():
    with pytest.raises(ValueError, match="not symmetric"):
        lanczos(np.triu(np.ones((10, 10))) + np.eye(10), 1)
    result = lanczos(random_symmetric(10), 1)
    assert result.num_products == 2  # one extra product, only in this case


def test_numeric_arguments_are_type_strict():
    a = random_symmetric(20, seed=5)
    result = eigenvalues(a, tol=np.float32(1e-3))
    assert result.settings["tol"] == pytest.approx(1e-3)
    eigenvalues(a, tol=np.float64(1e-4), failure_probability=np.float32(0.01))
    trace(a, rtol=np.float32(0.5), num_products=np.int64(20))
    # A wrong type is a TypeError, a wrong value a ValueError; the argument is named first.
    for call, name, error in (
        (lambda: eigenvalues(a, k=True), "k", TypeError),
        (lambda: eigenvalues(a, tol=True), "tol", TypeError),
        (lambda: eigenvalues(a, max_products=True), "max_products", TypeError),
        (lambda: eigenvalues(a, tol="1e-3"), "tol", TypeError),
        (lambda: eigenvalues(a, failure_probability=1.0), "failure_probability", ValueError),
        (lambda: eigenvalues(a, failure_probability=0), "failure_probability", ValueError),
        (lambda: eigenvalues(a, k=0), "k", ValueError),
        (lambda: eigenvalues(a, method=3), "method", TypeError),
        (lambda: eigenvalues(a, which="top"), "which", ValueError),
        (lambda: trace(a, num_products=True), "num_products", TypeError),
        (lambda: trace(a, rtol=True), "rtol", TypeError),
        (lambda: trace(a, block_size=True), "block_size", TypeError),
        (lambda: trace(a, num_products=1.0), "num_products", TypeError),
        (lambda: diagonal(a, num_products=True), "num_products", TypeError),
        (lambda: frobenius_norm(a, num_products=True), "num_products", TypeError),
        (lambda: xtrace(a, num_products=True), "num_products", TypeError),
        (lambda: lanczos(a, True), "num_steps", TypeError),
        (lambda: spectral_density(a, num_probes=True), "num_probes", TypeError),
        (lambda: spectral_density(a, num_steps=np.True_), "num_steps", TypeError),
        (lambda: eigenvalues(a, check_symmetry="yes"), "check_symmetry", TypeError),
    ):
        with pytest.raises(error, match=f"^{name} must be "):
            call()


@pytest.mark.parametrize(
    ("seed", "error", "message"),
    [
        (True, TypeError, r"^seed must be None, a non-negative integer or a numpy"),
        ("0", TypeError, r"^seed must be None, a non-negative integer or a numpy"),
        (1.5, TypeError, r"^seed must be None, a non-negative integer or a numpy"),
        (np.False_, TypeError, r"^seed must be None, a non-negative integer or a numpy"),
        (-1, ValueError, r"^seed must be a non-negative integer, got -1$"),
    ],
)
def test_seed_errors_name_the_argument(seed, error, message):
    a = random_symmetric(20, seed=5)
    for call in (
        lambda: eigenvalues(a, seed=seed),
        lambda: trace(a, seed=seed),
        lambda: diagonal(a, seed=seed),
        lambda: spectral_density(a, seed=seed),
        lambda: lanczos(a, 3, seed=seed),
    ):
        with pytest.raises(error, match=message):
            call()
