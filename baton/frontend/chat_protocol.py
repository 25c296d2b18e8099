"""Chat request bodies: messages, the chat template fields a conversation renders with, and
`POST /v1/chat/completions` (protocol.py's rules: strict, unknown fields ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from baton.chat_options import REQUEST_TEMPLATE_REFUSED, ReasoningEffort
from baton.frontend.protocol import (
    LogprobCount,
    NullMeansDefault,
    PositiveInt,
    SamplingRequest,
    StrictModel,
)
from baton.frontend.tools import ToolCallParam, ToolChoice, Tools

# The role of a reply after a generation prompt (vLLM's default --response-role).
REPLY_ROLE = "assistant"


class TextPart(StrictModel):
    """One part of a message's content; only text is supported."""

    type: Literal["text"]
    text: str


class ChatMessageParam(StrictModel):
    """One message: `content` is a string or a list of text parts (null counts as empty); an
    assistant's may carry its tool calls and reasoning, and a tool's names the call it
    answers."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as a reply under --reasoning-parser returns it (vLLM's
    # `reasoning`, and its older name).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatTemplateRequest(NullMeansDefault):
    """The messages and vLLM's chat template fields (baton/chat_options.py) of a request that
    renders a conversation: chat completions and /tokenize, with the tools the template writes
    into the prompt (frontend/tools.py). The request's own template is refused."""

    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(REQUEST_TEMPLATE_REFUSED)
        return value


class ChatCompletionRequest(SamplingRequest, ChatTemplateRequest):
    """`POST /v1/chat/completions`; `max_completion_tokens` wins over the older `max_tokens`."""

    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    # vLLM's: the reply starts with the final message's content when it has the reply's role.
    echo: bool = False
    # With tool_choice "required": whether the reply may make more than one call.
    parallel_tool_calls: bool = True
    # vLLM's: under --reasoning-parser, whether the reply's reasoning comes back (else dropped).
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        """The output token limit (None: until the context is full or the model stops)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to return, or None when no logprobs are wanted."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def reply_role(self) -> str:
        """The reply's role, as vLLM's: the assistant's after a generation prompt, else the
        final message's (the conversation goes on in that message's voice)."""
        return REPLY_ROLE if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed(self) -> str:
        """What `echo` puts before each reply's content: the final message's content when that
        message has the reply's role (vLLM's rule), else nothing."""
        final = self.messages[-1]
        return final.text if self.echo and final.role == self.reply_role else ""
