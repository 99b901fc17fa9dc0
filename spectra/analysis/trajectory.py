"""Sharpness along a training run: one measurement per point, and resumable runs over checkpoints.

Two layers, shared by ``spectra sharpness`` and :class:`spectra.SharpnessCallback`:

* :func:`measure_sharpness`: at one point of training (an operator at the current weights),
  the loss, the top-k Hessian eigenvalues with their error bounds (:func:`spectra.eigenvalues`)
  and optionally the trace (:func:`spectra.trace`). It starts the eigensolver from the previous
  point's eigenvectors when given (``v0``): along a run the top eigenvectors turn slowly, so a
  warm start needs fewer products than a random one, for the same tolerance.
* :class:`SharpnessRun`: the bookkeeping of a measurement over the checkpoints of a run,
  written to an output directory as ``sharpness.json`` (the record) and ``sharpness.csv``
  (derived from it), so that an interrupted run resumes where it stopped and never mixes
  results:

  - each entry is keyed by the checkpoint's file, step and content hash (SHA-256);
  - a resume whose checkpoint set, steps or number-deciding settings differ from the stored
    ones, or where a measured checkpoint's content changed, is refused with a message that
    names what changed (``restart=True`` discards the stored results); a checkpoint that
    failed or was not reached yet may have been replaced;
  - entries are never duplicated; a checkpoint that failed is recorded with its reason and
    retried by the next run;
  - one process at a time: an exclusive lock on the directory (:class:`spectra.io.files.
    DirectoryLock`), taken before anything is computed; the directory is created and proven
    writable first; temporary files of a killed run are removed;
  - one run per directory: the files are listed in ``.spectra-manifest.json`` before any is
    written; a directory holding another command's files, or files no manifest lists at the
    names written here, is refused, and a link where a file is written too
    (:func:`spectra.io.files.claim_outputs`); ``restart=True`` removes exactly the files the
    previous manifest lists;
  - a resumed run gives the numbers of an uninterrupted one, bit for bit: the eigenvectors of
    the last measurement, which the next checkpoint's eigensolve starts from and its overlap
    is measured against, are kept in ``warm_start.npz`` (with the key of the entry they
    belong to), written in the same step as the entry, and every checkpoint is measured
    with the same seed;
  - a write that fails (a full disk) keeps what fits: the JSON alone when the CSV or the
    warm start cannot be written, and the error (:class:`spectra.io.files.NotWritten`) names
    what was not written and why;
  - the JSON is strict (NaN and infinities as ``null`` with the reason); the CSV is derived
    from it and both are written in one step, the JSON last (see
    :func:`spectra.io.files.atomic_write_texts`), and the CSV is rebuilt from the JSON when a
    run opens the directory.

This module imports no TensorFlow; operators are used through their ``LinearOperator``
interface (and ``loss()``, ``num_data_passes`` when they have them).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra._validation import check_choice, check_float, check_int, check_seed
from spectra.analysis.subspaces import subspace_overlap
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.stochastic_trace import trace as estimate_trace
from spectra.io.files import (
    MANIFEST_NAME,
    DirectoryLock,
    NotWritten,
    OutputClaim,
    atomic_write_files,
    atomic_write_text,
    claim_outputs,
    prepare_directory,
    read_json,
    remove_temporaries,
    strict_json_text,
    strictly_jsonable,
    text_writer,
)

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

    from spectra.io.checkpoints import CheckpointRef

__all__ = [
    "CSV_NAME",
    "JSON_NAME",
    "WARM_START_NAME",
    "PlannedCheckpoint",
    "ResumeRefused",
    "SharpnessMeasurement",
    "SharpnessRun",
    "SharpnessSettings",
    "measure_sharpness",
    "plan_checkpoints",
    "sharpness_csv",
]

JSON_NAME = "sharpness.json"
CSV_NAME = "sharpness.csv"
WARM_START_NAME = "warm_start.npz"
_FORMAT = "spectra-sharpness/2"
_METHODS = ("lanczos", "power", "lobpcg")
_TRACE_METHODS = ("hutchinson", "hutch++", "xtrace")
_HINT = "rerun with --restart (restart=True) to discard them, or choose another output directory"
# Names listed in a refusal message before "and N more".
_LISTED = 5


# --------------------------------------------------------------------------- one measurement


@dataclass(frozen=True)
class SharpnessSettings:
    """How a sharpness measurement is computed.

    ``top_k`` largest eigenvalues by ``method`` to relative tolerance ``tol``
    (:func:`spectra.eigenvalues`); with ``trace``, a ``trace_method`` estimate with
    ``trace_products`` products (:func:`spectra.trace`); ``seed`` for the random start vectors
    and probes. ``warm_start`` starts the eigensolver from the previous point's eigenvectors;
    it changes the work, not the answer beyond the error bounds, so it is not one of the
    :meth:`numbers` settings. ``per_batch`` > 0 also measures λ₁ on that many mini-batches
    of ``per_batch_size`` examples at each point (:mod:`spectra.analysis.minibatch`; the
    same batches, drawn with ``seed``, at every point).
    """

    top_k: int = 1
    method: str = "lanczos"
    tol: float = 1e-8
    trace: bool = False
    trace_method: str = "hutchinson"
    trace_products: int = 100
    seed: int = 0
    warm_start: bool = True
    per_batch: int = 0
    per_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_int("top_k", self.top_k)
        check_int("per_batch", self.per_batch, minimum=0)
        check_int("per_batch_size", self.per_batch_size, allow_none=True)
        if self.per_batch and self.per_batch_size is None:
            raise ValueError(
                "per_batch_size is required with per_batch: the number of examples in each "
                "mini-batch (the batch size of training)."
            )
        check_int("trace_products", self.trace_products)
        check_seed("seed", self.seed, allow_none=False, allow_generator=False)
        check_float("tol", self.tol)
        check_choice("method", self.method, _METHODS)
        check_choice("trace_method", self.trace_method, _TRACE_METHODS)
        if self.trace:
            _check_trace_budget(self.trace_method, int(self.trace_products))

    def numbers(self) -> dict[str, Any]:
        """The settings that decide the numbers (a resumed run must match them)."""
        return {
            "top_k": int(self.top_k),
            "method": self.method,
            "tol": float(self.tol),
            "trace": bool(self.trace),
            "trace_method": self.trace_method if self.trace else None,
            "trace_products": int(self.trace_products) if self.trace else None,
            "seed": int(self.seed),
            # Only when asked for, so that runs recorded before these settings resume.
            **(
                {"per_batch": int(self.per_batch), "per_batch_size": int(self.per_batch_size)}
                if self.per_batch and self.per_batch_size is not None
                else {}
            ),
        }


def _check_trace_budget(method: str, num_products: int) -> None:
    """Let the trace estimator itself judge the budget, on a 4 × 4 matrix (microseconds).

    Each method has its own minimum (Hutch++ and XTrace need several products per sketch);
    asking the estimator keeps this check in step with it.
    """
    try:
        estimate_trace(
            np.eye(4),
            method=method,
            num_products=min(num_products, 64),
            progress=False,
            check_symmetry=False,
        )
    except ValueError as err:
        raise ValueError(
            f"trace_products {num_products} does not suit trace method {method!r}: {err}"
        ) from None


@dataclass
class SharpnessMeasurement:
    """The sharpness at one point of training.

    ``eigenvalues`` (largest first) with ``error_bounds``, ``residual_norms`` and
    ``converged`` flags as returned by :func:`spectra.eigenvalues`; ``trace`` and
    ``trace_stderr`` (None without a trace); ``loss`` the dataset loss (None for an operator
    without ``loss()``); the work as ``num_products`` (all products, the eigensolver's
    symmetry and residual checks and the trace included) and ``num_data_passes`` (None for an
    operator that does not count them); ``warm_start`` whether the eigensolver started from
    given vectors. ``eigenvectors`` (n × k) are kept for the next warm start, not recorded.

    ``eigenvector_overlap`` is how far the top eigenspace turned since the previous point:
    the mean over the k new unit eigenvectors v_i of their fraction ‖Qᵀv_i‖² in the span Q of
    the previous point's k eigenvectors, i.e. ⟨v_t, v_{t−1}⟩² for k = 1 (1: unchanged, 0:
    orthogonal; None without a previous point of the same size). ``gradient_overlap`` is
    the fraction ‖Vᵀg‖²/‖g‖² of the gradient g in the span of the new eigenvectors
    (Gur-Ari, Roberts & Dyer 2018; None unless asked for, or for a zero gradient). Both are
    in the operator's coordinates (for a preconditioned operator, u = P^{1/2}θ, where its
    gradient is P^{-1/2}∇L) and cost no product. ``failure_probability`` is the
    eigensolver's (:class:`spectra.EigenResult`): the bounds hold with probability at
    least 1 − failure_probability, None where the method makes no such statement.
    ``minibatch`` is :meth:`spectra.analysis.minibatch.MinibatchSharpness.to_dict` of the
    mini-batch λ₁ at this point, when measured (None otherwise).
    """

    loss: float | None
    eigenvalues: list[float]
    error_bounds: list[float]
    residual_norms: list[float]
    converged: list[bool]
    trace: float | None
    trace_stderr: float | None
    num_parameters: int
    num_products: int
    num_data_passes: int | None
    wall_time: float
    seed: int
    warm_start: bool
    eigenvector_overlap: float | None = None
    gradient_overlap: float | None = None
    failure_probability: float | None = None
    minibatch: dict[str, Any] | None = None
    eigenvectors: np.ndarray | None = field(default=None, repr=False)

    def record(self) -> dict[str, Any]:
        """The JSON-ready fields (everything but the eigenvectors)."""
        fields = asdict(self)
        del fields["eigenvectors"]
        return fields


def measure_sharpness(
    operator: LinearOperator,
    settings: SharpnessSettings,
    *,
    seed: int | None = None,
    v0: np.ndarray | None = None,
    previous: np.ndarray | None = None,
    gradient_overlap: bool = False,
    progress: bool | None = None,
) -> SharpnessMeasurement:
    """Measure the loss, top eigenvalues (and trace) of ``operator`` with ``settings``.

    ``seed`` overrides ``settings.seed`` (the callback uses ``seed + i`` for its i-th
    measurement). ``v0`` (n × j), typically the previous point's ``eigenvectors``, is the
    eigensolver's start when ``settings.warm_start`` and it has the operator's length (a
    checkpoint of another architecture starts cold). ``previous`` (n × k), the previous
    point's eigenvectors, gives the ``eigenvector_overlap``; ``gradient_overlap=True``
    records the gradient's overlap with the top-k eigenspace (``operator.gradient()``).

    Cost: one data pass for the loss (the first pass, which fills the operator's cache), the
    eigensolver's products (fewer from a good ``v0``), ``trace_products`` for the trace; the
    overlaps need no product.

    Parameters
    ----------
    progress : None, True or False
        the estimators' bars: None (default): a bar on a terminal for runs longer than ~2 s
        (none when stderr is not a terminal); True: a bar at once; False: no bar.

    Raises
    ------
    ValueError
        ``top_k`` larger than the number of parameters, or a loss or eigenvalue
        that is not finite (NaN weights, a diverged run).
    """
    started = time.perf_counter()
    seed = int(settings.seed if seed is None else seed)
    size = int(operator.shape[0])
    if settings.top_k > size:
        raise ValueError(
            f"top_k = {settings.top_k} is more than the {size} parameters of the model."
        )
    passes_before = _data_passes(operator)
    loss = _finite_loss(operator)
    start = _warm_start(v0, size) if settings.warm_start else None
    eig = eigenvalues(
        operator,
        k=settings.top_k,
        method=settings.method,
        tol=settings.tol,
        seed=seed,
        progress=progress,
        return_eigenvectors=True,
        v0=start,
    )
    vectors = eig.eigenvectors
    assert vectors is not None  # return_eigenvectors=True
    if not np.all(np.isfinite(eig.eigenvalues)):
        raise ValueError(
            f"the eigenvalues are not finite ({eig.eigenvalues.tolist()}): the Hessian "
            "products overflowed or the weights hold NaN."
        )
    products = int(eig.num_products)
    trace_result = None
    if settings.trace:
        trace_result = estimate_trace(
            operator,
            method=settings.trace_method,
            num_products=settings.trace_products,
            seed=seed,
            progress=progress,
        )
        products += int(trace_result.num_products)
    passes = None
    passes_after = _data_passes(operator)
    if passes_before is not None and passes_after is not None:
        passes = passes_after - passes_before
    gradient_fraction = None
    if gradient_overlap:
        gradient_fraction = _gradient_overlap(operator, vectors)
    return SharpnessMeasurement(
        loss=loss,
        eigenvalues=[float(v) for v in eig.eigenvalues],
        error_bounds=[float(v) for v in eig.error_bounds],
        residual_norms=[float(v) for v in eig.residual_norms],
        converged=[bool(c) for c in eig.converged],
        trace=None if trace_result is None else float(trace_result.estimate),
        trace_stderr=None if trace_result is None else float(trace_result.stderr),
        num_parameters=size,
        num_products=products,
        num_data_passes=passes,
        wall_time=time.perf_counter() - started,
        seed=seed,
        warm_start=start is not None,
        eigenvector_overlap=_eigenspace_overlap(previous, vectors),
        gradient_overlap=gradient_fraction,
        failure_probability=(
            None if eig.failure_probability is None else float(eig.failure_probability)
        ),
        eigenvectors=vectors,
    )


def _finite_loss(operator: LinearOperator) -> float | None:
    """The operator's loss (None for an operator without ``loss()``); a loss that is not
    finite is refused, since there is then no Hessian to measure."""
    if not callable(getattr(operator, "loss", None)):
        return None
    loss = float(operator.loss())
    if not math.isfinite(loss):
        raise ValueError(
            f"the loss is {loss} at these weights (a diverged run, or NaN weights): there "
            "is no Hessian to measure."
        )
    return loss


def _warm_start(v0: np.ndarray | None, size: int) -> np.ndarray | None:
    """``v0`` as n × j start columns for the eigensolver, or None (a cold start) when there
    is none, it has another length (another architecture) or it is not finite."""
    if v0 is None:
        return None
    start = np.asarray(v0, dtype=np.float64)
    if start.ndim == 1:
        start = start[:, None]
    if start.shape[0] != size or not np.all(np.isfinite(start)):
        return None
    return start


def _data_passes(operator: LinearOperator) -> int | None:
    """The operator's data-pass counter, or that of the operator it wraps (a preconditioned
    Hessian), or None."""
    for candidate in (operator, getattr(operator, "base", None)):
        passes = getattr(candidate, "num_data_passes", None)
        if passes is not None:
            return int(passes)
    return None


def _eigenspace_overlap(previous: np.ndarray | None, vectors: np.ndarray) -> float | None:
    """Mean fraction of the new unit eigenvectors in the span of the previous ones."""
    if previous is None:
        return None
    previous = np.asarray(previous, dtype=np.float64)
    if previous.ndim == 1:
        previous = previous[:, None]
    if previous.shape[0] != vectors.shape[0] or not np.all(np.isfinite(previous)):
        return None
    return float(np.mean(subspace_overlap(vectors, previous)))


def _gradient_overlap(operator: LinearOperator, vectors: np.ndarray) -> float | None:
    """‖Vᵀg‖²/‖g‖² for the operator's gradient g (None for a zero gradient)."""
    method = getattr(operator, "gradient", None)
    if not callable(method):
        raise ValueError(
            f"gradient_overlap needs the operator's gradient, and {type(operator).__name__} "
            "has no gradient()."
        )
    gradient = np.asarray(method(), dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(gradient)):
        raise ValueError("the gradient is not finite: there is no overlap to measure.")
    if not np.any(gradient):
        return None
    return float(subspace_overlap(gradient, vectors))


