"""Per-layer (per-group) spectra: the diagonal blocks H_ll of a Hessian in one go.

For a partition of the parameters into groups (by default one per Keras layer), the
block H_ll is the Hessian restricted to group l. A column that holds a vector v_l on the
entries of group l and zeros elsewhere has ``(H v_l)_l = H_ll v_l`` on those entries, so
one ``matmat`` with one such column per group advances every group at once: one data
pass serves all layers, where one operator per layer would cost one pass per layer and
product.

:func:`layerwise` runs one thick-restart Lanczos recurrence per group (Wu & Simon 2000;
Stewart's Krylov–Schur form, 2001) in lock-step, with full reorthogonalization inside
each group, and Hutchinson's trace estimator (1989) with Rademacher probes restricted to
each group in the same passes.

What it saves is data passes, not arithmetic: each column is a full Hessian-vector
product (the operator does not know that it is zero outside a group). Where a pass is
cheap (a cached operator on CPU), one operator per layer (``variables=`` that layer's
weights), whose products differentiate fewer weights, can take less time; where passes
dominate (streaming data, many batches, accelerators), one pass for all layers wins.

Error bounds (Parlett, "The Symmetric Eigenvalue Problem", 1998, §11.5-11.7): a Ritz
pair (θ, x) of H_ll with residual r = ‖H_ll x − θx‖ proves that some eigenvalue of H_ll
lies within r of θ. Where the nearest other Ritz value θ' is separated from θ by more
than its own residual r', the bound tightens to r²/δ with δ = |θ − θ'| − r' (Kato–Temple);
that gap is certified only if the Krylov space has seen every eigenvalue near θ, which
from a random start holds with high probability, not surely (Kuczyński & Woźniakowski
1992). Likewise, that θ approximates the k-th *largest* eigenvalue is probabilistic, and
a single-vector Krylov space sees an exactly repeated eigenvalue once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.sparse.linalg import aslinearoperator

from spectra.results import Result

__all__ = ["LayerwiseResult", "layerwise"]

# Basis size of each group's restarted Lanczos: max(2k + 1, this), at most the group size.
_MIN_BASIS = 20
# Breakdown (invariant subspace) when β <= factor · eps · ‖H_ll‖ (estimate).
_BREAKDOWN_FACTOR = 100.0
# Eigenvalue errors below factor · eps · ‖H_ll‖ count as converged whatever ``tol``.
_FLOOR_FACTOR = 10.0
# Trace probes per group and pass once every group's Lanczos run has stopped.
_TRACE_BLOCK = 16
# Symmetry test tolerance relative to (‖Au‖ + ‖Av‖)/sqrt(n) for random unit u, v.
_SYMMETRY_TOL = {np.dtype(np.float64): 1e-8}
_SYMMETRY_TOL_LOW_PRECISION = 1e-3


@dataclass
class LayerwiseResult(Result):
    """Top eigenvalues (and traces) of the diagonal blocks H_ll, one entry per group.

    ``groups`` are the group names and ``group_sizes`` their numbers of parameters. Per
    group: ``eigenvalues`` (min(k, size) values, largest first), ``residual_norms``
    (‖H_ll x − θx‖ recomputed with one final product of the Ritz vectors),
    ``error_bounds`` (min(r, r²/δ), never below eps·‖H_ll‖; see the module docstring),
    ``converged`` (bound <= tol·|θ|) and ``num_steps`` (Lanczos products of the group).
    ``traces``/``trace_stderr`` are Hutchinson estimates of tr(H_ll) and their standard
    errors (None unless asked for). ``num_products`` counts every vector multiplied,
    ``num_operator_calls`` the ``matmat`` calls (data passes of a Hessian).
    """

    groups: list[str]
    group_sizes: list[int]
    eigenvalues: list[np.ndarray]
    residual_norms: list[np.ndarray]
    error_bounds: list[np.ndarray]
    converged: list[np.ndarray]
    num_steps: list[int]
    traces: np.ndarray | None
    trace_stderr: np.ndarray | None
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def all_converged(self) -> bool:
        """True when every requested eigenvalue of every group converged."""
        return all(bool(np.all(flags)) for flags in self.converged)

    @property
    def top_eigenvalues(self) -> np.ndarray:
        """The largest eigenvalue of each group, shape (number of groups,)."""
        return np.array([values[0] for values in self.eigenvalues])

    def rows(self) -> list[dict[str, Any]]:
        """One plain dictionary per group (a table for reports)."""
        out = []
        for i, name in enumerate(self.groups):
            row: dict[str, Any] = {
                "group": name,
                "size": self.group_sizes[i],
                "eigenvalues": self.eigenvalues[i].tolist(),
                "error_bounds": self.error_bounds[i].tolist(),
                "converged": bool(np.all(self.converged[i])),
            }
            if self.traces is not None and self.trace_stderr is not None:
                row["trace"] = float(self.traces[i])
                row["trace_stderr"] = float(self.trace_stderr[i])
            out.append(row)
        return out


# -- groups ------------------------------------------------------------------------------------
def _variable_label(variable: Any, position: int) -> str:
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(variable, "name", None)
    if isinstance(name, str) and name:
        return name.removesuffix(":0")
    return f"variable_{position}"


def _default_groups(variables: Sequence[Any]) -> tuple[list[str], list[list[int]], str]:
    """One group per Keras layer (the parent of ``variable.path``), else per variable."""
    if all(isinstance(getattr(v, "path", None), str) for v in variables):
        keys: dict[str, list[int]] = {}
        for position, variable in enumerate(variables):
            keys.setdefault(variable.path.rpartition("/")[0] or variable.path, []).append(position)
        names = list(keys)
        # "sequential/dense", "sequential/dense_1" -> "dense", "dense_1"
        firsts = {name.partition("/")[0] for name in names}
        if len(firsts) == 1 and all("/" in name for name in names):
            short = [name.partition("/")[2] for name in names]
            if len(set(short)) == len(short):
                names = short
        return names, list(keys.values()), "layers"
    names = []
    for position, variable in enumerate(variables):
        label = _variable_label(variable, position)
        names.append(label if label not in names else f"{label}_{position}")
    return names, [[position] for position in range(len(variables))], "variables"


def _position_of(variable: Any, variables: Sequence[Any], group: str) -> int:
    if isinstance(variable, (int, np.integer)) and not isinstance(variable, bool):
        if not 0 <= variable < len(variables):
            raise ValueError(
                f"group {group!r}: variable index {variable} is out of range for the "
                f"operator's {len(variables)} variables"
            )
        return int(variable)
    handle = getattr(variable, "value", variable)
    for position, candidate in enumerate(variables):
        if candidate is variable or getattr(candidate, "value", candidate) is handle:
            return position
    raise ValueError(
        f"group {group!r}: {_variable_label(variable, -1)!r} is not one of the operator's "
        "variables (op.variables)"
    )


def _members(value: Any, group: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        members = list(value)
    elif isinstance(value, np.ndarray):
        members = value.reshape(-1).tolist()
    elif isinstance(value, range):
        members = list(value)
    else:
        members = [value]
    if not members:
        raise ValueError(f"group {group!r} is empty")
    return members


def _check_partition(
    names: list[str], parts: list[np.ndarray], total: int, unit: str, labels: Sequence[str]
) -> None:
    """Every item of ``range(total)`` in exactly one part; clear errors otherwise."""
    owner = np.full(total, -1)
    for index, part in enumerate(parts):
        values, counts = np.unique(part, return_counts=True)
        if np.any(counts > 1):
            twice = labels[int(values[counts > 1][0])]
            raise ValueError(f"group {names[index]!r} lists {unit} {twice!r} twice")
        taken = part[owner[part] >= 0]
        if taken.size:
            other = names[int(owner[taken[0]])]
            raise ValueError(
                f"{unit} {labels[int(taken[0])]!r} is in groups {other!r} and "
                f"{names[index]!r}: groups must not overlap"
            )
        owner[part] = index
    missing = np.flatnonzero(owner < 0)
    if missing.size:
        shown = [labels[int(i)] for i in missing[:5]]
        more = f" and {missing.size - 5} more" if missing.size > 5 else ""
        raise ValueError(
            f"{missing.size} {unit}(s) are in no group: {shown}{more}. Groups must cover "
            "every parameter; put the rest in a group of its own (e.g. 'other')"
        )


def _resolve_groups(op: Any, groups: Any, n: int) -> tuple[list[str], list[np.ndarray], str]:
    """Group names and the parameter indices of each group (a partition of range(n))."""
    if groups is not None and not isinstance(groups, Mapping):
        raise TypeError(
            f"groups must be a mapping of names to lists of variables, got {type(groups).__name__}"
        )
    if groups is not None and not groups:
        raise ValueError("groups is empty")
    variables = getattr(op, "variables", None)
    if variables is None:
        if groups is None:
            raise ValueError(
                f"{type(op).__name__} has no variables to group: pass groups as a mapping "
                "of names to parameter indices (0 <= i < n)"
            )
        names, parts = [], []
        for key, value in groups.items():
            try:
                part = np.asarray(_members(value, str(key)), dtype=np.int64)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"group {key!r}: expected parameter indices (integers), got {value!r}"
                ) from error
            if part.min() < 0 or part.max() >= n:
                raise ValueError(f"group {key!r}: parameter indices must be in [0, {n})")
            names.append(str(key))
            parts.append(part)
        _check_partition(names, parts, n, "parameter", [str(i) for i in range(n)])
        return names, parts, "given"
    variables = list(variables)
    shapes = getattr(op, "variable_shapes", None) or [tuple(v.shape) for v in variables]
    sizes = [math.prod(shape) for shape in shapes]
    if sum(sizes) != n:
        raise ValueError(
            f"the operator's variables have {sum(sizes)} entries but its dimension is {n}"
        )
    labels = [_variable_label(v, i) for i, v in enumerate(variables)]
    if groups is None:
        names, members, origin = _default_groups(variables)
    else:
        names = [str(key) for key in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be distinct as strings, got {names}")
        members = [
            [_position_of(item, variables, name) for item in _members(value, name)]
            for name, value in zip(names, groups.values())
        ]
        origin = "given"
    positions = [np.asarray(member, dtype=np.int64) for member in members]
    _check_partition(names, positions, len(variables), "variable", labels)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    parts = [
        np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in member])
        for member in members
    ]
    return names, parts, origin


# -- one group's Lanczos -----------------------------------------------------------------------
def _bounds(theta: np.ndarray, residuals: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """min(r, r²/δ) for the wanted Ritz values, δ = min over the others of |θ − θ'| − r'.

    A gap that is not positive (an unresolved neighbour) leaves the bound r.
    """
    bounds = residuals[wanted].copy()
    if theta.size < 2:
        return bounds
    for row, index in enumerate(wanted):
        others = np.delete(np.arange(theta.size), index)
        gap = float(np.min(np.abs(theta[index] - theta[others]) - residuals[others]))
        if gap > 0:
            bounds[row] = min(bounds[row], residuals[index] ** 2 / gap)
    return bounds


class _GroupLanczos:
    """Thick-restart Lanczos on one block, fed one product at a time.

    Keeps ``A Vᵀ = Vᵀ T + f bᵀ`` for the orthonormal rows V (``active`` of them), the
    projected matrix T and the unit residual direction f, the next vector to multiply.
    When V is full the best Ritz vectors are kept (T becomes diagonal plus the coupling
    b). On breakdown (an invariant subspace) the run continues from a random direction
    orthogonal to V, or stops when V spans the whole block (its Ritz values are exact).
    """

    def __init__(
        self, size: int, k: int, tol: float, max_steps: int, eps: float, rng: np.random.Generator
    ):
        self.size = size
        self.k = min(k, size)
        self.tol = tol
        self.max_steps = max_steps
        self.eps = eps
        self.rng = rng
        self.capacity = min(size, max(2 * self.k + 1, _MIN_BASIS))
        self.basis = np.zeros((self.capacity, size))
        self.projected = np.zeros((self.capacity, self.capacity))
        self.coupling = np.zeros(self.capacity)
        self.active = 0
        start = rng.standard_normal(size)
        self.direction = start / np.linalg.norm(start)
        self.anorm = 0.0
        self.steps = 0
        self.exhausted = False
        self.done = False
        self.theta = np.zeros(0)
        self.ritz_vectors = np.zeros((0, 0))
        self.residuals = np.zeros(0)

    def _fresh_direction(self) -> bool:
        vector = self.rng.standard_normal(self.size)
        stored = self.basis[: self.active]
        for _ in range(2):
            vector -= stored.T @ (stored @ vector)
        norm = float(np.linalg.norm(vector))
        if not norm > 1e-8 * math.sqrt(self.size):
            return False
        self.direction = vector / norm
        return True

    def _restart(self) -> None:
        order = np.argsort(-self.theta, kind="stable")
        count = min(self.active - 1, max(self.k + (self.active - self.k) // 2, 1))
        keep = self.ritz_vectors[:, order[:count]]
        self.basis[:count] = keep.T @ self.basis[: self.active]
        self.projected[:] = 0.0
        self.projected[np.arange(count), np.arange(count)] = self.theta[order[:count]]
        coupling = self.coupling[: self.active] @ keep
        self.coupling[:] = 0.0
        self.coupling[:count] = coupling
        self.active = count

    def absorb(self, image: np.ndarray) -> None:
        """Take ``A_ll · direction``: extend V, update the Ritz pairs and the stop flag."""
        if self.active == self.capacity:
            self._restart()
        j = self.active
        self.basis[j] = self.direction
        w = np.array(image, dtype=np.float64)
        self.anorm = max(self.anorm, float(np.linalg.norm(w)))
        stored = self.basis[: j + 1]
        column = np.zeros(j + 1)
        for _ in range(2):
            correction = stored @ w
            w -= stored.T @ correction
            column += correction
        self.projected[: j + 1, j] = column
        self.projected[j, : j + 1] = column
        self.active = j + 1
        self.steps += 1
        self.coupling[: self.active] = 0.0
        beta = float(np.linalg.norm(w))
        if self.active >= self.size or beta <= _BREAKDOWN_FACTOR * self.eps * self.anorm:
            if self.active >= self.size or not self._fresh_direction():
                self.exhausted = True
        else:
            self.coupling[j] = beta
            self.direction = w / beta
        theta, vectors = np.linalg.eigh(self.projected[: self.active, : self.active])
        self.theta, self.ritz_vectors = theta, vectors
        self.residuals = np.abs(self.coupling[: self.active] @ vectors)
        self.anorm = max(self.anorm, float(np.abs(theta).max()))
        converged = self.active >= self.k and bool(np.all(self.converged_flags()))
        self.done = self.exhausted or converged or self.steps >= self.max_steps

    def _wanted(self) -> np.ndarray:
        return np.argsort(-self.theta, kind="stable")[: self.k]

    def converged_flags(self) -> np.ndarray:
        wanted = self._wanted()
        values = self.theta[wanted]
        targets = np.maximum(self.tol * np.abs(values), _FLOOR_FACTOR * self.eps * self.anorm)
        return _bounds(self.theta, self.residuals, wanted) <= targets

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(values largest first, Ritz vectors as rows, error bounds, converged)."""
        wanted = self._wanted()
        vectors = self.ritz_vectors[:, wanted].T @ self.basis[: self.active]
        bounds = _bounds(self.theta, self.residuals, wanted)
        return self.theta[wanted], vectors, bounds, self.converged_flags()


