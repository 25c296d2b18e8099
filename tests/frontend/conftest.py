"""Fixtures: a pipeline (baton.launch.Server) plus the frontend process.

`frontend` serves stories260K (real text: compared with the offline LLM); `restricted_frontend`
serves the built-in default model, so the error tests run even where stories260K is absent.

Servers are session-scoped: starting one costs ~15 s on two cores, so the frontend test modules
share them. The frontend is started by hand (the launcher does not start it yet) and is ready
once GET /health answers 200. Fixtures yield the server's `BatonConfig`: its host and port give
the URL, and it holds the served model name, API key and body limit the tests need.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from baton import LLM
from baton.child_process import child_command
from baton.config import BatonConfig
from baton.launch import Server

STARTUP_TIMEOUT_S = 180.0
API_KEY = "test-secret-key"
# Small, so the 413 tests need only small bodies.
BODY_LIMIT = 64 * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the frontend exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the frontend was not healthy after {STARTUP_TIMEOUT_S:.0f}s")


def run_frontend(**settings: object) -> Iterator[BatonConfig]:
    """Start the pipeline and the frontend; on exit, SIGTERM must end the frontend with 0."""
    config = BatonConfig(
        dtype="float32",
        page_size=4,
        num_pages=400,
        port=free_port(),
        max_request_body_bytes=BODY_LIMIT,
        log_level="warning",
        **settings,
    )
    with Server(config) as pipeline:
        process = subprocess.Popen(child_command("baton.frontend", config, pipeline.addresses))
        url = f"http://{config.host}:{config.port}"
        try:
            wait_healthy(url, process)
            yield config
        finally:
            process.terminate()
            try:
                exit_code = process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                exit_code = process.wait()
    assert exit_code == 0, f"the frontend exited with {exit_code} on SIGTERM"


@pytest.fixture(scope="session")
def frontend(stories260k_dir: Path) -> Iterator[BatonConfig]:
    """stories260K under the name "stories-test", no API key."""
    yield from run_frontend(model=str(stories260k_dir), served_model_name="stories-test")


@pytest.fixture(scope="session")
def restricted_frontend() -> Iterator[BatonConfig]:
    """The built-in model (512-token context) with an API key, one running and one waiting
    request at most."""
    yield from run_frontend(
        max_model_len=512, api_key=API_KEY, max_running_requests=1, max_waiting_requests=1
    )


@pytest.fixture(scope="session")
def offline(stories260k_dir: Path) -> LLM:
    """The offline engine on the same model: the reference for greedy outputs."""
    return LLM(str(stories260k_dir), dtype="float32")
