"""The `input` of a Responses request, and the conversation it becomes for the chat path.

Items are OpenAI's, as vLLM maps them onto chat messages: a message keeps its role (the
chat path renders "developer" as "system"), a `function_call` becomes an assistant
turn's tool call and a `function_call_output` the "tool" turn answering it. The reasoning,
message and function calls of one assistant turn, as a response returns them, are rendered as
that one turn: its `reasoning`, content and `tool_calls`. Only text content is supported.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from baton.frontend.protocol import StrictModel

# A chat message, as ChatCompletionRequest takes it.
ChatTurn = dict[str, Any]


class TextContent(StrictModel):
    """One part of a message's content: text the user gave, or that an earlier reply wrote."""

    type: Literal["input_text", "output_text"]
    text: str


Content = str | list[TextContent]


def _chat_content(content: Content) -> str | list[dict[str, str]]:
    """Chat's content: parts stay parts, which chat joins with newlines as vLLM does."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


class MessageItem(StrictModel):
    """A message (`type` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content

    def add_to(self, turns: list[ChatTurn], assistant: ChatTurn | None) -> ChatTurn | None:
        """Append the message; an assistant's fills the turn its reasoning opened."""
        content = _chat_content(self.content)
        if self.role != "assistant":
            turns.append({"role": self.role, "content": content})
            return None
        if assistant is not None and assistant["content"] is None and "tool_calls" not in assistant:
            assistant["content"] = content
            return assistant
        turns.append({"role": "assistant", "content": content})
        return turns[-1]


class FunctionCallItem(StrictModel):
    """A call an earlier reply made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def add_to(self, turns: list[ChatTurn], assistant: ChatTurn | None) -> ChatTurn | None:
        """The call joins the open assistant turn's calls, or opens a turn of its own."""
        call = {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if assistant is None:
            turns.append({"role": "assistant", "content": None})
            assistant = turns[-1]
        assistant.setdefault("tool_calls", []).append(call)
        return assistant


class FunctionCallOutputItem(StrictModel):
    """What a call returned: the "tool" turn answering it."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content

    def add_to(self, turns: list[ChatTurn], assistant: ChatTurn | None) -> None:
        """Append the tool turn, which ends the assistant's."""
        turns.append(
            {"role": "tool", "tool_call_id": self.call_id, "content": _chat_content(self.output)}
        )


class ReasoningText(StrictModel):
    """A reasoning item's text."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    """An earlier reply's reasoning: it opens that reply's assistant turn, as its `reasoning`
    (its summary and encrypted content, which Baton never writes, are dropped)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None

    def add_to(self, turns: list[ChatTurn], assistant: ChatTurn | None) -> ChatTurn:
        """Open an assistant turn holding the reasoning."""
        reasoning = "".join(part.text for part in self.content or ())
        turns.append({"role": "assistant", "content": None, "reasoning": reasoning})
        return turns[-1]


def _item_type(item: Any) -> str | None:
    """An item's tag: its `type`, "message" when a message leaves it out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
Input = str | Annotated[list[InputItem], Field(min_length=1)]


def chat_turns(instructions: str | None, items: Input) -> list[ChatTurn]:
    """The chat messages of `instructions` (a system message first) and the input items."""
    turns: list[ChatTurn] = []
    if instructions is not None:
        turns.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        turns.append({"role": "user", "content": items})
        return turns
    assistant: ChatTurn | None = None  # the assistant turn the next items may add to
    for item in items:
        assistant = item.add_to(turns, assistant)
    return turns
