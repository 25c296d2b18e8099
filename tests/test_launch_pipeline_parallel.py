"""A server of two pipeline stages (gloo, one process and one core each; stories260K's five
layers held three and two): the same tokens as one process, through the whole pipeline, while
micro-batches of chunked prefills and decodes are in flight on both stages; stages of two
tensor-parallel ranks each, and stages on two nodes, too. A stage that dies or stalls stops the
server; more stages than layers, or a draft model with stages, is refused in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import free_port
from helpers.distributed_ranks import free_address
from helpers.launcher import (
    children_of,
    scheduler_ranks,
    start_launcher,
    stop_by_a_faulty_rank,
    wait_dead,
)
from helpers.pipeline import abort_beside_a_survivor, generate_all, generate_all_until_idle

from baton import LLM, SamplingParams, launch
from baton.config import BatonConfig
from baton.launch import Server
from baton.structured_outputs import StructuredOutputsParams

STORY_PROMPTS = ["The little dog", "One day, a girl named Sue", "Lily and Tom went to the park"]
# Shares its first tokens with STORY_PROMPTS[1]: a prefix hit once that one ran.
SHARED_PREFIX = "One day, a girl named Sue went"
NUM_PAGES = 400


@pytest.fixture(scope="module")
def server(stories260k_dir: Path) -> Iterator[Server]:
    # Chunks of 8 tokens: the prompts' prefills, sent together, take several micro-batches,
    # which fill both stages at once and mix with decode rows.
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=NUM_PAGES,
        chunk_size=8,
        pipeline_parallel_size=2,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        yield running


@pytest.fixture(scope="module")
def offline(stories260k_dir: Path) -> LLM:
    return LLM(str(stories260k_dir), dtype="float32")


def test_two_stages_give_one_processs_greedy_tokens(server: Server, offline: LLM) -> None:
    """All at once, then a prompt whose first pages the first round left in the prefix cache:
    a stage inserts only what has left the last stage, and the hit still gives the same
    tokens."""
    params = SamplingParams(temperature=0, max_tokens=120)
    expected = offline.generate([*STORY_PROMPTS, SHARED_PREFIX], params)
    results = generate_all(server, STORY_PROMPTS, params)
    results += generate_all(server, [SHARED_PREFIX], params)
    for result, reference in zip(results, expected, strict=True):
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == reference.finish_reason
    assert results[-1].usage is not None and results[-1].usage.cached_tokens > 0


def test_two_stages_sample_one_processs_seeded_tokens(server: Server, offline: LLM) -> None:
    """Only the last stage samples (each request's seeded generator there); every stage
    applies the tokens it shares, penalties counting them alike."""
    params = SamplingParams(
        temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.3, max_tokens=50
    )
    expected = offline.generate(STORY_PROMPTS, params)
    results = generate_all(server, STORY_PROMPTS, params)
    for result, reference in zip(results, expected, strict=True):
        assert result.token_ids == reference.token_ids


def test_two_stages_honour_structured_outputs(server: Server, offline: LLM) -> None:
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]+ (is|was) [a-z]+\."),
    )
    expected = offline.generate(STORY_PROMPTS, params)
    results = generate_all(server, STORY_PROMPTS, params)
    for result, reference in zip(results, expected, strict=True):
        assert result.text == reference.text and result.finish_reason == "stop"


def test_an_abort_reaches_every_stage_and_the_pool_ends_idle(server: Server, offline: LLM) -> None:
    """The aborted request has micro-batches in flight on both stages when the abort comes:
    its pages go back only once they are through the last stage, and none is lost."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected = offline.generate(STORY_PROMPTS[1], long)[0]

    survivor, stats = abort_beside_a_survivor(server, STORY_PROMPTS[0], STORY_PROMPTS[1], long)
    assert survivor.token_ids == expected.token_ids
    assert stats.used_pages == 0 and stats.running_requests == 0
    assert stats.free_pages + stats.cached_pages == NUM_PAGES


def test_two_stages_preempt_as_one_process(stories260k_dir: Path, offline: LLM) -> None:
    """40 pages of 4 tokens for nine requests of up to 66 tokens (17 pages) each: sequences
    are preempted while micro-batches of others are still in the pipeline, and recomputed
    later; the tokens are still one process's, and the pool ends idle."""
    prompts = [f"{p} and" for p in STORY_PROMPTS * 3]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [r.token_ids for r in offline.generate(prompts, params)]
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=40,
        max_model_len=160,
        pipeline_parallel_size=2,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        results, stats = generate_all_until_idle(running, prompts, params)
    assert [r.token_ids for r in results] == expected
    assert stats.used_pages == 0 and stats.free_pages + stats.cached_pages == 40
    assert stats.preemptions > 0


def test_two_stages_of_two_ranks_give_one_processs_greedy_tokens(
    stories260k_dir: Path, offline: LLM
) -> None:
    """-tp 2 -pp 2: four processes, rank = stage x 2 + tensor-parallel rank; each stage's
    ranks sum their shards, and its hidden states go to the same rank of the next stage."""
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = offline.generate(STORY_PROMPTS, params)
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=200,
        chunk_size=8,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        assert len([name for name in running.processes if name.startswith("scheduler")]) == 4
        results = generate_all(running, STORY_PROMPTS, params)
    for result, reference in zip(results, expected, strict=True):
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == reference.finish_reason


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_stage_that_dies_or_stalls_stops_the_server(
    fault: str, stories260k_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of stage 1: the launcher exits 1 within seconds naming it; SIGSTOP of stage 1:
    stage 0 waits for the outputs of a micro-batch stage 1 never finishes, times out after
    --distributed-timeout-seconds, and the server stops the same way. No process and no ipc
    directory is left behind."""
    flags = ("-pp", "2", "--distributed-timeout-seconds", "5", "--dtype", "float32")
    stopped_in, log = stop_by_a_faulty_rank(stories260k_dir, flags, fault, 5, tmp_path / "log")
    # The five layers, three and two: stories260K's LM head, on the last stage, weighs less
    # than one of its layers.
    assert "pipeline stage 0 of 2 (layers 0-2)" in log
    assert "pipeline stage 1 of 2 (layers 3-4)" in log
    if fault == "killed":
        assert stopped_in < 3.0
        assert "launch ERROR scheduler-1 process was killed by SIGKILL; stopping the server" in log
    else:
        assert stopped_in < 5 + 15
        assert "launch ERROR scheduler process exited with status 1; stopping the server" in log


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_stage_killed_mid_request_ends_it_and_the_server(
    stories260k_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of stage 1 while micro-batches of an open stream are in flight: stage 0, waiting
    for their outputs, must not wait forever (the timeout is left at its 300 s default here);
    the stream ends with an error and [DONE], and the launcher exits 1 within seconds."""
    long = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (tmp_path / "stderr").open("w+") as stderr:
        flags = ("-pp", "2", "--dtype", "float32")
        launcher, children = start_launcher(
            stories260k_dir, extra_args=flags, stderr=stderr, processes=5
        )
        try:
            with (
                httpx.Client(base_url=launcher.http_url, timeout=30) as http,
                http.stream("POST", "/v1/completions", json=long) as response,
            ):
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                killed_at = time.monotonic()
                os.kill(scheduler_ranks(children)[1], signal.SIGKILL)
                rest = [line for line in lines if line]
            assert launcher.wait(timeout=20) == 1
            stopped_in = time.monotonic() - killed_at
        finally:
            launcher.kill()
        stderr.seek(0)
        log = stderr.read()
    assert stopped_in < 3.0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "unavailable"
    assert wait_dead(children, timeout=10.0) == []
    assert re.search(r"launch ERROR scheduler(-1)? process .*; stopping the server", log), log


def test_more_stages_than_layers_are_refused_in_one_line(
    stories260k_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stories260K has 5 layers: 8 stages would leave some without one. The launcher reads the
    model's config and refuses before it starts any process."""
    started: list[object] = []
    monkeypatch.setattr(launch.Server, "start", lambda *args, **kwargs: started.append(args))
    argv = ["--model", str(stories260k_dir), "-pp", "8", "--port", "0"]
    assert launch.main(argv) == 1
    assert not started
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == "5 layers cannot make --pipeline-parallel-size 8 stages"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_stages_is_refused(method: str, stories260k_dir: Path) -> None:
    """A draft is proposed from the tokens before it, which a pipeline knows only once the
    micro-batch before has left its last stage: refused by the config, and so by the command
    line (SGLang's spelling, --pp-size, here) before any process starts."""
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        spec["model"] = str(stories260k_dir)
    refusal = "--speculative-config is not supported with --pipeline-parallel-size > 1"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        BatonConfig(model=str(stories260k_dir), pipeline_parallel_size=2, speculative_config=spec)
    argv = ["--model", str(stories260k_dir), "--pp-size", "2"]
    with pytest.raises(SystemExit, match=re.escape(refusal)):
        launch.main([*argv, "--speculative-config", json.dumps(spec)])
    one_stage = BatonConfig(model=str(stories260k_dir), speculative_config=spec)
    assert one_stage.speculative_config is not None


def node_flags(address: str, node_rank: int) -> tuple[str, ...]:
    return (
        "-pp", "2", "--nnodes", "2", "--node-rank", str(node_rank),
        "--dist-init-addr", address, "--dtype", "float32",
    )  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_two_nodes_one_stage_each_serve_one_processs_tokens(
    stories260k_dir: Path, offline: LLM
) -> None:
    """Two launchers on one machine, --nnodes 2: node 0 runs stage 0 and serves, node 1 runs
    stage 1; the tokens are one process's, and a node that dies stops the other."""
    address = free_address()
    command = [sys.executable, "-m", "baton.launch", "--model", str(stories260k_dir)]
    command += node_flags(address, 1)
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        launcher, children = start_launcher(
            stories260k_dir, extra_args=node_flags(address, 0), processes=4
        )
        try:
            assert next(worker.stdout).startswith("Baton worker node 1 of 2 ready: ranks 1-1 of 2")
            worker_children = children_of(worker.pid)
            assert len(worker_children) == 1
            expected = offline.generate(
                "Once upon a time", SamplingParams(temperature=0, max_tokens=40)
            )[0]
            body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
            reply = httpx.post(f"{launcher.http_url}/v1/completions", json=body, timeout=60)
            assert reply.json()["choices"][0]["text"] == expected.text
            killed_at = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL)  # the node's stage dies with its launcher
            assert launcher.wait(timeout=20) == 1
            assert time.monotonic() - killed_at < 5.0
        finally:
            launcher.kill()
    finally:
        worker.kill()
    assert wait_dead([*children, *worker_children], timeout=10.0) == []
