"""The tokenizer process on prompt length: vLLM's context-length checks and wording, text
refused before tokenizing when it cannot fit, and large prompts tokenized on a worker thread
beside the loop when they may."""

from __future__ import annotations

import select
import time

import pytest
from helpers.tokenizer_frames import (
    CLIENT,
    MAX_MODEL_LEN,
    failure,
    generate_frame,
    single,
    to_frame,
)

from baton.messages import AbortRequest
from baton.process_messages import AbortRid, TokenizedRequest, make_rid
from baton.tokenizer_proc.service import OFFLOAD_PROMPT_CHARS, TokenizerService


def test_prompt_length_limits(service: TokenizerService) -> None:
    fits = service.handle(
        CLIENT, generate_frame(prompt_token_ids=[1] * 63, params={"max_tokens": None})
    )
    assert len(single(fits, "scheduler", TokenizedRequest).prompt_token_ids) == 63
    frame = generate_frame(prompt_token_ids=[1] * 64, params={"max_tokens": None})
    assert failure(service.handle(CLIENT, frame), code="prompt_too_long") == (
        "This model's maximum context length is 64 tokens. However, your request has 64 input "
        "tokens. Please reduce the length of the input messages."
    )


def test_prompt_plus_max_tokens_limit(service: TokenizerService) -> None:
    fits = service.handle(
        CLIENT, generate_frame(prompt_token_ids=[1] * 60, params={"max_tokens": 4})
    )
    single(fits, "scheduler", TokenizedRequest)
    frame = generate_frame(prompt_token_ids=[1] * 60, params={"max_tokens": 5})
    assert failure(service.handle(CLIENT, frame), code="prompt_too_long") == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(60 in the messages, 5 in the completion). Please reduce the length of the messages "
        "or completion."
    )


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(
    stories_service: TokenizerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 32 MB prompt once took 35 s to tokenize and refuse while every other request waited."""
    limit = stories_service.prompts.max_prompt_chars
    assert limit == stories_service.max_model_len * stories_service.tokenizer.max_chars_per_token
    # Every vocabulary entry spells at most half the bound: no fitting prompt is refused.
    longest = max(len(t) for t in stories_service.tokenizer.backend.get_vocab())
    assert limit == 2 * longest * stories_service.max_model_len

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(stories_service.tokenizer, "encode", never)  # chat prompts too
    huge = "a" * (limit + 1)
    message = failure(
        stories_service.handle(CLIENT, generate_frame(prompt=huge)), "prompt_too_long"
    )
    assert f"{limit + 1} characters" in message
    chat = [{"role": "user", "content": huge[: limit // 2]}] * 3
    failure(stories_service.handle(CLIENT, generate_frame(messages=chat)), "prompt_too_long")
    ids = [1] * (stories_service.max_model_len + 1)
    failure(stories_service.handle(CLIENT, generate_frame(prompt_token_ids=ids)), "prompt_too_long")


def test_template_kwargs_are_measured_and_refused_before_tokenizing(
    service: TokenizerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bos_token kwarg, which the byte template writes into the prompt: 4 MB of it were once
    tokenized on the loop (4.3 s) before the context-length refusal."""

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(service.tokenizer, "encode", never)
    chat = {"chat_template_kwargs": {"bos_token": "x" * 4_000_000}}
    frame = generate_frame(messages=[{"role": "user", "content": "hi"}], chat=chat)
    message = failure(service.handle(CLIENT, frame), "prompt_too_long")
    assert "context length is 64 tokens" in message and "characters" in message


class _SlowTokenizer:
    """Takes half a second over a long text, as a real one does over hundreds of kilobytes."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= OFFLOAD_PROMPT_CHARS:
            time.sleep(0.5)
        return [1, 2, 3]

    max_chars_per_token = 400  # long entries: a long prompt may fit the context


def test_a_large_prompt_is_tokenized_beside_the_loop_and_its_abort_waits_for_it() -> None:
    """A 4 MB prompt once held up every other request for 1.8 s."""
    service = TokenizerService(_SlowTokenizer(), 100, MAX_MODEL_LEN, "fcfs")  # type: ignore[arg-type]
    service.start_offload()
    assert service.offload is not None
    try:
        started = time.monotonic()
        large = generate_frame(request_id="large", prompt="b" * OFFLOAD_PROMPT_CHARS)
        assert service.handle(CLIENT, large) == []  # on the worker
        small = single(
            service.handle(CLIENT, generate_frame(prompt="b")), "scheduler", TokenizedRequest
        )
        abort = to_frame(AbortRequest(request_id="large"))
        assert service.handle(CLIENT, abort) == []  # held: the request is not forwarded yet
        assert time.monotonic() - started < 0.3  # nobody waited for the large prompt
        assert small.started.request_id == "r1"
        assert select.select([service.offload.wake_fd], [], [], 10)[0]
        (_, tokenized), (_, held) = service.offload.completed()
        assert isinstance(tokenized, TokenizedRequest) and tokenized.started.request_id == "large"
        assert held == AbortRid(rid=make_rid(CLIENT, "large"))
        # Once forwarded, its aborts go straight through again.
        single(service.handle(CLIENT, abort), "scheduler", AbortRid)
    finally:
        service.offload.close()


def test_a_request_reusing_the_id_of_one_on_the_worker_is_refused() -> None:
    """Large or small: a small one would overtake the first to the scheduler, and an abort held
    for the first would then reach it."""
    service = TokenizerService(_SlowTokenizer(), 100, MAX_MODEL_LEN, "fcfs")  # type: ignore[arg-type]
    service.start_offload()
    assert service.offload is not None
    try:
        large = generate_frame(prompt="b" * OFFLOAD_PROMPT_CHARS)
        assert service.handle(CLIENT, large) == []
        assert "already running" in failure(service.handle(CLIENT, large))
        assert "already running" in failure(service.handle(CLIENT, generate_frame(prompt="b")))
    finally:
        service.offload.close()


def test_large_template_kwargs_are_rendered_beside_the_loop() -> None:
    """Short messages, large kwargs: the prompt they render to is large, so the request goes
    to the worker thread as a large prompt does."""
    service = TokenizerService(_SlowTokenizer(), 100, MAX_MODEL_LEN, "fcfs")  # type: ignore[arg-type]
    service.start_offload()
    assert service.offload is not None
    try:
        chat = {"chat_template_kwargs": {"bos_token": "b" * OFFLOAD_PROMPT_CHARS}}
        frame = generate_frame(messages=[{"role": "user", "content": "hi"}], chat=chat)
        assert service.handle(CLIENT, frame) == []  # on the worker
        assert select.select([service.offload.wake_fd], [], [], 10)[0]
        ((_, tokenized),) = service.offload.completed()
        assert isinstance(tokenized, TokenizedRequest)
    finally:
        service.offload.close()