def explain_null(path: str, value: float) -> str | None:
    """Why a recorded value is not finite, for the ``null_values`` of strict JSON."""
    name = path.rsplit(".", 1)[-1].split("[", 1)[0]
    if "stderr" in name:
        return "a standard error needs at least two probes (or two samples)"
    return None


# --------------------------------------------------------------------------- runs over checkpoints


@dataclass(frozen=True)
class PlannedCheckpoint:
    """A checkpoint of a run: its ``file`` (relative to the common directory), training
    ``step``, content ``sha256`` and ``path``."""

    file: str
    step: int
    sha256: str
    path: Path

    def key(self) -> dict[str, Any]:
        return {"file": self.file, "step": self.step, "sha256": self.sha256}


def plan_checkpoints(refs: Sequence[CheckpointRef]) -> list[PlannedCheckpoint]:
    """Hash the checkpoints (``CheckpointRef``\\ s, in step order) of a run.

    Files are named relative to their common directory: the bare name when they share one.
    Cost: reading every checkpoint file once.
    """
    from spectra.io.checkpoints import checkpoint_sha256

    paths = [Path(ref.path) for ref in refs]
    if not paths:
        return []
    common = Path(os.path.commonpath([str(p.absolute().parent) for p in paths]))
    return [
        PlannedCheckpoint(
            file=os.path.relpath(path.absolute(), common),
            step=int(ref.step),
            sha256=checkpoint_sha256(path),
            path=path,
        )
        for ref, path in zip(refs, paths)
    ]


