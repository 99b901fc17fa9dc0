"""The stability threshold of a sharpness run, recovered from what its checkpoints record:
the optimizer a compiled ``.keras`` checkpoint stores, else a ``trajectory.json`` beside the
checkpoints, else gradient descent with a given learning rate (:func:`recover_threshold`);
and which optimizers have a preconditioner spectra reads (:func:`check_preconditionable`)."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra.analysis.stability import (
    StabilityThreshold,
    gradient_descent_threshold,
    stability_threshold_of,
    threshold_matrix,
)
from spectra.io.files import read_json
from spectra.reports.base import InputError, SettingConflict

if TYPE_CHECKING:
    from spectra.io.checkpoints import CheckpointRef

__all__ = [
    "PRECONDITIONED_OPTIMIZERS",
    "RecoveredThreshold",
    "check_preconditionable",
    "float32_decimal",
    "recorded_learning_rate",
    "recover_threshold",
]

# The optimizers whose state gives --preconditioned its P (spectra._keras_compat.OPTIMIZER_SLOTS,
# named here so that checking a recorded optimizer needs no TensorFlow).
PRECONDITIONED_OPTIMIZERS = ("Adam", "AdamW", "RMSprop", "Adagrad")

# --lr and a recorded learning rate are the same rate when they agree to 1e-6: a rate read
# back from a saved float32 optimizer variable carries a relative rounding of 2^-24 ≈ 6e-8.
_SAME_RATE_RTOL = 1e-6


def check_preconditionable(name: str, where: str) -> None:
    """Refuse ``--preconditioned`` for an optimizer ``name`` without a preconditioner
    spectra reads (SGD: P = I; Lion, Adafactor, ...: unsupported), as a
    :class:`SettingConflict` (every checkpoint's problem, said before any checkpoint's)."""
    if name.lower() in (known.lower() for known in PRECONDITIONED_OPTIMIZERS):
        return
    if name.lower() == "sgd":
        raise SettingConflict(
            f"the optimizer {where} is SGD, which has no preconditioner (P = I): measure "
            "λ_max(H) without --preconditioned."
        )
    raise SettingConflict(
        f"--preconditioned does not support the optimizer {where}, {name}: its "
        "preconditioner is not one spectra reads; supported: "
        f"{', '.join(PRECONDITIONED_OPTIMIZERS)}. Measure λ_max(H) without --preconditioned."
    )


@dataclass
class RecoveredThreshold:
    """The stability threshold of a run (None when unknown or dropped), its learning rate η
    and where they came from (``source``), the warnings to show (``notes``), and the
    threshold ``dropped`` because it bounds the other matrix (None when none was)."""

    threshold: StabilityThreshold | None
    learning_rate: float | None
    source: str | None
    notes: list[str] = field(default_factory=list)
    dropped: StabilityThreshold | None = None


def _trajectory_notes(refs: Sequence[Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The ``trajectory.json`` beside the checkpoints (when they share one directory), its
    learning rate checked; a file that cannot be used is an InputError advising ``--lr``."""
    parents = {Path(ref.path).parent for ref in refs}
    if len(parents) != 1:
        return None, None
    notes = parents.pop() / "trajectory.json"
    if not notes.is_file():
        return None, None
    try:
        content = read_json(notes)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read '{notes}' as JSON ({err}); give --lr.") from err
    if not isinstance(content, dict):
        return None, str(notes)
    rate = content.get("learning_rate")
    if rate is not None and not (
        isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)
    ):
        raise InputError(f"'{notes}' has learning_rate {rate!r}, not a positive number; give --lr.")
    return content, str(notes)


