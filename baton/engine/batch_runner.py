"""Running one `ForwardBatch`: the model over its rows (the native decode step where it handles
them), then the sampler over the rows that sample, or the speculator's verification of drafts.

`BatchRunner` is `Engine`'s half that runs each batch; `Engine` (engine.py) builds what it reads.
"""

from __future__ import annotations

import itertools
import logging
import random

import torch
import torch.distributed as dist

from baton.distributed.pipeline_parallel import PipelineParallel
from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.batch.forward_batch import (
    PLACEHOLDER_TOKEN,
    ForwardBatch,
    ForwardOutput,
    TokenHistory,
)
from baton.engine.decode_step import NativeDecodeStep
from baton.engine.graphs.decode_graphs import DecodeGraphs
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM
from baton.engine.sampling.argmax import greedy_argmax
from baton.engine.sampling.grammar_masks import GrammarMasks
from baton.engine.sampling.logit_adjustments import BadWordTokens
from baton.engine.sampling.native_rows import NativeChoice, sampled_in_native_step
from baton.engine.sampling.sampler import Sampler
from baton.engine.sampling.sampling_plan import SamplingBatch
from baton.engine.sampling.token_counts import SlotTokenCounts, TokenCounts
from baton.engine.sampling.torch_rows import (
    completed_histories,
    logprob_lists,
    prompt_logprobs,
    scored_positions,
)
from baton.engine.speculation.speculator import Speculator

logger = logging.getLogger(__name__)


