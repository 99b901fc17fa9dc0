"""Private helpers shared by the estimators: operator validation, product
counting, random numbers, running moments and progress bars.

The estimators work in float64 on the host. Vectors are cast to the operator's
dtype at the boundary and results are cast back to float64.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator, aslinearoperator
from tqdm import tqdm  # the console bar: no ipywidgets needed in notebooks

SeedLike = int | np.random.Generator | None

# Symmetry test tolerance relative to (‖Au‖ + ‖Av‖)/sqrt(n) for unit u, v (see
# _check_symmetry): float64 operators are held to 1e-8, lower precision to 1e-3.
_SYMMETRY_TOL = {np.dtype(np.float64): 1e-8}
_SYMMETRY_TOL_LOW_PRECISION = 1e-3
# A fixed generator for the symmetry probe keeps estimator results independent of
# whether the check runs.
_SYMMETRY_SEED = 0x5EED


def _rng(seed: SeedLike) -> np.random.Generator:
    """A numpy Generator from an int, None or an existing Generator (used as is)."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is not None and not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, None or numpy.random.Generator, got {seed!r}")
    return np.random.default_rng(seed)


def _rademacher(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Independent ±1 entries (float64)."""
    return rng.integers(0, 2, size=shape).astype(np.float64) * 2.0 - 1.0


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        valid = ", ".join(repr(choice) for choice in choices)
        raise ValueError(f"unknown {name} {value!r}; valid values: {valid}")
    return value


def _boundary_dtype(dtype: Any) -> np.dtype:
    """dtype used to talk to the operator: its own float dtype, else float64."""
    dtype = np.dtype(dtype) if dtype is not None else np.dtype(np.float64)
    if np.issubdtype(dtype, np.complexfloating):
        raise ValueError(f"only real operators are supported, got dtype {dtype}")
    if np.issubdtype(dtype, np.floating):
        return dtype
    return np.dtype(np.float64)


class _ProductCounter(LinearOperator):
    """float64 view of an operator that counts products and calls.

    ``num_products`` counts every column multiplied (a ``matmat`` of b columns
    counts b), ``num_operator_calls`` counts ``matvec``/``matmat`` calls of the
    wrapped operator. If the wrapped operator has no native ``matmat``, scipy
    applies it column by column; that still counts as one call here.
    """

    def __init__(self, operator: LinearOperator):
        self.operator = operator
        self.n = int(operator.shape[0])
        self.boundary_dtype = _boundary_dtype(operator.dtype)
        self.num_products = 0
        self.num_operator_calls = 0
        self.norm_estimate: float | None = None
        super().__init__(dtype=np.float64, shape=(self.n, self.n))

    def _matmat(self, block: np.ndarray) -> np.ndarray:
        block = np.asarray(block)
        if block.ndim == 1:
            return self._matvec(block)
        width = block.shape[1]
        if width == 0:
            return np.zeros((self.n, 0))
        result = self.operator.matmat(np.ascontiguousarray(block, dtype=self.boundary_dtype))
        self.num_products += width
        self.num_operator_calls += 1
        return np.asarray(result, dtype=np.float64).reshape(self.n, width)

    def _matvec(self, vector: np.ndarray) -> np.ndarray:
        vector = np.asarray(vector).reshape(-1)
        result = self.operator.matvec(np.ascontiguousarray(vector, dtype=self.boundary_dtype))
        self.num_products += 1
        self.num_operator_calls += 1
        return np.asarray(result, dtype=np.float64).reshape(self.n)

    def _rmatvec(self, vector: np.ndarray) -> np.ndarray:
        return self._matvec(vector)

    def _rmatmat(self, block: np.ndarray) -> np.ndarray:
        return self._matmat(block)

    @property
    def eps(self) -> float:
        """Unit roundoff of the operator's arithmetic."""
        return float(np.finfo(self.boundary_dtype).eps)


def _check_symmetry(counter: _ProductCounter, tol: float | None = None) -> None:
    """Randomized symmetry test with one block of two products.

    For random unit u, v it requires ``|u·Av − v·Au| <= tol · (‖Au‖ + ‖Av‖)/sqrt(n)``;
    both sides scale like 1/sqrt(n) for random vectors, so the test is equally
    sensitive at every size. Also records ``‖Au‖`` as a cheap lower bound on ‖A‖₂.
    """
    n = counter.n
    if tol is None:
        tol = _SYMMETRY_TOL.get(counter.boundary_dtype, _SYMMETRY_TOL_LOW_PRECISION)
    probes = np.random.default_rng(_SYMMETRY_SEED).standard_normal((n, 2))
    probes /= np.linalg.norm(probes, axis=0)
    images = counter.matmat(probes)
    u_av = float(probes[:, 0] @ images[:, 1])
    v_au = float(probes[:, 1] @ images[:, 0])
    image_norms = np.linalg.norm(images, axis=0)
    counter.norm_estimate = float(image_norms.max())
    scale = float(image_norms.sum()) / math.sqrt(n)
    asymmetry = abs(u_av - v_au)
    if not asymmetry <= tol * scale:
        raise ValueError(
            f"operator is not symmetric: |u·Av − v·Au| = {asymmetry:.3e} exceeds "
            f"{tol:.1e} × {scale:.3e} for random unit u, v "
            "(pass check_symmetry=False to skip this test)"
        )


def _as_symmetric_operator(
    op: Any, check_symmetry: bool = True, symmetry_tol: float | None = None
) -> _ProductCounter:
    """Validate ``op`` (LinearOperator, array, sparse matrix...) and wrap it in a counter.

    Requires a square shape. With ``check_symmetry`` a randomized test costing
    two products (counted) rejects non-symmetric operators.
    """
    try:
        operator = aslinearoperator(op)
    except TypeError as error:
        raise ValueError(f"cannot use {type(op).__name__} as a linear operator: {error}") from error
    shape = tuple(operator.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"operator must be square, got shape {shape}")
    if shape[0] < 1:
        raise ValueError(f"operator must have a positive dimension, got shape {shape}")
    counter = _ProductCounter(operator)
    if check_symmetry:
        _check_symmetry(counter, symmetry_tol)
    return counter


class _RunningMoments:
    """Mean and unbiased variance of samples arriving in blocks.

    Uses the pairwise update of Chan, Golub and LeVeque (1979), which avoids the
    cancellation of accumulating sums of squares.
    """

    def __init__(self, shape: tuple[int, ...] = ()):
        self.count = 0
        self.mean = np.zeros(shape)
        self._sum_sq = np.zeros(shape)

    def update(self, samples: np.ndarray) -> None:
        """Add samples stacked along axis 0."""
        block_count = samples.shape[0]
        if block_count == 0:
            return
        block_mean = samples.mean(axis=0)
        block_sum_sq = ((samples - block_mean) ** 2).sum(axis=0)
        total = self.count + block_count
        delta = block_mean - self.mean
        self.mean = self.mean + delta * (block_count / total)
        self._sum_sq = self._sum_sq + block_sum_sq + delta**2 * (self.count * block_count / total)
        self.count = total

    def stderr(self) -> np.ndarray:
        """Sample standard deviation / sqrt(count) (NaN for fewer than 2 samples)."""
        if self.count < 2:
            return np.full_like(self.mean, np.nan)
        return np.sqrt(self._sum_sq / (self.count - 1) / self.count)


def _progress(total: int | None, desc: str, enabled: bool | None = None) -> tqdm:
    """A tqdm bar, shown by default only when stderr is a terminal."""
    if enabled is None:
        isatty = getattr(sys.stderr, "isatty", None)
        enabled = bool(isatty()) if callable(isatty) else False
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, unit="product")


def _orthogonalize(vectors: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """Remove from ``vectors`` (n,) or (n, b) their components along the rows of ``basis``.

    Two passes of classical Gram–Schmidt as matrix products (``basis @ w``), which
    restores orthogonality to working precision ("twice is enough").
    """
    if basis.shape[0] == 0:
        return vectors
    for _ in range(2):
        vectors = vectors - basis.T @ (basis @ vectors)
    return vectors
