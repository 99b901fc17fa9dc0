"""spectra._validation: the argument checks, one contract (name first, TypeError for a wrong
type, ValueError for a wrong value), without TensorFlow."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from spectra import _validation as V


def test_check_int():
    assert V.check_int("batch_size", np.int64(3)) == 3
    assert type(V.check_int("batch_size", np.int64(3))) is int
    assert V.check_int("max_batches", None, allow_none=True) is None
    assert V.check_int("offset", 0, minimum=0) == 0
    assert V.check_int("shift", -5, minimum=None) == -5
    with pytest.raises(TypeError, match=r"^batch_size must be an integer, got True \(bool\)$"):
        V.check_int("batch_size", True)
    with pytest.raises(TypeError, match=r"^num_probes must be an integer, got 2.0 \(float\)$"):
        V.check_int("num_probes", 2.0)
    with pytest.raises(TypeError, match=r"^k must be an integer, got None \(NoneType\)$"):
        V.check_int("k", None)
    with pytest.raises(TypeError, match=r"^max_batches must be an integer or None, got '2'"):
        V.check_int("max_batches", "2", allow_none=True)
    with pytest.raises(ValueError, match=r"^k must be an integer >= 1, got 0$"):
        V.check_int("k", 0)
    with pytest.raises(ValueError, match=r"^num_products must be an integer >= 4, got 3$"):
        V.check_int("num_products", np.int32(3), minimum=4)


def test_check_float():
    assert V.check_float("tol", np.float32(0.25)) == 0.25
    assert V.check_float("tol", 1) == 1.0 and type(V.check_float("tol", 1)) is float
    assert V.check_float("tol", None, allow_none=True) is None
    assert V.check_float("shift", -2.0, positive=False) == -2.0
    assert V.check_float("p", 0.5, below=1.0) == 0.5
    with pytest.raises(TypeError, match=r"^tol must be a number, got True \(bool\)$"):
        V.check_float("tol", True)
    with pytest.raises(TypeError, match=r"^tol must be a number, got '0.1' \(str\)$"):
        V.check_float("tol", "0.1")
    with pytest.raises(ValueError, match=r"^tol must be a positive finite number, got nan$"):
        V.check_float("tol", float("nan"))
    with pytest.raises(ValueError, match=r"^tol must be a positive finite number, got 0$"):
        V.check_float("tol", 0)
    with pytest.raises(ValueError, match=r"^shift must be a finite number, got -inf$"):
        V.check_float("shift", -np.inf, positive=False)
    with pytest.raises(
        ValueError, match=r"^failure_probability must be a positive finite number and < 1, got 1.0$"
    ):
        V.check_float("failure_probability", 1.0, below=1.0)


def test_check_bool_and_choice():
    assert V.check_bool("training", np.bool_(True)) is True
    with pytest.raises(TypeError, match=r"^training must be True or False, got 1 \(int\)$"):
        V.check_bool("training", 1)
    assert V.check_choice("which", "largest", ("largest", "smallest")) == "largest"
    with pytest.raises(
        ValueError, match=r"^which must be one of 'largest', 'smallest', got 'top'$"
    ):
        V.check_choice("which", "top", ("largest", "smallest"))
    with pytest.raises(TypeError, match=r"^which must be one of 'largest', got 1 \(int\)$"):
        V.check_choice("which", 1, ("largest",))


def test_check_seed():
    assert V.check_seed("seed", np.int32(4)) == 4
    generator = np.random.default_rng(0)
    assert V.check_seed("seed", generator) is generator
    assert V.check_seed("seed", None) is None
    assert V.check_seed("seed", 2**62 - 1, below=V.MAX_SEED) == 2**62 - 1
    with pytest.raises(
        TypeError,
        match=r"^seed must be None, a non-negative integer or a numpy.random.Generator, got "
        r"True \(bool\)$",
    ):
        V.check_seed("seed", True)
    with pytest.raises(ValueError, match=r"^seed must be a non-negative integer, got -1$"):
        V.check_seed("seed", -1)
    with pytest.raises(
        ValueError,
        match=r"^seed must be a non-negative integer below 2\*\*62, got 4611686018427387904$",
    ):
        V.check_seed("seed", 2**62, below=V.MAX_SEED)
    with pytest.raises(TypeError, match=r"^seed must be a non-negative integer, got None"):
        V.check_seed("seed", None, allow_none=False, allow_generator=False)
    with pytest.raises(TypeError, match=r"^seed must be None or a non-negative integer, got Gen"):
        V.check_seed("seed", generator, allow_generator=False)


def test_check_float_dtype():
    assert V.check_float_dtype("dtype", np.float64) == np.float64
    assert V.check_float_dtype("dtype", "float32") == np.float32
    assert V.check_float_dtype("dtype", None) is None

    class TensorFlowLike:  # how a tf.DType shows its numpy dtype
        as_numpy_dtype = np.float32

    assert V.check_float_dtype("dtype", TensorFlowLike()) == np.float32
    with pytest.raises(
        TypeError,
        match=r"^dtype must be one of float32, float64 \(or None.*, got float16 \(half "
        r"precision is too coarse for curvature: pass dtype='float32'.*dtype='float64'\)$",
    ):
        V.check_float_dtype("dtype", "float16")
    with pytest.raises(TypeError, match=r"^dtype must be one of float32, float64.*got 'banana'$"):
        V.check_float_dtype("dtype", "banana")
    with pytest.raises(TypeError, match=r"^dtype must be one of float32, float64, got None$"):
        V.check_float_dtype("dtype", None, allow_none=False)


def test_describe_loss():
    class Loss:
        name = "mean_squared_error"

    def my_loss(y_true, y_pred):
        return y_pred

    assert V.loss_name("mse") == "mse"
    assert V.loss_name(Loss()) == "mean_squared_error"
    assert V.loss_name(my_loss) == "my_loss"
    assert V.loss_name(object()) == "object"
    assert V.loss_name({"a": "mse", "b": [my_loss, "mae"]}) == "{a: mse, b: [my_loss, mae]}"


def test_imports_neither_tensorflow_nor_scipy():
    code = (
        "import sys, spectra._validation\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'scipy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
