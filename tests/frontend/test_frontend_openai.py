"""The HTTP frontend through the official `openai` client, checked against the offline `LLM`."""

from __future__ import annotations

import math

import openai
import pytest

from baton import LLM, RequestOutput, SamplingParams
from baton.chat_options import ChatOptions
from baton.config import BatonConfig
from baton.messages import ChatMessage
from baton.tokenizer_proc.chat import render_chat

PROMPT = "Once upon a time"
PROMPTS = ["The little dog", "Lily and Tom went to the park"]
MODEL_NAME = "stories-test"  # the `frontend` fixture's served_model_name


@pytest.fixture(scope="module")
def client(frontend: BatonConfig) -> openai.OpenAI:
    """An OpenAI client of the stories260K server."""
    assert frontend.served_model_name == MODEL_NAME
    base_url = f"http://{frontend.host}:{frontend.port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def greedy(offline: LLM, prompt: str | list[int], **params: object) -> RequestOutput:
    """The offline engine's greedy output: the reference."""
    return offline.generate(prompt, SamplingParams(temperature=0, **params))[0]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME
    assert model.model_extra["max_model_len"] == 512  # stories260K's context


def test_completion_equals_offline_greedy(client: openai.OpenAI, offline: LLM) -> None:
    expected = greedy(offline, PROMPT, max_tokens=40)
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0
    )
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(expected.token_ids)
    assert response.model == MODEL_NAME and response.object == "text_completion"


def test_penalties_and_logit_bias_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    """OpenAI's penalties and logit_bias (token ids as strings) and vLLM's repetition_penalty
    reach the sampler as the offline engine's params."""
    adjustments = {"presence_penalty": 0.7, "frequency_penalty": 1.2, "repetition_penalty": 1.4}
    expected = greedy(offline, PROMPT, max_tokens=40, logit_bias={9: 2.0}, **adjustments)
    plain = greedy(offline, PROMPT, max_tokens=40)
    assert expected.token_ids != plain.token_ids
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        presence_penalty=adjustments["presence_penalty"],
        frequency_penalty=adjustments["frequency_penalty"],
        logit_bias={"9": 2.0},
        extra_body={"repetition_penalty": adjustments["repetition_penalty"]},
    )
    assert response.choices[0].text == expected.text


def test_streamed_completion_with_usage(client: openai.OpenAI, offline: LLM) -> None:
    expected = greedy(offline, PROMPT, max_tokens=30, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == 30
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_token_id_prompt_and_several_prompts(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == greedy(offline, ids, max_tokens=20).text
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=20, temperature=0, n=2
    )
    # vLLM's indexing: prompt p's choice i is choice p * n + i.
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for index, choice in enumerate(response.choices):
        assert choice.text == greedy(offline, PROMPTS[index // 2], max_tokens=20).text
    lengths = [len(offline.tokenizer.encode(p)) for p in PROMPTS]
    assert response.usage.prompt_tokens == sum(lengths)  # each prompt counted once


def test_seeded_sampling_is_reproducible_per_choice(client: openai.OpenAI) -> None:
    def sample(n: int, seed: int) -> list[str]:
        response = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=1.0, n=n, seed=seed
        )
        return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]

    pair = sample(2, seed=1234)
    assert sample(2, seed=1234) == pair
    assert pair[0] != pair[1]
    # Choice i uses seed + i.
    assert sample(1, seed=1235) == [pair[1]]


def test_stop_string_and_stop_token(client: openai.OpenAI, offline: LLM) -> None:
    full = greedy(offline, PROMPT, max_tokens=60)
    stop = full.text[25:31]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop, "zzz"]
    )
    assert response.choices[0].text == full.text[: full.text.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    stop_token = full.token_ids[10]
    expected = greedy(offline, PROMPT, max_tokens=60, stop_token_ids=[stop_token])
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=60,
        temperature=0,
        extra_body={"stop_token_ids": [stop_token]},
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_completion_logprobs_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    expected = greedy(offline, PROMPT, max_tokens=12, logprobs=3, ignore_eos=True)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    for position, reference in enumerate(expected.logprobs):
        assert math.isclose(logprobs.token_logprobs[position], reference.logprob, abs_tol=1e-4)
        top = logprobs.top_logprobs[position]
        assert 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(max(top.values()), reference.logprob, abs_tol=1e-4)
        reference_top = sorted((lp for _, lp in reference.top), reverse=True)
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(reference_top, abs=1e-4)


def test_chat_equals_offline_on_rendered_prompt(client: openai.OpenAI, offline: LLM) -> None:
    messages = [
        {"role": "system", "content": "You tell stories."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me about a cat."}]},
    ]
    rendered = render_chat(
        offline.tokenizer,
        [ChatMessage("system", "You tell stories."), ChatMessage("user", "Tell me about a cat.")],
    )
    expected = greedy(offline, rendered, max_tokens=24)
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=24, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert response.usage.prompt_tokens == len(rendered)
    assert response.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_continues_and_echoes_the_final_message(client: openai.OpenAI, offline: LLM) -> None:
    """vLLM's continue_final_message (stories260K has no template: the fallback ends right
    after the final message's content) and echo: the reply, in that message's role, starts
    with its content, whole or streamed (the first content delta after the role chunk)."""
    opening = "Once upon a time, there was a"
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    rendered = render_chat(offline.tokenizer, [ChatMessage("assistant", opening)], options)
    expected = greedy(offline, rendered, max_tokens=16)
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "assistant", "content": opening}],
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        },
    }
    response = client.chat.completions.create(**request)
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", opening + expected.text)
    assert response.usage.prompt_tokens == len(rendered)
    assert response.usage.completion_tokens == len(expected.token_ids)  # the echo is no output
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert (deltas[0].role, deltas[0].content) == ("assistant", "")
    assert deltas[1].content == opening
    assert "".join(delta.content or "" for delta in deltas) == opening + expected.text
    # Without a generation prompt the reply goes on in the final message's role, as vLLM's.
    as_user = {**request, "messages": [{"role": "user", "content": opening}]}
    response = client.chat.completions.create(**as_user)
    assert response.choices[0].message.role == "user"
    assert response.choices[0].message.content.startswith(opening)