def recover_threshold(
    refs: Sequence[CheckpointRef], *, lr: float | None = None, preconditioned: bool = False
) -> RecoveredThreshold:
    """The stability threshold of the run whose checkpoints are ``refs``
    (:class:`spectra.io.checkpoints.CheckpointRef`), its η and where they came from,
    warnings, and the threshold dropped because it bounds the other matrix.

    The optimizer recorded in the first checkpoint (a compiled .keras file) decides the
    formula, else the optimizer named in a ``trajectory.json``, else gradient descent;
    ``lr`` overrides the recorded η (a mismatch is warned about). A threshold for another
    matrix than the one measured (λ_max(P⁻¹H) when ``preconditioned``, else λ_max(H)) is
    warned about and not returned: no line, ratio or count compares λ₁ with a threshold
    that does not bound it (the η stays recorded).

    Raises
    ------
    SettingConflict
        ``preconditioned`` on a run whose recorded optimizer has no preconditioner (said
        before anything is measured).
    InputError
        a ``trajectory.json`` that cannot be used, without ``lr``.
    """
    from spectra.io.checkpoints import recorded_optimizer

    threshold, rate, source, notes = _recorded_threshold(refs, lr)
    recorded = recorded_optimizer(refs[0].path)
    if preconditioned and recorded is None and threshold is not None and source != "--lr":
        # The optimizer named by a trajectory.json (SGD when it names none).
        name = threshold.optimizer
        if not threshold.preconditioned:
            raise SettingConflict(
                f"the optimizer recorded in {source} is {name}, which has no preconditioner "
                "(P = I): measure λ_max(H) without --preconditioned."
            )
    if preconditioned and recorded is not None:
        name = re.sub(r"_\d+$", "", str(recorded["class_name"]))
        with contextlib.suppress(ValueError):
            if threshold_matrix(name) == "hessian":
                raise SettingConflict(
                    f"the optimizer recorded in {Path(refs[0].path).name} is {name}, which has "
                    "no preconditioner (P = I): measure λ_max(H) without --preconditioned."
                )
        check_preconditionable(name, f"recorded in {Path(refs[0].path).name}")
    if threshold is not None and threshold.preconditioned and not preconditioned:
        notes.append(
            f"no threshold: {threshold.optimizer}'s threshold {threshold.formula} bounds the "
            "preconditioned sharpness λ_max(P⁻¹H), not the λ_max(H) this command measures "
            "(give --preconditioned to measure λ_max(P⁻¹H) against it)"
        )
        return RecoveredThreshold(None, rate, source, notes, threshold)
    if threshold is not None and not threshold.preconditioned and preconditioned:
        notes.append(
            f"no threshold: {threshold.optimizer}'s threshold {threshold.formula} bounds "
            "λ_max(H), not the preconditioned sharpness λ_max(P⁻¹H) that --preconditioned "
            "measures"
        )
        return RecoveredThreshold(None, rate, source, notes, threshold)
    return RecoveredThreshold(threshold, rate, source, notes, None)


def _recorded_threshold(
    refs: Sequence[CheckpointRef], lr: float | None
) -> tuple[StabilityThreshold | None, float | None, str | None, list[str]]:
    from spectra.io.checkpoints import recorded_optimizer

    notes: list[str] = []
    optimizer = recorded_optimizer(refs[0].path)
    source = f"optimizer recorded in {Path(refs[0].path).name}" if optimizer else None
    if optimizer is not None:
        config = dict(optimizer["config"])
        config["learning_rate"] = float32_decimal(config.get("learning_rate"))
        optimizer = {**optimizer, "config": config}
    if optimizer is None:
        try:
            content, where = _trajectory_notes(refs)
        except InputError as err:
            if lr is None:
                raise
            # The advice was followed: --lr makes the run independent of the file.
            notes.append(f"{str(err).removesuffix('; give --lr.')}: ignored, η from --lr")
            content = None
        if content is not None and content.get("learning_rate") is not None:
            rate = content["learning_rate"]
            name = str(content.get("optimizer") or "SGD")
            optimizer = {
                "class_name": name,
                "config": {
                    "learning_rate": float(rate),
                    "momentum": content.get("momentum") or 0.0,
                    "beta_1": content.get("beta_1", 0.9),
                    "nesterov": bool(content.get("nesterov", False)),
                },
            }
            source = where
    if optimizer is None:
        if lr is None:
            return None, None, None, notes
        return gradient_descent_threshold(lr), lr, "--lr", notes
    try:
        recorded = stability_threshold_of(optimizer)
    except ValueError as err:
        if lr is None:
            notes.append(f"no threshold line: {err}")
            return None, None, None, notes
        notes.append(f"{source}: {err}; the line is gradient descent's 2/η with --lr")
        return gradient_descent_threshold(lr), lr, "--lr", notes
    threshold = recorded
    same_rate = lr is None or math.isclose(lr, recorded.learning_rate, rel_tol=_SAME_RATE_RTOL)
    if not same_rate:
        notes.append(
            f"--lr {lr:g} differs from the learning rate {recorded.learning_rate:g} of the "
            f"{source}; the threshold uses --lr"
        )
        threshold = stability_threshold_of(optimizer, learning_rate=lr)
        source = f"{source}, η from --lr"
    return threshold, threshold.learning_rate, source, notes


def float32_decimal(value: Any) -> Any:
    """A float that holds a float32 exactly (a learning rate Keras saved from its float32
    variable: 0.009999999776482582) as the shortest decimal that rounds to the same float32
    (0.01), the rate the user gave; anything else (a schedule's dict, None, a float64
    value) unchanged."""
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    single = np.float32(value)
    if float(single) != value:
        return value
    return float(np.format_float_positional(single, unique=True, trim="-"))


def recorded_learning_rate(refs: Sequence[CheckpointRef]) -> float | None:
    """The learning rate as stored in the first checkpoint's optimizer (before
    :func:`float32_decimal`), or None when it records none or stores no float."""
    from spectra.io.checkpoints import recorded_optimizer

    optimizer = recorded_optimizer(refs[0].path)
    rate = None if optimizer is None else optimizer["config"].get("learning_rate")
    return rate if isinstance(rate, float) else None
