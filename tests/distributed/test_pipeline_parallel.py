"""Pipeline stages: how the layers split, hidden states passed stage to stage bit for bit
(float32 and bfloat16), the last stage's outputs reaching every rank, and the ranks' layout with
tensor-parallel ranks in each stage (rank = stage x tensor-parallel size + tensor-parallel
rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.distributed_ranks import run_ranks

from baton.checkpoint.model_config import ModelConfig
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.distributed.process_group import Ranks
from baton.distributed.stage_layers import stage_layers
from baton.engine.models.causal_lm import pipeline_stages

# Payloads the last stage shares: none, a short one, and one of 256 000 bytes.
PAYLOADS = [b"", b"\x00\xffmsgpack", bytes(range(256)) * 1000]
HIDDEN_SHAPE = (7, 48)
# Bit patterns a lossy path would change: signed zeros, infinities, a NaN, subnormals.
SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 3.0e38]


def hidden_states(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A micro-batch's hidden states as a stage would send them: random, plus special values."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(HIDDEN_SHAPE, generator=generator) * 100
    hidden[0, : len(SPECIALS)] = torch.tensor(SPECIALS)
    return hidden.to(dtype)


def bits(tensor: torch.Tensor) -> list[int]:
    """A tensor's elements as their bit patterns (NaN compares equal to itself here)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype]
    return tensor.view(view).flatten().tolist()


def exchange(ranks: Ranks) -> dict[str, Any]:
    """Each rank's place, then: each stage-0 rank sends two micro-batches' hidden states (float32,
    then bfloat16, waiting on each send before the next as a stage does) to its rank of stage 1,
    which reports their bit patterns; the output source shares every payload, which every rank
    reports; and the tensor-parallel sum within each stage."""
    pp, tp = ranks.pp, ranks.tp
    found: dict[str, Any] = {
        "place": (ranks.rank, ranks.size, pp.stage, pp.size, tp.rank, tp.size),
        "neighbours": (pp.previous_rank, pp.next_rank, pp.output_source),
        "first_last": (pp.is_first, pp.is_last, ranks.is_first),
    }
    # Seeded by the tensor-parallel rank: rank r of stage 1 expects what rank r of stage 0 sent.
    sent = [hidden_states(dtype, seed=tp.rank) for dtype in (torch.float32, torch.bfloat16)]
    if pp.is_first:
        for hidden in sent:
            work = pp.send_hidden(hidden)
            work.wait()
        found["hidden"] = [bits(hidden) for hidden in sent]
    else:
        received = [pp.receive_hidden(HIDDEN_SHAPE, h.dtype, torch.device("cpu")) for h in sent]
        found["hidden"] = [bits(hidden) for hidden in received]
        found["hidden_dtypes"] = [str(hidden.dtype) for hidden in received]
    source = ranks.rank == pp.output_source
    found["outputs"] = [pp.share_outputs(payload if source else None) for payload in PAYLOADS]
    found["stage_sum"] = tp.all_reduce(torch.full((2,), float(ranks.rank + 1))).tolist()
    return found


@pytest.fixture(scope="module")
def two_stages() -> dict[int, dict[str, Any]]:
    """Each rank's findings, with one rank per stage."""
    results = run_ranks(exchange, size=2, stages=2)
    for status, value in results.values():
        assert status == "ok", value
    return {rank: value for rank, (_, value) in results.items()}


@pytest.fixture(scope="module")
def two_by_two() -> dict[int, dict[str, Any]]:
    """Each rank's findings with two stages of two tensor-parallel ranks."""
    results = run_ranks(exchange, size=4, stages=2, timeout_s=90)
    for status, value in results.values():
        assert status == "ok", value
    return {rank: value for rank, (_, value) in results.items()}


@pytest.mark.parametrize(
    ("num_layers", "size", "head_layers", "expected"),
    [
        (4, 2, 0.0, [range(0, 2), range(2, 4)]),
        # Halves round up: the first stage takes the odd layer where the head weighs nothing.
        (5, 2, 0.0, [range(0, 3), range(3, 5)]),
        (5, 3, 0.0, [range(0, 2), range(2, 3), range(3, 5)]),
        (22, 1, 3.0, [range(0, 22)]),
        # A head as heavy as four layers: 10 layers, then 6 and the head.
        (16, 2, 4.0, [range(0, 10), range(10, 16)]),
        # A head heavier than every layer: the last stage still keeps one.
        (4, 2, 10.0, [range(0, 3), range(3, 4)]),
        (3, 3, 5.0, [range(0, 1), range(1, 2), range(2, 3)]),
    ],
)
def test_stages_hold_contiguous_runs_of_about_equal_work(
    num_layers: int, size: int, head_layers: float, expected: list[range]
) -> None:
    assert stage_layers(num_layers, size, head_layers) == expected


@pytest.mark.parametrize("head_layers", [0.0, 0.3, 1.0, 2.5, 4.3])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_every_layer_lies_in_exactly_one_stage(head_layers: float, size: int) -> None:
    """For every model depth: contiguous runs covering each layer once, a layer at least on
    each stage; where the head leaves room for that, no stage's work (the last's head
    included) is more than a layer off an equal share; a head never gives the last stage
    more layers."""
    for num_layers in range(size, 40):
        ranges = stage_layers(num_layers, size, head_layers)
        assert len(ranges) == size
        assert [layer for layers in ranges for layer in layers] == list(range(num_layers))
        counts = [len(layers) for layers in ranges]
        assert min(counts) >= 1, (num_layers, counts)
        if (size - 1) * head_layers <= num_layers - size:
            share = (num_layers + head_layers) / size
            work = [*counts[:-1], counts[-1] + head_layers]
            assert all(abs(each - share) <= 1 for each in work), (num_layers, counts)
        assert counts[-1] <= len(stage_layers(num_layers, size)[-1])


