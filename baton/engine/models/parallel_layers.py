"""Tensor parallelism, Megatron-style: which part of each weight a rank holds (`ModelShards`,
`Shard`), and the layers whose outputs the ranks combine (baton/distributed/tensor_parallel.py).

q/k/v and gate/up are column-parallel (a rank holds its heads' and features' output rows, and
needs no collective), o and down row-parallel (the matching input columns: `RowParallelLinear`
sums the ranks' partial products), the embedding and the LM head vocabulary-parallel
(`VocabShard`). With fewer KV heads than ranks, each rank holds a copy of the one KV head its q
heads group over; a mixture of experts' ranks each hold a share of whole experts (moe.py).
A single process (size 1) holds every weight whole and uses none of this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.checkpoint.model_config import ModelConfig
from baton.config import ConfigurationError
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.models.layers import Linear
from baton.engine.native.formats import FORMATS, CompactWeight


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank holds: its `rows` (output features) or its
    `columns` (input features), None meaning all; a vocabulary's rows padded with zero rows to
    `padded_rows`, so every rank holds as many (the padding's logits are cut after the
    gather). `Shard()`: the whole tensor."""

    rows: slice | None = None
    columns: slice | None = None
    padded_rows: int | None = None

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's part of a tensor of `shape`."""
        rows = self.padded_rows or _length(self.rows, shape[0])
        if len(shape) == 1:
            return (rows,)
        return (rows, _length(self.columns, shape[1]))

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint's `tensor` (a view where nothing is padded)."""
        if self.rows is not None:
            tensor = tensor[self.rows]
        if self.columns is not None:
            tensor = tensor[:, self.columns]
        if self.padded_rows is not None and self.padded_rows > tensor.shape[0]:
            padding = tensor.new_zeros(self.padded_rows - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, padding])
        return tensor

    def take_compact(self, compact: CompactWeight) -> CompactWeight | None:
        """This rank's part of a stored weight, copied (the whole one is then freed); None where
        its columns do not start and end on the format's block boundaries. Padding rows are
        zero bytes, which every format reads as weights of 0 (a zero scale)."""
        if self.rows is None and self.columns is None and self.padded_rows is None:
            return compact
        data, in_features = compact.data, compact.in_features
        if self.rows is not None:
            data = data[self.rows]
        if self.columns is not None:
            layout = FORMATS[compact.format]
            first, end, _ = self.columns.indices(in_features)
            if first % layout.block or end % layout.block:
                return None
            per_block = layout.block_bytes
            data = data[:, first // layout.block * per_block : end // layout.block * per_block]
            in_features = end - first
        if self.padded_rows is not None and self.padded_rows > data.shape[0]:
            padding = data.new_zeros(self.padded_rows - data.shape[0], data.shape[1])
            data = torch.cat([data, padding])  # (a copy)
        else:
            data = data.clone(memory_format=torch.contiguous_format)
        return CompactWeight(compact.format, data, in_features)


WHOLE = Shard()


def _length(part: slice | None, size: int) -> int:
    return size if part is None else len(range(*part.indices(size)))


@dataclass(frozen=True)
class ModelShards:
    """Which heads, MLP features and vocabulary rows a rank holds, each (first, count), and the
    model's shape as the rank computes it (`local_config`: its heads and features)."""

    tp: TensorParallel
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    # Rows of the embedding and LM head from `first`: ceil(vocab / size), the last rank's
    # padded with zero rows where the ranks do not divide the vocabulary.
    vocab: tuple[int, int]
    local_config: ModelConfig

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> ModelShards:
        """The shards of `config`'s model on `tp`'s rank; ConfigurationError, in one line
        naming the model's number and the size, where the ranks cannot divide it."""
        try:
            if config.moe is not None:  # (each rank's share: SparseMoE.held)
                tp.share(config.moe.num_experts, "experts")
            q_heads = tp.share(config.num_heads, "attention heads")
            intermediate = tp.share(config.intermediate_size, "MLP intermediate features")
            if config.num_kv_heads >= tp.size:
                kv_heads = tp.share(config.num_kv_heads, "KV heads")
            elif tp.size % config.num_kv_heads:
                raise ValueError(
                    f"KV heads ({config.num_kv_heads}) are fewer than the ranks and do not "
                    f"divide --tensor-parallel-size {tp.size}"
                )
            else:
                # Each KV head is copied on size / num_kv_heads ranks: those whose q heads
                # group over it.
                kv_heads = (tp.rank // (tp.size // config.num_kv_heads), 1)
        except ValueError as error:
            raise ConfigurationError(f"{error}: choose another --tensor-parallel-size") from None
        rows = -(-config.vocab_size // tp.size)
        local = dataclasses.replace(
            config,
            num_heads=q_heads[1],
            num_kv_heads=kv_heads[1],
            intermediate_size=intermediate[1],
        )
        return cls(tp, q_heads, kv_heads, intermediate, (tp.rank * rows, rows), local)

    def head_rows(self, heads: tuple[int, int]) -> Shard:
        """The rows of a q, k or v projection (weight or bias) holding `heads`."""
        head_dim = self.local_config.head_dim
        first, count = heads
        return self._split(slice(first * head_dim, (first + count) * head_dim), None)

    def head_columns(self) -> Shard:
        """The o projection's input columns: this rank's q heads' outputs."""
        head_dim = self.local_config.head_dim
        first, count = self.q_heads
        return self._split(None, slice(first * head_dim, (first + count) * head_dim))

    def intermediate_rows(self) -> Shard:
        """The rows of the gate or the up projection (weight or bias)."""
        first, count = self.intermediate
        return self._split(slice(first, first + count), None)

    def intermediate_columns(self) -> Shard:
        """The down projection's input columns."""
        first, count = self.intermediate
        return self._split(None, slice(first, first + count))

    def vocab_rows(self) -> Shard:
        """The embedding's (and an untied LM head's) rows, padded to the ranks' equal share."""
        first, rows = self.vocab
        return self._split(slice(first, first + rows), None, rows)

    def _split(self, rows: slice | None, columns: slice | None, padded: int | None = None) -> Shard:
        return WHOLE if self.tp.size == 1 else Shard(rows, columns, padded)


def all_reduce_sum(tp: TensorParallel, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the ranks, in place. On a CPU, partial products in a narrower float
    are added in float32 and the sum rounded once (gloo would round after each addition)."""
    if tensor.dtype == torch.float32 or tensor.device.type != "cpu":
        return tp.all_reduce(tensor)
    return tensor.copy_(tp.all_reduce(tensor.float()))


class RowParallelLinear(Linear):
    """A linear layer holding the input columns of its rank's share (the o and down
    projections): each rank's product is a partial sum, which the ranks add; the bias, which
    every rank holds, is added once, after the sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        gemm_dtype: torch.dtype | None,
        tp: TensorParallel,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device, gemm_dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in_features of this rank] -> [tokens, out_features], the ranks' sum."""
        out = all_reduce_sum(self.tp, self.product(x, None))
        return out if self.bias is None else out.add_(self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`: the residual joins after the sum (added to every rank's partial
        product, the sum would count it once per rank)."""
        return residual.add_(self(x))

    def gemm_in_gemm_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' summed product in `gemm_dtype` (a bias-free layer's: GatedMLP's bf16
        prefill)."""
        return all_reduce_sum(self.tp, super().gemm_in_gemm_dtype(x))


def row_parallel_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    gemm_dtype: torch.dtype | None,
    tp: TensorParallel,
) -> Linear:
    """An o or down projection: a plain `Linear` in a single process."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias, dtype, device, gemm_dtype)
    return RowParallelLinear(in_features, out_features, bias, dtype, device, gemm_dtype, tp)


class VocabShard:
    """This rank's rows of the vocabulary, [first, first + rows): the embedding looks up the ids
    it holds and leaves zeros for the others, which the ranks' sum fills in; the LM head's
    logits for those rows are gathered into the whole vocabulary's."""

    def __init__(self, tp: TensorParallel, vocab_size: int, first: int, rows: int) -> None:
        self.tp, self.vocab_size, self.first, self.rows = tp, vocab_size, first, rows

    def embed(
        self, input_ids: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The embeddings of `input_ids` [tokens] -> [tokens, hidden], `lookup` taking this
        rank's row indices; IndexError for an id outside the vocabulary, as F.embedding."""
        ids = input_ids.to(torch.int64)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab_size:
            raise IndexError("index out of range in self")
        local = ids - self.first
        held = (local >= 0) & (local < self.rows)
        out = lookup(torch.where(held, local, 0))
        return all_reduce_sum(self.tp, out.masked_fill_(~held.unsqueeze(-1), 0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's [rows, this share] logits side by side, cut to the vocabulary: the same
        float32 [rows, vocab] on every rank."""
        logits = self.tp.all_gather_columns(local)
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()


class VocabParallelHead(Linear):
    """The LM head of a rank's vocabulary rows, whose logits every rank gathers whole."""

    def __init__(self, hidden_size: int, vocab: VocabShard, device: torch.device | str) -> None:
        # Float32 whatever the model's dtype, as CausalLM's head.
        super().__init__(hidden_size, vocab.rows, False, torch.float32, device)
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 logits [rows, vocab], the same on every rank."""
        return self.vocab.gather_logits(super().forward(x))
