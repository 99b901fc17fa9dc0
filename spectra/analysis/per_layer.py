"""Per-layer (per-group) spectra: the diagonal blocks H_ll of a Hessian in one go.

For a partition of the parameters into groups (by default one per Keras layer), the
block H_ll is the Hessian restricted to group l. A column that holds a vector v_l on the
entries of group l and zeros elsewhere has ``(H v_l)_l = H_ll v_l`` on those entries, so
one ``matmat`` with one such column per group advances every group at once: one data
pass serves all layers, where one operator per layer would cost one pass per layer and
product.

:func:`layerwise` runs one Krylov–Schur restarted Lanczos state per group (Stewart
2001; thick restart, Wu & Simon 2000), the same one :func:`spectra.eigenvalues` uses, fed
one product at a time so that all groups advance in lock-step, with full
reorthogonalization inside each group, and Hutchinson's trace estimator (1989) with
Rademacher probes restricted to each group in the same passes.

What it saves is data passes, not arithmetic: each column is a full Hessian-vector
product (the operator does not know that it is zero outside a group). Where a pass is
cheap (a cached operator on CPU), one operator per layer (``variables=`` that layer's
weights), whose products differentiate fewer weights, can take less time; where passes
dominate (streaming data, many batches, accelerators), one pass for all layers wins.

Error bounds: those of :func:`spectra.eigenvalues` (see its module docstring), per block.
A Ritz pair (θ, x) of H_ll with residual r = ‖H_ll x − θx‖ proves that some eigenvalue
of H_ll lies within r of θ, and within r²/δ (Kato–Temple; Parlett, "The Symmetric
Eigenvalue Problem", 1998, §10.2, §11.5-11.7) when the gap δ to every other eigenvalue
is certified by the other Ritz values' residual intervals and by the probabilistic bound
on the rest of the block's spectrum. That θ is the k-th *largest* eigenvalue of the
block cannot be certified from products: each group runs until, with probability at
least 1 − failure_probability / (number of groups) over its random start, no
eigenvalue lies beyond the reported ones by more than their bounds (the a posteriori
Kuczyński–Woźniakowski bound, 1992); the result's ``failure_probability`` is the sum
over the groups. A single-vector Krylov space sees an exactly repeated eigenvalue once;
for k > 1 the verification run from a random start orthogonal to the converged vectors
finds further copies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra._validation import check_float, check_int, is_bool
from spectra.estimators._products import (
    SYMMETRY_SEED,
    ProductProgress,
    SeedLike,
    as_symmetric_operator,
    one_blas_thread,
    rademacher_vectors,
    seed_setting,
    seeded_rng,
)
from spectra.estimators.eigenpairs import Pairs
from spectra.estimators.eigensolvers import DEFAULT_FAILURE_PROBABILITY, unresolved_zero
from spectra.estimators.krylov_schur import KrylovSchur
from spectra.estimators.results import Result
from spectra.operators.block_diagonal import layer_groups

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

__all__ = ["LayerwiseResult", "layerwise"]

# Basis size of each group's restarted Lanczos: max(2k + 1, this), at most the group size.
_MIN_BASIS = 20
# Trace probes per group and pass once every group's Lanczos run has stopped.
_TRACE_BLOCK = 16
# The progress bar plans about this many Lanczos products per wanted value and group.
_PLANNED_STEPS_PER_VALUE = 20


@dataclass
class LayerwiseResult(Result):
    """Top eigenvalues (and traces) of the diagonal blocks H_ll, one entry per group.

    ``groups`` are the group names and ``group_sizes`` their numbers of parameters. Per
    group: ``eigenvalues`` (min(k, size) values, largest first), ``residual_norms``
    (‖H_ll x − θx‖ recomputed with one final product of the Ritz vectors),
    ``error_bounds`` (certified for some eigenvalue of H_ll, and for the i-th largest
    with probability; never below eps·‖H_ll‖; see the module docstring), ``converged``
    (bound <= ``tol·|θ|``) and ``num_steps`` (Lanczos products of the group).
    ``traces``/``trace_stderr`` are Hutchinson estimates of tr(H_ll) and their standard
    errors (None unless asked for). ``num_products`` counts every vector multiplied,
    ``num_operator_calls`` the ``matmat`` calls (data passes of a Hessian).
    ``failure_probability``: every error bound of every group holds for the i-th largest
    eigenvalue of its block with probability at least 1 − failure_probability.
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
    failure_probability: float | None = None

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
    """One group per Keras layer (runs of variables sharing the parent of ``variable.path``,
    :func:`~spectra.operators.block_diagonal.layer_groups`), else per variable."""
    if all(isinstance(getattr(v, "path", None), str) for v in variables):
        names, members = layer_groups([v.path for v in variables])
        return names, members, "layers"
    names = []
    for position, variable in enumerate(variables):
        label = _variable_label(variable, position)
        names.append(label if label not in names else f"{label}_{position}")
    return names, [[position] for position in range(len(variables))], "variables"


