"""A quiet console: TensorFlow imported without its C++ start-up log lines.

TensorFlow's C++ runtime writes to file descriptor 2 directly. Some of its start-up lines
(oneDNN notices, "Could not find cuda drivers", the absl banner "All log messages before
absl::InitializeLog() is called are written to STDERR") are written while its shared libraries
load, before its logging is set up, so ``TF_CPP_MIN_LOG_LEVEL`` does not hold them back; later
ones (CPU feature hints, ``failed call to cuInit`` when probing the devices of a machine without
a GPU) obey it. They are noise to a user, so spectra keeps them out without being asked:

* ``import spectra`` calls :func:`install_quiet_import`: it raises ``TF_CPP_MIN_LOG_LEVEL`` to 3
  (C++ lines below FATAL are dropped: oneDNN's "falling back to Eigen" notices for int64 or bool
  kernels are logged as errors, while a failing op reaches Python as an exception with its
  message, so nothing a user needs is dropped) when it is unset or lower, and leaves a higher
  (quieter) one as it is; and it adds an import hook that, the first time TensorFlow is imported
  (by spectra or by the user), runs that import with descriptor 2 routed to a temporary file
  (:func:`native_stderr_captured`). Both whatever the environment says: the lines written while
  the libraries load ignore the level, so a user's own ``TF_CPP_MIN_LOG_LEVEL=3`` alone would
  not keep them out. If the import fails, what was captured is written back to stderr, so
  nothing that explains a failure is lost.
* :func:`quiet_tensorflow` imports TensorFlow that way at once, also probes the devices quietly
  and sets TensorFlow's and absl's Python loggers to ERROR; the command line calls it first.
  ``quiet_tensorflow(verbose=True)`` (the CLI's ``--verbose``) undoes what ``import spectra`` set
  up (the user's own level, if any, comes back), so every line the user's level allows is shown.

Nothing here has an effect once TensorFlow is imported: lines printed by an import that came
before ``import spectra`` are TensorFlow's own.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

__all__ = ["install_quiet_import", "native_stderr_captured", "quiet_tensorflow"]

# C++ log lines below FATAL are dropped (op failures still raise Python exceptions).
_QUIET_CPP_LEVEL = "3"
_LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"


class _State:
    """What :func:`install_quiet_import` did, so that ``verbose`` can undo it."""

    # Whether TensorFlow's first import was set up to be quiet by ``import spectra``.
    installed = False
    # Whether spectra raised the level, and the environment's value before (None: unset).
    level_raised = False
    previous_level: str | None = None
    hook: _QuietTensorFlowFinder | None = None


def _raise_level() -> None:
    """Set ``TF_CPP_MIN_LOG_LEVEL`` to 3 unless the environment sets it to 3 or more (a
    value that is not an integer counts as lower, as TensorFlow reads it as 0)."""
    current = os.environ.get(_LEVEL_VARIABLE)
    try:
        quiet_enough = current is not None and int(current) >= int(_QUIET_CPP_LEVEL)
    except ValueError:
        quiet_enough = False
    if quiet_enough:
        return
    if not _State.level_raised:
        _State.level_raised, _State.previous_level = True, current
    os.environ[_LEVEL_VARIABLE] = _QUIET_CPP_LEVEL


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


class _QuietLoader(importlib.abc.Loader):
    """The real loader of ``tensorflow``, executing the module with descriptor 2 captured."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _remove_hook()
        with native_stderr_captured():
            self.loader.exec_module(module)


class _QuietTensorFlowFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that finds ``tensorflow`` with the other finders and wraps its
    loader in :class:`_QuietLoader`; it is removed when TensorFlow is first executed (a mere
    ``importlib.util.find_spec("tensorflow")`` leaves it in place)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "tensorflow":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _QuietLoader(spec.loader)
                return spec
        return None


def _remove_hook() -> None:
    hook, _State.hook = _State.hook, None
    if hook is not None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(hook)


def install_quiet_import() -> None:
    """Make the first import of TensorFlow quiet, whatever ``TF_CPP_MIN_LOG_LEVEL`` says.

    Called by ``import spectra``. Does nothing when TensorFlow is already imported.
    Otherwise raises ``TF_CPP_MIN_LOG_LEVEL`` to 3 when it is unset or lower (a higher,
    quieter value stays) and adds the import hook described in this module's docstring.
    Costs nothing until TensorFlow is imported.
    """
    if "tensorflow" in sys.modules or _State.hook is not None:
        return
    _raise_level()
    _State.installed = True
    _State.hook = _QuietTensorFlowFinder()
    sys.meta_path.insert(0, _State.hook)


def _show_tensorflow_logs() -> None:
    """Undo :func:`install_quiet_import` (before TensorFlow is imported): no hook, and the
    environment's own ``TF_CPP_MIN_LOG_LEVEL`` (or none) back."""
    _remove_hook()
    if _State.level_raised and os.environ.get(_LEVEL_VARIABLE) == _QUIET_CPP_LEVEL:
        if _State.previous_level is None:
            del os.environ[_LEVEL_VARIABLE]
        else:
            os.environ[_LEVEL_VARIABLE] = _State.previous_level
    _State.level_raised, _State.previous_level = False, None


def quiet_tensorflow(verbose: bool = False) -> ModuleType:
    """Import TensorFlow (and probe its devices) without C++ log lines; return the module.

    With ``verbose=True`` TensorFlow is imported as it is, every log line shown (what
    ``import spectra`` set up to keep them out is undone first). Otherwise
    ``TF_CPP_MIN_LOG_LEVEL`` is raised to 3 (C++ fatal lines only) unless it is 3 or more,
    the import and ``tf.config.list_physical_devices()`` (where the CUDA probing happens) run
    with descriptor 2 captured (:func:`native_stderr_captured`), and TensorFlow's and absl's
    Python loggers are set to ERROR, unless TensorFlow was already imported other than through
    the quiet import ``import spectra`` set up (the user's loggers stay as they are). The device
    probe does not initialize the devices, so GPU options (memory growth) can still be set
    afterwards. Only the first import has an effect on the C++ lines. Cost: the import itself
    (seconds) the first time.

    Parameters
    ----------
    verbose : bool
        show every TensorFlow log line (the CLI's ``--verbose``).

    Returns
    -------
    module
        the ``tensorflow`` module.
    """
    imported_before_spectra = "tensorflow" in sys.modules and not _State.installed
    if verbose:
        if "tensorflow" not in sys.modules:
            _show_tensorflow_logs()
        import tensorflow as tf

        return tf
    if "tensorflow" not in sys.modules:
        _raise_level()
    _remove_hook()
    with native_stderr_captured():
        import tensorflow as tf

        tf.config.list_physical_devices()
    if not imported_before_spectra:
        tf.get_logger().setLevel(logging.ERROR)
        with contextlib.suppress(ImportError):
            from absl import logging as absl_logging

            absl_logging.set_verbosity(absl_logging.ERROR)
    return tf
