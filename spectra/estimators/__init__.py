"""Estimators over any symmetric ``LinearOperator``: NumPy and SciPy only, no TensorFlow.

* :mod:`~spectra.estimators.krylov` — Lanczos with full reorthogonalization;
* :mod:`~spectra.estimators.tridiagonal` — eigenpairs and Gauss quadrature of its output;
* :mod:`~spectra.estimators.eigensolvers` — extreme eigenpairs with certified bounds
  (restarted Lanczos, power iteration, LOBPCG); the methods live in
  :mod:`~spectra.estimators.krylov_schur`, :mod:`~spectra.estimators.power_iteration` and
  :mod:`~spectra.estimators.block_eigensolver`, their bounds in
  :mod:`~spectra.estimators.eigenvalue_bounds`, what they share in
  :mod:`~spectra.estimators.eigenpairs`;
* :mod:`~spectra.estimators.stochastic_trace` — Hutchinson, Hutch++, XTrace, Frobenius norm;
* :mod:`~spectra.estimators.stochastic_diagonal` — the diagonal with per-entry errors;
* :mod:`~spectra.estimators.density` — stochastic Lanczos quadrature densities (of λ and of
  log λ);
* :mod:`~spectra.estimators.log_determinant` — log det(C + λI) by stochastic Lanczos
  quadrature;
* :mod:`~spectra.estimators.inverses` — damped inverse operators (C + λI)⁻¹ (CG, MINRES,
  LSMR, Neumann series);
* :mod:`~spectra.estimators.results` — the result dataclasses (``to_dict``, JSON).

The operator is seen through ``_products``: counted, scaled, checked for symmetry and
finite values.
"""