class ResumeRefused(ValueError):
    """The output directory holds results that do not belong to this run."""


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown} and {len(names) - _LISTED} more"


def _plan_changes(
    stored: Sequence[Mapping[str, Any]], plan: Sequence[PlannedCheckpoint], measured: set[str]
) -> list[str]:
    """What differs between a stored checkpoint set and this one, in words.

    A new content is a change only for a checkpoint with a result (``measured``): one that
    failed or was not reached yet holds nothing that could be mixed up.
    """
    old = {item["file"]: item for item in stored}
    new = {item.file: item for item in plan}
    changes = []
    added = [name for name in new if name not in old]
    missing = [name for name in old if name not in new]
    if added:
        changes.append(f"checkpoints not in the stored run: {_listed(added)}")
    if missing:
        changes.append(f"stored checkpoints no longer given: {_listed(missing)}")
    content = [
        f"{name} (sha256 {old[name]['sha256'][:12]}… -> {new[name].sha256[:12]}…)"
        for name in new
        if name in old and name in measured and old[name]["sha256"] != new[name].sha256
    ]
    if content:
        changes.append(f"checkpoint contents changed: {_listed(content)}")
    steps = [
        f"{name} {old[name]['step']} -> {new[name].step}"
        for name in new
        if name in old and old[name]["step"] != new[name].step
    ]
    if steps:
        changes.append(f"steps changed: {_listed(steps)}")
    return changes