def test_chat_logprobs_and_n(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=10,
        temperature=0.8,
        seed=7,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 20
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) == 10
        assert "".join(entry.token for entry in content) == choice.message.content
        for entry in content:
            assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 2
            assert entry.logprob <= 0
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_streamed_chat_n2_covers_both_choices(client: openai.OpenAI) -> None:
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "n": 2,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**request)
    texts: dict[int, str] = {}
    roles: dict[int, str] = {}
    finished = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.delta.role is not None:
                assert choice.index not in texts  # each choice opens with its role chunk
                roles[choice.index] = choice.delta.role
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert finished == {0: "length", 1: "length"}
    # Seeded (choice i with seed + i): streamed and whole responses are the same two texts.
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert texts[0] != texts[1]


def test_per_request_stats_when_asked(client: openai.OpenAI) -> None:
    """Baton's `return_stats` extension: each choice carries its request's stats, in the final
    chunk when streamed; without it, no choice has any."""
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    ignore_eos = {"ignore_eos": True}
    plain = client.completions.create(**request, extra_body=ignore_eos)
    assert "stats" not in (plain.choices[0].model_extra or {})
    whole = client.completions.create(
        **request, n=2, extra_body={**ignore_eos, "return_stats": True}
    )
    for choice in whole.choices:
        stats = choice.model_extra["stats"]
        assert stats["generated_tokens"] == 12
        assert stats["prompt_tokens"] == whole.usage.prompt_tokens
        assert 0 <= stats["queue_time"] <= stats["time_to_first_token"] <= stats["e2e_latency"]
        assert stats["prompt_time"] > 0 and stats["decode_tokens_per_s"] > 0
    chunks = list(
        client.completions.create(
            **request, stream=True, extra_body={**ignore_eos, "return_stats": True}
        )
    )
    with_stats = [c.choices[0].model_extra.get("stats") for c in chunks if c.choices]
    assert all(stats is None for stats in with_stats[:-1])
    assert with_stats[-1]["generated_tokens"] == 12
    # A stop string ends the request before the scheduler knows: its stats still come.
    stop = plain.choices[0].text[4:8]
    assert stop.strip()
    stopped = client.completions.create(
        **request, stop=[stop], extra_body={**ignore_eos, "return_stats": True}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stats"]["prompt_tokens"] == stopped.usage.prompt_tokens
    chunks = list(
        client.completions.create(
            **request, stop=[stop], stream=True, extra_body={**ignore_eos, "return_stats": True}
        )
    )
    final = [c for c in chunks if c.choices][-1].choices[0]
    assert final.finish_reason == "stop" and final.model_extra["stats"] is not None
