"""The curvature matrices ``spectra analyze --curvature`` can measure: one line each.

A :class:`CurvatureChoice` names the operator class (an attribute of the ``spectra``
package, looked up when a command runs, so that the parser imports nothing heavy and a
build without that class gives a one-line error), the extra keywords of its
``from_keras`` and how figures and reports name the matrix. To add a matrix, add one
line to :data:`CURVATURES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["CURVATURES", "DEFAULT_CURVATURE", "CurvatureChoice", "curvature_choice"]


@dataclass(frozen=True)
class CurvatureChoice:
    """One ``--curvature`` value.

    ``name`` is the option's value, ``class_name`` the operator class in ``spectra``
    (built with ``from_keras(model, loss, data, **the common keywords, **options)``),
    ``title`` how figures name the matrix ("Hessian") and ``symbol`` its letter in
    formulas ("H"). ``seeded`` operators draw random numbers (sampled labels) from the
    command's ``--seed`` in any mode; every operator gets the seed, so that in training
    mode its Dropout masks come from ``--seed`` (not from the model's seed generator
    states, which Keras draws anew in each process).
    """

    name: str
    class_name: str
    title: str
    symbol: str
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    seeded: bool = False

    def operator_class(self) -> Any:
        """The operator class, or ValueError when this build of spectra has none."""
        import spectra

        found = getattr(spectra, self.class_name, None)
        if found is None or not callable(getattr(found, "from_keras", None)):
            raise ValueError(
                f"--curvature {self.name} needs spectra.{self.class_name}, which this build "
                f"of spectra (version {spectra.__version__}) does not have; choose one of "
                f"the others or update spectra."
            )
        return found

    def from_keras(self, model: Any, loss: Any, data: Any, seed: int, **keywords: Any) -> Any:
        """The operator of this matrix for ``model`` (see :meth:`operator_class`), with
        ``seed`` passed on, as ``from_keras(..., seed=seed)`` in the Python API: the same
        command and seed give the same matrix in every process, training mode included."""
        return self.operator_class().from_keras(
            model, loss, data, **keywords, **self.options, seed=seed
        )


CURVATURES: Mapping[str, CurvatureChoice] = MappingProxyType(
    {
        choice.name: choice
        for choice in (
            CurvatureChoice("hessian", "HessianOperator", "Hessian", "H"),
            CurvatureChoice("ggn", "GGNOperator", "generalized Gauss-Newton matrix", "G"),
            CurvatureChoice(
                "fisher-mc",
                "FisherOperator",
                "Monte Carlo Fisher",
                "F",
                MappingProxyType({"kind": "mc"}),
                seeded=True,
            ),
            CurvatureChoice(
                "fisher-empirical",
                "FisherOperator",
                "empirical Fisher",
                "F̃",
                MappingProxyType({"kind": "empirical"}),
            ),
        )
    }
)
DEFAULT_CURVATURE = "hessian"


def curvature_choice(name: str | None) -> CurvatureChoice:
    """The registered choice ``name`` (the default, the Hessian, for None)."""
    return CURVATURES[name or DEFAULT_CURVATURE]
