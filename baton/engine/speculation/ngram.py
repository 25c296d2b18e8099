"""Prompt-lookup (n-gram) draft proposer for speculative decoding, vLLM's `"method": "ngram"`.

No draft model: the draft for a request is read out of its own context (prompt + generated so
far). The context's last n tokens are looked up earlier in the context, for n from `max_n` down
to `min_n`; the first n that recurs wins, and the draft is the (up to k) tokens that followed that
earlier occurrence. Text that copies its context (code edits, quoting, summaries, periodic output)
then gets long accepted drafts for the price of a search.

Among several earlier occurrences the most recent one (closest to the end) is taken: when the
model is reproducing a passage, the latest copy is the one being continued, so its continuation
is the likeliest. Every earlier occurrence has a non-empty continuation (it ends before the
context's last token). A continuation may run into the suffix itself, as in periodic text
(`a b a b a b`: the match of `a b` at position 2 continues with positions 4 and 5), and it is cut
short by the end of the context, never read past it.

The candidates are the earlier positions of the context's last token; each is extended backwards
to its match length (at most max_n). A numpy array is searched vectorised: each step of n keeps
the candidates whose preceding token also matches. A list (the scheduler's own storage) is first
searched in Python, latest candidate first, which usually ends within a few candidates (a full
max_n match, or no occurrence at all) and saves converting the context (~35 µs for 2,000 tokens);
past `python_candidates` candidates it is converted and searched with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts up to `num_speculative_tokens` tokens by prompt lookup with n-grams of
    `min_n`..`max_n` tokens (vLLM's `prompt_lookup_min` / `prompt_lookup_max`)."""

    # How many earlier occurrences of the last token a list context checks in Python before it
    # is converted to numpy instead (each costs ~0.3-0.5 µs in Python).
    python_candidates = 16

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int] | np.ndarray, num_tokens: int) -> list[int]:
        """Up to `num_tokens` (<= num_speculative_tokens) draft tokens continuing `tokens` (a
        request's whole context: prompt + generated so far): for n from max_n down to min_n, find
        the context's last n tokens earlier in the context; the first n for which a match exists
        wins, and the draft is the tokens that followed its most recent earlier occurrence (fewer
        when the context ends first). [] when no n-gram of length >= min_n recurs."""
        num_tokens = min(num_tokens, self.num_speculative_tokens)
        if num_tokens <= 0 or len(tokens) <= self.min_n:
            return []
        if not isinstance(tokens, np.ndarray):
            start = self._latest_match_python(tokens)
            if start is not None:
                return list(tokens[start : start + num_tokens]) if start >= 0 else []
            tokens = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
        start = self._latest_match_numpy(tokens)
        return tokens[start : start + num_tokens].tolist() if start >= 0 else []

    def _latest_match_python(self, tokens: Sequence[int]) -> int | None:
        """Where the draft starts (-1: no match), checking the earlier occurrences of the last
        token latest first and stopping at the first full `max_n` match; None when that takes more
        than `python_candidates` of them (converting to numpy is cheaper then)."""
        backwards = tokens[::-1]  # the context's suffix is the start of `backwards`
        length, last, max_n = len(tokens), backwards[0], self.max_n
        best_n, best_at = 0, -1
        at = 0
        for _ in range(self.python_candidates):
            try:
                at = backwards.index(last, at + 1)
            except ValueError:
                break
            n = 1
            while n < max_n and at + n < length and backwards[at + n] == backwards[n]:
                n += 1
            if n > best_n:  # strictly longer: ties keep the later (more recent) occurrence
                best_n, best_at = n, at
                if n == max_n:
                    break
        else:
            return None
        return length - best_at if best_n >= self.min_n else -1

    def _latest_match_numpy(self, context: np.ndarray) -> int:
        """Where the draft starts (-1: no match), vectorised over all the candidates."""
        last = len(context) - 1
        # Ends of earlier occurrences of the last 1, 2, ... tokens; all end before `last`, so
        # each has a non-empty continuation. Ascending, so the most recent is the final one.
        ends = np.flatnonzero(context[:last] == context[last])
        n = 1
        while n < self.max_n and ends.size:
            # Keep the ends whose occurrence also matches one token further back. `ends - n` is
            # negative only where the occurrence would start before the context: masked out.
            longer = ends[(ends >= n) & (context[ends - n] == context[last - n])]
            if not longer.size:
                break
            ends = longer
            n += 1
        if n < self.min_n or not ends.size:
            return -1
        return int(ends[-1]) + 1
