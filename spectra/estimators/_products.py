"""Private helpers shared by the estimators: seeds, the product counter
(which also refuses non-finite products and tests symmetry for free), random
numbers, running moments, progress bars and Gram–Schmidt reorthogonalization.

The estimators work in float64 on the host. Vectors are cast to the operator's
dtype at the boundary and results are cast back to float64.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from scipy.linalg import qr
from scipy.sparse.linalg import LinearOperator, aslinearoperator
from threadpoolctl import ThreadpoolController
from tqdm import tqdm  # the console bar: no ipywidgets needed in notebooks

from spectra._symmetric import SymmetricProducts
from spectra._validation import check_bool, check_seed, is_bool

SeedLike = int | np.random.Generator | None

# Symmetry test tolerance relative to (‖Au‖‖v‖ + ‖Av‖‖u‖)/sqrt(n) (see ProductCounter):
# float64 operators are held to 1e-8, lower precision to 3·sqrt(eps) of their dtype (1.0e-3
# for float32, 0.094 for float16, 0.27 for bfloat16: half their digits).
_SYMMETRY_TOL = {np.dtype(np.float64): 1e-8}
_SYMMETRY_TOL_SQRT_EPS = 3.0
# The products' own rounding: |u·δ(Av)| <= ‖u‖·‖δ(Av)‖ with ‖δ(Av)‖ up to this times
# eps·‖Av‖ (a relative error per product of a few hundred eps covers the sums of a Hessian
# product), added to the tolerance; an asymmetry within this many times that allowance is
# reported as the likely rounding it is.
_SYMMETRY_ROUNDING = 100.0
_SYMMETRY_ROUNDING_LIKELY = 100.0
# Underflow: a product whose norm is below tiny/eps of the operator's dtype (‖Av‖/‖v‖ <
# 9.9e-32 in float32, 1.0e-292 in float64) may have lost intermediate terms to underflow
# (TensorFlow flushes float32 subnormals to zero on CPU: each lost term is an absolute
# error up to tiny, i.e. eps relative to tiny/eps). The counter then makes one extra
# product with the vector scaled up by 2^(max exponent / 2), which lifts every term that
# depends on the vector out of the underflow range, and compares: a relative difference
# above _UNDERFLOW_TOL is refused; the products' resolution (``ProductCounter.eps``), which
# floors the error bounds, becomes the larger of that difference and what lost terms may
# cost: tiny/(‖Av‖/‖v‖) for an operator that flushes subnormals, tiny·eps/(‖Av‖/‖v‖) else.
_UNDERFLOW_TOL = 1e-3
# Two vectors whose cosine exceeds this are too close to parallel for the symmetry test.
_SYMMETRY_MAX_COSINE = 0.9
# Products whose largest entry lies outside [2^-_SAFE_EXPONENT, 2^_SAFE_EXPONENT] are
# scaled by a power of two (see ProductCounter): inside it, squares and sums of
# squares of n entries stay far from overflow and underflow, and no scaling at all
# keeps results at ordinary scales bit-identical.
_SAFE_EXPONENT = 64
# A fixed generator for the rare extra symmetry probe (see ProductCounter.finish), so
# that estimator results do not depend on whether it runs.
SYMMETRY_SEED = 0x5EED


# -- arguments ---------------------------------------------------------------------------
def seeded_rng(seed: Any, name: str = "seed") -> np.random.Generator:
    """A numpy Generator from a seed :func:`~spectra._validation.check_seed` accepts: an
    int >= 0, None, or an existing Generator (used as is)."""
    return np.random.default_rng(check_seed(name, seed))


def seed_setting(seed: SeedLike) -> Any:
    """How a seed is recorded in a result's settings (a Generator has no value to record)."""
    if seed is None:
        return None
    return int(seed) if isinstance(seed, (int, np.integer)) else "generator"


def _boundary_dtype(dtype: Any) -> np.dtype:
    """dtype used to talk to the operator: its own float dtype, else float64."""
    dtype = np.dtype(dtype) if dtype is not None else np.dtype(np.float64)
    if np.issubdtype(dtype, np.complexfloating):
        raise ValueError(f"only real operators are supported, got dtype {dtype}")
    if np.issubdtype(dtype, np.floating):
        return dtype
    return np.dtype(np.float64)


