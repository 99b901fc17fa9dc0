"""Checks of a Keras model's data against the model and its loss, before anything runs.

Backend-neutral (Keras and NumPy only): both engines run these checks on the data of
``from_keras`` before a function is traced or compiled, so that bad data gets one line
that names the argument or the input, the offending value and the fix, not an error from
inside a compiled computation (or nothing at all: Keras truncates float class labels such
as 0.5 to 0 without a word):

* inputs (:func:`check_input_dtypes`, :func:`check_input_shapes`): strings (or other
  non-numeric leaves) fed to a numeric model input, named by their path in ``x``
  (``x['tokens']``), and examples whose shape does not fit the model's ``Input``;
* Embedding indices (:func:`check_embedding_inputs`): integer inputs that feed an
  ``Embedding`` layer straight from an ``Input`` must lie in ``[0, input_dim)``;
* labels (:func:`check_labels`): integer, non-negative class indices below the number of
  classes for sparse categorical losses; ``y`` shaped like the output for the other
  Keras losses;
* finite inputs (:func:`check_finite_inputs`), and :func:`describe_inputs`, which says
  where to look when a batch's loss is not finite although the weights are;
* :func:`check_keras_data` runs all of these for ``from_keras``-style data, per output
  for multi-output models, on the engine's batches (anything with ``element_spec``,
  ``dataset`` and ``check_values``, as :class:`spectra.operators.batching.Batches` and
  :class:`spectra.operators.jax.data.Batches` have);
* :func:`warn_if_not_probabilities`, :func:`check_data_fits_model` and
  :func:`label_sources` for the command line's data files.

Leaves may be arrays or tensors of any engine, or specs without values (a
``tf.TensorSpec``, a ``jax.ShapeDtypeStruct``): dtypes are read by name
(:func:`spectra.operators.losses.dtype_name`), shapes as lists of dimensions.

Cost: dtype and shape checks read only the specs; value checks (labels, Embedding
indices, finiteness of ``y`` and sample weights) read the labels and the Embedding inputs
once, a few vectorized NumPy reductions — for array data at once, for a dataset batch by
batch during the counting pass the engine makes anyway, so no extra pass. Nothing here
runs on the product path.

The model's structure (its nested inputs and outputs, which layer an ``Input`` feeds) is
read with :func:`spectra._keras_compat.functional_structure` and
:func:`~spectra._keras_compat.layer_input_tensors`. A subclassed model declares no
structure: the checks that need it are skipped, and outputs are inferred with
``compute_output_spec``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np

from spectra import _keras_compat
from spectra.operators.losses import dtype_name, positional_labels_error
from spectra.operators.losses import output_entries as _output_entries

__all__ = [
    "check_data_fits_model",
    "check_embedding_inputs",
    "check_finite_inputs",
    "check_input_dtypes",
    "check_input_shapes",
    "check_keras_data",
    "check_labels",
    "describe_inputs",
    "label_sources",
    "warn_if_not_probabilities",
]

# -------------------------------------------------------------------------- nested paths


def _path_name(root: str, path: Sequence[Any]) -> str:
    """``x['tokens']``, ``y[1]``: how a user spells a leaf of a nested structure."""
    return root + "".join(f"[{key!r}]" for key in path)


def _leaves_with_paths(structure: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(structure, dict):
        for key in sorted(structure, key=str):
            yield from _leaves_with_paths(structure[key], (*path, key))
    elif isinstance(structure, (list, tuple)):
        for index, item in enumerate(structure):
            yield from _leaves_with_paths(item, (*path, index))
    else:
        yield path, structure


def _unpack(batch: Any) -> tuple[Any, Any, Any] | None:
    """``(x, y, sample_weight)`` of a Keras batch, None when it is not one."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)
    return None


class _DType(NamedTuple):
    """A dtype of any engine, by name (``"float32"``, ``"int64"``, ``"string"``)."""

    name: str

    @property
    def is_floating(self) -> bool:
        return self.name.startswith(("float", "bfloat"))

    @property
    def is_integer(self) -> bool:
        return self.name.startswith(("int", "uint"))

    @property
    def is_bool(self) -> bool:
        return self.name == "bool"

    @property
    def is_complex(self) -> bool:
        return self.name.startswith("complex")


_STRING = _DType("string")


def _dtype(leaf: Any) -> _DType:
    return _DType(dtype_name(leaf.dtype))


def _is_numeric(dtype: _DType) -> bool:
    return (dtype.is_floating or dtype.is_integer or dtype.is_bool) and not dtype.is_complex


def _is_spec(leaf: Any) -> bool:
    """A leaf without values (a ``tf.TensorSpec``, a ``jax.ShapeDtypeStruct``)."""
    return not (hasattr(leaf, "numpy") or hasattr(leaf, "__array__"))


def _shape_list(shaped: Any) -> list[int | None] | None:
    """The dimensions of a shape (or of a tensor, array or spec), None for an unknown rank."""
    shape = getattr(shaped, "shape", shaped)
    if shape is None or getattr(shape, "rank", 0) is None:
        return None
    try:
        return [None if d is None else int(d) for d in shape]
    except (TypeError, ValueError):
        return None


def _per_example_shape(leaf: Any) -> tuple[int | None, ...]:
    shape = _shape_list(leaf)
    if shape is None:
        return ()
    return tuple(shape[1:])


def _values(leaf: Any) -> np.ndarray:
    return np.asarray(leaf.numpy() if hasattr(leaf, "numpy") else leaf)


