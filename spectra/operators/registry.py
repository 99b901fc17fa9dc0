"""The curvature matrices spectra can build: one line each, read by the API and the CLI.

Each :class:`CurvatureEntry` names a matrix (the CLI's ``--curvature`` value), its operator
class (``"module:Class"``: the registry is data and imports nothing, so that reading it
imports no TensorFlow; :func:`spectra.operators.curvature_operator` gives the class on
Keras' backend and builds it), the curvature-specific keywords its ``from_keras`` gets,
and how figures and reports name it. :data:`CURVATURES` is what
``spectra analyze --curvature`` offers, and the operator classes it names are what
``spectra`` exports (:func:`operator_class_names`).

Adding a matrix is its module in :mod:`spectra.operators` (a
:class:`~spectra.operators.curvature.Curvature` and a
:class:`~spectra.operators.base.CurvatureOperator` subclass whose ``curvature_class`` is
it) plus one line in :data:`CURVATURES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CURVATURES",
    "DEFAULT_CURVATURE",
    "CurvatureEntry",
    "curvature_entry",
    "operator_class_names",
]


@dataclass(frozen=True)
class CurvatureEntry:
    """One curvature matrix.

    ``name`` is the CLI's ``--curvature`` value, ``operator`` the operator class as
    ``"module:Class"`` (built with ``from_keras(model, loss, data, **shared keywords,
    **options)``), ``title`` how figures and reports name the matrix ("Hessian") and
    ``symbol`` its letter in formulas ("H").
    """

    name: str
    operator: str
    title: str
    symbol: str
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def class_name(self) -> str:
        """The operator class's name (what ``spectra`` exports it as)."""
        return self.operator.rpartition(":")[2]


CURVATURES: Mapping[str, CurvatureEntry] = MappingProxyType(
    {
        entry.name: entry
        for entry in (
            CurvatureEntry("hessian", "spectra.operators.hessian:HessianOperator", "Hessian", "H"),
            CurvatureEntry(
                "ggn", "spectra.operators.ggn:GGNOperator", "generalized Gauss-Newton matrix", "G"
            ),
            CurvatureEntry(
                "fisher-mc",
                "spectra.operators.fisher:FisherOperator",
                "Monte Carlo Fisher",
                "F",
                MappingProxyType({"kind": "mc"}),
            ),
            CurvatureEntry(
                "fisher-empirical",
                "spectra.operators.fisher:FisherOperator",
                "empirical Fisher",
                "F̃",
                MappingProxyType({"kind": "empirical"}),
            ),
        )
    }
)
DEFAULT_CURVATURE = "hessian"


def curvature_entry(name: str | None) -> CurvatureEntry:
    """The registered matrix ``name`` (the Hessian for None); ``ValueError`` naming the
    registered ones for another name."""
    name = DEFAULT_CURVATURE if name is None else name
    entry = CURVATURES.get(name)
    if entry is None:
        raise ValueError(f"curvature must be one of {sorted(CURVATURES)}; got {name!r}.")
    return entry


def operator_class_names() -> list[str]:
    """The operator classes of the registered matrices, each once, in registry order."""
    return list(dict.fromkeys(entry.class_name for entry in CURVATURES.values()))
