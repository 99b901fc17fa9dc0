"""Print spectra's requirements without TensorFlow: install_requires less tensorflow, plus
the given extras of setup.cfg (one requirement per line), for a virtualenv that runs
spectra on Keras' JAX backend with TensorFlow not installed (make test-jax).

    python .ci/requirements_without_tensorflow.py test-jax > requirements.txt

setup.cfg stays the one place where versions are pinned.
"""

from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"
# Distributions that are TensorFlow or pull it in.
TENSORFLOW = {"tensorflow", "tensorflow-text", "tf-keras", "keras-hub", "tensorboard"}


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def requirements(extras: list[str]) -> list[str]:
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    found = _lines(config["options"]["install_requires"])
    available = config["options.extras_require"]
    for extra in extras:
        if extra not in available:
            raise SystemExit(f"setup.cfg has no extra {extra!r}; it has {sorted(available)}.")
        found += _lines(available[extra])
    kept = []
    for requirement in found:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()
        if name not in TENSORFLOW and requirement not in kept:
            kept.append(requirement)
    return kept


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
