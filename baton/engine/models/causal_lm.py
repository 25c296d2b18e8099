"""Baton's own decoder-only transformer: Llama, Qwen2, Qwen3 and Gemma in one module, by config
flags (Gemma's layer: gemma.py).

The forward pass takes a flat ragged batch (all rows' new tokens concatenated), appends each
layer's K/V to the paged pool and lets the attention backend read them back; only the rows that
are sampled from get the final norm and the LM head.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from baton.checkpoint.longrope import LONGROPE, describe_longrope_choice
from baton.checkpoint.model_config import ModelConfig
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.distributed.stage_layers import stage_layers
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.attention.base import AttentionBackend, soft_cap
from baton.engine.attention.metadata import AttentionMetadata
from baton.engine.kv.pool import KVPool
from baton.engine.models.compact_model import CompactWeights
from baton.engine.models.decoder_layer import DecoderLayer, norm_dtype
from baton.engine.models.gemma import GemmaDecoderLayer, scale_embeddings
from baton.engine.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    empty_parameter,
    rms_norm,
)
from baton.engine.models.parallel_layers import ModelShards, VocabParallelHead, VocabShard
from baton.engine.models.weight_loading import WeightLoading
from baton.engine.native.formats import (
    COMPACT_MAX_ROWS,
    CompactWeight,
)
from baton.engine.native.library import NativeKernels

logger = logging.getLogger(__name__)

_CPU_DTYPES = (torch.float32, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CausalLM(CompactWeights, WeightLoading, nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding when configured).

    `dtype` is the activations', the KV cache's and every weight's but, where given, the decoder
    layers' linear weights, held in `gemm_dtype` (`ComputePlan.gemm_dtype`). With several
    tensor-parallel ranks (`tp`), it holds this rank's shard of every layer
    (models/parallel_layers.py) and computes the whole model's logits with the others.
    `context_length` is the served context (--max-model-len; None: the model's positions), by
    which LongRoPE chooses its factor set (checkpoint/longrope.py)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        gemm_dtype: torch.dtype | None = None,
        tp: TensorParallel | None = None,
        pp: PipelineParallel | None = None,
        context_length: int | None = None,
    ) -> None:
        super().__init__()
        allowed = _CUDA_DTYPES if torch.device(device).type == "cuda" else _CPU_DTYPES
        if dtype not in allowed:
            raise ValueError(f"dtype {dtype} is not supported on {device}")
        self.config = config  # the checkpoint's (self.shards.local_config: this rank's shapes)
        self.shards = ModelShards.of(config, tp or TensorParallel())
        tp = self.shards.tp
        self.pipeline = pp or PipelineParallel()
        self.layer_range = pipeline_stages(config, self.pipeline.size)[self.pipeline.stage]
        self.dtype = dtype
        self.gemm_dtype = gemm_dtype
        # The vocabulary's rows this rank holds; None: all of them.
        self.vocab_shard = (
            VocabShard(tp, config.vocab_size, *self.shards.vocab) if tp.size > 1 else None
        )
        vocab_rows = config.vocab_size if self.vocab_shard is None else self.vocab_shard.rows
        last, tied = self.pipeline.is_last, config.tie_word_embeddings
        self.holds_embedding = self.pipeline.is_first or (last and tied)
        self.embed_tokens = empty_parameter(
            vocab_rows if self.holds_embedding else 0,
            config.hidden_size,
            dtype=dtype,
            device=device,
        )
        # The embedding as the checkpoint stores it, where no float32 table is kept
        # (models/stored_weights.py): its rows are dequantized as they are looked up.
        self.embedding_stored: CompactWeight | None = None
        self.embedding_native: NativeKernels | None = None
        # Numbered from 0 on each stage: a layer's index is its place in the stage's KV pool.
        moe, first = config.moe, self.layer_range.start
        self.layers = nn.ModuleList(
            (DecoderLayer if config.gemma is None else GemmaDecoderLayer)(
                self.shards.local_config,
                layer,
                dtype,
                device,
                gemm_dtype,
                tp,
                sparse=moe is not None and moe.is_sparse(first + layer),
                window=config.layer_windows[first + layer],
            )
            for layer in range(len(self.layer_range))
        )
        # Batches of up to this many rows multiply the compact weights (attach_compact_weights).
        self.compact_max_rows = COMPACT_MAX_ROWS
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, norm_dtype(config, dtype), device
        )
        # The LM head computes in float32 whatever the model's dtype (SGLang's
        # --enable-fp32-lm-head, always on): bf16 logits round near-ties together and the
        # argmax then picks by index (on SmolLM2, "The" -1.864 and "L" -1.963 nats both became
        # -1.885 in bf16, and greedy answered in French). A tied head in another dtype gets a
        # float32 copy of the embedding once loaded.
        head_rows = config.vocab_size if last else 0  # (a stage before the last has none)
        self.lm_head = (
            Linear(config.hidden_size, head_rows, False, torch.float32, device)
            if self.vocab_shard is None or not last
            else VocabParallelHead(config.hidden_size, self.vocab_shard, device)
        )
        if tied and last and dtype == torch.float32:
            self.lm_head.weight = self.embed_tokens
        positions = config.max_position_embeddings
        scaling, context_length = config.rope_scaling, context_length or positions
        self.rotary = RotaryEmbedding(
            config.head_dim, positions, config.rope_theta, scaling, dtype, device, context_length
        )
        if scaling is not None and scaling["rope_type"] == LONGROPE:
            logger.info(describe_longrope_choice(scaling, context_length))
        # Gemma 3's windowed layers rotate by their own base, unscaled; None: as the others.
        local_base = None if config.gemma is None else config.gemma.rope_local_base_freq
        self.local_rotary = (
            None
            if local_base is None
            else RotaryEmbedding(config.head_dim, positions, local_base, None, dtype, device)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits [len(logits_indices), vocab] for the chosen rows of a ragged batch.

        input_ids/positions: [tokens]. The caller must have called `attn.plan(meta)` for this
        batch; every layer's new K/V are written to `kv_pool` at `meta.slot_mapping`.
        """
        normed = self.final_hidden(input_ids, positions, kv_pool, attn, meta, logits_indices)
        return self.logits(normed)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of `final_hidden`: the LM head's, soft-capped where the model
        caps them (Gemma 2's final_logit_softcapping)."""
        logits = self.lm_head(normed)
        cap = None if self.config.gemma is None else self.config.gemma.final_logit_softcapping
        return logits if cap is None else soft_cap(logits, cap)

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` up to the LM head: the final norm's float32 output at the chosen rows,
        which `logits` turns into logits (a caller may do so a slice at a time). On the last
        of several pipeline stages, from the hidden states the stage before sends."""
        hidden = self.stage_hidden(input_ids, positions, kv_pool, attn, meta)
        # Norm and LM head only where a token is sampled: the head is the largest matmul. Both
        # in float32 (see __init__), so no rounding to the model's dtype comes between them.
        hidden = hidden[logits_indices].float()
        return rms_norm(hidden, self.norm.weight.float(), self.norm.eps)

    def stage_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """This stage's layers over a ragged batch [tokens, hidden]: from the tokens'
        embeddings on the first stage, else from the hidden states the stage before sends."""
        if self.pipeline.is_first:
            hidden = self.embed(input_ids)
        else:
            shape = (input_ids.numel(), self.config.hidden_size)
            hidden = self.pipeline.receive_hidden(shape, self.dtype, input_ids.device)
        angles = self.rotary.angles(positions)
        local = angles if self.local_rotary is None else self.local_rotary.angles(positions)
        for layer in self.layers:
            windowed = layer.self_attn.window is not None
            hidden = layer(hidden, local if windowed else angles, kv_pool, attn, meta)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids` [tokens] -> [tokens, hidden]; IndexError for an id
        outside the vocabulary, as F.embedding raises."""
        if self.vocab_shard is not None:
            hidden = self.vocab_shard.embed(input_ids, self._embed_rows)
        else:
            hidden = self._embed_rows(input_ids)
        if self.config.gemma is not None:
            return scale_embeddings(hidden, self.config.hidden_size)
        return hidden

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows `input_ids` of the embedding this rank holds."""
        if self.embedding_stored is None:
            return F.embedding(input_ids, self.embed_tokens)
        ids = input_ids.to(torch.int64)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.config.vocab_size:
            raise IndexError("index out of range in self")
        return self.embedding_native.dequantize_rows(self.embedding_stored, ids)

    def use_native_kernels(self, native: NativeKernels) -> None:
        """Normalise, rotate q/k and store K/V with the native kernels: float32 CPU models whose
        head_dim is a multiple of 8 (the caller checks)."""
        for layer in self.layers:
            layer.self_attn.native = native
            for norm in layer.modules():
                if isinstance(norm, RMSNorm):
                    norm.native = native
            layer.mlp.native = native

    def pack_linear_weights(self) -> None:
        """Pack every linear layer's weight for oneDNN (see Linear.pack_for_cpu).

        Call after `load_weights`, where the compute plan says so (`ComputePlan.pack_weights`:
        oneDNN cannot pack every dtype on every CPU). A tied LM head gets its own packed copy;
        the embedding keeps the plain weight for its lookups.
        """
        for module in self.modules():
            if isinstance(module, Linear) and module.out_features:  # (no stage's empty head)
                module.pack_for_cpu()


def pipeline_stages(config: ModelConfig, size: int) -> list[range]:
    """Each of `size` pipeline stages' layers of `config`'s model, the LM head weighed as the
    layers its weights make (`stage_layers`). ValueError for more stages than layers."""
    hidden = config.hidden_size
    layer_weights = hidden * (2 * config.q_size + 2 * config.kv_size)
    layer_weights += 3 * hidden * config.intermediate_size
    return stage_layers(config.num_layers, size, config.vocab_size * hidden / layer_weights)
