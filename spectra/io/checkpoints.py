"""Loading trained Keras models and ordering checkpoints of a training run.

Supported model sources (see :func:`load_model`):

* a Keras ``.keras`` archive (or a legacy full-model ``.h5`` file);
* a ``.weights.h5`` file together with a *builder*, a function that returns the built model;
* a ``tf.train.Checkpoint`` directory or prefix together with a builder.

A builder is a callable taking no arguments, or a string ``"module:function"`` or
``"path/to/file.py:function"`` naming one.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
import types
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import keras

# TensorFlow and Keras are imported where a model is loaded, so that finding and hashing
# checkpoints (the bookkeeping of a run) does not import them.
Builder = Callable[[], Any] | str
PathLike = str | os.PathLike
CustomObjects = Mapping[str, Any] | str

_MODEL_SUFFIXES = (".weights.h5", ".keras", ".h5")
_CHECKPOINT_INDEX_SUFFIX = ".index"
_FORMATS_HELP = (
    "expected a Keras '.keras' file, a '.weights.h5' file with builder=..., "
    "or a tf.train.Checkpoint directory/prefix with builder=..."
)


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint of a training run: where it is and at which training step it was saved."""

    path: Path
    step: int

    def load(self, builder: Builder | None = None, compile: bool = False) -> keras.Model:
        """Load this checkpoint with :func:`load_model`."""
        return load_model(self.path, builder=builder, compile=compile)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step}


# --------------------------------------------------------------------------- loading models


def load_model(
    path: PathLike,
    builder: Builder | None = None,
    compile: bool = False,
    *,
    custom_objects: CustomObjects | None = None,
    checkpoint_key: str = "model",
) -> keras.Model:
    """Load a trained Keras model.

    A ``.weights.h5`` file saved from a compiled model also holds the optimizer's state
    (under ``optimizer/``); like ``model.load_weights`` this reads the model's weights and
    ignores the optimizer's (:func:`stored_weight_counts` counts both).

    Parameters
    ----------
    path
        a ``.keras`` file, a legacy full-model ``.h5`` file, a ``.weights.h5`` file,
        or a ``tf.train.Checkpoint`` directory (its latest checkpoint is used) or prefix
        (e.g. ``run/ckpt-1200``).
    builder
        for weights files and ``tf.train.Checkpoint``\\ s: a callable with no arguments
        returning the built (not necessarily compiled) model, or ``"module:function"`` /
        ``"path/to/file.py:function"`` naming one.
    compile
        passed to ``keras.models.load_model`` for full-model files; a builder's model
        is returned as the builder made it.
    custom_objects
        for custom layers, models and losses in full-model files: a mapping from class
        name to class, passed to ``keras.models.load_model``, or a string naming a module
        to import first (see :func:`resolve_custom_objects`; this runs the module's code).
        Keras' safe mode stays on either way.
    checkpoint_key
        the attribute under which the model was saved in a
        ``tf.train.Checkpoint`` (``tf.train.Checkpoint(model=model)`` -> ``"model"``).

    Raises
    ------
    FileNotFoundError
        the path does not exist, or a directory holds no checkpoint.
    ValueError
        a corrupted or unrecognized file, a missing or failing builder, or weights
        that do not match the builder's model.
    """
    path = Path(path)
    name = path.name.lower()
    if isinstance(custom_objects, str):
        custom_objects = resolve_custom_objects(custom_objects)
    if path.is_dir():
        return _load_tf_checkpoint(_latest_checkpoint_in(path), builder, checkpoint_key)
    if not path.exists():
        if Path(str(path) + _CHECKPOINT_INDEX_SUFFIX).exists():
            return _load_tf_checkpoint(str(path), builder, checkpoint_key)
        raise FileNotFoundError(f"No model file or checkpoint at '{path}'; {_FORMATS_HELP}.")
    if name.endswith(_CHECKPOINT_INDEX_SUFFIX):
        return _load_tf_checkpoint(
            str(path)[: -len(_CHECKPOINT_INDEX_SUFFIX)], builder, checkpoint_key
        )
    if name.endswith(".keras"):
        return _load_keras_archive(path, compile, custom_objects)
    if name.endswith(".h5") or name.endswith(".hdf5"):
        return _load_h5(path, builder, compile, custom_objects)
    if name.endswith(".npz") or name.endswith(".npy"):
        raise ValueError(
            f"'{path}' is a NumPy data file, not a model; {_FORMATS_HELP}. "
            "(Data files go to the data argument, e.g. --data.)"
        )
    raise ValueError(f"Unrecognized model file '{path}'; {_FORMATS_HELP}.")