def _position_of(variable: Any, variables: Sequence[Any], group: str) -> int:
    if isinstance(variable, (str, bytes)):
        raise TypeError(
            f"groups[{group!r}] holds the string {variable!r}: give variables (from "
            "op.variables) or integer indices (names are not looked up)"
        )
    if isinstance(variable, (float, np.floating)):
        raise TypeError(
            f"groups[{group!r}] has a non-integer index {variable!r}: give integer "
            "indices or variables"
        )
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
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"groups[{group!r}] is the string {value!r}: give a list of variables or of "
            "integer indices (names are not looked up)"
        )
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


def _resolve_groups(
    op: LinearOperator, groups: Any, n: int
) -> tuple[list[str], list[np.ndarray], str]:
    """Group names and the parameter indices of each group (a partition of range(n))."""
    if isinstance(groups, (str, bytes)):
        raise TypeError(
            f"groups is the string {groups!r}: give a mapping of group names to lists of "
            f"variables or integer indices, e.g. {{{groups!r}: [...]}}"
        )
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
            members = _members(value, str(key))
            for member in members:
                if is_bool(member) or not isinstance(member, (int, np.integer)):
                    raise TypeError(
                        f"groups[{key!r}] has a non-integer index {member!r}: give integer "
                        f"parameter indices (0 <= i < {n})"
                    )
            part = np.asarray(members, dtype=np.int64)
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


