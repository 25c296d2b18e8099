"""Tool calling: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

The chat template writes the tools into the prompt (ChatOptions.tools). What the model may then
say depends on `tool_choice`:
- "required": a JSON array of calls, each `{"name": ..., "parameters": {...}}` of a given tool
  (a structured-outputs constraint, as vLLM's), read back into `tool_calls`;
- a named function: that function's arguments as JSON (its parameters' schema), one call;
- "auto" (the default when tools are given): free text, from which the server's
  `--tool-call-parser` reads the calls the model chose to make; it needs
  `--enable-auto-tool-choice`, as in vLLM;
- "none": free text, never read as calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from baton.frontend.tool_parsers import PARSERS, tool_call
from baton.structured_outputs import StructuredOutputsParams

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolParam(_Strict):
    """One tool a request offers: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice` naming the function the reply must call."""

    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallParam(_Strict):
    """A call an earlier assistant message made (OpenAI's format)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _unique_names(tools: list[ToolParam]) -> list[ToolParam]:
    seen: set[str] = set()
    for tool in tools:
        if tool.function.name in seen:
            raise ValueError(f"tool names must be unique: {tool.function.name!r} is given twice")
        seen.add(tool.function.name)
    return tools


# A request's `tools`: at least one (as OpenAI), each name once.
Tools = Annotated[list[ToolParam], Field(min_length=1), AfterValidator(_unique_names)]


@dataclass(frozen=True)
class ToolPlan:
    """How one request's reply relates to its tools: `mode`, the function a named choice
    forces, and the parser that reads an "auto" reply's calls."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[ToolParam, ...] = ()
    function: str | None = None
    parser: str | None = None

    @classmethod
    def of(
        cls,
        tools: list[ToolParam] | None,
        choice: ToolChoice | None,
        parser: str | None,
    ) -> ToolPlan:
        """The request's plan; ValueError for a choice this request or server cannot honour
        (vLLM's checks and wording)."""
        if not tools:
            if choice not in (None, "none"):
                raise ValueError("When using `tool_choice`, `tools` must be set.")
            return cls("none")
        choice = "auto" if choice is None else choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {tool.function.name for tool in tools}:
                raise ValueError(f"Tool '{choice.function.name}' has not been passed in `tools`.")
            return cls("named", tuple(tools), choice.function.name)
        if choice == "auto" and parser is None:
            raise ValueError(AUTO_NEEDS_FLAGS)
        return cls(choice, tuple(tools), parser=parser if choice == "auto" else None)

    def constraint(self, parallel_tool_calls: bool) -> StructuredOutputsParams | None:
        """The structured output a forced call must follow (None where the reply is free)."""
        if self.mode == "named":
            (tool,) = (tool for tool in self.tools if tool.function.name == self.function)
            return StructuredOutputsParams(json=_parameters(tool))
        if self.mode != "required":
            return None
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": tool.function.name},
                            "parameters": _parameters(tool),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for tool in self.tools
                ]
            },
        }
        if not parallel_tool_calls:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls)

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished reply's content (None when it was only calls) and its tool calls, in
        OpenAI's format; a reply that does not parse stays content."""
        if self.mode == "named":
            return None, [tool_call(self.function or "", text)]
        if self.mode == "required":
            try:
                calls = [
                    tool_call(call["name"], json.dumps(call["parameters"]))
                    for call in json.loads(text)
                ]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls
        if self.mode == "auto" and self.parser is not None:
            return PARSERS[self.parser].read(text)
        return text, []


# A request without tools.
NO_TOOLS = ToolPlan("none")


def _parameters(tool: ToolParam) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


class ToolCallStream:
    """One streamed choice's content under a tool plan: the text to send as content now, held
    back where it may open a call (the calls themselves go out once the reply is complete)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._text = ""
        self._sent = 0  # characters of _text sent as content

    def content(self, new_text: str) -> str:
        """The part of the reply so far that is surely content and not yet sent."""
        self._text += new_text
        if self.plan.mode in ("named", "required"):
            return ""
        end = len(self._text)
        if self.plan.mode == "auto":
            end = PARSERS[self.plan.parser or ""].content_end(self._text, self._sent)
        sent, self._sent = self._sent, max(self._sent, end)
        return self._text[sent : self._sent]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet, and the reply's calls."""
        content, calls = self.plan.read(self._text)
        if not calls:
            return self._text[self._sent :], []
        return (content or "")[self._sent :], calls
