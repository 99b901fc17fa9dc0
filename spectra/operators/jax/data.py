"""The data a JAX operator averages over, as batches with their weights n_b/N.

The dataset loss is the mean over all N examples: with batches of n_b examples and batch
losses L_b, L(θ) = Σ_b (n_b/N) L_b(θ) exactly, an unequal last batch included
(:mod:`spectra.operators.batching` states the convention; a ``reduction="sum"`` loss
makes its L_b the batch sum times N/n_b). :class:`Batches` reads

* **arrays**: ``(x, y)`` or ``(x, y, sample_weight)`` (``x`` and ``y`` may be dicts or
  lists of arrays), or ``x`` alone for the Jacobian: NumPy or JAX arrays, held in memory
  and split into batches of ``batch_size`` examples (default: one batch);
* a ``keras.utils.PyDataset``: its ``len(data)`` batches ``data[i]``, taken as they are;
* a Python **list of batches** (tuples ``(x, y[, sample_weight])``), or any other
  re-iterable object whose ``iter()`` yields such batches anew on every pass; a one-shot
  iterator (a generator) cannot be read twice and is refused;
* a ``tf.data.Dataset``, only where TensorFlow is installed (its batches as NumPy
  arrays, ``as_numpy_iterator()``); without TensorFlow such an object cannot exist, and
  anything that claims to be one is refused in one line.

Floating-point leaves are cast to the operator's dtype; integer leaves (labels) are left
as they are. A source other than arrays is read again on every pass that is not served
from a cache, so it must yield the same batches each time: each batch is fingerprinted
(CRC-32 of its bytes) on the first pass and checked on every later one (a shuffling or
randomly augmenting ``PyDataset`` is refused before its batch is used). Its examples are
counted on first use (one pass), during which the data checks run
(:meth:`Batches.check_values`).
"""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectra._validation import check_int

__all__ = ["Batches", "Spec", "leaves", "map_structure"]

BatchCheck = Callable[[Any, "str | None"], None]


@dataclass(frozen=True)
class Spec:
    """The shape (leading dimension None) and dtype of one leaf of a batch."""

    shape: tuple[int | None, ...]
    dtype: np.dtype


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """``fn`` applied to every leaf of nested dicts, lists and tuples (kept as they are)."""
    if isinstance(structure, dict):
        return {key: map_structure(fn, value) for key, value in structure.items()}
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(map_structure(fn, value) for value in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_structure(fn, value) for value in structure)
    return fn(structure)


def leaves(structure: Any, root: str = "data") -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf, named as a user spells it (``data[0]['a']``)."""
    if isinstance(structure, dict):
        return [item for key in structure for item in leaves(structure[key], f"{root}[{key!r}]")]
    if isinstance(structure, (list, tuple)):
        return [item for i, value in enumerate(structure) for item in leaves(value, f"{root}[{i}]")]
    return [(root, structure)]


def _part_names(structure: Any) -> list[tuple[str, Any]]:
    """Leaves of a batch named ``x``, ``y``, ``sample_weight`` (``x['a']``, ``y[1]``)."""
    if isinstance(structure, tuple) and 1 <= len(structure) <= 3:
        roots = ("x", "y", "sample_weight")
        return [item for root, part in zip(roots, structure) for item in leaves(part, root)]
    return leaves(structure, "x")


def _is_tf_dataset(data: Any) -> bool:
    """A ``tf.data.Dataset`` (recognized by its class, without importing TensorFlow)."""
    return any(
        cls.__module__.startswith("tensorflow") and "Dataset" in cls.__name__
        for cls in type(data).__mro__
    )


def _is_py_dataset(data: Any) -> bool:
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras is a dependency
        return False
    return isinstance(data, keras.utils.PyDataset)


def _is_leaf_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or hasattr(value, "__array__")


def _nbytes(batch: Any) -> int:
    return sum(int(np.asarray(leaf).nbytes) for _, leaf in leaves(batch))


def _fingerprint(batch: Any) -> int:
    """CRC-32 of a batch's dtypes, shapes and bytes."""
    crc = 0
    for _, leaf in leaves(batch):
        array = np.ascontiguousarray(leaf)
        crc = zlib.crc32(f"{array.dtype.str}{array.shape}".encode(), crc)
        if array.dtype.kind == "O":
            crc = zlib.crc32(repr(array.tolist()).encode(), crc)
        else:
            crc = zlib.crc32(array.reshape(-1).view(np.uint8).data, crc)
    return crc


def _rows(start: int, stop: int) -> Callable[[Any], Any]:
    """Rows ``start:stop`` of a leaf (None stays None)."""

    def rows(leaf: Any) -> Any:
        return None if leaf is None else leaf[start:stop]

    return rows