def test_without_a_head_the_stages_differ_by_a_layer_at_most() -> None:
    for size in range(1, 6):
        for num_layers in range(size, 40):
            counts = [len(layers) for layers in stage_layers(num_layers, size)]
            assert max(counts) - min(counts) <= 1, (num_layers, size, counts)


def test_a_models_head_weighs_as_the_layers_its_weights_make() -> None:
    """Llama 3.2 1B's shape: a head of 128256 x 2048 is about 4.3 of its layers, so two stages
    hold 10 layers, then 6 and the head; three hold 7, 7, and 2 and the head."""
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        torch_dtype="bfloat16",
        bos_token_id=None,
        eos_token_ids=(),
        layer_windows=(None,) * 16,
    )
    assert pipeline_stages(config, 1) == [range(0, 16)]
    assert pipeline_stages(config, 2) == [range(0, 10), range(10, 16)]
    assert pipeline_stages(config, 3) == [range(0, 7), range(7, 14), range(14, 16)]


def test_fewer_layers_than_stages_is_refused() -> None:
    with pytest.raises(ValueError) as refused:
        stage_layers(2, 3)
    assert str(refused.value) == "2 layers cannot make --pipeline-parallel-size 3 stages"
    with pytest.raises(ValueError, match="3 layers cannot make --pipeline-parallel-size 4"):
        stage_layers(3, 4, head_layers=1.0)


def test_a_stage_outside_its_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="stage 2 outside a pipeline of 2"):
        PipelineParallel(stage=2, size=2)
    with pytest.raises(ValueError, match="stage -1 outside a pipeline of 2"):
        PipelineParallel(stage=-1, size=2)


def test_one_process_is_a_single_stage_holding_every_layer() -> None:
    ranks = Ranks()
    assert (ranks.rank, ranks.size, ranks.is_first) == (0, 1, True)
    assert ranks.tp.size == 1 and ranks.tp.rank == 0
    pp = ranks.pp
    assert (pp.stage, pp.size, pp.is_first, pp.is_last) == (0, 1, True, True)
    assert (pp.previous_rank, pp.next_rank) == (None, None)


def test_two_stages_know_their_neighbours(two_stages: dict[int, dict[str, Any]]) -> None:
    first, last = two_stages[0], two_stages[1]
    assert first["place"] == (0, 2, 0, 2, 0, 1) and last["place"] == (1, 2, 1, 2, 0, 1)
    # (previous, next, output source): the last stage's rank shares the outputs.
    assert first["neighbours"] == (None, 1, 1) and last["neighbours"] == (0, None, 1)
    assert first["first_last"] == (True, False, True)
    assert last["first_last"] == (False, True, False)


def test_hidden_states_reach_the_next_stage_bit_for_bit(
    two_stages: dict[int, dict[str, Any]],
) -> None:
    sent, received = two_stages[0]["hidden"], two_stages[1]["hidden"]
    assert two_stages[1]["hidden_dtypes"] == ["torch.float32", "torch.bfloat16"]
    assert len(received[0]) == len(received[1]) == HIDDEN_SHAPE[0] * HIDDEN_SHAPE[1]
    assert received[0] == sent[0]  # float32
    assert received[1] == sent[1]  # bfloat16
    assert received[0] == bits(hidden_states(torch.float32, seed=0))  # not both garbled alike


def test_the_output_sources_bytes_reach_every_rank(two_stages: dict[int, dict[str, Any]]) -> None:
    assert two_stages[0]["outputs"] == PAYLOADS
    assert two_stages[1]["outputs"] == PAYLOADS


def test_two_stages_of_two_ranks_lay_out_stage_after_stage(
    two_by_two: dict[int, dict[str, Any]],
) -> None:
    """Ranks 0-1 are stage 0, 2-3 stage 1; each sends to its tensor-parallel rank of the next
    stage, the first rank of the last stage is the output source, and each stage's
    tensor-parallel sum adds its own ranks only."""
    places = {rank: found["place"] for rank, found in two_by_two.items()}
    assert places == {
        0: (0, 4, 0, 2, 0, 2),
        1: (1, 4, 0, 2, 1, 2),
        2: (2, 4, 1, 2, 0, 2),
        3: (3, 4, 1, 2, 1, 2),
    }
    neighbours = {rank: found["neighbours"] for rank, found in two_by_two.items()}
    assert neighbours == {0: (None, 2, 2), 1: (None, 3, 2), 2: (0, None, 2), 3: (1, None, 2)}
    assert two_by_two[2]["hidden"] == two_by_two[0]["hidden"]
    assert two_by_two[3]["hidden"] == two_by_two[1]["hidden"]
    assert two_by_two[2]["hidden"] != two_by_two[3]["hidden"]  # each its own rank's
    assert all(found["outputs"] == PAYLOADS for found in two_by_two.values())
    sums = {rank: found["stage_sum"] for rank, found in two_by_two.items()}
    assert sums == {0: [3.0, 3.0], 1: [3.0, 3.0], 2: [7.0, 7.0], 3: [7.0, 7.0]}
