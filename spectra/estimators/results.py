"""Result containers returned by the estimators.

Every result is a dataclass deriving from :class:`Result`, which provides
``to_dict()`` (JSON-serializable: numpy arrays become lists, numpy scalars
become Python numbers) and ``to_json(path=None)`` (atomic when writing a file), and
back: ``Cls.from_dict(d)``, ``Cls.from_json(path)`` and :func:`load` (the JSON of any result
type defined so far; :func:`spectra.load` also imports the analysis results and the
commands' reports, :mod:`spectra.reports`).
All results record the number of operator products (``num_products``, each
column of a ``matmat`` counts once), the number of operator calls
(``num_operator_calls``: ``matvec``/``matmat`` calls, i.e. data passes for a
Hessian), the wall time in seconds and the settings used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spectra.estimators.tridiagonal import tridiagonal_eigh
from spectra.io.files import atomic_write_text, read_json, strict_json_text
from spectra.io.result_validation import (
    FieldError,
    article,
    check_fields,
    check_value,
    damaged_file,
    join_path,
    read_array,
)

__all__ = [
    "DensityCurve",
    "DiagonalResult",
    "EigenResult",
    "FrobeniusResult",
    "InverseSolve",
    "LanczosResult",
    "LogDetResult",
    "LogSpectralDensity",
    "Result",
    "SpectralDensity",
    "SpectralMass",
    "SpectralMoments",
    "TraceResult",
    "load",
]

# Fields holding length-n vectors (eigenvectors, Lanczos basis) are marked so that
# ``to_dict(include_vectors=False)`` can leave them out of large reports.
_VECTOR_FIELD = {"vector": True}
# SpectralDensity's default kernel width: the nodes' range over this (about one spacing of
# the Ritz values of an 80-step probe); for a zero range, this times max(1, |node|).
_KERNEL_WIDTHS_PER_RANGE = 100.0
_DEGENERATE_KERNEL_WIDTH = 1e-3


def _to_jsonable(value: Any, include_vectors: bool) -> Any:
    if isinstance(value, Result):
        return value.to_dict(include_vectors=include_vectors)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(key): _to_jsonable(item, include_vectors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(item, include_vectors) for item in value]
    return value


# Every Result subclass by class name (the "type" field ``to_dict`` writes), filled as the
# classes are defined (Result.__init_subclass__): the estimators' own here, those defined
# above the estimators (the analysis results, the commands' reports) when their modules are
# imported, which spectra.load (spectra.reports.loading) does. This module imports nothing
# above the estimators.
_RESULT_TYPES: dict[str, type[Result]] = {}
# How strict_json_text names the position of a value it wrote as null: "a.b[2][0]".
_PATH_PART = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _result_class(name: str) -> type[Result] | None:
    """The Result subclass called ``name``, when its class is defined (its module imported)."""
    return _RESULT_TYPES.get(name)


def _restore_nulls(payload: dict[str, Any], notes: Any) -> None:
    """Put back, in place, the NaN and ±inf that strict JSON wrote as null: ``notes`` maps a
    value's path ("trace.stderr", "eigenvalues.error_bounds[2]") to its reason, which starts
    with "NaN", "Infinity" or "-Infinity" (see :func:`spectra.io.files.strictly_jsonable`)."""
    if not isinstance(notes, dict):
        raise ValueError(f"'null_values' must map paths to reasons, got {type(notes).__name__}")
    for path, reason in notes.items():
        value = _NON_FINITE.get(str(reason).split(":", 1)[0].strip())
        parts = [int(index) if index else key for key, index in _PATH_PART.findall(str(path))]
        if value is None or not parts:
            raise ValueError(f"'null_values' entry {path!r}: {reason!r} is not NaN or ±Infinity")
        holder: Any = payload
        try:
            for part in parts[:-1]:
                holder = holder[part]
            if holder[parts[-1]] is not None:
                raise ValueError(f"'null_values' names {path!r}, which is not null")
            holder[parts[-1]] = value
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"'null_values' names {path!r}, which is not in the file") from None


def _array(value: Any, name: str) -> np.ndarray:
    """A list (nested) as written by ``to_dict`` back to an array (see
    :func:`spectra.io.result_validation.read_array`)."""
    return read_array(value, name)


def _decode_nested(value: Any, annotation: str, name: str) -> Any:
    """A nested result dictionary back to its class, when the field's annotation names a
    Result type (``EigenResult``, ``TraceResult | None``) or is ``Any`` (a
    ``LandscapeReport``'s curves); an error in it names the field's path in the file."""
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        cls = _result_class(value["type"])
        if cls is not None and (
            annotation == "Any"
            or value["type"] in annotation
            or any(
                issubclass(cls, base)
                for base in map(_result_class, annotation.split(" | "))
                if base is not None
            )
        ):
            try:
                return cls.from_dict(value)
            except FieldError as error:
                raise error.within(name) from None
            except ValueError as error:
                raise FieldError(f"{{0}}: {_escaped(str(error))}", name) from None
    return value


def _escaped(text: str) -> str:
    """``text`` for a :class:`FieldError` template (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _decode_field(value: Any, annotation: str, name: str) -> Any:
    """A field's JSON value back to what the dataclass holds, from its annotation, after
    checking its type (:func:`spectra.io.result_validation.check_value`)."""
    check_value(value, annotation, name, _result_class)
    if value is None:
        return None
    if annotation.startswith("list[np.ndarray]"):
        return [_array(item, f"{name}[{i}]") for i, item in enumerate(value)]
    if annotation.startswith("dict[str, np.ndarray]"):
        return {key: _array(item, join_path(name, key)) for key, item in value.items()}
    if annotation.startswith("np.ndarray"):
        return _array(value, name)
    if annotation.split(" | ")[0] in ("float",) and isinstance(value, int):
        return float(value)
    return _decode_nested(value, annotation, name)


@dataclass
class Result:
    """Common base: conversion to plain Python objects and JSON, and back."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _RESULT_TYPES[cls.__name__] = cls

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> Any:
        """The result that :meth:`to_dict` (or the JSON of :meth:`to_json`) describes.

        Arrays come back as numpy arrays (bool, int64 or float64 as written; NaN where
        strict JSON wrote null and ``"null_values"`` says so, also in nested results and
        dictionaries), nested results as their classes. Vector fields left out by
        ``include_vectors=False`` come back as None. Cost: linear in the size of ``payload``.

        Raises
        ------
        TypeError
            ``payload`` is not a dictionary.
        ValueError
            its ``"type"`` is another class; or (a
            :class:`spectra.io.result_validation.FieldError` naming the field by its path,
            "eigenvalues.error_bounds") a field is missing or unknown, of another type,
            arrays that must agree in length do not, NaN where a number is required, a key
            the figures read is missing (:func:`spectra.io.result_validation.check_fields`).
        """
        if not isinstance(payload, dict):
            raise TypeError(
                f"{cls.__name__}.from_dict needs a dictionary, got {type(payload).__name__}"
            )
        payload = dict(payload)
        kind = payload.pop("type", cls.__name__)
        if kind != cls.__name__:
            raise ValueError(f"the dictionary describes a {kind}, not a {cls.__name__}")
        notes = payload.pop("null_values", None)
        if notes:
            payload = json.loads(json.dumps(payload))  # a copy to restore in place
            _restore_nulls(payload, notes)
        specs = {spec.name: spec for spec in dataclasses.fields(cls) if spec.init}
        unknown = sorted(set(payload) - set(specs))
        if unknown:
            kind = f"{article(cls.__name__)} {cls.__name__}"
            raise FieldError(f"{{0}} is not a field of {kind}", unknown[0])
        values = {}
        for name, spec in specs.items():
            if name not in payload:
                has_default = (
                    spec.default is not dataclasses.MISSING
                    or spec.default_factory is not dataclasses.MISSING
                )
                if has_default:
                    continue
                kind = f"{article(cls.__name__)} {cls.__name__}"
                raise FieldError(f"{{0}} is missing: {kind} needs it", name)
            annotation = spec.type if isinstance(spec.type, str) else str(spec.type)
            values[name] = _decode_field(payload[name], annotation, name)
        check_fields(cls.__name__, values)
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Any:
        """The result written to ``path`` by :meth:`to_json` (see :meth:`from_dict`).

        Raises
        ------
        ValueError
            naming the path and the cause: not JSON, another result type, a missing field.
        OSError
            the file cannot be read.
        """
        result = load(path)
        if not isinstance(result, cls):
            raise ValueError(
                f"{os.fspath(path)}: holds a {type(result).__name__}, not a {cls.__name__}"
            )
        return result

    def to_dict(self, include_vectors: bool = True) -> dict[str, Any]:
        """Plain-Python dictionary of all fields (arrays as nested lists).

        ``include_vectors=False`` omits length-n vector fields (eigenvectors,
        Lanczos basis), which can be large for a Hessian.
        """
        out: dict[str, Any] = {"type": type(self).__name__}
        for spec in dataclasses.fields(self):
            if not include_vectors and spec.metadata.get("vector", False):
                continue
            out[spec.name] = _to_jsonable(getattr(self, spec.name), include_vectors)
        return out

    def to_json(self, path: str | os.PathLike | None = None, include_vectors: bool = True) -> str:
        """Serialize to strict JSON; when ``path`` is given also write it atomically.

        Strict (RFC 8259): a non-finite number (the NaN standard error of a single
        probe, say) is written as ``null`` and listed with its reason under
        ``"null_values"``, so every JSON parser reads the file. The file is written to a
        temporary file in the same directory and moved into place with ``os.replace``,
        so readers never see a partial file. Returns the JSON text.
        """
        text = strict_json_text(self.to_dict(include_vectors=include_vectors))
        if path is not None:
            atomic_write_text(path, text)
        return text.rstrip("\n")


@dataclass
class EigenResult(Result):
    """Extreme eigenvalues of a symmetric operator.

    ``eigenvalues`` are ordered by ``which``: largest first ("largest"),
    smallest first ("smallest"), by decreasing magnitude ("magnitude").

    What each number means (see :func:`spectra.eigenvalues`):

    * ``error_bounds[i]``: an eigenvalue of A lies within this distance of
      ``eigenvalues[i]`` (from the residual, or Kato–Temple with a gap read off the
      Ritz values), and, with probability at least ``1 − failure_probability`` over
      the random start, the true i-th eigenvalue in ``which`` order does (for
      "magnitude": its magnitude). Never below 10·(eps + √n·eps₆₄)·‖A‖, the rounding of
      the operator and of the method with a margin (about 1.2e-6·λ₁ for float32 Hessian
      products).
    * ``failure_probability``: the probability bound of that statement. Whether the
      Krylov space has found the *extreme* eigenvalues cannot be certified from
      products; for "lanczos" it rests on the random start (a polynomial bound in the
      spirit of Kuczyński & Woźniakowski 1992) and is at most the requested value when
      converged; "power" reports its bound at the requested probability (the larger of
      its residual and the bound from ‖A^m q‖); "lobpcg" gets it from a Lanczos run
      that verifies its pairs.
    * ``converged[i]``: ``error_bounds[i] <= max(tol·|λ_i|, 10·(eps + √n·eps₆₄)·‖A‖)`` and
      ``failure_probability`` at most the requested one (``settings["failure_probability"]``),
      for every method; otherwise ``settings["not_converged_reason"]`` says why in one
      line (None when all converged).
    * ``residual_norms[i]``: ``‖A v − λ v‖`` of the returned vector from the method's
      own products (the Lanczos relation β|e_mᵀs| for "lanczos"), exact up to the
      operator's rounding; no extra product is spent on them.
    """

    eigenvalues: np.ndarray
    residual_norms: np.ndarray
    error_bounds: np.ndarray
    converged: np.ndarray
    which: str
    method: str
    num_products: int
    num_operator_calls: int
    wall_time: float
    failure_probability: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    eigenvectors: np.ndarray | None = field(default=None, metadata=_VECTOR_FIELD)

    @property
    def all_converged(self) -> bool:
        """True when every requested eigenpair converged."""
        return bool(np.all(self.converged))


@dataclass
class LanczosResult(Result):
    """Lanczos tridiagonalization ``Qᵀ A Q = T``.

    ``alpha`` (length m) is the diagonal and ``beta`` (length m − 1) the
    off-diagonal of T; ``residual_norm`` is the norm of the next, unnormalized
    Lanczos vector (``A Q = Q T + residual_norm · q_{m+1} e_mᵀ``), zero or tiny on
    breakdown. ``breakdown`` is True when an invariant subspace was found before
    ``num_steps`` steps; then m < num_steps. ``basis`` (n × m, orthonormal
    columns) is present when requested.
    """

    alpha: np.ndarray
    beta: np.ndarray
    residual_norm: float
    breakdown: bool
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)
    basis: np.ndarray | None = field(default=None, metadata=_VECTOR_FIELD)

    @property
    def num_steps_taken(self) -> int:
        """Size m of the tridiagonal matrix."""
        return int(self.alpha.shape[0])

    def tridiagonal(self) -> np.ndarray:
        """The dense m × m tridiagonal matrix T."""
        return (np.diag(self.alpha) + np.diag(self.beta, 1) + np.diag(self.beta, -1)).astype(
            np.float64
        )

    def ritz_values(self) -> np.ndarray:
        """Eigenvalues of T in ascending order."""
        return tridiagonal_eigh(self.alpha, self.beta, eigenvectors=False)[0]


@dataclass
class TraceResult(Result):
    """Stochastic trace estimate with its standard error.

    ``stopped`` is "rtol" when the relative-error target was met and "budget"
    when the product budget ran out (or no target was set).
    """

    estimate: float
    stderr: float
    method: str
    stopped: str
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class FrobeniusResult(Result):
    """Frobenius norm ``‖A‖_F`` and ``‖A‖_F²`` with standard errors."""

    estimate: float
    stderr: float
    squared_estimate: float
    squared_stderr: float
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class DiagonalResult(Result):
    """Stochastic estimate of ``diag(A)`` with a per-entry standard error."""

    estimate: np.ndarray
    stderr: np.ndarray
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class DensityCurve(Result):
    """A smoothed spectral density on a grid with a confidence band.

    ``values`` is the mean over probes; ``lower``/``upper`` are mean ∓ 2
    standard errors across probes (lower clipped at 0). ``sigma`` is the
    Gaussian kernel width used.
    """

    grid: np.ndarray
    values: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    sigma: float


@dataclass
class SpectralMoments(Result):
    """Quadrature estimates of ``trace(A^p)/n`` for ``p = orders``."""

    orders: np.ndarray
    estimate: np.ndarray
    stderr: np.ndarray


def _gaussian_kernel_sums(
    grid: np.ndarray, nodes: np.ndarray, weights: np.ndarray, sigma: float
) -> np.ndarray:
    """Σ_i w_i N(x; θ_i, σ²) for each probe row: returns (num_probes, len(grid))."""
    out = np.empty((nodes.shape[0], grid.shape[0]))
    norm = 1.0 / (sigma * math.sqrt(2.0 * math.pi))
    for probe in range(nodes.shape[0]):
        keep = weights[probe] > 0
        z = (grid[:, None] - nodes[probe, keep][None, :]) / sigma
        out[probe] = norm * (np.exp(-0.5 * z * z) @ weights[probe, keep])
    return out


@dataclass
class SpectralDensity(Result):
    """Stochastic Lanczos quadrature of the spectral density.

    Row p of ``nodes``/``weights`` is the Gauss quadrature rule of probe p: the
    Ritz values of its Lanczos tridiagonal and the squared first components of
    the Ritz vectors (each row sums to 1). It approximates the spectral measure
    ``(1/n) Σ_i δ(t − λ_i)``. Probes that broke down early (``steps_taken`` <
    ``num_steps``) are padded with zero-weight copies of their last node.

    ``positive_semidefinite``: the operator is PSD (a GGN, a Fisher, K-FAC: it says so
    with ``is_positive_semidefinite = True``) and no node contradicted it beyond rounding.
    Its nodes are then >= 0 (those within rounding below 0 raised to 0), :meth:`density`
    reflects the Gaussian kernel at 0 (no mass below 0, still integrating to 1) and
    :meth:`mass_below` any threshold <= 0 is exactly 0.
    """

    nodes: np.ndarray
    weights: np.ndarray
    steps_taken: np.ndarray
    dimension: int
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)
    positive_semidefinite: bool = False

    @property
    def num_probes(self) -> int:
        return int(self.nodes.shape[0])

    @classmethod
    def from_eigenvalues(
        cls, eigenvalues: Any, *, settings: dict[str, Any] | None = None
    ) -> SpectralDensity:
        """The exact spectral measure ``(1/n) Σ_i δ(t − λ_i)`` of a matrix whose n
        eigenvalues are all known (e.g. ``KFACOperator.eigenvalues()``).

        One "probe" whose nodes are the eigenvalues in ascending order, each of weight 1/n,
        marked exact (``steps_taken = dimension = n``): :meth:`density` is the Gaussian
        smoothing of the true spectrum with no sampling error (a zero-width band),
        :meth:`moments` and :meth:`mass_below` are exact up to rounding. ``ValueError``
        for an empty or non-finite array.
        """
        values = np.sort(np.asarray(eigenvalues, dtype=np.float64).ravel())
        if values.size == 0 or not np.all(np.isfinite(values)):
            raise ValueError(
                "eigenvalues must be a non-empty array of finite numbers; got "
                f"{values.size} values, {int(np.sum(~np.isfinite(values)))} non-finite."
            )
        n = int(values.size)
        return cls(
            nodes=values[None, :],
            weights=np.full((1, n), 1.0 / n),
            steps_taken=np.array([n]),
            dimension=n,
            num_products=0,
            num_operator_calls=0,
            wall_time=0.0,
            settings={"method": "exact eigenvalues", "num_steps": n, **(settings or {})},
        )

    def default_sigma(self) -> float:
        """Default kernel width: (max node − min node) / 100.

        With the default 80 Lanczos steps a probe's Ritz values in the bulk are
        spaced roughly range/80 apart, so a width of about one such spacing
        hides the discreteness of the quadrature while keeping any feature wider
        than 1 % of the spectral range. If the spectrum is dominated by a few
        far outliers the bulk gets smoothed too: pass a smaller ``sigma``.
        A zero range (e.g. the zero matrix) falls back to ``1e-3·max(1, |node|)``.
        """
        used = self.nodes[self.weights > 0]
        spread = float(used.max() - used.min())
        if spread > 0:
            return spread / _KERNEL_WIDTHS_PER_RANGE
        return _DEGENERATE_KERNEL_WIDTH * max(1.0, float(np.abs(used).max()))

    def density(self, grid: np.ndarray | None = None, sigma: float | None = None) -> DensityCurve:
        """Gaussian-smoothed density ``φ_σ(x) = Σ_i w_i N(x; θ_i, σ²)`` (mean over probes).

        Integrates to 1 over the real line. The default grid covers
        [min node − 5σ, max node + 5σ] with at least 1000 points and at least 5
        points per σ (capped at 200 000). The band is mean ∓ 2 standard errors
        of the per-probe densities (a single probe gives a zero-width band).

        For a positive semidefinite density the kernel is reflected at 0:
        ``φ_σ(x) = Σ_i w_i [N(x; θ_i, σ²) + N(−x; θ_i, σ²)]`` for x >= 0 and 0 below, so
        no mass leaks below 0 (a null space's node at 0 would put half of its weight
        there) and the curve still integrates to 1; the default grid starts at 0.
        Reflection, not truncation: it keeps every node's whole weight on [0, ∞).
        """
        if sigma is None:
            sigma = self.default_sigma()
        sigma = float(sigma)
        if not sigma > 0:
            raise ValueError(f"sigma must be positive, got {sigma}")
        if grid is None:
            used = self.nodes[self.weights > 0]
            low, high = float(used.min()) - 5 * sigma, float(used.max()) + 5 * sigma
            if self.positive_semidefinite:
                low = max(low, 0.0)
            points = int(min(200_000, max(1000, math.ceil(5 * (high - low) / sigma))))
            grid = np.linspace(low, high, points)
        grid = np.asarray(grid, dtype=np.float64).ravel()
        per_probe = _gaussian_kernel_sums(grid, self.nodes, self.weights, sigma)
        if self.positive_semidefinite:
            per_probe += _gaussian_kernel_sums(-grid, self.nodes, self.weights, sigma)
            per_probe[:, grid < 0] = 0.0
        values = per_probe.mean(axis=0)
        if per_probe.shape[0] > 1:
            stderr = per_probe.std(axis=0, ddof=1) / math.sqrt(per_probe.shape[0])
        else:
            stderr = np.zeros_like(values)
        return DensityCurve(
            grid=grid,
            values=values,
            lower=np.maximum(values - 2 * stderr, 0.0),
            upper=values + 2 * stderr,
            sigma=sigma,
        )

    def moments(self, max_order: int = 4) -> SpectralMoments:
        """Estimates of ``trace(A^p)/n`` for p = 0..max_order with stderr across probes.

        Probe p gives ``Σ_i w_i θ_i^p = q₁ᵀ A^p q₁`` exactly for p < 2m (Gauss
        quadrature), an unbiased estimate of trace(A^p)/n for a normalized
        Rademacher or uniform-on-sphere probe.
        """
        if int(max_order) != max_order or max_order < 0:
            raise ValueError(f"max_order must be a non-negative integer, got {max_order}")
        orders = np.arange(int(max_order) + 1)
        per_probe = np.stack([(self.weights * self.nodes**p).sum(axis=1) for p in orders], axis=1)
        estimate = per_probe.mean(axis=0)
        if per_probe.shape[0] > 1:
            stderr = per_probe.std(axis=0, ddof=1) / math.sqrt(per_probe.shape[0])
        else:
            stderr = np.full(orders.shape, np.nan)
        return SpectralMoments(orders=orders, estimate=estimate, stderr=stderr)

    def _exact_rows(self) -> np.ndarray:
        """Probes whose quadrature is exact: their Krylov space is invariant (breakdown
        before the requested steps) or the whole space."""
        steps = int(self.nodes.shape[1])
        planned = min(int(self.settings.get("num_steps", steps)), self.dimension)
        return (self.steps_taken < planned) | (self.steps_taken >= self.dimension)

    def mass_below(self, threshold: float) -> SpectralMass:
        """Spectral mass below ``threshold``: ``(1/n)·#{i: λ_i < threshold}``, with an
        error bar for both of its errors.

        Probe p's Gauss rule brackets the mass of its own spectral measure μ_p: by the
        Chebyshev–Markov–Stieltjes inequalities, with k nodes below the threshold,
        ``Σ_{i<k} w_i <= μ_p((−∞, t)) <= Σ_{i<=k+1} w_i`` (Golub & Meurant 2010,
        §6.3; Szegő 1939, §3.41). m nodes cannot resolve mass closer to the
        threshold than the node spacing: the bracket's width (the two weights next to
        the threshold) says how much. The estimate is the mean over probes of the
        bracket midpoints; ``resolution`` is the mean half-width (a deterministic
        bound on the quadrature error of the probe average), ``stderr`` the standard
        error across probes (the sampling error of E[μ_p] = the spectral mass), and
        ``error = resolution + 2·stderr``. A probe whose Krylov space is invariant
        has an exact rule (zero width).

        For a positive semidefinite density, the mass below a threshold <= 0 is 0 with a
        zero error bar: the operator has no eigenvalue below 0 (the Gauss bracket, which
        does not know it, would put up to the weight of the node at 0 there).
        """
        threshold = float(threshold)
        if not math.isfinite(threshold):
            raise ValueError(f"threshold must be finite, got {threshold}")
        if self.positive_semidefinite and threshold <= 0:
            return SpectralMass(
                threshold=threshold,
                estimate=0.0,
                stderr=0.0,
                resolution=0.0,
                error=0.0,
                lower=0.0,
                upper=0.0,
                num_probes=self.num_probes,
                num_steps=int(self.steps_taken.max()),
            )
        below = self.nodes < threshold
        cumulative = np.cumsum(self.weights, axis=1)
        counts = below.sum(axis=1)
        rows = np.arange(self.num_probes)
        padded = np.concatenate([np.zeros((self.num_probes, 1)), cumulative], axis=1)
        width = self.nodes.shape[1]
        lower = padded[rows, np.maximum(counts - 1, 0)]
        upper = np.where(counts >= width, 1.0, padded[rows, np.minimum(counts + 1, width)])
        exact = self._exact_rows()
        quadrature = padded[rows, counts]
        lower = np.where(exact, quadrature, lower)
        upper = np.where(exact, quadrature, np.minimum(upper, 1.0))
        midpoints = 0.5 * (lower + upper)
        estimate = float(midpoints.mean())
        resolution = float(0.5 * (upper - lower).mean())
        if self.num_probes > 1:
            stderr = float(midpoints.std(ddof=1) / math.sqrt(self.num_probes))
        else:
            stderr = float("nan")
        error = resolution + 2.0 * (stderr if math.isfinite(stderr) else 0.0)
        return SpectralMass(
            threshold=threshold,
            estimate=estimate,
            stderr=stderr,
            resolution=resolution,
            error=error,
            lower=max(0.0, estimate - error),
            upper=min(1.0, estimate + error),
            num_probes=self.num_probes,
            num_steps=int(self.steps_taken.max()),
        )


@dataclass
class SpectralMass(Result):
    """Fraction of the spectrum below ``threshold`` from SLQ, with its error bar.

    ``estimate`` ± ``error`` where ``error = resolution + 2·stderr``: ``resolution``
    bounds the Gauss-quadrature error (what m Lanczos nodes cannot resolve near the
    threshold), ``stderr`` is the standard error across probes (NaN for one probe,
    which then has no sampling error bar). ``lower``/``upper`` are the error bar's
    ends clipped to [0, 1]. ``tau`` and ``lambda_max`` are set when the threshold is
    −τ·λ_max (see :func:`spectra.estimators.density.spectral_mass_below`).
    """

    threshold: float
    estimate: float
    stderr: float
    resolution: float
    error: float
    lower: float
    upper: float
    num_probes: int
    num_steps: int
    tau: float | None = None
    lambda_max: float | None = None


@dataclass
class InverseSolve(Result):
    """The record of one application of :func:`spectra.inverse`: ``(C + λI) X = B``.

    Per column of B: ``converged[j]`` is ``relative_residuals[j] <= tol``, where
    ``relative_residuals[j] = ‖(C + λI)x_j − b_j‖/‖b_j‖`` is the true residual (computed
    with a product after the iteration, not the recurrence's estimate; 0 for b_j = 0), and
    ``iterations[j]`` the solver's iterations for it. ``num_products`` and
    ``num_operator_calls`` count C's products and calls of the whole application (the
    residual checks included). ``reason`` says in one line why a column did not converge
    (the first one), None when all did.
    """

    method: str
    converged: np.ndarray
    iterations: np.ndarray
    relative_residuals: np.ndarray
    tol: float
    damping: float
    num_products: int
    num_operator_calls: int
    wall_time: float
    reason: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def all_converged(self) -> bool:
        """True when every right-hand side met ``tol``."""
        return bool(np.all(self.converged))


@dataclass
class LogDetResult(Result):
    """``log det(C + λI) = tr log(C + λI)`` by stochastic Lanczos quadrature.

    ``estimate`` is n times the mean over probes of each probe's Gauss quadrature of
    ``qᵀ log(C + λI) q``; ``stderr`` the standard error across probes (NaN for one probe);
    ``per_probe`` the probes' n·qᵀ log(C + λI) q; ``min_ritz_value`` the smallest
    quadrature node of C + λI (an upper bound on its smallest eigenvalue, positive here);
    ``steps_taken`` the Lanczos steps of each probe. See :func:`spectra.logdet`.
    """

    estimate: float
    stderr: float
    damping: float
    dimension: int
    num_probes: int
    min_ritz_value: float
    per_probe: np.ndarray
    steps_taken: np.ndarray
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class LogSpectralDensity(SpectralDensity):
    """SLQ density of ``t = log10|λ + shift|`` (see
    :func:`spectra.estimators.density.log_spectral_density`).

    ``nodes`` are the transformed quadrature nodes (each row ascending, its zero-weight
    padding last), ``weights`` the same Gauss weights, so :meth:`density` is the
    smoothed density of t and :meth:`moments` estimates ``(1/n)·tr(log10|A + shift·I|^p)``.
    ``folded`` is True when some node had λ + shift < 0 (t then mixes both signs of the
    spectrum); ``floor`` is the magnitude below which ``|λ + shift|`` was raised to it (a
    node at 0 has no logarithm), ``floored_mass`` the mean weight of those nodes.
    """

    shift: float = 0.0
    floor: float = 0.0
    floored_mass: float = 0.0
    folded: bool = False

    def mass_below(self, threshold: float) -> SpectralMass:
        """The mass of t below ``threshold``, bracketed as in
        :meth:`SpectralDensity.mass_below` when the transform is monotone (no folded
        nodes); refused (``ValueError``) for a folded density, whose Gauss rule does not
        bracket the mass of an interval ``|λ + shift| < 10^threshold``."""
        if self.folded:
            raise ValueError(
                "mass_below of a log10|λ + shift| density with λ + shift < 0 nodes has no "
                "bracket: use spectral_density(...).mass_below on λ itself, or a shift that "
                "makes the spectrum positive"
            )
        return super().mass_below(threshold)


def load(path: str | os.PathLike) -> Any:
    """The result in the JSON file ``path``, as its class: any type defined so far.

    Reads any result's :meth:`Result.to_json` whose class is defined (the estimators' own
    always; the analysis results and the commands' reports once their modules are
    imported: :func:`spectra.load`, :func:`spectra.reports.loading.load`, imports them all
    and reads ``results.json``, ``landscape.json`` and ``sharpness.json`` too): the file's
    ``"type"`` field names the class, and :meth:`Result.from_dict` rebuilds it with numpy
    arrays, the NaN and ±inf written as null restored, after checking every field (types,
    lengths that must agree, NaN where a number is required, the keys the figures read). No
    TensorFlow is imported.

    Raises
    ------
    ValueError
        one line naming ``path`` and the cause: not UTF-8, not JSON, cut short, nested
        too deep (:func:`spectra.io.files.read_json`), no or an unknown ``"type"``; or a
        field that is not what its class holds, named by its path in the file, e.g.
        ``out/results.json: "eigenvalues.eigenvalues" has 1 value but
        "eigenvalues.error_bounds" has 2; the file was edited or is damaged — rerun the
        analysis (spectra analyze)`` (a :class:`spectra.io.result_validation.FieldError`).
    OSError
        the file cannot be read (FileNotFoundError for a missing file).
    """
    where = os.fspath(path)
    payload = read_json(where)
    if not isinstance(payload, dict) or not isinstance(payload.get("type"), str):
        raise ValueError(
            f'{where}: not a spectra result (a JSON object with a "type" field is needed)'
        )
    kind = payload["type"]
    cls = _result_class(kind)
    if cls is None:
        known = sorted(set(_RESULT_TYPES) - {"Result"})
        raise ValueError(f"{where}: unknown result type {kind!r} (known: {', '.join(known)})")
    try:
        return cls.from_dict(payload)
    except FieldError as error:
        raise damaged_file(where, kind, error) from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