def _load_keras_archive(
    path: Path, compile: bool, custom_objects: Mapping[str, Any] | None
) -> keras.Model:
    _read_archive_config(path)
    import keras

    try:
        with warnings.catch_warnings():
            # A compiled model saved before its optimizer's first step has no optimizer
            # state to load: Keras warns and keeps a fresh optimizer (iterations 0), which
            # is what such a checkpoint holds; whoever needs the state checks iterations.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            model = keras.models.load_model(path, compile=compile, custom_objects=custom_objects)
    except Exception as err:
        if "safe_mode" in str(err):
            raise ValueError(_unsafe_archive_message(path, err)) from err
        unknown = re.search(r"Could not locate (class|function) '([^']+)'", str(err))
        if unknown:
            kind, name = unknown.groups()
            raise ValueError(
                f"'{path}' uses the {kind} '{name}', which Keras does not know: import the "
                f"module that defines it before loading (on the command line "
                f"--custom-objects path/to/module.py, or 'module:attr' naming a dict or "
                f"list of them; in Python custom_objects={{'{name}': {name}}})."
            ) from err
        raise ValueError(
            f"Could not load the Keras model '{path}': {type(err).__name__}: {err}\n"
            "If the file is corrupted, save it again. If the model uses custom layers, import "
            "the module that registers them (keras.saving.register_keras_serializable) or pass "
            "custom_objects=..."
        ) from err
    return _require_model(model, path)


def _unsafe_archive_message(path: Path, err: Exception) -> str:
    """What to do with a ``.keras`` archive Keras refuses to deserialize safely (a
    ``Lambda`` layer holding Python bytecode): rebuild the architecture in code and load
    only the weights, which the archive holds as ``model.weights.h5``."""
    cause = str(err).split(".")[0]
    return (
        f"Keras refuses to load '{path}' safely ({cause}: loading it would run code stored "
        "in the file). Rebuild the model in a builder function (a Python file defining the "
        "same layers, the Lambda's function included) and load only the weights: the "
        f"archive holds them as model.weights.h5 (unzip '{path.name}' model.weights.h5), "
        "then give that file with builder=... (on the command line: spectra ... "
        "model.weights.h5 --builder path/to/file.py:function)."
    )


