"""Hessian products under tf.distribute give the same numbers as on one device.

Each configuration runs in fresh processes (logical devices and cluster settings must be
fixed before TensorFlow starts): MirroredStrategy over 2 logical CPU devices, and a
2-worker MultiWorkerMirroredStrategy cluster on localhost.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("_distributed_worker.py")
TIMEOUT = 240


def _run(mode: str, out: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(out)],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(process: subprocess.Popen) -> str:
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"distributed process timed out after {TIMEOUT} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _assert_same(a: dict, b: dict) -> None:
    for key in ("products", "gradient", "eigenvalues"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-11, atol=1e-14, err_msg=key)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)
    assert a["trace"] == pytest.approx(b["trace"], rel=1e-11)
    assert a["trace_stderr"] == pytest.approx(b["trace_stderr"], rel=1e-9)


@pytest.mark.slow
def test_mirrored_strategy_on_two_logical_devices(tmp_path: Path) -> None:
    out = tmp_path / "mirrored.json"
    _finish(_run("mirrored", out))
    result = json.loads(out.read_text())
    assert result["replicas"] == 2 and result["single_replicas"] == 1
    _assert_same(result["distributed"], result["single"])


@pytest.mark.slow
def test_two_worker_cluster_on_localhost(tmp_path: Path) -> None:
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    workers = []
    try:
        for task in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": task}}
            out = tmp_path / f"worker{task}.json"
            workers.append((out, _run("worker", out, {"TF_CONFIG": json.dumps(tf_config)})))
        single_out = tmp_path / "single.json"
        single = _run("single", single_out)
        _finish(single)
        for _, process in workers:
            _finish(process)
    finally:
        for _, process in workers:
            if process.poll() is None:
                process.kill()
    reference = json.loads(single_out.read_text())
    for task, (out, _) in enumerate(workers):
        result = json.loads(out.read_text())
        assert result["replicas"] == 2 and result["task_id"] == task
        _assert_same(result, reference)
