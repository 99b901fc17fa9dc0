"""Data for the command line and the notebooks: ``.npz`` files and small built-in data sets.

Built-in data sets (scikit-learn, ``pip install spectra-hessian[datasets]``), all with ``x`` as
float32 of shape ``(n, features)``:

==================  ======  ========  ==========================================================
name                n       features  preprocessing and labels
==================  ======  ========  ==========================================================
``digits``          1797    64        ``x = pixels / 16`` in [0, 1]; ``y`` int64 class 0-9
``breast_cancer``   569     30        standardized ``x``; ``y`` float32 of shape ``(n, 1)``, 0/1
                                      (1 = benign, scikit-learn's coding)
``diabetes``        442     10        standardized ``x``; ``y`` = standardized disease
                                      progression, float32 of shape ``(n, 1)``
``iris``            150     4         standardized ``x``; ``y`` int64 class 0-2
``wine``            178     13        standardized ``x``; ``y`` int64 class 0-2
==================  ======  ========  ==========================================================

"Standardized" means each column minus its mean, divided by its standard deviation (``ddof=0``),
both computed in float64 over the whole data set before any subset is taken, then cast to float32.
``data/digits.npz`` in the repository holds exactly ``load_data("digits")``.

Loss names that fit: ``sparse_categorical_crossentropy`` for ``digits``, ``iris`` and ``wine``
(softmax outputs); ``binary_crossentropy`` for ``breast_cancer`` (one sigmoid output);
``mean_squared_error`` for ``diabetes`` (one linear output).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spectra._validation import check_int, check_seed

BUILTIN_DATASETS = ("digits", "breast_cancer", "diabetes", "iris", "wine")


@dataclass
class Data:
    """Arrays for an analysis, with where they came from.

    ``num_examples`` is ``len(x)``; ``description`` says the source, the preprocessing and the
    subset taken, if any.
    """

    x: np.ndarray
    y: np.ndarray
    sample_weight: np.ndarray | None
    name: str
    num_examples: int
    description: str

    def as_tuple(self) -> tuple[np.ndarray, ...]:
        """``(x, y)``, or ``(x, y, sample_weight)`` when there are sample weights."""
        if self.sample_weight is None:
            return self.x, self.y
        return self.x, self.y, self.sample_weight


def load_data(spec: str | os.PathLike, max_examples: int | None = None, seed: int = 0) -> Data:
    """Load a ``.npz`` file (arrays ``x``, ``y``, optional ``sample_weight``) or a built-in set.

    Parameters
    ----------
    spec
        a path to a ``.npz`` file, or one of ``digits``, ``breast_cancer``, ``diabetes``,
        ``iris``, ``wine`` (preprocessing in the module docstring).
    max_examples
        keep a random subset of this many examples, drawn without replacement with
        ``numpy.random.default_rng(seed)`` and kept in their original order. ``None`` (or a
        number not smaller than the data set) keeps everything.
    seed
        the seed of that subset, a non-negative integer.

    Raises
    ------
    FileNotFoundError
        no such file and no such built-in name.
    TypeError
        ``max_examples`` or ``seed`` not an integer.
    ValueError
        ``max_examples < 1``, ``seed < 0``, a file without ``x``/``y`` or with
        arrays of different lengths.
    ImportError
        a built-in name without scikit-learn installed.
    """
    text = os.fspath(spec)
    if text in BUILTIN_DATASETS:
        x, y, weight, description = _BUILTIN_LOADERS[text]()
        name = text
    else:
        path = Path(text)
        if not path.exists():
            raise FileNotFoundError(
                f"No data file '{path}' and no built-in data set of that name; give a .npz file "
                f"with arrays 'x' and 'y' (optional 'sample_weight') or one of {BUILTIN_DATASETS}."
            )
        x, y, weight = _load_npz(path)
        name = path.stem
        description = f"{path} ({len(x)} examples)"

    total = len(x)
    max_examples = check_int("max_examples", max_examples, allow_none=True)
    check_seed("seed", seed, allow_none=False, allow_generator=False)
    if max_examples is not None:
        if max_examples < total:
            index = np.sort(np.random.default_rng(seed).choice(total, max_examples, replace=False))
            x, y = x[index], y[index]
            weight = None if weight is None else weight[index]
            description += (
                f"; random subset of {max_examples} of {total} examples "
                f"(numpy.random.default_rng({seed}), original order kept)"
            )
    return Data(
        x=x, y=y, sample_weight=weight, name=name, num_examples=len(x), description=description
    )


# Bytes of a file that is not a .npz archive shown in the error: enough to recognize a text
# file, an HDF5 or a pickle header.
_HEAD_BYTES = 16


def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if not zipfile.is_zipfile(path):
        # np.load would take it for a pickle and advise allow_pickle, which is unsafe and
        # not the cause: a .npz file is a zip archive.
        with open(path, "rb") as stream:
            head = stream.read(_HEAD_BYTES)
        raise ValueError(
            f"Could not read '{path}' as a .npz file: it is not the zip archive np.savez "
            f"writes (it begins with {head!r}: a text or other file renamed?). Save the "
            "arrays with np.savez(path, x=x, y=y)."
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except Exception as err:
        raise ValueError(
            f"Could not read '{path}' as a .npz file (np.savez with arrays 'x' and 'y'): "
            f"{type(err).__name__}: {err}"
        ) from err
    if "x" not in arrays or "y" not in arrays:
        raise ValueError(
            f"'{path}' must hold arrays named 'x' and 'y' (optional 'sample_weight'); it holds "
            f"{sorted(arrays)}. Write it with np.savez(path, x=x, y=y)."
        )
    x, y = arrays["x"], arrays["y"]
    weight = arrays.get("sample_weight")
    for key in ("x", "y", "sample_weight"):
        array = arrays.get(key)
        if array is not None and array.ndim == 0:
            raise ValueError(
                f"'{key}' in '{path}' is a scalar ({array!r}), not an array with one row per "
                "example. Write the data with np.savez(path, x=x, y=y), x of shape (n, ...)."
            )
    if len(x) == 0:
        raise ValueError(f"'{path}' holds no examples (x has shape {x.shape}).")
    lengths = {"x": len(x), "y": len(y)}
    if weight is not None:
        lengths["sample_weight"] = len(weight)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"The arrays in '{path}' have different numbers of examples: {lengths}")
    return x, y, weight


# --------------------------------------------------------------------------- built-in sets


def _sklearn_datasets() -> Any:
    try:
        import sklearn.datasets
    except ImportError as err:
        raise ImportError(
            "The built-in data sets need scikit-learn: pip install spectra-hessian[datasets]"
        ) from err
    return sklearn.datasets


def _standardize(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    scale = values.std(axis=0)
    scale[scale == 0] = 1.0
    return ((values - values.mean(axis=0)) / scale).astype(np.float32)


def _digits() -> tuple[np.ndarray, np.ndarray, None, str]:
    bunch = _sklearn_datasets().load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    return (
        x,
        bunch.target.astype(np.int64),
        None,
        (
            "scikit-learn digits: 8x8 images flattened to 64 features, x = pixels / 16 in [0, 1], "
            "y = class 0-9"
        ),
    )


def _breast_cancer() -> tuple[np.ndarray, np.ndarray, None, str]:
    bunch = _sklearn_datasets().load_breast_cancer()
    y = bunch.target.astype(np.float32).reshape(-1, 1)
    return (
        _standardize(bunch.data),
        y,
        None,
        (
            "scikit-learn breast_cancer: 30 standardized features, y = 0/1 (1 = benign) of shape "
            "(n, 1)"
        ),
    )


def _diabetes() -> tuple[np.ndarray, np.ndarray, None, str]:
    bunch = _sklearn_datasets().load_diabetes(scaled=False)
    y = _standardize(bunch.target.reshape(-1, 1))
    return (
        _standardize(bunch.data),
        y,
        None,
        (
            "scikit-learn diabetes: 10 standardized features, y = standardized disease progression "
            "of shape (n, 1)"
        ),
    )


def _iris() -> tuple[np.ndarray, np.ndarray, None, str]:
    bunch = _sklearn_datasets().load_iris()
    return (
        _standardize(bunch.data),
        bunch.target.astype(np.int64),
        None,
        ("scikit-learn iris: 4 standardized features, y = class 0-2"),
    )


def _wine() -> tuple[np.ndarray, np.ndarray, None, str]:
    bunch = _sklearn_datasets().load_wine()
    return (
        _standardize(bunch.data),
        bunch.target.astype(np.int64),
        None,
        ("scikit-learn wine: 13 standardized features, y = class 0-2"),
    )


_BUILTIN_LOADERS: dict[str, Callable[[], tuple[np.ndarray, np.ndarray, None, str]]] = {
    "digits": _digits,
    "breast_cancer": _breast_cancer,
    "diabetes": _diabetes,
    "iris": _iris,
    "wine": _wine,
}
