"""Turning scheduled rows into an engine batch, and the engine's output back into sequence state."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from baton.engine.batch.forward_batch import (
    PLACEHOLDER_TOKEN,
    ForwardBatch,
    ForwardOutput,
    PromptScoring,
    TokenHistory,
)
from baton.engine.batch.grammar import GrammarRow
from baton.process_messages import TokenLogprob
from baton.scheduler_proc.batch_policy import ScheduledRow
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence import Sequence


def build_forward_batch(
    rows: list[ScheduledRow], eos_token_ids: Seq[int], speculative: bool = False
) -> ForwardBatch:
    """Snapshot the rows into a ForwardBatch.

    Page tables are copied: the scheduler keeps mutating them (caching, reverting, growing) while
    the batch computes on the worker thread. With speculative decoding each speculative row
    carries its sequence's known tokens, which the engine proposes drafts from.
    """
    batch = ForwardBatch([], [], [], [], [], [], [], [])
    for index, row in enumerate(rows):
        seq, step = row.seq, row.step
        end = step.start + step.num_tokens
        known = seq.tokens[step.start : end]
        batch.input_ids.extend(known)
        # A decode scheduled while its input token is still being sampled (overlap loop).
        batch.input_ids.extend([PLACEHOLDER_TOKEN] * (step.num_tokens - len(known)))
        batch.kv_starts.append(step.start)
        batch.q_lens.append(step.num_tokens)
        batch.page_tables.append(seq.page_table[: -(-end // seq.page_size)])
        batch.slots.append(seq.slot)
        batch.entered_slot.append(row.entered_slot)
        if seq.prompt_logprobs is not None and step.is_prefill:
            offset, targets = seq.prompt_tokens_to_score(step)
            if targets:
                batch.prompt_scoring.append(
                    PromptScoring(index, offset, targets, seq.params.prompt_logprobs or 0)
                )
        if speculative:
            batch.num_drafts.append(step.num_drafts)
            batch.contexts.append(list(seq.tokens) if step.num_drafts else [])
        if step.samples:
            batch.sample_rows.append(index)
            batch.sampling_params.append(seq.params)
            batch.generators.append(seq.generator)
            batch.suppressed_token_ids.append(_suppressed(seq, eos_token_ids))
            # A copy: the scheduler appends this batch's predecessor's tokens while it computes.
            batch.histories.append(
                TokenHistory(list(seq.tokens), seq.num_prompt_tokens)
                if seq.params.adjusts_logits
                else None
            )
            batch.grammars.append(
                GrammarRow(seq.grammar, _output_index(seq)) if seq.grammar is not None else None
            )
    return batch


def _output_index(seq: Sequence) -> int:
    """Which output the newest scheduled step samples: the in-flight placeholders count, its
    own included."""
    return seq.num_output_tokens + seq.num_placeholders - 1


def _suppressed(seq: Sequence, eos_token_ids: Seq[int]) -> list[int]:
    """Stop tokens the step's sampled token may not be: all of them while it is one of the first
    `min_tokens` outputs."""
    params = seq.params
    if _output_index(seq) >= params.min_tokens:
        return []
    return [*(params.stop_token_ids or ()), *(() if params.ignore_eos else eos_token_ids)]


def kept_tokens(
    seq: Sequence, tokens: list[int], eos_token_ids: Seq[int]
) -> tuple[list[int], str | None]:
    """The prefix of a step's `tokens` that `seq` keeps, and why it stops after them (None to go
    on): a speculative step may yield tokens past a stop token or past max_tokens."""
    params = seq.params
    room = seq.max_tokens - seq.num_output_tokens
    for index, token in enumerate(tokens[:room]):
        if (params.stop_token_ids and token in params.stop_token_ids) or (
            not params.ignore_eos and token in eos_token_ids
        ):
            return tokens[: index + 1], "stop"
    kept = tokens[:room]
    return kept, "length" if seq.num_output_tokens + len(kept) >= seq.max_tokens else None


def apply_results(
    rows: list[ScheduledRow], output: ForwardOutput, kv: KVCacheManager, eos_token_ids: Seq[int]
) -> list[tuple[Sequence, list[int], list[TokenLogprob] | None, str | None]]:
    """Apply a processed batch to its sequences: (seq, new tokens, logprobs, finish reason) each.

    Rows of sequences that finished while the batch was in flight are skipped: their tokens are
    discarded and their still-scheduled steps are reverted when they are released. A row the
    engine could not sample (`output.failed_rows`) finishes its sequence with "error". A page
    that fills with computed tokens goes to the prefix cache at once.
    """
    results = []
    sampled_index = 0
    failed = set(output.failed_rows)
    for index, row in enumerate(rows):
        seq, step = row.seq, row.step
        tokens: list[int] = []
        logprobs = None
        num_drafted = 0
        if step.samples and sampled_index in failed:
            # Its step stays unapplied: releasing the finished sequence reverts it.
            sampled_index += 1
            if not seq.is_finished:
                results.append((seq, [], None, "error"))
            continue
        if step.samples:
            tokens = output.token_ids[sampled_index]
            if output.num_drafted is not None:
                num_drafted = output.num_drafted[sampled_index]
            if output.logprobs is not None and seq.params.logprobs is not None:
                logprobs = [
                    TokenLogprob(logprob, top)
                    for logprob, top in zip(
                        output.logprobs[sampled_index], output.top_logprobs[sampled_index]
                    )
                ]
            sampled_index += 1
        if seq.is_finished:
            continue
        if output.prompt_logprobs and index in output.prompt_logprobs:
            # A prefill chunk's scored prompt tokens, in order (see Sequence).
            seq.prompt_logprobs.extend(
                TokenLogprob(logprob, top, rank)
                for logprob, top, rank in output.prompt_logprobs[index]
            )
        if not tokens:  # a prefill chunk that does not finish the prefill
            seq.apply_prefill(None)
            continue
        kept, reason = kept_tokens(seq, tokens, eos_token_ids)
        if step.is_prefill:
            seq.apply_prefill(kept[0])
            seq.cache_computed_prefix(kv)
        else:
            if step.num_drafts:
                outcome = seq.apply_speculative(kept, num_drafted, kv, len(tokens) - 1)
            else:
                outcome = seq.apply_decode(kept[0])
            if outcome.block_completed:
                seq.cache_computed_prefix(kv)
                seq.drop_pages_out_of_window(kv)
        results.append((seq, kept, logprobs and logprobs[: len(kept)], reason))
    return results
