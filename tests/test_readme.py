"""Every code block of the README runs or is checked, and the quickstart's numbers are right.

The Python block (the quickstart) runs as written; what it prints is the output pasted
below it, to the digits printed; and its numbers match truths computed without spectra
and without TensorFlow (tests/_relu_mlp.py): exact float64 Hessian-vector products of the
digits MLP by a hand-written R-operator, with scipy's ``eigsh`` for the top eigenvalues,
and the exact trace in closed form (for a ReLU MLP the Hessian's diagonal equals the
Gauss-Newton diagonal). The shell blocks are checked without running them (each would
take minutes): the ``spectra`` command lines are parsed by the CLI's own parser, with their
files present; the ``make`` targets exist in the Makefile; the ``pip install`` lines name
this distribution and its extras.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse.linalg as spla
from _relu_mlp import ReluMLP

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"[-+]?\d+(?:\.(\d+))?(?:e([-+]?\d+))?")


def _blocks(language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(README.read_text()) if lang == language]


def _commands(block: str) -> list[list[str]]:
    """The command lines of a shell block: continuation lines joined, comments dropped."""
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]


def _numbers(text: str) -> list[tuple[float, float]]:
    """Each number printed in ``text`` with the size of one unit in its last digit."""
    found = []
    for match in NUMBER.finditer(text):
        decimals, exponent = match.group(1), match.group(2)
        unit = 10.0 ** (-len(decimals or "") + int(exponent or 0))
        found.append((float(match.group(0)), unit))
    return found


def test_the_readme_has_one_python_block_and_its_output_and_stays_a_front_page():
    text = README.read_text()
    assert len(_blocks("python")) == 1 and len(_blocks("text")) == 1
    assert len(text.splitlines()) <= 150
    # The two commands, in these words (the project's hooks look for them).
    assert "make run" in text and "make test" in text
    assert "`spectra-hessian`" in text and "import spectra" in text
    # It is installed from a clone: no install line names a package on the index.
    assert "pip install spectra" not in text.replace("Do not `pip install spectra`", "")


def test_the_readme_shell_blocks_name_real_commands_targets_and_extras():
    from spectra.cli import build_parser

    makefile = (ROOT / "Makefile").read_text()
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert f"**`{setup['metadata']['name']}`**" in README.read_text()
    extras = set(setup["options.extras_require"])
    parser = build_parser()
    seen = set()
    outputs: set[Path] = set()
    for block in _blocks("bash"):
        for words in _commands(block):
            if not words:
                continue
            seen.add(words[0])
            if words[0] == "make":
                assert re.search(rf"^{words[1]}\b[^:\n]*:", makefile, re.M), words
            elif words[0] == "pip":
                assert words[1] == "install", words
                # The checkout itself (this distribution), with extras it declares.
                match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[-1])
                assert match, words
                assert set(filter(None, (match.group(1) or "").split(","))) <= extras
            elif words[0] == "spectra":
                if words[1:] == ["--help"]:
                    continue
                args = parser.parse_args(words[1:])
                if args.command == "plot":
                    # It redraws the results of a command above it in the README.
                    assert Path(args.results).parent in outputs, words
                    continue
                outputs.add(Path(args.out))
                model = getattr(args, "model", None) or getattr(args, "checkpoints", None)
                for path in (model, args.data):
                    assert path is None or (ROOT / path).exists(), (words, path)
            else:
                raise AssertionError(f"a README command this test does not check: {words}")
    assert {"make", "pip", "spectra"} <= seen


# eigsh's tolerance for the reference: its eigenvalues are within EIGSH_TOL·|λ| (ARPACK's
# residual criterion), far below spectra's float32 bounds (10·eps₃₂·λ₁ ≈ 1.2e-6·λ₁).
EIGSH_TOL = 1e-10


@pytest.mark.slow
def test_quickstart_runs_and_its_numbers_match_independent_truths(monkeypatch, capsys):
    (code,) = _blocks("python")
    (pasted,) = _blocks("text")
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(code, "README.md quickstart", "exec"), namespace)
    top, tr, density = namespace["top"], namespace["tr"], namespace["density"]
    # What it prints is what the README shows, to one unit in the last digit printed
    # (float32 products may round differently on another CPU).
    printed = capsys.readouterr().out
    assert printed.count("\n") == pasted.count("\n"), (printed, pasted)
    shown, got = _numbers(pasted), _numbers(printed)
    assert len(shown) == len(got), (printed, pasted)
    for (value, unit), (actual, _) in zip(shown, got, strict=True):
        assert abs(actual - value) <= unit * (1 + 1e-9), (printed, pasted)
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

    # Spectral density: its first moment estimates tr(H)/n, a mean of 5 probes (Student t
    # with 4 degrees of freedom: P(|t| > 8) ≈ 1.3e-3 over seeds; the seed here is fixed: 0).
    moments = density.moments(max_order=1)
    assert moments.estimate[0] == pytest.approx(1.0)
    assert abs(moments.estimate[1] - exact_trace / truth.n) <= 8 * moments.stderr[1] + 1e-5 * abs(
        exact_trace / truth.n
    )
