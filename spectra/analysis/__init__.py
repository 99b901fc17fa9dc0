"""What composes operators and estimators into the quantities researchers ask for.

* :mod:`~spectra.analysis.per_layer` — spectra and traces of the diagonal blocks;
* :mod:`~spectra.analysis.preconditioning` — the Hessian an adaptive optimizer sees;
* :mod:`~spectra.analysis.stability` — stability thresholds of optimizers;
* :mod:`~spectra.analysis.subspaces` — overlaps with the top eigenspace;
* :mod:`~spectra.analysis.landscape` — loss landscapes along directions;
* :mod:`~spectra.analysis.trajectory` — sharpness over a run's checkpoints;
* :mod:`~spectra.analysis.minibatch` — the distribution of λ₁ over mini-batches.
"""
