"""Batching of the data a loss is averaged over.

The dataset loss is the mean over all N examples. With batches of n_b examples and
batch losses L_b (the mean over the batch, Keras' ``sum_over_batch_size`` reduction)

    L(θ) = Σ_b (n_b / N) L_b(θ),    so    H = Σ_b (n_b / N) H_b

exactly, an unequal last batch included. :class:`Batches` yields each batch with its
weight n_b / N; everything that sums over batches (losses, gradients, Hessian products)
uses these weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["Batches"]


def _is_dataset(data: Any) -> bool:
    return isinstance(data, tf.data.Dataset)


def _leading_dims(structure: Any) -> list[int | None]:
    return [
        (None if leaf.shape.rank in (None, 0) else leaf.shape[0])
        for leaf in tf.nest.flatten(structure)
    ]


class Batches:
    """Batches of ``data`` with their weights ``n_b / N``.

    Parameters
    ----------
    data:
        ``None`` (a loss without data: one "batch" of weight 1), a nested structure of
        arrays/tensors with a common leading (example) dimension — typically
        ``(x, y)`` or ``(x, y, sample_weight)``, ``x`` possibly a dict or list —, or a
        ``tf.data.Dataset`` whose elements are such batches.
    batch_size:
        Split arrays into batches of this many examples (default: one batch). Not
        accepted for a ``tf.data.Dataset``, which is taken batched as it is.
    cast_floats_to:
        If given, floating-point array leaves are cast to this dtype (e.g. the dtype the
        Hessian products run in). Integer leaves (labels) are left alone.

    Iterating yields ``(batch, weight)`` pairs where ``batch`` has the structure of the
    data with tensors as leaves. For a dataset the number of examples N is counted on the
    first pass (one extra pass over the data, done once).
    """

    def __init__(
        self,
        data: Any,
        batch_size: int | None = None,
        *,
        cast_floats_to: tf.DType | np.dtype | str | None = None,
    ) -> None:
        self._cast = None if cast_floats_to is None else tf.as_dtype(cast_floats_to)
        self._dataset: tf.data.Dataset | None = None
        self._arrays: Any = None
        self._num_examples: int | None = None
        self._batch_sizes: list[int] | None = None
        if data is None:
            if batch_size is not None:
                raise ValueError("batch_size was given but there is no data to batch.")
            self._num_examples = 1
            self._batch_sizes = [1]
        elif _is_dataset(data):
            if batch_size is not None:
                raise ValueError(
                    "batch_size cannot be used with a tf.data.Dataset: its elements are "
                    "taken as batches as they are. Batch the dataset yourself, e.g. "
                    "dataset.batch(batch_size)."
                )
            self._dataset = data
            self._check_dataset_spec(data.element_spec)
        else:
            self._arrays = self._to_tensors(data)
            n = self._count_arrays(self._arrays)
            if batch_size is None:
                batch_size = n
            if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
                raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
            self._num_examples = n
            bs = int(batch_size)
            self._batch_sizes = [min(bs, n - start) for start in range(0, n, bs)]

    # -- construction helpers -------------------------------------------------------
    def _to_tensors(self, data: Any) -> Any:
        def convert(leaf: Any) -> tf.Tensor:
            tensor = tf.convert_to_tensor(leaf)
            if self._cast is not None and tensor.dtype.is_floating and tensor.dtype != self._cast:
                tensor = tf.cast(tensor, self._cast)
            return tensor

        try:
            return tf.nest.map_structure(convert, data)
        except (ValueError, TypeError) as err:
            raise TypeError(
                "data must be None, a tf.data.Dataset, or a tuple such as (x, y) or "
                f"(x, y, sample_weight) of arrays/tensors; could not convert it: {err}"
            ) from err

    @staticmethod
    def _count_arrays(arrays: Any) -> int:
        dims = _leading_dims(arrays)
        if not dims:
            raise ValueError("data is empty: it holds no arrays.")
        if any(d is None for d in dims):
            raise ValueError("every array in data needs a leading example dimension; got a scalar.")
        if len(set(dims)) != 1:
            raise ValueError(
                "all arrays in data must have the same number of examples (leading "
                f"dimension); got {dims}."
            )
        if dims[0] == 0:
            raise ValueError("data is empty: it has 0 examples.")
        return int(dims[0])

    @staticmethod
    def _check_dataset_spec(spec: Any) -> None:
        for leaf in tf.nest.flatten(spec):
            if not isinstance(leaf, tf.TensorSpec):
                raise TypeError(
                    f"dataset elements must be dense tensors; got a {type(leaf).__name__}."
                )
            if leaf.shape.rank == 0:
                raise ValueError(
                    "dataset elements must be batches (a leading example dimension); got "
                    "scalar components. Batch the dataset, e.g. dataset.batch(256)."
                )

    # -- properties -----------------------------------------------------------------
    @property
    def has_data(self) -> bool:
        return self._arrays is not None or self._dataset is not None

    @property
    def element_spec(self) -> Any:
        """Nested ``tf.TensorSpec`` of one batch, with an unknown batch dimension."""
        if self._dataset is not None:
            return tf.nest.map_structure(
                lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), self._dataset.element_spec
            )
        if self._arrays is None:
            return ()
        return tf.nest.map_structure(
            lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), self._arrays
        )

    @property
    def num_examples(self) -> int:
        """Total number of examples N (counts a dataset on first use)."""
        if self._num_examples is None:
            self._count_dataset()
        assert self._num_examples is not None
        return self._num_examples

    @property
    def num_batches(self) -> int:
        if self._batch_sizes is None:
            self._count_dataset()
        assert self._batch_sizes is not None
        return len(self._batch_sizes)

    def _count_dataset(self) -> None:
        sizes = [n for _, n in self._iterate_dataset()]
        self._set_dataset_sizes(sizes)

    def _set_dataset_sizes(self, sizes: list[int]) -> None:
        if not sizes or sum(sizes) == 0:
            raise ValueError("the dataset is empty: it yielded no examples.")
        self._batch_sizes = sizes
        self._num_examples = int(sum(sizes))

    # -- iteration ------------------------------------------------------------------
    def _iterate_dataset(self) -> Iterator[tuple[Any, int]]:
        assert self._dataset is not None
        for element in self._dataset:
            dims = {d for d in _leading_dims(element)}
            if len(dims) != 1:
                raise ValueError(
                    "all components of a dataset element must have the same batch size; "
                    f"got {sorted(dims)}."
                )
            yield element, int(dims.pop())

    def __iter__(self) -> Iterator[tuple[Any, float]]:
        """Yield ``(batch, weight)`` with ``weight = n_b / N``."""
        if self._dataset is not None:
            if self._num_examples is None:
                # First pass: weights are not known yet, so count while materializing
                # nothing more than one batch at a time would need two passes; count
                # first (cheap for most pipelines), then iterate.
                self._count_dataset()
            total = self.num_examples
            seen = []
            for batch, n in self._iterate_dataset():
                seen.append(n)
                if n:
                    yield batch, n / total
            if seen != self._batch_sizes:
                raise RuntimeError(
                    "the dataset yielded different batches on two passes "
                    f"({sum(seen)} vs {total} examples). The Hessian needs the same data "
                    "on every pass: remove shuffling/random augmentation, or shuffle with "
                    "reshuffle_each_iteration=False."
                )
            return
        if self._arrays is None:
            yield (), 1.0
            return
        total = self.num_examples
        start = 0
        for n in self._batch_sizes or []:
            batch = tf.nest.map_structure(lambda t, s=start, m=n: t[s : s + m], self._arrays)
            start += n
            yield batch, n / total
