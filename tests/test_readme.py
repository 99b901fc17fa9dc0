"""The README's quickstart runs as written and prints numbers that are right.

The truth is computed without spectra and without TensorFlow (tests/_relu_mlp.py): exact
float64 Hessian-vector products of the digits MLP by a hand-written R-operator, with
scipy's ``eigsh`` for the top eigenvalues, and the exact trace in closed form (for a ReLU
MLP the Hessian's diagonal equals the Gauss-Newton diagonal).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse.linalg as spla
from _relu_mlp import ReluMLP

ROOT = Path(__file__).resolve().parents[1]
# eigsh's tolerance for the reference: its eigenvalues are within EIGSH_TOL·|λ| (ARPACK's
# residual criterion), far below spectra's float32 bounds (10·eps₃₂·λ₁ ≈ 1.2e-6·λ₁).
EIGSH_TOL = 1e-10


@pytest.mark.slow
def test_quickstart_runs_and_its_numbers_match_independent_truths(monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(code, "README.md quickstart", "exec"), namespace)
    top, tr, density = namespace["top"], namespace["tr"], namespace["density"]
    assert "±" in capsys.readouterr().out
    assert os.path.exists(ROOT / "data" / "digits_mlp.keras")
    assert top.all_converged and len(top.eigenvalues) == 5

    data = namespace["data"]
    truth = ReluMLP.from_keras(namespace["model"], data["x"], data["y"])
    assert namespace["H"].shape == (truth.n, truth.n)
    start = np.random.default_rng(0).standard_normal(truth.n)
    reference = np.sort(
        spla.eigsh(
            truth.operator(),
            k=5,
            which="LA",
            tol=EIGSH_TOL,
            ncv=24,
            v0=start,
            return_eigenvectors=False,
        )
    )[::-1]
    # Each reported λ_i (float32 products) lies within its reported bound of the true
    # i-th eigenvalue (the bound is certified for some eigenvalue and, with the reported
    # failure probability ≤ 1e-4 per run at the fixed seed 0, for the i-th).
    errors = np.abs(top.eigenvalues - reference)
    assert np.all(errors <= top.error_bounds + EIGSH_TOL * np.abs(reference)), (
        top.eigenvalues,
        reference,
        top.error_bounds,
    )
    # A bound of 0 (or a wrong value) fails: the bounds are positive and the values agree
    # with the truth to about float32 precision.
    assert np.all(top.error_bounds > 0)
    assert np.all(errors <= 1e-4 * reference[0])

    # Trace: Hutch++ with 100 products; its standard error comes from about 33 Hutchinson
    # samples of the deflated remainder, so |error|/stderr is close to a Student t with
    # ~32 degrees of freedom: P(|t| > 5) ≈ 2e-5 over seeds (the seed here is fixed: 0).
    # The float32 products add rounding of about 1e-6 relative (allowed: 1e-5).
    exact_trace = truth.trace()
    assert abs(tr.estimate - exact_trace) <= 5 * tr.stderr + 1e-5 * abs(exact_trace), (
        tr.estimate,
        tr.stderr,
        exact_trace,
    )
    # Not vacuous: the standard error is small against the trace.
    assert 0 < tr.stderr <= 0.05 * exact_trace

    # Spectral density: its first moment estimates tr(H)/n, a mean of 10 probes (Student t
    # with 9 degrees of freedom: P(|t| > 8) ≈ 2e-5).
    moments = density.moments(max_order=1)
    assert moments.estimate[0] == pytest.approx(1.0)
    assert abs(moments.estimate[1] - exact_trace / truth.n) <= 8 * moments.stderr[1] + 1e-5 * abs(
        exact_trace / truth.n
    )
