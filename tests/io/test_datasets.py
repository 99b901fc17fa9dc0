"""load_data for .npz files and the built-in sets."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from spectra.io.datasets import BUILTIN_DATASETS, Data, load_data

DATA = Path(__file__).resolve().parents[2] / "data"


# --------------------------------------------------------------------------- npz files


def test_npz_without_weights(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6)
    np.savez(tmp_path / "toy.npz", x=x, y=y)
    data = load_data(tmp_path / "toy.npz")
    assert isinstance(data, Data)
    np.testing.assert_array_equal(data.x, x)
    np.testing.assert_array_equal(data.y, y)
    assert data.sample_weight is None
    assert data.name == "toy" and data.num_examples == 6
    assert "toy.npz" in data.description
    assert len(data.as_tuple()) == 2


def test_npz_with_weights(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"x": rng.random((5, 3)), "y": rng.random((5, 1)), "sample_weight": rng.random(5)}
    np.savez(tmp_path / "weighted.npz", **arrays)
    data = load_data(str(tmp_path / "weighted.npz"))
    x, y, weight = data.as_tuple()
    np.testing.assert_array_equal(x, arrays["x"])
    np.testing.assert_array_equal(y, arrays["y"])
    np.testing.assert_array_equal(weight, arrays["sample_weight"])


def test_npz_missing_arrays(tmp_path):
    np.savez(tmp_path / "bad.npz", inputs=np.zeros(3), y=np.zeros(3))
    with pytest.raises(ValueError, match=r"arrays named 'x' and 'y'.*\['inputs', 'y'\]"):
        load_data(tmp_path / "bad.npz")


def test_npz_length_mismatch(tmp_path):
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 2)), y=np.zeros(4), sample_weight=np.ones(3))
    with pytest.raises(ValueError, match=r"different numbers of examples.*'sample_weight': 3"):
        load_data(tmp_path / "bad.npz")


def test_npz_unreadable(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"Could not read .* as a \.npz file"):
        load_data(tmp_path / "bad.npz")


def test_unknown_spec():
    with pytest.raises(FileNotFoundError, match=r"no built-in data set.*'digits'"):
        load_data("no_such_data.npz")


# --------------------------------------------------------------------------- built-in sets


def _assert_standardized(x):
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=0), 1.0, atol=1e-4)


def test_digits():
    from sklearn.datasets import load_digits

    data = load_data("digits")
    assert data.x.shape == (1797, 64) and data.x.dtype == np.float32
    assert data.y.shape == (1797,) and data.y.dtype == np.int64
    assert data.x.min() == 0.0 and data.x.max() == 1.0
    np.testing.assert_array_equal(data.x, (load_digits().data / 16).astype(np.float32))
    assert set(np.unique(data.y)) == set(range(10))


def test_breast_cancer():
    data = load_data("breast_cancer")
    assert data.x.shape == (569, 30) and data.x.dtype == np.float32
    assert data.y.shape == (569, 1) and data.y.dtype == np.float32
    assert set(np.unique(data.y)) == {0.0, 1.0}
    _assert_standardized(data.x)


def test_diabetes():
    data = load_data("diabetes")
    assert data.x.shape == (442, 10) and data.x.dtype == np.float32
    assert data.y.shape == (442, 1) and data.y.dtype == np.float32
    _assert_standardized(data.x)
    _assert_standardized(data.y)


@pytest.mark.parametrize(("name", "shape"), [("iris", (150, 4)), ("wine", (178, 13))])
def test_small_classification_sets(name, shape):
    data = load_data(name)
    assert data.x.shape == shape and data.x.dtype == np.float32
    assert data.y.shape == (shape[0],) and data.y.dtype == np.int64
    assert set(np.unique(data.y)) == {0, 1, 2}
    _assert_standardized(data.x)


def test_every_builtin_has_a_description():
    for name in BUILTIN_DATASETS:
        data = load_data(name)
        assert data.name == name and data.num_examples == len(data.x) == len(data.y)
        assert "scikit-learn" in data.description


def test_missing_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(
        ImportError, match=r"pip install scikit-learn .*pip install '\.\[datasets\]'"
    ):
        load_data("digits")


def test_committed_digits_npz_matches_builtin():
    committed = load_data(DATA / "digits.npz")
    builtin = load_data("digits")
    np.testing.assert_array_equal(committed.x, builtin.x)
    np.testing.assert_array_equal(committed.y, builtin.y)
    assert committed.x.dtype == np.float32 and committed.y.dtype == np.int64


# --------------------------------------------------------------------------- subsets


def test_max_examples_is_reproducible():
    full = load_data("iris")
    first = load_data("iris", max_examples=40, seed=3)
    again = load_data("iris", max_examples=40, seed=3)
    other = load_data("iris", max_examples=40, seed=4)
    assert first.num_examples == 40 and len(first.y) == 40
    np.testing.assert_array_equal(first.x, again.x)
    assert not np.array_equal(first.x, other.x)
    rows = [int(np.flatnonzero((full.x == row).all(axis=1))[0]) for row in first.x]
    assert rows == sorted(rows)
    np.testing.assert_array_equal(full.y[rows], first.y)
    assert "random subset of 40 of 150 examples" in first.description
    assert "default_rng(3)" in first.description


def test_max_examples_subsets_sample_weight(tmp_path):
    np.savez(
        tmp_path / "w.npz",
        x=np.arange(10.0)[:, None],
        y=np.arange(10.0),
        sample_weight=np.arange(10.0) * 2,
    )
    data = load_data(tmp_path / "w.npz", max_examples=4, seed=0)
    np.testing.assert_array_equal(data.sample_weight, data.x[:, 0] * 2)
    np.testing.assert_array_equal(data.y, data.x[:, 0])


def test_max_examples_not_smaller_than_data():
    data = load_data("iris", max_examples=1000)
    assert data.num_examples == 150 and "subset" not in data.description


def test_max_examples_and_seed_are_checked():
    with pytest.raises(ValueError, match=r"^max_examples must be an integer >= 1, got 0$"):
        load_data("iris", max_examples=0)
    with pytest.raises(TypeError, match=r"^max_examples must be an integer or None, got 2.5"):
        load_data("iris", max_examples=2.5)
    with pytest.raises(ValueError, match=r"^seed must be a non-negative integer, got -1$"):
        load_data("iris", max_examples=10, seed=-1)
    with pytest.raises(TypeError, match=r"^seed must be a non-negative integer, got None"):
        load_data("iris", max_examples=10, seed=None)


# --------------------------------------------------------------------------- several outputs


def _two_outputs(tmp_path, **labels):
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    np.savez(tmp_path / "two.npz", x=x, **labels)
    return tmp_path / "two.npz"


def test_npz_labels_by_output_name(tmp_path):
    cls, reg = np.arange(5) % 3, np.linspace(0, 1, 5).reshape(5, 1)
    data = load_data(_two_outputs(tmp_path, y_cls=cls, y_reg=reg))
    assert sorted(data.y) == ["cls", "reg"]
    np.testing.assert_array_equal(data.y["cls"], cls)
    np.testing.assert_array_equal(data.y["reg"], reg)
    assert sorted(data.label_arrays()) == ["y_cls", "y_reg"]


def test_npz_labels_in_output_order_and_subset(tmp_path):
    first, second = np.arange(5), np.arange(5) * 10
    data = load_data(_two_outputs(tmp_path, y1=second, y0=first), max_examples=3, seed=4)
    assert isinstance(data.y, list) and len(data.y) == 2
    # The same rows of every array are kept.
    rows = data.x[:, 0].astype(int) // 2
    np.testing.assert_array_equal(data.y[0], first[rows])
    np.testing.assert_array_equal(data.y[1], second[rows])


@pytest.mark.parametrize(
    "labels, message",
    [
        ({"y": np.zeros(5), "y_a": np.zeros(5)}, "holds both 'y' and per-output labels ['y_a']"),
        ({"y_a": np.zeros(5), "y1": np.zeros(5)}, "mixes labels by output name ['y_a']"),
        ({"y0": np.zeros(5), "y2": np.zeros(5)}, "give 'y0' .. 'y1'"),
        ({"y_a": np.zeros(5), "y_b": np.zeros(4)}, "'y_b': 4"),
    ],
)
def test_npz_bad_output_labels(tmp_path, labels, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_data(_two_outputs(tmp_path, **labels))
