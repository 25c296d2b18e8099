"""MkDocs hook: the flag reference, generated from the command line's own parser at each build.

`docs/reference/flags.md` holds only its introduction and, between the markers below, a note
for readers of the bare file; this hook replaces the markers and the note with one table per
group of flags, read from `baton.cli.build_parser()` (the parser `baton launch` and `baton
generate` run), so the reference cannot drift from the code. A flag without a help string
fails the build.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

MARKER = "<!-- flag-reference -->"
END_MARKER = "<!-- /flag-reference -->"
GENERATED = re.compile(re.escape(MARKER) + ".*?" + re.escape(END_MARKER), re.DOTALL)
PAGE = "reference/flags.md"
# Environment read for defaults when the parser is built: a secret must never reach the page.
SECRET_DEFAULTS = ("BATON_API_KEY",)
GiB = 1 << 30


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the flag reference page; leave every other page as it is."""
    if page.file.src_uri != PAGE:
        return markdown
    if GENERATED.search(markdown) is None:
        raise ValueError(f"{PAGE} lost its markers {MARKER} {END_MARKER}: the tables have no place")
    return GENERATED.sub(lambda _: flag_reference(), markdown, count=1)


def flag_reference() -> str:
    """The Markdown of every `baton launch` and `baton generate` flag, grouped as `--help`
    groups them."""
    launch, generate = _subcommands("launch", "generate")
    config_groups = [group for group in _groups(launch) if group.title not in _GENERIC_TITLES]
    config_titles = {group.title for group in config_groups}
    own_groups = [group for group in _groups(generate) if group.title not in config_titles]
    lines = ["## `baton launch`", ""]
    lines += [
        "Also `python -m baton.launch`. Every flag below is also a flag of `baton generate`, "
        "and a keyword of the offline `LLM(...)` under the config field named in its row.",
        "",
    ]
    from baton.config import BatonConfig

    fields = {field.name for field in dataclasses.fields(BatonConfig)}
    for group in config_groups:
        title = f"### {group.title.capitalize()}"
        lines += _table(title, group._group_actions, anchor_prefix="", config_fields=fields)
    lines += ["## `baton generate`", ""]
    lines += [
        "Completes prompts offline and prints each text, its token count and finish reason. "
        "It takes every flag of `baton launch` above, and these:",
        "",
    ]
    actions = [action for group in own_groups for action in group._group_actions]
    lines += _table("", actions, anchor_prefix="generate-", config_fields=None)
    return "\n".join(lines)


_GENERIC_TITLES = ("positional arguments", "options", "optional arguments")


def _subcommands(*names: str) -> list[argparse.ArgumentParser]:
    saved = {name: os.environ.pop(name) for name in SECRET_DEFAULTS if name in os.environ}
    try:
        from baton.cli import build_parser

        parser = build_parser()
    finally:
        os.environ.update(saved)
    commands = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    return [commands.choices[name] for name in names]


def _groups(parser: argparse.ArgumentParser) -> Iterator[argparse._ArgumentGroup]:
    for group in parser._action_groups:
        if any(not _is_help(action) for action in group._group_actions):
            yield group


def _is_help(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction)


def _table(
    heading: str,
    actions: Iterable[argparse.Action],
    anchor_prefix: str,
    config_fields: set[str] | None,
) -> list[str]:
    """One table; with `config_fields`, a column naming each flag's `BatonConfig` field."""
    lines = [heading, ""] if heading else []
    if config_fields is None:
        lines += ["| Flag | Default | What it does |", "|---|---|---|"]
    else:
        lines += ["| Flag | Default | Config field | What it does |", "|---|---|---|---|"]
    for action in actions:
        if _is_help(action):
            continue
        if not action.help:
            raise ValueError(f"{_names(action)} has no help string (baton/config_cli.py)")
        name = (action.option_strings or [action.dest])[0].lstrip("-")
        anchor = f'<a id="{anchor_prefix}{name}"></a>'
        if action.option_strings:
            flag = " ".join(f"`{option}`" for option in action.option_strings)
            value = _value_name(action)
            flag += f" `{value}`" if value else ""
        else:  # a positional argument
            flag = f"`{action.dest.upper()}` ..." if action.nargs in ("+", "*") else action.dest
        row = [anchor + flag, _default(action), _help(action)]
        if config_fields is not None:
            if action.dest not in config_fields:
                raise ValueError(f"{_names(action)} sets no BatonConfig field ({action.dest})")
            row.insert(2, f"`{action.dest}`")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    lines.append("")
    return lines


def _names(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


def _value_name(action: argparse.Action) -> str:
    """What follows the flag: nothing for a switch, else its metavar, choices or kind."""
    if action.nargs == 0:
        return ""
    if action.metavar:
        return str(action.metavar)
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    kind = getattr(action.type, "__name__", "")
    if kind == "int":
        return "N"
    if kind == "float":
        return "X"
    if "json" in kind or "config" in kind:
        return "JSON"
    return "TEXT"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0:
        return "off"
    if not action.option_strings:
        return "required" if action.nargs in ("+", None) else "none"
    value = action.default
    if value is None or value == argparse.SUPPRESS:
        return "none"
    if isinstance(value, tuple):
        return f"`{json.dumps(list(value))}`"
    if isinstance(value, float) and math.isinf(value):
        return "`inf`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= GiB and value % GiB == 0:
        return f"`{value}` ({value // GiB} GiB)"
    return f"`{value}`"


def _help(action: argparse.Action) -> str:
    """The help string, with HTML's special characters escaped outside `code spans`."""
    text = str(action.help) % {"default": action.default, "prog": "baton"}
    parts = text.split("`")
    for index in range(0, len(parts), 2):  # outside code spans
        parts[index] = html.escape(parts[index], quote=False)
    return "`".join(parts)
