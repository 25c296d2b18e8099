"""The shards a rank holds and the vocabulary-parallel embedding and LM head, one rank at a time:
the test plays the collectives (adding the ranks' embeddings, gathering their logits)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import ModelConfig
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.models.parallel_layers import WHOLE, ModelShards, Shard, VocabShard
from baton.engine.native.library import NativeKernels
from baton.engine.weights.gguf_weights import iter_gguf_compact_weights

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-llama-Q3_K_M.gguf"
VOCAB = 11  # over 2 ranks: 6 rows each, the last padded with a zero row


@dataclasses.dataclass(frozen=True)
class PlayedRank(TensorParallel):
    """A rank whose collectives the test plays: its sum is its own part (the test adds the
    ranks'), its gather the ranks' parts the test hands it."""

    parts: tuple[torch.Tensor, ...] = ()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        assert any(part is tensor for part in self.parts)  # this rank's own is among them
        return torch.cat(self.parts, dim=-1)


@pytest.fixture(scope="module")
def config(tiny_model_factory: Callable[..., Path]) -> ModelConfig:
    return dataclasses.replace(
        load_checkpoint(str(tiny_model_factory("qwen3"))).config, vocab_size=VOCAB
    )


def shards(config: ModelConfig, rank: int) -> ModelShards:
    return ModelShards.of(config, TensorParallel(rank=rank, size=2))


def test_each_rank_embeds_its_rows_and_the_sum_is_the_whole_embedding(config: ModelConfig) -> None:
    table = torch.randn(VOCAB, 8)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    parts = []
    for rank in range(2):
        rank_shards = shards(config, rank)
        local = rank_shards.vocab_rows().take(table)
        assert local.shape == (6, 8)
        vocab = VocabShard(PlayedRank(rank, 2), VOCAB, *rank_shards.vocab)
        parts.append(vocab.embed(ids, lambda rows, local=local: F.embedding(rows, local)))
    assert torch.equal(parts[0][1], table[5]) and not parts[0][2].any()  # id 6 is rank 1's
    assert torch.equal(parts[0] + parts[1], F.embedding(ids, table))
    # Past the vocabulary, in rank 1's padding row too: refused as F.embedding refuses it.
    for bad in (VOCAB, -1):
        with pytest.raises(IndexError):
            vocab.embed(torch.tensor([1, bad]), lambda rows: F.embedding(rows, local))


def test_the_gathered_logits_are_the_whole_heads_cut_to_the_vocabulary(config: ModelConfig) -> None:
    head, hidden = torch.randn(VOCAB, 8), torch.randn(3, 8)
    local = [hidden @ shards(config, rank).vocab_rows().take(head).T for rank in range(2)]
    assert local[1][:, -1].eq(0).all()  # the padding row's logits
    for rank in range(2):
        vocab = VocabShard(
            PlayedRank(rank, 2, parts=tuple(local)), VOCAB, *shards(config, rank).vocab
        )
        logits = vocab.gather_logits(local[rank])
        assert logits.shape == (3, VOCAB) and logits.is_contiguous()
        torch.testing.assert_close(logits, hidden @ head.T)


def test_heads_and_features_split_by_rank(config: ModelConfig) -> None:
    """qwen3's 4 q heads, 2 KV heads of 32 and 160 MLP features over 2 ranks."""
    rank1 = shards(config, 1)
    assert (rank1.q_heads, rank1.kv_heads, rank1.intermediate) == ((2, 2), (1, 1), (80, 80))
    assert rank1.head_rows(rank1.q_heads) == Shard(rows=slice(64, 128))
    assert rank1.head_columns() == Shard(columns=slice(64, 128))
    assert rank1.local_config.q_size == 64 and rank1.local_config.kv_size == 32
    assert shards(config, 0).vocab_rows() == Shard(rows=slice(0, 6), padded_rows=6)
    single = ModelShards.of(config, TensorParallel())
    assert single.local_config == config
    assert {single.vocab_rows(), single.head_columns(), single.intermediate_rows()} == {WHOLE}


def test_fewer_kv_heads_than_ranks_copy_the_one_each_ranks_q_heads_group_over(
    config: ModelConfig,
) -> None:
    """8 q heads over 2 KV heads on 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1."""
    config = dataclasses.replace(config, num_heads=8, intermediate_size=160)
    held = [ModelShards.of(config, TensorParallel(rank, 4)) for rank in range(4)]
    assert [rank.kv_heads for rank in held] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [rank.q_heads for rank in held] == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_stored_shards_keep_whole_blocks_and_pad_with_zero_weights(native: NativeKernels) -> None:
    stored = dict(iter_gguf_compact_weights(FIXTURE, load_checkpoint(str(FIXTURE)).config))
    down = stored["model.layers.0.mlp.down_proj.weight"]  # Q4_K, 512 input features
    whole = native.dequantize(down)
    second_block = Shard(columns=slice(256, 512)).take_compact(down)
    assert second_block.in_features == 256
    assert torch.equal(native.dequantize(second_block), whole[:, 256:])
    assert Shard(columns=slice(128, 384)).take_compact(down) is None  # cuts two blocks
    embedding = stored["model.embed_tokens.weight"]  # Q6_K
    padded = Shard(rows=slice(509, 515), padded_rows=6).take_compact(embedding)
    rows = native.dequantize(padded)
    assert torch.equal(rows[:3], native.dequantize(embedding)[509:]) and not rows[3:].any()
    assert WHOLE.take_compact(embedding) is embedding