def _first_bad(name: str, values: np.ndarray, bad: np.ndarray) -> tuple[str, Any]:
    """``("y[3]", value)``: the first entry of ``values`` where ``bad`` holds."""
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"{name}[{', '.join(map(str, index))}]", values[index]


def _show(value: Any) -> str:
    """A numpy scalar as the user typed it (5, 0.5), not as np.int64(5)."""
    if isinstance(value, np.floating):
        return str(value)  # numpy's shortest form: 3e+38 for a float32, not 3.0000000054977558e+38
    return repr(value.item() if hasattr(value, "item") else value)


def _at(where: str | None) -> str:
    return f" in {where}" if where else ""


# -------------------------------------------------------------------------- model structure


def _model_inputs(model: keras.Model) -> list[tuple[tuple, Any]]:
    """``(path in x, KerasTensor)`` for each declared input (empty for subclassed models)."""
    structure = _keras_compat.functional_structure(model)
    if structure is None:
        return []
    return list(_leaves_with_paths(structure[0]))


def _leaf_at(x: Any, path: tuple, tensor: Any, single: bool) -> tuple[Any, tuple] | None:
    """The leaf of ``x`` feeding a model input, and its path in ``x`` (None if not found).

    Follows Keras: a single-input model takes ``x`` itself (or its only element); dict
    data are matched by key, or by the input's name.
    """
    leaves = list(_leaves_with_paths(x))
    if single and len(leaves) == 1:
        return leaves[0][1], leaves[0][0]
    node, walked = x, []
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
            break
        walked.append(key)
    if node is not None and not isinstance(node, (dict, list, tuple)):
        return node, tuple(walked)
    name = getattr(tensor, "name", None)
    if isinstance(x, dict) and name in x:
        return x[name], (name,)
    return None


def _keras_tensor(spec: Any) -> keras.KerasTensor:
    return keras.KerasTensor(tuple(_shape_list(spec) or ()), dtype=dtype_name(spec.dtype))


def _model_outputs(model: keras.Model, x_spec: Any) -> Any:
    """The nested output structure (KerasTensors) of ``model``, or None if unknown."""
    structure = _keras_compat.functional_structure(model)
    if structure is not None:
        return structure[1]
    try:
        return model.compute_output_spec(keras.tree.map_structure(_keras_tensor, x_spec))
    except (ValueError, TypeError, NotImplementedError, AttributeError):
        return None


def _output_names(model: keras.Model, outputs: Any) -> list[str] | None:
    names = getattr(model, "output_names", None)
    if isinstance(outputs, (list, tuple)) and names and len(names) == len(outputs):
        return list(names)
    return None


# -------------------------------------------------------------------------- inputs


def check_input_dtypes(model: keras.Model, x: Any) -> None:
    """Refuse non-numeric leaves of ``x`` (strings, complex numbers) fed to numeric inputs.

    ``x`` is the input part of the data: arrays, tensors or ``tf.TensorSpec`` leaves (a
    dataset's ``element_spec``), possibly nested. Checked against the model's declared
    ``Input`` dtypes: a string leaf is fine for an ``Input(dtype="string")`` (text
    preprocessing inside the model). Models that declare no inputs (subclassed models)
    are not checked. Raises ``TypeError`` naming the leaf (``x['tokens']``).
    """
    inputs = _model_inputs(model)
    for path, tensor in inputs:
        found = _leaf_at(x, path, tensor, single=len(inputs) == 1)
        if found is None:
            continue
        leaf, where = found
        got, expected = _dtype(leaf), _DType(dtype_name(tensor.dtype))
        if _is_numeric(got) or not _is_numeric(expected):
            continue
        what = "strings" if got == _STRING else f"values of dtype {got.name}"
        fix = (
            " Turn text into numbers first (keras.layers.StringLookup or TextVectorization), "
            "or give the model an Input(dtype='string') that does it."
            if got == _STRING
            else ""
        )
        input_name = getattr(tensor, "name", "") or ""
        named = "" if input_name.startswith("keras_tensor") else f" {input_name!r}"
        raise TypeError(
            f"{_path_name('x', where)} holds {what}, but the model's input{named} expects "
            f"{expected.name} numbers.{fix}"
        )


def check_input_shapes(model: keras.Model, x: Any) -> None:
    """Refuse leaves of ``x`` whose per-example shape does not fit the model's ``Input``.

    ``x`` as in :func:`check_input_dtypes`. A leaf of the input's rank with a different
    known dimension (e.g. 5 features for an ``Input((4,))``) raises a ``ValueError``
    naming the leaf and both shapes, before Keras' multi-line error from inside the
    model's call. Other ranks are left to Keras (it expands some).
    """
    inputs = _model_inputs(model)
    for path, tensor in inputs:
        found = _leaf_at(x, path, tensor, single=len(inputs) == 1)
        if found is None or getattr(found[0], "shape", None) is None:
            continue
        leaf, where = found
        got = _per_example_shape(leaf)
        expected = tuple(tensor.shape[1:]) if tensor.shape is not None else ()
        if len(got) != len(expected):
            continue
        if any(g is not None and e is not None and g != e for g, e in zip(got, expected)):
            input_name = getattr(tensor, "name", "") or ""
            named = "" if input_name.startswith("keras_tensor") else f" {input_name!r}"
            raise ValueError(
                f"{_path_name('x', where)} has examples of shape {got} but the model's "
                f"input{named} expects {expected} (the shape of one example, batch "
                "dimension left out). Pass data with the model's number of features, or "
                "the model the data were made for."
            )


