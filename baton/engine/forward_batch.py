"""What the scheduler hands the engine for one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.sampling_params import SamplingParams

# An input token not known when the batch was scheduled (overlap loop): the engine reads it from
# its buffer of last sampled tokens, at the row's slot, when the forward runs.
PLACEHOLDER_TOKEN = -1


@dataclass
class ForwardBatch:
    """A ragged batch: row i appends `q_lens[i]` tokens after `kv_starts[i]` cached ones."""

    input_ids: list[int]  # flat, row after row; PLACEHOLDER_TOKEN where not yet known
    kv_starts: list[int]
    q_lens: list[int]
    page_tables: list[list[int]]
    slots: list[int]  # per row: its row in the sampled-token buffer
    sample_rows: list[int]  # rows whose last token's logits are sampled, ascending
    sampling_params: list[SamplingParams]  # per sampled row
    generators: list[torch.Generator | None]  # per sampled row
    # Per sampled row: token ids it must not sample now (EOS and stop ids before min_tokens).
    suppressed_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class ForwardOutput:
    """Per sampled row: the token, and log-probabilities where the request asked for them;
    `failed_rows` (indices into the sampled rows) could not be sampled: their requests end with
    an error, the batch's other rows go on."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = field(default=None)
    failed_rows: list[int] = field(default_factory=list)
