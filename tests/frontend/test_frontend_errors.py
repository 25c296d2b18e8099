"""Every error class over raw HTTP: OpenAI's error JSON with the right status, never a 500.

The server (built-in model, 512-token context) requires an API key and admits one running and
one waiting request; the `http` client sends the key. vLLM's chat template fields have their
own module (test_frontend_chat_errors.py).
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import msgspec
import pytest
from helpers.frontend_http import CHAT, VALID, assert_error, auth, base_url

from baton.config import BatonConfig
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.cpu.compute_plan import choose_compute_plan
from baton.hardware import ComputePlan, CpuCapabilities
from baton.sampling_params import MAX_LOGIT_BIAS_ENTRIES


def test_malformed_json_is_400(http: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = http.post(
            path, content=b'{"prompt": "hi",', headers={"content-type": "application/json"}
        )
        assert "JSON" in assert_error(response, 400, "invalid_request")["message"]
    assert_error(http.post("/v1/completions", content=b"[1, 2]"), 400, "invalid_request")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages.0.role"),
        ("/v1/completions", {**VALID, "max_tokens": "four"}, "max_tokens"),
        ("/v1/completions", {**VALID, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {**VALID, "prompt": 5}, "prompt"),
        ("/v1/completions", {**VALID, "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {**VALID, "stream": "yes"}, "stream"),
        ("/v1/completions", {**VALID, "stop": 3}, "stop"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, None),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            None,
        ),
        ("/v1/completions", {**VALID, "temperature": -1}, "temperature"),
        ("/v1/completions", {**VALID, "prompt": [1, 2**70]}, "prompt"),
        ("/v1/completions", {**VALID, "top_k": 2**70}, "top_k"),
        ("/v1/completions", {**VALID, "max_tokens": 2**70}, "max_tokens"),
        ("/v1/completions", {**VALID, "stop_token_ids": [2**70]}, "stop_token_ids.0"),
        ("/v1/completions", {**VALID, "top_p": 0}, "top_p"),
        ("/v1/completions", {**VALID, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {**VALID, "top_k": -2}, "top_k"),
        ("/v1/completions", {**VALID, "min_p": 2}, "min_p"),
        ("/v1/completions", {**VALID, "n": 0}, "n"),
        # More choices than the scheduler can hold (1 running + 1 waiting here).
        ("/v1/completions", {**VALID, "prompt": ["a", "b", "c"]}, "prompt"),
        ("/v1/completions", {**VALID, "prompt": [[1], [2]], "n": 2}, "prompt"),
        ("/v1/completions", {**VALID, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**VALID, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**VALID, "seed": -1}, "seed"),
        ("/v1/completions", {**VALID, "prompt": []}, "prompt"),
        ("/v1/completions", {**VALID, "stop": [""]}, "stop"),
        ("/v1/completions", {**VALID, "echo": "yes"}, "echo"),
        ("/v1/completions", {**VALID, "max_tokens": 0, "echo": False}, "max_tokens"),
        ("/v1/completions", {**VALID, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {**VALID, "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {**VALID, "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"the": 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1.0}}, "logit_bias"),
        ("/v1/completions", {**VALID, "logit_bias": {"3": "high"}}, "logit_bias.3"),
        (
            "/v1/completions",
            {**VALID, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
            "logit_bias",
        ),
        ("/v1/completions", {**VALID, "stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream_options": {"include_usage": False}},
            "stream_options",
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
        ("/v1/completions", {**VALID, "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [-1]}, "allowed_token_ids.0"),
        ("/v1/chat/completions", {**CHAT, "bad_words": ["  "]}, "bad_words"),
        ("/v1/completions", {**VALID, "bad_words": "no"}, "bad_words"),
        # vLLM's options Baton does not implement are refused, never silently ignored.
        ("/v1/completions", {**VALID, "use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {**CHAT, "use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {**VALID, "length_penalty": 2.0}, "length_penalty"),
        ("/v1/completions", {**VALID, "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ("/v1/completions", {**VALID, "best_of": 0}, "best_of"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_invalid_fields_are_400(
    http: httpx.Client, path: str, body: dict, param: str | None
) -> None:
    error = assert_error(http.post(path, json=body), 400, "invalid_request")
    if param is not None:
        assert error["param"] == param
        assert param.split(".")[0] in error["message"]


def test_non_finite_numbers_are_400(http: httpx.Client) -> None:
    for value in (b"Infinity", b"NaN", b"1e999"):
        body = b'{"prompt": "hi", "temperature": ' + value + b"}"
        error = assert_error(http.post("/v1/completions", content=body), 400, "invalid_request")
        assert error["param"] == "temperature"


def test_pipeline_rejections_are_400(http: httpx.Client) -> None:
    out_of_vocabulary = http.post("/v1/completions", json={**VALID, "prompt": [1, 10**6]})
    assert "vocabulary" in assert_error(out_of_vocabulary, 400, "invalid_request")["message"]
    biased_past_the_vocabulary = {**VALID, "logit_bias": {str(10**6): 5.0}}
    response = http.post("/v1/completions", json=biased_past_the_vocabulary)
    error = assert_error(response, 400, "invalid_request")
    assert "logit_bias" in error["message"] and "vocabulary" in error["message"]
    allowed_past_the_vocabulary = {**VALID, "allowed_token_ids": [3, 10**6]}
    response = http.post("/v1/completions", json=allowed_past_the_vocabulary)
    error = assert_error(response, 400, "invalid_request")
    assert "allowed_token_ids" in error["message"] and "vocabulary" in error["message"]
    bad_role = {"messages": [{"role": "wizard", "content": "Hi"}]}
    assert_error(http.post("/v1/chat/completions", json=bad_role), 400, "invalid_request")
    too_long = {"prompt": [1] * 600, "max_tokens": 4}
    assert_error(http.post("/v1/completions", json=too_long), 400, "prompt_too_long")
    # A stream fails before it starts: a proper status, not a 200 with an error inside.
    streamed = http.post("/v1/completions", json={**too_long, "stream": True})
    assert_error(streamed, 400, "prompt_too_long")
    # Nor when another choice was admitted first: the stream waits for every choice's admission.
    for _ in range(30):  # which comes first, admission or refusal, varies from run to run
        mixed = {"prompt": [[1, 2, 3], [1] * 600], "max_tokens": 4, "stream": True}
        assert_error(http.post("/v1/completions", json=mixed), 400, "prompt_too_long")
    too_much_output = {"prompt": "Hi", "max_tokens": 600}
    assert_error(http.post("/v1/completions", json=too_much_output), 400, "prompt_too_long")
    # Finite in JSON, but not in the sampler's float32 / int64: once it failed its whole batch.
    # And 100,000 stop strings once slowed every other request tenfold: bounded now.
    for field, value in (("temperature", 1e39), ("top_k", 2**63 - 1), ("stop", ["x"] * 1000)):
        unrepresentable = http.post("/v1/completions", json={**VALID, field: value})
        assert field in assert_error(unrepresentable, 400, "invalid_request")["message"]


def test_a_priority_needs_the_priority_policy(http: httpx.Client) -> None:
    """vLLM's 400 under any other --scheduling-policy (this server's is fcfs): the tokenizer
    process refuses it, for HTTP and ZMQ clients alike."""
    for path, body in (("/v1/completions", VALID), ("/v1/chat/completions", CHAT)):
        refused = http.post(path, json={**body, "priority": -1})
        error = assert_error(refused, 400, "invalid_request")
        assert error["message"] == "Got priority -1 but Priority scheduling is not enabled."
        assert http.post(path, json={**body, "priority": 0}).status_code == 200


def test_unknown_model_and_route_are_404(http: httpx.Client) -> None:
    error = assert_error(
        http.post("/v1/completions", json={**VALID, "model": "gpt-17"}), 404, "model_not_found"
    )
    assert "gpt-17" in error["message"] and error["param"] == "model"
    chat = {**CHAT, "model": "gpt-17"}
    assert_error(http.post("/v1/chat/completions", json=chat), 404, "model_not_found")
    assert_error(http.post("/v1/nothing", json=VALID), 404, "not_found")
    assert_error(http.get("/v1/completions"), 405, "method_not_allowed")


def test_oversized_body_is_413(http: httpx.Client, restricted_frontend: BatonConfig) -> None:
    limit = restricted_frontend.max_request_body_bytes
    big = {**VALID, "prompt": "a" * (limit + 10)}
    assert_error(http.post("/v1/completions", json=big), 413, "request_too_large")

    def chunked():  # no Content-Length: the limit must hold on the streamed body too
        for _ in range(4):
            yield b" " * (limit // 2)
        yield b'{"prompt": "hi"}'

    assert_error(http.post("/v1/completions", content=chunked()), 413, "request_too_large")
    just_under = {**VALID, "user": "u" * (limit - 200)}
    assert http.post("/v1/completions", json=just_under).status_code == 200


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"GARBAGE\r\n\r\n",
    ],
)
def test_an_unparsable_request_gets_openai_error_json(
    restricted_frontend: BatonConfig, head: bytes
) -> None:
    """Once uvicorn's plain-text "Invalid HTTP request received."."""
    with socket.create_connection((restricted_frontend.host, restricted_frontend.port), 10) as s:
        s.sendall(head)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    head_text, _, body = reply.partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/json" in head_text.lower()
    error = msgspec.json.decode(body)["error"]
    assert error["code"] == "invalid_request" and error["message"]


