"""Loading models in every format, ordering checkpoints, and the committed data/ assets."""

import json
import re
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.io.checkpoints import (
    CheckpointRef,
    checkpoint_files,
    checkpoint_sha256,
    find_checkpoints,
    load_model,
    recorded_optimizer,
    resolve_builder,
    resolve_custom_objects,
    step_unit,
    stored_weight_counts,
)

TESTS = Path(__file__).resolve().parents[1]
BUILDERS_FILE = TESTS / "_builders.py"
DATA = TESTS.parent / "data"


@pytest.fixture(scope="module")
def builders_importable():
    """Make tests/_builders.py importable as '_builders' for the builder strings below."""
    added = str(TESTS) not in sys.path
    if added:
        sys.path.insert(0, str(TESTS))
    yield
    if added:
        sys.path.remove(str(TESTS))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, builders_importable):
    """A small model saved in every format, with its weights and outputs for comparison."""
    import _builders

    root = tmp_path_factory.mktemp("saved")
    keras.utils.set_random_seed(1)
    model = _builders.build_small_mlp()
    model.set_weights([w + 0.1 * np.arange(w.size).reshape(w.shape) for w in model.get_weights()])
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    model.save(root / "model.keras")
    model.save_weights(root / "model.weights.h5")
    checkpoint_dir = root / "tf_ckpt"
    prefix = tf.train.Checkpoint(model=model).save(str(checkpoint_dir / "ckpt"))
    other_key_prefix = tf.train.Checkpoint(net=model).save(str(root / "tf_other_key" / "ckpt"))
    return {
        "root": root,
        "weights": model.get_weights(),
        "x": x,
        "outputs": np.asarray(model(x)),
        "checkpoint_dir": checkpoint_dir,
        "prefix": prefix,
        "other_key_prefix": other_key_prefix,
    }


def _assert_same_model(model, saved):
    loaded = model.get_weights()
    assert len(loaded) == len(saved["weights"])
    for got, expected in zip(loaded, saved["weights"], strict=True):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.asarray(model(saved["x"])), saved["outputs"])


# --------------------------------------------------------------------------- round trips


def test_keras_file_round_trip(saved):
    model = load_model(saved["root"] / "model.keras")
    assert isinstance(model, keras.Model)
    _assert_same_model(model, saved)


def test_keras_file_accepts_str_path_and_compile_flag(saved):
    _assert_same_model(load_model(str(saved["root"] / "model.keras"), compile=True), saved)


@pytest.mark.parametrize(
    "builder",
    ["_builders:build_small_mlp", f"{BUILDERS_FILE}:build_small_mlp", "callable"],
)
def test_weights_file_round_trip(saved, builder):
    if builder == "callable":
        builder = resolve_builder("_builders:build_small_mlp")
    model = load_model(saved["root"] / "model.weights.h5", builder=builder)
    _assert_same_model(model, saved)


def test_builder_file_path_relative_to_cwd(saved, monkeypatch):
    monkeypatch.chdir(TESTS.parent)
    model = load_model(
        saved["root"] / "model.weights.h5", builder="tests/_builders.py:build_small_mlp"
    )
    _assert_same_model(model, saved)


@pytest.mark.parametrize("which", ["directory", "prefix", "index_file"])
def test_tf_checkpoint_round_trip(saved, which):
    path = {
        "directory": saved["checkpoint_dir"],
        "prefix": saved["prefix"],
        "index_file": saved["prefix"] + ".index",
    }[which]
    model = load_model(path, builder="_builders:build_small_mlp")
    _assert_same_model(model, saved)


def test_tf_checkpoint_other_key(saved):
    with pytest.raises(ValueError, match=r"no object 'model'.*'net'.*checkpoint_key"):
        load_model(saved["other_key_prefix"], builder="_builders:build_small_mlp")
    model = load_model(
        saved["other_key_prefix"], builder="_builders:build_small_mlp", checkpoint_key="net"
    )
    _assert_same_model(model, saved)


