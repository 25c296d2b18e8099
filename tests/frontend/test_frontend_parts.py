"""The frontend's parts without a pipeline: request mapping, errors, logprob text, metrics, and
the app in-process (no lifespan, so no pipeline client)."""

from __future__ import annotations

import asyncio
import importlib.metadata

import httpx
import msgspec
import pytest
from helpers import SAMPLE_STATS
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.cli import build_parser
from baton.client import BatonClient, ServerError
from baton.config import BatonConfig
from baton.config_cli import config_from_args
from baton.frontend.app import create_app, served_model_name
from baton.frontend.body_limit import default_body_limit
from baton.frontend.chat_protocol import ChatCompletionRequest
from baton.frontend.errors import OpenAIError, from_server_error, from_validation_error
from baton.frontend.metrics import FrontendMetrics
from baton.frontend.params import NO_DEFAULTS, chat_choices, completion_choices
from baton.frontend.protocol import CompletionRequest
from baton.frontend.tools import NO_TOOLS
from baton.messages import GenerateDelta
from baton.scheduler_stats import AggregateStats, merge_replica_stats


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
    stats = SAMPLE_STATS
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
    assert samples[("baton:engine_step_seconds", None)] == 0.0
    assert samples[("baton:num_requests_waiting", None)] == 1
    assert samples[("baton:num_requests_paused", None)] == 1
    assert samples[("baton:prefix_cache_hits_total", None)] == 8
    assert samples[("baton:spec_decode_num_drafts_total", None)] == 5
    assert samples[("baton:spec_decode_num_draft_tokens_total", None)] == 20
    assert samples[("baton:spec_decode_num_accepted_tokens_total", None)] == 12
    without_stats = metrics.render(None).decode()
    assert "baton:num_requests_running" not in without_stats


def test_metrics_label_each_data_parallel_replica_as_an_engine() -> None:
    """A merged reply of two replicas: each its own series, labelled engine="0" and "1"."""
    parts = [
        msgspec.structs.replace(SAMPLE_STATS, replica=1, waiting_requests=5),
        msgspec.structs.replace(SAMPLE_STATS, replica=0),
    ]
    merged = merge_replica_stats(parts)
    samples = {
        (sample.name, sample.labels.get("engine")): sample.value
        for family in text_string_to_metric_families(FrontendMetrics("m").render(merged).decode())
        for sample in family.samples
        if sample.name.startswith("baton:num_requests_waiting")
        or sample.name.startswith("baton:generation_tokens")
    }
    assert samples == {
        ("baton:num_requests_waiting", "0"): 1,
        ("baton:num_requests_waiting", "1"): 5,
        ("baton:generation_tokens_total", "0"): 40,
        ("baton:generation_tokens_total", "1"): 40,
    }
    assert merged.waiting_requests == 6


def app_client(pipeline: object = None, **settings: object) -> httpx.AsyncClient:
    """The app in-process: its lifespan does not run, so its pipeline client is `pipeline`."""

    async def never_connects() -> BatonClient:
        raise AssertionError("the lifespan does not run in-process")

    config = BatonConfig(**settings)
    app = create_app(config, never_connects, 64, RANDOM_MODEL_NAME)
    app.state.frontend.client = pipeline
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


class StatsOnlyPipeline:
    """A pipeline client that answers stats only: its engine step has run `step_seconds`."""

    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds

    async def stats(self) -> AggregateStats:
        return msgspec.structs.replace(SAMPLE_STATS, engine_step_seconds=self.step_seconds)


@pytest.mark.parametrize(("step_seconds", "status"), [(0.0, 200), (29.0, 200), (31.0, 503)])
def test_health_is_503_once_an_engine_step_runs_past_the_watchdog(
    step_seconds: float, status: int
) -> None:
    async def main() -> httpx.Response:
        pipeline = StatsOnlyPipeline(step_seconds)
        async with app_client(pipeline, watchdog_timeout=30.0) as client:
            return await client.get("/health")

    response = asyncio.run(main())
    assert response.status_code == status
    if status == 503:
        message = response.json()["error"]["message"]
        assert message == "an engine step has run for 31.0 s, past --watchdog-timeout (30 s)"


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
            version = await client.get("/version", headers=key)
            statuses["version"] = version.json()["version"]
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
        "version": importlib.metadata.version("baton"),
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


def test_allowed_tokens_and_bad_words_reach_the_params() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
    request = ChatCompletionRequest.model_validate(
        {**body, "allowed_token_ids": [4, 9], "bad_words": ["dark", "night"]}
    )
    for choice in chat_choices(request, NO_DEFAULTS, NO_TOOLS):
        assert choice.params.allowed_token_ids == [4, 9]
        assert choice.params.bad_words == ["dark", "night"]


def test_return_tokens_as_token_ids_is_the_servers_default_a_request_overrides() -> None:
    """--return-tokens-as-token-ids reaches the app; a request's own field wins either way
    (the layout itself: test_frontend_openai.py)."""
    config = config_from_args(build_parser().parse_args(["launch", "--return-tokens-as-token-ids"]))
    assert config.return_tokens_as_token_ids
    for server_default in (False, True):
        config = BatonConfig(return_tokens_as_token_ids=server_default)
        state = create_app(config, None, 64, RANDOM_MODEL_NAME).state.frontend  # type: ignore[arg-type]
        assert state.tokens_as_ids(None) is server_default
        assert state.tokens_as_ids(True) is True and state.tokens_as_ids(False) is False


def test_cors_lets_a_browser_call_the_api_as_vllms_defaults_do() -> None:
    """Any origin by default; a preflight needs no key; a refusal still carries the header the
    browser needs to read it; a restricted server answers only its origins."""
    preflight = {
        "Origin": "http://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }

    async def main() -> list[httpx.Response]:
        async with app_client(api_key="k") as client:
            allowed = await client.options("/v1/chat/completions", headers=preflight)
            refused = await client.post(
                "/v1/completions", json={"prompt": "hi"}, headers={"Origin": "http://ui.example"}
            )
        restricted = ("http://ui.example",)
        args = build_parser().parse_args(["launch", "--allowed-origins", '["http://ui.example"]'])
        assert config_from_args(args).allowed_origins == restricted
        async with app_client(allowed_origins=restricted) as client:
            own = await client.options("/v1/completions", headers=preflight)
            foreign = await client.options(
                "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
            )
        return [allowed, refused, own, foreign]

    allowed, refused, own, foreign = asyncio.run(main())
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "*"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert own.status_code == 200
    assert own.headers["access-control-allow-origin"] == "http://ui.example"
    assert foreign.status_code == 400 and "access-control-allow-origin" not in foreign.headers
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--allowed-origins", "*"])  # not a JSON list
