"""A server whose generation config sets sampling defaults gives them to every HTTP request that
leaves the parameter unset (vLLM's --generation-config, --override-generation-config)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from helpers.frontend_http import base_url, run_frontend

DEFAULTS = {"temperature": 0, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    for config in run_frontend(max_model_len=256, override_generation_config=DEFAULTS):
        with httpx.Client(base_url=base_url(config), timeout=30) as client:
            yield client


def complete(http: httpx.Client, **fields: object) -> dict:
    response = http.post(
        "/v1/completions", json={"prompt": "Once upon", "ignore_eos": True, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_unset_fields_take_the_generation_configs_defaults(http: httpx.Client) -> None:
    first, second = complete(http), complete(http)
    # max_new_tokens caps completions' default of 16; temperature 0 makes the two agree.
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
    )
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
    info = http.get("/server_info").json()
    assert info["sampling_defaults"] == {"temperature": 0.0, "max_new_tokens": 5}


def test_a_requests_own_values_win_under_the_cap(http: httpx.Client) -> None:
    assert complete(http, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert complete(http, max_tokens=50)["usage"]["completion_tokens"] == 5
    texts = {complete(http, temperature=1.5, seed=seed)["choices"][0]["text"] for seed in range(4)}
    assert len(texts) > 1  # sampled, not the default's greedy


def test_a_chat_near_the_context_end_runs_to_it_rather_than_being_refused(
    http: httpx.Client,
) -> None:
    """max_new_tokens caps a chat without max_tokens; where fewer tokens fit the context, those
    are what it gets (vLLM's rule), not a 400 for asking past it."""
    messages = [{"role": "user", "content": "x" * 200}]
    prompt_len = http.post("/tokenize", json={"messages": messages}).json()["count"]
    content = "x" * (200 + 256 - 3 - prompt_len)  # 3 tokens of room (the byte tokenizer)
    body = {"messages": [{"role": "user", "content": content}], "ignore_eos": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"
