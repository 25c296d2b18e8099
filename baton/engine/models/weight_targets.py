"""Where each checkpoint tensor goes in `CausalLM`: rows of one of its (possibly fused)
parameters, and, with tensor parallelism, which part of the tensor this rank holds."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from baton.checkpoint.gemma_config import GEMMA_NORM_SHIFT
from baton.checkpoint.model_config import ModelConfig
from baton.config import ConfigurationError
from baton.engine.models.decoder_layer import DecoderLayer
from baton.engine.models.gemma import GemmaDecoderLayer
from baton.engine.models.moe import SparseMoE
from baton.engine.models.parallel_layers import WHOLE, ModelShards, Shard
from baton.engine.native.formats import CompactWeight


@dataclass(frozen=True)
class WeightTarget:
    """Where one HF tensor of `shape` (the checkpoint's) goes: this rank's `shard` of it, into
    `rows` of `param`, plus `shift` (Gemma's norms, gemma_config.GEMMA_NORM_SHIFT)."""

    param: torch.Tensor
    rows: slice
    shape: tuple[int, ...]
    shard: Shard = WHOLE
    shift: float = 0.0

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the part this rank holds."""
        return self.shard.local_shape(self.shape)


def weight_targets(
    config: ModelConfig,
    shards: ModelShards,
    embedding: torch.Tensor | None,
    norm: torch.Tensor | None,
    lm_head: torch.Tensor | None,
    layers: Iterable[DecoderLayer],
    first_layer: int = 0,
) -> dict[str, WeightTarget]:
    """HF parameter name -> destination, for every tensor a checkpoint must provide, of the
    model whose parameters these are (`config` the checkpoint's, `shards` this rank's): a
    pipeline stage's `layers` are the checkpoint's from `first_layer` on, and the embedding,
    norm and head it does not hold are None."""
    targets: dict[str, WeightTarget] = {}

    def add(
        name: str,
        param: torch.Tensor,
        start: int = 0,
        shape: tuple[int, ...] = (),
        shard: Shard = WHOLE,
    ) -> None:
        shape = shape or tuple(param.shape)
        rows = shard.local_shape(shape)[0]
        targets[name] = WeightTarget(param, slice(start, start + rows), shape, shard)

    shift = 0.0 if config.gemma is None else GEMMA_NORM_SHIFT

    def add_norm(name: str, param: torch.Tensor, rows: slice = slice(None)) -> None:
        """A norm's [size] weight, into `rows` of `param` (broadcast over a row per head)."""
        targets[name] = WeightTarget(param, rows, tuple(param.shape[-1:]), shift=shift)

    hidden, head_dim = config.hidden_size, config.head_dim
    vocab = (config.vocab_size, hidden)
    if embedding is not None:
        add("model.embed_tokens.weight", embedding, shape=vocab, shard=shards.vocab_rows())
    if norm is not None:
        add_norm("model.norm.weight", norm)
    if lm_head is not None and not config.tie_word_embeddings:
        add("lm_head.weight", lm_head, shape=vocab, shard=shards.vocab_rows())
    # This rank's q, k and v rows, one after the other in the fused projection.
    local_q = shards.q_heads[1] * head_dim
    local_kv = shards.kv_heads[1] * head_dim
    qkv = {
        "q": (0, config.q_size, shards.head_rows(shards.q_heads)),
        "k": (local_q, config.kv_size, shards.head_rows(shards.kv_heads)),
        "v": (local_q + local_kv, config.kv_size, shards.head_rows(shards.kv_heads)),
    }
    inter, local_inter = config.intermediate_size, shards.intermediate[1]
    for index, layer in enumerate(layers, start=first_layer):
        prefix = f"model.layers.{index}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if isinstance(layer, GemmaDecoderLayer):
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm_name in norms:
            add_norm(f"{prefix}{norm_name}.weight", getattr(layer, norm_name).weight)
        attn = layer.self_attn
        for proj, (start, size, rows) in qkv.items():
            name = f"{prefix}self_attn.{proj}_proj."
            add(name + "weight", attn.qkv_proj.weight, start, (size, hidden), rows)
            if config.qkv_bias:
                add(name + "bias", attn.qkv_proj.bias, start, (size,), rows)
        o_shape = (hidden, config.q_size)
        add(
            prefix + "self_attn.o_proj.weight",
            attn.o_proj.weight,
            0,
            o_shape,
            shards.head_columns(),
        )
        if config.o_bias:
            add(prefix + "self_attn.o_proj.bias", attn.o_proj.bias)  # every rank's, added once
        if attn.qk_norm is not None:
            # One [head_dim] vector per norm, broadcast over this rank's heads' rows by copy_.
            heads = shards.q_heads[1]
            add_norm(prefix + "self_attn.q_norm.weight", attn.qk_norm, slice(0, heads))
            add_norm(prefix + "self_attn.k_norm.weight", attn.qk_norm, slice(heads, None))
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            targets.update(_expert_targets(prefix, index, mlp, hidden))
            continue
        for proj, start in (("gate", 0), ("up", local_inter)):
            name = f"{prefix}mlp.{proj}_proj."
            rows = shards.intermediate_rows()
            add(name + "weight", mlp.gate_up_proj.weight, start, (inter, hidden), rows)
            if config.mlp_bias:
                add(name + "bias", mlp.gate_up_proj.bias, start, (inter,), rows)
        down_shape = (hidden, inter)
        down_columns = shards.intermediate_columns()
        add(prefix + "mlp.down_proj.weight", mlp.down_proj.weight, 0, down_shape, down_columns)
        if config.mlp_bias:
            add(prefix + "mlp.down_proj.bias", mlp.down_proj.bias)
    return targets


def _expert_targets(
    prefix: str, layer: int, block: SparseMoE, hidden: int
) -> dict[str, WeightTarget]:
    """A mixture-of-experts layer's tensors: its router, each expert's gate, up and down (into
    their slices of the stacked weights: this rank's experts only) and a shared expert with its
    gate (where the block holds it)."""
    moe = block.moe
    features = moe.expert_intermediate_size
    block_prefix = f"{prefix}{moe.prefix}."
    targets = {
        block_prefix + "gate.weight": WeightTarget(
            block.router, slice(0, moe.num_experts), (moe.num_experts, hidden)
        )
    }
    # A block holding its experts' stored weights (stored_experts.py) has no float32 ones.
    first, count = block.held
    for local in range(count if block.stored is None else 0):
        gate, up, down = moe.expert_weight_names(layer, first + local)
        stacked = block.experts_gate_up[local]
        targets[gate] = WeightTarget(stacked, slice(0, features), (features, hidden))
        targets[up] = WeightTarget(stacked, slice(features, 2 * features), (features, hidden))
        targets[down] = WeightTarget(
            block.experts_down[local], slice(0, hidden), (hidden, features)
        )
    if block.shared_expert is not None:
        shared = block.shared_expert
        size = moe.shared_intermediate_size
        name = f"{block_prefix}shared_expert."
        for proj, rows in (("gate", slice(0, size)), ("up", slice(size, 2 * size))):
            targets[f"{name}{proj}_proj.weight"] = WeightTarget(
                shared.gate_up_proj.weight, rows, (size, hidden)
            )
        targets[f"{name}down_proj.weight"] = WeightTarget(
            shared.down_proj.weight, slice(0, hidden), (hidden, size)
        )
        targets[f"{block_prefix}shared_expert_gate.weight"] = WeightTarget(
            block.shared_expert_gate, slice(0, 1), (1, hidden)
        )
    return targets


def local_compact_weights(
    targets: dict[str, WeightTarget],
    weights: Iterable[tuple[str, CompactWeight]],
    size: int,
    whole_blocks: bool,
) -> Iterator[tuple[str, CompactWeight]]:
    """This rank's part of each stored weight, copied as it comes, so that the whole ones are
    never all held at once (a name without a target passes as it is). A row-parallel weight
    whose share of input features (`size` ranks') is not whole blocks of its format is refused
    where `whole_blocks` (it is the only copy: a GGUF held as stored), else left out (the layer
    keeps multiplying its float32 weight)."""
    for name, compact in weights:
        target = targets.get(name)
        if target is None or (compact.out_features, compact.in_features) != target.shape:
            yield name, compact
            continue
        local = target.shard.take_compact(compact)
        if local is not None:
            yield name, local
        elif whole_blocks:
            raise ConfigurationError(
                f"{name} has {compact.in_features} input features, stored in {compact.format} "
                f"blocks: {compact.in_features} / --tensor-parallel-size {size} is not whole "
                "blocks; choose another --tensor-parallel-size"
            )
