"""Processes of a tf.distribute cluster on localhost, for the distributed tests and the
scaling benchmark: free ports, each task's TF_CONFIG, and waiting for a process."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Callable


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_environments(count: int) -> list[dict[str, str]]:
    """The ``TF_CONFIG`` environment of each worker of a ``count``-worker cluster."""
    spec = {"worker": [f"127.0.0.1:{port}" for port in free_ports(count)]}
    return [
        {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "worker", "index": task}})}
        for task in range(count)
    ]


def finish(process: subprocess.Popen, timeout: float) -> str:
    """Wait for ``process``; its output, or a ``RuntimeError`` with the end of it if it
    failed or ran past ``timeout`` seconds (then it is killed)."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise RuntimeError(f"a process timed out after {timeout} s:\n{output[-3000:]}") from None
    if process.returncode != 0:
        raise RuntimeError(f"a process failed ({process.returncode}):\n{output[-3000:]}")
    return output


def run_workers(
    start: Callable[[int, dict[str, str]], subprocess.Popen],
    count: int,
    timeout: float,
    alongside: Callable[[], object] | None = None,
) -> None:
    """Start ``count`` workers (``start(task, environment)``), run ``alongside()`` while
    they run, and wait for all of them; any still running at the end are killed."""
    processes: list[subprocess.Popen] = []
    try:
        for task, environment in enumerate(worker_environments(count)):
            processes.append(start(task, environment))
        if alongside is not None:
            alongside()
        for process in processes:
            finish(process, timeout)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
