"""A model's stored compact weights (native/formats.py): which linear layers multiply the
checkpoint's bf16, f16 or GGUF blocks as stored, and their AMX tiles and AVX-512 panels.

`CompactWeights` is `CausalLM`'s half that attaches them; `CausalLM` (causal_lm.py) builds the
layers it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from baton.checkpoint.model_config import ModelConfig
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.engine.models.layers import Linear
from baton.engine.models.moe import SparseMoE
from baton.engine.models.parallel_layers import ModelShards
from baton.engine.models.stored_experts import hold_stored_experts
from baton.engine.models.weight_targets import WeightTarget, local_compact_weights
from baton.engine.native.formats import BLOCK_FORMATS, COMPACT_MAX_ROWS, CompactWeight, concat_rows
from baton.engine.native.library import NativeKernels


class CompactWeights:
    """Attaching stored weights to a `CausalLM`'s linear layers, and their repacked copies.
    `CausalLM.__init__` builds the parts declared here."""

    config: ModelConfig
    shards: ModelShards
    pipeline: PipelineParallel
    gemm_dtype: torch.dtype | None
    embed_tokens: torch.Tensor
    lm_head: Linear
    layers: nn.ModuleList
    compact_max_rows: int
    layer_range: range
    modules: Callable[[], Iterator[nn.Module]]
    _weight_targets: Callable[[], dict[str, WeightTarget]]

    def local_compact_weights(
        self, weights: Iterable[tuple[str, CompactWeight]], whole_blocks: bool = False
    ) -> Iterator[tuple[str, CompactWeight]]:
        """The checkpoint's stored `weights` as this rank holds them (its shard of each, as it
        comes), for `attach_compact_weights`; `whole_blocks`: refuse, rather than leave out, a
        weight whose shard cuts its blocks (weight_targets.py)."""
        if self.shards.tp.size == 1:
            return iter(weights)
        size = self.shards.tp.size
        return local_compact_weights(self._weight_targets(), weights, size, whole_blocks)

    def attach_compact_weights(
        self, weights: Iterable[tuple[str, CompactWeight]], native: NativeKernels
    ) -> set[str]:
        """Give float32 linear layers their stored compact weights (native/formats.py), to be
        multiplied by `native.gemv` in small batches; returns the names of the tensors they
        hold. A fused layer gets them only where all its parts came (else it keeps multiplying
        float32 weights at every batch size); a mixture of experts' layer its experts where all
        came (`hold_stored_experts`). With several ranks, `weights` are this rank's
        (`local_compact_weights`).
        """
        targets = self._weight_targets()
        # The kernel multiplies float32 rows: the layers of a float32 model (their weights in
        # float32 or in a GEMM dtype) and the float32 LM head of any.
        owners = {
            id(module.weight): module
            for module in self.modules()
            if isinstance(module, Linear)
            and (module.weight.dtype == torch.float32 or module.gemm_dtype is not None)
        }
        if self.config.tie_word_embeddings and self.pipeline.is_last:
            owners[id(self.embed_tokens)] = self.lm_head  # the head multiplies by the embedding
        parts: dict[Linear, dict[int, tuple[str, CompactWeight]]] = {}
        # A mixture of experts' experts go to their blocks (stored_experts.py), all at once:
        # this rank's (another rank's pass by, unread).
        moe = self.config.moe
        expert_names = {
            name
            for layer, decoder_layer in zip(self.layer_range, self.layers)
            if isinstance(decoder_layer.mlp, SparseMoE)
            for expert in range(decoder_layer.mlp.held[0], sum(decoder_layer.mlp.held))
            for name in moe.expert_weight_names(layer, expert)
        }
        experts: dict[str, CompactWeight] = {}
        for name, compact in weights:
            if name in expert_names:
                experts[name] = compact
                continue
            target = targets.get(name)
            owner = owners.get(id(target.param)) if target is not None else None
            shape = (compact.out_features, compact.in_features)
            if owner is None or shape != target.local_shape:
                continue
            parts.setdefault(owner, {})[target.rows.start or 0] = (name, compact)
        held: set[str] = set()
        for linear, by_first_row in parts.items():
            names, ordered = zip(*(by_first_row[row] for row in sorted(by_first_row)))
            if sum(part.out_features for part in ordered) != linear.out_features:
                continue
            combined = concat_rows(ordered)
            if combined is not None:
                linear.compact, linear.native = combined, native
                held.update(names)
        layers = zip(self.layer_range, self.layers)
        return held | hold_stored_experts(self.config, layers, experts, native)

    def tile_compact_weights(self, native: NativeKernels) -> int:
        """Give linear layers' compact weights their tile-ordered copy, which every batch of
        several rows multiplies on the bf16 hardware (AMX, or AVX512_BF16's dot products for
        bf16 weights: `native.bf16_tiles`); returns how many got one. Where the GEMMs round
        their rows to bf16 (`gemm_dtype`), bf16 weights get tiles, whose products round the
        rows the same way; else only block formats (AMX only), whose tiles keep float32
        precision.
        The tiled layers' GEMM weights are freed: no batch reaches their GEMMs."""
        tiled = 0
        tileable = ("bf16",) if self.gemm_dtype == torch.bfloat16 else BLOCK_FORMATS

        def tile(part: CompactWeight) -> CompactWeight:
            return native.with_tiles(part) if part.format in tileable else part

        for module in self.modules():
            compact = module.compact if isinstance(module, Linear) else None
            if compact is not None and compact.stored_formats() & set(tileable):
                module.compact = compact.map_parts(tile)
                tiled += 1
                # SmolLM2: 424 MB of float32 layers; the 0.5B shape: 716 MB of bf16 ones. A
                # tied head's weight is the embedding, which keeps its own reference.
                if module.compact.multiplies_any_rows and not module.stored_only:
                    module.drop_gemm_weight()
        return tiled

    def panel_compact_weights(self, native: NativeKernels) -> int:
        """Give linear layers' block-format compact weights (Q8_0, Q4_0, Q4_1) their copy in
        panels of 16 features, which batches of a few rows or more multiply where the CPU has
        AVX-512 (`native.avx512`); returns how many got one."""
        panelled = 0

        def panel(part: CompactWeight) -> CompactWeight:
            return native.with_panels(part) if part.format in BLOCK_FORMATS else part

        for module in self.modules():
            compact = module.compact if isinstance(module, Linear) else None
            if compact is not None and compact.stored_formats() & set(BLOCK_FORMATS):
                module.compact = compact.map_parts(panel)
                panelled += 1
        return panelled

    def limit_compact_rows(self, max_rows: int) -> None:
        """Let the decoder layers multiply their compact weights in batches of up to `max_rows`
        rows only (0: never); larger ones take their GEMMs. At most COMPACT_MAX_ROWS, the native
        step's capacity. The float32 LM head keeps reading its compact weights up to that
        capacity: its GEMM would read float32 weights, twice the bytes, on no faster hardware."""
        self.compact_max_rows = min(max_rows, COMPACT_MAX_ROWS)
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.compact_max_rows = self.compact_max_rows

    def drop_layer_compact_weights(self) -> None:
        """Free the decoder layers' compact weights, which batches of no size use any more."""
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.compact = None
