"""Batching of the data a loss is averaged over, and its split across workers.

The dataset loss is the mean over all N examples. With batches of n_b examples and
batch losses L_b (the mean over the batch, Keras' ``sum_over_batch_size`` reduction)

    L(θ) = Σ_b (n_b / N) L_b(θ),    so    H = Σ_b (n_b / N) H_b

exactly, an unequal last batch included. :class:`Batches` yields each batch with its
weight n_b / N; everything that sums over batches (losses, gradients, Hessian products)
uses these weights. (A Keras loss with ``reduction="sum"`` makes its L_b the batch sum
times N/n_b, so the same weighted sum is the sum over the dataset.)

A ``tf.data.Dataset`` is read again on every pass that is not served from a cache, so it
must yield the same batches each time. Each pass fingerprints every batch (a CRC-32 of
its bytes, computed on the host as the batches stream by) and compares it with the first
pass: a reshuffled or randomly augmented pipeline is refused before its batch is used.

**Several workers** (``MultiWorkerMirroredStrategy``, W processes): each worker reads
only its part of the data, and the weights stay those of the whole dataset.

* A *dataset function* ``data=lambda input_context: dataset`` (the convention of
  ``strategy.distribute_datasets_from_function``) is called once per worker with a
  ``tf.distribute.InputContext`` (``input_pipeline_id`` of ``num_input_pipelines`` = W);
  the dataset it returns is that worker's shard, typically
  ``files.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)`` followed by the
  reading and batching. The shards must together hold every example once.
* A ``tf.data.Dataset`` is sharded by TensorFlow's auto-sharding (``AutoShardPolicy``,
  read from the dataset's options; default ``AUTO``): by *file* when the pipeline reads
  files (TFRecord, text, fixed-length records), so each worker opens only its files; else
  by *data*: every worker runs the whole pipeline and keeps every W-th batch. Both are
  exact; data sharding saves compute but no reading. A dataset whose policy is ``OFF``
  is sharded by data too: with every worker computing every batch, the all-reduced sum
  would count each batch W times.
* Arrays are in memory on every worker: each computes its batches b with
  b mod R among its replicas' ids, and no data moves.

Batch b of a worker's stream goes to its local replica b mod L, so no worker reads
another's data to know its batches. The global N is learned once, by an all-reduce of
the per-worker counts (:meth:`Batches.synchronize`), so n_b/N is exact with uneven
shards and with a worker whose shard is empty (it still takes part in every
all-reduce). The fingerprint check runs on each worker over its own stream.
"""

from __future__ import annotations

import inspect
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from spectra._validation import check_int
from spectra.operators.data_checks import graph_errors
from spectra.operators.replicas import Replicas

__all__ = ["Batches", "DatasetFunction"]

# A dataset of unknown cardinality still being counted after this long gets one warning
# (it may never end).
_SLOW_COUNT_SECONDS = 60.0

BatchCheck = Callable[[Any, "str | None"], None]
DatasetFunction = Callable[[tf.distribute.InputContext], tf.data.Dataset]


def _is_dataset(data: Any) -> bool:
    return isinstance(data, tf.data.Dataset)


def _leading_dims(structure: Any) -> list[int | None]:
    return [
        (None if leaf.shape.rank in (None, 0) else leaf.shape[0])
        for leaf in tf.nest.flatten(structure)
    ]


def _fingerprint(batch: Any) -> int:
    """CRC-32 of a batch's dtypes, shapes and bytes (host copies of device tensors).

    Strings are hashed element-wise by TensorFlow first (``to_hash_bucket_fast``), so the
    fingerprint covers their contents rather than pointers.
    """
    crc = 0
    for leaf in tf.nest.flatten(batch):
        if leaf.dtype == tf.string:
            leaf = tf.strings.to_hash_bucket_fast(leaf, 2**62)
        array = np.ascontiguousarray(leaf.numpy())
        crc = zlib.crc32(f"{array.dtype.str}{array.shape}".encode(), crc)
        crc = zlib.crc32(array.reshape(-1).view(np.uint8).data, crc)
    return crc


