"""Data for the command line and the notebooks: ``.npz`` files and small built-in data sets.

Built-in data sets (scikit-learn: ``pip install scikit-learn``), all with ``x`` as
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

Labels of a model with several outputs go in a ``.npz`` file as one array per output, instead of
``y``: preferably ``y_<output name>`` (``np.savez(path, x=x, y_digit=..., y_size=...)``, giving a
dict keyed by output name). ``y0, y1, ...`` (giving a list) are taken in Keras' output order,
which is the order of the list a functional model was built with (``model.output_names``); they
are refused for a model whose outputs are a dict, where nothing written down fixes an order.

Loss names that fit: ``sparse_categorical_crossentropy`` for ``digits``, ``iris`` and ``wine``
(softmax outputs); ``binary_crossentropy`` for ``breast_cancer`` (one sigmoid output);
``mean_squared_error`` for ``diabetes`` (one linear output).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spectra._validation import check_int, check_seed

BUILTIN_DATASETS = ("digits", "breast_cancer", "diabetes", "iris", "wine")

# One label array, or one per model output: by output name or in output order.
Labels = np.ndarray | dict[str, np.ndarray] | list[np.ndarray]


def label_arrays(y: Labels) -> dict[str, np.ndarray]:
    """The label arrays of ``y`` by the name they have in a ``.npz`` file: ``{"y": y}`` for
    one array, ``{"y_<name>": ...}`` for a dict, ``{"y0": ..., "y1": ...}`` for a list."""
    if isinstance(y, dict):
        return {f"y_{name}": array for name, array in y.items()}
    if isinstance(y, list):
        return {f"y{i}": array for i, array in enumerate(y)}
    return {"y": y}


def _take(y: Labels, index: np.ndarray) -> Labels:
    if isinstance(y, dict):
        return {name: array[index] for name, array in y.items()}
    if isinstance(y, list):
        return [array[index] for array in y]
    return y[index]


@dataclass
class Data:
    """Arrays for an analysis, with where they came from.

    ``num_examples`` is ``len(x)``; ``description`` says the source, the preprocessing and the
    subset taken, if any. ``y`` is one array, or for a model with several outputs a dict of
    arrays by output name (``y_<name>`` in the file) or a list in Keras' output order (``y0,
    y1, ...``; only for a model whose outputs are a list).
    """

    def label_arrays(self) -> dict[str, np.ndarray]:
        """The label arrays by the name they have in the file: ``{"y": y}``, ``{"y_<name>":
        ...}`` or ``{"y0": ..., "y1": ...}``."""
        return label_arrays(self.y)

    x: np.ndarray
    y: Labels
    sample_weight: np.ndarray | None
    name: str
    num_examples: int
    description: str

    def as_tuple(self) -> tuple[Any, ...]:
        """``(x, y)``, or ``(x, y, sample_weight)`` when there are sample weights."""
        if self.sample_weight is None:
            return self.x, self.y
        return self.x, self.y, self.sample_weight


def load_data(spec: str | os.PathLike, max_examples: int | None = None, seed: int = 0) -> Data:
    """Load a ``.npz`` file (arrays ``x``, ``y``, optional ``sample_weight``) or a built-in set.

    For a model with several outputs the file holds ``y_<output name>`` arrays (``y`` becomes
    a dict by output name) or ``y0, y1, ...`` (a list in Keras' output order, refused later
    for a model whose outputs are a dict) instead of ``y``.

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
        ``max_examples < 1``, ``seed < 0``, a file without ``x`` or labels, with both
        ``y`` and per-output labels, ``y0, y1, ...`` with a gap, or arrays of different
        lengths.
    ImportError
        a built-in name without scikit-learn installed.
    """
    text = os.fspath(spec)
    y: Labels
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
        description = f"{path} ({len(x):,} examples)"

    total = len(x)
    max_examples = check_int("max_examples", max_examples, allow_none=True)
    check_seed("seed", seed, allow_none=False, allow_generator=False)
    if max_examples is not None:
        if max_examples < total:
            index = np.sort(np.random.default_rng(seed).choice(total, max_examples, replace=False))
            x, y = x[index], _take(y, index)
            weight = None if weight is None else weight[index]
            description += (
                f"; random subset of {max_examples:,} of {total:,} examples "
                f"(numpy.random.default_rng({seed}), original order kept)"
            )
    return Data(
        x=x, y=y, sample_weight=weight, name=name, num_examples=len(x), description=description
    )


# Bytes of a file that is not a .npz archive shown in the error: enough to recognize a text
# file, an HDF5 or a pickle header.
_HEAD_BYTES = 16


def _load_npz(path: Path) -> tuple[np.ndarray, Labels, np.ndarray | None]:
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
    per_output = sorted(key for key in arrays if _is_output_label(key))
    if "x" not in arrays or ("y" not in arrays and not per_output):
        raise ValueError(
            f"'{path}' must hold arrays named 'x' and 'y' (optional 'sample_weight'; for a "
            "model with several outputs 'y_<output name>' or 'y0', 'y1', ... instead of 'y'); "
            f"it holds {sorted(arrays)}. Write it with np.savez(path, x=x, y=y)."
        )
    x = arrays["x"]
    y = _labels(path, arrays, per_output)
    weight = arrays.get("sample_weight")
    for key, array in {"x": x, **label_arrays(y), "sample_weight": weight}.items():
        if array is not None and array.ndim == 0:
            raise ValueError(
                f"'{key}' in '{path}' is a scalar ({array!r}), not an array with one row per "
                "example. Write the data with np.savez(path, x=x, y=y), x of shape (n, ...)."
            )
    if len(x) == 0:
        raise ValueError(f"'{path}' holds no examples (x has shape {x.shape}).")
    lengths = {"x": len(x), **{key: len(array) for key, array in label_arrays(y).items()}}
    if weight is not None:
        lengths["sample_weight"] = len(weight)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"The arrays in '{path}' have different numbers of examples: {lengths}")
    return x, y, weight


_NUMBERED_LABEL = re.compile(r"y(\d+)")


def _is_output_label(key: str) -> bool:
    return (key.startswith("y_") and len(key) > 2) or _NUMBERED_LABEL.fullmatch(key) is not None


def _labels(path: Path, arrays: dict[str, np.ndarray], per_output: list[str]) -> Labels:
    """``y``, a dict from the ``y_<name>`` arrays, or a list from ``y0, y1, ...``."""
    if not per_output:
        return arrays["y"]
    if "y" in arrays:
        raise ValueError(
            f"'{path}' holds both 'y' and per-output labels {per_output}: keep 'y' for a "
            "single-output model, or only the per-output arrays for a model with several."
        )
    named = [key for key in per_output if key.startswith("y_")]
    numbered = [key for key in per_output if not key.startswith("y_")]
    if named and numbered:
        raise ValueError(
            f"'{path}' mixes labels by output name {named} and by position {numbered}: "
            "name every array 'y_<output name>'."
        )
    if named:
        return {key[2:]: arrays[key] for key in named}
    positions = sorted(int(key[1:]) for key in numbered)
    if positions != list(range(len(positions))) or any(
        key != f"y{int(key[1:])}" for key in numbered
    ):
        raise ValueError(
            f"'{path}' numbers its labels {sorted(numbered, key=lambda k: int(k[1:]))}: "
            f"name them 'y_<output name>', one per model output (or give 'y0' .. "
            f"'y{len(positions) - 1}' for a model whose outputs are a list, in its order)."
        )
    return [arrays[f"y{i}"] for i in positions]


# --------------------------------------------------------------------------- built-in sets


def _sklearn_datasets() -> Any:
    try:
        import sklearn.datasets
    except ImportError as err:
        raise ImportError(
            "The built-in data sets need scikit-learn: pip install scikit-learn (or, in a "
            "clone of spectra, pip install '.[datasets]')"
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
