"""Pipeline stages: how the layers split, hidden states passed stage to stage bit for bit
(float32 and bfloat16), the last stage's outputs reaching every rank, and the ranks' layout with
tensor-parallel ranks in each stage (rank = stage x tensor-parallel size + tensor-parallel
rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.distributed_ranks import run_ranks

from baton.distributed.pipeline_parallel import PipelineParallel, stage_layers
from baton.distributed.process_group import Ranks

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
    ("num_layers", "size", "expected"),
    [
        (4, 2, [range(0, 2), range(2, 4)]),
        (5, 2, [range(0, 3), range(3, 5)]),
        (5, 3, [range(0, 2), range(2, 4), range(4, 5)]),
        (7, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]),
        (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
        (22, 1, [range(0, 22)]),
    ],
)
def test_stages_hold_contiguous_layers_the_first_ones_more(
    num_layers: int, size: int, expected: list[range]
) -> None:
    assert stage_layers(num_layers, size) == expected
    for stage, layers in enumerate(expected):
        assert PipelineParallel(stage=stage, size=size).layers(num_layers) == layers


@pytest.mark.parametrize("num_layers", range(1, 30))
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_every_layer_lies_in_exactly_one_stage(num_layers: int, size: int) -> None:
    if num_layers < size:
        pytest.skip("fewer layers than stages (refused, below)")
    ranges = stage_layers(num_layers, size)
    assert len(ranges) == size
    assert [layer for layers in ranges for layer in layers] == list(range(num_layers))
    counts = [len(layers) for layers in ranges]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # an uneven split's extra layers come first


def test_fewer_layers_than_stages_is_refused() -> None:
    with pytest.raises(ValueError) as refused:
        stage_layers(2, 3)
    assert str(refused.value) == "2 layers cannot make --pipeline-parallel-size 3 stages"
    with pytest.raises(ValueError):
        PipelineParallel(stage=3, size=4).layers(3)


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
    assert pp.layers(5) == range(0, 5)


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