def _nbytes(batch: Any) -> int:
    """Bytes of a batch's tensors (strings: their lengths)."""
    total = 0
    for leaf in tf.nest.flatten(batch):
        if leaf.dtype == tf.string:
            total += int(tf.reduce_sum(tf.strings.length(leaf)))
        else:
            total += int(leaf.shape.num_elements() or 0) * leaf.dtype.size
    return total


def _shard_across_workers(dataset: tf.data.Dataset, replicas: Replicas) -> tf.data.Dataset:
    """This worker's part of ``dataset``, by TensorFlow's auto-sharding.

    The dataset's ``AutoShardPolicy`` decides (``AUTO``: by file when the pipeline reads
    files, else by data); ``OFF`` becomes ``DATA`` (see the module docstring). Public
    APIs only: the ``AutoShardDataset`` raw op between ``to_variant``/``from_variant``.
    """
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == tf.data.experimental.AutoShardPolicy.OFF:
        policy = tf.data.experimental.AutoShardPolicy.DATA
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        dataset = dataset.with_options(options)  # the rewrite reads the pipeline's own
    spec = dataset.element_spec
    flat = tf.nest.flatten(spec)
    try:
        variant = tf.raw_ops.AutoShardDataset(
            input_dataset=tf.data.experimental.to_variant(dataset),
            num_workers=replicas.num_workers,
            index=replicas.worker,
            auto_shard_policy=int(policy),
            num_replicas=replicas.total,
            output_types=[s.dtype for s in flat],
            output_shapes=[s.shape for s in flat],
        )
    except tf.errors.NotFoundError as err:
        raise ValueError(
            "the dataset's auto_shard_policy is FILE but TensorFlow found no files to shard "
            "it by. Use AutoShardPolicy.AUTO (the default) or DATA, or pass a dataset "
            "function (data=lambda input_context: dataset) that builds each worker's "
            "shard."
        ) from err
    return tf.data.experimental.from_variant(variant, spec).with_options(dataset.options())


