"""Where batches run and how their sums are combined: one device or a ``tf.distribute`` strategy.

With a strategy (``MirroredStrategy`` on the GPUs of one machine,
``MultiWorkerMirroredStrategy`` across machines) there are R = ``num_replicas_in_sync``
replicas, L of them local to each of the W worker processes (R = W·L). Each process
computes the batches assigned to its local replicas on their devices, keeps one running
sum per replica, and an all-reduce (``strategy.reduce(SUM)``) gives every process the
same total. Every process therefore runs the same estimator with the same seed on the
same vectors (SPMD) and sees the same products. Which batches a replica computes is
decided by :class:`spectra.operators.batching.Batches`; the weights n_b/N are those of the whole
dataset, so the result is the exact dataset matrix whatever the number of replicas.

**Concurrency.** The local replicas' work is issued from one host thread per replica
(:meth:`Replicas.run`): a replica's batches run in order on its own thread and device, the
replicas side by side, while the calling thread reads the next batches. TensorFlow
releases the GIL while a compiled function runs, so devices overlap; on GPUs kernel
launches are asynchronous as well. One replica runs on the calling thread.

**Collective failure.** An exception on one worker would leave the others waiting in the
next all-reduce forever. A worker whose pass fails therefore still joins the pass's
all-reduces, contributing NaN (``sum(..., poisoned=True)``), so every worker sees a
non-finite sum; only then do all run :meth:`Replicas.agree`, one small all-reduce of a
failure flag, after which the failing worker raises its own error and the others
:class:`WorkerFailed` naming it. A pass that went well costs no extra collective.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

# Tasks queued per replica thread before the reading thread waits (bounds the batches
# held in memory while streaming).
_IN_FLIGHT = 2


class WorkerFailed(RuntimeError):
    """Raised on the healthy workers when another worker of the cluster failed."""


class _Accumulator:
    """Per-local-replica running sums of tensors of one dtype."""

    def __init__(self, num_local: int, dtype: tf.DType) -> None:
        self.values: list[tf.Tensor | None] = [None] * num_local
        self.dtype = dtype

    def add(self, replica: int, value: tf.Tensor) -> None:
        current = self.values[replica]
        self.values[replica] = value if current is None else current + value


class Replicas:
    """Local replica devices of a strategy (or the default device) and cross-replica sums.

    Attributes: ``devices`` (local replica devices; ``[None]`` without a strategy),
    ``total`` (R, all replicas), ``first_global`` (the global id of local replica 0),
    ``num_workers`` (W, the input pipelines: one per process), ``worker`` (this process's
    pipeline id), ``concurrent`` (issue local replicas from their own threads; default
    True, False runs them one after another on the calling thread).
    """

    def __init__(self, strategy: tf.distribute.Strategy | None) -> None:
        if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(
                f"strategy must be a tf.distribute.Strategy; got {type(strategy).__name__}."
            )
        if strategy is not None and strategy.num_replicas_in_sync == 1:
            strategy = None  # one replica: nothing to distribute
        self.strategy = strategy
        self.concurrent = True
        if strategy is None:
            self.devices: list[str | None] = [None]
            self.first_global = 0
            self.total = 1
        else:
            self.devices = list(strategy.extended.worker_devices)
            self.total = int(strategy.num_replicas_in_sync)
            # The global ids of the local replicas, as the strategy numbers them (workers
            # in cluster order, the chief first when there is one).
            ids = strategy.experimental_distribute_values_from_function(
                lambda context: context.replica_id_in_sync_group
            )
            self.first_global = min(int(i) for i in strategy.experimental_local_results(ids))
        self.num_workers = self.total // len(self.devices)
        self.worker = self.first_global // len(self.devices)

    @property
    def num_local(self) -> int:
        return len(self.devices)

    def input_context(self) -> tf.distribute.InputContext:
        """This process's input pipeline, as ``strategy.distribute_datasets_from_function``
        describes it: pipeline ``worker`` of ``num_workers``, ``total`` replicas."""
        return tf.distribute.InputContext(
            num_input_pipelines=self.num_workers,
            input_pipeline_id=self.worker,
            num_replicas_in_sync=self.total,
        )

    def owner(self, global_index: int) -> int | None:
        """The local replica of global batch ``global_index`` (b mod R), None if remote."""
        local = global_index % self.total - self.first_global
        return local if 0 <= local < len(self.devices) else None

    @contextlib.contextmanager
    def device(self, replica: int) -> Iterator[None]:
        device = self.devices[replica]
        if device is None:
            yield
        else:
            with tf.device(device):
                yield

    # -- running ------------------------------------------------------------------
    def run(self, tasks: Iterable[tuple[int, Callable[[], None]]]) -> None:
        """Run each ``(replica, task)`` on that local replica's device.

        A replica's tasks run in the order given, on one thread per replica, the
        replicas concurrently; ``tasks`` is consumed on the calling thread (which reads
        the data meanwhile), at most a few tasks ahead of each replica. The first
        exception (in the order of the tasks) is raised once every started task has
        finished; later tasks are skipped.
        """
        if len(self.devices) == 1 or not self.concurrent:
            for replica, task in tasks:
                with self.device(replica):
                    task()
            return
        stop = threading.Event()
        failures: list[tuple[int, BaseException]] = []
        lock = threading.Lock()

        def on_device(order: int, replica: int, task: Callable[[], None]) -> None:
            if stop.is_set():
                return
            try:
                with self.device(replica):
                    task()
            except BaseException as err:  # re-raised on the calling thread
                stop.set()
                with lock:
                    failures.append((order, err))

        queued: list[collections.deque] = [collections.deque() for _ in self.devices]
        with contextlib.ExitStack() as stack:
            pools = [
                stack.enter_context(
                    concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"replica{r}")
                )
                for r in range(len(self.devices))
            ]
            try:
                for order, (replica, task) in enumerate(tasks):
                    if stop.is_set():
                        break
                    waiting = queued[replica]
                    while len(waiting) >= _IN_FLIGHT:
                        waiting.popleft().result()
                    waiting.append(pools[replica].submit(on_device, order, replica, task))
            except BaseException:
                stop.set()
                raise
            # Leaving the ExitStack waits for every submitted task.
        if failures:
            raise min(failures, key=lambda item: item[0])[1]

    # -- sums over replicas and workers ---------------------------------------------
    def accumulator(self, dtype: tf.DType) -> _Accumulator:
        return _Accumulator(len(self.devices), dtype)

    def sum(
        self, accumulator: _Accumulator, shape: tuple[int, ...], *, poisoned: bool = False
    ) -> tf.Tensor:
        """Σ over all replicas of all processes (an all-reduce under a strategy).

        ``poisoned``: this process failed; it contributes NaN, so that every process
        gets a non-finite sum and knows to ask who failed (:meth:`agree`).
        """
        dtype = accumulator.dtype
        if poisoned:
            values = [tf.fill(shape, tf.constant(np.nan, dtype)) for _ in accumulator.values]
        else:
            values = [tf.zeros(shape, dtype) if v is None else v for v in accumulator.values]
        if self.strategy is None:
            return values[0]
        first = self.first_global

        def local_value(context: Any) -> tf.Tensor:
            return values[context.replica_id_in_sync_group - first]

        distributed = self.strategy.experimental_distribute_values_from_function(local_value)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, distributed, axis=None)

    def all_gather(self, row: Any) -> np.ndarray:
        """Every worker's ``row`` (a float64 vector), stacked by worker: shape (W, m).

        One all-reduce of a (W, m) table in which each worker fills its own row; exact
        for integers below 2**53.
        """
        row = np.asarray(row, dtype=np.float64).reshape(-1)
        table = np.zeros((self.num_workers, row.size))
        table[self.worker] = row
        if self.num_workers == 1:
            return table
        accumulator = self.accumulator(tf.float64)
        accumulator.add(0, tf.constant(table))
        return self.sum(accumulator, table.shape).numpy()

    def agree(self, error: BaseException | None, what: str) -> None:
        """End a pass consistently on every worker: raise ``error`` if this worker failed,
        :class:`WorkerFailed` if another did (one small all-reduce when W > 1)."""
        if self.num_workers == 1:
            if error is not None:
                raise error
            return
        flags = self.all_gather([0.0 if error is None else 1.0])[:, 0]
        if error is not None:
            raise error
        failed = [int(w) for w in np.flatnonzero(flags)]
        if failed:
            raise WorkerFailed(
                f"worker(s) {failed} of the cluster failed during {what}; the error is in "
                "their output. This worker stops too, so that none waits forever."
            )
