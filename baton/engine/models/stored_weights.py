"""A model that holds its matrices only as the checkpoint stores them: a GGUF's blocks for every
linear layer, every expert, the LM head and the embedding, no float32 copy of any (issue 45: a
Llama-3.2-1B Q4_K_M of 637 MiB took 9.9 GiB with float32 copies).

Small batches multiply the blocks with the compact kernels, larger ones (prefill chunks) a
float32 slab at a time (`NativeKernels.stored_product`), the embedding dequantizes the rows it
looks up. Every path widens each weight to the exact float32 value gguf's dequantization gives,
so the results are those of the float32 model on the dequantized weights, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from baton.checkpoint.load import Checkpoint
from baton.checkpoint.model_config import CheckpointError
from baton.engine.models.causal_lm import CausalLM
from baton.engine.models.layers import Linear
from baton.engine.native.formats import FORMATS, CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.weights.checkpoint_tensors import iter_compact_weights, iter_weights
from baton.engine.weights.gguf_weights import forget_gguf_tensors, unsupported_gguf_matrices

EMBEDDING = "model.embed_tokens.weight"


def load_as_stored(model: CausalLM, checkpoint: Checkpoint, native: NativeKernels) -> int:
    """Load a GGUF as it is stored: every matrix in its blocks, no float32 copy (with several
    tensor-parallel ranks, this rank's shard of each); returns how many linear layers hold only
    their stored weights. CheckpointError for a matrix in a type no kernel multiplies."""
    gguf_file = checkpoint.gguf_file
    unsupported = unsupported_gguf_matrices(gguf_file)
    if unsupported:
        types = sorted({kind for _, kind in unsupported})
        raise CheckpointError(
            f"{gguf_file.name}: {len(unsupported)} matrices (first {unsupported[0][0]}) are "
            f"stored as {', '.join(types)}, which Baton cannot multiply as stored; it reads "
            f"F32 and {', '.join(name.upper() for name in FORMATS)}"
        )
    held = hold_stored_weights(model, iter_compact_weights(checkpoint), native)
    model.load_weights(iter_weights(checkpoint, native, skip=held), held=held)
    layers = free_float32_copies(model)
    forget_gguf_tensors()
    return layers


def hold_stored_weights(
    model: CausalLM, weights: Iterable[tuple[str, CompactWeight]], native: NativeKernels
) -> frozenset[str]:
    """Give the model's linear layers and embedding their stored weights (this rank's shard of
    each); the names held, which `CausalLM.load_weights` then counts as loaded (and the caller
    does not read as float32). Call `free_float32_copies` after loading."""
    # Sharded as they come: every weight is the only copy, so one whose shard would cut its
    # blocks is refused (CausalLM.local_compact_weights).
    stored = dict(model.local_compact_weights(weights, whole_blocks=True))
    held = model.attach_compact_weights(stored.items(), native)
    embedding = stored.get(EMBEDDING)
    shape = tuple(model.embed_tokens.shape)  # this rank's rows of the vocabulary
    if embedding is not None and (embedding.out_features, embedding.in_features) == shape:
        model.embedding_stored, model.embedding_native = embedding, native
        held.add(EMBEDDING)
    return frozenset(held)


def free_float32_copies(model: CausalLM) -> int:
    """Free the float32 parameters the stored weights replace (never written: allocated
    untouched, they were never resident); returns how many linear layers hold only their
    stored weights."""
    held = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.compact is not None:
            module.hold_stored_only()
            held += 1
    if model.embedding_stored is not None:
        model.embed_tokens = nn.Parameter(torch.empty(0), requires_grad=False)
    return held
