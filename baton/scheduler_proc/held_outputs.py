"""`--stream-interval`: a request's new tokens go downstream every `interval` of them rather than
every step. Each message wakes the detokenizer, the frontend and the client in turn, which on a
small machine costs more CPU than the token itself (docs/benchmarks.md, "Serving around the
engine", 4d64b18)."""

from __future__ import annotations

from baton.process_messages import TokenLogprob

Tokens = tuple[list[int], list[TokenLogprob] | None]


class HeldOutputs:
    """Tokens held back per request. A request's first tokens are never held (its time to
    first token stays what the engine made it), and its last output takes what it holds."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[str, Tokens] = {}

    def add(
        self, rid: str, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> Tokens | None:
        """The tokens to send now, those held before first; None while fewer than `interval`
        are waiting."""
        tokens, logprobs = self.take(rid, tokens, logprobs)
        if len(tokens) >= self.interval:
            return tokens, logprobs
        self._held[rid] = (tokens, logprobs)
        return None

    def drop(self, rid: str) -> None:
        """Forget what `rid` holds (an aborted request's final output carries no tokens)."""
        self._held.pop(rid, None)

    def take(self, rid: str, tokens: list[int], logprobs: list[TokenLogprob] | None) -> Tokens:
        """What `rid` holds followed by `tokens` (its last output, or an interval's worth)."""
        held = self._held.pop(rid, None)
        if held is None:
            return tokens, logprobs
        held_tokens, held_logprobs = held
        if held_logprobs is None:
            return held_tokens + tokens, logprobs
        return held_tokens + tokens, held_logprobs + (logprobs or [])
