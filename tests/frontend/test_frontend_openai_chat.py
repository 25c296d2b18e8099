"""Chat completions through the official `openai` client, checked against the offline `LLM`
on the rendered prompt: vLLM's chat template fields and echo, logprobs, n, streaming."""

from __future__ import annotations

import openai
from helpers.frontend_http import MODEL_NAME, greedy

from baton import LLM
from baton.chat_options import ChatOptions
from baton.messages import ChatMessage
from baton.tokenizer_proc.chat import render_chat


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


def test_chat_shows_special_tokens_when_asked(client: openai.OpenAI, offline: LLM) -> None:
    eos = offline.engine.checkpoint.eos_token_ids[0]
    eos_text = offline.tokenizer.decode([eos], skip_special_tokens=False)

    def reply(**extra: object) -> str | None:
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
            logit_bias={str(eos): 100},
            extra_body={"ignore_eos": True, **extra},
        )
        return response.choices[0].message.content

    assert reply() == "" and reply(skip_special_tokens=False) == eos_text * 2
