"""A checkpoint's JSON files (config.json, tokenizer_config.json, generation_config.json, ...),
read with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from baton.checkpoint.model_config import CheckpointError


def read_json(file: Path, required: bool) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict ({} if absent and not `required`); CheckpointError
    naming the file otherwise."""
    if not file.is_file():
        if required:
            raise CheckpointError(f"{file}: missing")
        return {}
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: unreadable: {error}") from error
    if not isinstance(content, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return content