# --------------------------------------------------------------------------- errors


def test_missing_file():
    with pytest.raises(FileNotFoundError, match=r"No model file or checkpoint at .*nothing\.keras"):
        load_model("/nonexistent/nothing.keras")


def test_truncated_keras_file(saved, tmp_path):
    data = (saved["root"] / "model.keras").read_bytes()
    (tmp_path / "cut.keras").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"not a valid \.keras archive.*truncated or corrupted"):
        load_model(tmp_path / "cut.keras")


def test_garbage_keras_file(tmp_path):
    (tmp_path / "garbage.keras").write_bytes(b"not a zip at all" * 10)
    with pytest.raises(ValueError, match=r"not a valid \.keras archive"):
        load_model(tmp_path / "garbage.keras")


def test_zip_that_is_not_a_model(tmp_path):
    np.savez(tmp_path / "arrays.npz", x=np.zeros(3))
    (tmp_path / "arrays.keras").write_bytes((tmp_path / "arrays.npz").read_bytes())
    with pytest.raises(ValueError, match=r"zip archive but not a Keras model.*config\.json"):
        load_model(tmp_path / "arrays.keras")


def test_corrupted_keras_content(saved, tmp_path):
    path = tmp_path / "bad_config.keras"
    with (
        zipfile.ZipFile(saved["root"] / "model.keras") as source,
        zipfile.ZipFile(path, "w") as target,
    ):
        for name in source.namelist():
            content = b"{ not json" if name == "config.json" else source.read(name)
            target.writestr(name, content)
    with pytest.raises(ValueError, match="damaged .keras archive.*JSONDecodeError"):
        load_model(path)


def test_data_file_is_not_a_model(tmp_path):
    np.savez(tmp_path / "data.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="NumPy data file, not a model"):
        load_model(tmp_path / "data.npz")


def test_unknown_suffix(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"Unrecognized model file.*expected a Keras '\.keras'"):
        load_model(tmp_path / "model.pt")


def test_truncated_weights_file(saved, tmp_path):
    data = (saved["root"] / "model.weights.h5").read_bytes()
    (tmp_path / "cut.weights.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="damaged HDF5"):
        load_model(tmp_path / "cut.weights.h5", builder="_builders:build_small_mlp")


def test_garbage_weights_file(tmp_path):
    (tmp_path / "garbage.weights.h5").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="not a valid HDF5 file"):
        load_model(tmp_path / "garbage.weights.h5", builder="_builders:build_small_mlp")


def test_hdf5_file_that_is_not_keras_weights(tmp_path):
    import h5py

    with h5py.File(tmp_path / "other.h5", "w") as h5:
        h5["numbers"] = np.arange(3)
    with pytest.raises(ValueError, match="not a Keras weights file"):
        load_model(tmp_path / "other.h5", builder="_builders:build_small_mlp")


def test_weights_file_without_builder(saved):
    with pytest.raises(ValueError, match=r"holds only weights.*builder="):
        load_model(saved["root"] / "model.weights.h5")


def test_tf_checkpoint_without_builder(saved):
    with pytest.raises(ValueError, match=r"holds only variables.*builder="):
        load_model(saved["checkpoint_dir"])


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        ("_builders:build_wider_mlp", r"(?s)do not fit the builder's model.*\(4, 5\)"),
        ("_builders:build_shallow_model", "holds 4 weight arrays but the builder's model has only"),
    ],
)
def test_weights_that_do_not_fit_the_builder(saved, builder, message):
    with pytest.raises(ValueError, match=message):
        load_model(saved["root"] / "model.weights.h5", builder=builder)


@pytest.mark.parametrize("builder", ["_builders:build_wider_mlp", "_builders:build_shallow_model"])
def test_tf_checkpoint_that_does_not_fit_the_builder(saved, builder):
    with pytest.raises(ValueError, match="does not fit the builder's model"):
        load_model(saved["prefix"], builder=builder)


