"""Decode steps replayed from CUDA graphs against the same engine run eagerly
(`--enforce-eager`): greedy token for token, with batches of every bucket and ragged lengths,
chunked prefill and prefix hits in the mix; the padding rows' page is kept from requests.
Skips without a CUDA GPU and FlashInfer (CI has neither); `scripts/gpu/run_cuda_checks.sh`
runs it on a GPU machine."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.attention.flashinfer_backend import flashinfer_available
from baton.engine.graphs.decode_graphs import DecodeGraphs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _greedy(model_dir: Path, prompts: list[list[int]], **config: object) -> tuple[list, LLM]:
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", chunk_size=64, **config)
    return [output.token_ids for output in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])  # head_dim 24, 16, 32
@pytest.mark.parametrize("num_prompts", [1, 3, 8, 13])
def test_graphs_decode_as_eager_steps_do(
    tiny_model_factory, monkeypatch: pytest.MonkeyPatch, variant: str, num_prompts: int
) -> None:
    if not flashinfer_available():
        pytest.skip("flashinfer is not importable here")
    model_dir = tiny_model_factory(variant)
    rng = random.Random(num_prompts)
    shared = [rng.randrange(256) for _ in range(40)]  # a prefix the later prompts hit
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 150))]]
    prompts += [
        (shared if index % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 150))]
        for index in range(num_prompts - 1)
    ]
    replays = []
    replay = DecodeGraphs.logits

    def counted(self: DecodeGraphs, input_ids, *args: object) -> torch.Tensor:
        replays.append(len(input_ids))
        return replay(self, input_ids, *args)

    monkeypatch.setattr(DecodeGraphs, "logits", counted)
    graphed, llm = _greedy(model_dir, prompts, cuda_graph_max_bs=16)
    try:
        graphs = llm.engine.decode_graphs
        assert graphs is not None and graphs.sizes == (1, 2, 4, 8, 16)
        # The pool's last page is the padding rows': the scheduler never hands it out.
        assert llm.engine.num_pages == llm.engine.kv_pool.num_pages - 1
    finally:
        del llm
        gc.collect()
    # Every decode step of the run replayed a graph (each prompt's tokens after its first).
    assert len(replays) >= GREEDY.max_tokens - 1
    eager, llm = _greedy(model_dir, prompts, enforce_eager=True)
    assert llm.engine.decode_graphs is None
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert graphed == eager
