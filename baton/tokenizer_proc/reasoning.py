"""Whether a chat reply opens inside the model's reasoning (baton/reasoning.py), read from its
rendered prompt under `--reasoning-parser`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.checkpoint.tokenizer import Tokenizer
from baton.config import ConfigurationError
from baton.reasoning import THINK_END, THINK_START

# A prompt that closed the block for the reply (`enable_thinking: false`) ends with `</think>`
# and a few tokens of whitespace; a longer tail is a conversation that went on after one.
CLOSING_TAIL_TOKENS = 8


@dataclass(frozen=True)
class ReasoningTokens:
    """The reasoning block's tags as token ids of one model."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, parser: str) -> ReasoningTokens:
        """The tags' ids; ConfigurationError where the vocabulary cannot mark the block: a tag
        that is not one token, or one decoding skips as special."""
        ids = []
        for tag in (THINK_START, THINK_END):
            token = tokenizer.token_to_id(tag)
            if token is None:
                raise ConfigurationError(
                    f"--reasoning-parser {parser} needs {tag} as one token of the model's "
                    "vocabulary, and this model has none: drop --reasoning-parser"
                )
            if tokenizer.decode([token]) != tag:
                raise ConfigurationError(
                    f"--reasoning-parser {parser}: this model's {tag} is a special token that "
                    "decoding drops, so replies could not show where reasoning ends"
                )
            ids.append(token)
        return cls(*ids)

    def reply_end(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], continue_final_message: bool
    ) -> int | None:
        """The token that ends the reasoning the reply to this chat prompt opens in (the end
        tag's id); None where the reply opens as content."""
        opens = self.opens_in_reasoning(tokenizer, prompt_ids, continue_final_message)
        return self.end if opens else None

    def opens_in_reasoning(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], continue_final_message: bool
    ) -> bool:
        """Whether the reply to this prompt starts inside the block. A new turn does unless
        the prompt closed the block for it (its last `</think>` is followed by whitespace
        alone); a continued message does when the prompt's last tag opened the block."""
        last_start = _last_index(prompt_ids, self.start)
        last_end = _last_index(prompt_ids, self.end)
        if continue_final_message or last_start > last_end:
            return last_start > last_end
        if last_end < 0:
            return True
        tail = prompt_ids[last_end + 1 :]
        closed = len(tail) <= CLOSING_TAIL_TOKENS and not tokenizer.decode(tail).strip()
        return not closed


def _last_index(ids: Sequence[int], token: int) -> int:
    try:
        return len(ids) - 1 - list(reversed(ids)).index(token)
    except ValueError:
        return -1
