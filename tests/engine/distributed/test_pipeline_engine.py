"""Pipeline parallelism end to end: two stages, each rank a scheduler driving its stage's engine,
give a single process's tokens (Llama; Qwen2's tied head from bf16 weights; Qwen3's q/k norms;
a GGUF held as stored; an uneven split; a pool small enough to preempt), with prompts in
chunks; every rank's pool is whole again at the end; each stage holds only its layers, the
first the embedding, the last the norm and head (and a tied head's embedding). Three stages of
an uneven split, and two stages of two tensor-parallel ranks, give the same tokens too."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed_ranks import run_ranks

from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.config import BatonConfig
from baton.distributed.process_group import Ranks
from baton.engine.engine import Engine
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.scheduler import Scheduler

# Prefill chunks of this many tokens: the longest prompt takes three, so its chunks fill both
# stages, and decode rows and prefill chunks share micro-batches.
CHUNK = 16
NEW_TOKENS = 10
PROMPTS = [
    [(7 * j + 3) % 250 for j in range(41)],
    [(5 * j + 1) % 250 for j in range(9)],
    [(11 * j + 2) % 250 for j in range(23)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# A sampled request with its own seed: its generator advances on the last stage alone.
SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
REQUESTS = [(f"greedy{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)] + [
    ("sampled", PROMPTS[1], SAMPLED)
]
PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@dataclass(frozen=True)
class Case:
    """One model the stages serve, with `options` for its config."""

    name: str
    model: str
    num_layers: int = 2
    tied: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def engine_config(model: str, ranks: Ranks, **options: Any) -> BatonConfig:
    """A float32 engine on one thread, as many stages and tensor-parallel ranks as `ranks`; the
    AVX2 plan on every CPU, so that no bf16 GEMM rounds a row differently in another batch."""
    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_cpu_isa": "avx2",
        "num_threads": 1,
        "omp_threads_bind": "nobind",
        "num_pages": 32,
        "max_model_len": 256,
        "max_running_requests": 8,
        "chunk_size": CHUNK,
        "pipeline_parallel_size": ranks.pp.size,
        "tensor_parallel_size": ranks.tp.size,
    }
    return BatonConfig(model=model, **{**settings, **options})


def stage_shape(engine: Engine) -> dict[str, Any]:
    """What this rank's engine holds: its layers, KV pool layers, embedding and head rows."""
    model = engine.model
    stored = model.embedding_stored
    return {
        "layers": (model.layer_range.start, model.layer_range.stop),
        "num_layers": len(model.layers),
        "kv_layers": engine.kv_pool.num_layers,
        "embedding_rows": model.embed_tokens.shape[0] + (stored.out_features if stored else 0),
        "head_rows": model.lm_head.out_features,
        "head_is_embedding": model.lm_head.weight is model.embed_tokens,
    }


def serve(case: Case, ranks: Ranks) -> dict[str, Any]:
    """REQUESTS through this rank's scheduler: each request's tokens, the pool's pages free at
    the end and in all, preemptions, and the stage's shape."""
    scheduler = Scheduler(engine_config(case.model, ranks, **case.options), ranks=ranks)
    try:
        for rid, prompt, params in REQUESTS:
            scheduler.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in REQUESTS}
        steps = 0
        while scheduler.has_unfinished_requests():
            for output in scheduler.step():
                tokens[output.rid].extend(output.new_token_ids)
            steps += 1
            assert steps < 1000, "the requests never finished"
        return {
            "tokens": tokens,
            "free": scheduler.kv.available_pages,
            "pages": scheduler.kv.num_pages,
            "preemptions": scheduler.stats.preemptions,
            "shape": stage_shape(scheduler.engine),
        }
    finally:
        scheduler.shutdown()


def serve_cases(cases: list[Case], ranks: Ranks) -> dict[str, dict[str, Any]]:
    """Every case on this rank, on one thread (so that the ranks share two cores)."""
    torch.set_num_threads(1)
    return {case.name: serve(case, ranks) for case in cases}


@pytest.fixture(scope="module")
def cases(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    gguf_source = tiny_model_factory(
        "llama", vocab_size=301, head_dim=32, intermediate_size=192, **PLAIN_ROPE
    )
    gguf = export_gguf(gguf_source, "float32", tmp_path_factory.mktemp("gguf") / "t.gguf", "Q8_0")
    load_checkpoint(str(gguf))  # its metadata converted once, not by both ranks at once
    llama = str(tiny_model_factory("llama"))
    return [
        Case("llama", llama),
        Case("qwen2", str(tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)), tied=True),
        Case("qwen3", str(tiny_model_factory("qwen3")), tied=False),
        Case("gguf_q8_0", str(gguf)),
        # Two layers on the first stage, one on the last.
        Case("uneven", str(tiny_model_factory("llama", num_hidden_layers=3)), num_layers=3),
        # 16 pages of 4 tokens for requests of 51, 19, 19 and 33 tokens: some are preempted,
        # their chunks maybe still in the pipeline.
        Case("kv_pressure", llama, options={"page_size": 4, "num_pages": 16}),
    ]


@pytest.fixture(scope="module")
def five_layers(tiny_model_factory: Callable[..., Path]) -> Case:
    """Three stages of two, two and one layers."""
    return Case("five_layers", str(tiny_model_factory("qwen3", num_hidden_layers=5)), 5)


