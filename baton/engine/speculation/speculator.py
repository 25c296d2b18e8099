"""The engine's side of speculative decoding: where each row really starts, its drafts, and the
verdict on them.

The scheduler schedules a speculative row as the tail token plus k drafts and, in the overlap
loop, may schedule a sequence's next step before this one's verdict is known: it then assumes
every draft accepted (vLLM's scenario 4). The engine runs batches one at a time, so when it runs
that next step it knows the verdict; it keeps, per slot, the tokens the slot's latest step
yielded and how many of its positions were rejected, and a row whose first input is still a
placeholder starts that many positions lower and reads its input token from there. The
scheduler makes the same correction when it applies the verdict (`Sequence.apply_speculative`).

Drafts are proposed here, when the row runs, from the context the scheduler knew plus what the
slot's latest step yielded: so they always continue the verified text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.engine.batch.forward_batch import PLACEHOLDER_TOKEN, ForwardBatch, ForwardOutput
from baton.engine.sampling.argmax import greedy_argmax
from baton.engine.speculation.draft_budget import DraftBudget
from baton.engine.speculation.drafter import Draft, Drafter, DraftRequest
from baton.engine.speculation.verify import (
    accept_matching,
    keep_matching_draws,
    target_probs,
    verify_sampled,
)

# Samples the plain rows of a batch as the engine does without speculation: (their logits, their
# indices among the batch's sampled rows) -> (a token each, logprobs, top logprobs, failed rows,
# as indices into the given rows).
PlainSample = tuple[list[int], list | None, list | None, list[int]]
PlainSampler = Callable[[torch.Tensor, list[int]], PlainSample]


@dataclass
class ResolvedBatch:
    """A batch as it really runs: corrected starts, known inputs, drafts proposed."""

    input_ids: list[int]
    kv_starts: list[int]
    q_lens: list[int]
    page_tables: list[list[int]]
    logits_indices: list[int]  # per sampled row, its 1 + len(drafts) positions
    drafts: list[Draft | None]  # per sampled row; None for a plain row

    def add_row(self, ids: list[int], start: int, page_table: list[int]) -> None:
        self.input_ids.extend(ids)
        self.kv_starts.append(start)
        self.q_lens.append(len(ids))
        self.page_tables.append(page_table)


class Speculator:
    """Per-slot state of speculative decoding, and the draft/verify halves of a forward."""

    def __init__(self, drafter: Drafter, num_slots: int, budget: DraftBudget) -> None:
        self.drafter = drafter
        self.budget = budget  # which of the proposed drafts are worth verifying
        # Of each slot's latest step: the tokens it yielded, and its rejected positions.
        self._last_outputs: list[list[int]] = [[] for _ in range(num_slots)]
        self._rejected = [0] * num_slots

    def resolve(self, batch: ForwardBatch) -> ResolvedBatch:
        """Correct each row's start and input after its slot's latest verdict; propose drafts."""
        input_ids: list[int] = []
        kv_starts: list[int] = []
        q_lens: list[int] = []
        requests: list[DraftRequest] = []
        sample_index = {row: i for i, row in enumerate(batch.sample_rows)}
        offset = 0
        for row in range(batch.num_rows):
            q_len = batch.q_lens[row]
            ids = batch.input_ids[offset : offset + q_len]
            offset += q_len
            start, slot = batch.kv_starts[row], batch.slots[row]
            if batch.entered_slot and batch.entered_slot[row]:
                self.budget.reset(slot)
                self.drafter.forget(slot)
            follows_in_flight = ids[0] == PLACEHOLDER_TOKEN
            if follows_in_flight:  # a decode scheduled before its slot's latest step was done
                start -= self._rejected[slot]
                ids[0] = self._last_outputs[slot][-1]
            num_drafts = batch.num_drafts[row] if batch.num_drafts else 0
            if num_drafts:
                ids = ids[:1]
                context = batch.contexts[row]
                if follows_in_flight:
                    context = context + self._last_outputs[slot]
                if len(context) != start + 1:
                    raise RuntimeError(
                        f"slot {slot}: context of {len(context)} tokens for a row at {start}"
                    )
                sampled = sample_index[row]
                requests.append(
                    DraftRequest(
                        slot,
                        context,
                        num_drafts,
                        batch.page_tables[row],
                        batch.sampling_params[sampled],
                        batch.generators[sampled],
                    )
                )
            input_ids.extend(ids)
            kv_starts.append(start)
            q_lens.append(len(ids))
        proposed = self.drafter.propose(requests) if requests else []
        slots = [request.slot for request in requests]
        num_outputs = len(batch.sample_rows)
        drafts = iter(self.budget.trim(slots, proposed, len(input_ids), num_outputs))
        resolved = ResolvedBatch([], [], [], [], [], [])
        position = 0
        sample_rows = set(batch.sample_rows)
        for row in range(batch.num_rows):
            ids = input_ids[position : position + q_lens[row]]
            position += q_lens[row]
            start, table = kv_starts[row], batch.page_tables[row]
            draft = next(drafts) if batch.num_drafts and batch.num_drafts[row] else None
            if draft is not None and not draft.tokens:
                draft = None  # nothing to verify: sampled as a plain row
            if draft is None:
                resolved.add_row(ids, start, table)
            else:
                # Verified as 1 + m decode rows over the same pages, the j-th seeing the K/V of
                # positions up to start + j: every backend writes a layer's K/V for the whole
                # batch before it attends, so the rows see each other's, and the step stays a
                # decode step (the native one, on CPU) instead of a prefill.
                for offset, token in enumerate([*ids, *draft.tokens]):
                    resolved.add_row([token], start + offset, table)
            if row in sample_rows:
                resolved.drafts.append(draft)
                num_logits = 1 + (len(draft.tokens) if draft else 0)
                end = len(resolved.input_ids)
                resolved.logits_indices.extend(range(end - num_logits, end))
        return resolved

    def verify(
        self,
        logits: torch.Tensor,
        resolved: ResolvedBatch,
        batch: ForwardBatch,
        sample_plain: PlainSampler,
    ) -> ForwardOutput:
        """Turn the logits of every sampled position into each row's tokens, and remember per
        slot what its step yielded and rejected."""
        drafts = resolved.drafts
        first_rows: list[int] = []  # per sampled row: its first logits row
        index = 0
        for draft in drafts:
            first_rows.append(index)
            index += 1 + (len(draft.tokens) if draft is not None else 0)
        token_ids: list[list[int]] = [[] for _ in drafts]
        num_drafted = [len(draft.tokens) if draft is not None else 0 for draft in drafts]
        logprobs = top_logprobs = None
        failed: list[int] = []
        # Drawn by the plain sampler, one token a verified position: plain rows, and sampled rows
        # with deterministic drafts (n-gram), which keep their drafts while the draws match them
        # (verify.keep_matching_draws: exact in distribution, one uniform per token emitted), so
        # a seeded request samples the very tokens it would without speculation, whatever
        # drafts the budget (timed on this machine) let it verify.
        drawn = [
            i
            for i, draft in enumerate(drafts)
            if draft is None or (draft.probs is None and not batch.sampling_params[i].is_greedy)
        ]
        if drawn:
            positions = [first_rows[i] + j for i in drawn for j in range(1 + num_drafted[i])]
            tokens, drawn_logprobs, drawn_top, drawn_failed = sample_plain(
                logits.index_select(0, torch.tensor(positions)),
                [i for i in drawn for _ in range(1 + num_drafted[i])],
            )
            failed_at, at = set(drawn_failed), 0
            if drawn_logprobs is not None:
                logprobs, top_logprobs = [[] for _ in drafts], [[] for _ in drafts]
            for i in drawn:
                draft_tokens = drafts[i].tokens if drafts[i] is not None else []
                emitted = keep_matching_draws(
                    tokens[at : at + 1 + len(draft_tokens)], draft_tokens, batch.generators[i]
                )
                if failed_at.intersection(range(at, at + len(emitted))):
                    failed.append(i)
                    emitted = emitted[:1]
                token_ids[i] = emitted
                if drawn_logprobs is not None and drafts[i] is None:
                    logprobs[i], top_logprobs[i] = drawn_logprobs[at], drawn_top[at]
                at += 1 + len(draft_tokens)
        speculative = [i for i, draft in enumerate(drafts) if draft is not None]
        greedy = [i for i in speculative if batch.sampling_params[i].is_greedy]
        if greedy:
            rows = [first_rows[i] + j for i in greedy for j in range(1 + len(drafts[i].tokens))]
            argmax = greedy_argmax(logits.index_select(0, torch.tensor(rows))).tolist()
            at = 0
            for i in greedy:
                count = 1 + len(drafts[i].tokens)
                token_ids[i] = accept_matching(argmax[at : at + count], drafts[i].tokens)
                at += count
        for i in speculative:
            draft = drafts[i]
            if draft.probs is None:  # greedy, or drawn above
                continue
            rows_logits = logits[first_rows[i] : first_rows[i] + 1 + len(draft.tokens)]
            try:
                probs = target_probs(rows_logits, batch.sampling_params[i])
                token_ids[i] = verify_sampled(probs, draft.tokens, draft.probs, batch.generators[i])
            except ValueError:  # not a distribution (NaN logits): this row alone fails
                failed.append(i)
                token_ids[i] = [0]
        asking = [i for i in speculative if batch.sampling_params[i].logprobs is not None]
        if asking:
            if logprobs is None:
                logprobs, top_logprobs = [[] for _ in drafts], [[] for _ in drafts]
            for i in asking:
                rows_logits = logits[first_rows[i] : first_rows[i] + len(token_ids[i])]
                logprobs[i], top_logprobs[i] = _token_logprobs(
                    rows_logits, token_ids[i], batch.sampling_params[i].logprobs or 0
                )
        self._remember(batch, resolved, token_ids)
        return ForwardOutput(
            token_ids, logprobs, top_logprobs, failed_rows=sorted(failed), num_drafted=num_drafted
        )

    def _remember(
        self, batch: ForwardBatch, resolved: ResolvedBatch, token_ids: list[list[int]]
    ) -> None:
        for i, row in enumerate(batch.sample_rows):
            slot = batch.slots[row]
            self._last_outputs[slot] = token_ids[i]
            # The scheduler assumed every scheduled draft accepted (a plain row has none).
            num_drafts = batch.num_drafts[row] if batch.num_drafts else 0
            self._rejected[slot] = 1 + num_drafts - len(token_ids[i]) if num_drafts else 0
            if resolved.drafts[i] is not None:
                self.budget.observe(slot, len(resolved.drafts[i].tokens), len(token_ids[i]) - 1)


def _token_logprobs(
    logits: torch.Tensor, tokens: list[int], num_top: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each token's log-probability under the raw distribution of the logits row before it
    (as the sampler reports it), and the row's top `num_top` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    if not num_top:
        return chosen, [[] for _ in tokens]
    values, ids = logprobs.topk(num_top, dim=-1)
    return chosen, [list(zip(row_ids, row_values)) for row_ids, row_values in
                    zip(ids.tolist(), values.tolist())]  # fmt: skip