def test_tf_checkpoint_into_deeper_model_is_detected(saved, tmp_path):
    builder_file = tmp_path / "deeper.py"
    builder_file.write_text(
        "import keras\n"
        "def build():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),\n"
        "                             keras.layers.Dense(3), keras.layers.Dense(3)])\n"
    )
    with pytest.raises(ValueError, match="does not fit the builder's model"):
        load_model(saved["prefix"], builder=f"{builder_file}:build")


def test_directory_without_tf_checkpoint(tmp_path):
    (tmp_path / "step_1.keras").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"No tf\.train\.Checkpoint.*find_checkpoints"):
        load_model(tmp_path, builder="_builders:build_small_mlp")


@pytest.mark.parametrize(
    ("builder", "error", "message"),
    [
        (
            "no_such_module_xyz:build",
            ValueError,
            r"Cannot import module 'no_such_module_xyz'.*PYTHONPATH",
        ),
        ("_builders:build_nothing", ValueError, r"has no 'build_nothing'.*build_small_mlp"),
        ("no/such/file.py:build", FileNotFoundError, r"Builder file 'no/such/file\.py'"),
        ("_builders", ValueError, "not of the form 'module:function'"),
        ("_builders:", ValueError, "not of the form 'module:function'"),
        (":build", ValueError, "not of the form 'module:function'"),
        ("_builders:NOT_A_FUNCTION", ValueError, "names a int, not a function"),
        ("_builders:build_unbuilt_mlp", ValueError, r"unbuilt model.*keras\.Input"),
        ("_builders:build_layer", ValueError, r"returned a Dense, not a keras\.Model"),
    ],
)
def test_bad_builder(saved, builder, error, message):
    with pytest.raises(error, match=message):
        load_model(saved["root"] / "model.weights.h5", builder=builder)


# --------------------------------------------------------------------------- find_checkpoints


def _touch(directory, *names):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"")


def test_steps_from_various_names(tmp_path):
    _touch(
        tmp_path,
        "ckpt-1200.keras",
        "epoch_005.keras",
        "step=300.weights.h5",
        "model_12.keras",
        "trajectory.json",
        "notes.txt",
    )
    refs = find_checkpoints(tmp_path)
    assert [(ref.path.name, ref.step) for ref in refs] == [
        ("epoch_005.keras", 5),
        ("model_12.keras", 12),
        ("step=300.weights.h5", 300),
        ("ckpt-1200.keras", 1200),
    ]
    assert all(isinstance(ref, CheckpointRef) for ref in refs)
    assert refs[0].to_dict() == {"path": str(tmp_path / "epoch_005.keras"), "step": 5}


def test_numeric_not_lexicographic_order_directory_and_glob(tmp_path):
    names = ["step_4000.keras", "step_300.keras", "step_20.keras", "step_1.keras", "step_5.keras"]
    _touch(tmp_path, *names, "other_7.weights.h5")
    expected = [1, 5, 20, 300, 4000]
    assert sorted(names) != [f"step_{s}.keras" for s in expected]
    assert [ref.step for ref in find_checkpoints(tmp_path / "step_*.keras")] == expected
    assert [ref.step for ref in find_checkpoints(str(tmp_path / "step_*.keras"))] == expected
    assert [ref.step for ref in find_checkpoints(tmp_path)] == [1, 5, 7, 20, 300, 4000]


def test_list_of_paths(tmp_path):
    _touch(tmp_path, "a_30.keras", "a_4.keras")
    refs = find_checkpoints([tmp_path / "a_30.keras", tmp_path / "a_4.keras"])
    assert [ref.step for ref in refs] == [4, 30]


def test_tf_checkpoint_prefixes(tmp_path):
    _touch(
        tmp_path,
        "checkpoint",
        "ckpt-10.index",
        "ckpt-10.data-00000-of-00001",
        "ckpt-2.index",
        "ckpt-2.data-00000-of-00001",
    )
    refs = find_checkpoints(tmp_path)
    assert [(ref.path.name, ref.step) for ref in refs] == [("ckpt-2", 2), ("ckpt-10", 10)]