def _embedding_inputs(model: keras.Model) -> list[tuple[tuple, Any, keras.layers.Embedding]]:
    """``(input path, input KerasTensor, Embedding layer)`` for Embeddings fed by an Input."""
    inputs = _model_inputs(model)
    by_id = {id(tensor): (path, tensor) for path, tensor in inputs}
    found = []
    structure = _keras_compat.functional_structure(model)
    layers = structure[2] if structure is not None else []
    for layer in layers:
        if not isinstance(layer, keras.layers.Embedding):
            continue
        for tensor in _keras_compat.layer_input_tensors(layer):
            if id(tensor) in by_id:
                path, source = by_id[id(tensor)]
                found.append((path, source, layer))
    return found


def check_embedding_inputs(model: keras.Model, x: Any, *, where: str | None = None) -> None:
    """Refuse indices outside the vocabulary of an ``Embedding`` fed straight by an Input.

    ``x`` holds values (arrays or tensors; ``tf.TensorSpec`` leaves are skipped). For
    each ``Embedding(input_dim, ...)`` whose input is one of the model's ``Input``
    tensors, every index must be an integer in ``[0, input_dim)`` (float inputs must be
    integral, as Keras casts them to int). Embeddings behind other layers (lookups,
    nested models) are not checked. ``where`` (e.g. "batch 3 of the dataset") is added to
    the message. Cost: a min and a max over those inputs. Raises ``ValueError`` naming
    the layer, the input, the offending value and its position.
    """
    inputs = _model_inputs(model)
    for path, tensor, layer in _embedding_inputs(model):
        found = _leaf_at(x, path, tensor, single=len(inputs) == 1)
        if found is None or _is_spec(found[0]) or not _is_numeric(_dtype(found[0])):
            continue
        leaf, leaf_path = found
        values = _values(leaf)
        if values.size == 0:
            continue
        name = _path_name("x", leaf_path)
        if values.dtype.kind == "f":
            bad = ~np.isfinite(values) | (values != np.round(values))
            if bad.any():
                entry, value = _first_bad(name, values, bad)
                raise ValueError(
                    f"{name} feeds Embedding layer {layer.name!r}, which needs integer "
                    f"indices, but {entry} = {_show(value)}{_at(where)}. Pass integer token ids."
                )
        low, high = values.min(), values.max()
        if low < 0 or high >= layer.input_dim:
            entry, value = _first_bad(name, values, (values < 0) | (values >= layer.input_dim))
            raise ValueError(
                f"{name} feeds Embedding layer {layer.name!r} with input_dim="
                f"{layer.input_dim}, so its indices must lie in [0, {layer.input_dim}), but "
                f"{entry} = {_show(value)}{_at(where)} (range of {name}: [{_show(low)}, "
                f"{_show(high)}]). Map tokens outside the vocabulary to a reserved index, or "
                "build the Embedding with a larger input_dim."
            )


# -------------------------------------------------------------------------- labels


def keras_loss_function(loss: Any) -> tuple[Any, dict[str, Any], str] | None:
    """``(Keras per-example function, its keyword arguments, display name)`` of a Keras
    loss, or None for losses these checks do not know (custom callables, classes)."""
    if isinstance(loss, str):
        try:
            resolved = keras.losses.get(loss)
        except (ValueError, TypeError):
            return None
        found = keras_loss_function(resolved)
        return None if found is None else (found[0], found[1], loss)
    fn = getattr(loss, "fn", None)
    if isinstance(loss, keras.losses.Loss) and callable(fn):
        return fn, _keras_compat.loss_function_kwargs(loss), fn.__name__
    if callable(loss) and (getattr(loss, "__module__", "") or "").startswith("keras"):
        return loss, {}, getattr(loss, "__name__", "loss")
    return None


def _keras_losses(*names: str) -> frozenset[Any]:
    return frozenset(f for f in (getattr(keras.losses, n, None) for n in names) if f is not None)


_SPARSE_LOSSES = _keras_losses("sparse_categorical_crossentropy")
# Losses that compare y with the output entry by entry (or class vector by class vector).
_DENSE_LOSSES = _keras_losses(
    "categorical_crossentropy", "categorical_focal_crossentropy", "categorical_hinge",
    "kl_divergence", "mean_squared_error", "mean_absolute_error", "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error", "huber", "log_cosh", "binary_crossentropy",
    "binary_focal_crossentropy", "hinge", "squared_hinge", "poisson", "cosine_similarity",
)  # fmt: skip


# Losses of a probability y in [0, 1] against the output (a subset of _DENSE_LOSSES).
_BINARY_LOSSES = _keras_losses("binary_crossentropy", "binary_focal_crossentropy")
# Losses of probabilities unless from_logits=True: over classes (rows summing to 1), or
# per entry (binary).
_CATEGORICAL_PROBABILITY_LOSSES = _keras_losses(
    "sparse_categorical_crossentropy", "categorical_crossentropy", "categorical_focal_crossentropy"
)
# How far a row of probabilities may sum from 1 (float16 softmax rounding is ~1e-3).
_SUM_TOLERANCE = 1e-2
# Examples of the first batch the model is run on to look at its outputs.
_PROBABILITY_EXAMPLES = 64


def _compatible(a: Sequence[int | None], b: Sequence[int | None]) -> bool:
    return len(a) == len(b) and all(p is None or q is None or p == q for p, q in zip(a, b))


