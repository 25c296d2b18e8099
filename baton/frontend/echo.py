"""Completions' `echo`: each choice's text starts with its prompt's, and with `logprobs` its
logprobs with the prompt tokens' (the pipeline scores them: `SamplingParams.prompt_logprobs`);
with `max_tokens: 0` the prompt is all that comes back, as in vLLM."""

from __future__ import annotations

from typing import Literal

from baton.client import BatonClient
from baton.messages import GenerateDelta

# Where the prompt goes: before the generated output, or instead of it (max_tokens 0: one token
# is still generated and dropped, as vLLM does; its finish reason stays, an "error" included).
EchoMode = Literal["before_output", "instead_of_output"]


class Echo:
    """Rewrites one choice's deltas: the first one gains the prompt's text in front (the
    completions formatter puts its `prompt_logprobs` in front of the output's)."""

    def __init__(self, prompt_text: str, mode: EchoMode) -> None:
        self._prompt_text: str | None = prompt_text
        self._mode = mode

    def apply(self, delta: GenerateDelta) -> GenerateDelta:
        """The delta as the client sees it (modified in place). The prompt goes on the first
        delta with output, where its logprobs come too; the admission stays empty."""
        if delta.admission:
            return delta
        if self._mode == "instead_of_output":
            delta.token_ids, delta.text, delta.logprobs = [], "", None
        if self._prompt_text is not None:
            delta.text = self._prompt_text + delta.text
            self._prompt_text = None
        return delta


async def prompt_echo(client: BatonClient, prompt: str | list[int], mode: EchoMode) -> Echo:
    """The echo of a completions prompt: its own text, or the text of its token ids (special
    tokens kept, as vLLM decodes an echoed token prompt)."""
    text = prompt if isinstance(prompt, str) else await client.detokenize(prompt)
    return Echo(text, mode)
