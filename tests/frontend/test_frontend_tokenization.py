"""vLLM's /tokenize and /detokenize over HTTP, against the offline engine's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from helpers.frontend_http import MODEL_NAME, assert_error, base_url

from baton import LLM
from baton.chat_options import ChatOptions
from baton.config import BatonConfig
from baton.messages import ChatMessage
from baton.tokenizer_proc.chat import render_chat

TEXT = "Once upon a time"


@pytest.fixture(scope="module")
def http(frontend: BatonConfig) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(frontend), timeout=30) as client:
        yield client


def test_tokenize_a_text_as_vllm(http: httpx.Client, offline: LLM) -> None:
    body = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXT}).json()
    ids = offline.tokenizer.encode(TEXT)
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    bare = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == offline.tokenizer.encode(TEXT, add_special_tokens=False)
    body = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert body["tokens"] == ids
    assert body["token_strs"] == [offline.tokenizer.id_to_token(token) for token in ids]
    assert body["token_strs"][0] == "<s>" and "".join(body["token_strs"][1:]) == "▁Once▁upon▁a▁time"


def test_tokenize_messages_as_chat_completions_renders_them(
    http: httpx.Client, offline: LLM
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    body = {"messages": messages, "add_generation_prompt": False}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    options = ChatOptions(add_generation_prompt=False)
    conversation = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello")]
    assert tokens == render_chat(offline.tokenizer, conversation, options)
    with_cue = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert with_cue == render_chat(offline.tokenizer, conversation)
    assert len(with_cue) > len(tokens)


def test_detokenize_keeps_special_tokens(http: httpx.Client, offline: LLM) -> None:
    ids = offline.tokenizer.encode(TEXT)
    body = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids}).json()
    assert body == {"prompt": offline.tokenizer.decode(ids, skip_special_tokens=False)}
    assert body["prompt"].endswith(TEXT)


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "message"),
    [
        ("/detokenize", {"tokens": [1, 100000]}, 400, "invalid_request", "[1] = 100000 is outside"),
        ("/detokenize", {"tokens": ["1"]}, 400, "invalid_request", "tokens"),
        ("/tokenize", {"prompt": 5}, 400, "invalid_request", "prompt"),
        ("/tokenize", {}, 400, "invalid_request", "prompt"),
        ("/tokenize", {"messages": []}, 400, "invalid_request", "messages"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model_not_found", "other"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template": "x"},
         400, "invalid_request", "chat_template"),
        ("/tokenize", {"prompt": "a" * 60_000}, 400, "prompt_too_long", "maximum context"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": []},
         400, "invalid_request", "at least 1 item"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
         400, "invalid_request", "add_special_tokens=true is not supported"),
        # Once `messages` silently won: the ZMQ protocol refuses the mix too.
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
         400, "invalid_request", "exactly one of prompt and messages must be set (got both)"),
    ],
)  # fmt: skip
def test_bad_requests_are_openai_errors(
    http: httpx.Client, path: str, body: dict, status: int, code: str, message: str
) -> None:
    error = assert_error(http.post(path, json=body), status, code)
    assert message in error["message"] or message == error["param"], error


def test_malformed_json_is_a_400(http: httpx.Client) -> None:
    assert_error(http.post("/tokenize", content=b"{"), 400, "invalid_request")
    assert_error(http.post("/detokenize", content=b"[1"), 400, "invalid_request")
    nested = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(http.post("/tokenize", content=nested), 400, "invalid_request")


def test_an_explicit_null_takes_the_default_as_in_vllm(http: httpx.Client, offline: LLM) -> None:
    ids = offline.tokenizer.encode(TEXT)
    nulls = {"prompt": TEXT, "messages": None, "add_special_tokens": None, "model": None}
    body = http.post("/tokenize", json={**nulls, "return_token_strs": None}).json()
    assert body["tokens"] == ids and body["token_strs"] is None
    chat = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": None}
    conversation = [ChatMessage("user", "Hi")]
    assert http.post("/tokenize", json=chat).json()["tokens"] == render_chat(
        offline.tokenizer, conversation
    )
