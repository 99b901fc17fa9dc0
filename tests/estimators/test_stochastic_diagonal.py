import json

import numpy as np
import pytest
from _matrices import (
    BlockOperator,
    assert_symmetry_checked_unless_disabled,
    progress_lines,
    random_symmetric,
    single_blas_thread,
    timed_with_defaults,
    with_spectrum,
)

from spectra.estimators.stochastic_diagonal import diagonal


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


def test_stderr_covers_truth_and_error_shrinks():
    a = random_symmetric(300, seed=1) + np.diag(np.linspace(-1, 1, 300))
    truth = np.diag(a)
    result = diagonal(a, num_products=100, seed=2)
    # 300 entries, each covered with probability 0.952 (t with 99 degrees of freedom): the
    # coverage has a standard deviation of 1.2 points, so [0.90, 0.995] lies 4.2 and 3.5 of
    # them away (false alarm < 3e-4); a stderr twice too large covers 99.99% and fails.
    coverage = np.mean(np.abs(result.estimate - truth) <= 2 * result.stderr)
    assert 0.90 <= coverage <= 0.995
    # per entry: Var = sum_{j != i} a_ij^2 per probe; the median ratio over 300 entries
    # has a standard deviation below 1%, so ±10% cannot fail by chance.
    theory = np.sqrt((np.sum(a**2, axis=1) - truth**2) / 100)
    assert np.median(result.stderr / theory) == pytest.approx(1.0, abs=0.1)
    # RMS error ratio for 4x the probes: 2, with a standard deviation of about 0.12 (300
    # entries); [1.6, 2.5] is 3.5 of them away (false alarm < 5e-4).
    more = diagonal(a, num_products=400, seed=2)
    ratio = np.sqrt(np.mean((result.estimate - truth) ** 2) / np.mean((more.estimate - truth) ** 2))
    assert 1.6 < ratio < 2.5


def test_diagonal_matrix_is_exact():
    d = np.linspace(-2, 5, 40)
    result = diagonal(np.diag(d), num_products=8)
    np.testing.assert_allclose(result.estimate, d, atol=1e-14)
    np.testing.assert_allclose(result.stderr, 0.0, atol=1e-14)


def test_blocks_counts_and_reproducibility():
    a = with_spectrum(np.linspace(0, 1, 50), seed=3)
    operator = BlockOperator(a)
    result = diagonal(operator, num_products=40, block_size=16, seed=5)
    assert result.num_products == 40 and operator.columns == 40
    assert result.num_operator_calls == 3
    again = diagonal(a, num_products=40, block_size=16, seed=5)
    other = diagonal(a, num_products=40, block_size=16, seed=6)
    np.testing.assert_array_equal(result.estimate, again.estimate)
    assert not np.array_equal(result.estimate, other.estimate)
    json.dumps(result.to_dict())


def test_invalid_arguments():
    with pytest.raises(ValueError, match="num_products"):
        diagonal(np.eye(3), num_products=1)
    with pytest.raises(ValueError, match="block_size"):
        diagonal(np.eye(3), block_size=0)
    with pytest.raises(ValueError, match=r"square, got shape \(2, 3\)"):
        diagonal(np.ones((2, 3)))
    with pytest.raises(ValueError, match="operator is not symmetric"):
        diagonal(np.triu(np.ones((6, 6))))


# -- contracts that mutation testing (make mutate) found untested -------------------------
def test_defaults_settings_time_and_messages():
    a = random_symmetric(20, seed=13)
    result = timed_with_defaults(diagonal, a)
    assert result.num_products == 100  # the default budget
    assert result.settings == {
        "num_products": 100,
        "block_size": 16,
        "seed": 0,
        "check_symmetry": True,
    }
    smallest = diagonal(a, num_products=2)  # the smallest budget with a standard error
    assert smallest.num_products == 2 and np.all(np.isfinite(smallest.stderr))
    with pytest.raises(ValueError, match=r"^num_products must be an integer >= 2, got 1$"):
        diagonal(a, num_products=1)
    with pytest.raises(ValueError, match=r"^block_size must be an integer >= 1, got 0$"):
        diagonal(a, block_size=0)
    assert_symmetry_checked_unless_disabled(diagonal, num_products=4)


def test_progress_bar_names_the_estimator(capsys):
    diagonal(random_symmetric(20, seed=14), num_products=8, progress=True)
    first = progress_lines(capsys)[0]
    assert first.startswith("diagonal: ") and "0/8" in first