def _same_rank_as_keras(
    y: tuple[int | None, ...], out: tuple[int | None, ...]
) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Keras' only reshaping of ``y`` against the output: ranks that differ by one lose the
    trailing 1 of the longer shape, (n,) vs (n, 1) (``squeeze_or_expand_to_same_rank``)."""
    if len(y) == len(out) + 1 and y and y[-1] == 1:
        return y[:-1], out
    if len(out) == len(y) + 1 and out and out[-1] == 1:
        return y, out[:-1]
    return y, out


def check_labels(
    loss: Any,
    y: Any,
    output: Any,
    *,
    name: str = "y",
    where: str | None = None,
) -> None:
    """Check labels ``y`` against the model output they are compared with under ``loss``.

    ``loss``: a Keras loss name, ``keras.losses.Loss`` or Keras loss function (anything
    else, e.g. a custom callable, is not checked). ``y``: an array/tensor (dtype, shape and
    values checked) or a ``tf.TensorSpec`` (dtype and shape only). ``output``: the
    output's shape including the batch dimension (a tuple, ``TensorShape``,
    ``TensorSpec`` or ``KerasTensor``).

    * Sparse categorical cross-entropy: ``y`` holds one class index per prediction,
      shape = output shape without its class axis (a trailing 1 allowed). Indices must be
      integers (integer dtype, or floats with integral values, which Keras casts
      exactly; 0.5 is refused rather than truncated to 0), non-negative and below the
      number of classes C (the output's last dimension), the loss's ``ignore_class``
      excepted.
    * Other Keras losses (categorical/binary cross-entropy, MSE, MAE, hinge, ...): ``y``
      has the output's shape, up to the one reshaping Keras does itself, a trailing 1 on
      one side ((n,) vs (n, 1)). Broadcasting that Keras would also accept silently, e.g.
      y of shape (n, 1) against (n, 3), is refused: it almost always means class
      indices given to a per-output loss. Values must be finite.

    Raises ``TypeError`` (non-numeric ``y``) or ``ValueError`` naming the loss, ``name``
    and the fix (e.g. ``sparse_categorical_crossentropy`` for integer labels given to
    ``mse`` against a multi-class output).
    """
    resolved = keras_loss_function(loss)
    if resolved is None:
        return
    fn, kwargs, loss_name = resolved
    if fn not in _SPARSE_LOSSES and fn not in _DENSE_LOSSES:
        return
    dtype = _dtype(y)
    if not _is_numeric(dtype):
        raise TypeError(
            f"{name} has dtype {dtype.name}, but the loss {loss_name} needs numbers"
            f"{_at(where)}. Encode the labels as integers (class indices) or floats."
        )
    out = tuple(_shape_list(output) or ())
    out_shape, y_shape = out[1:], _per_example_shape(y)
    shown = tuple(_shape_list(y) or ())
    described = f"{name} has shape {shown} and the model's output {out}"
    if fn in _SPARSE_LOSSES:
        _check_sparse_labels(loss_name, kwargs, y, y_shape, out_shape, name, described, where)
        return
    y_cmp, out_cmp = _same_rank_as_keras(y_shape, out_shape)
    if not _compatible(y_cmp, out_cmp):
        classes = out_shape[-1] if out_shape else None
        looks_sparse = y_shape in ((), (1,)) and classes is not None and classes > 1
        if looks_sparse and (dtype.is_integer or dtype.is_bool):
            hint = (
                f" {name} holds integer class labels, but {loss_name} compares {name} with "
                f"the {classes} outputs entry by entry. For classification use "
                "loss='sparse_categorical_crossentropy' (from_logits=True if the model "
                "outputs logits), or one-hot encode the labels "
                "(keras.utils.to_categorical) for a per-class loss."
            )
        elif looks_sparse:
            hint = f" If {name} holds class indices, use loss='sparse_categorical_crossentropy'."
        else:
            hint = f" Reshape {name} to the output's shape."
        raise ValueError(
            f"the loss {loss_name} needs {name} shaped like the model's output, but "
            f"{described}{_at(where)}.{hint}"
        )
    if not _is_spec(y) and dtype.is_floating:
        values = _values(y)
        bad = ~np.isfinite(values)
        if bad.any():
            entry, _ = _first_bad(name, values, bad)
            raise ValueError(
                f"{name} holds {int(bad.sum())} NaN or infinite values{_at(where)}, first at "
                f"{entry}; the loss would be NaN. Remove or repair those examples."
            )
    if fn in _BINARY_LOSSES and not _is_spec(y):
        values = _values(y)
        bad = (values < 0) | (values > 1)
        if bad.any():
            entry, value = _first_bad(name, values, bad)
            raise ValueError(
                f"the loss {loss_name} needs labels in [0, 1] (probabilities of the positive "
                f"class), but {entry} = {_show(value)}{_at(where)} ({int(bad.sum())} of "
                f"{values.size} labels outside). For more than two classes use "
                "loss='sparse_categorical_crossentropy' with one output per class."
            )


def _check_sparse_labels(
    loss_name: str,
    kwargs: dict[str, Any],
    y: Any,
    y_shape: tuple[int | None, ...],
    out_shape: tuple[int | None, ...],
    name: str,
    described: str,
    where: str | None,
) -> None:
    if not out_shape:
        raise ValueError(
            f"the loss {loss_name} needs class scores along the output's last axis, but "
            f"{described}{_at(where)}. Give the model one output per class."
        )
    classes, expected = out_shape[-1], out_shape[:-1]
    if not (_compatible(y_shape, expected) or _compatible(y_shape, (*expected, 1))):
        hint = (
            " It looks one-hot encoded: use loss='categorical_crossentropy', or pass the "
            "class indices (y.argmax(-1))."
            if _compatible(y_shape, out_shape)
            else ""
        )
        raise ValueError(
            f"the loss {loss_name} needs one class index per prediction ({name} of shape "
            f"{(None, *expected)} or {(None, *expected, 1)}), but {described}{_at(where)}.{hint}"
        )
    if _is_spec(y):
        return
    values = _values(y)
    if values.size == 0:
        return
    ignored = kwargs.get("ignore_class")
    counted = values != ignored if ignored is not None else np.ones(values.shape, bool)
    if values.dtype.kind == "f":
        bad = counted & (~np.isfinite(values) | (values != np.round(values)))
        if bad.any():
            entry, value = _first_bad(name, values, bad)
            raise ValueError(
                f"the loss {loss_name} needs integer class indices, but {entry} = "
                f"{_show(value)}{_at(where)} ({int(bad.sum())} of {values.size} labels are not "
                "integers; Keras would truncate them silently). Pass integer class indices, "
                "or use loss='categorical_crossentropy' with soft (probability) labels of the "
                "output's shape."
            )
    if classes is None:
        return
    bad = counted & ((values < 0) | (values >= classes))
    if bad.any():
        entry, value = _first_bad(name, values, bad)
        problem = "negative" if value < 0 else f"not below the number of classes, {classes}"
        raise ValueError(
            f"the loss {loss_name} needs class indices in [0, {classes}) for a model with "
            f"{classes} outputs, but {entry} = {int(value)}{_at(where)} is {problem} "
            f"({int(bad.sum())} of {values.size} labels out of range). Renumber the classes "
            "0 .. C-1, or give the model one output per class."
        )


def _per_output(
    model: keras.Model, loss: Any, y: Any, outputs: Any
) -> list[tuple[Any, Any, Any, str]]:
    """``(loss, y, output, name)`` for each output with a loss and labels to check."""
    leaves = list(_leaves_with_paths(outputs))
    if len(leaves) == 1:
        single = loss
        if isinstance(loss, dict) and len(loss) == 1:
            single = next(iter(loss.values()))
        elif isinstance(loss, (list, tuple)) and len(loss) == 1:
            single = loss[0]
        label = y
        if isinstance(y, dict) and len(y) == 1:
            label = next(iter(y.values()))
        elif isinstance(y, (list, tuple)) and len(y) == 1:
            label = y[0]
        if isinstance(label, (dict, list, tuple)):
            return []
        return [(single, label, leaves[0][1], "y")]
    names = _output_names(model, outputs)
    if isinstance(outputs, dict) and isinstance(y, (list, tuple)):
        raise positional_labels_error([str(path[0]) for path, _ in leaves])
    result = []
    for position, (path, output) in enumerate(leaves):
        key = path[0] if isinstance(outputs, dict) else position
        output_name: str | None
        if isinstance(outputs, dict):
            output_name = str(key)
        else:
            output_name = names[position] if names else None
        if isinstance(loss, dict):
            output_loss = loss.get(output_name, loss.get(key))
        elif isinstance(loss, (list, tuple)):
            output_loss = loss[position] if position < len(loss) else None
        else:
            output_loss = loss
        if output_loss is None or keras_loss_function(output_loss) is None:
            continue
        if isinstance(y, dict):
            chosen = output_name if output_name in y else key
            if chosen not in y:
                continue
            label, label_name = y[chosen], _path_name("y", (chosen,))
        elif isinstance(y, (list, tuple)):
            if position >= len(y):
                continue
            label, label_name = y[position], _path_name("y", (position,))
        else:
            raise ValueError(
                f"the model has {len(leaves)} outputs but y is a single array; give one "
                "label array per output, as a dict keyed by output name or a list."
            )
        result.append((output_loss, label, output, label_name))
    return result


def check_data_fits_model(model: keras.Model, x: Any, y: Any, loss: Any = None) -> None:
    """Check cheaply that arrays ``x`` fit the model's input and ``y`` its output under
    ``loss``, before a model or data set is used for anything longer.

    ``x`` and ``y`` need as many examples; a single-input model's declared input shape must
    fit ``x`` (per example); the model must run on the first 2 examples; and the labels are
    checked against that output by :func:`check_labels` (class indices in ``[0, C)`` for
    sparse categorical losses, ``y`` shaped like the output for the others, ``[0, 1]`` for
    binary cross-entropy). ``loss``: as for :func:`check_labels`; None (or a loss it does
    not know) checks no labels. For a model with several outputs ``y`` is a dict by output
    name or a list in output order, matched to the outputs one to one, and ``loss`` a
    single loss for all or a dict/list of them (an output without one is not checked).
    Cost: the model on 2 examples and a few reductions over ``y``. Raises ``ValueError``
    naming the model's expected shape and the data's, the labels' problem, or the model's
    outputs when the label arrays do not match them.
    """
    x = np.asarray(x)
    labels = _label_leaves(y)
    for name, array in labels:
        if len(x) != len(array):
            raise ValueError(f"x has {len(x)} examples but {name} has {len(array)}.")
    expected = _single_input_shape(model)
    if expected is not None and not _compatible(expected, (None, *x.shape[1:])):
        raise ValueError(
            f"The data do not fit the model's input: the model expects inputs of shape "
            f"{expected}, the data x has shape {x.shape} (per example {x.shape[1:]})."
        )
    try:
        output = model(x[:2], training=False)
    except Exception as err:  # anything the model's call raises is the data not fitting it
        raise ValueError(
            f"The model failed on 2 examples of the data: x has shape {x.shape}, the model "
            f"expects {expected if expected is not None else 'an unknown input shape'}. "
            f"{type(err).__name__}: {err}"
        ) from err
    outputs = _named_outputs(model, output)
    if len(outputs) == 1 and not isinstance(y, (dict, list, tuple)):
        if loss is not None:
            check_labels(loss, np.asarray(y), (None, *outputs[0][1].shape[1:]))
        return
    pairs = _labels_per_output(outputs, y, by_name_only=isinstance(output, dict))
    for position, (name, label, out) in enumerate(pairs):
        label_name = f"y_{name}" if isinstance(y, dict) else f"y{position}"
        output_loss = _loss_of_output(loss, name, position)
        if output_loss is None:
            continue
        try:
            check_labels(output_loss, label, (None, *out.shape[1:]), name=label_name)
        except ValueError as err:
            raise ValueError(f"labels of the model's output '{name}': {err}") from err


def _label_leaves(y: Any) -> list[tuple[str, np.ndarray]]:
    """The label arrays of ``y`` (an array, a dict by output name or a list in output
    order) with the names a ``.npz`` file gives them (``y``, ``y_<name>``, ``y0``...)."""
    if isinstance(y, dict):
        return [(f"y_{key}", np.asarray(value)) for key, value in y.items()]
    if isinstance(y, (list, tuple)):
        return [(f"y{i}", np.asarray(value)) for i, value in enumerate(y)]
    return [("y", np.asarray(y))]


def _named_outputs(model: keras.Model, output: Any) -> list[tuple[str, np.ndarray]]:
    """``(name, value)`` of each of the model's outputs, in Keras' output order (a dict's
    sorted keys, :func:`spectra.operators.keras_models._output_entries`): the order the
    loss pairs labels and outputs in."""
    return [(name, np.asarray(value)) for name, value in _output_entries(model, output)]


def _labels_per_output(
    outputs: list[tuple[str, np.ndarray]], y: Any, *, by_name_only: bool = False
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(output name, labels, output)`` for each output; ValueError listing the model's
    outputs when the label arrays do not match them one to one. ``by_name_only`` (a model
    with dict outputs) refuses labels given by position (:func:`positional_labels_error`)."""
    names = [name for name, _ in outputs]
    listed = ", ".join(names)
    by_name = ", ".join("y_" + n for n in names)
    if by_name_only:
        numbered = ""
    else:
        numbered = f" (or {', '.join(f'y{i}' for i in range(len(names)))} in this order)"
    if isinstance(y, dict):
        missing = [name for name in names if name not in y]
        extra = [str(key) for key in y if key not in names]
        if missing or extra:
            problems = []
            if missing:
                problems.append(f"no labels for {', '.join(missing)}")
            if extra:
                problems.append(f"labels {', '.join('y_' + k for k in extra)} match no output")
            raise ValueError(
                f"the label arrays do not match the model's outputs ({listed}): "
                f"{'; '.join(problems)}. Give one array per output, named {by_name}{numbered}."
            )
        return [(name, np.asarray(y[name]), out) for name, out in outputs]
    if isinstance(y, (list, tuple)):
        if by_name_only:
            raise positional_labels_error(names)
        if len(y) != len(outputs):
            raise ValueError(
                f"{len(y)} label arrays (y0 .. y{len(y) - 1}) for the model's {len(outputs)} "
                f"outputs ({listed}): name them {by_name}, or give one per output in this "
                "order."
            )
        return [
            (name, np.asarray(label), out) for (name, out), label in zip(outputs, y, strict=True)
        ]
    raise ValueError(
        f"the model has {len(outputs)} outputs ({listed}) but the data has one label array "
        "y: give one per output, as a dict keyed by output name"
        f"{'' if by_name_only else ' or a list in this order'} (in a .npz file: "
        f"{by_name} instead of y)."
    )


def label_sources(model: keras.Model, x: Any, y: Any) -> dict[str, str]:
    """Which label array goes to which of the model's outputs: ``{output name: array}``
    with the array named as in a ``.npz`` file (``y``, ``y_<name>``, ``y0``...), in
    Keras' output order. Runs the model on 2 examples; raises as
    :func:`check_data_fits_model` does when the labels do not match the outputs."""
    output = model(np.asarray(x)[:2], training=False)
    outputs = _named_outputs(model, output)
    if len(outputs) == 1 and not isinstance(y, (dict, list, tuple)):
        return {outputs[0][0]: "y"}
    pairs = _labels_per_output(outputs, y, by_name_only=isinstance(output, dict))
    return {
        name: (f"y_{name}" if isinstance(y, dict) else f"y{position}")
        for position, (name, _, _) in enumerate(pairs)
    }


def _single_input_shape(model: keras.Model) -> tuple | None:
    """The declared input shape of a single-input model (batch dimension first), or None."""
    inputs = getattr(model, "inputs", None)
    try:
        if inputs and len(inputs) == 1:
            return tuple(inputs[0].shape)
    except (AttributeError, ValueError, TypeError):
        return None
    return None


def check_keras_data(model: keras.Model, loss: Any, batches: Any) -> None:
    """All checks for the data ``(x, y[, sample_weight])`` of a Keras model and loss.

    Before any graph: the input dtypes (:func:`check_input_dtypes`) and the labels' dtype
    and shape per output (:func:`check_labels`) from ``batches.element_spec``. The
    values — class indices, Embedding indices (:func:`check_embedding_inputs`), finite
    labels and sample weights — for array data now, for a dataset batch by batch during
    its counting pass (``batches.check_values``), so at no extra pass; the error then
    names the batch. ``batches`` is an engine's batches (``element_spec``, ``dataset``:
    None for arrays, ``check_values``). ``loss`` may be one loss, or a dict/list of losses
    per output of a multi-output model (with ``y`` a dict/list). Data that are not
    ``(x, y[, w])``, and losses these checks do not know, are left to the loss itself.
    """
    parts = _unpack(batches.element_spec)
    if parts is None:
        spec = batches.element_spec
        if batches.dataset is not None:
            # A dataset, or the batches of another kind of source (``batches.kind``).
            kind = getattr(batches, "kind", "a tf.data.Dataset")
            what = f"data is {kind} whose elements are {_describe_structure(spec)}"
        else:
            what = f"data is {_describe_structure(spec)}"
        raise ValueError(
            f"{what}; for a Keras model it must be (x, y) or (x, y, sample_weight) (a "
            "dataset must yield such tuples). Pair the inputs with their labels, e.g. "
            "(x, y), tf.data.Dataset.zip((inputs, labels)) or dataset.map(lambda x: (x, y))."
        )
    x_spec, y_spec, w_spec = parts
    check_input_dtypes(model, x_spec)
    check_input_shapes(model, x_spec)
    outputs = _model_outputs(model, x_spec)
    if outputs is not None and batches.dataset is not None:
        # Dtypes and shapes of a dataset's labels now; arrays get them with their values.
        for output_loss, label, output, label_name in _per_output(model, loss, y_spec, outputs):
            check_labels(output_loss, label, output, name=label_name)
    if w_spec is not None:
        for path, leaf in _leaves_with_paths(w_spec):
            if not _is_numeric(_dtype(leaf)):
                raise TypeError(
                    f"{_path_name('sample_weight', path)} has dtype {_dtype(leaf).name}; "
                    "sample weights must be numbers."
                )
    embeddings = _embedding_inputs(model)
    looked_at_outputs: list[bool] = []

    def check_values(batch: Any, where: str | None) -> None:
        x, y, sample_weight = _unpack(batch)  # type: ignore[misc]
        check_finite_inputs(x, where=where)
        if embeddings:
            check_embedding_inputs(model, x, where=where)
        if outputs is not None:
            for output_loss, label, output, label_name in _per_output(model, loss, y, outputs):
                check_labels(output_loss, label, output, name=label_name, where=where)
        if sample_weight is not None:
            for path, leaf in _leaves_with_paths(sample_weight):
                weights = _values(leaf)
                if weights.dtype.kind == "f" and not np.all(np.isfinite(weights)):
                    raise ValueError(
                        f"{_path_name('sample_weight', path)} holds NaN or infinite values"
                        f"{_at(where)}; the loss would be NaN."
                    )
        if not looked_at_outputs:
            looked_at_outputs.append(True)
            warn_if_not_probabilities(model, loss, x)

    batches.check_values(check_values)


def _takes_probabilities(loss: Any) -> bool:
    """Whether ``loss`` is a Keras cross-entropy without ``from_logits=True``."""
    resolved = None if loss is None else keras_loss_function(loss)
    if resolved is None:
        return False
    fn, kwargs, _ = resolved
    probabilistic = fn in _CATEGORICAL_PROBABILITY_LOSSES or fn in _BINARY_LOSSES
    return probabilistic and not kwargs.get("from_logits")


def _loss_of_output(loss: Any, name: str, position: int) -> Any:
    """The loss of output ``name`` (at ``position`` in Keras' output order) from a loss
    given per output (a dict by name, a list in order) or one for all; None if none."""
    if isinstance(loss, dict):
        return loss.get(name)
    if isinstance(loss, (list, tuple)):
        return loss[position] if position < len(loss) else None
    return loss


def _not_probabilities(loss: Any, values: np.ndarray) -> str | None:
    """What makes ``values`` (one output on some examples) not the probabilities ``loss``
    takes, or None: when the loss is a Keras cross-entropy without ``from_logits=True``,
    negative values, values above 1, or (categorical) rows not summing to 1."""
    if not _takes_probabilities(loss):
        return None
    fn, kwargs, _ = keras_loss_function(loss)  # type: ignore[misc]
    categorical = fn in _CATEGORICAL_PROBABILITY_LOSSES
    values = np.asarray(values, np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)):
        return None  # non-finite outputs are refused where the loss is computed
    if values.min() < 0:
        return f"negative values (the smallest {values.min():.3g})"
    if values.max() > 1:
        return f"values above 1 (the largest {values.max():.3g})"
    if categorical and values.ndim >= 1:
        sums = values.sum(axis=kwargs.get("axis", -1))
        worst = float(np.ravel(sums)[np.argmax(np.abs(np.ravel(sums) - 1))])
        if abs(worst - 1) > _SUM_TOLERANCE:
            return f"rows summing to {worst:.3g}, not 1"
    return None


