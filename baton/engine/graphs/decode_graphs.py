"""Decode steps replayed from graphs recorded at start-up, one per batch-size bucket.

Each bucket's step is the model's forward over the persistent inputs (decode_inputs.py) up to
its logits, recorded once; a batch then costs a fill of the inputs, the attention's plan (on
the host, outside the graph, as FlashInfer requires) and one replay, instead of a Python call
per op. Recording is the caller's: on CUDA a `torch.cuda.CUDAGraph` (`cuda_graph_recorder`);
any other recorder that returns a function re-running the step reads the same buffers, so the
whole discipline (fixed inputs, padding, per-bucket attention) is tested on a CPU too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.metadata import AttentionMetadata
from baton.engine.graphs.buckets import bucket_for
from baton.engine.graphs.decode_inputs import DecodeInputs
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM

# Records a step (a function of no arguments) and returns what replays it.
Recorder = Callable[[Callable[[], None]], Callable[[], None]]


def cuda_graph_recorder(device: torch.device) -> Recorder:
    """Records steps as CUDA graphs sharing one memory pool (the largest bucket recorded first
    sizes it for all), each warmed up once on a side stream as PyTorch requires."""
    pool = torch.cuda.graph_pool_handle()

    def record(step: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()  # the warm-up: lazy initialisation must not happen during capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        return graph.replay

    return record


class DecodeGraphs:
    """The decode steps of every size in `sizes`, recorded with `record`, each over its own
    attention backend (`attention_for(size)`: on CUDA, FlashInfer's decode wrapper over that
    size's fixed index buffers)."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        inputs: DecodeInputs,
        sizes: Sequence[int],
        attention_for: Callable[[int], AttentionBackend],
        record: Recorder,
    ) -> None:
        self.sizes = tuple(sorted(sizes))
        if self.sizes[-1] > inputs.max_rows:
            raise ValueError(f"graphs of {self.sizes[-1]} rows, inputs of {inputs.max_rows}")
        self._model, self._kv_pool = model, kv_pool
        self._inputs = inputs
        self._attention = {size: attention_for(size) for size in self.sizes}
        self._logits: dict[int, torch.Tensor] = {}
        self._meta: AttentionMetadata  # the batch being run, set by each fill
        self._replays: dict[int, Callable[[], None]] = {}
        # Largest first: its graph's memory pool then serves the smaller ones.
        for size in reversed(self.sizes):
            self._fill_padding(size)
            self._replays[size] = record(self._step_of(size))

    def handles(self, rows: int) -> bool:
        """Whether a decode batch of `rows` rows has a recorded size."""
        return bucket_for(rows, self.sizes) is not None

    def logits(
        self,
        input_ids: Sequence[int],
        kv_starts: Sequence[int],
        page_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Float32 logits [rows, vocab] of a decode batch, its K/V written to the pool: the
        inputs filled, the bucket's attention planned, its graph replayed. A view of the
        graph's output, valid until the next step."""
        rows = len(input_ids)
        bucket = bucket_for(rows, self.sizes)
        if bucket is None:
            raise ValueError(f"no decode graph holds {rows} rows (at most {self.sizes[-1]})")
        self._meta = self._inputs.fill(input_ids, kv_starts, page_tables, bucket)
        self._attention[bucket].plan(self._meta)
        self._replays[bucket]()
        return self._logits[bucket][:rows]

    def _fill_padding(self, size: int) -> None:
        """Inputs of `size` padding rows (the dummy page only) to record with, planned."""
        self._meta = self._inputs.fill([], [], [], size)
        self._attention[size].plan(self._meta)

    def _step_of(self, size: int) -> Callable[[], None]:
        indices = torch.arange(size, device=self._inputs.device)
        attention = self._attention[size]

        def step() -> None:
            # Reads the current batch's metadata: a CUDA graph replays the kernels recorded
            # over the same buffers (this runs only while recording), a re-run reads it anew.
            meta, input_ids = self._meta, self._inputs.input_ids[:size]
            self._logits[size] = self._model(
                input_ids, meta.positions, self._kv_pool, attention, meta, indices
            )

        return step
