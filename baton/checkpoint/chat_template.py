"""Chat templates: the Jinja template a checkpoint ships, rendered as transformers renders it.

The environment matches transformers' `apply_chat_template` (sandboxed, `trim_blocks` and
`lstrip_blocks`, loop controls, its `tojson` filter and its `raise_exception` and
`strftime_now` globals), so a conversation renders to the same text, without importing
transformers (and torch) in the processes that render it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "TemplateError", "read_chat_template"]

# transformers' marker for continue_final_message: appended to the final message's content, so
# the rendered text can be cut right after that content whatever the template writes after it.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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


def read_chat_template(value: str) -> str:
    """`--chat-template`'s value as a template's text, checked to compile: the file it names, or
    else, where it holds a brace or a newline, the value itself (vLLM's rule). ValueError in one
    line naming the flag otherwise."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # an inline template is no valid path (a name too long, say)
        is_file = False
    if is_file:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--chat-template {value!r} cannot be read: {error}") from None
    elif any(char in value for char in "{}\n"):
        source = value
    else:
        raise ValueError(
            f"--chat-template {value!r} looks like a file path, and there is no such file"
        )
    if not source.strip():
        raise ValueError(f"--chat-template {value!r} is empty")
    try:
        _ENVIRONMENT.from_string(source)  # compiled: unknown filters and tests fail here too
    except TemplateError as error:
        raise ValueError(f"--chat-template does not compile: {error}") from None
    return source


class ChatTemplate:
    """A compiled chat template; `render` raises jinja2's TemplateError for what the template
    refuses (its own `raise_exception`)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self._template = _ENVIRONMENT.from_string(source)
        # bos_token, eos_token...: templates refer to them by these names.
        self._special_tokens = special_tokens

    def render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the prompt text the model was trained on.

        `continue_final_message` (not with `add_generation_prompt`) leaves the final message
        open, as transformers does: its content is rendered with a tag after it, and the text
        is cut where the tag is (ValueError if the template does not write the content as it
        is). `variables` are further template variables, as transformers' kwargs: they may
        override the special tokens and `documents`, not the messages; which of a request's
        kwargs get here, and which of its fields win over them, is ChatOptions' merge (its
        `template_variables`, which leave out `add_generation_prompt`). Whatever a render
        raises is a TemplateError: with a request's variables, any expression of the template
        can fail on them.
        """
        if continue_final_message:
            *earlier, final = messages
            messages = [*earlier, {**final, "content": final["content"] + CONTINUE_TAG}]
        context = {
            **self._special_tokens,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **(variables or {}),
            "messages": messages,
        }
        try:
            text = self._template.render(context)
        except TemplateError:
            raise
        except Exception as error:  # e.g. a TypeError on a variable's value: vLLM's 400 too
            raise TemplateError(f"the chat template failed: {error!r}") from error
        if not continue_final_message:
            return text
        return _cut_at_tag(text, final["content"])


def _cut_at_tag(text: str, final_content: str) -> str:
    """The rendered text up to the end of the final message's content (transformers' cut)."""
    tag = CONTINUE_TAG.strip()
    if final_content.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content: its trailing space goes too