def warn_if_not_probabilities(model: keras.Model, loss: Any, x: Any) -> None:
    """Warn (one line, ``UserWarning``) when a probabilistic loss (a Keras cross-entropy
    without ``from_logits=True``) gets model outputs that are not probabilities on ``x``.

    A model that ends without a softmax (or sigmoid) gives logits: under such a loss they
    are clipped and renormalized, and the curvature of that is no one's loss (λ_max
    orders of magnitude off, and no error). ``x`` is the first examples of the data (at
    most :data:`_PROBABILITY_EXAMPLES` are used; the model runs once on them in inference
    mode). ``loss`` is one loss, or a dict/list per output. A model that fails on ``x``
    is not judged here: the operator's own evaluation reports that failure.
    """
    losses = list(loss.values()) if isinstance(loss, dict) else loss
    if not any(
        _takes_probabilities(item)
        for item in (losses if isinstance(losses, (list, tuple)) else [losses])
    ):
        return  # no output to look at: the model is not run
    first = keras.tree.map_structure(lambda leaf: leaf[:_PROBABILITY_EXAMPLES], x)
    try:
        output = model(first, training=False)
    except Exception:  # the operator's evaluation raises this error with its context
        return
    entries = _output_entries(model, output)
    for position, (name, value) in enumerate(entries):
        output_loss = _loss_of_output(loss, name, position)
        if output_loss is None:
            continue
        problem = _not_probabilities(output_loss, _values(value))
        if problem is None:
            continue
        fn, _, shown = keras_loss_function(output_loss)  # type: ignore[misc]
        loss_class = "".join(part.capitalize() for part in fn.__name__.split("_"))
        activation = "a softmax" if fn in _CATEGORICAL_PROBABILITY_LOSSES else "a sigmoid"
        output_name = "the model's output" + (f" {name!r}" if len(entries) > 1 else "")
        warnings.warn(
            f"the loss {shown} takes probabilities (from_logits=False), but {output_name} "
            f"has {problem} on the first {len(_values(value))} examples: "
            f"if the model outputs logits, pass keras.losses.{loss_class}(from_logits=True) "
            f"(or end the model with {activation}); as it is, the curvature is that of "
            "clipped, renormalized logits.",
            UserWarning,
            stacklevel=3,
        )


