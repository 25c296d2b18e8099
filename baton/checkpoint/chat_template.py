"""Chat templates: the Jinja template a checkpoint ships, rendered as transformers renders it.

The environment matches transformers' `apply_chat_template` (sandboxed, `trim_blocks` and
`lstrip_blocks`, loop controls, its `tojson` filter and its `raise_exception` and
`strftime_now` globals), so a conversation renders to the same text, without importing
transformers (and torch) in the processes that render it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "TemplateError"]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_ENVIRONMENT = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
)
_ENVIRONMENT.filters["tojson"] = _tojson
_ENVIRONMENT.globals["raise_exception"] = _raise_exception
_ENVIRONMENT.globals["strftime_now"] = _strftime_now


class ChatTemplate:
    """A compiled chat template; `render` raises jinja2's TemplateError for what the template
    refuses (its own `raise_exception`)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self._template = _ENVIRONMENT.from_string(source)
        # bos_token, eos_token...: templates refer to them by these names.
        self._special_tokens = special_tokens

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the prompt text the model was trained on."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **self._special_tokens,
        )
