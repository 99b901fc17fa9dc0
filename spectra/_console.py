"""A quiet console: TensorFlow imported without its C++ start-up log lines.

TensorFlow's C++ runtime writes to file descriptor 2 directly. Some of its start-up lines
(oneDNN notices, "Could not find cuda drivers", CPU feature hints, the absl banner) appear
before its logging is set up, so ``TF_CPP_MIN_LOG_LEVEL`` does not hold them back, and probing
the devices on a machine without a GPU logs ``failed call to cuInit`` as an error. They are
noise to a user: :func:`quiet_tensorflow` imports TensorFlow and probes the devices with
descriptor 2 routed to a temporary file, and keeps later C++ log lines below FATAL out
(``TF_CPP_MIN_LOG_LEVEL=3``): oneDNN's "falling back to Eigen" notices for int64 or bool
kernels are logged as errors, while a failing op reaches Python as an exception with its
message, so nothing a user needs is dropped (``--verbose`` shows every line). If the
import fails, what was captured is written back to stderr, so nothing that explains a
failure is lost.

The command line calls it first; notebooks call ``spectra.quiet_tensorflow()`` in their first
cell. It has an effect only before TensorFlow is first imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

__all__ = ["native_stderr_captured", "quiet_tensorflow"]

# C++ log lines below FATAL are dropped (op failures still raise Python exceptions).
_QUIET_CPP_LEVEL = "3"


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[None]:
    """Route file descriptor 2 to a temporary file while the block runs.

    Lines written by C/C++ code (which bypasses ``sys.stderr``) are captured and dropped.
    When the block raises, the captured bytes are written back to the real stderr before the
    exception propagates. Without a usable descriptor 2 the block just runs.
    """
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                capture.seek(0)
                os.write(2, capture.read())


def quiet_tensorflow(verbose: bool = False) -> ModuleType:
    """Import TensorFlow (and probe its devices) without C++ log lines; return the module.

    With ``verbose=True`` TensorFlow is imported as it is, every log line shown. Otherwise
    ``TF_CPP_MIN_LOG_LEVEL`` is set to 3 (C++ fatal lines only) unless the environment sets it,
    the import and ``tf.config.list_physical_devices()`` (where the CUDA probing happens) run
    with descriptor 2 captured (:func:`native_stderr_captured`), and TensorFlow's and absl's
    Python loggers are set to ERROR. The device probe does not initialize the devices, so GPU
    options (memory growth) can still be set afterwards. Cost: the import itself (seconds).
    """
    if verbose:
        import tensorflow as tf

        return tf
    already_imported = "tensorflow" in sys.modules
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", _QUIET_CPP_LEVEL)
    with native_stderr_captured():
        import tensorflow as tf

        tf.config.list_physical_devices()
    if not already_imported:
        tf.get_logger().setLevel(logging.ERROR)
        with contextlib.suppress(ImportError):
            from absl import logging as absl_logging

            absl_logging.set_verbosity(absl_logging.ERROR)
    return tf
