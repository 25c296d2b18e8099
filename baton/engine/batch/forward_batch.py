"""What the scheduler hands the engine for one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.batch.grammar import GrammarRow
from baton.engine.batch.seeded_uniforms import SeededUniforms
from baton.sampling_params import SamplingParams

# An input token not known when the batch was scheduled (overlap loop): the engine reads it from
# its buffer of last sampled tokens, at the row's slot, when the forward runs.
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True)
class TokenHistory:
    """A sampled row's tokens so far, in order: its `prompt_len` prompt tokens, then its
    outputs."""

    tokens: list[int]
    prompt_len: int


@dataclass(frozen=True)
class PromptScoring:
    """Prompt tokens of one prefill row to score (`SamplingParams.prompt_logprobs`): the
    log-probability of `targets[k]` given the row's tokens up to and including its position
    `offset + k` (an index into the row's chunk), with the `num_top` likeliest alternatives."""

    row: int
    offset: int
    targets: list[int]
    num_top: int


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
    generators: list[SeededUniforms | None]  # per sampled row: its own random source
    # Per sampled row: token ids it must not sample now (EOS and stop ids before min_tokens).
    suppressed_token_ids: list[list[int]] = field(default_factory=list)
    # Speculative decoding, per row: how many drafts the engine proposes and verifies after the
    # row's one known (or placeholder) input token, and the tokens the scheduler knew of its
    # sequence when it scheduled the row (what drafts are proposed from; [] for other rows).
    num_drafts: list[int] = field(default_factory=list)
    contexts: list[list[int]] = field(default_factory=list)
    # Per row: whether it is its request's first step in its slot (the engine's per-slot state,
    # drafts and penalty counts, starts over).
    entered_slot: list[bool] = field(default_factory=list)
    # Per sampled row whose params have penalties or a logit bias: its tokens as the scheduler
    # knew them (the engine appends the row's placeholders, resolved); None for other rows.
    histories: list[TokenHistory | None] = field(default_factory=list)
    # Prefill rows whose prompt tokens are scored, in row order.
    prompt_scoring: list[PromptScoring] = field(default_factory=list)
    # Per sampled row with structured outputs: its grammar (engine/batch/grammar.py); None for
    # others.
    grammars: list[GrammarRow | None] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class ForwardOutput:
    """Per sampled row: its tokens (one; for a speculative row its accepted drafts and the token
    sampled after them), and for each of them its log-probability and the top-n alternatives
    where the request asked for them; `failed_rows` (indices into the sampled rows) could not
    be sampled: their requests end with an error, the batch's other rows go on. `num_drafted`,
    per sampled row: the drafts verified (0 without speculation). `prompt_logprobs`, by the row of
    each of the batch's `prompt_scoring`: each target's logprob, top alternatives and rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = field(default=None)
    failed_rows: list[int] = field(default_factory=list)
    num_drafted: list[int] | None = None
    prompt_logprobs: dict[int, list[tuple[float, list[tuple[int, float]], int]]] = field(
        default_factory=dict
    )
