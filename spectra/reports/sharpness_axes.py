"""Where a sharpness run's figure puts its checkpoints: the x axes they can be placed on
(training steps, epochs), found from ``--steps``, the optimizer's iteration counter saved in
each checkpoint or the numbers in the file names (:func:`x_axes`, recorded in
``sharpness.json``), and the positions on the axis a figure draws (:func:`x_positions`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spectra.reports.base import InputError

if TYPE_CHECKING:
    from spectra.analysis.trajectory import PlannedCheckpoint

__all__ = ["X_AXES", "x_axes", "x_positions"]

# The x axes a run can be drawn on (--x): where each source puts the checkpoints.
X_AXES = ("steps", "epochs")
# The axis label without --x: the file names' (or --steps') numbers and what they count.
_UNIT_LABELS = {
    ("step", "--steps"): "Training step (from --steps)",
    ("step", "file names"): "Training step (from the file names)",
    ("epoch", "file names"): "Epoch (from the file names)",
    ("checkpoint", "file names"): "Checkpoint number (from the file names)",
}
_STEP_SOURCE_LABELS = {
    "--steps": "from --steps",
    "optimizer iterations": "optimizer iterations",
    "file names": "from the file names",
}
# The training steps' source as the numerator of an epoch axis' label.
_STEPS_PER_EPOCH_LABELS = {
    "--steps": "--steps",
    "optimizer iterations": "optimizer iterations",
    "file names": "steps in the file names",
}


def x_axes(
    plan: Sequence[PlannedCheckpoint],
    *,
    x_axis: str | None = None,
    steps_per_epoch: int | None = None,
    steps: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Every x axis the checkpoints of ``plan`` (each a
    :class:`spectra.analysis.trajectory.PlannedCheckpoint`, its step from ``steps`` when
    given) can be placed on, as recorded in ``sharpness.json``'s ``x_axes`` (see
    :class:`spectra.reports.sharpness.SharpnessReport`), after checking that ``x_axis`` is
    among them (an :class:`InputError` naming what is missing and what to pass otherwise;
    nothing is loaded into TensorFlow).

    ``"steps"``: from ``steps``; else the optimizer's iteration counter saved in every
    checkpoint (:func:`spectra.io.checkpoints.stored_iterations`), when they all hold one
    and no two are equal; else the file names' numbers when they count steps.
    ``"epochs"``: the training steps / ``steps_per_epoch``; else the file names' numbers
    when they count epochs. Cost: reading each checkpoint's weights index once.
    """
    from spectra.io.checkpoints import step_from_name, step_unit, stored_iterations

    choice = x_axis
    per_epoch = steps_per_epoch
    if per_epoch is not None and choice is None:
        raise InputError(
            f"--steps-per-epoch {per_epoch} places the checkpoints at training step / "
            f"{per_epoch} on an epoch axis: add --x epochs (or leave it out)."
        )
    named = step_unit([item.path for item in plan])
    from_names = {item.file: step_from_name(item.path) for item in plan}
    axes: dict[str, Any] = {}
    missing = ""
    if steps:
        axes["steps"] = _axis("--steps", {item.file: item.step for item in plan})
    else:
        counters = {item.file: stored_iterations(item.path) for item in plan}
        without = [file for file, counter in counters.items() if counter is None]
        repeated = len(set(counters.values())) < len(counters)
        if not without and not repeated:
            axes["steps"] = _axis("optimizer iterations", counters)
        elif named == "step":
            axes["steps"] = _axis("file names", from_names)
        else:
            missing = _missing_steps(plan, named, without, counters)
    if per_epoch is not None and "steps" in axes:
        found = axes["steps"]
        epochs = {file: value / per_epoch for file, value in found["values"].items()}
        source = f"{found['source']} / {per_epoch}"
        label = f"Epoch ({_STEPS_PER_EPOCH_LABELS[found['source']]} / {per_epoch})"
        axes["epochs"] = {"source": source, "label": label, "values": epochs}
    elif named == "epoch" and per_epoch is None:
        axes["epochs"] = _axis("file names", from_names, unit="Epoch")
    if choice == "steps" and "steps" not in axes:
        raise InputError(f"--x steps: {missing}")
    if choice == "epochs" and "epochs" not in axes:
        if per_epoch is not None:
            reason = missing.removeprefix("the checkpoints' training steps are not known: ")
            raise InputError(
                f"--x epochs: --steps-per-epoch {per_epoch} divides the training steps, "
                f"which are not known: {reason}"
            )
        counted = "steps given by --steps" if steps else f"the file names count {named}s"
        raise InputError(
            f"--x epochs: the checkpoints' epochs are not known ({counted}, not epochs): "
            "pass --steps-per-epoch N (the optimizer steps in one epoch) to plot training "
            "step / N."
        )
    return axes


def _axis(source: str, values: dict[str, Any], unit: str = "Training step") -> dict[str, Any]:
    return {"source": source, "label": f"{unit} ({_STEP_SOURCE_LABELS[source]})", "values": values}


def _missing_steps(
    plan: Sequence[PlannedCheckpoint], named: str, without: list[str], counters: dict[str, Any]
) -> str:
    """Why the training steps of ``plan`` are not known, and what to pass."""
    names = f"the file names count {named}s, not steps ({plan[0].file}, …)"
    if len(without) == len(plan):
        counter = (
            "no checkpoint holds an optimizer iteration counter (a .keras or .weights.h5 "
            "saved from a compiled model after training does)"
        )
    elif without:
        counter = (
            f"{len(without)} of {len(plan)} checkpoints hold no optimizer iteration counter "
            f"(e.g. {without[0]})"
        )
    else:
        counter = (
            f"their optimizer iteration counters repeat ({sorted(counters.values())[:6]}: "
            "the optimizer was rebuilt between saves)"
        )
    return (
        f"the checkpoints' training steps are not known: {names} and {counter}; pass --steps "
        "STEP [STEP ...] (one per checkpoint file, in natural name order)."
    )


def x_positions(
    report: Mapping[str, Any],
    done: Sequence[Mapping[str, Any]],
    x_axis: str | None,
    unit: str,
    step_source: str,
) -> tuple[list[Any], str]:
    """The x positions of the ``done`` entries of a ``sharpness.json`` record ``report`` and
    the axis label: the file names' (or ``--steps``') numbers, counting ``unit`` from
    ``step_source``, without ``x_axis``, else those of the recorded axis it names (an
    :class:`InputError` when the run recorded no such axis)."""
    choice = x_axis
    if choice is None:
        return [entry["step"] for entry in done], _UNIT_LABELS.get(
            (unit, step_source), unit.capitalize()
        )
    axis = (report.get("x_axes") or {}).get(choice)
    if axis is None:
        known = ", ".join(sorted(report.get("x_axes") or {})) or "none"
        raise InputError(
            f"--x {choice}: the run records no {choice} for its checkpoints (axes recorded: "
            f"{known}); run spectra sharpness again with --x {choice} (it says what to pass)."
        )
    return [axis["values"][entry["file"]] for entry in done], str(axis["label"])