def _setting_changes(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    wanted = json.loads(strict_json_text(dict(wanted)))
    return [
        f"{name}: {stored.get(name)!r} -> {value!r}"
        for name, value in wanted.items()
        if name != "null_values" and stored.get(name) != value
    ]


_CSV_VALUES = ("eigenvalues", "error_bounds", "residual_norms")
_CSV_TAIL = [
    "trace",
    "trace_stderr",
    "num_products",
    "num_data_passes",
    "wall_time",
    "warm_start",
    "eigenvector_overlap",
    "sha256",
    "error",
]
# The columns of a mini-batch distribution (``minibatch_lambda_1_<name>``), when measured.
_CSV_MINIBATCH = ("mean", "std", "q05", "q25", "q50", "q75", "q95")
_CSV_PREFIX = {
    "eigenvalues": "eigenvalue",
    "error_bounds": "error_bound",
    "residual_norms": "residual_norm",
}


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def sharpness_csv(entries: Sequence[Mapping[str, Any]], top_k: int) -> str:
    """The CSV table of sharpness entries (one row per checkpoint, missing values empty)."""
    columns = ["step", "file", "status", "loss"]
    for name in _CSV_VALUES:
        columns += [f"{_CSV_PREFIX[name]}_{i}" for i in range(1, top_k + 1)]
    columns += _CSV_TAIL
    minibatch = any(entry.get("minibatch") for entry in entries)
    if minibatch:
        columns += [f"minibatch_lambda_1_{name}" for name in _CSV_MINIBATCH]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(columns)
    for entry in entries:
        row = [entry["step"], entry["file"], entry["status"], _csv_value(entry.get("loss"))]
        for name in _CSV_VALUES:
            values = list(entry.get(name) or [])
            row += [_csv_value(v) for v in values] + [""] * (top_k - len(values))
        row += [_csv_value(entry.get(name)) for name in _CSV_TAIL]
        if minibatch:
            summary = (entry.get("minibatch") or {}).get("summary") or {}
            row += [_csv_value(summary.get(name)) for name in _CSV_MINIBATCH]
        writer.writerow(row)
    return text.getvalue()


@dataclass
class ResumeState:
    """What :meth:`SharpnessRun.start` found: entries kept, failed entries to retry,
    temporary files removed."""

    done: int
    failed: int
    removed_temporaries: int


class SharpnessRun:
    """The output directory of a sharpness measurement over checkpoints (see the module
    docstring for the rules it keeps).

    Use::

        with SharpnessRun(out) as run:                  # created, writable, locked
            state = run.start(plan, settings, header)    # resume checks, first commit
            for planned in run.pending():
                ...measure...
                run.record(planned, measurement=m)       # or error="why it failed"
            run.finish()

    ``settings`` are the values that decide the numbers (a resume must match them);
    ``header`` everything else to record (command, versions, data description, …), replaced
    by each run. Each :meth:`record` writes ``sharpness.csv`` and ``sharpness.json``.
    """

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = prepare_directory(out)
        self.json_path = self.out / JSON_NAME
        self.csv_path = self.out / CSV_NAME
        self.warm_start_path = self.out / WARM_START_NAME
        #: Why a warm start file was not used (None when it was, or there was none).
        self.warm_start_problem: str | None = None
        self._claim: OutputClaim | None = None
        self._removed: list[Path] = []
        self._lock = DirectoryLock(self.out)
        self._plan: list[PlannedCheckpoint] = []
        self._entries: dict[str, dict[str, Any]] = {}
        self._settings: dict[str, Any] = {}
        self._header: dict[str, Any] = {}
        self._top_k = 1
        self._started = False

    # -- lock -----------------------------------------------------------------------------
    def __enter__(self) -> SharpnessRun:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    # -- resume ---------------------------------------------------------------------------
    def start(
        self,
        plan: Sequence[PlannedCheckpoint],
        settings: Mapping[str, Any],
        header: Mapping[str, Any] | None = None,
        *,
        restart: bool = False,
        extra_outputs: Iterable[str] = (),
    ) -> ResumeState:
        """Check the stored results against this run and write the first version.

        ``extra_outputs`` names further files of the run (figures): they are claimed with the
        record (:func:`spectra.io.files.claim_outputs`), and the temporary files a killed run
        left of them are removed.

        Raises
        ------
        ResumeRefused
            stored results of another run or other settings (unless
            ``restart``), or a file that is not a sharpness record of this format.
        OutputInUse
            the directory holds another command's files, or files no manifest
            lists at the names written here.
        UnsafeOutput
            a name written here is a symbolic link or not a regular file.
        """
        header = dict(header or {})
        if self._claim is None:
            self.claim(
                restart=restart, extra_outputs=extra_outputs, command_line=header.get("command")
            )
        removed = self._removed
        self._plan = list(plan)
        self._settings = dict(settings)
        self._header = header
        self._top_k = int(self._settings.get("top_k", 1))
        entries: list[dict[str, Any]] = []
        if not restart and self.json_path.exists():
            entries, stored = self._stored_entries()
            # What only a measurement learns (the model's description) stays until replaced.
            for name in ("model",):
                if name in stored and name not in self._header:
                    self._header[name] = stored[name]
        self._entries = {entry["file"]: entry for entry in entries}
        self._started = True
        self._commit()
        failed = sum(entry["status"] == "failed" for entry in self._entries.values())
        return ResumeState(len(self._entries) - failed, failed, len(removed))

    def claim(
        self,
        *,
        restart: bool = False,
        extra_outputs: Iterable[str] = (),
        command_line: str | None = None,
    ) -> None:
        """Claim the (locked) directory for this run before anything is computed, as
        :meth:`start` does when it was not called first: the files are checked (no links),
        a directory holding another command's files is refused and ``restart`` removes the
        files the previous manifest lists (:func:`spectra.io.files.claim_outputs`); temporary
        files of a killed run are removed.

        Raises
        ------
        OutputInUse, UnsafeOutput
            see :meth:`start`.
        """
        names = list(dict.fromkeys([JSON_NAME, CSV_NAME, WARM_START_NAME, *extra_outputs]))
        self._removed = remove_temporaries(self.out, [*names, MANIFEST_NAME])
        self._claim, _ = claim_outputs(
            self.out,
            "sharpness",
            names,
            restart=restart,
            command_line=command_line,
            resumes=lambda manifest: manifest.get("command") == "sharpness",
            adopt=names if self._older_record() else (),
        )

    def _older_record(self) -> bool:
        """Whether the directory holds a ``sharpness.json`` but no manifest (a record written
        by a spectra that wrote none): the resume checks judge it, as before manifests, and
        the files of the run are this run's to resume or, with ``restart``, to replace."""
        return os.path.lexists(self.json_path) and not os.path.lexists(self.out / MANIFEST_NAME)

    def warm_start(self, planned: PlannedCheckpoint) -> np.ndarray | None:
        """The eigenvectors to start ``planned`` from, as an uninterrupted run would: those of
        the checkpoint just before it in the plan, kept in ``warm_start.npz`` when that
        checkpoint was measured. None when there are none (the first checkpoint, one that
        failed, a file of another entry); an unreadable file is None with the reason in
        :attr:`warm_start_problem`."""
        self.warm_start_problem = None
        files = [item.file for item in self._plan]
        index = files.index(planned.file) if planned.file in files else 0
        if index == 0 or not self.warm_start_path.is_file():
            return None
        before = self._plan[index - 1]
        entry = self._entries.get(before.file)
        if entry is None or entry.get("status") != "done":
            return None
        try:
            with np.load(self.warm_start_path, allow_pickle=False) as stored:
                key = json.loads(str(stored["key"]))
                vectors = np.array(stored["vectors"], dtype=np.float64)
        except (OSError, ValueError, KeyError) as err:
            self.warm_start_problem = (
                f"'{self.warm_start_path}' cannot be read ({err}): {planned.file} starts cold"
            )
            return None
        if key != json.loads(json.dumps(before.key())) or vectors.ndim != 2:
            return None
        return vectors

    def _stored_entries(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The stored entries that belong to this run, and the stored record."""
        try:
            # read_json: not UTF-8, truncated or absurdly nested files are ValueErrors.
            stored = read_json(self.json_path)
            form = stored["format"]
            stored_settings = stored["settings"]
            stored_plan = stored["plan"]
            entries = list(stored["checkpoints"])
        except ValueError as err:  # read_json's one line, which starts with the path
            reason = str(err).removeprefix(f"{self.json_path}: ")
            raise ResumeRefused(
                f"'{self.json_path}' exists but is not a sharpness record of spectra "
                f"({reason}); {_HINT}."
            ) from err
        except (OSError, KeyError, TypeError) as err:
            raise ResumeRefused(
                f"'{self.json_path}' exists but is not a sharpness record of spectra "
                f"({type(err).__name__}: {err}); {_HINT}."
            ) from err
        if form != _FORMAT:
            raise ResumeRefused(
                f"'{self.json_path}' was written in the format {form!r}, not {_FORMAT!r}; {_HINT}."
            )
        changes = _setting_changes(stored_settings, self._settings)
        if changes:
            raise ResumeRefused(
                f"'{self.json_path}' holds results computed with other settings "
                f"({'; '.join(changes)}); {_HINT}."
            )
        measured = {entry.get("file") for entry in entries if entry.get("status") == "done"}
        changes = _plan_changes(stored_plan, self._plan, measured)
        if changes:
            raise ResumeRefused(
                f"'{self.json_path}' holds results of another checkpoint set "
                f"({'; '.join(changes)}); {_HINT}."
            )
        keys = {item.file: item.key() for item in self._plan}
        kept: dict[str, dict[str, Any]] = {}
        for entry in entries:
            key = keys.get(entry.get("file"))
            matches = key is not None and all(entry.get(k) == v for k, v in key.items())
            if entry.get("status") == "failed" and key is not None and not matches:
                continue  # a failed checkpoint that was replaced: measure it again
            if not matches:
                raise ResumeRefused(
                    f"'{self.json_path}' holds an entry for {entry.get('file')!r} (step "
                    f"{entry.get('step')}) that is not in its own checkpoint set; {_HINT}."
                )
            kept[entry["file"]] = entry
        return list(kept.values()), stored

    # -- progress -------------------------------------------------------------------------
    def pending(self) -> list[PlannedCheckpoint]:
        """The checkpoints still to measure, in step order (failed ones are tried again)."""
        return [
            item for item in self._plan if self._entries.get(item.file, {}).get("status") != "done"
        ]

    @property
    def entries(self) -> list[dict[str, Any]]:
        """The recorded entries in step order."""
        return sorted(self._entries.values(), key=lambda entry: entry["step"])

    def update_header(self, **values: Any) -> None:
        """Add or replace header fields (written with the next record)."""
        self._header.update(values)

    def record(
        self,
        planned: PlannedCheckpoint,
        measurement: SharpnessMeasurement | None = None,
        *,
        error: str | None = None,
    ) -> dict[str, Any]:
        """Record a measurement, or the ``error`` that stopped one, and write both files."""
        if (measurement is None) == (error is None):
            raise ValueError("give either a measurement or an error")
        entry: dict[str, Any] = {**planned.key(), "path": str(planned.path)}
        if measurement is not None:
            entry.update(status="done", error=None, **measurement.record())
        else:
            # The same fields as a measurement, empty: one schema for every entry.
            names = [f.name for f in fields(SharpnessMeasurement) if f.name != "eigenvectors"]
            empty = dict.fromkeys(names)
            entry.update(status="failed", error=" ".join(str(error).split()), **empty)
        self._entries[planned.file] = entry
        vectors = None if measurement is None else measurement.eigenvectors
        warm = None if vectors is None else (planned.key(), np.asarray(vectors, np.float64))
        self._commit(warm, lost=f"the result of {planned.file}")
        return entry

    def finish(self) -> None:
        """Write the files once more (a run with nothing left to do still records itself),
        and mark the manifest ``"complete"`` (every checkpoint done) or ``"resumable"``; it
        keeps listing every file of the run (figures are written after this)."""
        self._commit()
        status = "complete" if not self.pending() else "resumable"
        assert self._claim is not None  # set by start(), which _commit() checked
        self._claim.write_manifest(status, files=self._claim.planned)

    def report(self) -> dict[str, Any]:
        """The record as written to ``sharpness.json``."""
        entries = self.entries
        done = sum(entry["status"] == "done" for entry in entries)
        failed = sum(entry["status"] == "failed" for entry in entries)
        return {
            "type": "SharpnessReport",
            "format": _FORMAT,
            **self._header,
            "settings": self._settings,
            "plan": [item.key() for item in self._plan],
            "summary": {
                "checkpoints": len(self._plan),
                "done": done,
                "failed": failed,
                "pending": len(self._plan) - done - failed,
            },
            "checkpoints": entries,
        }

    def _commit(
        self, warm: tuple[dict[str, Any], np.ndarray] | None = None, lost: str | None = None
    ) -> None:
        """Write the warm start (``(entry key, eigenvectors)``, when given), the CSV and the
        JSON in one step, the JSON last. When that fails, the JSON alone is tried: the
        results are kept if it fits.

        Raises
        ------
        NotWritten
            naming the files not written and the cause, and what is kept.
        """
        if not self._started:
            raise RuntimeError("call start() first")
        report = self.report()
        text = strict_json_text(report, explain_null)
        table = sharpness_csv(strictly_jsonable(report["checkpoints"])[0], self._top_k)
        files: list[tuple[Path, Any]] = []
        if warm is not None:
            files.append((self.warm_start_path, _warm_start_writer(*warm)))
        files += [(self.csv_path, text_writer(table)), (self.json_path, text_writer(text))]
        try:
            atomic_write_files(files)
        except OSError as err:
            reason = os.strerror(err.errno) if err.errno else str(err)
            try:
                atomic_write_text(self.json_path, text)
            except OSError:
                what = f"{lost} is lost; the file keeps the results before it" if lost else ""
                raise NotWritten(
                    f"'{self.json_path}' not written ({reason}): {what or 'nothing recorded'}; "
                    "free space and rerun to resume."
                ) from err
            others = " and ".join(str(path.name) for path, _ in files[:-1])
            raise NotWritten(
                f"{others} not written in '{self.out}' ({reason}); '{self.json_path}' holds "
                f"all {len(report['checkpoints'])} results (the CSV is rebuilt from it when "
                "the run is resumed)."
            ) from err


def _warm_start_writer(key: dict[str, Any], vectors: np.ndarray) -> Any:
    """Writes ``warm_start.npz``: the eigenvectors and the JSON key of their entry."""

    def write(temp_name: str) -> None:
        with open(temp_name, "wb") as stream:
            np.savez(stream, vectors=vectors, key=np.array(json.dumps(key)))

    return write