class Batches:
    """Batches of ``data`` with their weights ``n_b / N``.

    Parameters
    ----------
    data:
        ``None`` (a loss without data: one "batch" of weight 1), a nested structure of
        arrays/tensors with a common leading (example) dimension — typically
        ``(x, y)`` or ``(x, y, sample_weight)``, ``x`` possibly a dict or list —, a
        finite ``tf.data.Dataset`` whose elements are such batches, or a dataset
        function ``input_context -> tf.data.Dataset`` returning this input pipeline's
        shard of them (see the module docstring).
    batch_size:
        Split arrays into batches of this many examples (default: one batch). A positive
        int (numpy integers too; not a bool). Not accepted for a ``tf.data.Dataset``,
        which is taken batched as it is.
    cast_floats_to:
        If given, floating-point array leaves are cast to this dtype (e.g. the dtype the
        Hessian products run in). Integer leaves (labels) are left alone.
    max_batches:
        Optional safety limit for a dataset: more batches than this is an error (at
        construction when the dataset's cardinality is known, else while counting).
    replicas:
        Where the batches run (:class:`spectra.operators.replicas.Replicas`); default: one device.
        With several workers, a dataset is sharded across them (module docstring).
    purpose:
        Who reads the data several times, for the error when a dataset changes between
        passes: "<purpose> needs the same batches on every pass" (e.g. "The Hessian
        operator", "EKFACOperator's second data pass"); default "spectra".

    Notes
    -----
    Iterating yields ``(batch, weight)`` pairs for every batch this process reads, where
    ``batch`` has the structure of the data with tensors as leaves;
    :meth:`assigned` yields the batches this process computes, with their replicas.

    **Datasets.** The number of examples N is counted on the first pass (one extra pass
    over the data, done once). A dataset of infinite cardinality (``.repeat()`` without a
    count) is refused at construction: the loss is the mean over a finite dataset, so
    cut it with ``dataset.take(num_batches)``. TensorFlow cannot tell whether a dataset of
    *unknown* cardinality (``from_generator``, ``filter``, ...) ends; counting such a
    dataset that never ends never returns. That is the caller's responsibility: pass
    ``max_batches`` to turn it into an error, or watch for the warning issued once when
    the count has run for a minute.

    Every later pass must yield the same batches in the same order: each batch is
    fingerprinted (CRC-32 of its bytes) and compared with the first pass's, and a
    mismatch (``shuffle`` with ``reshuffle_each_iteration=True``, random augmentation,
    ``deterministic=False`` parallel maps) raises a ``ValueError`` before the batch is
    used. Array data is held in memory and needs no check. Cost: 2-4 GB/s of batch data on
    one core, paid on each pass that reads the dataset (the counting pass, the pass that
    fills the cache, and every product while streaming; cached products read no data).
    Measured: under 1% of a streaming product pass for an MLP on digits, about 20% for a
    linear model on 32x32x3 images, whose products cost next to nothing.

    Counters: ``examples_read`` and ``bytes_read``, what this process took from the data
    (dataset elements its pipeline yielded, array batches it sliced) over all passes.
    ``sharding`` says how this process's part was chosen: ``"none"`` (one worker, or no
    data), ``"replicated"`` (arrays, held whole by every worker), ``"auto-shard"`` (a
    dataset sharded by TensorFlow) or ``"function"`` (the shard a dataset function built).
    """

    def __init__(
        self,
        data: Any,
        batch_size: int | None = None,
        *,
        cast_floats_to: tf.DType | np.dtype | str | None = None,
        max_batches: int | None = None,
        replicas: Replicas | None = None,
        purpose: str = "spectra",
    ) -> None:
        batch_size = check_int("batch_size", batch_size, allow_none=True)
        self._purpose = purpose
        self._max_batches = check_int("max_batches", max_batches, allow_none=True)
        self._cast = None if cast_floats_to is None else tf.as_dtype(cast_floats_to)
        self._replicas = Replicas(None) if replicas is None else replicas
        self._dataset: tf.data.Dataset | None = None
        self._arrays: Any = None
        self._num_examples: int | None = None
        self._num_batches: int | None = None
        self._batch_sizes: list[int] | None = None
        self._fingerprints: list[int] | None = None
        self._pending_checks: list[BatchCheck] = []
        self._synchronized = False
        self.examples_read = 0
        self.bytes_read = 0
        workers = self._replicas.num_workers
        if data is None:
            if batch_size is not None:
                raise ValueError("batch_size was given but there is no data to batch.")
            self._num_examples = 1
            self._batch_sizes = [1]
            self.sharding = "none"
        elif _is_dataset(data) or callable(data):
            if batch_size is not None:
                raise ValueError(
                    "batch_size cannot be used with a tf.data.Dataset or a dataset function: "
                    "their elements are taken as batches as they are. Batch the dataset "
                    "yourself, e.g. dataset.batch(batch_size)."
                )
            if _is_dataset(data):
                dataset = data
                self.sharding = "auto-shard" if workers > 1 else "none"
            else:
                dataset = self._call_dataset_function(data)
                self.sharding = "function"
            self._check_cardinality(dataset)
            self._check_dataset_spec(dataset.element_spec)
            if workers > 1 and self.sharding == "auto-shard":
                dataset = _shard_across_workers(dataset, self._replicas)
            self._dataset = dataset
        else:
            self._arrays = self._to_tensors(data)
            n = self._count_arrays(self._arrays)
            bs = n if batch_size is None else batch_size
            self._num_examples = n
            self._batch_sizes = [min(bs, n - start) for start in range(0, n, bs)]
            self.sharding = "replicated" if workers > 1 else "none"
        if self._batch_sizes is not None and self._dataset is None:
            self._num_batches = len(self._batch_sizes)

    # -- construction helpers -------------------------------------------------------
    def _call_dataset_function(self, function: DatasetFunction) -> tf.data.Dataset:
        context = self._replicas.input_context()
        try:
            inspect.signature(function).bind(context)
        except TypeError as err:
            raise TypeError(
                "data is a function, so it is taken as a dataset function and called as "
                "data(input_context) (the convention of "
                f"strategy.distribute_datasets_from_function), but it cannot be: {err}."
            ) from None
        except ValueError:
            pass  # no signature to inspect (a builtin): call it and see
        dataset = function(context)
        if not _is_dataset(dataset):
            raise TypeError(
                "the dataset function must return a tf.data.Dataset of batches (this input "
                f"pipeline's shard); it returned a {type(dataset).__name__}."
            )
        return dataset

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
                "data must be None, a tf.data.Dataset, a dataset function, or a tuple such "
                "as (x, y) or (x, y, sample_weight) of arrays/tensors; could not convert it: "
                f"{err}"
            ) from err

    @staticmethod
    def _count_arrays(arrays: Any) -> int:
        leading = _leading_dims(arrays)
        if not leading:
            raise ValueError("data is empty: it holds no arrays.")
        dims = [d for d in leading if d is not None]
        if len(dims) != len(leading):
            raise ValueError("every array in data needs a leading example dimension; got a scalar.")
        if len(set(dims)) != 1:
            raise ValueError(
                "all arrays in data must have the same number of examples (leading "
                f"dimension); got {dims}."
            )
        if dims[0] == 0:
            raise ValueError("data is empty: it has 0 examples.")
        return dims[0]

    def _check_cardinality(self, dataset: tf.data.Dataset) -> None:
        cardinality = int(dataset.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "data is an infinite tf.data.Dataset (e.g. made with .repeat()): the loss is "
                "the mean over a finite dataset, and counting its examples would never end. "
                "Remove .repeat(), or take a finite part: dataset.take(num_batches)."
            )
        if self._max_batches is not None and cardinality > self._max_batches:
            raise ValueError(
                f"the dataset has {cardinality} batches, more than max_batches="
                f"{self._max_batches}. Take fewer (dataset.take(n)) or raise max_batches."
            )

    @staticmethod
    def _check_dataset_spec(spec: Any) -> None:
        for leaf in tf.nest.flatten(spec):
            if not isinstance(leaf, tf.TensorSpec):
                raise TypeError(
                    f"dataset elements must be dense tensors; got a {type(leaf).__name__}."
                )
            if leaf.shape.rank is None:
                raise ValueError(
                    "dataset elements must have a known rank (a leading example dimension); "
                    f"got a component of unknown shape ({leaf}), as tf.py_function outputs "
                    "have. Give it its shape in the pipeline, e.g. with tf.ensure_shape."
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
    def arrays(self) -> Any:
        """The array data as a nested structure of tensors (all examples), else None."""
        return self._arrays

    @property
    def dataset(self) -> tf.data.Dataset | None:
        """The dataset this process reads (its shard with several workers), else None."""
        return self._dataset

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
        """Total number of examples N over all workers (counts a dataset on first use)."""
        if self._num_examples is None:
            self.synchronize()
        assert self._num_examples is not None
        return self._num_examples

    @property
    def num_batches(self) -> int:
        """Total number of batches over all workers."""
        if self._num_batches is None:
            self.synchronize()
        assert self._num_batches is not None
        return self._num_batches

    @property
    def _per_worker(self) -> bool:
        """Whether this process reads its own stream of batches (a dataset) rather than
        all of the data (arrays, or no data)."""
        return self._dataset is not None

    def draw_index(self, index: int) -> int:
        """The number that seeds the random draws of batch ``index`` of this process's
        stream (Dropout masks in training mode, sampled labels), distinct over the cluster.

        Batch i of worker w's own stream gets i·W + w: its global index when the shards
        deal the batches round-robin (``Dataset.shard`` after ``batch``, auto-sharding by
        data), so such a cluster draws what one process does. Arrays are indexed
        globally already.
        """
        if self._per_worker:
            return index * self._replicas.num_workers + self._replicas.worker
        return index

    def describe(self, index: int) -> str:
        """How errors name batch ``index`` of this process's stream."""
        if self._per_worker and self._replicas.num_workers > 1:
            return f"batch {index} of worker {self._replicas.worker}'s shard"
        return f"batch {index}"

    def _where(self, index: int) -> str:
        if self._replicas.num_workers > 1:
            return f"{self.describe(index)} of the dataset"
        return f"batch {index} of the dataset"

    # -- counting and agreeing across workers -----------------------------------------
    def synchronize(self) -> None:
        """Count this worker's data and agree with the other workers on N.

        Under several workers this is one all-reduce of each worker's count (and, for
        arrays, of a fingerprint of them: every worker must hold the same arrays), so
        every worker must call it at the same point: operators do at construction. A
        worker whose counting pass fails still joins the all-reduce, and then every
        worker raises. Without workers it is the counting pass alone. Done once.
        """
        if self._synchronized:
            return
        error: BaseException | None = None
        crc = 0
        if self._dataset is not None:
            try:
                self._count_dataset()
            except Exception as err:  # raised below, after the other workers know
                if self._replicas.num_workers == 1:
                    raise
                error = err
        elif self._arrays is not None and self._replicas.num_workers > 1:
            crc = _fingerprint(self._arrays)
        sizes = self._batch_sizes or []
        row = [0.0 if error is None else 1.0, float(sum(sizes)), float(len(sizes)), float(crc)]
        table = self._replicas.all_gather(row)
        self._replicas.agree(error, "the counting pass over the data")
        if self._per_worker:
            examples, batches = int(table[:, 1].sum()), int(table[:, 2].sum())
            if examples == 0:
                where = " on every worker" if self._replicas.num_workers > 1 else ""
                raise ValueError(f"the dataset is empty{where}: it yielded no examples.")
        else:
            if np.any(table[:, 1:] != table[0, 1:]):
                raise ValueError(
                    "the workers hold different data (examples, batches, CRC-32 per worker: "
                    f"{table[:, 1:].astype(np.int64).tolist()}). With arrays every worker "
                    "must pass the same arrays (load or generate them with the same seed); "
                    "to give each worker only its part, pass a dataset function."
                )
            examples, batches = int(table[0, 1]), int(table[0, 2])
        self._num_examples = examples
        self._num_batches = batches
        self._synchronized = True

    def _count_dataset(self) -> None:
        """The counting pass: batch sizes, fingerprints, and the pending value checks."""
        assert self._dataset is not None
        unknown = int(self._dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
        started = time.monotonic()
        warned = False
        sizes: list[int] = []
        fingerprints: list[int] = []
        for index, (batch, n) in enumerate(self._read_dataset()):
            for check in self._pending_checks:
                check(batch, self._where(index))
            sizes.append(n)
            fingerprints.append(_fingerprint(batch))
            if unknown and not warned and time.monotonic() - started > _SLOW_COUNT_SECONDS:
                warned = True
                warnings.warn(
                    f"still counting the examples of a tf.data.Dataset of unknown "
                    f"cardinality: {len(sizes)} batches, {sum(sizes)} examples after "
                    f"{_SLOW_COUNT_SECONDS:.0f} s. The loss is the mean over the whole "
                    "dataset; if it never ends, cut it with dataset.take(num_batches) (or "
                    "pass max_batches to make this an error).",
                    RuntimeWarning,
                    stacklevel=4,
                )
        self._pending_checks = []
        self._batch_sizes = sizes
        self._fingerprints = fingerprints

    # -- value checks -----------------------------------------------------------------
    def check_values(self, check: BatchCheck) -> None:
        """Run ``check(batch, where)`` over the data, raising whatever it raises.

        Array data is checked at once, as one batch of all examples (``where`` is
        None). A dataset is checked batch by batch during its counting pass, so
        the check costs no extra pass (``where`` is ``"batch i of the dataset"``); if that
        pass has already run, one extra pass runs now. Without data nothing is checked.
        With several workers each checks the batches it reads.
        """
        if self._arrays is not None:
            check(self._arrays, None)
        elif self._dataset is not None:
            if self._batch_sizes is None:
                self._pending_checks.append(check)
            else:
                for index, (batch, _) in enumerate(self._read_dataset()):
                    check(batch, self._where(index))

    # -- iteration ------------------------------------------------------------------
    def _read_dataset(self) -> Iterator[tuple[Any, int]]:
        """``(batch, n)`` for each element of this process's dataset, counted as read."""
        assert self._dataset is not None
        for index, element in enumerate(self._elements()):
            if self._max_batches is not None and index >= self._max_batches:
                raise ValueError(
                    f"the dataset yielded more than max_batches={self._max_batches} batches. "
                    "If it never ends, cut it with dataset.take(num_batches); otherwise raise "
                    "max_batches."
                )
            # Every component has a leading dimension: _check_dataset_spec refused rank 0 and
            # unknown ranks, and an eager tensor's dimensions are known.
            dims = {int(leaf.shape[0]) for leaf in tf.nest.flatten(element)}
            if len(dims) != 1:
                raise ValueError(
                    "all components of a dataset element must have the same batch size; "
                    f"got {sorted(dims)}."
                )
            n = dims.pop()
            self.examples_read += n
            self.bytes_read += _nbytes(element)
            yield element, n

    def _elements(self) -> Iterator[Any]:
        """The dataset's elements; an error raised while producing one (a failing
        assertion in a ``map``, a raising ``from_generator``) is re-raised with the batch
        and its root cause on the first line ("batch 3 of the dataset: ...")."""
        assert self._dataset is not None
        iterator = iter(self._dataset)
        index = 0
        while True:
            with graph_errors(self._where(index)):
                try:
                    element = next(iterator)
                except StopIteration:
                    return
            yield element
            index += 1

    def _changed(self, detail: str) -> ValueError:
        where = f" on worker {self._replicas.worker}" if self._replicas.num_workers > 1 else ""
        return ValueError(
            f"the dataset yielded different data on this pass than on the first{where}: "
            f"{detail}. {self._purpose} needs the same batches on every pass, so the dataset must "
            "be deterministic: shuffle with reshuffle_each_iteration=False (or shuffle the "
            "arrays once before making the dataset), move random augmentation out of the "
            "pipeline, and keep parallel maps deterministic."
        )

    def _checked_pass(self) -> Iterator[tuple[int, Any, int]]:
        """``(index, batch, n)`` of a pass over the dataset, checked against the first."""
        self.synchronize()  # the counting pass, on first use
        sizes = self._batch_sizes
        fingerprints = self._fingerprints
        assert sizes is not None and fingerprints is not None
        count = 0
        for index, (batch, n) in enumerate(self._read_dataset()):
            count = index + 1
            if index >= len(sizes):
                raise self._changed(f"more than the {len(sizes)} batches of the first pass")
            if n != sizes[index]:
                raise self._changed(
                    f"batch {index} has {n} examples, on the first pass {sizes[index]}"
                )
            if _fingerprint(batch) != fingerprints[index]:
                raise self._changed(f"batch {index} has the same size ({n}) but different contents")
            yield index, batch, n
        if count != len(sizes):
            raise self._changed(f"{count} batches, on the first pass {len(sizes)}")

    def _array_batch(self, index: int) -> tuple[Any, int]:
        sizes = self._batch_sizes
        assert sizes is not None
        start = index * sizes[0]  # all batches but the last have the first one's size
        n = sizes[index]
        batch = tf.nest.map_structure(lambda t: t[start : start + n], self._arrays)
        self.examples_read += n
        self.bytes_read += _nbytes(batch)
        return batch, n

    def __iter__(self) -> Iterator[tuple[Any, float]]:
        """Yield ``(batch, weight)`` with ``weight = n_b / N`` for every batch this process
        reads (with several workers and a dataset: its shard)."""
        if self._dataset is not None:
            for _, batch, n in self._checked_pass():
                if n:
                    yield batch, n / self.num_examples
            return
        if self._arrays is None:
            yield (), 1.0
            return
        for index in range(len(self._batch_sizes or [])):
            batch, n = self._array_batch(index)
            yield batch, n / self.num_examples

    def assigned(self) -> Iterator[tuple[int, Any, float, int]]:
        """``(index, batch, weight, local replica)`` for the batches this process computes.

        Batch ``index`` of this process's dataset goes to local replica ``index mod L``;
        with arrays (or no data), which every process holds in full, global batch b goes
        to global replica b mod R and only this process's are sliced.
        """
        if self._dataset is not None:
            local = self._replicas.num_local
            for index, batch, n in self._checked_pass():
                if n:
                    yield index, batch, n / self.num_examples, index % local
            return
        for index in range(len(self._batch_sizes or [])):
            replica = self._replicas.owner(index)
            if replica is None:
                continue
            if self._arrays is None:
                yield index, (), 1.0, replica
            else:
                batch, n = self._array_batch(index)
                yield index, batch, n / self.num_examples, replica