# -- the driver -----------------------------------------------------------------------------
def layerwise(
    op: LinearOperator,
    k: int = 1,
    trace: bool = False,
    *,
    groups: Mapping[str, Any] | None = None,
    tol: float = 1e-6,
    num_products: int | None = None,
    num_probes: int = 50,
    seed: SeedLike = 0,
    check_symmetry: bool = True,
    failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
    progress: bool | None = None,
) -> LayerwiseResult:
    """Top-k eigenvalues (and traces) of each diagonal block H_ll, all groups at once.

    Parameters
    ----------
    op
        symmetric LinearOperator (a :class:`~spectra.HessianOperator`, a preconditioned
        one...) or dense array, n × n.
    k
        eigenvalues per group (a group with fewer parameters gets all of its own).
    trace
        also estimate tr(H_ll) per group (Hutchinson, ``num_probes`` Rademacher
        probes restricted to each group), with standard errors.
    groups
        mapping of group names to lists of variables of ``op.variables`` (or of
        their positions in it). Default: one group per Keras layer with trainable
        weights (the parent of ``variable.path``, e.g. "dense_1/kernel" → "dense_1"; a
        prefix shared by all groups, like "sequential/", is dropped), or one group per
        variable for variables without a Keras path. For an operator without
        ``variables`` (e.g. a dense matrix), a mapping of names to parameter indices
        is required. Groups must not overlap and must cover every parameter (a missing
        one is an error naming it: put the rest in a group of its own, e.g. "other").
    tol
        relative eigenvalue error at which a group stops: its k error bounds (see the
        module docstring) <= ``tol·|θ|``, or below 10·eps·‖H_ll‖ (the operator's rounding).
    num_products
        at most this many Lanczos products per group (>= k; default
        1000 + 100k); a group that has not converged by then reports ``converged=False``.
    num_probes
        Hutchinson probes per group (>= 2) when ``trace``.
    seed
        seed of the start vectors and probes.
    check_symmetry
        a randomized symmetry test (2 products, in the first pass).
    failure_probability
        each group runs until, with at least 1 − failure_probability /
        (number of groups) over its random start, no eigenvalue of its block lies beyond
        the reported ones by more than the error bounds; all bounds of all groups then
        hold together with probability at least ``1 − result.failure_probability``
        (default 1e-4).
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s; True: at once;
        False: none. It counts products (every group's column of a pass).

    Notes
    -----
    Cost: each pass is ONE ``matmat`` holding one Lanczos column per still-running group
    (column l is zero outside group l, and the group-l rows of its product are H_ll v_l),
    the trace probes (one per group and pass while Lanczos runs, then 16 per group),
    and, in the last Lanczos-free pass, the k Ritz vectors of every group for their
    residuals. Data passes: about max_l(steps_l) + 1; products: Σ_l steps_l + Σ_l k_l +
    (number of groups)·num_probes (+ 2). The host keeps at most max(2k + 1, 20) + 2k + 2
    vectors of each group's length (the Krylov basis, the locked vectors and their
    residuals, two work vectors), i.e. that many times n numbers in all.
    """
    started = time.perf_counter()
    k = check_int("k", k)
    if num_products is None:
        num_products = 1000 + 100 * k
    num_products = check_int("num_products", num_products, minimum=k)
    num_probes = check_int("num_probes", num_probes, minimum=2)
    tol = check_float("tol", tol)
    failure_probability = check_float("failure_probability", failure_probability, below=1.0)
    counter = as_symmetric_operator(op, "layerwise", check_symmetry)
    n = counter.n
    names, parts, origin = _resolve_groups(op, groups, n)
    rng = seeded_rng(seed)
    # Separate streams: the eigenvalues do not depend on whether traces are estimated.
    lanczos_rng, probe_rng = rng.spawn(2)
    share = failure_probability / len(parts)
    states = _start_states(parts, k, tol, counter.eps, num_products, lanczos_rng, share)
    passes = _LockstepPasses(counter, parts, states, num_probes if trace else 0, probe_rng)
    planned = sum(
        min(num_products, _PLANNED_STEPS_PER_VALUE * k, int(part.size)) + min(k, int(part.size))
        for part in parts
    ) + (len(parts) * num_probes if trace else 0)
    with ProductProgress(counter, planned, "layerwise", progress) as bar:
        final, residual_norms = passes.run(bar)
    eigenvalues, error_bounds, converged = _group_pairs(counter, states, final)
    unresolved = unresolved_zero(counter)
    if unresolved is not None:  # float32 zeros: the zero operator, or flushed products
        error_bounds = [np.full_like(bounds, np.inf) for bounds in error_bounds]
        converged = [np.zeros_like(flags) for flags in converged]
    traces = trace_stderr = None
    if trace:
        traces, trace_stderr = _block_traces(counter, passes.samples)
    probability = sum(segment.probability for state in states for segment in state.segments)
    return LayerwiseResult(
        groups=names,
        group_sizes=[int(part.size) for part in parts],
        eigenvalues=eigenvalues,
        residual_norms=[norms * counter.scale for norms in residual_norms],
        error_bounds=error_bounds,
        converged=converged,
        num_steps=[state.spent for state in states],
        traces=traces,
        trace_stderr=trace_stderr,
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            "k": k,
            "trace": bool(trace),
            "tol": tol,
            "num_products": num_products,
            "num_probes": num_probes if trace else 0,
            "groups": origin,
            "seed": seed_setting(seed),
            "check_symmetry": bool(check_symmetry),
            "dimension": n,
            "failure_probability": failure_probability,
            **({"not_converged_reason": unresolved} if unresolved is not None else {}),
        },
        failure_probability=min(1.0, probability),
    )


def _start_states(
    parts: list[np.ndarray],
    k: int,
    tol: float,
    eps: float,
    num_products: int,
    rng: np.random.Generator,
    share: float,
) -> list[KrylovSchur]:
    """One Krylov–Schur state per group, each from a Gaussian start of the group's size,
    wanting min(k, size) values, failing with probability at most ``share``."""
    states = []
    for part in parts:
        size = int(part.size)
        wanted = min(k, size)
        start = rng.standard_normal(size)
        states.append(
            KrylovSchur(
                size,
                wanted,
                "largest",
                tol,
                eps,
                num_products,
                start,
                False,
                rng,
                min(size, max(2 * wanted + 1, _MIN_BASIS)),
                share,
            )
        )
    return states


