"""What every command report shares: the report base class, the settings of a run's inputs
(data, loss, model), the errors those inputs can have, and the level at which an eigenvalue
bound counts as proven.

Nothing here imports TensorFlow: the functions that touch a Keras model import what they
need when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from spectra.analysis.trajectory import SharpnessSettings
from spectra.estimators.results import Result
from spectra.operators.registry import CURVATURES, DEFAULT_CURVATURE

__all__ = [
    "DEFAULT_FAILURE_PROBABILITY",
    "SEED_STATE_STRIDE",
    "UNNAMED_OUTPUT",
    "CommandReport",
    "EigensolverSettings",
    "EstimateSettings",
    "InputError",
    "InputSettings",
    "SettingConflict",
    "bound_holds",
    "compile_with_loss_weights",
    "input_problems",
    "output_names",
    "seed_generator_states",
]


class InputError(ValueError):
    """A problem with what a run was given (an option, the data, a checkpoint), said in one
    line naming the option; the command line prints it as its error (exit status 2)."""


class SettingConflict(InputError):
    """A setting that does not fit the model or the run's checkpoints (found once they are
    read): every checkpoint's problem, never one to record as a failed checkpoint."""


@contextlib.contextmanager
def input_problems(context: str | None = None) -> Iterator[None]:
    """Turn the errors that checking and loading inputs raise (``OSError``, ``ValueError``,
    ``ImportError``) into an :class:`InputError` prefixed with ``context`` (an option, a
    file), the original error as its cause; an :class:`InputError` passes unchanged."""
    try:
        yield
    except InputError:
        raise
    except (OSError, ValueError, ImportError) as err:
        text = str(err) or type(err).__name__
        raise InputError(f"{context}: {text}" if context else text) from err


@dataclass
class CommandReport(Result):
    """What every command records: how it was called, with which versions, on what data."""

    command: str
    versions: dict[str, str]
    settings: dict[str, Any]
    data: dict[str, Any]


# --------------------------------------------------------------------------- settings

_Settings = TypeVar("_Settings", bound="InputSettings")
# What a recorded value must be for a field's annotation (its first word), so that a
# record of an earlier version, or an edited one, gives a field its default instead.
_RECORDED_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "dict": (dict,),
    "list": (list,),
}


def _fits(annotation: str, value: Any) -> bool:
    """Whether ``value`` (read from JSON) is what a field annotated ``annotation`` holds."""
    kinds = [part.split("[")[0].strip() for part in annotation.split(" | ")]
    if "Any" in kinds:
        return True
    if value is None:
        return "None" in kinds
    if isinstance(value, bool) and "bool" not in kinds:
        return False
    return any(isinstance(value, _RECORDED_KINDS.get(kind, ())) for kind in kinds)


@dataclass(frozen=True, kw_only=True)
class InputSettings:
    """What a run's matrix is built from, as the command line's options of the same names.

    ``loss``: a Keras loss name, a dict of them by output name (None for an output left
    out of the loss), or None for the loss the model was compiled with; ``loss_weights``:
    the weight of each output's loss by name (None: the compiled or equal weights);
    ``max_examples``: a random subset of that many examples, drawn with ``seed`` (None: all);
    ``batch_size``: examples per batch (None: one batch); ``float64``: computed on a float64
    copy of the model; ``training``: layers in training mode; ``seed``: the data subset,
    the random probes and, in training mode, the Dropout masks; ``builder``: the
    ``"module:function"`` that builds the model of a weights file.
    """

    loss: Any = None
    loss_weights: dict[str, float] | None = None
    max_examples: int | None = None
    batch_size: int | None = None
    float64: bool = False
    training: bool = False
    seed: int = 0
    builder: str | None = None

    @property
    def matrix(self) -> str:
        """How figures, captions and records name the matrix measured (the Hessian here)."""
        return CURVATURES[DEFAULT_CURVATURE].title

    @property
    def operator_loss(self) -> Any:
        """The ``loss`` the operators and the landscape get: ``loss``, or None (the model's
        compiled loss, which :func:`compile_with_loss_weights` makes the weighted one) with
        ``loss_weights``."""
        return None if self.loss_weights is not None else self.loss

    @classmethod
    def from_record(cls: type[_Settings], record: Mapping[str, Any], **values: Any) -> _Settings:
        """The settings a report recorded (its ``settings``), as far as it records them: a
        field the record lacks, or holds as another type (a record of an earlier version,
        or an edited one), keeps its default; ``values`` set fields outright."""
        found = {}
        for spec in dataclasses.fields(cls):
            if spec.name in values or spec.name not in record:
                continue
            annotation = spec.type if isinstance(spec.type, str) else str(spec.type)
            if _fits(annotation, record[spec.name]):
                found[spec.name] = record[spec.name]
        return cls(**found, **values)