def _float_input_leaves(x: Any) -> Iterator[tuple[str, np.ndarray]]:
    """``(name in x, values)`` of each floating-point leaf of the inputs ``x``."""
    for path, leaf in _leaves_with_paths(x):
        if _is_spec(leaf) or not _dtype(leaf).is_floating:
            continue
        yield _path_name("x", path), _values(leaf)


def check_finite_inputs(x: Any, *, where: str | None = None) -> None:
    """Refuse NaN or infinite values in the floating-point inputs ``x``, naming the array,
    the first bad entry and the count.

    The values are those the operator computes with (cast to its dtype): an infinite
    entry of float32 data may be a finite float64 value beyond ±3.4e38, which the
    message then says. Without this check such data reach the loss as a NaN batch loss
    or gradient, whose cause would have to be guessed. Cost: one ``isfinite`` pass over x.
    """
    for name, values in _float_input_leaves(x):
        bad = ~np.isfinite(values)
        if not bad.any():
            continue
        entry, value = _first_bad(name, values, bad)
        overflow = ""
        if np.isinf(value) and values.dtype != np.float64:
            limit = float(np.finfo(values.dtype).max)
            overflow = (
                f" (or a value beyond ±{limit:.2g}, which the {values.dtype} the operator "
                "computes in cannot hold: rescale x, or compute in float64)"
            )
        raise ValueError(
            f"{name} holds {int(bad.sum())} NaN or infinite values{_at(where)}, first "
            f"{entry} = {_show(value)}{overflow}: the model's outputs, the loss and its "
            "derivatives are undefined there. Remove or repair those examples."
        )


