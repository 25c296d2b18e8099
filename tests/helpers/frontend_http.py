"""What the frontend tests share: request bodies, the served name, OpenAI's error shape, and
the offline reference for greedy outputs."""

from __future__ import annotations

import httpx

from baton import LLM, RequestOutput, SamplingParams
from baton.config import BatonConfig

VALID = {"prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MODEL_NAME = "stories-test"  # the `frontend` fixture's served_model_name


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
