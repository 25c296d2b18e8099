"""How the native decode step chooses each row's token (native/sampling/sampling.c): which batches
it can serve, each row's settings (its draw, the adjustments made to its logits first, the raw
logprobs it reports), and the step's result in ForwardOutput's layout. It follows the torch
sampler's rules (sampler.py, logit_adjustments.py), which serve the other batches.

Nothing here creates a torch tensor (see decode_step.py): a row's arrays are Python `array`s
and ctypes buffers, which its settings point into.
"""

from __future__ import annotations

import ctypes
import random
from array import array
from collections.abc import Sequence

from baton.engine.batch.forward_batch import ForwardBatch, ForwardOutput, TokenHistory
from baton.engine.batch.seeded_uniforms import SeededUniforms
from baton.engine.native.structs import RowSampling
from baton.engine.sampling.grammar_masks import GrammarMasks
from baton.engine.sampling.logit_adjustments import BadWordTokens, banned_tokens
from baton.engine.sampling.token_counts import TokenCounts
from baton.sampling_params import SamplingParams

# One row's reported logprobs: [chosen, top...] and the top ids.
LogprobBuffers = tuple[ctypes.Array, ctypes.Array]


def sampled_in_native_step(batch: ForwardBatch) -> bool:
    """Whether the native step can choose every sampled row's token: no row is constrained by
    a grammar while min_tokens holds its stop tokens back (a complete grammar's end must then
    overrule them: GrammarMasks.yield_to_grammars), and no prompt is scored."""
    return not batch.prompt_scoring and not any(
        grammar is not None and suppressed
        for grammar, suppressed in zip(batch.grammars, batch.suppressed_token_ids)
    )


class NativeChoice:
    """One step's settings, one per batch row (None: every row takes its raw argmax), and the
    buffers they point into, kept alive here until the step's result is read."""

    def __init__(
        self,
        batch: ForwardBatch,
        unseeded: random.Random,
        histories: Sequence[TokenHistory | None] | None,
        token_counts: Sequence[TokenCounts | None] | None,
        bad_words: BadWordTokens,
        grammar_masks: GrammarMasks,
        vocab_size: int,
    ) -> None:
        """`histories` and `token_counts` are the sampled rows' (completed, placeholders
        resolved: BatchRunner's), None where no row adjusts its logits or penalizes. A seeded
        row draws its uniform from its own generator, as the torch sampler does (one draw a
        step), so its tokens do not depend on the path or the batch; the others draw from
        `unseeded`, a Python generator, since a torch op here waits to retake the GIL. A
        constrained row's mask comes from `grammar_masks`, over `vocab_size` logits."""
        self._arrays: list[array] = []
        self._grammars = batch.grammars if any(batch.grammars) else None
        self._masks = grammar_masks.compute(self._grammars, vocab_size) if self._grammars else None
        # Sampled row -> its row of the step's grammar masks.
        masked = {} if self._masks is None else {row: k for k, row in enumerate(self._masks.rows)}
        # Per sampled row: its logprob buffers and how many top ones it asked for.
        self._logprobs: list[tuple[LogprobBuffers, int] | None] = []
        settings: list[RowSampling | None] = [None] * batch.num_rows
        for index, (row, params) in enumerate(zip(batch.sample_rows, batch.sampling_params)):
            banned = list(batch.suppressed_token_ids[index])
            if params.bad_words and histories is not None:
                words = bad_words.sequences(tuple(params.bad_words))
                banned += banned_tokens(words, histories[index])
            counts = token_counts[index] if token_counts is not None else None
            settings[row] = self._row(
                params, batch.generators[index], unseeded, counts, banned, masked.get(index)
            )
        if any(setting is not None for setting in settings):
            self.settings: list[RowSampling] | None = [
                setting if setting is not None else RowSampling() for setting in settings
            ]
        else:
            self.settings = None

    def _row(
        self,
        params: SamplingParams,
        generator: SeededUniforms | None,
        unseeded: random.Random,
        counts: TokenCounts | None,
        banned: list[int],
        mask: int | None,
    ) -> RowSampling | None:
        """One sampled row's settings, `mask` its row of the step's grammar masks; None for a
        plain greedy row (its raw argmax)."""
        self._logprobs.append(None)
        if params.is_greedy and not (
            counts is not None
            or params.logit_bias
            or banned
            or params.logprobs is not None
            or params.allowed_token_ids is not None
            or mask is not None
        ):
            return None
        setting = RowSampling()  # temperature 0: the argmax
        if not params.is_greedy:
            uniform = unseeded.random() if generator is None else generator.take(1)[0]
            setting = RowSampling(
                params.temperature, params.top_p, params.min_p, uniform, params.top_k
            )
        if counts is not None:
            setting.repetition_penalty = params.repetition_penalty
            setting.frequency_penalty = params.frequency_penalty
            setting.presence_penalty = params.presence_penalty
            setting.num_seen = len(counts.ids)
            setting.seen_ids = self._keep(counts.ids)
            setting.output_counts = self._keep(counts.output_counts)
        if params.logit_bias:
            setting.num_bias = len(params.logit_bias)
            setting.bias_ids = self._keep(array("i", params.logit_bias))
            setting.bias_values = self._keep(array("f", params.logit_bias.values()))
        if params.allowed_token_ids is not None:
            setting.num_allowed = len(params.allowed_token_ids)
            setting.allowed_ids = self._keep(array("i", params.allowed_token_ids))
        if banned:
            setting.num_banned = len(banned)
            setting.banned_ids = self._keep(array("i", banned))
        if params.logprobs is not None:
            values = (ctypes.c_float * (1 + params.logprobs))()
            ids = (ctypes.c_int32 * max(params.logprobs, 1))()
            setting.logprobs, setting.top_ids = ctypes.addressof(values), ctypes.addressof(ids)
            setting.num_top = params.logprobs
            self._logprobs[-1] = ((values, ids), params.logprobs)
        if mask is not None:
            masks = self._masks
            setting.allowed_bits = ctypes.addressof(masks.bits) + mask * masks.words * 4
        return setting

    def _keep(self, values: array) -> int:
        """The address of `values`, which this keeps alive until the step's result is read."""
        self._arrays.append(values)
        return values.buffer_info()[0]

    def output(self, batch: ForwardBatch, tokens: list[int]) -> ForwardOutput:
        """The step's result: each sampled row's token, logprobs where any row asked (NaN and
        none for the others, as the torch sampler reports them), and the rows whose logits
        were no distribution (token -1), which fail alone with token 0, as do those whose
        grammar could not go on or refused the token. Constrained rows' matchers advance past
        their tokens."""
        chosen = [tokens[row] for row in batch.sample_rows]
        failed = [index for index, token in enumerate(chosen) if token < 0]
        if self._grammars is not None:
            grammar_failed = self._masks.failed
            refused = GrammarMasks.advance(
                self._grammars, [max(token, 0) for token in chosen], grammar_failed
            )
            failed = sorted({*failed, *grammar_failed, *refused})
        logprobs = top_logprobs = None
        if any(entry is not None for entry in self._logprobs):
            logprobs, top_logprobs = [], []
            for entry in self._logprobs:
                if entry is None:
                    logprobs.append([float("nan")])
                    top_logprobs.append([[]])
                    continue
                (values, ids), num_top = entry
                logprobs.append([values[0]])
                top_logprobs.append([list(zip(ids[:num_top], values[1 : 1 + num_top]))])
        return ForwardOutput(
            [[max(token, 0)] for token in chosen], logprobs, top_logprobs, failed_rows=failed
        )
