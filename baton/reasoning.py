"""Reasoning outputs, as vLLM's `--reasoning-parser` serves them: a reasoning model (Qwen3,
DeepSeek-R1 and its distills, QwQ) thinks in a `<think>...</think>` block before it answers, and
a chat reply's block comes back as its `reasoning`, apart from its `content`.

Whether a reply opens inside the block is the prompt's to say (the tokenizer process reads it
from the rendered prompt: tokenizer_proc/reasoning.py). Templates differ: Qwen3's lets the model
write `<think>` itself, newer ones write it into the prompt, and a template asked not to think
(Qwen3's `enable_thinking: false`) closes an empty block in the prompt. So a reply that opens in
reasoning is reasoning up to its first `</think>`, and content after it; a `<think>` the model
writes first is dropped. A reply whose block never closes (cut by `max_tokens`) is all
reasoning, and one whose prompt closed the block is all content.

The tags must be single tokens that decode to their text (checked at start-up), so they also
mark where a constraint starts (engine/batch/grammar.py) and cannot hide in special-token skipping.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningSplit:
    """One reply's text, split into reasoning and content as it streams: `feed` returns what is
    surely one or the other so far, holding back a tail that may be the start of a tag."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._opened = False  # past a leading <think> (or sure there is none)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        if not self.in_reasoning:
            return "", text
        held = self._held + text
        if not self._opened:
            opening = held.lstrip()
            if THINK_START.startswith(opening) and len(opening) < len(THINK_START):
                self._held = held  # whitespace, or a part of <think>: not known yet
                return "", ""
            if opening.startswith(THINK_START):
                held = opening[len(THINK_START) :]
            self._opened = True
        end = held.find(THINK_END)
        if end >= 0:
            self.in_reasoning, self._held = False, ""
            return held[:end], held[end + len(THINK_END) :]
        keep = _partial_tag(held, THINK_END)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], ""

    def finish(self) -> str:
        """The reasoning held back at the reply's end (a block that never closed)."""
        held, self._held = self._held, ""
        return held if self.in_reasoning else ""


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A whole reply's (reasoning, content), each None where the reply has none; vLLM's shape:
    no reasoning unless it opened in it, no content unless the block closed."""
    if not in_reasoning:
        return None, text
    split = ReasoningSplit(in_reasoning=True)
    reasoning, content = split.feed(text)
    reasoning += split.finish()
    if split.in_reasoning:
        return reasoning, None
    return reasoning, content or None


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag` (and is not all of it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
