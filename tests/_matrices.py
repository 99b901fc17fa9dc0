"""Test matrices with known spectra and operator wrappers for the estimator tests."""

from __future__ import annotations

import numpy as np
from scipy.sparse.linalg import LinearOperator


def with_spectrum(eigenvalues, seed: int = 0) -> np.ndarray:
    """Symmetric matrix Q diag(eigenvalues) Qᵀ with a random orthogonal Q."""
    eigenvalues = np.asarray(eigenvalues, dtype=np.float64)
    n = eigenvalues.size
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    matrix = (q * eigenvalues) @ q.T
    return 0.5 * (matrix + matrix.T)


def random_symmetric(n: int, seed: int = 0) -> np.ndarray:
    """GOE-like symmetric matrix (indefinite, semicircle spectrum)."""
    g = np.random.default_rng(seed).standard_normal((n, n))
    return (g + g.T) / np.sqrt(2 * n)


def hessian_like_spectrum(n: int, seed: int = 0) -> np.ndarray:
    """Bulk near zero (a few small negative values) plus ten outliers."""
    rng = np.random.default_rng(seed)
    outliers = np.array([40.0, 25.0, 18.0, 12.0, 9.0, 7.0, 5.0, 4.0, 3.0, 2.5])
    bulk = rng.gamma(0.5, 0.02, n - outliers.size) * rng.choice(
        [-0.2, 1.0], n - outliers.size, p=[0.2, 0.8]
    )
    return np.concatenate([outliers, bulk])


def clustered_top_spectrum(n: int, seed: int = 0) -> np.ndarray:
    """Four eigenvalues within 0.1% of each other at the top, then a bulk in [0, 5]."""
    rng = np.random.default_rng(seed)
    top = np.array([10.0, 9.995, 9.99, 9.98])
    return np.concatenate([top, rng.uniform(0.0, 5.0, n - top.size)])


def small_gap_spectrum(n: int, seed: int = 0) -> np.ndarray:
    """A top eigenvalue 0.1% above a dense bulk that reaches up to it (slow Lanczos)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[10.0], rng.uniform(-2.0, 9.99, n - 1)])


def repeated_top_spectrum(n: int, seed: int = 0) -> np.ndarray:
    """λ = 10 three times, then 9 and an indefinite bulk."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[10.0, 10.0, 10.0, 9.0], rng.uniform(-3.0, 6.0, n - 4)])


def hard_spectra(n: int) -> dict[str, np.ndarray]:
    """The spectra the eigenvalue-bound tests run on, by name."""
    return {
        "clustered top": clustered_top_spectrum(n),
        "small gap": small_gap_spectrum(n),
        "repeated top": repeated_top_spectrum(n),
        "hessian-like": hessian_like_spectrum(n),
    }


def low_rank_plus_noise(n: int, rank: int, noise: float, seed: int = 0) -> np.ndarray:
    """Eigenvalues 100/i² for i <= rank, then a small flat tail."""
    eigenvalues = np.full(n, noise)
    eigenvalues[:rank] = 100.0 / np.arange(1, rank + 1) ** 2
    return with_spectrum(eigenvalues, seed)


def in_which_order(eigenvalues, which: str) -> np.ndarray:
    """All eigenvalues in the order an estimator reports them for ``which``."""
    values = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    if which == "largest":
        return values[::-1]
    if which == "smallest":
        return values
    return values[np.argsort(-np.abs(values), kind="stable")]


def trace_errors(matrix: np.ndarray, method: str, num_products: int, seeds) -> tuple:
    """(estimate − tr A, stderr) of ``spectra.trace`` over seeds."""
    from spectra.estimators.stochastic_trace import trace

    truth = np.trace(matrix)
    results = [
        trace(matrix, method=method, num_products=num_products, seed=s, check_symmetry=False)
        for s in seeds
    ]
    errors = np.array([r.estimate - truth for r in results])
    return errors, np.array([r.stderr for r in results])


class MatvecOnly(LinearOperator):
    """Exposes only ``matvec``: scipy applies ``matmat`` column by column."""

    def __init__(self, matrix: np.ndarray):
        self.matrix = matrix
        self.matvec_calls = 0
        super().__init__(dtype=matrix.dtype, shape=matrix.shape)

    def _matvec(self, x):
        self.matvec_calls += 1
        return self.matrix @ x


class BlockOperator(LinearOperator):
    """Exposes ``matvec`` and a native ``matmat``, counts both and records every vector it
    is applied to (``inputs``, in order)."""

    def __init__(self, matrix: np.ndarray):
        self.matrix = matrix
        self.matvec_calls = 0
        self.matmat_calls = 0
        self.columns = 0
        self.inputs: list[np.ndarray] = []
        super().__init__(dtype=matrix.dtype, shape=matrix.shape)

    def _matvec(self, x):
        self.matvec_calls += 1
        self.columns += 1
        self.inputs.append(np.array(x, dtype=np.float64).reshape(-1))
        return self.matrix @ np.ravel(x)

    def _matmat(self, x):
        self.matmat_calls += 1
        self.columns += x.shape[1]
        self.inputs.extend(np.array(column, dtype=np.float64) for column in np.asarray(x).T)
        return self.matrix @ x


def single_blas_thread():
    """Context limiting BLAS to one thread: the small dense products in these tests
    are many times slower with threads contending on a 2-core machine."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # threadpoolctl is optional for the tests
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def assert_symmetry_checked_unless_disabled(estimator, **kwargs) -> None:
    """``estimator`` refuses a non-symmetric matrix, and records check_symmetry=False."""
    import pytest

    asymmetric = np.triu(np.ones((10, 10)))
    with pytest.raises(ValueError, match="not symmetric"):
        estimator(asymmetric, **kwargs)
    unchecked = estimator(asymmetric, check_symmetry=False, **kwargs)
    assert unchecked.settings["check_symmetry"] is False


def progress_lines(capsys) -> list[str]:
    """The progress bar's successive states, from what a test captured on stderr."""
    return capsys.readouterr().err.replace("\r", "\n").strip().splitlines()


def timed_with_defaults(estimator, matrix, **kwargs):
    """``estimator(matrix, **kwargs)``, checked to report its wall time and to default to
    seed 0 (the same result, array for array, as with seed=0)."""
    import time

    started = time.perf_counter()
    result = estimator(matrix, **kwargs)
    elapsed = time.perf_counter() - started
    assert 0.0 <= result.wall_time <= elapsed
    again = estimator(matrix, seed=0, **kwargs)
    for field in ("estimate", "nodes"):
        if hasattr(result, field):
            np.testing.assert_array_equal(getattr(result, field), getattr(again, field))
    return result
