"""A pipeline process that dies ends every open request with an error, and the server with it."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.frontend_http import assert_error
from helpers.launcher import child_pid, start_launcher, wait_dead

from baton.checkpoint.random_model import RANDOM_MODEL_NAME

# Long enough (seconds of decoding) to be certainly open when a process is killed; the random
# model's 4096 positions hold it, and two such requests fit these KV pages.
LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
KV_PAGES = ("--num-gpu-blocks-override", "1024")
PIPELINE_LOST = "the server is shutting down: one of its processes died"


def post(url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as http:
        return http.post("/v1/completions", json=body)


def wait_running(http: httpx.Client, count: int) -> None:
    """Wait until the scheduler runs `count` requests."""
    deadline = time.monotonic() + 30
    while http.get("/server_info").json()["scheduler"]["running_requests"] < count:
        assert time.monotonic() < deadline, f"{count} requests never ran at once"
        time.sleep(0.05)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("victim", ["scheduler", "tokenizer", "detokenizer"])
def test_a_killed_process_ends_every_open_request_and_the_server_at_once(
    victim: str, tmp_path: Path
) -> None:
    """kill -9 of any pipeline process: the open stream ends with an "unavailable" error chunk
    and [DONE], the open plain request gets a 503 in OpenAI's shape, and the launcher exits 1
    within 2 s, logging which process died and how, leaving no process and no ipc directory.
    Once the stream was cut mid-body and the launcher waited out the frontend's 5 s drain."""
    with (tmp_path / "stderr").open("w+") as stderr:
        launcher, children = start_launcher(RANDOM_MODEL_NAME, extra_args=KV_PAGES, stderr=stderr)
        try:
            with (
                ThreadPoolExecutor(1) as pool,
                httpx.Client(base_url=launcher.http_url, timeout=30) as http,
                http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
            ):
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                plain = pool.submit(post, launcher.http_url, LONG)
                wait_running(http, 2)
                killed_at = time.monotonic()
                os.kill(child_pid(children, f"{victim}_proc"), signal.SIGKILL)
                rest = [line for line in lines if line]
                plain_reply = plain.result()
            assert launcher.wait(timeout=10) == 1
            stopped_in = time.monotonic() - killed_at
        finally:
            launcher.kill()
        stderr.seek(0)
        log = stderr.read()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"] == {
        "message": PIPELINE_LOST,
        "type": "server_error",
        "param": None,
        "code": "unavailable",
    }
    assert assert_error(plain_reply, 503, "unavailable")["message"] == PIPELINE_LOST
    assert stopped_in < 2.0
    assert wait_dead(children, timeout=1.0) == []
    assert list(Path(tempfile.gettempdir()).glob(f"baton-{launcher.pid}-*")) == []
    assert f"launch ERROR {victim} process was killed by SIGKILL; stopping the server" in log
    assert "Traceback" not in log
