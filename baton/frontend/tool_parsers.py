"""--tool-call-parser: how an "auto" tool choice's calls are read from the model's free text, as
vLLM's parsers of the same names read them.

- `hermes` (Qwen2.5, Qwen3, Hermes models): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks after any content.
- `llama3_json` (Llama 3.1, 3.2, 3.3): a reply that is one JSON object `{"name": ...,
  "parameters": {...}}` ("arguments" too), or several separated by `;`, optionally after
  `<|python_tag|>`; a reply that opens with anything else is content.

Each parser also says how much of a streamed reply is surely content, so a call's text never
goes out as content before the reply is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

# A call as OpenAI's API returns it.
ToolCall = dict[str, Any]


class ToolParser(Protocol):
    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished reply's content (None when it was only calls) and its calls; a reply
        whose calls do not parse stays content, with no calls (vLLM's rule)."""
        ...

    def content_end(self, text: str, sent: int) -> int:
        """How far the reply so far (`sent` characters of it already sent as content) is
        surely content: never into a call, nor the whitespace before one."""
        ...


def tool_call(name: str, arguments: str) -> ToolCall:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.OPEN not in text:
            return text, []
        calls = []
        for match in self._CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
                calls.append(tool_call(call["name"], json.dumps(call.get("arguments", {}))))
            except (ValueError, TypeError, KeyError):
                return text, []
        content = text[: text.index(self.OPEN)].rstrip()
        return content or None, calls

    def content_end(self, text: str, sent: int) -> int:
        tag = text.find(self.OPEN)
        before = text if tag < 0 else text[:tag]
        # Hold back the longest unsent tail that may be the tag's start.
        end = len(before)
        for length in range(min(len(self.OPEN) - 1, len(before) - sent), 0, -1):
            if self.OPEN.startswith(before[-length:]):
                end = len(before) - length
                break
        return max(sent, len(before[:end].rstrip()))


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"
    _SEPARATOR = re.compile(r"\s*;?\s*")

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = self._body(text)
        if body is None:
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                call, at = decoder.raw_decode(body, at)
                arguments = call["arguments"] if "arguments" in call else call["parameters"]
                if not isinstance(call["name"], str) or not isinstance(arguments, dict):
                    return text, []
                calls.append(tool_call(call["name"], json.dumps(arguments, ensure_ascii=False)))
                at = self._SEPARATOR.match(body, at).end()
        except (ValueError, TypeError, KeyError):
            return text, []
        return None, calls

    def content_end(self, text: str, sent: int) -> int:
        opening = text.lstrip()
        if not opening or self._body(text) is not None or self.PYTHON_TAG.startswith(opening):
            return sent  # it may still turn out to be calls
        return len(text)

    def _body(self, text: str) -> str | None:
        """The text of the calls, if the reply opens as calls do."""
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        return body if body.startswith("{") else None


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