def describe_inputs(x: Any) -> str:
    """Where to look in the inputs ``x`` when a batch's loss or gradient is not finite
    although the weights are: the first NaN/Inf entry, or else the entry of largest
    magnitude (a finite but huge input can overflow inside the model). One clause, e.g.
    ``"x[7, 1] = 3e+38 is its largest input"``; empty for inputs without floats."""
    largest: tuple[float, str, Any] | None = None
    for name, values in _float_input_leaves(x):
        if values.size == 0:
            continue
        bad = ~np.isfinite(values)
        if bad.any():
            entry, value = _first_bad(name, values, bad)
            return f"{entry} = {_show(value)} ({int(bad.sum())} NaN or infinite values in {name})"
        magnitude = np.abs(values)
        index = np.unravel_index(int(np.argmax(magnitude)), values.shape)
        if largest is None or magnitude[index] > largest[0]:
            where = f"{name}[{', '.join(str(int(i)) for i in index)}]"
            largest = (float(magnitude[index]), where, values[index])
    if largest is None:
        return ""
    return f"{largest[1]} = {_show(largest[2])} is the input of largest magnitude"


def _describe_structure(spec: Any) -> str:
    """``a tensor of shape (None, 4)``, ``a tuple of 4 parts``: how errors name a batch."""
    if isinstance(spec, (tuple, list)):
        return f"a {type(spec).__name__} of {len(spec)} part{'s' if len(spec) != 1 else ''}"
    if isinstance(spec, dict):
        return f"a dict with keys {sorted(map(str, spec))}"
    shape = getattr(spec, "shape", None)
    if shape is not None:
        return f"a single tensor of shape {tuple(_shape_list(shape) or ())}"
    return f"a {type(spec).__name__}"