def rademacher_vectors(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Independent ±1 entries (float64)."""
    values = rng.integers(0, 2, size=shape).astype(np.float64)
    values *= 2.0  # in place: the same values as 2·b − 1, without two temporaries
    values -= 1.0
    return values


# -- the product counter ------------------------------------------------------------------
class ProductCounter(SymmetricProducts, LinearOperator):
    """float64 view of an operator that counts products, refuses non-finite values and
    tests symmetry on the products the estimator makes anyway.

    ``num_products`` counts every column multiplied (a ``matmat`` of b columns counts
    b), ``num_operator_calls`` counts ``matvec``/``matmat`` calls of the wrapped
    operator (data passes for a Hessian). If the wrapped operator has no native
    ``matmat``, scipy applies it column by column; that still counts as one call here.

    Finite or refused: every product is checked, and a NaN/Inf one raises a
    ``ValueError`` naming the estimator (``label``), the product and the call.

    Floating point has two ends: a Hessian scaled by 1e300 (or 1e-300) has products whose
    norms, squares and inner products overflow (underflow) in float64 although every
    answer is representable. The counter therefore hands out the products of
    ``A / scale``, where ``scale = 2^e`` is fixed by the first nonzero product: 1 when its
    largest entry m lies in [2^-64, 2^64] (the estimators' arithmetic is safe there, and
    results at ordinary scales are bit-identical to unscaled ones), else the power of
    two at or just below m, so that the scaled products are O(1). Multiplying by a power of
    two is exact (the scaled entries are normal numbers), so the estimators see the
    matrix A/2^e exactly as rounded by the operator, and each multiplies what it
    reports (eigenvalues, bounds, traces, standard errors) by ``scale`` (squared norms
    by ``scale²``). Zero products before the first nonzero one are zero at any scale.
    Everything an estimator reads from the counter (``norm_estimate``, the symmetry
    test) is in the scaled units, so the symmetry test is scale-invariant.

    Symmetry (``check_symmetry``): the first two non-parallel input vectors u, v the
    estimator multiplies, with their images, must satisfy
    ``|u·Av − v·Au| <= tol·(‖Au‖‖v‖ + ‖Av‖‖u‖)/sqrt(n) + 100·eps·(‖Au‖‖v‖ + ‖Av‖‖u‖)``
    (tol 1e-8 for float64, 3·sqrt(eps) of the dtype otherwise: 1.0e-3 for float32; eps the
    products' resolution): the first term scales like 1/sqrt(n) for random vectors, so the
    test is equally sensitive at every size, the second allows the products' own rounding
    (which does not shrink with n); it runs on the scaled products, so it is equally
    sensitive at every scale, and it allows the absolute rounding of products in the
    operator's subnormal range (a nearly zero operator). An asymmetry within 100 times the
    rounding allowance is reported as likely rounding, not asymmetry. It costs no product;
    only an estimator that multiplies a single vector in total gets one extra product
    (:meth:`finish`).

    Underflow (:meth:`_check_underflow`): a first nonzero product below tiny/eps of the
    dtype relative to its vector (9.9e-32 in float32) is compared with the product of the
    same vector scaled up by a power of two (one extra product): refused when they differ
    by more than 1e-3, else the difference becomes ``eps``. An all-zero product gets the
    same check once (a nonzero scaled twin is refused as underflow).
    """

    def __init__(self, operator: LinearOperator, label: str, check_symmetry: bool):
        self.operator = operator
        self.label = label
        self.n = int(operator.shape[0])
        self.boundary_dtype = _boundary_dtype(operator.dtype)
        self.num_products = 0
        self.num_operator_calls = 0
        self.norm_estimate = 0.0
        self.scale = 1.0
        self._scale_exponent: int | None = None
        # The relative accuracy of the products: the dtype's unit roundoff, raised to the
        # measured loss to underflow for products below tiny/eps (see _check_underflow).
        self.resolution = float(np.finfo(self.boundary_dtype).eps)
        self._underflow_checked = False
        self._zero_checked = False
        self.symmetry_pending = bool(check_symmetry) and self.n > 1
        self._first_pair: tuple[np.ndarray, np.ndarray] | None = None
        super().__init__(dtype=np.float64, shape=(self.n, self.n))

    @property
    def eps(self) -> float:
        """Relative accuracy of the operator's products: the unit roundoff of its dtype, or
        the relative error measured by the underflow check when that is larger."""
        return self.resolution

    @property
    def saw_nonzero(self) -> bool:
        """Whether any product so far had a nonzero entry."""
        return self._scale_exponent is not None

    def _multiply(self, block: np.ndarray) -> np.ndarray:
        """A (n, b) float64 block through the operator, checked and counted."""
        width = block.shape[1]
        first = self.num_products + 1
        cast = np.ascontiguousarray(block, dtype=self.boundary_dtype)
        if not np.all(np.isfinite(cast)):
            raise ValueError(
                f"{self.label}: the vectors of product {first} are not finite in the "
                f"operator's dtype {self.boundary_dtype} (entries up to "
                f"{np.max(np.abs(block)):.3g}); they cannot be multiplied"
            )
        if width == 1:
            result = self.operator.matvec(cast[:, 0])
        else:
            result = self.operator.matmat(cast)
        result = np.asarray(result, dtype=np.float64).reshape(self.n, width)
        self.num_products += width
        self.num_operator_calls += 1
        if not np.all(np.isfinite(result)):
            bad = int(np.size(result) - np.count_nonzero(np.isfinite(result)))
            products = (
                f"product {first}" if width == 1 else (f"products {first}-{first + width - 1}")
            )
            raise ValueError(
                f"{self.label}: {products} (operator call {self.num_operator_calls}) "
                f"returned {bad} non-finite value(s) (NaN or Inf) out of {result.size}. "
                "The operator is not finite here: check that the weights, the loss and "
                "the data it is built from are finite."
            )
        if not self._underflow_checked:
            self._check_underflow(cast, result)
        result = self._scaled(result)
        norms = _column_norms(result) / np.maximum(_column_norms(block), np.finfo(float).tiny)
        self.norm_estimate = max(self.norm_estimate, float(norms.max(initial=0.0)))
        if self.symmetry_pending:
            self._test_symmetry(cast, result)
        return result

    def _check_underflow(self, cast: np.ndarray, result: np.ndarray) -> None:
        """Refuse products that underflow the operator's dtype, or measure what they lose.

        Runs on the first nonzero product (and once on an all-zero one): when its norm is
        below tiny/eps of the dtype relative to its vector's, one extra product with that
        vector scaled up by a power of two (exact) lifts every term that depends on the
        vector out of the underflow range. For a linear operator the two agree to rounding
        unless the small one lost terms to underflow (gradual, or flushed to zero as
        TensorFlow does on CPU): a relative difference above ``_UNDERFLOW_TOL``, or an
        exactly zero product whose scaled twin is not zero, is refused in one line; a
        smaller difference becomes ``resolution``. Ordinary products pass at no cost.
        """
        finfo = np.finfo(self.boundary_dtype)
        threshold = float(finfo.tiny) / float(finfo.eps)
        # The usual case, decided on the first column alone (O(n), not O(n k)).
        first_in = float(_safe_norms(cast[:, :1].astype(np.float64))[0])
        first_out = float(_safe_norms(result[:, :1])[0])
        if first_out > 0 and first_out >= threshold * first_in:
            self._underflow_checked = True
            return
        inputs = cast.astype(np.float64)
        in_norms = _safe_norms(inputs)
        out_norms = _safe_norms(result)
        nonzero = np.flatnonzero(out_norms > 0)
        if nonzero.size:
            column = int(nonzero[0])
            if out_norms[column] >= threshold * in_norms[column]:
                self._underflow_checked = True
                return
        else:
            candidates = np.flatnonzero(in_norms > 0)
            if self._zero_checked or candidates.size == 0:
                return
            column = int(candidates[0])
        vector = inputs[:, column]
        # Entries up to 2^(maxexp/2): 2^64 for float32, 2^512 for float64.
        shift = int(finfo.maxexp) // 2 - int(np.frexp(np.max(np.abs(vector)))[1])
        lifted = np.ldexp(vector, shift).astype(self.boundary_dtype)
        reference = np.asarray(self.operator.matvec(lifted), dtype=np.float64).reshape(self.n)
        self.num_products += 1
        self.num_operator_calls += 1
        if not np.all(np.isfinite(reference)):
            raise ValueError(
                f"{self.label}: the underflow check's product (a vector scaled by 2^{shift}) "
                "returned non-finite values (NaN or Inf): the operator is not finite or not "
                "linear here"
            )
        reference = np.ldexp(reference, -shift)
        reference_norm = float(_safe_norms(reference[:, None])[0])
        ratio = reference_norm / float(in_norms[column])
        dtype = self.boundary_dtype
        # A factor that brings ‖A‖ near 1, at most 2^(maxexp/2) (a float32 constant above
        # 2^127 overflows).
        lift = int(finfo.maxexp) // 2
        if ratio > 0:
            lift = min(lift, -int(np.frexp(ratio)[1]))
        advice = (
            f"build the operator in float64, or scale the loss up (e.g. by 2^{lift}) and "
            "divide the results by the same factor"
        )
        if not nonzero.size:
            self._zero_checked = True
            if reference_norm == 0.0:
                return  # zero at every scale: the zero operator of this arithmetic
            raise ValueError(
                f"{self.label}: the operator's products underflow {dtype}: a vector gives an "
                f"exactly zero product, but the same vector scaled by 2^{shift} gives "
                f"‖Av‖/‖v‖ ≈ {ratio:.3g}, below the {threshold:.3g} (tiny/eps) that {dtype} "
                f"resolves: {advice}"
            )
        self._underflow_checked = True
        difference = float(_safe_norms((result[:, column] - reference)[:, None])[0])
        delta = difference / reference_norm if reference_norm > 0 else math.inf
        if not delta <= _UNDERFLOW_TOL:
            raise ValueError(
                f"{self.label}: the operator's products underflow {dtype}: ‖Av‖/‖v‖ ≈ "
                f"{float(out_norms[column] / in_norms[column]):.3g}, below the "
                f"{threshold:.3g} (tiny/eps) that {dtype} resolves, changes by {delta:.3g} "
                f"(relative) when the vector is scaled by 2^{shift}: {advice}"
            )
        # The check measures one vector; another may lose more. An operator that flushes
        # subnormals to zero (TensorFlow and XLA on a CPU: ``flushes_subnormals``) loses
        # terms of up to tiny each on a product of relative size ``ratio``: its resolution
        # is at least tiny/ratio (measured: a float32 Hessian at ‖A‖ ≈ 3e-34 passed the
        # check at 7e-8 and gave an eigenvalue off by 1.3e-5; tiny/ratio ≈ 4e-5). With
        # gradual underflow (NumPy) a lost term is at most the subnormal spacing, tiny·eps.
        lost = float(finfo.tiny) / ratio
        if not getattr(self.operator, "flushes_subnormals", False):
            lost *= float(finfo.eps)
        self.resolution = max(self.resolution, delta, lost)

    def _scaled(self, result: np.ndarray) -> np.ndarray:
        """``result / scale``, fixing the scale at the first nonzero product."""
        if self._scale_exponent is None:
            largest = float(np.max(np.abs(result), initial=0.0))
            if largest == 0.0:
                return result
            # largest = f·2^(exponent + 1) with f in [0.5, 1): scaled entries below 2, and
            # 2^exponent is finite even for the largest float64 (2^1024 is not).
            exponent = int(np.frexp(largest)[1]) - 1
            if -_SAFE_EXPONENT <= exponent <= _SAFE_EXPONENT:
                exponent = 0
            self._scale_exponent = exponent
            self.scale = math.ldexp(1.0, exponent)
        if self._scale_exponent == 0:
            return result
        return np.ldexp(result, -self._scale_exponent)

    def unscale(self, values: Any, what: str, power: int = 1) -> Any:
        """``values · scale^power`` (exact: a power of two), from the units of the scaled
        products back to the operator's. A result that is finite in the scaled units and
        overflows float64 in the operator's is refused with a ``ValueError`` naming
        ``what`` (an answer float64 cannot hold, not a number to report)."""
        exponent = self._scale_exponent or 0
        if exponent == 0:
            return values
        scaled = np.asarray(values, dtype=np.float64)
        with np.errstate(over="ignore"):
            out = np.ldexp(scaled, power * exponent)
        overflow = np.isfinite(scaled) & ~np.isfinite(out)
        if np.any(overflow):
            raise ValueError(
                f"{self.label}: {what} overflows float64 (it is about 2^"
                f"{power * exponent + int(np.frexp(np.max(np.abs(scaled[overflow])))[1])}, "
                "above 1.8e308): scale the operator down (e.g. by a power of two) and "
                "the result up"
            )
        return out if np.ndim(values) else float(out)

    def _matmat(self, block: np.ndarray) -> np.ndarray:
        block = np.asarray(block, dtype=np.float64)
        if block.ndim == 1:
            return self._matvec(block)
        if block.shape[1] == 0:
            return np.zeros((self.n, 0))
        return self._multiply(block)

    def _test_symmetry(self, inputs: np.ndarray, images: np.ndarray) -> None:
        """The symmetry test on the columns of ``inputs`` (in the operator's dtype, each
        column converted to float64 when it is read) and their ``images``."""
        for column in range(inputs.shape[1]):
            vector = inputs[:, column].astype(np.float64)
            image = images[:, column]
            norm = float(np.linalg.norm(vector))
            if norm == 0.0:
                continue
            if self._first_pair is None:
                self._first_pair = (vector.copy(), image.copy())
                continue
            first, first_image = self._first_pair
            cosine = abs(float(first @ vector)) / (float(np.linalg.norm(first)) * norm)
            if cosine > _SYMMETRY_MAX_COSINE:
                continue
            self.symmetry_pending = False
            self._first_pair = None
            tol = _SYMMETRY_TOL.get(
                self.boundary_dtype,
                _SYMMETRY_TOL_SQRT_EPS * math.sqrt(float(np.finfo(self.boundary_dtype).eps)),
            )
            asymmetry = abs(float(first @ image) - float(vector @ first_image))
            norms = float(np.linalg.norm(first_image)) * norm + float(
                np.linalg.norm(image)
            ) * float(np.linalg.norm(first))
            scale = norms / math.sqrt(self.n)
            # The products' rounding (relative error up to _SYMMETRY_ROUNDING·eps each, eps
            # the measured resolution when underflow costs more): |u·δ(Av)| <= ‖u‖‖δ(Av)‖.
            rounding = _SYMMETRY_ROUNDING * self.eps * norms
            # Products in the operator's subnormal range (a nearly zero operator, such as
            # the Hessian of a nearly constant loss in float32) carry absolute errors up
            # to its smallest subnormal per entry, whatever their size: in the scaled
            # units, |Σ u_i δ_i| <= sqrt(n)·‖u‖·smallest_subnormal / scale.
            subnormal = float(np.finfo(self.boundary_dtype).smallest_subnormal) / self.scale
            slack = 2.0 * math.sqrt(self.n) * (norm + float(np.linalg.norm(first))) * subnormal
            allowed = tol * scale + rounding + slack
            if not asymmetry <= allowed:
                if asymmetry <= _SYMMETRY_ROUNDING_LIKELY * (rounding + slack):
                    raise ValueError(
                        f"{self.label}: the operator fails the symmetry test: |u·Av − v·Au| = "
                        f"{asymmetry:.3e} exceeds {allowed:.3e} for the first two vectors "
                        f"multiplied, but only by {asymmetry / (rounding + slack):.3g} times "
                        f"what {self.boundary_dtype} rounding of the products can give: likely "
                        "rounding (cancellation in the products), not asymmetry; build the "
                        "operator in float64 to tell, or pass check_symmetry=False"
                    )
                if self.boundary_dtype == np.dtype(np.float64):
                    advice = "pass check_symmetry=False to skip this test"
                else:
                    advice = (
                        f"or its {self.boundary_dtype} rounding exceeds eps·‖Av‖ (cancellation "
                        "in the products): build the operator in float64 to tell, or pass "
                        "check_symmetry=False"
                    )
                raise ValueError(
                    f"{self.label}: the operator is not symmetric: |u·Av − v·Au| = "
                    f"{asymmetry:.3e} exceeds {allowed:.3e} ({tol:.1e} × {scale:.3e} plus "
                    f"{self.boundary_dtype} rounding) for the first two vectors multiplied "
                    f"({advice})"
                )
            return

    def finish(self) -> None:
        """Complete a symmetry test that the estimator's own products did not (one extra
        product, only when it multiplied a single vector in total)."""
        if not self.symmetry_pending or self._first_pair is None:
            return
        first = self._first_pair[0]
        probe = np.random.default_rng(SYMMETRY_SEED).standard_normal(self.n)
        probe -= first * (first @ probe) / (first @ first)
        if np.linalg.norm(probe) > 0:
            self._matvec(probe)


def _column_norms(block: np.ndarray) -> np.ndarray:
    """Euclidean norms of the columns of a float64 (n, k) block, without an (n, k)
    temporary (``np.linalg.norm(block, axis=0)`` squares the whole block first)."""
    return np.sqrt(np.einsum("ij,ij->j", block, block))


def _safe_norms(block: np.ndarray) -> np.ndarray:
    """Euclidean norms of the columns of a float64 block, without the underflow (or
    overflow) of their squares: each column is divided by its largest |entry| first."""
    largest = np.max(np.abs(block), axis=0, initial=0.0)
    safe = np.where(largest > 0, largest, 1.0)
    with np.errstate(over="ignore"):  # a norm above float64's range is inf
        return np.linalg.norm(block / safe, axis=0) * largest


def as_symmetric_operator(op: Any, label: str, check_symmetry: bool = True) -> ProductCounter:
    """Validate ``op`` (LinearOperator, array, sparse matrix...) and wrap it in a counter.

    Requires a square shape. With ``check_symmetry`` the counter tests symmetry on the
    estimator's first products (no extra product, see :class:`ProductCounter`).
    """
    check_symmetry = check_bool("check_symmetry", check_symmetry)
    try:
        operator = aslinearoperator(op)
    except TypeError as error:
        raise ValueError(f"cannot use {type(op).__name__} as a linear operator: {error}") from error
    shape = tuple(operator.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"operator must be square, got shape {shape}")
    if shape[0] < 1:
        raise ValueError(f"operator must have a positive dimension, got shape {shape}")
    return ProductCounter(operator, label, bool(check_symmetry))


# -- statistics -----------------------------------------------------------------------------
class RunningMoments:
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
        """Sample standard deviation (divisor count − 1) / sqrt(count); NaN below 2 samples."""
        if self.count < 2:
            return np.full_like(self.mean, np.nan)
        return np.sqrt(self._sum_sq / (self.count - 1) / self.count)


# -- progress -------------------------------------------------------------------------------
# A bar shown by default (progress=None, stderr a terminal) appears only once a run has taken
# this long, so that quick runs print nothing; progress=True shows it at once.
_PROGRESS_DELAY_S = 2.0


def _stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` (where bars are drawn) is a terminal; False when it cannot say."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def check_progress(progress: Any) -> bool | None:
    """``progress`` if it is None, True or False, else a ``TypeError``."""
    if progress is not None and not is_bool(progress):
        raise TypeError(f"progress must be None, True or False, got {progress!r}")
    return None if progress is None else bool(progress)


def make_progress_bar(total: int | None, desc: str, unit: str, progress: Any) -> tqdm:
    """A tqdm bar on ``sys.stderr`` over ``total`` planned items, per ``progress``.

    ``None`` (the default of every estimator): shown only when stderr is a terminal, and only
    once the run has lasted :data:`_PROGRESS_DELAY_S` seconds; ``True``: shown at once, terminal
    or not; ``False``: never. The bar is removed when it closes (``leave=False``). Anything
    else for ``progress`` is a ``TypeError``.
    """
    if check_progress(progress) is None:
        enabled, delay = _stderr_is_terminal(), _PROGRESS_DELAY_S
    else:
        enabled, delay = bool(progress), 0.0
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not enabled,
        leave=False,
        delay=delay,
        file=sys.stderr,
    )


class ProductProgress:
    """A tqdm bar over the products an estimator plans, with its data passes.

    ``plan`` revises the expected total (e.g. the Lanczos steps to the expected
    convergence); ``update`` reads the counter; on exit the total becomes the work
    done, so a finished bar reads 100%. ``enabled`` is the estimator's ``progress``
    (see :func:`make_progress_bar`): by default a bar on a terminal for runs longer than
    about 2 s.
    """

    def __init__(self, counter: ProductCounter, total: int, desc: str, enabled: bool | None):
        self.counter = counter
        self.start_products = counter.num_products
        self.start_calls = counter.num_operator_calls
        self.bar = make_progress_bar(max(int(total), 1), desc, "product", enabled)

    def update(self) -> None:
        done = self.counter.num_products - self.start_products
        if done > self.bar.total:
            self.bar.total = done
        self.bar.set_postfix_str(
            f"{self.counter.num_operator_calls - self.start_calls} data passes", refresh=False
        )
        self.bar.update(done - self.bar.n)

    def plan(self, total: int) -> None:
        done = self.counter.num_products - self.start_products
        self.bar.total = max(int(total), done, 1)
        self._refresh()

    def _refresh(self) -> None:
        """Redraw the bar, unless it is off or still within its delay (not drawn yet)."""
        if not self.bar.disable and time.time() >= self.bar.start_t + self.bar.delay:
            self.bar.refresh()

    def __enter__(self) -> ProductProgress:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.update()
        self.bar.total = max(self.bar.n, 1)
        self._refresh()
        self.bar.close()


# -- host threads -----------------------------------------------------------------------
_THREADPOOLS: list[ThreadpoolController] = []


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the host-side linear algebra of an estimator on one BLAS thread.

    The reorthogonalizations are thin products (n × j with j <= a few dozen): on a
    machine whose cores TensorFlow keeps busy, several BLAS threads mostly wait for
    each other. On the digits MLP (2 cores) a 15-step Lanczos run spent 17 ms per step on
    the host with the default BLAS threads and 1.8 ms with one. TensorFlow's own
    thread pools are not affected.
    """
    if not _THREADPOOLS:
        _THREADPOOLS.append(ThreadpoolController())
    with _THREADPOOLS[0].limit(limits=1, user_api="blas"):
        yield


# -- thin QR of tall blocks -----------------------------------------------------------------
# Rows per block of :func:`tall_qr`: a block of s <= 64 float64 columns (4 MiB) stays in cache.
_QR_ROWS = 8192


def tall_qr(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Thin QR (Q n × s with orthonormal columns, R s × s upper triangular) of a tall n × s
    float64 matrix.

    Below 4·:data:`_QR_ROWS` rows (or for s > _QR_ROWS/8) this is LAPACK's Householder QR
    (``scipy.linalg.qr(mode="economic")``). Above, the same factorization by blocks of rows
    (TSQR, Demmel, Grigori, Hoemmen & Langou 2012): each block's Householder QR, then the QR
    of the stacked R factors, then Q = diag(Q_b) Q₂. It is as stable as Householder QR
    (orthogonal transformations throughout) and equal to it up to rounding and the signs
    of Q's columns and R's rows, which no estimator here depends on. On a 670k × 50
    matrix with one BLAS thread it took 1.5–2.0 s against 4.2 s: LAPACK's QR of a tall
    matrix streams the whole matrix from memory once per column, the blocks stay in cache.
    """
    n, s = matrix.shape
    if n < 4 * _QR_ROWS or 8 * s > _QR_ROWS:
        return qr(matrix, mode="economic", check_finite=False)
    starts = list(range(0, n, _QR_ROWS))
    bounds = [(a, b) for a, b in zip(starts, [*starts[1:-1], n])]  # last block takes the rest
    bases, triangles = [], []
    for a, b in bounds:
        basis, triangle = qr(matrix[a:b], mode="economic", check_finite=False)
        bases.append(basis)
        triangles.append(triangle)
    combined, triangular = qr(np.vstack(triangles), mode="economic", check_finite=False)
    out = np.empty((n, s))
    for index, ((a, b), basis) in enumerate(zip(bounds, bases)):
        np.matmul(basis, combined[index * s : (index + 1) * s], out=out[a:b])
    return out, triangular


# -- Gram–Schmidt ---------------------------------------------------------------------------
def orthogonalize(
    vectors: np.ndarray, basis: np.ndarray, passes: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """Remove from ``vectors`` their components along the orthonormal rows of ``basis``.

    Classical Gram–Schmidt as matrix products, repeated ``passes`` times (two restore
    orthogonality to working precision: "twice is enough", Giraud et al. 2005).
    Shapes: ``basis`` (j, n) with ``vectors`` (n,) or (n, b); or a batch of bases
    (P, j, n) with ``vectors`` (P, n), each row against its own basis. Returns the
    orthogonalized vectors and the summed coefficients (the projections removed):
    (j,) or (j, b), or (P, j) for a batch. Cost O(passes·j·n) per vector.
    """
    if basis.ndim == 3:
        coefficients = np.zeros(basis.shape[:2])
        if basis.shape[1] == 0:
            return vectors, coefficients
        for _ in range(passes):
            step = np.matmul(basis, vectors[:, :, None])[:, :, 0]
            vectors = vectors - np.matmul(basis.transpose(0, 2, 1), step[:, :, None])[:, :, 0]
            coefficients += step
        return vectors, coefficients
    coefficients = np.zeros((basis.shape[0], *vectors.shape[1:]))
    if basis.shape[0] == 0:
        return vectors, coefficients
    for _ in range(passes):
        step = basis @ vectors
        vectors = vectors - basis.T @ step
        coefficients += step
    return vectors, coefficients