def test_explicit_steps_sequence_in_natural_name_order(tmp_path):
    _touch(tmp_path, "final.keras", "warm.keras", "mid.keras")
    refs = find_checkpoints(tmp_path, steps=[900, 450, 0])
    assert [(ref.path.name, ref.step) for ref in refs] == [
        ("warm.keras", 0),
        ("mid.keras", 450),
        ("final.keras", 900),
    ]
    _touch(tmp_path / "numbered", "run2.keras", "run10.keras")
    refs = find_checkpoints(tmp_path / "numbered", steps=[100, 200])
    assert [(ref.path.name, ref.step) for ref in refs] == [
        ("run2.keras", 100),
        ("run10.keras", 200),
    ]


def test_explicit_steps_mapping(tmp_path):
    _touch(tmp_path, "final.keras", "start.keras")
    refs = find_checkpoints(tmp_path, steps={"start.keras": 0, "final.keras": 50})
    assert [(ref.path.name, ref.step) for ref in refs] == [("start.keras", 0), ("final.keras", 50)]
    with pytest.raises(ValueError, match=r"steps has no entry for 'start\.keras'"):
        find_checkpoints(tmp_path, steps={"final.keras": 50})


def test_explicit_steps_wrong_count(tmp_path):
    _touch(tmp_path, "a.keras", "b.keras")
    with pytest.raises(ValueError, match=r"Got 3 steps for 2 checkpoint files"):
        find_checkpoints(tmp_path, steps=[1, 2, 3])


def test_name_without_step(tmp_path):
    _touch(tmp_path, "final.keras", "step_3.keras")
    with pytest.raises(ValueError, match=r"No step number in the file name\(s\) \['final.keras'\]"):
        find_checkpoints(tmp_path)


def test_duplicate_steps(tmp_path):
    _touch(tmp_path, "step_3.keras", "step_3.weights.h5", "step_4.keras")
    with pytest.raises(ValueError, match=r"share a step: \{3: \["):
        find_checkpoints(tmp_path)
    with pytest.raises(ValueError, match="share a step"):
        find_checkpoints(tmp_path, steps=[1, 1, 2])


def test_empty_matches(tmp_path):
    _touch(tmp_path, "notes.txt")
    with pytest.raises(FileNotFoundError, match=r"No checkpoints match the directory.*\.keras"):
        find_checkpoints(tmp_path)
    with pytest.raises(FileNotFoundError, match="No checkpoints match the pattern"):
        find_checkpoints(tmp_path / "*.keras")
    with pytest.raises(FileNotFoundError, match="No checkpoint directory or file"):
        find_checkpoints(tmp_path / "missing")


def test_checkpoint_ref_load(saved):
    ref = find_checkpoints(saved["root"] / "model.keras", steps=[7])[0]
    assert ref.step == 7
    _assert_same_model(ref.load(), saved)


# --------------------------------------------------------------------------- committed assets


@pytest.fixture(scope="module")
def readme():
    return (DATA / "README.md").read_text()


@pytest.fixture(scope="module")
def trajectory():
    return json.loads((DATA / "gd_trajectory" / "trajectory.json").read_text())


def test_digits_mlp_asset(readme):
    model = load_model(DATA / "digits_mlp.keras")
    assert model.input_shape == (None, 64)
    assert model.output_shape == (None, 10)
    assert model.count_params() == 85_002
    assert "64-256-256-10" in readme and "85,002 parameters" in readme
    assert "`sparse_categorical_crossentropy`" in readme
    with np.load(DATA / "digits.npz") as data:
        x, y = data["x"], data["y"]
    probabilities = np.asarray(model(x))
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    accuracy = np.mean(np.argmax(probabilities, axis=1) == y)
    stated = float(re.search(r"training accuracy\s+([\d.]+)%", readme).group(1))
    assert accuracy > 0.95
    assert abs(100 * accuracy - stated) < 0.1


