"""Draft-model speculation: a small model that shares the target's tokenizer proposes the drafts.

The draft model keeps its own KV pool with the target's page geometry and is addressed through
the target's page tables: a sequence's page p holds the target's K/V in the target pool and the
draft's in this one. So the draft needs no allocation of its own: a row's pages already cover
every position it drafts (the scheduler allocated them for the 1 + k positions of the step).

Per slot, it remembers which tokens its K/V were computed for, and through which pages. A row
first catches up on the context tokens it lacks (the prompt, at first; after a step, the accepted
drafts and the new token), which also proposes the first draft; each further draft is one more
single-token step. Drafts a verdict rejects are simply recomputed: a mismatch in tokens or pages
invalidates the draft's K/V from there on.
"""

from __future__ import annotations

import logging

import torch

from baton.checkpoint.load import load_checkpoint
from baton.config import BatonConfig, ConfigurationError
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.attention.select import model_attention_backend
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM
from baton.engine.sampling.argmax import greedy_argmax
from baton.engine.sampling.sampler import _draw
from baton.engine.speculation.drafter import Draft, DraftRequest
from baton.engine.speculation.verify import target_probs
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


class DraftModel:
    """Proposes drafts by running a small model autoregressively, k steps per speculative row."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        config: BatonConfig,
        vocab_size: int,
        num_pages: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        gemm_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype` and `gemm_dtype`: the target's (ComputePlan), so both models compute alike;
        `kv_dtype`: its KV pool's (--kv-cache-dtype), so both caches round alike."""
        assert spec.model is not None
        checkpoint = load_checkpoint(spec.model)
        model_config = checkpoint.config
        if model_config.vocab_size != vocab_size:
            raise ConfigurationError(
                f"the draft model {spec.model} has a vocabulary of {model_config.vocab_size} "
                f"tokens, the target {vocab_size}: a draft model must share the tokenizer"
            )
        self.device = torch.device(config.device)
        self.page_size = config.page_size
        # (Served with the target's context: a LongRoPE draft chooses its factors by it.)
        self.model = CausalLM(
            model_config, dtype, self.device, gemm_dtype, context_length=config.max_model_len
        )
        self.model.load_weights(iter_weights(checkpoint))
        self.kv_pool = KVPool.for_model(
            model_config, num_pages, config.page_size, kv_dtype, self.device
        )
        self.attention = model_attention_backend(
            config.attention_backend, model_config, dtype, self.device
        )
        # Per slot: the tokens whose draft K/V are in the pool, and the pages they are in.
        self._computed: dict[int, tuple[list[int], list[int]]] = {}
        logger.info("draft model: %s, %d layers", checkpoint.name, model_config.num_layers)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        starts = [self._valid_prefix(request) for request in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # The first step catches each row up on its context; each later one feeds the last draft.
        inputs = [request.context[start:] for request, start in zip(requests, starts)]
        rows = list(range(len(requests)))
        for _ in range(max(request.num_drafts for request in requests)):
            logits = self._forward(
                [inputs[row] for row in rows],
                [starts[row] for row in rows],
                [requests[row].page_table for row in rows],
            )
            argmax = greedy_argmax(logits).tolist()
            for index, row in enumerate(rows):
                request = requests[row]
                if request.params.is_greedy:  # the verdict compares argmaxes
                    token = argmax[index]
                else:
                    token = self._draw(logits[index : index + 1], request, probs[row])
                tokens[row].append(token)
                starts[row] += len(inputs[row])
                inputs[row] = [token]
            rows = [row for row in rows if len(tokens[row]) < requests[row].num_drafts]
            if not rows:
                break
        for request, drafted in zip(requests, tokens):
            # Its K/V now cover the context and every draft but the last.
            self._computed[request.slot] = (request.context + drafted[:-1], request.page_table)
        return [
            Draft(drafted, torch.cat(row_probs) if row_probs else None)
            for drafted, row_probs in zip(tokens, probs)
        ]

    def forget(self, slot: int) -> None:
        self._computed.pop(slot, None)

    def _valid_prefix(self, request: DraftRequest) -> int:
        """How many leading context tokens already have the draft's K/V, in this row's pages
        (always leaving the last one to compute: its logits give the first draft)."""
        computed_tokens, computed_pages = self._computed.get(request.slot, ([], []))
        limit = min(len(computed_tokens), len(request.context) - 1)
        valid = _common_prefix(computed_tokens, request.context, limit)
        same_pages = _common_prefix(computed_pages, request.page_table, len(computed_pages))
        return min(valid, same_pages * self.page_size)

    def _forward(
        self, inputs: list[list[int]], starts: list[int], page_tables: list[list[int]]
    ) -> torch.Tensor:
        q_lens = [len(ids) for ids in inputs]
        meta = build_attention_metadata(starts, q_lens, page_tables, self.page_size, self.device)
        self.attention.plan(meta)
        input_ids = torch.tensor([t for ids in inputs for t in ids], device=self.device)
        last = torch.tensor(q_lens, device=self.device).cumsum(0) - 1
        return self.model(input_ids, meta.positions, self.kv_pool, self.attention, meta, last)

    @staticmethod
    def _draw(logits: torch.Tensor, request: DraftRequest, probs: list[torch.Tensor]) -> int:
        """A draw from the draft's distribution under the request's sampling params, whose
        probabilities the rejection sampler needs (appended to `probs`)."""
        row_probs = target_probs(logits, request.params)
        probs.append(row_probs)
        return int(_draw(row_probs, request.generator)[0])


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the common prefix of a[:limit] and b[:limit] (a few C-level compares)."""
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
