"""Where batches run and how their sums are combined: one device or a ``tf.distribute`` strategy.

With a strategy (``MirroredStrategy`` on the GPUs of one machine,
``MultiWorkerMirroredStrategy`` across machines), batch b of a data pass belongs to the
global replica ``b mod R`` (R = ``num_replicas_in_sync``). Each process computes the
batches of its local replicas on their devices, keeps per-replica sums, and an all-reduce
(``strategy.reduce(SUM)``) gives every process the same total. Every process therefore
runs the same estimator with the same seed on the same vectors (SPMD) and sees the same
Hessian products. The weights n_b/N are those of the whole dataset, so the result is the
exact dataset Hessian whatever the number of replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf


class _Accumulator:
    """Per-local-replica running sums of tensors."""

    def __init__(self, num_local: int) -> None:
        self.values: list[tf.Tensor | None] = [None] * num_local

    def add(self, replica: int, value: tf.Tensor) -> None:
        current = self.values[replica]
        self.values[replica] = value if current is None else current + value


class Replicas:
    """Local replica devices of a strategy (or the default device) and cross-replica sums."""

    def __init__(self, strategy: tf.distribute.Strategy | None, dtype: tf.DType) -> None:
        if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(
                f"strategy must be a tf.distribute.Strategy; got {type(strategy).__name__}."
            )
        if strategy is not None and strategy.num_replicas_in_sync == 1:
            strategy = None  # one replica: nothing to distribute
        self.strategy = strategy
        self.dtype = dtype
        if strategy is None:
            self.devices: list[str | None] = [None]
            self.first_global = 0
            self.total = 1
        else:
            self.devices = list(strategy.extended.worker_devices)
            resolver = getattr(strategy, "cluster_resolver", None)
            task_id = getattr(resolver, "task_id", None) if resolver is not None else None
            self.first_global = int(task_id or 0) * len(self.devices)
            self.total = int(strategy.num_replicas_in_sync)

    def owner(self, batch_index: int) -> int | None:
        """The local replica that computes batch ``batch_index``, or None if remote."""
        local = batch_index % self.total - self.first_global
        return local if 0 <= local < len(self.devices) else None

    @contextlib.contextmanager
    def device(self, replica: int) -> Iterator[None]:
        device = self.devices[replica]
        if device is None:
            yield
        else:
            with tf.device(device):
                yield

    def accumulator(self) -> _Accumulator:
        return _Accumulator(len(self.devices))

    def sum(self, accumulator: _Accumulator, shape: tuple[int, ...]) -> tf.Tensor:
        """Σ over all replicas of all processes (an all-reduce under a strategy)."""
        values = [tf.zeros(shape, self.dtype) if v is None else v for v in accumulator.values]
        if self.strategy is None:
            return values[0]
        first = self.first_global

        def local_value(context: Any) -> tf.Tensor:
            return values[context.replica_id_in_sync_group - first]

        distributed = self.strategy.experimental_distribute_values_from_function(local_value)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, distributed, axis=None)