class Batches:
    """Batches of ``data`` with their weights n_b/N (see the module docstring).

    Parameters
    ----------
    data:
        Arrays, a ``keras.utils.PyDataset``, a list (or re-iterable) of batches, or a
        ``tf.data.Dataset`` where TensorFlow is installed.
    batch_size:
        Split arrays into batches of this many examples (default: one batch); refused for
        the other sources, which are taken batched as they are.
    cast_floats_to:
        The dtype floating-point leaves are cast to (the operator's).
    purpose:
        Who reads the data several times, for the error when a source changes between
        passes ("<purpose> needs the same batches on every pass").

    Iterating yields ``(index, batch, n_b)`` with ``batch`` a structure of NumPy arrays
    like the data's. ``kind`` names the source in messages; ``dataset`` is the source for
    sources other than arrays (None for arrays), as the data checks read it.
    """

    def __init__(
        self,
        data: Any,
        batch_size: int | None = None,
        *,
        cast_floats_to: Any = None,
        purpose: str = "spectra",
    ) -> None:
        batch_size = check_int("batch_size", batch_size, allow_none=True)
        self._cast = None if cast_floats_to is None else np.dtype(cast_floats_to)
        self._purpose = purpose
        self._arrays: Any = None
        self._source: Any = None
        self._read: Callable[[], Iterable[Any]] | None = None
        self._batch_sizes: list[int] | None = None
        self._fingerprints: list[int] | None = None
        self._pending_checks: list[BatchCheck] = []
        self._first: Any = None
        self.examples_read = 0
        self.bytes_read = 0
        if data is None:
            raise ValueError("data is required.")
        if isinstance(data, (str, bytes)):
            raise TypeError(
                "data must be (x, y) or (x, y, sample_weight) arrays, a keras.utils.PyDataset, "
                f"or a list of such batches; got a {type(data).__name__} (load a file first)."
            )
        if _is_tf_dataset(data):
            self._from_tf_dataset(data)
        elif _is_py_dataset(data):
            self.kind = "a keras.utils.PyDataset"
            self._source = data
            self._read = lambda: (data[i] for i in range(len(data)))
        elif isinstance(data, list) and data and all(isinstance(b, tuple) for b in data):
            self.kind = "a list of batches"
            self._source = data
            self._read = lambda: iter(data)
        elif isinstance(data, (tuple, list, dict)) or _is_leaf_array(data):
            self.kind = "arrays"
            self._arrays = self._converted(data)
            n = self._count_arrays(self._arrays)
            size = n if batch_size is None else batch_size
            self._batch_sizes = [min(size, n - start) for start in range(0, n, size)]
        elif isinstance(data, Iterable):
            if iter(data) is data:
                raise TypeError(
                    f"data is a {type(data).__name__}, an iterator that can be read only "
                    "once, but the operator reads its batches on several passes: pass a list "
                    "of batches, a keras.utils.PyDataset or arrays."
                )
            self.kind = f"a {type(data).__name__} of batches"
            self._source = data
            self._read = lambda: iter(data)
        else:
            raise TypeError(
                "data must be (x, y) or (x, y, sample_weight) arrays, a keras.utils.PyDataset, "
                f"or a list of such batches; got a {type(data).__name__}."
            )
        if batch_size is not None and self._arrays is None:
            raise ValueError(
                f"batch_size cannot be used with {self.kind}: its batches are taken as they "
                "are. Batch the data yourself, or pass arrays."
            )

    # -- sources --------------------------------------------------------------------
    def _from_tf_dataset(self, data: Any) -> None:
        if importlib.util.find_spec("tensorflow") is None:
            raise TypeError(
                f"data is a {type(data).__name__} (tf.data), which needs TensorFlow, and "
                "TensorFlow is not installed: pass arrays (x, y) or a keras.utils.PyDataset."
            )
        cardinality = int(data.cardinality())
        if cardinality == -1:  # tf.data.INFINITE_CARDINALITY
            raise ValueError(
                "data is an infinite tf.data.Dataset (e.g. made with .repeat()): the loss is "
                "the mean over a finite dataset. Take a finite part: dataset.take(num_batches)."
            )
        self.kind = "a tf.data.Dataset"
        self._source = data
        self._read = data.as_numpy_iterator

    def _converted(self, structure: Any) -> Any:
        def convert(leaf: Any) -> Any:
            if leaf is None:
                return None
            array = np.asarray(leaf)
            if self._cast is not None and array.dtype.kind == "f" and array.dtype != self._cast:
                array = array.astype(self._cast)
            return array

        return map_structure(convert, structure)

    @staticmethod
    def _count_arrays(structure: Any, where: str = "") -> int:
        named = [(name, leaf) for name, leaf in _part_names(structure) if leaf is not None]
        if not named:
            raise ValueError(f"data{where} is empty: it holds no arrays.")
        scalars = [name for name, leaf in named if np.ndim(leaf) == 0]
        if scalars:
            raise ValueError(
                f"every array in data needs a leading example dimension; {scalars[0]}{where} "
                "is a scalar."
            )
        counts = {name: int(np.shape(leaf)[0]) for name, leaf in named}
        if len(set(counts.values())) != 1:
            listed = ", ".join(f"{name} has {count}" for name, count in counts.items())
            raise ValueError(
                f"the arrays in data{where} must have the same number of examples (leading "
                f"dimension): {listed}."
            )
        n = next(iter(counts.values()))
        if n == 0:
            raise ValueError(f"data{where} is empty: it has 0 examples.")
        return n

    # -- properties -----------------------------------------------------------------
    @property
    def dataset(self) -> Any:
        """The source of batches other than arrays (None for arrays)."""
        return self._source

    @property
    def arrays(self) -> Any:
        """The array data (all examples, cast), else None."""
        return self._arrays

    def _first_batch(self) -> Any:
        if self._arrays is not None:
            return self._arrays
        if self._first is None:
            assert self._read is not None
            for batch in self._read():
                self._first = self._converted(batch)
                break
            else:
                raise ValueError(f"data is {self.kind} that yields no batches.")
        return self._first

    @property
    def element_spec(self) -> Any:
        """A batch's structure with a :class:`Spec` per leaf (leading dimension None)."""

        def spec(leaf: Any) -> Any:
            if leaf is None:
                return None
            return Spec((None, *np.shape(leaf)[1:]), np.asarray(leaf).dtype)

        return map_structure(spec, self._first_batch())

    @property
    def num_examples(self) -> int:
        """N, the number of examples (counts a source other than arrays on first use)."""
        return sum(self.batch_sizes)

    @property
    def num_batches(self) -> int:
        return len(self.batch_sizes)

    @property
    def batch_sizes(self) -> list[int]:
        if self._batch_sizes is None:
            self._count()
        assert self._batch_sizes is not None
        return self._batch_sizes

    def describe(self, index: int) -> str:
        """How errors name batch ``index``."""
        return f"batch {index}"

    def _where(self, index: int) -> str:
        return f"batch {index} of the data" if self._arrays is None else f"batch {index}"

    # -- passes -----------------------------------------------------------------------
    def _elements(self) -> Iterator[tuple[int, Any, int]]:
        assert self._read is not None
        for index, batch in enumerate(self._read()):
            batch = self._converted(batch)
            n = self._count_arrays(batch, where=f" ({self._where(index)})")
            self.examples_read += n
            self.bytes_read += _nbytes(batch)
            yield index, batch, n

    def _count(self) -> None:
        """The counting pass: batch sizes, fingerprints and the pending value checks."""
        sizes: list[int] = []
        fingerprints: list[int] = []
        for index, batch, n in self._elements():
            for check in self._pending_checks:
                check(batch, self._where(index))
            sizes.append(n)
            fingerprints.append(_fingerprint(batch))
        if not sizes:
            raise ValueError(f"data is {self.kind} that yields no batches.")
        self._pending_checks = []
        self._batch_sizes = sizes
        self._fingerprints = fingerprints

    def check_values(self, check: BatchCheck) -> None:
        """Run ``check(batch, where)`` over the data: arrays at once (``where`` None),
        another source batch by batch during its counting pass (no extra pass, unless it
        was counted already)."""
        if self._arrays is not None:
            check(self._arrays, None)
        elif self._batch_sizes is None:
            self._pending_checks.append(check)
        else:
            for index, batch, _ in self._elements():
                check(batch, self._where(index))

    def _changed(self, detail: str) -> ValueError:
        return ValueError(
            f"data ({self.kind}) yielded different batches on this pass than on the first: "
            f"{detail}. {self._purpose} needs the same batches on every pass: shuffle once "
            "before, and move random augmentation out of the data."
        )

    def __iter__(self) -> Iterator[tuple[int, Any, int]]:
        """``(index, batch, n_b)`` for every batch, in order."""
        if self._arrays is not None:
            sizes = self.batch_sizes
            start = 0
            for index, n in enumerate(sizes):
                stop = start + n
                batch = map_structure(_rows(start, stop), self._arrays)
                self.examples_read += n
                self.bytes_read += _nbytes(batch)
                yield index, batch, n
                start = stop
            return
        sizes = self.batch_sizes
        fingerprints = self._fingerprints
        assert fingerprints is not None
        count = 0
        for index, batch, n in self._elements():
            count = index + 1
            if index >= len(sizes):
                raise self._changed(f"more than the {len(sizes)} batches of the first pass")
            if n != sizes[index] or _fingerprint(batch) != fingerprints[index]:
                raise self._changed(f"batch {index} differs from the first pass's")
            yield index, batch, n
        if count != len(sizes):
            raise self._changed(f"{count} batches, on the first pass {len(sizes)}")
