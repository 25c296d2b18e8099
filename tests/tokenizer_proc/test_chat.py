"""Chat rendering: a tokenizer's own template, the plain fallback, their options (vLLM's chat
template fields), and role validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.chat_options import ChatOptions
from baton.checkpoint.chat_template import ChatTemplate
from baton.checkpoint.load import Checkpoint
from baton.checkpoint.tokenizer import Tokenizer
from baton.messages import ChatMessage
from baton.tokenizer_proc.chat import chat_prompt, render_chat

CONVERSATION = [
    ChatMessage(role="system", content="You are terse."),
    ChatMessage(role="user", content="Once upon a time"),
]
BRACKET_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] }}]{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture()
def stories_tokenizer(stories260k_dir: Path) -> Tokenizer:
    """A fresh stories260K tokenizer (tests may set a template on it)."""
    return Tokenizer.from_folder(stories260k_dir)


def test_fallback_without_template_is_role_lines_then_cue(
    stories_tokenizer: Tokenizer,
) -> None:
    assert stories_tokenizer.chat_template is None
    expected_text = "system: You are terse.\nuser: Once upon a time\nassistant:"
    ids = render_chat(stories_tokenizer, CONVERSATION)
    assert ids == stories_tokenizer.encode(expected_text, add_special_tokens=True)
    assert ids[0] == stories_tokenizer.bos_token_id


def test_fallback_without_generation_prompt_or_continuing_the_final_message(
    stories_tokenizer: Tokenizer,
) -> None:
    """No `assistant:` cue without a generation prompt; with continue_final_message the text
    ends right after the final message's content (whatever its role, as transformers)."""
    no_cue = render_chat(stories_tokenizer, CONVERSATION, ChatOptions(add_generation_prompt=False))
    expected = "system: You are terse.\nuser: Once upon a time\n"
    assert no_cue == stories_tokenizer.encode(expected, add_special_tokens=True)
    options = ChatOptions(
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},  # no template: nothing to change
    )
    continued = render_chat(stories_tokenizer, CONVERSATION, options)
    expected = "system: You are terse.\nuser: Once upon a time"
    assert continued == stories_tokenizer.encode(expected, add_special_tokens=True)


def test_tokenizer_template_is_used_when_set(stories_tokenizer: Tokenizer) -> None:
    stories_tokenizer.chat_template = ChatTemplate(
        BRACKET_TEMPLATE, stories_tokenizer.special_tokens
    )
    expected_text = "[system]You are terse.[user]Once upon a time[assistant]"
    ids = render_chat(stories_tokenizer, CONVERSATION)
    # The template supplies any special tokens itself, so the text is encoded without them.
    assert ids == stories_tokenizer.encode(expected_text, add_special_tokens=False)


def test_default_model_byte_template(random_checkpoint: Checkpoint) -> None:
    tokenizer = random_checkpoint.tokenizer
    ids = render_chat(tokenizer, [ChatMessage(role="user", content="hi")])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    # Byte tokenizer: each byte of the role headers and content is its own id.
    expected = [bos, *b"<|user|>\nhi", eos, *b"\n<|assistant|>\n"]
    assert ids == expected


def test_template_options_and_variables(stories_tokenizer: Tokenizer) -> None:
    template = (
        BRACKET_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}"
        "<no-think>{% endif %}"
    )
    stories_tokenizer.chat_template = ChatTemplate(template, stories_tokenizer.special_tokens)

    def rendered(**options: object) -> list[int]:
        return render_chat(stories_tokenizer, CONVERSATION, ChatOptions(**options))

    def encoded(text: str) -> list[int]:
        return stories_tokenizer.encode(text, add_special_tokens=False)

    turns = "[system]You are terse.[user]Once upon a time"
    assert rendered(add_generation_prompt=False) == encoded(turns)
    assert rendered(chat_template_kwargs={"enable_thinking": False}) == encoded(
        turns + "[assistant]<no-think>"
    )
    # The template writes nothing after the final message here: continuing it cuts nothing.
    continued = rendered(add_generation_prompt=False, continue_final_message=True)
    assert continued == encoded(turns)


def test_a_developer_message_is_a_system_one(stories_tokenizer: Tokenizer) -> None:
    """OpenAI's developer role renders as "system", in the fallback and in a template."""
    developer = [ChatMessage(role="developer", content="You are terse."), CONVERSATION[1]]
    assert render_chat(stories_tokenizer, developer) == render_chat(stories_tokenizer, CONVERSATION)
    stories_tokenizer.chat_template = ChatTemplate(
        BRACKET_TEMPLATE, stories_tokenizer.special_tokens
    )
    assert chat_prompt(stories_tokenizer, developer).text == (
        "[system]You are terse.[user]Once upon a time[assistant]"
    )


@pytest.mark.parametrize("role", ["function", "", "User", "Developer"])
def test_unsupported_role_is_rejected(random_checkpoint: Checkpoint, role: str) -> None:
    messages = [ChatMessage(role="user", content="a"), ChatMessage(role=role, content="b")]
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        render_chat(random_checkpoint.tokenizer, messages)


def test_empty_conversation_is_rejected(random_checkpoint: Checkpoint) -> None:
    with pytest.raises(ValueError, match="empty"):
        render_chat(random_checkpoint.tokenizer, [])


# Qwen2.5's way with tools, cut down: tool definitions in the system turn, an assistant's calls
# with their arguments as objects (tojson), a tool's reply in a user turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}[tool {{ m.tool_call_id }}]{{ m.content }}"
    "{% else %}[{{ m.role }}]{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</call>{% endfor %}{% endif %}"
    "{% endfor %}"
)


def test_tools_and_tool_turns_reach_the_template(stories_tokenizer: Tokenizer) -> None:
    stories_tokenizer.use_chat_template(TOOLS_TEMPLATE)
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"tz": 1}'}}
    messages = [
        ChatMessage("user", "time?"),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", "noon", tool_call_id="c1"),
    ]
    text = chat_prompt(stories_tokenizer, messages, ChatOptions(tools=[tool])).text
    assert text == (
        '<tools>{"type": "function", "function": {"name": "now", "parameters": {"type": '
        '"object"}}}</tools>[user]time?[assistant]<call>now {"tz": 1}</call>[tool c1]noon'
    )
    # Arguments that are not JSON reach the template as the text they are.
    call["function"]["arguments"] = "{oops"
    text = chat_prompt(stories_tokenizer, messages[:2], ChatOptions()).text
    assert text == '[user]time?[assistant]<call>now "{oops"</call>'


def test_the_fallback_writes_tool_calls_and_tool_turns(stories_tokenizer: Tokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    messages = [
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", "noon", tool_call_id="c1"),
    ]
    text = chat_prompt(stories_tokenizer, messages).text
    assert text == 'assistant: {"name": "now", "arguments": "{}"}\ntool: noon\nassistant:'