def test_gd_trajectory_asset(readme, trajectory):
    refs = find_checkpoints(DATA / "gd_trajectory")
    steps = [ref.step for ref in refs]
    assert steps == [c["step"] for c in trajectory["checkpoints"]]
    assert [ref.path.name for ref in refs] == [c["file"] for c in trajectory["checkpoints"]]
    assert 8 <= len(refs) <= 12
    assert f"({len(refs)} checkpoints" in readme
    lr = trajectory["learning_rate"]
    assert f"lr = {lr:g}" in readme
    assert f"2/lr = {2 / lr:g}" in readme
    assert trajectory["loss"] == "sparse_categorical_crossentropy"
    assert trajectory["momentum"] == 0.0
    assert len(trajectory["train_loss"]) == trajectory["num_steps"] + 1 == steps[-1] + 1
    assert trajectory["data"] == "data/digits.npz"
    sharpness = [c["sharpness"] for c in trajectory["checkpoints"]]
    assert sharpness[0] < 0.5 * (2 / lr) < max(sharpness)
    assert max(sharpness) == pytest.approx(2 / lr, rel=0.15)

    first, last = load_model(refs[0].path), load_model(refs[-1].path)
    assert first.input_shape == (None, 64) and first.output_shape == (None, 10)
    with np.load(DATA / "digits.npz") as data:
        x, y = data["x"], data["y"]
    for model, index in ((first, 0), (last, -1)):
        loss = float(keras.losses.SparseCategoricalCrossentropy()(y, model(x)))
        assert loss == pytest.approx(trajectory["checkpoints"][index]["loss"], rel=1e-5)
        assert loss == pytest.approx(trajectory["train_loss"][steps[index]], rel=1e-5)


# --------------------------------------------------------------------------- runs


def test_subclassed_model_weights_load_with_a_builder(tmp_path, builders_importable):
    import _builders

    keras.utils.set_random_seed(3)
    model = _builders.build_subclassed()
    model.save_weights(tmp_path / "net.weights.h5")  # as the error message tells users to
    loaded = load_model(tmp_path / "net.weights.h5", builder="_builders:build_subclassed")
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # A smaller model than the file: refused (Keras would load it silently).
    with pytest.raises(
        ValueError, match="holds 4 weight arrays but the builder's model has only 2"
    ):
        load_model(tmp_path / "net.weights.h5", builder="_builders:build_shallow_model")


def test_step_unit_from_names():
    assert step_unit(["run/epoch_001.keras", "run/epoch_010.keras"]) == "epoch"
    assert step_unit(["step_0000.keras", "step-20.weights.h5"]) == "step"
    assert step_unit(["ckpt-3", "ckpt-4"]) == "checkpoint"
    assert step_unit(["model_03.keras"]) == "checkpoint"
    assert step_unit(["epoch_1.keras", "step_2.keras"]) == "checkpoint"


def test_checkpoint_hash_covers_every_file_of_a_tf_checkpoint(saved, tmp_path):
    prefix = Path(saved["prefix"])
    first = checkpoint_sha256(prefix)
    assert {p.name for p in checkpoint_files(prefix)} == {
        p.name for p in prefix.parent.glob(prefix.name + ".*")
    }
    copy = tmp_path / "ckpt-1"
    for file in checkpoint_files(prefix):
        data = bytearray(file.read_bytes())
        if ".data-" in file.name:
            data[-1] ^= 1  # one bit of the variables
        (tmp_path / file.name).write_bytes(bytes(data))
    assert checkpoint_sha256(copy) != first
    assert checkpoint_sha256(saved["root"] / "model.keras") != checkpoint_sha256(
        saved["root"] / "model.weights.h5"
    )


