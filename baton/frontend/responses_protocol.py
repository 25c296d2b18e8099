"""The body of `POST /v1/responses` (OpenAI's Responses API, stateless, as vLLM serves it), and
the chat completion request it becomes: the chat path validates, samples, renders, constrains
and reads tool calls for both endpoints.

What Baton cannot honour is refused, naming the field: anything that needs a stored response
or conversation (`previous_response_id`, `conversation`, `background`, a stored `prompt`),
tools other than functions, `truncation: "auto"`, `max_tool_calls` and `include` values other
than the output's logprobs. `store` is accepted, and nothing is stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from baton.chat_options import ReasoningEffort
from baton.frontend.chat_protocol import ChatCompletionRequest
from baton.frontend.errors import OpenAIError, from_validation_error
from baton.frontend.protocol import LogprobCount, NullMeansDefault, PositiveInt, StrictModel
from baton.frontend.responses_input import Input, chat_turns

# Chat fields a Responses request may set under the same name (vLLM's sampling extensions and
# the template's variables), validated by the chat request.
CHAT_FIELDS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "priority",
    "deadline_ms",
    "return_tokens_as_token_ids",
    "chat_template_kwargs",
    "structured_outputs",
)
# The Responses name of a chat field that a Responses request sets under another name.
RESPONSES_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "include",
}
OUTPUT_LOGPROBS = "message.output_text.logprobs"
NOTHING_STORED = "Baton stores no responses or conversations: send the whole conversation as input"


class FunctionTool(StrictModel):
    """A function the model may call, in Responses' flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments of a forced call always follow the schema

    def chat_tool(self) -> dict[str, Any]:
        """Chat's shape, which chat validates (names, uniqueness)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


class FunctionChoice(StrictModel):
    """`tool_choice` naming the function the reply must call."""

    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """`text.format`: free text, any JSON object, or JSON following `schema`."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('a text format of type "json_schema" needs its `schema`')
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's `response_format`."""
        if self.type != "json_schema":
            return {"type": self.type}
        described = self.model_dump(by_alias=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": described}


class TextConfig(StrictModel):
    """`text`: the output's format (its `verbosity` is a model's own, ignored as vLLM does)."""

    format: TextFormat = TextFormat(type="text")


class ReasoningConfig(StrictModel):
    """`reasoning`: the effort reaches the template as chat's `reasoning_effort`. A summary may
    be asked for, but none is written: the reasoning comes back whole, as vLLM's."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


def _refused(field: str, why: str) -> Any:
    """A before-validator refusing any value of `field`."""

    def refuse(cls: type, value: Any) -> Any:
        raise ValueError(f"`{field}` is not supported: {why}")

    return field_validator(field, mode="before")(classmethod(refuse))


class ResponsesRequest(NullMeansDefault):
    """`POST /v1/responses`. Unknown fields are kept, for `chat_request` to pass on CHAT_FIELDS
    (and ignore the rest, as vLLM does)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = None  # ranges: SamplingParams.validate's, on the chat path
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    reasoning: ReasoningConfig | None = None
    include: list[str] = Field(default_factory=list)
    top_logprobs: LogprobCount | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # accepted; nothing is stored (the response says `store: false`)
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None

    _no_previous_response = _refused("previous_response_id", NOTHING_STORED)
    _no_conversation = _refused("conversation", NOTHING_STORED)
    _no_stored_prompt = _refused("prompt", "send the prompt's text as instructions and input")
    _no_call_limit = _refused("max_tool_calls", "use parallel_tool_calls: false for one call")

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else ():
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(
                    f"tools of type {tool.get('type')!r} are not supported: only functions"
                )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {value.get('type')!r} is not supported: "
                '"none", "auto", "required" or a function'
            )
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str]) -> list[str]:
        for name in value:
            if name != OUTPUT_LOGPROBS:
                raise ValueError(f"include {name!r} is not supported: only {OUTPUT_LOGPROBS!r}")
        return value

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, value: bool) -> bool:
        if value:
            raise ValueError(f"`background` is not supported: {NOTHING_STORED}")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str) -> str:
        if value == "auto":
            raise ValueError('truncation "auto" is not supported: an input too long is a 400')
        return value

    @property
    def with_logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs."""
        return OUTPUT_LOGPROBS in self.include

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that answers this one (one choice)."""
        extras = self.model_extra or {}
        fields = {name: extras[name] for name in CHAT_FIELDS if name in extras}
        fields |= {
            "model": self.model,
            "messages": chat_turns(self.instructions, self.input),
            "stream": self.stream,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens,
            # No tools offers none (chat refuses an empty list).
            "tools": [tool.chat_tool() for tool in self.tools] or None,
            "tool_choice": self._chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.text.format.response_format(),
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "logprobs": self.with_logprobs,
            "top_logprobs": self.top_logprobs if self.with_logprobs else None,
            "user": self.user,
        }
        return ChatCompletionRequest.model_validate(fields)

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        if not self.tools and self.tool_choice in ("auto", "none"):
            return None  # OpenAI's default choice, with nothing to choose from
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def settings(self, temperature: float, top_p: float) -> dict[str, object]:
        """The request's settings, as a response echoes them (`temperature` and `top_p` as the
        output was sampled: the request's, else the model's defaults). Nothing is stored."""
        tool_choice = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": None,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": self.reasoning.model_dump() if self.reasoning else None,
            "store": False,
            "background": False,
            "temperature": temperature,
            "top_p": top_p,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [tool.model_dump() for tool in self.tools],
            "top_logprobs": self.top_logprobs,
            "truncation": self.truncation,
            "user": self.user,
        }


@contextmanager
def in_responses_terms() -> Iterator[None]:
    """Errors of the chat path, naming the Responses fields the client set (RESPONSES_NAMES)."""
    try:
        yield
    except ValidationError as error:
        raise _renamed(from_validation_error(error)) from error
    except OpenAIError as error:
        raise _renamed(error) from error


def _renamed(error: OpenAIError) -> OpenAIError:
    if error.param is not None:
        head, dot, rest = error.param.partition(".")
        error.param = RESPONSES_NAMES.get(head, head) + dot + rest
    return error