class _LockstepPasses:
    """The data passes of :func:`layerwise`, each ONE ``matmat`` of the block

        [symmetry probes | a Lanczos vector per running group | trace probes | Ritz vectors]

    with every group's vectors embedded on its own entries (:func:`_embed`) and its
    rows of the product read back (:func:`_restrict`). The symmetry probes ride in the
    first pass, the trace probes one per group and pass while Lanczos runs (then
    ``_TRACE_BLOCK``), and the Ritz vectors once every group has stopped, for their
    residuals.
    """

    def __init__(
        self,
        counter: Any,
        parts: list[np.ndarray],
        states: list[KrylovSchur],
        num_probes: int,
        probe_rng: np.random.Generator,
    ):
        self.counter = counter
        self.parts = parts
        self.states = states
        self.probe_rng = probe_rng
        self.probes_left = num_probes
        self.samples: list[list[float]] = [[] for _ in parts]  # z_lᵀ H_ll z_l per group
        self.final: list[Pairs] | None = None
        self.residual_norms: list[np.ndarray] = []
        n = counter.n
        self.symmetry_probes = np.zeros((n, 0))
        if counter.symmetry_pending:
            # The counter tests symmetry on the first two vectors it multiplies: two random
            # unit vectors over all parameters, in the first pass.
            self.symmetry_probes = np.random.default_rng(SYMMETRY_SEED).standard_normal((n, 2))
            self.symmetry_probes /= np.linalg.norm(self.symmetry_probes, axis=0)

    def run(self, bar: Any = None) -> tuple[list[Pairs], list[np.ndarray]]:
        """All passes: each group's final pairs and their residual norms (scaled units);
        ``bar`` (a ``ProductProgress``) is updated after each pass."""
        with one_blas_thread():
            while self._next_pass():
                if bar is not None:
                    bar.update()
            self.counter.finish()
        assert self.final is not None
        return self.final, self.residual_norms

    def _next_pass(self) -> bool:
        """One pass; False once all groups stopped, residuals are checked, probes done."""
        running = [not state.finished for state in self.states]
        if not any(running) and self.final is None:
            self.final = [state.result() for state in self.states]
        final = self.final if not self.residual_norms else None  # pairs to check now
        check_residuals = final is not None
        width = min(self.probes_left, 1 if any(running) else _TRACE_BLOCK)
        if not (any(running) or check_residuals or width):
            return False
        lanczos = [
            state.next_vector()[:, None] if active else np.zeros((state.n, 0))
            for state, active in zip(self.states, running)
        ]
        probes = [rademacher_vectors(self.probe_rng, (part.size, width)) for part in self.parts]
        if final is not None:
            ritz = [pairs.vectors for pairs in final]
        else:
            ritz = [np.zeros((part.size, 0)) for part in self.parts]
        own_lanczos, own_probes, own_ritz = self._multiply([lanczos, probes, ritz])
        for state, active, own in zip(self.states, running, own_lanczos):
            if active:
                state.absorb(own[:, 0])
        for samples, probe, own in zip(self.samples, probes, own_probes):
            samples.extend(np.einsum("ij,ij->j", probe, own).tolist())
        self.probes_left -= width
        if final is not None:
            for pairs, own in zip(final, own_ritz):
                self.residual_norms.append(
                    np.linalg.norm(own - pairs.vectors * pairs.values, axis=0)
                )
        return True

    def _multiply(self, sections: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        """H times the block of the symmetry probes and the embedded sections; each
        group's own rows of each section's columns."""
        n = self.counter.n
        block = np.concatenate(
            [self.symmetry_probes] + [_embed(n, self.parts, pieces) for pieces in sections],
            axis=1,
        )
        image = self.counter.matmat(block)
        own = _restrict(image[:, self.symmetry_probes.shape[1] :], self.parts, sections)
        self.symmetry_probes = np.zeros((n, 0))
        return own


def _group_pairs(
    counter: Any, states: list[KrylovSchur], final: list[Pairs]
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Each group's eigenvalues, error bounds (never below eps·‖H_ll‖, ‖H_ll‖ estimated by
    the largest |θ| and product norm seen) and convergence flags, in the operator's units:
    everything before is in those of the counter's scaled products (A / 2^e), exact to
    multiply back."""
    eigenvalues, error_bounds, converged = [], [], []
    for state, pairs in zip(states, final):
        scale = max(float(np.max(np.abs(pairs.values), initial=0.0)), state.anorm)
        bounds = np.maximum(pairs.bounds, counter.eps * scale)
        eigenvalues.append(
            counter.unscale(np.asarray(pairs.values, dtype=np.float64), "an eigenvalue")
        )
        error_bounds.append(bounds * counter.scale)
        converged.append(np.asarray(pairs.converged, dtype=bool) & np.isfinite(error_bounds[-1]))
    return eigenvalues, error_bounds, converged


def _block_traces(counter: Any, samples: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Hutchinson's estimate of each tr(H_ll), the mean of its samples, and its standard
    error std/sqrt(m), in the operator's units."""
    table = np.array(samples)
    traces = counter.unscale(table.mean(axis=1), "a block trace")
    trace_stderr = counter.unscale(
        table.std(axis=1, ddof=1) / math.sqrt(table.shape[1]), "a block trace's stderr"
    )
    return traces, trace_stderr


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