def _read_archive_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a ``.keras`` archive, after checking the archive."""
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"'{path}' is not a valid .keras archive (a .keras file is a zip archive): the file "
            "is truncated or corrupted. Save it again with model.save('model.keras')."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if "config.json" not in names:
                raise ValueError(
                    f"'{path}' is a zip archive but not a Keras model (no config.json inside; "
                    f"it holds {sorted(names)[:5]}). Save a model with model.save('model.keras')."
                )
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"'{path}' is a damaged .keras archive ({type(err).__name__}: {err}). Save it again "
            "with model.save('model.keras')."
        ) from err
    if not isinstance(config, dict):
        raise ValueError(f"'{path}' has a config.json that is not a Keras model configuration.")
    return config


def _load_h5(
    path: Path,
    builder: Builder | None,
    compile: bool,
    custom_objects: Mapping[str, Any] | None,
) -> keras.Model:
    is_full_model = _inspect_h5(path)
    if is_full_model and builder is None:
        import keras

        try:
            model = keras.models.load_model(path, compile=compile, custom_objects=custom_objects)
        except Exception as err:
            raise ValueError(
                f"Could not load the legacy HDF5 model '{path}': {type(err).__name__}: {err}"
            ) from err
        return _require_model(model, path)
    if builder is None:
        raise ValueError(
            f"'{path}' holds only weights, not the architecture: pass builder=... (a function "
            "returning the built model, or 'module:function' / 'path/to/file.py:function'; "
            "on the command line --builder), or save the whole model with "
            "model.save('model.keras')."
        )
    model = _build_model(builder)
    _load_weights_file(model, path)
    return model


def _inspect_h5(path: Path) -> bool:
    """Check that ``path`` is a readable HDF5 file; True when it holds a whole legacy model."""
    import h5py

    if not h5py.is_hdf5(path):
        raise ValueError(
            f"'{path}' is not a valid HDF5 file: it is truncated, corrupted or of another "
            "format. Save the weights again with model.save_weights('model.weights.h5')."
        )
    try:
        with h5py.File(path, "r") as h5:
            return "model_config" in h5.attrs
    except OSError as err:
        raise ValueError(f"'{path}' is a damaged HDF5 file and cannot be read: {err}") from err


def _load_weights_file(model: keras.Model, path: Path) -> None:
    """``model.load_weights(path)`` for a Keras weights file, with errors that say what to do.

    Any layout Keras writes is accepted (Sequential and functional models keep their weights
    under ``layers/``, subclassed models under their attribute names); the optimizer's state
    that a compiled model saves under ``optimizer/`` is ignored, as Keras ignores it when the
    model has no built optimizer. The one check beyond Keras' own is that the file holds no
    more of the model's weight arrays than the model has, because Keras loads such a file
    into a smaller model without complaint.
    """

    counts = stored_weight_counts(path)
    num_stored = counts["model"]
    num_expected = len(model.weights)
    if num_stored > num_expected:
        besides = (
            f" of the model (besides {counts['optimizer']} of the optimizer's state, which "
            "are not loaded)"
            if counts["optimizer"]
            else ""
        )
        raise ValueError(
            f"'{path}' holds {num_stored} weight arrays{besides} but the builder's model has "
            f"only {num_expected} weights: the builder does not build the architecture these "
            "weights were saved from."
        )
    try:
        model.load_weights(path)
    except Exception as err:
        raise ValueError(
            f"The weights in '{path}' do not fit the builder's model: {err}\n"
            "Check that the builder builds the architecture the weights were saved from."
        ) from err


def stored_weight_counts(path: PathLike) -> dict[str, int]:
    """How many weight arrays a Keras 3 ``.weights.h5`` file holds: ``{"model": m,
    "optimizer": o}``, the arrays in its ``vars`` groups outside and inside the top-level
    ``optimizer`` group (the state ``save_weights`` writes for a compiled, built optimizer:
    ``iterations``, the learning rate and, for Adam, two moments per weight).

    Cost: reading the file's index, not the arrays.

    Raises
    ------
    ValueError
        not a readable HDF5 file, or not a Keras weights file (no ``vars`` groups).
    """
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r") as h5:
            counts = _count_stored_weights(h5)
    except OSError as err:
        raise ValueError(f"'{path}' is a damaged HDF5 file and cannot be read: {err}") from err
    if counts is None:
        raise ValueError(
            f"'{path}' is an HDF5 file but not a Keras weights file (no 'vars' groups). "
            "Save the weights with model.save_weights('model.weights.h5')."
        )
    return counts


def stored_iterations(path: PathLike) -> int | None:
    """The optimizer's iteration counter saved in a checkpoint (the training steps taken),
    or None when it holds none.

    Keras 3 saves a compiled model's optimizer state in the top-level ``optimizer`` group of
    the weights (``model.weights.h5`` inside a ``.keras`` archive, or the ``.weights.h5``
    file itself), ``iterations`` first (``optimizer/vars/0``, an integer scalar). It is read
    with h5py, without building a model or an optimizer. None for an uncompiled model, an
    optimizer never built (no step taken), a tf.train.Checkpoint, or a file that is not
    one of these. Cost: reading the weights file's index and one scalar.
    """
    import h5py

    path = Path(path)
    name = path.name.lower()
    if not path.is_file():
        return None
    try:
        if name.endswith(".keras"):
            with zipfile.ZipFile(path) as archive:
                if "model.weights.h5" not in archive.namelist():
                    return None
                with archive.open("model.weights.h5") as inner, h5py.File(inner, "r") as h5:
                    return _iterations_in(h5)
        if name.endswith(".h5"):
            with h5py.File(path, "r") as h5:
                return _iterations_in(h5)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    return None


def _iterations_in(h5: Any) -> int | None:
    """``optimizer/vars/0`` of a Keras weights file when it is an integer scalar."""
    import h5py

    counter = h5.get("optimizer/vars/0")
    if not isinstance(counter, h5py.Dataset) or counter.shape != ():
        return None
    if counter.dtype.kind not in "iu":
        return None
    return int(counter[()])


def _count_stored_weights(h5: Any) -> dict[str, int] | None:
    """Weight arrays (datasets in ``vars`` groups) of the model and of the top-level
    ``optimizer`` group; None when the file has no ``vars`` group at all."""
    import h5py

    counts = {"model": 0, "optimizer": 0}
    found = False

    def visit(name: str, obj: Any) -> None:
        nonlocal found
        parts = name.split("/")
        if isinstance(obj, h5py.Group) and parts[-1] == "vars":
            found = True
        if isinstance(obj, h5py.Dataset) and "vars" in parts[:-1]:
            counts["optimizer" if parts[0] == "optimizer" else "model"] += 1

    h5.visititems(visit)
    return counts if found else None


def _latest_checkpoint_in(directory: Path) -> str:
    import tensorflow as tf

    prefix = tf.train.latest_checkpoint(str(directory))
    if prefix is not None:
        return prefix
    indexes = sorted(directory.glob("*" + _CHECKPOINT_INDEX_SUFFIX))
    if len(indexes) == 1:
        return str(indexes[0])[: -len(_CHECKPOINT_INDEX_SUFFIX)]
    model_files = sorted(p.name for p in directory.iterdir() if _model_suffix(p.name))
    hint = (
        f" It holds model files ({', '.join(model_files[:3])}...): load one of them, or list "
        "them all in step order with find_checkpoints()."
        if model_files
        else ""
    )
    if (directory / "saved_model.pb").exists():
        hint = (
            " It is a TensorFlow SavedModel, which Keras 3 cannot load as a model: save the "
            "model as '.keras' (model.save) or its weights as '.weights.h5'."
        )
    raise FileNotFoundError(
        f"No tf.train.Checkpoint in directory '{directory}' (no 'checkpoint' file and no "
        f"single '*.index' file).{hint}"
    )


def _load_tf_checkpoint(prefix: str, builder: Builder | None, checkpoint_key: str) -> keras.Model:
    if builder is None:
        raise ValueError(
            f"The tf.train.Checkpoint '{prefix}' holds only variables, not the architecture: "
            "pass builder=... (a function returning the built model, or 'module:function' / "
            "'path/to/file.py:function')."
        )
    _check_tf_checkpoint(prefix, checkpoint_key)
    model = _build_model(builder)
    _restore_tf_checkpoint(model, prefix, checkpoint_key)
    return model


def _check_tf_checkpoint(prefix: str, checkpoint_key: str) -> None:
    import tensorflow as tf

    try:
        stored = [name for name, _ in tf.train.list_variables(prefix)]
    except (tf.errors.OpError, ValueError) as err:
        raise ValueError(
            f"Could not read the tf.train.Checkpoint '{prefix}' (truncated or corrupted?): {err}"
        ) from err
    top_level = sorted({name.split("/")[0] for name in stored} - {"_CHECKPOINTABLE_OBJECT_GRAPH"})
    if checkpoint_key not in top_level:
        raise ValueError(
            f"The tf.train.Checkpoint '{prefix}' has no object '{checkpoint_key}' (it holds "
            f"{top_level}). Save with tf.train.Checkpoint({checkpoint_key}=model), or pass "
            "checkpoint_key= with the name the model was saved under."
        )


def _restore_tf_checkpoint(model: keras.Model, prefix: str, checkpoint_key: str) -> None:
    import tensorflow as tf

    try:
        status = tf.train.Checkpoint(**{checkpoint_key: model}).restore(prefix).expect_partial()
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as err:
        raise ValueError(
            f"The tf.train.Checkpoint '{prefix}' does not fit the builder's model: {err}\n"
            "Check that the builder builds the architecture the checkpoint was saved from."
        ) from err


def _require_model(obj: Any, path: Path) -> keras.Model:
    import keras

    if not isinstance(obj, keras.Model):
        raise ValueError(
            f"'{path}' holds a {type(obj).__name__}, not a keras.Model; wrap it in a model "
            "(e.g. keras.Sequential([layer])) and save that."
        )
    return obj


# --------------------------------------------------------------------------- builders


# Names of a module listed when a builder function is not found in it: enough to spot a typo.
_NAMES_SHOWN = 10


def resolve_builder(builder: Builder) -> Callable[[], keras.Model]:
    """Turn ``"module:function"`` or ``"path/to/file.py:function"`` into the callable it names."""
    if callable(builder):
        return builder
    if not isinstance(builder, str):
        raise TypeError(
            f"builder must be a callable or a 'module:function' string, got {type(builder)}"
        )
    location, sep, attribute = builder.rpartition(":")
    if not sep or not location or not attribute:
        raise ValueError(
            f"Builder '{builder}' is not of the form 'module:function' or "
            "'path/to/file.py:function'."
        )
    if location.endswith(".py") or "/" in location or os.sep in location:
        module = _import_file(Path(location), builder)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as err:
            raise ValueError(
                f"Cannot import module '{location}' of builder '{builder}': {err}. Put its "
                "directory on PYTHONPATH, or give the file: 'path/to/file.py:function'."
            ) from err
    try:
        function = getattr(module, attribute)
    except AttributeError as err:
        public = _defined_names(module)
        raise ValueError(
            f"Module '{location}' has no '{attribute}' (builder '{builder}'); it defines "
            f"{public[:_NAMES_SHOWN]}"
        ) from err
    if not callable(function):
        raise ValueError(f"Builder '{builder}' names a {type(function).__name__}, not a function.")
    return function


def _import_file(file: Path, builder: str, role: str = "builder") -> Any:
    if not file.is_file():
        raise FileNotFoundError(
            f"{role.capitalize()} file '{file}' of {role} '{builder}' does not exist."
        )
    module_name = "_spectra_builder_" + re.sub(r"\W", "_", str(file.resolve()))
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"Cannot import '{file}' ({role} '{builder}') as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ValueError(
            f"Importing {role} file '{file}' failed: {type(err).__name__}: {err}"
        ) from err
    return module


def resolve_custom_objects(spec: str) -> dict[str, Any]:
    """Import the module that ``spec`` names and return the custom objects it provides.

    ``spec`` is ``"path/to/module.py"``, a dotted module name (``"mypkg.models"``), or either
    followed by ``":attr"`` naming a dict (name -> object) or a list/tuple of classes and
    functions (keyed by ``__name__``) in that module. Importing runs the module's code (as a
    builder does): classes it decorates with ``@keras.saving.register_keras_serializable()``
    become known to Keras. Without ``:attr`` the result also maps the name of every Keras
    layer, model, loss, metric, initializer, regularizer and constraint class the module
    defines to the class, so unregistered classes are found too. Keras' safe mode is not
    touched: this makes classes known, it does not allow code stored in a file to run.

    Raises
    ------
    TypeError
        ``spec`` is not a string, or ``attr`` names something else than a dict or list.
    FileNotFoundError
        the module file does not exist.
    ValueError
        the module cannot be imported or has no ``attr``.
    """
    if not isinstance(spec, str):
        raise TypeError(f"custom_objects must be a mapping or a module string, got {type(spec)}")
    location, attribute = spec, ""
    head, sep, tail = spec.rpartition(":")
    # "C:\\dir\\m.py" has a drive colon; an attribute is an identifier after the last colon.
    if sep and head and tail.isidentifier():
        location, attribute = head, tail
    if not location.strip():
        raise ValueError(
            f"custom objects '{spec}' name no module: give 'path/to/module.py', a dotted "
            "module name, or either with ':attr'."
        )
    if location.endswith(".py") or "/" in location or os.sep in location:
        if not Path(location).is_file():
            raise FileNotFoundError(
                f"no file '{location}'"
                + ("" if location == spec else f" (custom objects '{spec}')")
            )
        module = _import_file(Path(location), spec, role="custom objects")
    else:
        try:
            module = importlib.import_module(location)
        except Exception as err:
            raise ValueError(
                f"Cannot import module '{location}' of custom objects '{spec}': "
                f"{type(err).__name__}: {err}. Put its directory on PYTHONPATH, or give the "
                "file: 'path/to/module.py'."
            ) from err
    if not attribute:
        return _keras_classes_of(module)
    if not hasattr(module, attribute):
        public = _defined_names(module)
        raise ValueError(
            f"Module '{location}' has no '{attribute}' (custom objects '{spec}'); it defines "
            f"{public[:_NAMES_SHOWN]}"
        )
    named = getattr(module, attribute)
    if isinstance(named, Mapping):
        return {str(key): value for key, value in named.items()}
    if isinstance(named, (list, tuple)):
        return {getattr(item, "__name__", str(item)): item for item in named}
    raise TypeError(
        f"'{attribute}' in '{location}' (custom objects '{spec}') is a "
        f"{type(named).__name__}; name a dict {{name: class}} or a list of classes."
    )


def _defined_names(module: Any) -> list[str]:
    """The public names a module defines, not those it imports (modules, imported
    classes), sorted."""
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", module.__name__) == module.__name__
    )


def _keras_classes_of(module: Any) -> dict[str, Any]:
    """The Keras serializable classes a module defines (not those it imports), by name."""
    import keras

    bases = (
        keras.layers.Layer,
        keras.losses.Loss,
        keras.metrics.Metric,
        keras.initializers.Initializer,
        keras.regularizers.Regularizer,
        keras.constraints.Constraint,
    )
    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, bases)
        and value.__module__ == module.__name__
    }


def _build_model(builder: Builder) -> keras.Model:
    import keras

    function = resolve_builder(builder)
    try:
        model = function()
    except Exception as err:
        raise ValueError(
            f"The builder {builder!r} raised {type(err).__name__}: {err} (fix the builder "
            "so that it returns the built model)"
        ) from err
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"The builder {builder!r} returned a {type(model).__name__}, not a keras.Model."
        )
    if not model.built or not model.weights:
        raise ValueError(
            f"The builder {builder!r} returned an unbuilt model (it has no weights yet), so "
            "there is nothing to load the weights into. Build it inside the builder: start it "
            "with keras.Input(shape), or call model.build(input_shape) or model(example_batch)."
        )
    return model


# --------------------------------------------------------------------------- trajectories


def find_checkpoints(
    spec: PathLike | Sequence[PathLike],
    steps: Sequence[int] | Mapping[str, int] | None = None,
) -> list[CheckpointRef]:
    """Find the checkpoints of a training run, ordered by training step.

    Parameters
    ----------
    spec
        a directory (all ``.keras``, ``.weights.h5``, ``.h5`` files and
        ``tf.train.Checkpoint`` prefixes in it), a glob pattern (``"run/ckpt-*.keras"``),
        or a list of paths.
    steps
        by default the step is the last integer in the file name without its suffix
        (``ckpt-1200.keras`` -> 1200, ``epoch_005.keras`` -> 5, ``step=300.weights.h5`` ->
        300). Otherwise a sequence of steps paired with the files in natural name order
        (``a2`` before ``a10``), or a mapping from file name (or path) to step.

    Raises
    ------
    FileNotFoundError
        nothing matches ``spec``.
    ValueError
        a file name without a step, two files with the same step, or ``steps`` that
        do not pair up with the files.
    """
    paths = _checkpoint_paths(spec)
    if steps is None:
        refs = [CheckpointRef(path, step_from_name(path)) for path in paths]
        unnamed = [path.name for path, ref in zip(paths, refs, strict=True) if ref.step < 0]
        if unnamed:
            raise ValueError(
                f"No step number in the file name(s) {unnamed}: name checkpoints like "
                "'ckpt-1200.keras' (the last integer in the name is the step), or pass "
                "steps=[...] (in natural name order) or steps={file name: step}."
            )
    elif isinstance(steps, Mapping):
        refs = []
        for path in paths:
            key = path.name if path.name in steps else str(path)
            if key not in steps:
                raise ValueError(
                    f"steps has no entry for '{path.name}'; its keys are {sorted(steps)}."
                )
            refs.append(CheckpointRef(path, int(steps[key])))
    else:
        steps = [int(step) for step in steps]
        if len(steps) != len(paths):
            raise ValueError(
                f"Got {len(steps)} steps for {len(paths)} checkpoint files "
                f"{[p.name for p in paths]} (in natural name order); give one step per file."
            )
        refs = [CheckpointRef(path, step) for path, step in zip(paths, steps, strict=True)]

    by_step: dict[int, list[str]] = {}
    for ref in refs:
        by_step.setdefault(ref.step, []).append(ref.path.name)
    duplicates = {step: names for step, names in by_step.items() if len(names) > 1}
    if duplicates:
        raise ValueError(
            f"Several checkpoints share a step: {duplicates}. Keep one file per step (e.g. "
            "do not mix '.keras' and '.weights.h5' copies in one directory), or select them "
            "with a glob pattern."
        )
    return sorted(refs, key=lambda ref: ref.step)


def _checkpoint_paths(spec: PathLike | Sequence[PathLike]) -> list[Path]:
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        paths = [Path(p) for p in spec]
        missing = [str(p) for p in paths if not (p.exists() or _is_tf_prefix(p))]
        if missing:
            raise FileNotFoundError(f"Checkpoint files not found: {missing}")
        if not paths:
            raise FileNotFoundError("No checkpoints given (empty list).")
        return sorted(paths, key=_natural_key)

    text = os.fspath(spec)
    if glob.has_magic(text):
        matches = [Path(p) for p in glob.glob(text)]
        where = f"the pattern '{text}'"
    else:
        directory = Path(text)
        if not directory.exists():
            raise FileNotFoundError(f"No checkpoint directory or file '{directory}'.")
        if not directory.is_dir():
            return [directory]
        matches = list(directory.iterdir())
        where = f"the directory '{directory}'"

    paths = []
    for match in matches:
        if match.name.endswith(_CHECKPOINT_INDEX_SUFFIX):
            paths.append(match.with_name(match.name[: -len(_CHECKPOINT_INDEX_SUFFIX)]))
        elif _model_suffix(match.name) and match.is_file():
            paths.append(match)
    if not paths:
        raise FileNotFoundError(
            f"No checkpoints match {where}: expected files ending in "
            f"{', '.join(_MODEL_SUFFIXES)} or tf.train.Checkpoint '*.index' files."
        )
    return sorted(paths, key=_natural_key)


def _model_suffix(name: str) -> str | None:
    lower = name.lower()
    return next((suffix for suffix in _MODEL_SUFFIXES if lower.endswith(suffix)), None)


def _is_tf_prefix(path: Path) -> bool:
    return Path(str(path) + _CHECKPOINT_INDEX_SUFFIX).exists()


def step_from_name(path: Path) -> int:
    """The last integer in the file name without its model suffix, or -1 when there is none."""
    suffix = _model_suffix(path.name)
    stem = path.name[: -len(suffix)] if suffix else path.name
    numbers = re.findall(r"\d+", stem)
    return int(numbers[-1]) if numbers else -1


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


# --------------------------------------------------------------------------- run metadata


def step_unit(paths: Sequence[PathLike]) -> str:
    """What the integers in the file names count: ``"epoch"``, ``"step"`` or ``"checkpoint"``.

    Read from the word before the last integer of each name (``epoch_005.keras`` -> epoch,
    ``step_0200.keras``, ``iter-300.weights.h5`` -> step); names that disagree or say neither
    (``ckpt-12``: tf.train.CheckpointManager numbers its saves) give ``"checkpoint"``.
    """
    units = set()
    for path in paths:
        name = Path(path).name
        suffix = _model_suffix(name)
        stem = name[: -len(suffix)] if suffix else name
        before = re.split(r"\d+(?=\D*$)", stem)[0].lower()
        words = re.findall(r"[a-z]+", before)
        last = words[-1] if words else ""
        if last in ("epoch", "epochs", "ep", "e"):
            units.add("epoch")
        elif last in ("step", "steps", "iter", "iteration", "it", "global", "globalstep"):
            units.add("step")
        else:
            units.add("checkpoint")
    return units.pop() if len(units) == 1 else "checkpoint"


def checkpoint_files(path: PathLike) -> list[Path]:
    """The files that hold a checkpoint: the file itself, or a tf.train.Checkpoint's
    ``PREFIX.index`` and ``PREFIX.data-*`` files."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = Path(str(path) + _CHECKPOINT_INDEX_SUFFIX)
    if index.exists():
        shards = sorted(path.parent.glob(glob.escape(path.name) + ".data-*"))
        return [index, *shards]
    raise FileNotFoundError(f"No checkpoint file or tf.train.Checkpoint prefix '{path}'.")


