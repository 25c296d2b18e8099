"""A checkpoint's tokenizer, loaded with the `tokenizers` library alone (no transformers, no
torch): the pipeline of its `tokenizer.json`, and from `tokenizer_config.json` its special
tokens and chat template.

It encodes and decodes exactly as transformers' fast tokenizer does for the same folder (a test
compares them token for token), which is what every Hugging Face checkpoint Baton serves ships.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from baton.checkpoint.chat_template import ChatTemplate
from baton.checkpoint.json_files import read_json
from baton.checkpoint.model_config import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.chat_template = ChatTemplate(chat_template, special_tokens) if chat_template else None

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` instead of the checkpoint's template (--chat-template)."""
        self.chat_template = ChatTemplate(source, self.special_tokens)

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """Load the tokenizer saved in a checkpoint folder; CheckpointError naming what is
        missing or broken."""
        file = folder / TOKENIZER_FILE
        if not file.is_file():
            raise CheckpointError(f"{folder}: no tokenizer ({TOKENIZER_FILE})")
        try:
            backend = Backend.from_file(str(file))
        except Exception as error:  # the Rust library raises its own exception type
            raise CheckpointError(f"{file}: cannot load the tokenizer: {error}") from error
        config = read_json(folder / TOKENIZER_CONFIG_FILE, required=False)
        special_map = read_json(folder / SPECIAL_TOKENS_MAP_FILE, required=False)
        special_tokens = {}
        for key in SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key) or special_map.get(key))
            if content is not None:
                special_tokens[key] = content
        # transformers skips `clean_up_tokenization_spaces` for the BPE tokenizers of the models
        # Baton serves (it would strip spaces before punctuation), and so does this.
        return cls(backend, special_tokens, _chat_template(folder, config))

    def save(self, folder: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json: a folder both Baton and transformers
        load."""
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / TOKENIZER_FILE))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template.source
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2))

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included."""
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor
        adds (BOS for most models)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; ValueError-like errors from the library for unknown ids."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (e.g. "▁time", "<0xE2>"), None if there is none."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry `token` (added tokens included), None if there is
        none."""
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token's id, None if the model names none."""
        return self._special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token's id, None if the model names none."""
        return self._special_token_id("eos_token")

    def _special_token_id(self, key: str) -> int | None:
        content = self.special_tokens.get(key)
        return None if content is None else self.token_to_id(content)

    @cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token covers: its longest vocabulary entry
        (byte-level and SentencePiece entries spell at least the characters they match),
        doubled as a margin for normalizers that drop characters."""
        return 2 * max(len(token) for token in self.backend.get_vocab())


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The template, looked up where transformers looks: chat_template.jinja, then
    chat_template.json, then tokenizer_config.json (a string, or named templates)."""
    jinja_file, json_file = (folder / name for name in CHAT_TEMPLATE_FILES)
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = read_json(json_file, required=False).get("chat_template") or config.get(
        "chat_template"
    )
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None
