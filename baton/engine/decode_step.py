"""The native decode step: a decode batch of a few rows runs the whole model in one C call.

What a captured CUDA graph is to a GPU engine, this is to the CPU one: eager PyTorch spends
5-20 us dispatching each of a layer's ~25 small ops, which at one row costs more than the
layer's arithmetic (SmolLM2, 30 layers: ~7 ms of a 20 ms step). `decode_layer.c` chains the very
kernels the model calls one by one (compact GEMV, RMSNorm, RoPE + K/V store, paged attention),
so both paths compute the same things in the same order, from the embedding to the LM head and,
for greedy rows, the argmax. It serves decode-only batches of up to NATIVE_STEP_MAX_ROWS rows of
a float32 CPU model whose linear layers all read compact weights; everything else runs the
model's forward. `--enforce-eager` turns it off (vLLM's flag for "no CUDA graphs").

Nothing on this path creates a torch tensor: in a server each torch op gives up the GIL and
waits to retake it while the scheduler thread runs Python, and the ~40 small ops a step used to
run around the C call (the batch's index tensors, embedding, sampling) cost SmolLM2 about 3 ms
a token that way (docs/benchmarks.md, "The native decode step and compact weights", 0b4f491).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from baton.checkpoint.model_config import ModelConfig
from baton.engine.attention.metadata import page_lists
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM
from baton.engine.models.gemma import GemmaDecoderLayer
from baton.engine.models.layers import Linear
from baton.engine.models.mlp import GatedMLP
from baton.engine.models.moe import SparseMoE
from baton.engine.native.attention_kernels import kv_element_type
from baton.engine.native.formats import COMPACT_MAX_ROWS
from baton.engine.native.library import NativeKernels
from baton.engine.native.structs import (
    DecodeModelArgs,
    DecoderLayerArgs,
    DecodeStepArgs,
    Matrix,
    RowSampling,
)

# The most rows a native step holds: as many as the linear layers multiply by their compact
# weights (beyond, GEMMs, compute-bound, overtake the compact GEMV). A model whose compact rows
# are limited further (CausalLM.limit_compact_rows) limits its native steps with them.
NATIVE_STEP_MAX_ROWS = COMPACT_MAX_ROWS


class NativeDecodeStep:
    """Runs `CausalLM.forward` for small decode-only batches through `decode_layer.c`."""

    def __init__(self, model: CausalLM, kv_pool: KVPool, native: NativeKernels) -> None:
        self.model = model
        self.native = native
        config = model.config
        # The Matrix structs the C step reads, kept here: a fused weight's parts live in an
        # array its Matrix owns, which copying the struct into another does not keep alive.
        self._matrices: list[Matrix] = []
        self._layers = (DecoderLayerArgs * len(model.layers))(
            *(self._layer_args(layer, kv_pool) for layer in model.layers)
        )
        # One scratch buffer for every layer's intermediates (decode_layer.c's DecodeStep).
        moe = config.moe
        per_row = (
            2 * config.hidden_size
            + config.q_size
            + 2 * config.kv_size
            + config.q_size
            # (the MLP's, or a shared expert's: Qwen2-57B-A14B's is the wider)
            + 3 * max(config.intermediate_size, moe.shared_intermediate_size if moe else 0)
        )
        self._scratch = torch.empty(NATIVE_STEP_MAX_ROWS * per_row)
        # The residual stream and its final norm, then the logits; the C step owns their
        # contents from one call to the next.
        self._hidden = torch.empty(2, NATIVE_STEP_MAX_ROWS, config.hidden_size)
        self._logits = torch.empty(NATIVE_STEP_MAX_ROWS, config.vocab_size)
        stored = model.embedding_stored
        self._model_args = DecodeModelArgs(
            None if stored is not None else model.embed_tokens.data_ptr(),
            native.matrix(stored, None) if stored is not None else Matrix(),
            model.norm.weight.data_ptr(),
            self._matrix(model.lm_head),
            self._hidden[0].data_ptr(),
            self._hidden[1].data_ptr(),
            self._logits.data_ptr(),
            model.norm.eps,
            *_gemma_model_factors(config),
        )
        self._batch_rows = (ctypes.c_int32 * NATIVE_STEP_MAX_ROWS)(*range(NATIVE_STEP_MAX_ROWS))
        self._cos_table = model.rotary.cos.data_ptr()
        self._sin_table = model.rotary.sin.data_ptr()
        self.page_size = kv_pool.page_size

    @staticmethod
    def supports(model: CausalLM) -> bool:
        """Every linear layer reads compact weights, every attention runs natively and every
        MLP is a dense gated one (Gemma's GeGLU too) or routed experts held as stored
        (Qwen2-MoE's shared expert and its gate too)."""
        linears = [module for module in model.modules() if isinstance(module, Linear)]
        return all(linear.compact is not None for linear in linears) and all(
            layer.self_attn.native is not None
            and (
                isinstance(layer.mlp, GatedMLP)
                or (
                    isinstance(layer.mlp, SparseMoE)
                    and layer.mlp.stored is not None
                    and layer.mlp.router.dtype == torch.float32
                    and (
                        layer.mlp.shared_expert_gate is None
                        or layer.mlp.shared_expert_gate.dtype == torch.float32
                    )
                )
            )
            for layer in model.layers
        )

    def handles(self, q_lens: list[int]) -> bool:
        """Whether a batch with these rows runs here: decode rows only (one new token each), as
        many as the model's linear layers multiply by their compact weights."""
        return len(q_lens) <= self.model.compact_max_rows and all(n == 1 for n in q_lens)

    def _matrix(self, linear: Linear) -> Matrix:
        matrix = self.native.matrix(linear.compact, linear.bias)
        self._matrices.append(matrix)
        return matrix

    def _layer_args(self, layer, kv_pool: KVPool) -> DecoderLayerArgs:
        attn, mlp = layer.self_attn, layer.mlp
        sparse = isinstance(mlp, SparseMoE)
        shared = mlp.shared_expert if sparse else None
        dense = mlp if not sparse else shared  # (a shared expert's matrices take the MLP's place)
        args = DecoderLayerArgs(
            self._matrix(attn.qkv_proj),
            self._matrix(attn.o_proj),
            Matrix() if dense is None else self._matrix(dense.gate_up_proj),
            Matrix() if dense is None else self._matrix(dense.down_proj),
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            None if attn.qk_norm is None else attn.qk_norm.data_ptr(),
            kv_pool.k_cache(attn.layer).data_ptr(),
            kv_pool.v_cache(attn.layer).data_ptr(),
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            kv_pool.page_size,
            kv_element_type(kv_pool.k_cache(attn.layer)),
            attn.window or 0,
            attn.eps,
            attn.scale,
        )
        if isinstance(layer, GemmaDecoderLayer):
            # Gemma's post_attention_layernorm normalises attention's output; the MLP's input
            # is its pre_feedforward_layernorm's (the step's post_norm).
            args.post_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
            args.attn_out_norm = layer.post_attention_layernorm.weight.data_ptr()
            args.mlp_out_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            args.gelu = 1
            args.softcap = attn.softcap or 0.0
            local = self.model.local_rotary
            if local is not None and attn.window is not None:  # (Gemma 3's local layers)
                args.cos_table, args.sin_table = local.cos.data_ptr(), local.sin.data_ptr()
        if sparse:  # (the experts' arrays are the block's, which the model keeps alive)
            experts = mlp.stored
            args.router = mlp.router.data_ptr()
            args.experts_gate = ctypes.addressof(experts.gate)
            args.experts_up = ctypes.addressof(experts.up)
            args.experts_down = ctypes.addressof(experts.down)
            args.num_experts, args.top_k = experts.num_experts, mlp.moe.top_k
            args.normalize_top_k = int(mlp.moe.normalize_top_k)
            if shared is not None:
                args.shared_gate = mlp.shared_expert_gate.data_ptr()
        return args

    def __call__(
        self,
        input_ids: list[int],
        kv_starts: list[int],
        page_tables: list[list[int]],
        choose: bool,
        sampling: Sequence[RowSampling] | None = None,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """Decode one token per row: row i's `input_ids[i]` at position `kv_starts[i]`, its K/V
        into the pages of `page_tables[i]`. Returns the float32 logits [rows, vocab] (a view of
        a buffer the next step overwrites) and, when `choose`, each row's token: sampled as
        `sampling` says (one per batch row; -1 where its logits are no distribution), else its
        argmax."""
        rows = len(input_ids)
        pages = page_lists(kv_starts, [1] * rows, page_tables, self.page_size)
        # Plain ctypes arrays: building torch tensors would release and retake the GIL for
        # each, and every retake waits while the scheduler thread runs Python.
        ids = (ctypes.c_int64 * rows)(*input_ids)
        positions = (ctypes.c_int64 * rows)(*pages.positions)
        slots = (ctypes.c_int64 * rows)(*pages.slot_mapping)
        indptr = (ctypes.c_int32 * (rows + 1))(*pages.kv_indptr)
        indices = (ctypes.c_int32 * len(pages.kv_indices))(*pages.kv_indices)
        kv_lens = (ctypes.c_int32 * rows)(*pages.kv_lens)
        tokens = (ctypes.c_int64 * rows)() if choose else None
        if sampling is not None and len(sampling) != rows:
            raise ValueError(f"{len(sampling)} sampling settings for {rows} rows")
        settings = None if sampling is None else (RowSampling * rows)(*sampling)
        step = DecodeStepArgs(
            rows,
            ctypes.addressof(ids),
            None if tokens is None else ctypes.addressof(tokens),
            None if settings is None else ctypes.addressof(settings),
            ctypes.addressof(positions),
            ctypes.addressof(slots),
            ctypes.addressof(self._batch_rows),
            ctypes.addressof(indptr),
            ctypes.addressof(indices),
            ctypes.addressof(kv_lens),
            self._cos_table,
            self._sin_table,
            self._scratch.data_ptr(),
        )
        status = self.native.decode_step(
            self._layers, len(self._layers), ctypes.byref(self._model_args), ctypes.byref(step)
        )
        if status == -1:
            raise ValueError(f"an input id of {input_ids} is outside the vocabulary")
        if status != 0:
            raise MemoryError("the native decode step ran out of memory")
        return self._logits[:rows], None if tokens is None else list(tokens)


def _gemma_model_factors(config: ModelConfig) -> tuple[float, float]:
    """(the embeddings' factor, the final logits' soft cap or 0): Gemma's sqrt(hidden_size) as
    float32 rounds it (gemma.scale_embeddings) and Gemma 2's cap; 1 and 0 elsewhere."""
    if config.gemma is None:
        return 1.0, 0.0
    return float(config.hidden_size**0.5), config.gemma.final_logit_softcapping or 0.0
