"""Sharpness (top Hessian eigenvalues) during Keras training, as a callback.

:class:`SharpnessCallback` measures the largest eigenvalue(s) of the Hessian of the loss on a
fixed data set, and optionally its Hutchinson trace, at the start of training and every few
epochs or optimizer steps. Each measurement is :func:`spectra.analysis.trajectory.measure_sharpness`
(the one ``spectra sharpness`` makes per checkpoint) on a :class:`spectra.HessianOperator`
built at the current weights (cheap: the compiled functions are reused), with the eigensolver
started from the previous measurement's eigenvectors. With ``preconditioned=True`` it
measures the preconditioned sharpness λ_max(P⁻¹H) instead, with P the live optimizer's
preconditioner (:func:`spectra.preconditioned`).

Under full-batch gradient descent with step size η the sharpness λ₁ rises to about 2/η and
hovers there, the *edge of stability* (Cohen, Kaur, Li, Kolter & Talwalkar, ICLR 2021); under
full-batch Adam the preconditioned sharpness does so at (2 + 2β₁)/((1 − β₁)η) (Cohen et al.
2022). The threshold of the model's optimizer (:mod:`spectra.analysis.stability`) is recorded with
each measurement.

On Keras' JAX backend the operator is the JAX engine's (:mod:`spectra.operators.jax`) and
the callback needs no TensorFlow, except for TensorBoard logs (``log_dir``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np

from spectra._format import plus_minus
from spectra._validation import (
    MAX_SEED,
    check_choice,
    check_float,
    check_int,
    check_seed,
    loss_name,
)
from spectra.analysis.minibatch import minibatch_sharpness, summary_scalars
from spectra.analysis.preconditioning import preconditioned as precondition
from spectra.analysis.stability import stability_threshold_of, threshold_matrix
from spectra.analysis.trajectory import (
    SharpnessMeasurement,
    SharpnessSettings,
    explain_null,
    measure_sharpness,
)
from spectra.io.files import atomic_write_json, prepare_directory
from spectra.io.tensorboard import SharpnessEvents, sharpness_scalars
from spectra.operators import HessianOperator
from spectra.operators.losses import dtype_name

__all__ = ["SharpnessCallback"]

_UNITS = ("epoch", "step")


def _is_dataset(data: Any) -> bool:
    """A ``tf.data.Dataset`` (or anything with its ``take``/``as_numpy_iterator``)."""
    return callable(getattr(data, "take", None)) and callable(
        getattr(data, "as_numpy_iterator", None)
    )


@contextlib.contextmanager
def _global_rng_preserved() -> Iterator[None]:
    """Leave Python's and NumPy's global random states exactly as they were.

    Building a Keras model (the float64 clone the operator builds for ``dtype=np.float64``)
    draws default layer seeds from Python's ``random`` module; restoring both global states
    keeps a measurement invisible to any training code that draws from them.
    """
    python_state = random.getstate()
    numpy_state = np.random.get_state()  # noqa: NPY002 (the legacy global state is the point)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002


class SharpnessCallback(keras.callbacks.Callback):
    """Measure the top Hessian eigenvalues (the sharpness λ₁) of the loss during training.

    Measurement points, the same rule in both units: the start of each ``fit`` (step 0 and
    epoch 0 for a fresh model; skipped when that point was measured already), then every
    ``every`` epochs (``unit="epoch"``: after epochs ``every``, ``2·every``, …, Keras' epoch
    numbers, which follow ``initial_epoch``) or every ``every`` optimizer steps
    (``unit="step"``: steps ``every``, ``2·every``, … counted across epochs and ``fit`` calls
    by the optimizer's ``iterations``). At each point the callback builds the Hessian of the
    mean loss on ``data`` at the current weights (:meth:`HessianOperator.from_keras`, inference
    mode: Dropout off, BatchNorm moving statistics) and measures it with
    :func:`spectra.analysis.trajectory.measure_sharpness`: the ``top_k`` largest eigenvalues with
    :func:`spectra.eigenvalues`, started from the previous point's eigenvectors, and, with
    ``trace=True``, a Hutchinson trace of ``trace_products`` products. Under full-batch
    gradient descent with learning rate η, λ₁ rises to about 2/η and hovers there (Cohen et
    al. 2021).

    Checked in ``on_train_begin``, before any training step: the loss (given, or the
    compiled one), that the operator can be built on ``data`` (shapes, dtype), that
    ``log_file`` and ``log_dir`` can be written and, with ``preconditioned=True``, that the
    optimizer has a diagonal preconditioner.

    Results
    -------
    ``callback.history`` is a list with one dict per measurement, in order: ``step``
    (optimizer steps taken), ``epoch`` (epochs completed), ``loss`` (the loss on ``data``),
    ``eigenvalues`` (largest first), ``residual_norms``, ``error_bounds``, ``converged``,
    ``trace`` and ``trace_stderr`` (None without ``trace=True``), ``num_parameters``,
    ``num_products``, ``num_data_passes``, ``wall_time`` (seconds), ``seed``, ``warm_start``,
    ``eigenvector_overlap`` (how much the top eigenspace turned since the previous
    measurement: ⟨v_t, v_{t−1}⟩² for ``top_k=1``, the mean fraction of the new eigenvectors
    in the previous span for more; None at the first), ``gradient_overlap`` (with
    ``gradient_overlap=True``: the fraction ‖Vᵀg‖²/‖g‖² of the gradient g of the loss on
    ``data`` in the span of the top-k eigenvectors V, Gur-Ari, Roberts & Dyer 2018; else
    None), ``threshold`` (the stability threshold of the model's optimizer at that point,
    :func:`spectra.analysis.stability.stability_threshold`, or None for an optimizer without
    one) and ``threshold_matrix`` (which matrix that threshold bounds: ``"hessian"`` for SGD,
    ``"preconditioned"`` for Adam, AdamW, RMSprop and Adagrad; see
    :func:`spectra.analysis.stability.threshold_matrix`) and, with ``per_batch``, ``minibatch``
    (:meth:`spectra.analysis.minibatch.MinibatchSharpness.to_dict`: λ₁ of each of
    ``per_batch`` mini-batch Hessians, their mean, std and quantiles, the full-batch λ₁ and
    the threshold; else None). Both overlaps come from the
    eigenvectors the eigensolver computed anyway: no further product. ``callback.points`` lists the
    measurement points in the callback's unit (the ``step`` or ``epoch`` of each record).
    The history keeps growing over several ``fit`` calls.

    Keras logs: with ``unit="epoch"`` the logs of each measured epoch get ``sharpness`` (λ₁),
    ``sharpness_2`` … ``sharpness_{top_k}``, with ``trace=True`` ``hessian_trace`` and
    ``hessian_trace_stderr``, and with ``gradient_overlap=True`` ``gradient_overlap``, so
    ``fit``'s ``History`` holds one value per measurement after an epoch (the point at the
    start of training is in ``callback.history`` only). With ``preconditioned=True`` the
    names start with ``preconditioned_`` (``preconditioned_sharpness``, …), so that a raw
    and a preconditioned callback can log side by side. With ``unit="step"`` nothing goes
    into the per-epoch logs: the measurements belong to steps, and ``callback.history`` (or
    ``log_file``) holds them keyed by ``step``.

    Mini-batch sharpness: with ``per_batch=M`` each measurement also takes λ₁ of the Hessian
    of each of M mini-batch losses L_B (batches of ``per_batch_size`` examples drawn from
    ``data`` as SGD draws them, seeded ``seed + i`` at measurement i; for a
    ``tf.data.Dataset`` its first M batches), the distribution SGD's steps see beside the
    full-batch λ₁ (:mod:`spectra.analysis.minibatch`; Jastrzębski et al. 2020). For batches
    partitioning the data, their mean λ₁ is at least the full-batch λ₁ (λ_max is convex).
    Cost: about M·b/N full-batch measurements more per point.

    Preconditioned sharpness: with ``preconditioned=True`` each measurement is of the
    symmetric P^{-1/2} H P^{-1/2} (the eigenvalues of P⁻¹H), with P the diagonal
    preconditioner of the model's optimizer (Adam, AdamW: √v̂ + ε with bias correction;
    RMSprop; Adagrad) read from its state at that point (:func:`spectra.preconditioned`);
    the optimizer is only read. P exists only after the optimizer's first step, so the
    point at step 0 is not measured. Under full-batch Adam it rises to about
    (2 + 2β₁)/((1 − β₁)η) = 38/η (β₁ = 0.9) and hovers there (Cohen et al. 2022, "Adaptive
    gradient methods at the edge of stability"). The eigenvectors and the gradient of the
    overlaps are then in the coordinates u = P^{1/2}θ (the gradient P^{-1/2}∇L).

    With ``log_file`` the settings and the whole history are written as strict JSON after
    every measurement, atomically (temporary file and ``os.replace``), so an interrupted run
    keeps everything it measured.

    TensorBoard: with ``log_dir`` (the ``log_dir`` of the run's
    ``keras.callbacks.TensorBoard``, or any directory) each measurement is written as scalar
    summaries into ``<log_dir>/spectra/``, a run beside Keras' ``train/`` and
    ``validation/``, at the record's ``epoch`` (``unit="epoch"``, the x of Keras' ``epoch_*``
    scalars) or optimizer ``step`` (``unit="step"``): ``sharpness/lambda_1`` …
    ``sharpness/lambda_{top_k}``, ``sharpness/error_bound_1`` …, ``sharpness/threshold``
    (when the optimizer's threshold bounds the measured matrix), ``sharpness/loss``, and when
    measured ``sharpness/trace``, ``sharpness/trace_stderr``,
    ``sharpness/eigenvector_overlap``, ``sharpness/gradient_overlap`` (the prefix is
    ``preconditioned_sharpness/`` with ``preconditioned=True``); see
    :mod:`spectra.io.tensorboard`. The file is opened at the first measurement, flushed after
    each and closed at the end of training; the ``tensorboard`` package is needed only to
    view it.

    Training is not changed: the model runs through ``stateless_call`` (no state updates), no
    weight, optimizer variable or Keras/TensorFlow seed is touched, the estimators draw from
    NumPy Generators seeded with ``seed + i`` for measurement ``i``, and Python's and NumPy's
    global random states are restored after each measurement.

    Parameters
    ----------
    data:
        ``(x, y)`` or ``(x, y, sample_weight)`` arrays, or a ``tf.data.Dataset`` of such
        batches: the loss whose Hessian is measured is the mean over all of it.
    loss:
        A Keras loss name, ``keras.losses.Loss`` or callable ``(y_true, y_pred) -> scalar``;
        None (default) takes the loss the model was compiled with.
    every, unit:
        Measure every ``every`` epochs (``unit="epoch"``) or optimizer steps (``"step"``).
    top_k:
        Number of largest eigenvalues.
    trace, trace_products:
        Also estimate the trace by Hutchinson's method with this many products.
    batch_size, variables, dtype:
        Passed to :meth:`HessianOperator.from_keras` (``dtype=np.float64`` computes the
        products in float64 on a float64 copy of the model).
    tol, method:
        Relative eigenvalue tolerance and method of :func:`spectra.eigenvalues`.
    seed:
        Base seed (int >= 0) of the random start vectors and probes.
    warm_start:
        Start each eigensolve from the previous measurement's eigenvectors (default True):
        fewer products for the same tolerance.
    preconditioned:
        Measure λ_max(P⁻¹H) with the optimizer's preconditioner P (see above).
    gradient_overlap:
        Record the gradient's overlap with the top-k eigenspace at each measurement.
    per_batch, per_batch_size:
        Also measure λ₁ on ``per_batch`` mini-batches of ``per_batch_size`` examples (default
        0: off; 32 is Keras' default batch size of ``fit``).
    log_file:
        Path of a JSON file rewritten after each measurement.
    log_dir:
        TensorBoard log directory (created if missing) to write the measurements into, as
        the run ``spectra/``.
    verbose:
        ``>= 1`` prints one line per measurement.
    """

    def __init__(
        self,
        data: Any,
        loss: Any = None,
        *,
        every: int = 1,
        unit: str = "epoch",
        top_k: int = 1,
        trace: bool = False,
        trace_products: int = 100,
        batch_size: int | None = None,
        variables: Sequence[Any] | None = None,
        dtype: Any = None,
        tol: float = 1e-6,
        method: str = "lanczos",
        seed: int = 0,
        warm_start: bool = True,
        preconditioned: bool = False,
        gradient_overlap: bool = False,
        per_batch: int = 0,
        per_batch_size: int = 32,
        log_file: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        unit = check_choice("unit", unit, _UNITS)
        if data is None:
            raise ValueError(
                "data is required: the (x, y) arrays or tf.data.Dataset whose loss Hessian "
                "is measured."
            )
        tol = check_float("tol", tol)
        check_seed("seed", seed, below=MAX_SEED, allow_none=False, allow_generator=False)
        self.data = data
        self.loss = loss
        self.every = check_int("every", every)
        self.unit = unit
        self.top_k = check_int("top_k", top_k)
        self.trace = bool(trace)
        # A Hutchinson trace needs two probes for its standard error.
        self.trace_products = check_int(
            "trace_products", trace_products, minimum=2 if self.trace else 1
        )
        self.settings = SharpnessSettings(
            top_k=self.top_k,
            method=method,
            tol=float(tol),
            trace=self.trace,
            trace_method="hutchinson",
            trace_products=self.trace_products,
            seed=int(seed),
            warm_start=bool(warm_start),
        )
        self.batch_size = batch_size
        self.variables = None if variables is None else list(variables)
        self.dtype = dtype
        self.tol = float(tol)
        self.method = method
        self.seed = int(seed)
        self.preconditioned = bool(preconditioned)
        self.gradient_overlap = bool(gradient_overlap)
        self.per_batch = check_int("per_batch", per_batch, minimum=0)
        self.per_batch_size = check_int("per_batch_size", per_batch_size)
        if log_dir is not None and importlib.util.find_spec("tensorflow") is None:
            raise ValueError(
                "log_dir: TensorBoard event files are written with TensorFlow's tf.summary, "
                "and TensorFlow is not installed (Keras runs on "
                f"{keras.backend.backend()}). Install tensorflow (the CPU wheel is enough) "
                "for log_dir, or use log_file=..., a JSON file of the same measurements."
            )
        self._events = None if log_dir is None else SharpnessEvents(log_dir)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.log_file = None if log_file is None else os.fspath(log_file)
        self.verbose = int(verbose)
        self.history: list[dict[str, Any]] = []
        self._resolved_loss: Any = None
        self._epochs_completed = 0
        self._next_step = 0
        self._fit_started = False
        self._previous: SharpnessMeasurement | None = None

    @property
    def points(self) -> list[int]:
        """The measurement points in the callback's unit (steps or epochs), in order."""
        return [record[self.unit] for record in self.history]

    # -- Keras hooks ------------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Keras hook: check the loss, optimizer and log file and build the operator."""
        self._resolved_loss = self._resolve_loss()
        self._current_step()  # a compiled model (it has an optimizer)
        if self.preconditioned:
            self._check_preconditioner()
        self._check_log_file()
        if self._events is not None:
            self._events.prepare()
            if self.verbose >= 1:
                print(
                    f"SharpnessCallback: TensorBoard scalars go to {self._events.run_dir} "
                    f"(view with: tensorboard --logdir {self._events.log_dir})"
                )
        try:
            with _global_rng_preserved():
                self._hessian()
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"SharpnessCallback cannot measure the Hessian of this model on its data: {err}"
            ) from err
        self._fit_started = True

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Keras hook: measure at the start of a fit, unless that point is measured."""
        self._epochs_completed = int(epoch)
        if not self._fit_started:
            return
        # The start of this fit: measured unless this point was measured already.
        self._fit_started = False
        step = self._current_step()
        if not self.history or self.history[-1]["step"] != step:
            self._measure(step)
        self._next_step = (step // self.every + 1) * self.every

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Keras hook: with ``unit="step"``, measure every ``every`` optimizer steps."""
        if self.unit != "step":
            return
        step = self._current_step()
        if step >= self._next_step:
            self._measure(step)
            self._next_step = (step // self.every + 1) * self.every

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Keras hook: with ``unit="epoch"``, measure every ``every`` epochs."""
        self._epochs_completed = int(epoch) + 1
        if self.unit != "epoch" or self._epochs_completed % self.every != 0:
            return
        step = self._current_step()
        record: dict[str, Any] | None
        if self.history and self.history[-1]["step"] == step:
            record = self.history[-1]
            record["epoch"] = self._epochs_completed
        else:
            record = self._measure(step)
        if logs is not None and record is not None:
            logs.update(self._log_entries(record))

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Keras hook: close the TensorBoard event file (a later fit opens another)."""
        if self._events is not None:
            self._events.close()

    # -- measurement ------------------------------------------------------------------
    def _resolve_loss(self) -> Any:
        if self.loss is not None:
            return self.loss
        compiled = getattr(self.model, "loss", None)
        if compiled is None:
            raise ValueError(
                "SharpnessCallback needs a loss: pass loss=... (a Keras loss name, a "
                "keras.losses.Loss or a callable (y_true, y_pred) -> scalar), or compile the "
                "model with a loss."
            )
        if isinstance(compiled, (list, tuple, dict)):
            raise ValueError(
                "the model was compiled with several losses (one per output); pass the "
                "single loss to measure with loss=..."
            )
        return compiled

    def _check_log_file(self) -> None:
        if self.log_file is None:
            return
        path = Path(self.log_file)
        if path.is_dir():
            raise ValueError(f"log_file '{path}' is a directory; give a file path.")
        prepare_directory(path.parent, "the directory of log_file")

    def _current_step(self) -> int:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError("SharpnessCallback needs a compiled model (it has no optimizer).")
        return int(optimizer.iterations.numpy())

    def _check_preconditioner(self) -> None:
        """An optimizer with a diagonal preconditioner, before the first training step."""
        optimizer = self.model.optimizer
        try:
            matrix = threshold_matrix(optimizer)
        except ValueError:
            matrix = None
        if matrix != "preconditioned":
            name = type(getattr(optimizer, "inner_optimizer", optimizer)).__name__
            raise ValueError(
                f"preconditioned=True needs an optimizer with a diagonal preconditioner "
                f"(Adam, AdamW, RMSprop, Adagrad); the model's optimizer is {name}"
                + (", whose P = I: use preconditioned=False." if matrix == "hessian" else ".")
            )

    def _hessian(self) -> HessianOperator:
        return HessianOperator.from_keras(
            self.model,
            self._resolved_loss,
            self.data,
            variables=self.variables,
            batch_size=self.batch_size,
            dtype=self.dtype,
        )

    def _operator(self) -> Any:
        """The measured matrix at the current weights (and optimizer state)."""
        hessian = self._hessian()
        if not self.preconditioned:
            return hessian
        return precondition(hessian, self.model.optimizer)

    def _threshold(self) -> tuple[float | None, str | None]:
        optimizer = self.model.optimizer
        try:
            return stability_threshold_of(optimizer).value, threshold_matrix(optimizer)
        except (ValueError, TypeError, AttributeError):
            return None, None

    def _measure(self, step: int) -> dict[str, Any] | None:
        """Measure at the current weights and record it (None: a preconditioned point
        before the optimizer's first step, not measured)."""
        if self.preconditioned and step < 1:
            return None
        index = len(self.history)
        vectors = None if self._previous is None else self._previous.eigenvectors
        with _global_rng_preserved():
            measurement = measure_sharpness(
                self._operator(),
                self.settings,
                seed=self.seed + index,
                v0=vectors,
                previous=vectors,
                gradient_overlap=self.gradient_overlap,
                progress=False,
            )
        self._previous = measurement
        threshold, matrix = self._threshold()
        record: dict[str, Any] = {
            "step": int(step),
            "epoch": self._epochs_completed,
            **measurement.record(),
            "threshold": threshold,
            "threshold_matrix": matrix,
        }
        if self.per_batch:
            measured = "preconditioned" if self.preconditioned else "hessian"
            record["minibatch"] = self._minibatch(
                index,
                full_batch=measurement.eigenvalues[0],
                threshold=threshold if matrix == measured else None,
            )
        self.history.append(record)
        if not all(record["converged"]):
            warnings.warn(
                f"SharpnessCallback: at step {step} the eigenvalues did not all converge to "
                f"tol={self.tol:g} (error bounds {record['error_bounds']}).",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.log_file is not None:
            atomic_write_json(
                self.log_file,
                {"settings": self._settings(), "history": self.history},
                explain_null,
            )
        if self._events is not None:
            scalars = sharpness_scalars(record, preconditioned=self.preconditioned)
            if record["minibatch"] is not None:
                prefix = "preconditioned_sharpness" if self.preconditioned else "sharpness"
                scalars.update(summary_scalars(record["minibatch"]["summary"], prefix))
            self._events.write(record[self.unit], scalars)
        if self.verbose >= 1:
            print(self._summary_line(record))
        return record

    def _minibatch(self, index: int, full_batch: float, threshold: float | None) -> dict[str, Any]:
        """λ₁ on ``per_batch`` mini-batches at the current weights (measurement ``index``)."""

        def build(batch: Any) -> Any:
            hessian = HessianOperator.from_keras(
                self.model, self._resolved_loss, batch, variables=self.variables, dtype=self.dtype
            )
            return precondition(hessian, self.model.optimizer) if self.preconditioned else hessian

        seed = self.seed + index
        common: dict[str, Any] = {
            "tol": self.tol,
            "method": self.method,
            "seed": seed,
            "build": build,
            "progress": False,
        }
        with _global_rng_preserved():
            if _is_dataset(self.data):
                batches = list(self.data.take(self.per_batch).as_numpy_iterator())
                result = minibatch_sharpness(self.model, batches=batches, **common)
            else:
                result = minibatch_sharpness(
                    self.model,
                    self.data,
                    batch_size=self.per_batch_size,
                    num_batches=self.per_batch,
                    **common,
                )
        result.full_batch = float(full_batch)
        result.threshold = threshold
        return result.to_dict()

    def _log_entries(self, record: dict[str, Any]) -> dict[str, float]:
        values = record["eigenvalues"]
        entries = {"sharpness": values[0]}
        entries.update({f"sharpness_{i}": value for i, value in enumerate(values[1:], start=2)})
        if record["trace"] is not None:
            entries["hessian_trace"] = record["trace"]
            entries["hessian_trace_stderr"] = record["trace_stderr"]
        if record["gradient_overlap"] is not None:
            entries["gradient_overlap"] = record["gradient_overlap"]
        if self.preconditioned:
            return {f"preconditioned_{name}": value for name, value in entries.items()}
        return entries

    def _settings(self) -> dict[str, Any]:
        loss = self._resolved_loss if self._resolved_loss is not None else self.loss
        return {
            "unit": self.unit,
            "every": self.every,
            "loss": None if loss is None else loss_name(loss),
            "batch_size": self.batch_size,
            "dtype": None if self.dtype is None else dtype_name(self.dtype),
            **self.settings.numbers(),
            "warm_start": self.settings.warm_start,
            "preconditioned": self.preconditioned,
            "gradient_overlap": self.gradient_overlap,
            "per_batch": self.per_batch,
            "per_batch_size": self.per_batch_size if self.per_batch else None,
        }

    def _summary_line(self, record: dict[str, Any]) -> str:
        values = record["eigenvalues"]
        symbol = "λ₁(P⁻¹H)" if self.preconditioned else "λ₁"
        line = (
            f"SharpnessCallback step {record['step']} (epoch {record['epoch']}): "
            f"{symbol} = {values[0]:.5g}"
        )
        if len(values) > 1:
            line += " (top " + ", ".join(f"{v:.4g}" for v in values) + ")"
        measured = "preconditioned" if self.preconditioned else "hessian"
        if record["threshold"] is not None and record["threshold_matrix"] == measured:
            line += f" = {values[0] / record['threshold']:.3f} × threshold"
        if record["gradient_overlap"] is not None:
            line += f", gradient overlap {record['gradient_overlap']:.3f}"
        if record["trace"] is not None:
            line += f", trace = {plus_minus(record['trace'], record['trace_stderr'])}"
        if record["minibatch"] is not None:
            summary = record["minibatch"]["summary"]
            line += (
                f", mini-batch λ₁ median {summary['q50']:.4g} "
                f"(5–95 % {summary['q05']:.4g}–{summary['q95']:.4g})"
            )
        if not all(record["converged"]):
            line += ", not converged"
        return line + f" [{record['num_products']} products, {record['wall_time']:.2f} s]"
