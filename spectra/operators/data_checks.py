"""Checks of a Keras model's data, run once before any graph, and TensorFlow's graph errors.

The checks of the data against the model and its loss are backend-neutral and live in
:mod:`spectra.operators.keras_data` (inputs, Embedding indices, labels, finite inputs,
:func:`check_keras_data`); they are importable from here as well. This module adds what
is TensorFlow's own: TensorFlow reports bad data from inside a compiled graph, as an
``InvalidArgumentError`` whose first line is "Graph execution error:" and whose cause
sits many lines below; :func:`graph_errors` and :func:`root_cause_first` re-raise such an
error with its root cause as the first line (and where it happened, "batch 3: ...").

Cost: one ``try`` per use; nothing here runs on the Hessian-product path.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import tensorflow as tf

from spectra.operators.keras_data import (
    check_data_fits_model,
    check_embedding_inputs,
    check_finite_inputs,
    check_input_dtypes,
    check_input_shapes,
    check_keras_data,
    check_labels,
    describe_inputs,
    label_sources,
    warn_if_not_probabilities,
)

__all__ = [
    "check_data_fits_model",
    "check_embedding_inputs",
    "check_finite_inputs",
    "check_input_dtypes",
    "check_input_shapes",
    "check_keras_data",
    "check_labels",
    "describe_inputs",
    "graph_errors",
    "label_sources",
    "root_cause",
    "root_cause_first",
    "warn_if_not_probabilities",
]

# -------------------------------------------------------------------------- graph errors

_GRAPH_ERROR = "Graph execution error:"
# Errors raised while a compiled function (an iterator's GetNext) runs start with it.
_FUNCTION_NODE = re.compile(r"^\s*\{\{function_node [^}]*\}\}\s*")
# "... passed to MapDataset:4 transformation with iterator: Iterator::Root::Map: cause"
_ITERATOR = re.compile(r" with iterator: [\w:]+:")
_NODE = re.compile(r"Detected at node '?(?P<node>[^'\s]+)'? defined at")
_ROOT_ERRORS = re.compile(r"^\(\d+\)\s+[A-Z_]+:\s*")
_NOISE = re.compile(
    r"^(\d+ root error\(s\) found\.|\d+ successful operations\.|\d+ derived errors)"
)
_HINTS = (
    (
        re.compile(r"label value of .* outside the valid range"),
        "Class labels must be indices in [0, number of outputs).",
    ),
    (
        re.compile(r"indices\[.*\] = .* is not in \["),
        "An index (e.g. an Embedding input) lies outside its table.",
    ),
    (
        re.compile(r"Cast string to"),
        "The data hold strings where the model computes with numbers.",
    ),
    (
        re.compile(r"Incompatible shapes"),
        "The labels' shape does not match the model's output under this loss.",
    ),
)
_LONGEST_CAUSE = 500


def root_cause(message: str) -> str | None:
    """The root cause of a "Graph execution error:" message, or None for other messages.

    That is the first line of the error itself, after the "Detected at node ... defined
    at" traceback and without the ``[[{{node ...}}]]`` and ``[Op:...]`` decorations,
    followed by the node's name when TensorFlow gives one.
    """
    if not message.startswith(_GRAPH_ERROR):
        return None
    node = None
    cause = None
    for line in message[len(_GRAPH_ERROR) :].splitlines():
        text = line.strip()
        match = _NODE.search(text)
        if match:
            node = node or match.group("node")
            continue
        if (
            not text
            or line.startswith("  File ")
            or line.startswith("    ")
            or text.startswith("[[")
            or text.startswith("[Op:")
            or text == "<stack traces unavailable>"
            or _NOISE.match(text)
        ):
            continue
        text = _ROOT_ERRORS.sub("", text)
        text = _ITERATOR.sub(":", text)
        text = re.sub(r"\s*\[\[\{\{node [^}]*\}\}\]\].*$", "", text)
        text = re.sub(r"\s*\[Op:[^\]]*\]\s*$", "", text).strip()
        if text:
            cause = text
            break
    if cause is None:
        return None
    if len(cause) > _LONGEST_CAUSE:
        cause = cause[: _LONGEST_CAUSE - 3] + "..."
    notes = [h for pattern, h in _HINTS if pattern.search(cause)][:1]
    if node:
        notes.append(f"(TensorFlow op {node}; the full error is chained above.)")
    return "\n".join([cause, " ".join(notes)]) if notes else cause


def _function_cause(message: str) -> str | None:
    """The root cause of an error raised while a compiled function ran outside a graph
    (``{{function_node __wrapped__IteratorGetNext...}} cause [[{{node ...}}]]``, as a
    dataset's iterator raises it), or None for other messages."""
    match = _FUNCTION_NODE.match(message)
    if match is None:
        return None
    return root_cause(f"{_GRAPH_ERROR}\n{message[match.end() :]}")


def _with_root_cause(error: tf.errors.OpError) -> tf.errors.OpError | None:
    cause = root_cause(error.message)
    if cause is None:
        return None
    try:
        return type(error)(error.node_def, error.op, cause)
    except TypeError:
        return tf.errors.OpError(error.node_def, error.op, cause, error.error_code)


@contextlib.contextmanager
def graph_errors(what: str) -> Iterator[None]:
    """Re-raise a TensorFlow error with where it happened (``what``, e.g. "batch 3") and
    its root cause on the first line ("batch 3: assertion failed: ..."); the original is
    chained, and the error keeps its class (``InvalidArgumentError``, ...)."""
    try:
        yield
    except tf.errors.OpError as err:
        cause = (
            root_cause(err.message)
            or _function_cause(err.message)
            or err.message.strip()
            or type(err).__name__
        )
        first, _, rest = cause.partition("\n")
        message = f"{what}: {first}" + (f"\n{rest}" if rest else "")
        try:
            raised = type(err)(err.node_def, err.op, message)
        except TypeError:
            raised = tf.errors.OpError(err.node_def, err.op, message, err.error_code)
        raise raised from err


@contextlib.contextmanager
def root_cause_first() -> Iterator[None]:
    """Re-raise TensorFlow graph errors with their root cause as the first line.

    A ``tf.errors.OpError`` (``InvalidArgumentError``, ``UnimplementedError``, ...) whose
    message starts with "Graph execution error:" is raised again as the same class, with
    :func:`root_cause` as its message and the original chained (``raise ... from``), so
    the traceback ends with the cause. Other errors pass unchanged. Usable as a context
    manager or a decorator; costs one ``try`` per use.
    """
    try:
        yield
    except tf.errors.OpError as error:
        clearer = _with_root_cause(error)
        if clearer is None:
            raise
        raise clearer from error
