"""A model that holds its matrices only as the checkpoint stores them: a GGUF's blocks for every
linear layer, the LM head and the embedding, no float32 copy of any (issue 45: a Llama-3.2-1B
Q4_K_M of 637 MiB took 9.9 GiB with float32 copies).

Small batches multiply the blocks with the compact kernels, larger ones (prefill chunks) a
float32 slab at a time (`NativeKernels.stored_product`), the embedding dequantizes the rows it
looks up. Every path widens each weight to the exact float32 value gguf's dequantization gives,
so the results are those of the float32 model on the dequantized weights, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from baton.engine.models.causal_lm import CausalLM
from baton.engine.models.layers import Linear
from baton.engine.native.formats import CompactWeight
from baton.engine.native.library import NativeKernels

EMBEDDING = "model.embed_tokens.weight"


def hold_stored_weights(
    model: CausalLM, weights: Mapping[str, CompactWeight], native: NativeKernels
) -> frozenset[str]:
    """Give the model's linear layers and embedding their stored weights; the names held, which
    `CausalLM.load_weights` then counts as loaded (and the caller does not read as float32).
    Call `free_float32_copies` after loading."""
    held = model.attach_compact_weights(weights.items(), native)
    embedding = weights.get(EMBEDDING)
    shape = (model.config.vocab_size, model.config.hidden_size)
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
