"""Two nodes on one machine: two `baton launch` processes with --nnodes 2 and their own
--node-rank, one tensor-parallel rank each; only node 0 serves. A node that dies stops the
other; a node that never joins is one line after --distributed-timeout-seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers.distributed_ranks import free_address
from helpers.launcher import children_of, start_launcher, wait_dead

from baton import LLM, SamplingParams

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def node_flags(address: str, node_rank: int) -> tuple[str, ...]:
    return (
        "-tp", "2", "--nnodes", "2", "--node-rank", str(node_rank),
        "--dist-init-addr", address, "--dtype", "float32",
    )  # fmt: skip


def start_worker(model: Path, address: str) -> subprocess.Popen:
    """Node 1's launcher; its first line says its rank is ready."""
    return subprocess.Popen(
        [sys.executable, "-m", "baton.launch", "--model", str(model), *node_flags(address, 1)],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_two_nodes_serve_one_processs_tokens_and_stop_together(stories260k_dir: Path) -> None:
    address = free_address()
    worker = start_worker(stories260k_dir, address)
    try:
        launcher, children = start_launcher(
            stories260k_dir, extra_args=node_flags(address, 0), processes=4
        )
        try:
            assert next(worker.stdout).startswith("Baton worker node 1 of 2 ready: ranks 1-1")
            worker_children = children_of(worker.pid)
            body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
            reply = httpx.post(f"{launcher.http_url}/v1/completions", json=body, timeout=60)
            expected = LLM(str(stories260k_dir), dtype="float32").generate(
                "Once upon a time", SamplingParams(temperature=0, max_tokens=40)
            )[0]
            assert reply.json()["choices"][0]["text"] == expected.text
            killed_at = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL)  # the node's rank dies with its launcher
            assert launcher.wait(timeout=20) == 1
            assert time.monotonic() - killed_at < 5.0
        finally:
            launcher.kill()
    finally:
        worker.kill()
    assert wait_dead([*children, *worker_children], timeout=10.0) == []


def test_a_node_that_never_joins_is_one_line(stories260k_dir: Path) -> None:
    flags = (*node_flags(free_address(), 0), "--distributed-timeout-seconds", "3")
    result = subprocess.run(
        [sys.executable, "-m", "baton.launch", "--model", str(stories260k_dir), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert any("could not join the others" in line for line in errors), result.stderr
    assert "within 3 s (--distributed-timeout-seconds)" in result.stderr
    assert "Traceback" not in result.stderr