# -- the driver -----------------------------------------------------------------------------
def _check_number(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def layerwise(
    op: Any,
    k: int = 1,
    trace: bool = False,
    *,
    groups: Mapping[str, Any] | None = None,
    tol: float = 1e-6,
    num_products: int | None = None,
    num_probes: int = 50,
    seed: int | np.random.Generator | None = 0,
    check_symmetry: bool = True,
) -> LayerwiseResult:
    """Top-k eigenvalues (and traces) of each diagonal block H_ll, all groups at once.

    Parameters
    ----------
    op : symmetric LinearOperator (a :class:`~spectra.HessianOperator`, a preconditioned
        one...) or dense array, n × n.
    k : eigenvalues per group (a group with fewer parameters gets all of its own).
    trace : also estimate tr(H_ll) per group (Hutchinson, ``num_probes`` Rademacher
        probes restricted to each group), with standard errors.
    groups : mapping of group names to lists of variables of ``op.variables`` (or of
        their positions in it). Default: one group per Keras layer with trainable
        weights (the parent of ``variable.path``, e.g. "dense_1/kernel" → "dense_1"; a
        prefix shared by all groups, like "sequential/", is dropped), or one group per
        variable for variables without a Keras path. For an operator without
        ``variables`` (e.g. a dense matrix), a mapping of names to parameter indices
        is required. Groups must not overlap and must cover every parameter (a missing
        one is an error naming it: put the rest in a group of its own, e.g. "other").
    tol : relative eigenvalue error at which a group stops: the bound min(r, r²/δ)
        <= tol·|θ| (or below 10·eps·‖H_ll‖, the operator's rounding) for its k values.
    num_products : at most this many Lanczos products per group (>= k; default
        1000 + 100k); a group that has not converged by then reports ``converged=False``.
    num_probes : Hutchinson probes per group (>= 2) when ``trace``.
    seed : seed of the start vectors and probes.
    check_symmetry : a randomized symmetry test (2 products, in the first pass).

    Cost: each pass is ONE ``matmat`` holding one Lanczos column per still-running group
    (column l is zero outside group l, and the group-l rows of its product are H_ll v_l),
    the trace probes (one per group and pass while Lanczos runs, then 16 per group),
    and, in the last Lanczos-free pass, the k Ritz vectors of every group for their
    residuals. Data passes: about max_l(steps_l) + 1; products: Σ_l steps_l + Σ_l k_l +
    (number of groups)·num_probes (+ 2). The host keeps at most max(2k + 1, 20) vectors of
    each group's length, i.e. max(2k + 1, 20)·n numbers in all.
    """
    started = time.perf_counter()
    k = _check_number("k", k, 1)
    if num_products is None:
        num_products = 1000 + 100 * k
    num_products = _check_number("num_products", num_products, k)
    num_probes = _check_number("num_probes", num_probes, 2)
    if not (isinstance(tol, (int, float)) and tol > 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a positive finite number, got {tol!r}")
    try:
        operator = aslinearoperator(op)
    except TypeError as error:
        raise ValueError(f"cannot use {type(op).__name__} as a linear operator: {error}") from error
    n = int(operator.shape[0])
    if tuple(operator.shape) != (n, n) or n < 1:
        raise ValueError(f"op must be square with n >= 1, got shape {tuple(operator.shape)}")
    names, parts, origin = _resolve_groups(op, groups, n)
    dtype = np.dtype(operator.dtype) if np.dtype(operator.dtype).kind == "f" else np.dtype("f8")
    eps = float(np.finfo(dtype).eps)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    # Separate streams: the eigenvalues do not depend on whether traces are estimated.
    lanczos_rng, probe_rng = rng.spawn(2)

    states = [
        _GroupLanczos(part.size, k, float(tol), num_products, eps, lanczos_rng) for part in parts
    ]
    probes_left = num_probes if trace else 0
    samples: list[list[float]] = [[] for _ in parts]
    final: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = None
    residual_norms: list[np.ndarray] = []
    counts = {"products": 0, "calls": 0}
    symmetry_probes = np.zeros((n, 0))
    if check_symmetry:
        symmetry_probes = np.random.default_rng(0x5EED).standard_normal((n, 2))
        symmetry_probes /= np.linalg.norm(symmetry_probes, axis=0)

    while True:
        running = [not state.done for state in states]
        if not any(running) and final is None:
            final = [state.result() for state in states]
        check_residuals = final is not None and not residual_norms
        width = min(probes_left, 1 if any(running) else _TRACE_BLOCK)
        if not (any(running) or check_residuals or width):
            break  # all groups stopped, residuals checked, probes done
        # One block: symmetry probes | Lanczos vectors | trace probes | Ritz vectors.
        lanczos = [
            state.direction[:, None] if active else np.zeros((state.size, 0))
            for state, active in zip(states, running)
        ]
        probes = [_rademacher_block(probe_rng, part.size, width) for part in parts]
        if check_residuals:
            ritz = [vectors.T for _, vectors, _, _ in final]
        else:
            ritz = [np.zeros((part.size, 0)) for part in parts]
        sections = [lanczos, probes, ritz]
        block = np.concatenate(
            [symmetry_probes] + [_embed(n, parts, pieces) for pieces in sections], axis=1
        )
        image = np.asarray(
            operator.matmat(np.ascontiguousarray(block, dtype=dtype)), dtype=np.float64
        ).reshape(n, -1)
        if not np.all(np.isfinite(image)):
            raise ValueError("the operator returned NaN or Inf")
        counts["products"] += block.shape[1]
        counts["calls"] += 1
        at = symmetry_probes.shape[1]
        if at:
            _check_symmetry(symmetry_probes, image[:, :at], dtype)
            symmetry_probes = np.zeros((n, 0))
        own_lanczos, own_probes, own_ritz = _restrict(image[:, at:], parts, sections)
        for state, active, own in zip(states, running, own_lanczos):
            if active:
                state.absorb(own[:, 0])
        for i, (probe, own) in enumerate(zip(probes, own_probes)):
            samples[i].extend(np.einsum("ij,ij->j", probe, own).tolist())
        probes_left -= width
        if check_residuals:
            for (values, vectors, _, _), own in zip(final, own_ritz):
                residual_norms.append(np.linalg.norm(own - vectors.T * values, axis=0))

    assert final is not None
    eigenvalues, error_bounds, converged = [], [], []
    for state, (values, _, bounds, flags) in zip(states, final):
        scale = max(float(np.max(np.abs(values), initial=0.0)), state.anorm)
        eigenvalues.append(np.asarray(values, dtype=np.float64))
        error_bounds.append(np.maximum(bounds, eps * scale))
        converged.append(np.asarray(flags, dtype=bool))
    traces = trace_stderr = None
    if trace:
        table = np.array(samples)
        traces = table.mean(axis=1)
        trace_stderr = table.std(axis=1, ddof=1) / math.sqrt(table.shape[1])
    return LayerwiseResult(
        groups=names,
        group_sizes=[int(part.size) for part in parts],
        eigenvalues=eigenvalues,
        residual_norms=residual_norms,
        error_bounds=error_bounds,
        converged=converged,
        num_steps=[state.steps for state in states],
        traces=traces,
        trace_stderr=trace_stderr,
        num_products=counts["products"],
        num_operator_calls=counts["calls"],
        wall_time=time.perf_counter() - started,
        settings={
            "k": k,
            "trace": bool(trace),
            "tol": float(tol),
            "num_products": num_products,
            "num_probes": num_probes if trace else 0,
            "groups": origin,
            "seed": seed if isinstance(seed, (int, type(None))) else "generator",
            "check_symmetry": bool(check_symmetry),
            "dimension": n,
        },
    )


def _embed(n: int, parts: list[np.ndarray], pieces: list[np.ndarray]) -> np.ndarray:
    """Columns holding each group's vectors on its own entries, zero elsewhere.

    ``pieces[l]`` has shape (size of group l, w_l); the result (n, Σ w_l) has group 0's
    columns first.
    """
    block = np.zeros((n, sum(piece.shape[1] for piece in pieces)))
    at = 0
    for part, piece in zip(parts, pieces):
        block[part, at : at + piece.shape[1]] = piece
        at += piece.shape[1]
    return block


def _restrict(
    image: np.ndarray, parts: list[np.ndarray], sections: list[list[np.ndarray]]
) -> list[list[np.ndarray]]:
    """Inverse of ``_embed`` for the product of consecutive embedded sections: each
    group's rows of the columns it owns, i.e. H_ll times its own vectors."""
    out, at = [], 0
    for pieces in sections:
        own = []
        for part, piece in zip(parts, pieces):
            own.append(image[part, at : at + piece.shape[1]])
            at += piece.shape[1]
        out.append(own)
    return out


def _rademacher_block(rng: np.random.Generator, size: int, width: int) -> np.ndarray:
    """Independent ±1 entries, shape (size, width)."""
    return rng.integers(0, 2, size=(size, width)).astype(np.float64) * 2.0 - 1.0


def _check_symmetry(probes: np.ndarray, images: np.ndarray, dtype: np.dtype) -> None:
    """``|u·Av − v·Au| <= tol·(‖Au‖ + ‖Av‖)/sqrt(n)`` for the two random unit probes."""
    tol = _SYMMETRY_TOL.get(np.dtype(dtype), _SYMMETRY_TOL_LOW_PRECISION)
    asymmetry = abs(float(probes[:, 0] @ images[:, 1]) - float(probes[:, 1] @ images[:, 0]))
    scale = float(np.linalg.norm(images, axis=0).sum()) / math.sqrt(probes.shape[0])
    if not asymmetry <= tol * scale:
        raise ValueError(
            f"operator is not symmetric: |u·Av − v·Au| = {asymmetry:.3e} exceeds "
            f"{tol:.1e} × {scale:.3e} for random unit u, v (pass check_symmetry=False "
            "to skip this test)"
        )
