"""Decode steps replayed per bucket give the eager forward's logits, at every bucket and with
ragged lengths, and their padding rows write only the dummy page. Recorded here by re-running
the step over the persistent buffers (a CUDA graph replays the same kernels over them; the
CUDA tests record real graphs)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton.checkpoint.load import load_checkpoint
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.graphs.buckets import graph_batch_sizes
from baton.engine.graphs.decode_graphs import DecodeGraphs
from baton.engine.graphs.decode_inputs import DecodeInputs
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM
from baton.engine.weights.checkpoint_tensors import iter_weights

PAGE_SIZE, NUM_PAGES, MAX_ROWS = 4, 96, 10
DUMMY_PAGE = NUM_PAGES - 1  # no request is given it
FLOAT32_ATOL = 1e-4  # a padded batch's GEMMs may sum in another order


class Setup:
    """A model with two pools: one run by the graphs, one eagerly, sequences prefilled alike."""

    def __init__(self, model_dir: Path) -> None:
        checkpoint = load_checkpoint(str(model_dir))
        config = checkpoint.config
        self.model = CausalLM(config, torch.float32, "cpu")
        self.model.load_weights(iter_weights(checkpoint))
        self.graph_pool, self.eager_pool = (
            KVPool.for_model(config, NUM_PAGES, PAGE_SIZE, torch.float32, "cpu") for _ in range(2)
        )
        self.eager_attention = TorchPagedAttention(config.num_heads, config.num_kv_heads)
        self.recorded: list[int] = []
        inputs = DecodeInputs(MAX_ROWS, NUM_PAGES, PAGE_SIZE, DUMMY_PAGE, "cpu")
        self.graphs = DecodeGraphs(
            self.model,
            self.graph_pool,
            inputs,
            graph_batch_sizes(MAX_ROWS),
            lambda size: TorchPagedAttention(config.num_heads, config.num_kv_heads),
            self._record,
        )

    def _record(self, step: Callable[[], None]) -> Callable[[], None]:
        self.recorded.append(len(self.recorded))
        return step

    def eager(
        self, pool: KVPool, ids: list[int], starts: list[int], q_lens: list[int], tables: list
    ) -> torch.Tensor:
        meta = build_attention_metadata(starts, q_lens, tables, PAGE_SIZE)
        self.eager_attention.plan(meta)
        last = torch.tensor(q_lens).cumsum(0) - 1
        attention = self.eager_attention
        with torch.inference_mode():
            return self.model(torch.tensor(ids), meta.positions, pool, attention, meta, last)


@pytest.fixture(scope="module")
def setup(tiny_model_factory: Callable[..., Path]) -> Setup:
    return Setup(tiny_model_factory("qwen2"))


def test_each_bucket_is_recorded_once(setup: Setup) -> None:
    assert setup.graphs.sizes == (1, 2, 4, 8, 10)
    assert len(setup.recorded) == 5
    assert setup.graphs.handles(10) and not setup.graphs.handles(11)


def test_replayed_steps_give_the_eager_logits_and_padding_stays_in_the_dummy_page(
    setup: Setup,
) -> None:
    rng = random.Random(3)
    free = list(range(NUM_PAGES - 1))
    rng.shuffle(free)
    prompts = [[rng.randrange(200) for _ in range(rng.randrange(1, 14))] for _ in range(MAX_ROWS)]
    tables = [[free.pop() for _ in range(6)] for _ in prompts]
    lengths = [len(prompt) for prompt in prompts]
    # Prefill every sequence into both pools alike.
    flat = [token for prompt in prompts for token in prompt]
    for pool in (setup.graph_pool, setup.eager_pool):
        setup.eager(pool, flat, [0] * len(prompts), lengths, tables)
    # Decode steps of every size: 10 rows, then fewer (ragged lengths, every bucket, padded).
    next_ids = [rng.randrange(200) for _ in prompts]
    for rows in (10, 7, 5, 3, 2, 1, 9):
        chosen = sorted(rng.sample(range(len(prompts)), rows))
        ids = [next_ids[i] for i in chosen]
        starts = [lengths[i] for i in chosen]
        row_tables = [tables[i] for i in chosen]
        with torch.inference_mode():
            replayed = setup.graphs.logits(ids, starts, row_tables).clone()
        eager = setup.eager(setup.eager_pool, ids, starts, [1] * rows, row_tables)
        torch.testing.assert_close(replayed, eager, rtol=0, atol=FLOAT32_ATOL)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        for i, token in zip(chosen, replayed.argmax(-1).tolist()):
            lengths[i] += 1
            next_ids[i] = token
    # Every real page holds what the eager steps wrote; pages no sequence owns stay untouched.
    used = sorted({page for table in tables for page in table})
    graph_pages, eager_pages = setup.graph_pool._storage, setup.eager_pool._storage
    torch.testing.assert_close(
        graph_pages[:, :, used], eager_pages[:, :, used], rtol=0, atol=FLOAT32_ATOL
    )
    unused = [page for page in range(NUM_PAGES - 1) if page not in used]
    assert unused and not graph_pages[:, :, unused].any()
    assert graph_pages[:, :, DUMMY_PAGE].any()  # the padding rows' K/V went there