def test_recorded_optimizer_of_a_compiled_keras_file(tmp_path, saved):
    assert recorded_optimizer(saved["root"] / "model.keras") is None  # saved uncompiled
    assert recorded_optimizer(saved["root"] / "model.weights.h5") is None
    model = load_model(saved["root"] / "model.keras")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.8), loss="mse")
    model.save(tmp_path / "compiled.keras")
    optimizer = recorded_optimizer(tmp_path / "compiled.keras")
    assert optimizer["class_name"] == "SGD"
    assert optimizer["config"]["momentum"] == pytest.approx(0.8)
    assert optimizer["config"]["learning_rate"] == pytest.approx(0.05)


# --------------------------------------------------------------------------- custom objects


_CUSTOM_MODULE = """
import keras


class Scale(keras.layers.Layer):
    def call(self, x):
        return 2.0 * x


def helper(x):
    return x


CUSTOM = {"Renamed": Scale}
LISTED = [Scale, helper]
NOT_OBJECTS = 3
"""


@pytest.fixture
def custom_module(tmp_path):
    path = tmp_path / "custom_layers.py"
    path.write_text(_CUSTOM_MODULE)
    return path


def test_custom_objects_module_file_lists_its_keras_classes(custom_module):
    found = resolve_custom_objects(str(custom_module))
    assert list(found) == ["Scale"] and issubclass(found["Scale"], keras.layers.Layer)


def test_custom_objects_named_dict_and_list(custom_module):
    assert list(resolve_custom_objects(f"{custom_module}:CUSTOM")) == ["Renamed"]
    assert list(resolve_custom_objects(f"{custom_module}:LISTED")) == ["Scale", "helper"]


def test_custom_objects_dotted_module_name(custom_module, monkeypatch):
    monkeypatch.syspath_prepend(str(custom_module.parent))
    assert list(resolve_custom_objects("custom_layers:CUSTOM")) == ["Renamed"]


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("{dir}/absent.py", FileNotFoundError, "no file '{dir}/absent.py'"),
        ("{dir}/absent.py:CUSTOM", FileNotFoundError, "absent.py' (custom objects '{dir}/"),
        ("no_such_module_xyz", ValueError, "Cannot import module 'no_such_module_xyz'"),
        # Only the names the module defines, not the modules it imports (keras).
        (
            "{file}:MISSING",
            ValueError,
            "has no 'MISSING' (custom objects '{file}:MISSING'); it defines "
            "['CUSTOM', 'LISTED', 'NOT_OBJECTS', 'Scale', 'helper']",
        ),
        ("{file}:NOT_OBJECTS", TypeError, "is a int; name a dict"),
    ],
)
def test_custom_objects_errors(custom_module, spec, error, message):
    spec = spec.format(dir=custom_module.parent, file=custom_module)
    message = message.format(dir=custom_module.parent, file=custom_module)
    with pytest.raises(error, match=re.escape(message)):
        resolve_custom_objects(spec)


def test_custom_objects_string_reaches_load_model(custom_module, tmp_path):
    """An unregistered custom layer: load_model fails naming it, and loads it when the
    module is given as a string."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("_spectra_saved_custom_layers", custom_module)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1), module.Scale()])
    model.save(tmp_path / "scaled.keras")
    with pytest.raises(ValueError, match="uses the class 'Scale'.*--custom-objects"):
        load_model(tmp_path / "scaled.keras")
    loaded = load_model(tmp_path / "scaled.keras", custom_objects=str(custom_module))
    x = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(loaded(x), model(x))


def test_stored_weight_counts_of_a_compiled_trained_model(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    model.save_weights(tmp_path / "m.weights.h5")
    # SGD with momentum: iterations, learning rate and one momentum per weight.
    assert stored_weight_counts(tmp_path / "m.weights.h5") == {"model": 2, "optimizer": 4}
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    loaded = load_model(tmp_path / "m.weights.h5", builder=lambda: fresh)
    for got, want in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
