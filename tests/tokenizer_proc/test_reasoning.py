"""--reasoning-parser in the tokenizer process: the tags must be tokens of the model, and each
chat's rendered prompt says whether its reply opens in reasoning (the scheduler then learns the
token that ends it, the detokenizer that the reply opens there); completions never do."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tiny_models import write_thinking_checkpoint
from helpers.tokenizer_frames import CLIENT, single, to_frame

from baton.chat_options import ChatOptions
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.tokenizer import Tokenizer
from baton.config import BatonConfig, ConfigurationError
from baton.messages import ChatMessage, GenerateRequest
from baton.process_messages import TokenizedRequest
from baton.tokenizer_proc.chat import render_chat
from baton.tokenizer_proc.reasoning import ReasoningTokens
from baton.tokenizer_proc.service import TokenizerService

THINK, END = 259, 260  # write_thinking_checkpoint's tags
ASK = [ChatMessage(role="user", content="Hi")]


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def tokenizer(thinking_dir: Path) -> Tokenizer:
    return load_checkpoint(str(thinking_dir)).tokenizer


def test_the_tags_are_the_models_tokens(tokenizer: Tokenizer) -> None:
    assert ReasoningTokens.of(tokenizer, "qwen3") == ReasoningTokens(THINK, END)


def test_a_model_without_the_tags_is_refused_at_start_up(stories260k_dir: Path) -> None:
    config = BatonConfig(model=str(stories260k_dir), reasoning_parser="deepseek_r1")
    with pytest.raises(ConfigurationError, match="--reasoning-parser deepseek_r1 needs <think>"):
        TokenizerService.from_config(config)


def test_tags_that_decoding_drops_are_refused(thinking_dir: Path, tmp_path: Path) -> None:
    """A model whose tags are special tokens: its replies' text would not show them."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(thinking_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("</think>", special=True, normalized=False)])
    tokenizer = load_checkpoint(str(thinking_dir)).tokenizer
    tokenizer.backend = backend
    with pytest.raises(ConfigurationError, match="special token that decoding drops"):
        ReasoningTokens.of(tokenizer, "qwen3")


def opens(tokenizer: Tokenizer, messages: list[ChatMessage], **options: object) -> bool:
    chat = ChatOptions(**options)  # type: ignore[arg-type]
    prompt = render_chat(tokenizer, messages, chat)
    tokens = ReasoningTokens(THINK, END)
    return tokens.opens_in_reasoning(tokenizer, prompt, chat.continue_final_message)


def test_which_replies_open_in_reasoning(tokenizer: Tokenizer) -> None:
    # The template opens the block for the reply.
    assert opens(tokenizer, ASK)
    # enable_thinking false: the template closes an empty block before the reply.
    assert not opens(tokenizer, ASK, chat_template_kwargs={"enable_thinking": False})
    # An earlier turn's closed block does not close the new reply's.
    earlier = [*ASK, ChatMessage(role="assistant", content="Hello.", reasoning="Greet."), *ASK]
    assert opens(tokenizer, earlier)
    # A continued message is in reasoning where its last tag opened the block.
    unfinished = ChatMessage(role="assistant", content="<think>Let me")
    finished = ChatMessage(role="assistant", content="<think>Hmm</think>It is")
    plain = ChatMessage(role="assistant", content="It is")
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert opens(tokenizer, [*ASK, unfinished], **continued)
    assert not opens(tokenizer, [*ASK, finished], **continued)
    assert not opens(tokenizer, [*ASK, plain], **continued)


def test_an_assistant_turns_reasoning_reaches_the_template(tokenizer: Tokenizer) -> None:
    turn = ChatMessage(role="assistant", content="Hello.", reasoning="Greet them.")
    prompt = tokenizer.decode(render_chat(tokenizer, [*ASK, turn]))
    assert "<|assistant|>\n<think>Greet them.</think>Hello.\n" in prompt


def test_the_scheduler_and_detokenizer_learn_where_the_reasoning_ends(thinking_dir: Path) -> None:
    service = TokenizerService.from_config(
        BatonConfig(model=str(thinking_dir), reasoning_parser="qwen3")
    )

    def forwarded(**fields: object) -> TokenizedRequest:
        frame = to_frame(GenerateRequest(request_id="r1", **fields))  # type: ignore[arg-type]
        return single(service.handle(CLIENT, frame), "scheduler", TokenizedRequest)

    thinking = forwarded(messages=ASK)
    assert (thinking.reasoning_end_token, thinking.started.in_reasoning) == (END, True)
    closed = ChatOptions(chat_template_kwargs={"enable_thinking": False})
    answering = forwarded(messages=ASK, chat=closed)
    assert (answering.reasoning_end_token, answering.started.in_reasoning) == (None, False)
    # A completion's text is its own: never split, never left unconstrained.
    completion = forwarded(prompt="<think>Hi")
    assert (completion.reasoning_end_token, completion.started.in_reasoning) == (None, False)