class BatchRunner:
    """Computes a batch and samples its next tokens, remembering the last token sampled per
    slot: the overlap loop schedules a decode before the token it consumes is known
    (`PLACEHOLDER_TOKEN`). `Engine.__init__` builds the parts declared here."""

    device: torch.device
    page_size: int
    model: CausalLM
    kv_pool: KVPool
    attention: AttentionBackend
    decode_step: NativeDecodeStep | None
    decode_graphs: DecodeGraphs | None
    sampler: Sampler
    grammar_masks: GrammarMasks
    bad_words: BadWordTokens
    token_counts: SlotTokenCounts
    unseeded_draws: random.Random
    speculator: Speculator | None
    _last_sampled: list[int]
    vocab_size: int  # the logits' width
    pp: PipelineParallel
    # The hidden states this stage sent last, until the next stage has them (isend).
    _hidden_sent: tuple[dist.Work, torch.Tensor] | None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Compute one batch and sample a token for each of its `sample_rows` (with
        speculative decoding: verify each speculative row's drafts)."""
        if self.speculator is not None:
            return self._forward_speculative(batch)
        input_ids = self._resolve_placeholders(batch)
        histories = completed_histories(batch, input_ids) if any(batch.histories) else None
        token_counts = self.token_counts.update(batch, histories)
        native = self.decode_step is not None and self.decode_step.handles(batch.q_lens)
        if native and sampled_in_native_step(batch):  # the step chooses: nothing left to do
            choice = NativeChoice(
                batch,
                self.unseeded_draws,
                histories,
                token_counts,
                self.bad_words,
                self.grammar_masks,
                self.vocab_size,
            )
            _, tokens = self.decode_step(
                input_ids, batch.kv_starts, batch.page_tables, True, choice.settings
            )
            output = choice.output(batch, tokens)
            for row, (token,) in zip(batch.sample_rows, output.token_ids):
                self._last_sampled[batch.slots[row]] = token
            return output
        starts = [0, *itertools.accumulate(batch.q_lens)]
        sample_indices = [starts[row + 1] - 1 for row in batch.sample_rows]
        scored = {}
        if batch.prompt_scoring:
            logits, scored = self._scored_forward(batch, input_ids, starts, sample_indices)
        else:
            logits = self.logits(
                input_ids, batch.kv_starts, batch.q_lens, batch.page_tables, sample_indices
            )
        token_ids, logprobs, top_logprobs, failed_rows = self._sample(
            logits, list(range(len(sample_indices))), batch, histories, token_counts
        )
        return ForwardOutput(
            [[token] for token in token_ids],
            logprobs,
            top_logprobs,
            failed_rows=failed_rows,
            prompt_logprobs=scored,
        )

    @torch.inference_mode()
    def forward_stage(self, batch: ForwardBatch) -> None:
        """A pipeline stage before the last: its layers over `batch` (K/V into its pool), the
        hidden states sent on to the next stage, which the last one samples from. The batch's
        input tokens are all known (no placeholders: the scheduler waits for them)."""
        meta = build_attention_metadata(
            batch.kv_starts, batch.q_lens, batch.page_tables, self.page_size, self.device
        )
        self.attention.plan(meta)
        hidden = self.model.stage_hidden(
            torch.tensor(batch.input_ids, dtype=torch.long, device=self.device),
            meta.positions,
            self.kv_pool,
            self.attention,
            meta,
        )
        # The send before this one must have left before its tensor is dropped; waiting here,
        # not after sending, lets this stage go on to its next micro-batch meanwhile.
        if self._hidden_sent is not None:
            self._hidden_sent[0].wait()
        self._hidden_sent = (self.pp.send_hidden(hidden), hidden)

    def _scored_forward(
        self,
        batch: ForwardBatch,
        input_ids: list[int],
        starts: list[int],
        sample_indices: list[int],
    ) -> tuple[torch.Tensor, dict[int, list[tuple[float, list[tuple[int, float]], int]]]]:
        """A batch that scores prompt tokens: the sampled rows' logits, and by row the scored
        tokens' logprobs. Off the native step the LM head runs a slice of scored positions at a
        time, so a long chunk never holds all its logits at once (2048 x 152k floats: 1.2 GB)."""
        num_sampled = len(sample_indices)
        indices = sample_indices + scored_positions(batch, starts)
        args = (input_ids, batch.kv_starts, batch.q_lens, batch.page_tables)
        if self.decode_step is not None and self.decode_step.handles(batch.q_lens):
            logits = self.logits(*args, indices)  # at most NATIVE_STEP_MAX_ROWS rows
            sampled = logits[:num_sampled]

            def scored_logits(start: int, end: int) -> torch.Tensor:
                return logits[num_sampled + start : num_sampled + end]
        else:
            normed = self._final_hidden(*args, indices)
            sampled = self.model.logits(normed[:num_sampled])

            def scored_logits(start: int, end: int) -> torch.Tensor:
                return self.model.logits(normed[num_sampled + start : num_sampled + end])

        rows = [scoring.row for scoring in batch.prompt_scoring]
        return sampled, dict(zip(rows, prompt_logprobs(scored_logits, batch.prompt_scoring)))

    def _resolve_placeholders(self, batch: ForwardBatch) -> list[int]:
        """The batch's input ids, each placeholder replaced by the last token sampled for its
        row's slot (the overlap loop scheduled the row before that token was known)."""
        if PLACEHOLDER_TOKEN not in batch.input_ids:
            return batch.input_ids
        input_ids, start = list(batch.input_ids), 0
        for slot, num_tokens in zip(batch.slots, batch.q_lens):
            for index in range(start, start + num_tokens):
                if input_ids[index] == PLACEHOLDER_TOKEN:
                    input_ids[index] = self._last_sampled[slot]
            start += num_tokens
        return input_ids

    def _forward_speculative(self, batch: ForwardBatch) -> ForwardOutput:
        resolved = self.speculator.resolve(batch)
        logits = self.logits(
            resolved.input_ids,
            resolved.kv_starts,
            resolved.q_lens,
            resolved.page_tables,
            resolved.logits_indices,
        )
        return self.speculator.verify(
            logits,
            resolved,
            batch,
            lambda rows_logits, rows: self._sample(rows_logits, rows, batch, None, None),
        )

    def logits(
        self,
        input_ids: list[int],
        kv_starts: list[int],
        q_lens: list[int],
        page_tables: list[list[int]],
        logits_indices: list[int],
    ) -> torch.Tensor:
        """Run the model over the rows (K/V into the pool); float32 logits at `logits_indices`."""
        if self.decode_step is not None and self.decode_step.handles(q_lens):
            logits, _ = self.decode_step(input_ids, kv_starts, page_tables, False)
            # A copy: the step's buffer is overwritten by the next one.
            return logits[torch.tensor(logits_indices, dtype=torch.long, device=self.device)]
        graphs = self.decode_graphs
        if graphs is not None and max(q_lens) == 1 and graphs.handles(len(q_lens)):
            logits = graphs.logits(input_ids, kv_starts, page_tables)
            # A copy, as above: the graph's output is overwritten by the next replay.
            return logits[torch.tensor(logits_indices, dtype=torch.long, device=self.device)]
        return self.model.logits(
            self._final_hidden(input_ids, kv_starts, q_lens, page_tables, logits_indices)
        )

    def _final_hidden(
        self,
        input_ids: list[int],
        kv_starts: list[int],
        q_lens: list[int],
        page_tables: list[list[int]],
        logits_indices: list[int],
    ) -> torch.Tensor:
        """The model's forward over the rows, up to the LM head (`CausalLM.final_hidden`)."""
        indices = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        meta = build_attention_metadata(kv_starts, q_lens, page_tables, self.page_size, self.device)
        self.attention.plan(meta)
        return self.model.final_hidden(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            meta.positions,
            self.kv_pool,
            self.attention,
            meta,
            indices,
        )

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[int],
        batch: ForwardBatch,
        histories: list[TokenHistory | None] | None,
        token_counts: list[TokenCounts | None] | None,
    ) -> tuple[list[int], list | None, list | None, list[int]]:
        """Sample one token for each of the given sampled rows (indices into `sample_rows`)
        from its logits row: (tokens, logprobs, top logprobs, failed rows as indices into
        `rows`). Each row's slot remembers its token for a decode scheduled before it was known.
        `histories` and `token_counts` are the sampled rows' (completed, placeholders resolved)
        where any adjusts its logits (None under speculation, which admits no request with
        penalties or a logit bias, nor structured outputs). A constrained row's grammar masks
        its logits, then takes its token."""
        grammars = [batch.grammars[i] for i in rows] if any(batch.grammars) else None
        suppressed = [batch.suppressed_token_ids[i] for i in rows]
        failed_grammars = []
        if grammars:
            failed_grammars = self.grammar_masks.apply(logits, grammars)
            suppressed = self.grammar_masks.yield_to_grammars(logits, grammars, suppressed)
        sampling = SamplingBatch.from_params(
            [batch.sampling_params[i] for i in rows],
            [batch.generators[i] for i in rows],
            self.device,
            [histories[i] for i in rows] if histories is not None else (),
            self.bad_words,
            [token_counts[i] for i in rows] if token_counts is not None else None,
            suppressed,
        )
        sampled = self.sampler.sample(logits, sampling)
        token_ids = sampled.token_ids.tolist()
        for i, token in zip(rows, token_ids):
            self._last_sampled[batch.slots[batch.sample_rows[i]]] = token
        failed_rows = sampled.failed.cpu().nonzero().flatten().tolist()
        if grammars:
            failed_grammars += self.grammar_masks.advance(grammars, token_ids, failed_grammars)
            failed_rows = sorted({*failed_rows, *failed_grammars})
        if failed_rows:
            logger.error("sampling failed for %d rows of the batch", len(failed_rows))
        return (
            token_ids,
            *logprob_lists(sampled, sampling.num_logprobs),
            failed_rows,
        )

    def idle_decode_step(self, num_rows: int) -> None:
        """A decode step of `num_rows` rows over the pool's first pages, which hold no request
        yet (at start-up only), greedy sampling included: what start-up times."""
        pages = list(range(-(-num_rows // self.page_size)))
        with torch.inference_mode():
            logits = self.logits(
                [0] * num_rows,
                list(range(num_rows)),
                [1] * num_rows,
                [pages] * num_rows,
                list(range(num_rows)),
            )
            greedy_argmax(logits)
