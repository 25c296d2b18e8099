"""Pipeline parallelism end to end: two stages, each rank a scheduler driving its stage's engine,
give a single process's tokens, logprobs and prompt logprobs (Llama; Qwen2's tied head from bf16
weights; Qwen3's q/k norms; a GGUF held as stored, a mixture of experts' too; Gemma 2's windowed
and global layers; an uneven split; a pool small enough to preempt), with prompts in chunks;
every rank's pool is whole again at the end; each stage holds only its layers, the first the
embedding, the last the norm and head (and a tied head's embedding). Three stages of an uneven
split (a middle stage receiving and sending), and two stages of two tensor-parallel ranks, give
the same too; the same four processes serve the three topologies in turn."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed_ranks import free_address, run_ranks

from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.config import BatonConfig
from baton.distributed.process_group import Ranks, join_ranks, leave
from baton.engine.engine import Engine
from baton.process_messages import TokenLogprob
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
# The longest prompt scored, its chunks in flight on both stages at once, and its outputs'
# logprobs: both come back from the last stage with the tokens.
SCORED = SamplingParams(
    temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2
)
REQUESTS = [(f"greedy{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)] + [
    ("sampled", PROMPTS[1], SAMPLED),
    ("scored", PROMPTS[0], SCORED),
]
# The cases two stages serve (`cases`).
NAMES = [
    "llama",
    "qwen2",
    "qwen3",
    "gguf_q8_0",
    "gguf_moe",
    "gemma2",
    "uneven",
    "kv_pressure",
    "decode_first",
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
        "kv_heads": engine.kv_pool.k_cache(0).shape[-2],
        "embedding_rows": model.embed_tokens.shape[0] + (stored.out_features if stored else 0),
        "head_rows": model.lm_head.out_features,
    }


def logprob_fields(logprob: TokenLogprob) -> tuple[float, list[int], int | None]:
    return logprob.logprob, [token for token, _ in logprob.top], logprob.rank


def serve(case: Case, ranks: Ranks) -> dict[str, Any]:
    """REQUESTS through this rank's scheduler: each request's tokens, the scored one's prompt
    and output logprobs (logprob, top ids, rank), the pool's pages free at the end and in all,
    preemptions, and the stage's shape."""
    scheduler = Scheduler(engine_config(case.model, ranks, **case.options), ranks=ranks)
    try:
        for rid, prompt, params in REQUESTS:
            scheduler.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in REQUESTS}
        scored: dict[str, list] = {"prompt": [], "outputs": []}
        steps = 0
        while scheduler.has_unfinished_requests():
            for output in scheduler.step():
                tokens[output.rid].extend(output.new_token_ids)
                if output.rid == "scored":
                    scored["prompt"] += map(logprob_fields, output.prompt_logprobs or [])
                    scored["outputs"] += map(logprob_fields, output.logprobs or [])
            steps += 1
            assert steps < 1000, "the requests never finished"
        return {
            "tokens": tokens,
            "scored": scored,
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
    moe_source = tiny_model_factory(
        "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[], moe_intermediate_size=64
    )
    moe = export_gguf(moe_source, "float32", tmp_path_factory.mktemp("moe") / "m.gguf", "Q8_0")
    load_checkpoint(str(moe))
    llama = str(tiny_model_factory("llama"))
    return [
        Case("llama", llama),
        Case("qwen2", str(tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)), tied=True),
        Case("qwen3", str(tiny_model_factory("qwen3")), tied=False),
        Case("gguf_q8_0", str(gguf)),
        # A mixture of experts held as stored: each stage holds its layers' experts.
        Case("gguf_moe", str(moe)),
        # A windowed layer, then a global one on the last stage (each stage windows its layers
        # by their place in the model), soft caps, scaled embeddings on the first stage.
        Case("gemma2", str(tiny_model_factory("gemma2")), tied=True),
        # Two layers on the first stage, one on the last.
        Case("uneven", str(tiny_model_factory("llama", num_hidden_layers=3)), num_layers=3),
        # 16 pages of 4 tokens for requests of 51, 19, 19 and 33 tokens: some are preempted,
        # their chunks maybe still in the pipeline.
        Case("kv_pressure", llama, options={"page_size": 4, "num_pages": 16, "max_model_len": 64}),
        # Decodes first, prefill chunks in the budget they leave: micro-batches of both.
        Case("decode_first", llama, options={"batch_order": "decode-first"}),
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


# The topologies the same processes serve one after the other (starting them is most of the
# time these tests take): (ranks, stages, cases) of two stages of two tensor-parallel ranks,
# three stages, then two stages.
TOPOLOGIES = [(4, 2, "two_by_two"), (3, 3, "three_stages"), (2, 2, "two_stages")]


def serve_topologies(
    cases: dict[str, list[Case]], ranks: Ranks
) -> dict[str, dict[str, dict[str, Any]]]:
    """This rank's results of each topology it takes part in: after each, rank 0 names where
    the next one's ranks meet (a port free now), every rank leaves, and those the next one
    has join it."""
    rank, results = ranks.rank, {}
    for index, (size, stages, name) in enumerate(TOPOLOGIES):
        if index:
            address = ranks.broadcast(free_address().encode() if ranks.is_first else None)
            leave(ranks)
            if rank >= size:
                break
            ranks = join_ranks(rank, size // stages, stages, address.decode(), 120.0, "cpu")
        assert (ranks.size, ranks.pp.size) == (size, stages)
        results[name] = serve_cases(cases[name], ranks)
    return results


@pytest.fixture(scope="module")
def served(cases: list[Case], five_layers: Case) -> dict[str, dict[int, dict[str, Any]]]:
    """Each topology's results, by rank."""
    llama = [case for case in cases if case.name == "llama"]
    by_topology = {"two_by_two": llama, "three_stages": [five_layers], "two_stages": cases}
    results = run_ranks(
        functools.partial(serve_topologies, by_topology), size=4, stages=2, timeout_s=240
    )
    for status, value in results.values():
        assert status == "ok", value
    return {
        name: {rank: value[name] for rank, (_, value) in results.items() if name in value}
        for _, _, name in TOPOLOGIES
    }


@pytest.fixture(scope="module")
def two_stages(served: dict[str, dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    return served["two_stages"]


@pytest.fixture(scope="module")
def three_stages(served: dict[str, dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    return served["three_stages"]


@pytest.fixture(scope="module")
def two_by_two(served: dict[str, dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Two stages of two tensor-parallel ranks, on Llama."""
    return served["two_by_two"]


@pytest.mark.parametrize("name", NAMES)
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
        assert_same_logprobs(results["scored"], alone["scored"])


def assert_same_logprobs(scored: dict[str, list], expected: dict[str, list]) -> None:
    """Every prompt token after the first scored, and every output token: the same top ids
    and ranks, the logprobs to float32 rounding (the batches differ)."""
    assert len(expected["prompt"]) == len(PROMPTS[0]) - 1
    assert len(expected["outputs"]) == NEW_TOKENS
    for part in ("prompt", "outputs"):
        assert [(top, rank) for _, top, rank in scored[part]] == [
            (top, rank) for _, top, rank in expected[part]
        ]
        values = [logprob for logprob, _, _ in scored[part]]
        assert values == pytest.approx([logprob for logprob, _, _ in expected[part]], abs=1e-4)


def test_a_pool_too_small_for_every_request_preempts_on_both_stages_alike(
    two_stages: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]]
) -> None:
    first, last = (two_stages[rank]["kv_pressure"] for rank in (0, 1))
    assert first["preemptions"] > 0 and first["preemptions"] == last["preemptions"]
    assert single["kv_pressure"]["preemptions"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_each_stage_holds_only_its_layers(
    two_stages: dict[int, dict[str, Any]],
    single: dict[str, dict[str, Any]],
    cases: list[Case],
    name: str,
) -> None:
    """The first stage: the embedding and the first layers, no LM head rows; the last: the
    remaining layers, the norm and the head, and no embedding unless the head is tied to it."""
    case = next(case for case in cases if case.name == name)
    first, last, alone = (
        results[name]["shape"] for results in (two_stages[0], two_stages[1], single)
    )
    # (The head of these models weighs about a third of a layer: two layers split one and
    # one, three two and one.)
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


def test_three_stages_of_an_uneven_split_give_one_process_tokens(
    three_stages: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]]
) -> None:
    alone = single["five_layers"]
    for rank, layers in zip(range(3), [(0, 2), (2, 4), (4, 5)]):
        results = three_stages[rank]["five_layers"]
        assert results["tokens"] == alone["tokens"]
        assert_same_logprobs(results["scored"], alone["scored"])
        assert results["shape"]["layers"] == layers
        assert results["shape"]["kv_layers"] == layers[1] - layers[0]
        assert results["free"] == results["pages"]
    first, middle, last = (three_stages[rank]["five_layers"]["shape"] for rank in range(3))
    vocab = alone["shape"]["head_rows"]
    assert first["embedding_rows"] == vocab and first["head_rows"] == 0
    assert middle["embedding_rows"] == 0 and middle["head_rows"] == 0  # layers only
    assert last["embedding_rows"] == 0 and last["head_rows"] == vocab


def test_two_stages_of_two_tensor_parallel_ranks_give_one_process_tokens(
    two_by_two: dict[int, dict[str, Any]], single: dict[str, dict[str, Any]]
) -> None:
    """Ranks 0-1 the first stage, 2-3 the last; each stage's ranks hold one KV head of two and
    their share of the vocabulary rows they hold."""
    alone = single["llama"]
    for rank in range(4):
        results = two_by_two[rank]["llama"]
        assert results["tokens"] == alone["tokens"]
        assert_same_logprobs(results["scored"], alone["scored"])
        assert results["free"] == results["pages"]
        assert results["shape"]["layers"] == ((0, 1) if rank < 2 else (1, 2))
    shapes = [two_by_two[rank]["llama"]["shape"] for rank in range(4)]
    assert [shape["head_rows"] == 0 for shape in shapes] == [True, True, False, False]
    assert [shape["embedding_rows"] == 0 for shape in shapes] == [False, False, True, True]
    vocab = alone["shape"]["head_rows"]
    assert 0 < shapes[2]["head_rows"] < vocab and 0 < shapes[0]["embedding_rows"] < vocab
    assert [shape["kv_heads"] for shape in shapes] == [1, 1, 1, 1]
    assert alone["shape"]["kv_heads"] == 2
