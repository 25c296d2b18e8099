"""Token log-probabilities in OpenAI's two shapes: completions' parallel lists and chat's
`content` entries.

The pipeline sends token ids; their text is decoded here. A token's text is what it adds after
a few tokens of context (as an incremental detokenizer sees it), so "▁time" reads " time", and
completions' `text_offset`s line up with the generated text. Decoding keeps special tokens, so
an end-of-sequence token is shown (e.g. "</s>") rather than an empty string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from baton.messages import TokenLogprob

# Enough context for a tokenizer's decoder to place spaces and merge byte pieces right.
CONTEXT_TOKENS = 4
# JSON has no -inf; vLLM reports impossible tokens with this floor too.
MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT_CHARACTER = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


@dataclass(frozen=True, slots=True)
class TokenText:
    """One token as shown to the client."""

    text: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """A generated token and its top alternatives (most likely first)."""

    token: TokenText
    top: list[TokenText]


class TokenTextDecoder:
    """Decodes token ids to the text they add in context."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        # A first token has no generated context: an ordinary word stands in, so that a leading
        # "▁" still reads as a space.
        self.anchor: list[int] = tokenizer.encode("a", add_special_tokens=False)[-1:]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def text_after(self, context: list[int], base: str, token_id: int) -> str:
        """The text `token_id` adds after `context` (whose decoded text is `base`)."""
        full = self._decode([*context, token_id])
        if full.startswith(base):
            return full[len(base) :]
        return self._decode([token_id])

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's bytes. A token holding part of a character decodes to U+FFFD; its bytes
        then come from its vocabulary entry: a SentencePiece byte-fallback token ("<0xE2>") or
        a byte-level BPE token (GPT-2's alphabet, one character per byte)."""
        if REPLACEMENT_CHARACTER not in text:
            return list(text.encode("utf-8"))
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return list(text.encode("utf-8"))
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        if piece and all(char in _BYTE_LEVEL for char in piece):
            return [_BYTE_LEVEL[char] for char in piece]
        return list(text.encode("utf-8"))

    def entries(
        self, context: list[int], token_ids: list[int], logprobs: list[TokenLogprob]
    ) -> list[LogprobEntry]:
        """Entries for consecutive generated tokens; `context` is the tokens before them."""
        window = list(context[-CONTEXT_TOKENS:]) or list(self.anchor)
        entries = []
        for token_id, logprob in zip(token_ids, logprobs):
            base = self._decode(window)
            chosen = self._token(window, base, token_id, logprob.logprob)
            top = [self._token(window, base, alt, alt_logprob) for alt, alt_logprob in logprob.top]
            entries.append(LogprobEntry(chosen, top))
            window = [*window[1 - CONTEXT_TOKENS :], token_id]
        return entries

    def _token(self, window: list[int], base: str, token_id: int, logprob: float) -> TokenText:
        text = self.text_after(window, base, token_id)
        return TokenText(text, self.token_bytes(token_id, text), max(logprob, MIN_LOGPROB))


class ChoiceLogprobs:
    """Per-choice state (context tokens, text offset) for formatting streamed logprobs."""

    def __init__(self, decoder: TokenTextDecoder) -> None:
        self._decoder = decoder
        self._context: list[int] = []
        self._offset = 0

    def _entries(
        self, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> list[LogprobEntry]:
        entries = self._decoder.entries(self._context, token_ids, logprobs or [])
        self._context = [*self._context, *token_ids][-CONTEXT_TOKENS:]
        return entries

    def completion(
        self, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> dict[str, list]:
        """Completions' shape: parallel lists; each top dict includes the chosen token."""
        body: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry in self._entries(token_ids, logprobs):
            body["tokens"].append(entry.token.text)
            body["token_logprobs"].append(entry.token.logprob)
            top = {alt.text: alt.logprob for alt in entry.top}
            top.setdefault(entry.token.text, entry.token.logprob)
            body["top_logprobs"].append(top)
            body["text_offset"].append(self._offset)
            self._offset += len(entry.token.text)
        return body

    def chat(
        self, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> dict[str, list[dict]]:
        """Chat's shape: `content`, one entry per token with its `top_logprobs`."""
        content = []
        for entry in self._entries(token_ids, logprobs):
            content.append(
                {
                    **_chat_token(entry.token),
                    "top_logprobs": [_chat_token(alt) for alt in entry.top],
                }
            )
        return {"content": content}


def _chat_token(token: TokenText) -> dict[str, object]:
    return {"token": token.text, "logprob": token.logprob, "bytes": token.bytes}