@dataclass(frozen=True, kw_only=True)
class EigensolverSettings(InputSettings):
    """The eigensolver's settings, as the options ``--method`` and ``--tol`` (defaults as
    there): eigenvalues by ``method`` to relative tolerance ``tol``. The inputs are
    :class:`InputSettings`'."""

    method: str = "lanczos"
    tol: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class EstimateSettings(EigensolverSettings):
    """The estimates a command measures the matrix by, as the options of the same names:
    the ``top_k`` eigenvalues (each command has its own default; 1 here) by ``method`` to
    relative tolerance ``tol``; with ``trace`` a ``trace_method`` estimate from
    ``trace_products`` products. The inputs are :class:`InputSettings`'."""

    top_k: int = 1
    trace: bool = False
    trace_method: str = "hutchinson"
    trace_products: int = 100

    def measurement(self) -> SharpnessSettings:
        """The eigenvalue and trace settings, with ``seed``, checked (``ValueError`` naming
        the setting)."""
        return SharpnessSettings(
            top_k=self.top_k,
            method=self.method,
            tol=self.tol,
            trace=bool(self.trace),
            trace_method=self.trace_method,
            trace_products=self.trace_products,
            seed=self.seed,
        )

    def estimate_record(self) -> dict[str, Any]:
        """The inputs and the :meth:`measurement`'s numbers as a report records them, in
        its order, with the ``matrix`` measured: every such setting that decides the
        numbers."""
        return {
            "loss": self.loss,
            "loss_weights": self.loss_weights,
            "max_examples": self.max_examples,
            **self.measurement().numbers(),
            "batch_size": self.batch_size,
            "float64": self.float64,
            "training": self.training,
            "builder": self.builder,
            "matrix": self.matrix,
        }


# --------------------------------------------------------------------------- bounds

# The failure probability spectra.eigenvalues certifies by default: a bound at this level
# (or below) is printed as it is; any other level, or none, is printed beside it.
DEFAULT_FAILURE_PROBABILITY = 1e-4


def bound_holds(converged: bool, failure_probability: float | None) -> bool:
    """Whether an eigenvalue's error bound is proven at the default level: it converged
    and its failure probability is known and at most :data:`DEFAULT_FAILURE_PROBABILITY`."""
    return (
        bool(converged)
        and failure_probability is not None
        and failure_probability <= DEFAULT_FAILURE_PROBABILITY
    )


# --------------------------------------------------------------------------- models

# What spectra calls the one output of a model whose outputs have no names (a Sequential
# model), as :func:`spectra.operators.losses.output_entries` does.
UNNAMED_OUTPUT = "output"


def output_names(model: Any) -> list[str]:
    """The names of the model's outputs in Keras' order (``model.output_names``), or
    ``["output"]`` for a model without them (a Sequential model has one output)."""
    names = [str(name) for name in (getattr(model, "output_names", None) or [])]
    return names or [UNNAMED_OUTPUT]


def compile_with_loss_weights(
    model: Any, loss: Any, loss_weights: Mapping[str, float] | None, like: Any = None
) -> None:
    """With ``loss_weights``: compile ``model`` with ``loss`` (else the compiled loss of
    ``like``, default ``model`` itself) and those weights (1 for outputs not named),
    keeping its optimizer, so that the operators' compiled loss (``loss=None``, as in the
    Python API) is Σ_o w_o L_o. Nothing without ``loss_weights``; a loss Keras refuses is
    an :class:`InputError` naming ``--loss-weight``."""
    if loss_weights is None:
        return
    source = model if like is None else like
    loss = loss if loss is not None else getattr(source, "loss", None)
    per_output: Any = {name: float(loss_weights.get(name, 1.0)) for name in output_names(model)}
    if not getattr(model, "output_names", None):
        # Keras knows no name for the one output of a Sequential model: lists of one.
        per_output = list(per_output.values())
        if isinstance(loss, dict):
            loss = [loss.get(UNNAMED_OUTPUT)]
    optimizer = getattr(model, "optimizer", None)
    keywords = {} if optimizer is None else {"optimizer": optimizer}
    with input_problems("--loss-weight"):
        model.compile(loss=loss, loss_weights=per_output, **keywords)


# The second entries of the Keras seed states are 2²⁰ apart, as the operators space them
# (spectra.operators.base): each generator's counter may advance 2²⁰ draws before it would
# reach the next one's stream.
SEED_STATE_STRIDE = 2**20


def seed_generator_states(model: Any, seed: int) -> None:
    """Set the state of the j-th Keras ``SeedGenerator`` of ``model`` (in the order of
    ``model.variables``) to ``[seed, 2²⁰·j]``, the base the operators use with ``seed``.

    Keras draws these states at random when a model is loaded, so in training mode
    whatever evaluates the model itself (the loss landscape) would draw other Dropout
    masks in every process; the operators are given ``seed`` and do not read them.
    """
    from spectra import _keras_compat

    states = _keras_compat.seed_state_variables(model)
    ordered = [v for v in model.variables if any(v is s for s in states)]
    ordered += [s for s in states if all(s is not v for v in ordered)]
    for j, state in enumerate(ordered):
        state.assign(np.array([seed, j * SEED_STATE_STRIDE], dtype=state.dtype))
