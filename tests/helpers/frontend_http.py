"""What the frontend tests share: a server launcher, request bodies, the served name, OpenAI's
error shape, and the offline reference for greedy outputs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from baton import LLM, RequestOutput, SamplingParams
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.config import BatonConfig
from baton.launch import Server
from helpers.ports import free_port

VALID = {"prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MODEL_NAME = "stories-test"  # the `frontend` fixture's served_model_name
# Small, so the 413 tests need only small bodies.
BODY_LIMIT = 64 * 1024


def run_frontend(**settings: object) -> Iterator[BatonConfig]:
    """Launch a server (its frontend included); on exit, SIGTERM must end the frontend with 0."""
    config = BatonConfig(
        **{"model": RANDOM_MODEL_NAME, **settings},
        dtype="float32",
        page_size=4,
        num_pages=400,
        port=free_port(),
        max_request_body_bytes=BODY_LIMIT,
        log_level="warning",
    )
    with Server(config) as server:
        yield config
    exit_code = server.processes["frontend"].returncode
    assert exit_code == 0, f"the frontend exited with {exit_code} on SIGTERM"


def base_url(config: BatonConfig) -> str:
    """The server's HTTP root."""
    return f"http://{config.host}:{config.port}"


def auth(config: BatonConfig) -> dict[str, str]:
    """The Authorization header with the server's API key."""
    return {"Authorization": f"Bearer {config.api_key}"}


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    """The body is OpenAI's error shape with `code`; returns the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    return error


def greedy(offline: LLM, prompt: str | list[int], **params: object) -> RequestOutput:
    """The offline engine's greedy output: the reference."""
    return offline.generate(prompt, SamplingParams(temperature=0, **params))[0]