def checkpoint_sha256(path: PathLike) -> str:
    """SHA-256 of a checkpoint's content (all its files, with their names for several).

    Cost: reading the files once.
    """
    files = checkpoint_files(path)
    digest = hashlib.sha256()
    for file in files:
        if len(files) > 1:
            digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def recorded_optimizer(path: PathLike) -> dict[str, Any] | None:
    """The optimizer a compiled ``.keras`` file was saved with, serialized, or None.

    ``{"class_name": "SGD", "config": {"learning_rate": 0.1, "momentum": 0.9, ...}}`` as Keras
    stores it in the archive's ``compile_config``; None for an uncompiled model or another
    format. Reads ``config.json`` only; no model is built.
    """
    path = Path(path)
    if not path.name.lower().endswith(".keras") or not path.is_file():
        return None
    try:
        config = _read_archive_config(path)
    except ValueError:
        return None
    optimizer = (config.get("compile_config") or {}).get("optimizer")
    if isinstance(optimizer, str):
        return {"class_name": optimizer, "config": {"name": optimizer}}
    if isinstance(optimizer, dict) and isinstance(optimizer.get("config"), dict):
        return {"class_name": optimizer.get("class_name", "?"), "config": optimizer["config"]}
    return None


class CheckpointLoader:
    """Loads the checkpoints of a training run into as few model instances as possible.

    Checkpoints of one architecture share one model: the first is loaded with
    :func:`load_model`, each further one only has its weights loaded into that model
    (``model.load_weights`` for ``.keras`` and ``.weights.h5`` files, a restore for
    tf.train.Checkpoints). The engine behind :meth:`HessianOperator.from_keras` is cached per
    model, so its traced functions then serve the whole run: no retrace per checkpoint.

    The architecture is the model configuration inside a ``.keras`` archive (compared as
    text), or the builder for weights files and tf.train.Checkpoints. A new architecture, or
    a checkpoint that failed to load (it may have left the model half overwritten), gets a
    fresh model. ``num_models_built`` counts the models made.

    ``compile=True`` loads ``.keras`` files compiled, with their loss and optimizer: Keras
    restores the optimizer's variables (``iterations`` and the moments) with the weights,
    from the first file and, through ``load_weights``, from each further one.
    """

    def __init__(
        self,
        builder: Builder | None = None,
        *,
        compile: bool = False,
        custom_objects: CustomObjects | None = None,
        checkpoint_key: str = "model",
    ) -> None:
        self.builder = builder
        self.compile = bool(compile)
        self.custom_objects = custom_objects
        self.checkpoint_key = checkpoint_key
        self.num_models_built = 0
        self._model: keras.Model | None = None
        self._architecture: Any = None

    def load(self, path: PathLike) -> keras.Model:
        """The model with the weights of the checkpoint at ``path`` (see the class docstring).

        Raises the errors of :func:`load_model`.
        """
        path = Path(path)
        architecture = self._architecture_of(path)
        model = self._model
        self._model = None
        if model is not None and architecture is not None and architecture == self._architecture:
            self._load_weights(model, path)
        else:
            model = load_model(
                path,
                builder=self.builder,
                compile=self.compile,
                custom_objects=self.custom_objects,
                checkpoint_key=self.checkpoint_key,
            )
            self.num_models_built += 1
        self._model, self._architecture = model, architecture
        return model

    def _architecture_of(self, path: Path) -> Any:
        name = path.name.lower()
        if name.endswith(".keras") and path.is_file():
            config = _read_archive_config(path)
            return ("keras", json.dumps(config.get("config"), sort_keys=True))
        if self.builder is not None and (
            name.endswith(".weights.h5") or _is_tf_prefix(path) or path.is_dir()
        ):
            return ("builder", self.builder if isinstance(self.builder, str) else id(self.builder))
        return None

    def _load_weights(self, model: keras.Model, path: Path) -> None:
        name = path.name.lower()
        if name.endswith(".keras"):
            try:
                model.load_weights(path)
            except Exception as err:
                raise ValueError(
                    f"Could not load the weights of '{path}': {type(err).__name__}: {err}\n"
                    "If the file is corrupted, save it again."
                ) from err
        elif name.endswith(".weights.h5"):
            _inspect_h5(path)
            _load_weights_file(model, path)
        else:
            prefix = _latest_checkpoint_in(path) if path.is_dir() else str(path)
            if prefix.endswith(_CHECKPOINT_INDEX_SUFFIX):
                prefix = prefix[: -len(_CHECKPOINT_INDEX_SUFFIX)]
            _check_tf_checkpoint(prefix, self.checkpoint_key)
            _restore_tf_checkpoint(model, prefix, self.checkpoint_key)
