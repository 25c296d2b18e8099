"""A server of two data-parallel replicas behind one router: one process's tokens, the stats of
both in one reply, and a replica that dies stops the server."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port
from helpers.launcher import start_launcher, wait_dead
from helpers.pipeline import abort_beside_a_survivor, generate_all

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.launch import Server

STORY_PROMPTS = [
    "The little dog",
    "One day, a girl named Sue",
    "Lily and Tom went to the park",
    "Once upon a time, there was a big",
]
NUM_PAGES = 300


@pytest.fixture(scope="module")
def server(stories260k_dir: Path) -> Iterator[Server]:
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=NUM_PAGES,
        data_parallel_size=2,
        load_balance_method="cache_aware",
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        yield running


@pytest.fixture(scope="module")
def offline(stories260k_dir: Path) -> LLM:
    return LLM(str(stories260k_dir), dtype="float32")


def test_replicas_give_one_processs_greedy_tokens(server: Server, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=80)
    prompts = STORY_PROMPTS * 2  # the second round hits the replica each prompt went to
    expected = offline.generate(prompts, params)
    for result, reference in zip(generate_all(server, prompts, params), expected):
        assert result.token_ids == reference.token_ids


def test_stats_merge_both_replicas_and_aborts_reach_the_right_one(
    server: Server, offline: LLM
) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected = offline.generate(STORY_PROMPTS[1], long)[0]

    survivor, stats = abort_beside_a_survivor(server, STORY_PROMPTS[0], STORY_PROMPTS[1], long)
    assert survivor.token_ids == expected.token_ids
    assert stats.total_pages == 2 * NUM_PAGES  # one reply for both replicas' pools
    assert [(part.replica, part.total_pages) for part in stats.replicas] == [
        (0, NUM_PAGES),
        (1, NUM_PAGES),
    ]
    assert stats.used_pages == 0 and stats.running_requests == 0


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_replica_that_dies_stops_the_server(stories260k_dir: Path, tmp_path: Path) -> None:
    flags = ("-dp", "2", "--dtype", "float32")
    with (tmp_path / "stderr").open("w+") as stderr:
        launcher, children = start_launcher(
            stories260k_dir, extra_args=flags, stderr=stderr, processes=6
        )
        try:
            schedulers = sorted(p for p, cmd in children.items() if "scheduler_proc" in cmd)
            assert any("router_proc" in cmd for cmd in children.values())
            killed_at = time.monotonic()
            os.kill(schedulers[1], signal.SIGKILL)
            assert launcher.wait(timeout=20) == 1
            stopped_in = time.monotonic() - killed_at
        finally:
            launcher.kill()
        stderr.seek(0)
        log = stderr.read()
    assert stopped_in < 3.0
    assert wait_dead(children, timeout=10.0) == []
    assert "launch ERROR scheduler-1 process was killed by SIGKILL; stopping the server" in log
