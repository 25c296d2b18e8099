"""Many concurrent streams with early disconnects, aborts of non-streamed requests, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton import LLM, SamplingParams
from baton.config import BatonConfig

PROMPTS = ["The little dog", "One day, a girl named Sue", "Lily and Tom", "The sun was hot"]
STREAMS = 64
MAX_TOKENS = 24
# Streams that hang up ask for many tokens: had they not been aborted, the token count shows it.
HANG_UP_MAX_TOKENS = 400
FAMILIES = {
    "baton:num_requests_running": "gauge",
    "baton:num_requests_waiting": "gauge",
    "baton:kv_cache_usage_perc": "gauge",
    "baton:prompt_tokens": "counter",
    "baton:generation_tokens": "counter",
    "baton:request_success": "counter",
    "baton:time_to_first_token_seconds": "histogram",
    "baton:inter_token_latency_seconds": "histogram",
    "baton:e2e_request_latency_seconds": "histogram",
}


def base_url(config: BatonConfig) -> str:
    """The server's HTTP root."""
    return f"http://{config.host}:{config.port}"


def scrape(client: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name (label sets summed), e.g. "baton:prompt_tokens_total"."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def wait_idle(client: httpx.Client, timeout: float = 15.0) -> dict[str, float]:
    """Metrics once no request runs or waits and no KV page is held."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(client)
        idle = (
            samples["baton:num_requests_running"] == 0
            and samples["baton:num_requests_waiting"] == 0
            and samples["baton:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


async def one_stream(client: httpx.AsyncClient, index: int) -> tuple[int, str, dict | None]:
    """Stream one completion; every fourth stream hangs up after three chunks.

    Returns (chunks read, text, usage or None if it hung up)."""
    hang_up = index % 4 == 0
    body = {
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_tokens": HANG_UP_MAX_TOKENS if hang_up else MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, text, usage = 0, "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            chunks += 1
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            usage = chunk.get("usage") or usage
            if hang_up and chunks == 3:
                break  # leaving the block closes the connection mid-stream
    return chunks, text, None if hang_up else usage


def test_concurrent_streams_with_disconnects(frontend: BatonConfig, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {o.text for o in offline.generate(PROMPTS, params)}

    async def run_all() -> list[tuple[int, str, dict | None]]:
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(
            base_url=base_url(frontend), limits=limits, timeout=120
        ) as client:
            return await asyncio.gather(*(one_stream(client, i) for i in range(STREAMS)))

    with httpx.Client(base_url=base_url(frontend), timeout=30) as client:
        before = wait_idle(client)
        results = asyncio.run(run_all())
        after = wait_idle(client)
    completed = [(text, usage) for _, text, usage in results if usage is not None]
    hung_up = STREAMS // 4
    assert len(completed) == STREAMS - hung_up
    for text, usage in completed:
        assert usage["completion_tokens"] == MAX_TOKENS
        assert text in expected
    assert after["baton:kv_cache_usage_perc"] == 0
    assert after["baton:num_requests_running"] == 0
    generated = after["baton:generation_tokens_total"] - before["baton:generation_tokens_total"]
    assert generated < len(completed) * MAX_TOKENS + hung_up * HANG_UP_MAX_TOKENS // 2


def test_a_stream_that_fell_behind_is_aborted_when_its_client_leaves(
    frontend: BatonConfig,
) -> None:
    """A reader that stops reading gets its choices paused on the server; hanging up then
    must abort them at once, not leave them paused with their pages held."""
    # Enough bytes (top-5 logprobs on every token) to fill the socket buffers on the way.
    choices, max_tokens = 16, 480
    body = json.dumps(
        {
            "model": frontend.served_model_name,
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "n": choices,
            "logprobs": 5,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with httpx.Client(base_url=base_url(frontend), timeout=30) as client:
        before = wait_idle(client)
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        reader.connect((frontend.host, frontend.port))
        reader.sendall(head + body)  # and reads nothing
        deadline = time.monotonic() + 30
        while scrape(client)["baton:num_requests_paused"] == 0:
            assert time.monotonic() < deadline, "the unread choices were never paused"
            time.sleep(0.1)
        reader.close()
        after = wait_idle(client)
    assert after["baton:num_requests_running"] == 0
    assert after["baton:kv_cache_usage_perc"] == 0
    generated = after["baton:generation_tokens_total"] - before["baton:generation_tokens_total"]
    assert generated < choices * max_tokens  # aborted, not run to the end


def test_non_streamed_request_aborts_when_client_leaves(frontend: BatonConfig) -> None:
    long = {"prompt": "Once", "max_tokens": 500, "ignore_eos": True}
    with httpx.Client(base_url=base_url(frontend), timeout=30) as client:
        before = wait_idle(client)
        with contextlib.suppress(httpx.ReadTimeout):  # the client gives up and hangs up
            client.post("/v1/completions", json=long, timeout=0.2)
        after = wait_idle(client)
    generated = after["baton:generation_tokens_total"] - before["baton:generation_tokens_total"]
    assert generated < 500  # aborted, not run to the end
    assert after["baton:kv_cache_usage_perc"] == 0
    finished = after["baton:request_success_total"] - before["baton:request_success_total"]
    assert finished == 0  # an aborted request is not a success


def test_metrics_families_and_counters(frontend: BatonConfig, offline: LLM) -> None:
    with httpx.Client(base_url=base_url(frontend), timeout=30) as client:
        families = {
            family.name: family.type
            for family in text_string_to_metric_families(client.get("/metrics").text)
        }
        for name, kind in FAMILIES.items():
            assert families.get(name) == kind, name
        before = wait_idle(client)
        body = {"prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        after = wait_idle(client)
    prompt_tokens = len(offline.tokenizer.encode(body["prompt"]))
    increments = {name: after[name] - before.get(name, 0.0) for name in after}
    assert increments["baton:prompt_tokens_total"] == prompt_tokens
    assert increments["baton:generation_tokens_total"] == 5
    assert increments["baton:request_success_total"] == 1
    assert increments["baton:time_to_first_token_seconds_count"] == 1
    assert increments["baton:inter_token_latency_seconds_count"] == 4
    assert increments["baton:e2e_request_latency_seconds_count"] == 1
