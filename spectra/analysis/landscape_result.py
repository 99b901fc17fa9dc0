"""The result of :func:`spectra.analysis.landscape.loss_landscape`, without TensorFlow.

Kept apart from :mod:`spectra.analysis.landscape` (which builds perturbed models with
TensorFlow) so that :func:`spectra.load` of a ``LandscapeResult`` or of ``spectra
landscape``'s ``landscape.json``, and ``spectra plot`` of it, import no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spectra.estimators.results import Result

__all__ = ["LandscapeResult"]


@dataclass
class LandscapeResult(Result):
    """Losses along directions from the parameters θ.

    1-D (``betas`` is None): ``losses[label][i] = L(θ + alphas[i]·d_label)``, one curve per
    direction. 2-D: ``losses_2d[i, j] = L(θ + alphas[i]·d₁ + betas[j]·d₂)`` for the two
    directions in ``labels`` order, and ``losses`` is empty. ``base_loss`` is L(θ);
    ``direction_norms`` the Euclidean norms of the directions (1 for eigenvectors), which
    give the units of α and β (see the module docstring). ``num_evaluations`` counts loss
    evaluations at a point, each a pass over the data.
    """

    alphas: np.ndarray
    betas: np.ndarray | None
    labels: list[str]
    losses: dict[str, np.ndarray]
    losses_2d: np.ndarray | None
    base_loss: float
    direction_norms: dict[str, float]
    num_examples: int
    num_evaluations: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)
