"""vLLM's chat template fields against the live server (built-in model, API key): what vLLM
refuses is OpenAI's 400 naming the field, what it accepts is served."""

from __future__ import annotations

import httpx
import pytest
from helpers.frontend_http import CHAT, assert_error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # Accepted and ignored until an HTTP probe; refused as vLLM refuses them.
        ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
        ({**CHAT, "tools": []}, "tools"),
        ({**CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
        ({**CHAT, "continue_final_message": True}, "continue_final_message"),
        ({**CHAT, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({**CHAT, "chat_template_kwargs": {"x": 2**70}}, "chat_template_kwargs"),
        ({**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({**CHAT, "documents": [{"title": 1}]}, "documents.0.title"),
    ],
)
def test_chat_fields_vllm_refuses_are_400(http: httpx.Client, body: dict, param: str) -> None:
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request")
    assert error["param"] == param
    assert param.split(".")[0] in error["message"]


def test_what_vllm_accepts_is_served(http: httpx.Client) -> None:
    """An empty stream_options without stream, tool_choice "none" without tools, and the
    template's variables (the built-in model's template writes `bos_token`: three bytes for
    one special token)."""
    plain = http.post("/v1/chat/completions", json={**CHAT, "stream_options": {}})
    assert plain.status_code == 200, plain.text
    assert (
        http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"}).status_code == 200
    )
    kwargs = {"chat_template_kwargs": {"bos_token": "BOS", "enable_thinking": False}}
    varied = http.post("/v1/chat/completions", json={**CHAT, **kwargs})
    assert varied.status_code == 200, varied.text
    prompt_tokens = plain.json()["usage"]["prompt_tokens"]
    assert varied.json()["usage"]["prompt_tokens"] == prompt_tokens + 2


def test_documents_and_reasoning_effort_are_served(http: httpx.Client) -> None:
    """vLLM's top-level template fields, once ignored unread; the built-in model's template
    reads neither, so its prompt stays the plain one."""
    plain = http.post("/v1/chat/completions", json=CHAT)
    fields = {"documents": [{"title": "t", "text": "x"}], "reasoning_effort": "none"}
    served = http.post("/v1/chat/completions", json={**CHAT, **fields})
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_non_finite_numbers_in_the_kwargs_are_400(http: httpx.Client) -> None:
    """JSON's NaN and Infinity pass the kwargs' `Any` (a float field refuses them): refused as
    ChatOptions refuses them for every client."""
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": '
        response = http.post("/v1/chat/completions", content=body + b'{"x": [' + value + b"]}}")
        error = assert_error(response, 400, "invalid_request")
        assert error["param"] == "chat_template_kwargs" and "finite" in error["message"]
