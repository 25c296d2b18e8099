"""The HTTP frontend through the official `openai` client, checked against the offline `LLM`
(chat completions: test_frontend_openai_chat.py)."""

from __future__ import annotations

import math

import openai
import pytest
from helpers.frontend_http import MODEL_NAME, greedy

from baton import LLM

PROMPT = "Once upon a time"
PROMPTS = ["The little dog", "Lily and Tom went to the park"]


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


def test_special_tokens_in_the_prompt_and_the_output_as_vllm(
    client: openai.OpenAI, offline: LLM
) -> None:
    """vLLM's add_special_tokens=false leaves out the BOS a text prompt gets; its
    skip_special_tokens=false shows special tokens in the text (EOS forced here by a bias)."""
    eos = offline.engine.checkpoint.eos_token_ids[0]
    eos_text = offline.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text and offline.tokenizer.decode([eos]) == ""

    def complete(**extra: object) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            logit_bias={str(eos): 100},
            extra_body={"ignore_eos": True, **extra},
        )

    default, kept = complete(), complete(skip_special_tokens=False)
    assert default.choices[0].text == "" and kept.choices[0].text == eos_text * 3
    bare = complete(add_special_tokens=False)
    with_bos = offline.tokenizer.encode(PROMPT)
    assert default.usage.prompt_tokens == len(with_bos)
    assert bare.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT, False))
    assert bare.usage.prompt_tokens == len(with_bos) - 1


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


def test_logprob_tokens_as_token_ids(client: openai.OpenAI, offline: LLM) -> None:
    """vLLM's `return_tokens_as_token_ids`: every logprob token (chosen, alternatives, an echoed
    prompt's) reads "token_id:<id>"; the text offsets still count the tokens' texts."""
    expected = greedy(offline, PROMPT, max_tokens=6, logprobs=2, ignore_eos=True)
    request = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2,
    }  # fmt: skip
    plain = client.completions.create(**request, extra_body={"ignore_eos": True})
    as_ids = client.completions.create(
        **request, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
    )
    logprobs = as_ids.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{token}" for token in expected.token_ids]
    assert logprobs.text_offset == plain.choices[0].logprobs.text_offset
    for top, entry in zip(logprobs.top_logprobs, expected.logprobs):
        assert {f"token_id:{token}" for token, _ in entry.top} <= set(top)
    echoed = client.completions.create(
        **{**request, "max_tokens": 1},
        echo=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    prompt_ids = offline.tokenizer.encode(PROMPT)
    tokens = echoed.choices[0].logprobs.tokens
    assert tokens[: len(prompt_ids)] == [f"token_id:{token}" for token in prompt_ids]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and entry.bytes is not None
        assert all(alt.token.startswith("token_id:") for alt in entry.top_logprobs)
    streamed = client.completions.create(
        **request, stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
    )
    tokens = [t for chunk in streamed if chunk.choices for t in chunk.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
    streamed_chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    chat_tokens = [
        entry.token
        for chunk in streamed_chat
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert chat_tokens == [entry.token for entry in chat.choices[0].logprobs.content]


def test_truncate_prompt_tokens_serves_the_prompts_tail(
    client: openai.OpenAI, offline: LLM
) -> None:
    prompt_ids = offline.tokenizer.encode(PROMPT * 3)
    expected = greedy(offline, prompt_ids[-5:], max_tokens=6)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT * 3,
        max_tokens=6,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 0}
        )
