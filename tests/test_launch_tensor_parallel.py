"""A server of two tensor-parallel ranks (gloo, one process and one core each): the same tokens
as one process, through the whole pipeline; a rank that dies or stalls stops the server."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port
from helpers.launcher import stop_by_a_faulty_rank
from helpers.pipeline import abort_beside_a_survivor, generate_all, generate_all_until_idle

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.launch import Server
from baton.structured_outputs import StructuredOutputsParams

STORY_PROMPTS = ["The little dog", "One day, a girl named Sue", "Lily and Tom went to the park"]
# Shares its first tokens with STORY_PROMPTS[1]: a prefix hit once that one ran.
SHARED_PREFIX = "One day, a girl named Sue went"


@pytest.fixture(scope="module")
def server(stories260k_dir: Path) -> Iterator[Server]:
    # Chunks of 8 tokens: every prompt's prefill takes several steps, mixed with decode rows.
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=400,
        chunk_size=8,
        tensor_parallel_size=2,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        yield running


@pytest.fixture(scope="module")
def offline(stories260k_dir: Path) -> LLM:
    return LLM(str(stories260k_dir), dtype="float32")


def test_two_ranks_give_one_processs_greedy_tokens(server: Server, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=120)
    prompts = [*STORY_PROMPTS, SHARED_PREFIX]
    expected = offline.generate(prompts, params)
    for result, reference in zip(generate_all(server, prompts, params), expected):
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == reference.finish_reason


def test_two_ranks_honour_structured_outputs(server: Server, offline: LLM) -> None:
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]+ (is|was) [a-z]+\."),
    )
    expected = offline.generate(STORY_PROMPTS, params)
    for result, reference in zip(generate_all(server, STORY_PROMPTS, params), expected):
        assert result.text == reference.text and result.finish_reason == "stop"


def test_an_abort_reaches_every_rank_and_the_pool_ends_idle(server: Server, offline: LLM) -> None:
    """An abort is one of the messages rank 0 broadcasts: had a rank missed it, its batches
    would differ from rank 0's and the next collective would never match."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected = offline.generate(STORY_PROMPTS[1], long)[0]

    survivor, stats = abort_beside_a_survivor(server, STORY_PROMPTS[0], STORY_PROMPTS[1], long)
    assert survivor.token_ids == expected.token_ids
    assert stats.used_pages == 0 and stats.running_requests == 0


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_rank_that_dies_or_stalls_stops_the_server(
    fault: str, stories260k_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of rank 1: the launcher exits 1 within seconds naming it; SIGSTOP of rank 1:
    rank 0's next collective times out after --distributed-timeout-seconds, and the server
    stops the same way. No process and no ipc directory is left behind."""
    flags = ("-tp", "2", "--distributed-timeout-seconds", "5", "--dtype", "float32")
    stopped_in, log = stop_by_a_faulty_rank(stories260k_dir, flags, fault, 5, tmp_path / "log")
    if fault == "killed":
        assert stopped_in < 3.0
        assert "launch ERROR scheduler-1 process was killed by SIGKILL; stopping the server" in log
    else:
        assert stopped_in < 5 + 15
        assert "launch ERROR scheduler process exited with status 1; stopping the server" in log


def test_two_ranks_preempt_and_speculate_as_one_process(
    stories260k_dir: Path, offline: LLM
) -> None:
    """A pool too small for every request at once (preemptions) and a draft model (the target
    as its own draft: every draft accepted, rows verify several tokens): each rank makes rank
    0's decisions from the same messages, so the tokens are still one process's, and the pool
    ends idle."""
    prompts = [f"{p} and" for p in STORY_PROMPTS * 3]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [r.token_ids for r in offline.generate(prompts, params)]
    draft = {"method": "draft_model", "model": str(stories260k_dir), "num_speculative_tokens": 2}
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=60,
        max_model_len=240,
        tensor_parallel_size=2,
        speculative_config=draft,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        results, stats = generate_all_until_idle(running, prompts, params)
    assert [r.token_ids for r in results] == expected
    assert stats.used_pages == 0 and stats.free_pages + stats.cached_pages == 60
    assert stats.preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0
