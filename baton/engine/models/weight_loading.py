"""Loading a checkpoint's tensors into a `CausalLM`'s parameters: each HF name's place
(weight_targets.py), the fused projections' rows, a pipeline stage's share, Gemma's norms
shifted to 1 + w (gemma_config.GEMMA_NORM_SHIFT)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.engine.models.moe import SparseMoE
from baton.engine.models.parallel_layers import ModelShards
from baton.engine.models.weight_targets import WeightTarget, weight_targets
from baton.engine.native.formats import CompactWeight


class WeightLoading:
    """`CausalLM.load_weights` and what it reads; `CausalLM.__init__` builds the parts declared
    here."""

    config: ModelConfig
    shards: ModelShards
    pipeline: PipelineParallel
    layer_range: range
    holds_embedding: bool
    embed_tokens: torch.Tensor
    embedding_stored: CompactWeight | None
    norm: nn.Module
    lm_head: nn.Module
    layers: nn.ModuleList

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], held: frozenset[str] = frozenset()
    ) -> None:
        """Copy HF-named tensors into our parameters, fusing q/k/v and gate/up on the way;
        `held`: the names whose stored weights the model holds already (stored_weights.py).

        Raises `CheckpointError` naming any unexpected, wrongly shaped or missing tensor.
        """
        targets = self._weight_targets()
        loaded: set[str] = set(held)
        for name, tensor in weights:
            # Old checkpoints store RoPE buffers; tied checkpoints may also repeat the embedding.
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if not self.holds(name):  # another pipeline stage's or tensor-parallel rank's
                continue
            target = targets.get(name)
            if target is None:
                raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")
            if tuple(tensor.shape) != target.shape:
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}"
                )
            part = target.shard.take(tensor)
            if target.shift:  # (in float32, as transformers' Gemma norms add 1 to w)
                part = part.float() + target.shift
            target.param[target.rows].copy_(part)
            loaded.add(name)
        missing = sorted(targets.keys() - loaded)
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): {missing[:5]}")
        tied_copy = (
            self.config.tie_word_embeddings
            and self.pipeline.is_last
            and self.lm_head.weight is not self.embed_tokens
        )
        if tied_copy and self.embedding_stored is None:
            self.lm_head.weight.copy_(self.embed_tokens)  # the float32 head of a tied model

    def _weight_targets(self) -> dict[str, WeightTarget]:
        """HF parameter name -> destination, for every tensor a checkpoint must provide."""
        last = self.pipeline.is_last
        return weight_targets(
            self.config,
            self.shards,
            self.embed_tokens if self.holds_embedding else None,
            self.norm.weight if last else None,
            self.lm_head.weight if last else None,
            self.layers,
            self.layer_range.start,
        )

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this rank (every one does to a single
        process): its pipeline stage's layers, or the embedding, norm and head it holds; of a
        mixture of experts, with several tensor-parallel ranks, its own experts' and (the first
        rank's) the shared expert's."""
        if name.startswith("model.layers."):
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            if self.pipeline.size > 1 and int(layer) not in self.layer_range:
                return False
            return self.shards.tp.size == 1 or self._holds_part(int(layer), rest)
        if self.pipeline.size == 1:
            return True
        if name.startswith("model.embed_tokens."):
            return self.holds_embedding
        return self.pipeline.is_last  # the final norm, the LM head

    def _holds_part(self, layer: int, rest: str) -> bool:
        """Whether this tensor-parallel rank holds layer `layer`'s tensor named `rest` after
        "model.layers.N.": of a mixture of experts, its own experts' (`SparseMoE.held`) and
        the shared expert's where its block has one (the first rank's)."""
        if layer not in self.layer_range:
            return True  # (a layer the model has not: named as unexpected)
        block = self.layers[layer - self.layer_range.start].mlp
        prefix = f"{self.config.moe.prefix}." if isinstance(block, SparseMoE) else None
        if prefix is None or not rest.startswith(prefix):
            return True
        part = rest[len(prefix) :]
        if part.startswith("experts."):
            first, count = block.held
            return first <= int(part.split(".")[1]) < first + count
        return not part.startswith("shared_expert") or block.shared_expert is not None