def test_server_keeps_serving_after_errors(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=VALID)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
    # Without --served-model-name the API uses the --model given, or the built-in's name.
    assert [model["id"] for model in http.get("/v1/models").json()["data"]] == ["baton-random"]
    named = http.post("/v1/completions", json={**VALID, "model": "baton-random"})
    assert named.status_code == 200


def test_server_info_names_the_machine_and_the_compute_plan(http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    caps = detect_cpu_capabilities()  # the server runs here, under the same environment
    assert msgspec.convert(info["cpu"], CpuCapabilities) == caps
    # run_frontend asks for float32 (the built-in model's own dtype): packed where oneDNN can.
    plan = choose_compute_plan("float32", "float32", "cpu", caps)
    assert msgspec.convert(info["compute_plan"], ComputePlan) == plan
    assert info["model"] == "baton-random" and info["max_model_len"] == 512
    assert info["scheduler"]["total_pages"] > 0 and "cpu" not in info["scheduler"]


def test_api_key_is_required_on_v1_and_tokenization(restricted_frontend: BatonConfig) -> None:
    url = base_url(restricted_frontend)
    with httpx.Client(base_url=url, timeout=30) as client:
        assert_error(client.post("/v1/completions", json=VALID), 401, "invalid_api_key")
        assert_error(client.post("/tokenize", json={"prompt": "a"}), 401, "invalid_api_key")
        assert_error(client.post("/detokenize", json={"tokens": [1]}), 401, "invalid_api_key")
        headers = auth(restricted_frontend)
        assert client.post("/tokenize", json={"prompt": "a"}, headers=headers).status_code == 200
        wrong = {"Authorization": "Bearer nope"}
        assert_error(client.get("/v1/models", headers=wrong), 401, "invalid_api_key")
        # Refused before the body is read: malformed JSON without a key is still a 401.
        assert_error(client.post("/v1/completions", content=b"{"), 401, "invalid_api_key")
        response = client.post("/v1/completions", json=VALID, headers=auth(restricted_frontend))
        assert response.status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("path", ["/server_info", "/version", "/openapi.json"])
def test_api_key_is_required_on_what_describes_the_server(
    restricted_frontend: BatonConfig, path: str
) -> None:
    """The model's path, the CPU, the scheduler's state and the route table: only probes and
    scrapers (/health, /metrics) go without the key, as in vLLM."""
    with httpx.Client(base_url=base_url(restricted_frontend), timeout=30) as client:
        assert_error(client.get(path), 401, "invalid_api_key")
        assert client.get(path, headers=auth(restricted_frontend)).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_overloaded_is_429(restricted_frontend: BatonConfig) -> None:
    """One running and one waiting request at most: while a long request runs, a flood of
    others gets 429 (all but the one that fits in the waiting queue)."""
    headers = auth(restricted_frontend)
    long = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def flood() -> list[httpx.Response]:
        async with (
            httpx.AsyncClient(
                base_url=base_url(restricted_frontend), headers=headers, timeout=60
            ) as client,
            client.stream("POST", "/v1/completions", json=long) as running,
        ):
            assert running.status_code == 200
            await anext(running.aiter_lines())  # it runs: the only running slot is taken
            return await asyncio.gather(
                *(client.post("/v1/completions", json=VALID) for _ in range(6))
            )

    responses = asyncio.run(flood())
    statuses = sorted(response.status_code for response in responses)
    assert statuses.count(429) >= 4 and set(statuses) <= {200, 429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert_error(response, 429, "overloaded")
            assert response.headers["Retry-After"] == "1"
