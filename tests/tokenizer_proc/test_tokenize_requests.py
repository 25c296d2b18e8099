"""vLLM's /tokenize and /detokenize in the tokenizer process: a prompt is tokenized as a
generation request's would be, ids are decoded with special tokens, and bad requests fail."""

from __future__ import annotations

import select

import pytest
from helpers.tokenizer_frames import CLIENT, failure, single, to_frame

from baton.chat_options import ChatOptions
from baton.messages import ChatMessage, DetokenizeRequest, TokenizeReply, TokenizeRequest
from baton.process_messages import ForwardedTokenizeReply
from baton.tokenizer_proc.chat import render_chat
from baton.tokenizer_proc.service import OFFLOAD_PROMPT_CHARS, TokenizerService


def reply(service: TokenizerService, message: object) -> TokenizeReply:
    forwarded = single(
        service.handle(CLIENT, to_frame(message)), "detokenizer", ForwardedTokenizeReply
    )
    assert forwarded.client_id == CLIENT and forwarded.reply.request_id == "r1"
    return forwarded.reply


def test_a_text_is_tokenized_with_or_without_special_tokens(
    stories_service: TokenizerService,
) -> None:
    tokenizer = stories_service.tokenizer
    text = "Once upon a time"
    with_bos = reply(stories_service, TokenizeRequest(request_id="r1", prompt=text))
    assert (with_bos.text, with_bos.token_ids) == (text, tokenizer.encode(text))
    bare = reply(
        stories_service, TokenizeRequest(request_id="r1", prompt=text, add_special_tokens=False)
    )
    assert bare.token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert len(bare.token_ids) == len(with_bos.token_ids) - 1
    assert with_bos.token_strs is None  # not asked for
    strs = reply(
        stories_service, TokenizeRequest(request_id="r1", prompt=text, return_token_strs=True)
    )
    assert strs.token_strs == [tokenizer.id_to_token(token) for token in with_bos.token_ids]


def test_messages_are_rendered_as_for_generation(stories_service: TokenizerService) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    chat = ChatOptions(add_generation_prompt=False)
    answer = reply(stories_service, TokenizeRequest(request_id="r1", messages=messages, chat=chat))
    assert answer.token_ids == render_chat(stories_service.tokenizer, messages, chat)
    assert answer.text.startswith("system: Be brief.")  # the plain fallback's rendering


def test_ids_are_decoded_with_their_special_tokens(stories_service: TokenizerService) -> None:
    ids = stories_service.tokenizer.encode("Once upon a time")  # BOS first
    answer = reply(stories_service, DetokenizeRequest(request_id="r1", token_ids=ids))
    assert answer.text == stories_service.tokenizer.decode(ids, skip_special_tokens=False)
    assert answer.text.endswith("Once upon a time") and answer.token_ids == ids
    assert answer.text != stories_service.tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (DetokenizeRequest(request_id="r1", token_ids=[5, 512]), "token_ids[1] = 512 is outside"),
        (DetokenizeRequest(request_id="r1", token_ids=[-1]), "token_ids[0] = -1 is outside"),
        (DetokenizeRequest(request_id="r1", token_ids=[5] * 513), "at most 512 token ids"),
        (TokenizeRequest(request_id="r1"), "exactly one of prompt and messages"),
        (
            TokenizeRequest(request_id="r1", prompt="a", messages=[ChatMessage("user", "b")]),
            "exactly one of prompt and messages",
        ),
        (
            TokenizeRequest(
                request_id="r1", prompt="a", chat=ChatOptions(add_generation_prompt=False)
            ),
            "chat options (`chat`) need `messages`",
        ),
    ],
)
def test_bad_requests_fail_with_their_reason(
    stories_service: TokenizerService, message: object, expected: str
) -> None:
    assert expected in failure(stories_service.handle(CLIENT, to_frame(message)))


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing(
    stories_service: TokenizerService,
) -> None:
    text = "a" * (stories_service.prompts.max_prompt_chars + 1)
    message = TokenizeRequest(request_id="r1", prompt=text)
    assert "maximum context length" in failure(
        stories_service.handle(CLIENT, to_frame(message)), "prompt_too_long"
    )


def test_a_large_text_is_tokenized_beside_the_loop(stories_service: TokenizerService) -> None:
    # A context long enough for the text: /tokenize counts what fits, as generation does.
    tokenizer, vocab = stories_service.tokenizer, stories_service.vocab_size
    service = TokenizerService(tokenizer, vocab, 100_000, "fcfs")
    service.start_offload()
    assert service.offload is not None
    try:
        text = "Once upon a time. " * (OFFLOAD_PROMPT_CHARS // 18 + 1)
        assert service.handle(CLIENT, to_frame(TokenizeRequest(request_id="r1", prompt=text))) == []
        assert select.select([service.offload.wake_fd], [], [], 10)[0]
        ((destination, forwarded),) = service.offload.completed()
        assert destination == "detokenizer" and isinstance(forwarded, ForwardedTokenizeReply)
        assert forwarded.reply.token_ids == service.tokenizer.encode(text)
    finally:
        service.offload.close()
