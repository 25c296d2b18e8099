"""Token log-probabilities in OpenAI's two shapes: completions' parallel lists and chat's
`content` entries. The tokens' texts and bytes come from the detokenizer
(detokenizer_proc/logprob_text.py); this only lays them out. With vLLM's
`return_tokens_as_token_ids`, a token reads "token_id:<id>" (a client can tell apart tokens whose
text is not valid UTF-8); text offsets still count the tokens' texts, so they index the output."""

from __future__ import annotations

from baton.messages import LogprobEntry, PromptLogprobs, TokenText


class ChoiceLogprobs:
    """Per-choice state (the running text offset) for formatting streamed logprobs."""

    def __init__(self, as_token_ids: bool = False) -> None:
        self._offset = 0
        self._as_token_ids = as_token_ids

    def _label(self, token: TokenText) -> str:
        return f"token_id:{token.token_id}" if self._as_token_ids else token.text

    def completion(
        self, entries: list[LogprobEntry] | None, prompt: PromptLogprobs | None = None
    ) -> dict[str, list]:
        """Completions' shape: parallel lists; each top dict includes the chosen token. An
        echoed `prompt` comes first, its first token with null logprobs (as OpenAI's)."""
        body: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        if prompt is not None:
            first = TokenText(prompt.first_token_id, prompt.first_token, [], 0.0)
            body["tokens"].append(self._label(first))
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            body["text_offset"].append(self._offset)
            self._offset += len(prompt.first_token)
            entries = [*prompt.entries, *(entries or ())]
        for entry in entries or ():
            body["tokens"].append(self._label(entry.token))
            body["token_logprobs"].append(entry.token.logprob)
            top = {self._label(alt): alt.logprob for alt in entry.top}
            top.setdefault(self._label(entry.token), entry.token.logprob)
            body["top_logprobs"].append(top)
            body["text_offset"].append(self._offset)
            self._offset += len(entry.token.text)
        return body

    def chat(self, entries: list[LogprobEntry] | None) -> dict[str, list[dict]]:
        """Chat's shape: `content`, one entry per token with its `top_logprobs`."""
        content = [
            {
                **self._chat_token(entry.token),
                "top_logprobs": [self._chat_token(alt) for alt in entry.top],
            }
            for entry in entries or ()
        ]
        return {"content": content}

    def _chat_token(self, token: TokenText) -> dict[str, object]:
        return {"token": self._label(token), "logprob": token.logprob, "bytes": token.bytes}


def vllm_prompt_logprobs(prompt: PromptLogprobs) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's `prompt_logprobs`: null for the first token (nothing precedes it), then per token
    `{id: {logprob, rank, decoded_token}}` for it and its top alternatives (ranks 1, 2...)."""
    body: list[dict[str, dict[str, object]] | None] = [None]
    for entry in prompt.entries:
        position = {str(entry.token.token_id): _vllm_logprob(entry.token, entry.rank)}
        for rank, alt in enumerate(entry.top, 1):
            position.setdefault(str(alt.token_id), _vllm_logprob(alt, rank))
        body.append(position)
    return body


def _vllm_logprob(token: TokenText, rank: int | None) -> dict[str, object]:
    return {"logprob": token.logprob, "rank": rank, "decoded_token": token.text}