@pytest.fixture(scope="module")
def single(cases: list[Case], five_layers: Case) -> dict[str, dict[str, Any]]:
    """A single process's results of every case."""
    threads = torch.get_num_threads()
    try:
        return serve_cases([*cases, five_layers], Ranks())
    finally:
        torch.set_num_threads(threads)  # (the engines set this process's threads to one)


def ranks_results(cases: list[Case], size: int, stages: int) -> dict[int, dict[str, Any]]:
    """Each rank's results of `cases` with `size` ranks in `stages` stages."""
    results = run_ranks(
        functools.partial(serve_cases, cases), size=size, stages=stages, timeout_s=180
    )
    for status, value in results.values():
        assert status == "ok", value
    return {rank: value for rank, (_, value) in results.items()}


@pytest.fixture(scope="module")
def two_stages(cases: list[Case]) -> dict[int, dict[str, Any]]:
    return ranks_results(cases, size=2, stages=2)


@pytest.fixture(scope="module")
def three_stages(five_layers: Case) -> dict[int, dict[str, Any]]:
    return ranks_results([five_layers], size=3, stages=3)


@pytest.fixture(scope="module")
def two_by_two(cases: list[Case]) -> dict[int, dict[str, Any]]:
    """Two stages of two tensor-parallel ranks, on Llama."""
    return ranks_results([case for case in cases if case.name == "llama"], size=4, stages=2)


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "qwen3", "gguf_q8_0", "uneven", "kv_pressure"]
)
def test_two_stages_give_one_process_tokens(
    two_stages: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]], name: str
) -> None:
    first, last, alone = two_stages[0][name], two_stages[1][name], single[name]
    assert first["tokens"] == last["tokens"] == alone["tokens"]
    assert all(len(tokens) == NEW_TOKENS for tokens in alone["tokens"].values())
    greedy = [tuple(alone["tokens"][f"greedy{i}"]) for i in range(len(PROMPTS))]
    assert len(set(greedy)) == len(PROMPTS)  # not degenerate
    for results in (first, last):
        assert results["free"] == results["pages"] == alone["pages"]  # the pool whole again


def test_a_pool_too_small_for_every_request_preempts_on_both_stages_alike(
    two_stages: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]]
) -> None:
    first, last = (two_stages[rank]["kv_pressure"] for rank in (0, 1))
    assert first["preemptions"] > 0 and first["preemptions"] == last["preemptions"]
    assert single["kv_pressure"]["preemptions"] > 0


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "qwen3", "gguf_q8_0", "uneven", "kv_pressure"]
)
def test_each_stage_holds_only_its_layers(
    two_stages: dict[int, dict[str, Any]],
    single: dict[str, dict[str, Any]],
    cases: list[Case],
    name: str,
) -> None:
    """The first stage: the embedding and the first layers, no LM head rows; the last: the
    remaining layers, the norm and the head, and no embedding unless the head is tied to it."""
    case = next(case for case in cases if case.name == name)
    first, last, alone = (results[name]["shape"] for results in (two_stages[0], two_stages[1], single))
    split = (case.num_layers + 1) // 2
    assert first["layers"] == (0, split) and last["layers"] == (split, case.num_layers)
    assert first["num_layers"] == first["kv_layers"] == split
    assert last["num_layers"] == last["kv_layers"] == case.num_layers - split
    assert alone["num_layers"] == alone["kv_layers"] == case.num_layers
    vocab = alone["head_rows"]
    assert vocab > 0 and alone["embedding_rows"] == vocab
    assert first["embedding_rows"] == vocab and first["head_rows"] == 0
    assert last["head_rows"] == vocab
    assert last["embedding_rows"] == (vocab if case.tied else 0)
    assert last["head_is_embedding"] == case.tied  # (a float32 model's tied head)


def test_three_stages_of_an_uneven_split_give_one_process_tokens(
    three_stages: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]]
) -> None:
    alone = single["five_layers"]
    for rank, layers in zip(range(3), [(0, 2), (2, 4), (4, 5)]):
        results = three_stages[rank]["five_layers"]
        assert results["tokens"] == alone["tokens"]
        assert results["shape"]["layers"] == layers
        assert results["shape"]["kv_layers"] == layers[1] - layers[0]
        assert results["free"] == results["pages"]
    middle = three_stages[1]["five_layers"]["shape"]
    assert middle["embedding_rows"] == 0 and middle["head_rows"] == 0  # layers only


def test_two_stages_of_two_tensor_parallel_ranks_give_one_process_tokens(
    two_by_two: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]]
) -> None:
    """Ranks 0-1 the first stage, 2-3 the last; each stage's ranks hold one KV head of two and
    their share of the vocabulary rows they hold."""
    alone = single["llama"]
    for rank in range(4):
        results = two_by_two[rank]["llama"]
        assert results["tokens"] == alone["tokens"]
        assert results["free"] == results["pages"]
        assert results["shape"]["layers"] == ((0, 1) if rank < 2 else (1, 2))
    shapes = [two_by_two[rank]["llama"]["shape"] for rank in range(4)]
    assert [shape["head_rows"] == 0 for shape in shapes] == [True, True, False, False]
    assert [shape["embedding_rows"] == 0 for shape in shapes] == [False, False, True, True]
    vocab = alone["shape"]["head_rows"]
    assert 0 < shapes[2]["head_rows"] < vocab and 0 < shapes[0]["embedding_rows"] < vocab
