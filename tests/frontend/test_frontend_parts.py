"""The frontend's parts without a pipeline: request mapping, errors, logprob text, metrics, and
the app in-process (no lifespan, so no pipeline client)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import SAMPLE_CPU, SAMPLE_PLAN
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from baton.chat_options import ChatOptions
from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.client import BatonClient, ServerError
from baton.config import BatonConfig
from baton.frontend.app import create_app, served_model_name
from baton.frontend.body_limit import default_body_limit
from baton.frontend.chat import ChatChunkWriter, chat_body
from baton.frontend.errors import OpenAIError, from_server_error, from_validation_error
from baton.frontend.generation import ChoiceOutput
from baton.frontend.metrics import FrontendMetrics
from baton.frontend.params import chat_choices, completion_choices
from baton.frontend.protocol import ChatCompletionRequest, CompletionRequest
from baton.messages import AggregateStats, ChatMessage, GenerateDelta, Usage


def test_completion_choices_index_and_seed_per_choice() -> None:
    request = CompletionRequest(prompt=["a", "b"], n=2, seed=2**63 - 1, temperature=0.5)
    choices = completion_choices(request, max_choices=4)
    assert [(c.index, c.group, c.prompt) for c in choices] == [
        (0, 0, "a"),
        (1, 0, "a"),
        (2, 1, "b"),
        (3, 1, "b"),
    ]
    # Choice i samples with seed + i, wrapped into SamplingParams' range.
    assert [c.params.seed for c in choices] == [2**63 - 1, 0, 2**63 - 1, 0]
    assert all(c.params.temperature == 0.5 and c.params.max_tokens == 16 for c in choices)
    (single,) = completion_choices(CompletionRequest(prompt=[5, 6, 7], stop="x", top_k=3), 1)
    assert single.prompt == [5, 6, 7] and single.params.stop == ["x"]
    assert single.params.top_k == 3 and single.params.top_p == 1.0
    assert not single.params.include_stop_str_in_output
    keep = CompletionRequest(prompt="a", stop=",", include_stop_str_in_output=True)
    assert completion_choices(keep, 1)[0].params.include_stop_str_in_output
    # The scheduling fields reach every choice (vLLM's `priority`, Baton's `deadline_ms`).
    urgent = CompletionRequest(prompt="a", n=2, priority=-3, deadline_ms=250.0)
    assert {(c.priority, c.deadline_ms) for c in completion_choices(urgent, 2)} == {(-3, 250.0)}
    assert (single.priority, single.deadline_ms) == (0, None)
    # One choice more than the server admits at once is refused before any is built.
    with pytest.raises(OpenAIError, match="more choices") as refused:
        completion_choices(request, max_choices=3)
    assert (refused.value.status, refused.value.param) == (400, "prompt")


def test_chat_choices_messages_and_limits() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "system", "content": None}, {"role": "user", "content": parts}],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "logprobs": True,
        }
    )
    (choice,) = chat_choices(request)
    assert choice.prompt == [ChatMessage("system", ""), ChatMessage("user", "a\nb")]
    assert choice.params.max_tokens == 5  # max_completion_tokens wins
    assert choice.params.logprobs == 0  # logprobs without top_logprobs: the chosen token only


def chat_request(**fields: object) -> ChatCompletionRequest:
    """A chat request of one user message, with `fields` (JSON values)."""
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def test_chat_template_options_reach_every_choice() -> None:
    kwargs = {"enable_thinking": False, "add_generation_prompt": True}
    request = chat_request(
        n=2, add_generation_prompt=False, continue_final_message=True, chat_template_kwargs=kwargs
    )
    expected = ChatOptions(
        add_generation_prompt=False, continue_final_message=True, chat_template_kwargs=kwargs
    )
    assert [choice.chat for choice in chat_choices(request)] == [expected, expected]
    assert chat_choices(chat_request())[0].chat == ChatOptions()


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"continue_final_message": True}, "continue_final_message", "Cannot set both"),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
            "Cannot set both",
        ),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs", "templates"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "`messages`"),
    ],
)
def test_chat_options_that_cannot_be_honoured_are_400(
    fields: dict, param: str, message: str
) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat_choices(chat_request(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert message in refused.value.message


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "tools"),
        ({"tools": []}, "tools", "tools are not supported"),
        ({"chat_template": "{{ messages }}"}, "chat_template", "does not accept request chat"),
        ({"chat_template_kwargs": {"x": [2**70]}}, "chat_template_kwargs", "64 bits"),
        ({"stream_options": {"include_usage": False}}, "stream_options", "`stream=True`"),
        ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options", ""),
    ],
)
def test_chat_fields_vllm_refuses(fields: dict, param: str, message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        chat_request(**fields)
    error = from_validation_error(raised.value)
    assert (error.status, error.param) == (400, param)
    assert message in error.message


def test_chat_fields_vllm_accepts() -> None:
    """tool_choice "none" (or null) needs no tools, and an empty stream_options says nothing:
    vLLM accepts both without `stream`; the chat template kwargs take any JSON."""
    for fields in (
        {"tool_choice": "none"},
        {"tool_choice": None, "chat_template": None},
        {"stream_options": {}},
        {"stream_options": None},
        {"chat_template_kwargs": {"enable_thinking": False, "n": -(2**63), "d": [{"a": None}]}},
    ):
        request = chat_request(**fields)
        assert not request.include_usage
    streamed = chat_request(stream=True, stream_options={"include_usage": True})
    assert streamed.include_usage


def test_the_reply_role_and_echo_follow_vllm() -> None:
    """After a generation prompt the reply is the assistant's; without one it continues the
    final message's role. `echo` repeats the final message when it has the reply's role."""
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    user_then_assistant = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": parts},
    ]
    cases = [
        ({}, "assistant", ""),  # the final message is the user's: nothing to echo
        ({"add_generation_prompt": False}, "user", "Hi"),
        ({"messages": user_then_assistant}, "assistant", "Hel\nlo"),
        (
            {"messages": user_then_assistant, "add_generation_prompt": False},
            "assistant",
            "Hel\nlo",
        ),
    ]
    for fields, role, echoed in cases:
        request = chat_request(echo=True, **fields)
        assert (request.reply_role, request.echoed) == (role, echoed), fields
        assert chat_request(**fields).echoed == ""  # without echo


def test_echo_prefixes_the_content_whole_and_streamed() -> None:
    request = chat_request(
        messages=[{"role": "assistant", "content": "Once"}],
        add_generation_prompt=False,
        continue_final_message=True,
        echo=True,
        n=2,
    )
    choices = chat_choices(request)
    usage = Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=0)
    envelope = {"id": "c", "object": "chat.completion", "created": 0, "model": "m"}
    outputs = [ChoiceOutput(i, 0, [7, 8], [" upon", " a"], [], "length", usage) for i in range(2)]
    body = chat_body(envelope, outputs, False, False, request.reply_role, request.echoed)
    messages = [choice["message"] for choice in body["choices"]]  # type: ignore[index]
    assert messages == [{"role": "assistant", "content": "Once upon a"}] * 2
    writer = ChatChunkWriter(envelope, choices, False, False, False, "assistant", "Once")
    first = GenerateDelta(request_id="c-1", token_ids=[7], text=" upon")
    last = GenerateDelta(
        request_id="c-1", token_ids=[8], text=" a", finished=True, finish_reason="length",
        usage=usage,
    )  # fmt: skip
    chunks = writer.chunks(1, first) + writer.chunks(1, last)
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks]
    # As vLLM: the role chunk, then the echoed content as the first content delta.
    assert deltas == [
        (1, {"role": "assistant", "content": ""}),
        (1, {"content": "Once"}),
        (1, {"content": " upon"}),
        (1, {"content": " a"}),
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    plain = ChatChunkWriter(envelope, choices, False, False, False, "assistant", "")
    assert len(plain.chunks(0, first)) == 2  # no echo: no echo chunk


def test_an_explicit_null_takes_the_default_as_in_vllm() -> None:
    nulls = b'"n": null, "stream": null, "logprobs": null, "max_tokens": null, "seed": null'
    completion = CompletionRequest.model_validate_json(b'{"prompt": "hi", ' + nulls + b"}")
    assert completion == CompletionRequest(prompt="hi")
    chat = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "hi"}], "echo": null, ' + nulls + b"}"
    )
    assert (chat.n, chat.stream, chat.logprobs, chat.output_limit) == (1, False, False, None)
    with pytest.raises(ValidationError) as raised:  # a required field stays required
        CompletionRequest.model_validate_json(b'{"prompt": null}')
    assert from_validation_error(raised.value).param == "prompt"


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate_json(b'{"prompt": 5}')
    error = from_validation_error(raised.value)
    assert error.status == 400 and error.param == "prompt"
    assert error.message.startswith("prompt: Input should be")
    assert "[" not in error.message  # union branches ("list[int]") are not shown
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate_json(b'{"messages": [{"role": "user"}], "n": 0}')
    assert from_validation_error(raised.value).param == "n"


@pytest.mark.parametrize(
    ("code", "status"),
    [("invalid_request", 400), ("prompt_too_long", 400), ("overloaded", 429), ("internal", 500)],
)
def test_server_error_statuses(code: str, status: int) -> None:
    error = from_server_error(ServerError(code, "why"))
    assert (error.status, error.code) == (status, code)
    assert error.payload()["error"]["message"] == "why"


def test_metrics_observe_requests_and_stats() -> None:
    metrics = FrontendMetrics("m")
    tracker = metrics.track()
    tracker.observe(GenerateDelta(request_id="r", token_ids=[1, 2], text="ab"))
    tracker.observe(GenerateDelta(request_id="r", token_ids=[3], text="c"))
    tracker.observe(
        GenerateDelta(
            request_id="r", token_ids=[4], text="d", finished=True, finish_reason="length"
        )
    )
    stats = AggregateStats(
        running_requests=2, waiting_requests=1, paused_requests=1, total_pages=10, free_pages=5,
        cached_pages=1, used_pages=4, peak_used_pages=7, peak_memory_bytes=3 << 30,
        finished_requests=3, prompt_tokens=30, cached_prompt_tokens=8, generated_tokens=40,
        preemptions=1, spec_decode_num_drafts=5, spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=12, uptime=1.0, generation_throughput=40.0,
        cpu=SAMPLE_CPU, compute_plan=SAMPLE_PLAN,
    )  # fmt: skip
    samples = {
        (sample.name, sample.labels.get("finished_reason")): sample.value
        for family in text_string_to_metric_families(metrics.render(stats).decode())
        for sample in family.samples
    }
    assert samples[("baton:time_to_first_token_seconds_count", None)] == 1
    assert samples[("baton:inter_token_latency_seconds_count", None)] == 3
    assert samples[("baton:e2e_request_latency_seconds_count", None)] == 1
    assert samples[("baton:request_success_total", "length")] == 1
    assert samples[("baton:kv_cache_usage_perc", None)] == pytest.approx(0.4)
    assert samples[("baton:kv_cache_peak_usage_perc", None)] == pytest.approx(0.7)
    assert samples[("baton:peak_memory_bytes", None)] == 3 << 30
    assert samples[("baton:num_requests_waiting", None)] == 1
    assert samples[("baton:num_requests_paused", None)] == 1
    assert samples[("baton:prefix_cache_hits_total", None)] == 8
    assert samples[("baton:spec_decode_num_drafts_total", None)] == 5
    assert samples[("baton:spec_decode_num_draft_tokens_total", None)] == 20
    assert samples[("baton:spec_decode_num_accepted_tokens_total", None)] == 12
    without_stats = metrics.render(None).decode()
    assert "baton:num_requests_running" not in without_stats


def app_client(**settings: object) -> httpx.AsyncClient:
    """The app in-process: its lifespan does not run, so it has no pipeline client."""

    async def never_connects() -> BatonClient:
        raise AssertionError("the lifespan does not run in-process")

    config = BatonConfig(**settings)
    app = create_app(config, never_connects, 64, RANDOM_MODEL_NAME)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


def test_app_in_process_errors() -> None:
    async def main() -> dict[str, int]:
        statuses = {}
        async with app_client(api_key="k", max_request_body_bytes=100) as client:
            key = {"Authorization": "Bearer k"}
            valid = {"prompt": "hi"}
            statuses["no_key"] = (await client.post("/v1/completions", json=valid)).status_code
            big = {"prompt": "x" * 200}
            response = await client.post("/v1/completions", json=big, headers=key)
            statuses["too_big"] = response.status_code
            response = await client.post("/v1/completions", json={"prompt": 1}, headers=key)
            statuses["invalid"] = response.status_code
            statuses["pipeline_down"] = (
                await client.post("/v1/completions", json=valid, headers=key)
            ).status_code
            statuses["health"] = (await client.get("/health")).status_code
            statuses["metrics"] = (await client.get("/metrics")).status_code
            models = (await client.get("/v1/models", headers=key)).json()
            statuses["models"] = models["data"][0]["max_model_len"]
        return statuses

    assert asyncio.run(main()) == {
        "no_key": 401,
        "too_big": 413,
        "invalid": 400,
        "pipeline_down": 503,
        "health": 503,
        "metrics": 200,
        "models": 64,
    }


def test_served_model_name_fallbacks() -> None:
    named = BatonConfig(model="org/model", served_model_name="x")
    assert served_model_name(named, "checkpoint") == "x"
    assert served_model_name(BatonConfig(model="org/model"), "checkpoint") == "org/model"
    assert served_model_name(BatonConfig(), "SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"


def test_the_default_body_limit_fits_the_longest_prompt_the_context_holds() -> None:
    """Once a flat 32 MiB: a 32 MB prompt was read and tokenized for 35 s before its refusal."""
    tokenizer = build_byte_tokenizer()
    limit = default_body_limit(64)
    longest_fitting = 64 * tokenizer.max_chars_per_token
    assert longest_fitting * 12 < limit < 2 << 20
    # A long context's worst case would buffer hundreds of MB per request: capped.
    assert default_body_limit(1 << 20) == 32 << 20

    async def statuses() -> tuple[int, int]:
        async with app_client() as client:
            # The worst escaping JSON has: 12 bytes for each character.
            escaped = b'{"prompt": "' + b"\\ud83d\\ude00" * longest_fitting + b'"}'
            fits = await client.post("/v1/completions", content=escaped)
            too_big = await client.post("/v1/completions", content=b" " * (limit + 1))
            return fits.status_code, too_big.status_code

    assert asyncio.run(statuses()) == (503, 413)  # 503: past the limit, no pipeline in-process


def test_penalties_and_a_clamped_logit_bias_reach_the_params() -> None:
    """vLLM clamps logit_bias values into OpenAI's [-100, 100]; keys are token ids."""
    request = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "logit_bias": {"5": 250, "6": -1e9, "7": 0.5},
        }
    )
    (choice,) = completion_choices(request, max_choices=1)
    params = choice.params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1)
    assert params.repetition_penalty == 1.2
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 0.5}
