"""Fixtures: a pipeline (baton.launch.Server) plus the frontend process.

`frontend` serves stories260K (real text: compared with the offline LLM); `restricted_frontend`
serves the built-in default model, so the error tests run even where stories260K is absent.

Servers are session-scoped: starting one costs ~15 s on two cores, so the frontend test modules
share them. Fixtures yield the server's `BatonConfig`: its host and port give the URL, and it
holds the served model name, API key and body limit the tests need.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.frontend_http import MODEL_NAME, auth, base_url, run_frontend

from baton import LLM
from baton.config import BatonConfig

API_KEY = "test-secret-key"


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


@pytest.fixture(scope="module")
def http(restricted_frontend: BatonConfig) -> Iterator[httpx.Client]:
    """A client of the restricted server that sends the API key."""
    with httpx.Client(
        base_url=base_url(restricted_frontend), headers=auth(restricted_frontend), timeout=30
    ) as client:
        yield client


@pytest.fixture(scope="module")
def client(frontend: BatonConfig) -> openai.OpenAI:
    """An OpenAI client of the stories260K server."""
    assert frontend.served_model_name == MODEL_NAME
    base_url = f"http://{frontend.host}:{frontend.port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
