"""The scheduler core under pressure: preemption, aborts in flight, deferred freeing, limits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_proc.sequence_state import EventKind, SequenceStatus
from baton.validation import OverloadedError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(4, 60))] for _ in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    """Greedy outputs of 24 requests run with plenty of KV pages."""
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    return [o.token_ids for o in llm.generate(prompts(24), GREEDY)]


def pressured_config(model_dir: Path, disable_overlap: bool = False) -> BatonConfig:
    """40 pages of 4 tokens = 160 tokens, for requests of up to 84 tokens each (prompts(): up
    to 60, and 24 outputs): the longest request the pool can hold is the context."""
    return BatonConfig(
        model=str(model_dir),
        dtype="float32",
        page_size=4,
        num_pages=40,
        max_model_len=160,
        disable_overlap=disable_overlap,
    )


def run_all(scheduler: Scheduler, requests: list[list[int]]) -> dict[str, list[int]]:
    for index, prompt in enumerate(requests):
        scheduler.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    while scheduler.has_unfinished_requests():
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
    return tokens


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "plain"])
def test_kv_pressure_preempts_and_recovers(
    tiny_llama_dir: Path, reference: list[list[int]], disable_overlap: bool
) -> None:
    config = pressured_config(tiny_llama_dir, disable_overlap)
    scheduler = Scheduler(config)
    tokens = run_all(scheduler, prompts(24))
    assert [tokens[str(i)] for i in range(24)] == reference
    stats = scheduler.aggregate_stats()
    assert stats.preemptions > 0
    assert stats.used_pages == 0 and stats.free_pages + stats.cached_pages == 40
    assert scheduler.kv.cache.num_evictable_pages == stats.cached_pages
    assert sorted(scheduler.free_slots) == list(range(config.max_running_requests))


def test_abort_inside_in_flight_batch(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    config = BatonConfig(model=str(tiny_llama_dir), dtype="float32", page_size=4)
    scheduler = Scheduler(config)
    requests = prompts(24)[:3]
    for index, prompt in enumerate(requests):
        scheduler.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    finals = {}
    for _ in range(5):
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
    victim = scheduler.requests["1"]
    assert victim.in_flight_batches == 1  # the overlap loop has a batch with it computing
    scheduler.abort_request("1")
    assert victim.page_table  # not freed while the in-flight batch may still read its pages
    tokens_at_abort = len(tokens["1"])
    while scheduler.has_unfinished_requests():
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
            if output.finished:
                finals[output.rid] = output
    assert finals["1"].finish_reason == "abort"
    assert len(tokens["1"]) == tokens_at_abort  # tokens computed after the abort never surface
    assert tokens["1"] == reference[1][:tokens_at_abort]
    assert tokens["0"] == reference[0] and tokens["2"] == reference[2]
    assert victim.page_table == [] and "1" not in scheduler.requests
    assert scheduler.aggregate_stats().used_pages == 0


def test_finished_request_is_freed_one_step_late(tiny_llama_dir: Path) -> None:
    config = BatonConfig(model=str(tiny_llama_dir), dtype="float32", page_size=4)
    scheduler = Scheduler(config)
    scheduler.add_request("a", prompts(1)[0], SamplingParams(temperature=0, max_tokens=50))
    scheduler.add_request("b", prompts(2)[1], GREEDY)
    first_token = None
    while first_token is None:
        outputs = [o for o in scheduler.step() if o.rid == "a" and o.new_token_ids]
        first_token = outputs[0].new_token_ids[0] if outputs else None
    # Re-run with that token as a stop token: "a" finishes on its first token, while the overlap
    # loop already has its first decode step in flight.
    scheduler = Scheduler(config)
    scheduler.add_request(
        "a", prompts(1)[0], SamplingParams(temperature=0, stop_token_ids=[first_token])
    )
    scheduler.add_request("b", prompts(2)[1], GREEDY)
    finished = []
    while not finished:
        finished = [o for o in scheduler.step() if o.rid == "a" and o.finished]
    seq_a = scheduler.requests["a"]
    assert finished[0].finish_reason == "stop" and finished[0].new_token_ids == [first_token]
    assert seq_a.in_flight_batches == 1 and seq_a in scheduler.releasing and seq_a.page_table
    scheduler.step()
    assert "a" not in scheduler.requests and seq_a.page_table == []


def test_abort_waiting_request_and_queue_bound(tiny_llama_dir: Path) -> None:
    config = BatonConfig(model=str(tiny_llama_dir), dtype="float32", max_waiting_requests=2)
    scheduler = Scheduler(config)
    scheduler.add_request("a", [1, 2, 3], GREEDY)
    scheduler.add_request("b", [4, 5, 6], GREEDY)
    with pytest.raises(OverloadedError):
        scheduler.add_request("c", [7, 8, 9], GREEDY)
    scheduler.abort_request("b")
    scheduler.abort_request("b")  # twice, and unknown ids, are harmless
    scheduler.abort_request("nope")
    outputs = scheduler.step()
    aborted = [o for o in outputs if o.rid == "b"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    while scheduler.has_unfinished_requests():
        scheduler.step()
    assert scheduler.aggregate_stats().finished_requests == 2


def test_request_stats(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    output = llm.generate([list(range(1, 30))], GREEDY)[0]
    stats = output.stats
    assert stats.prompt_tokens == 29 and stats.generated_tokens == 24
    assert 0 <= stats.queue_time <= stats.time_to_first_token <= stats.e2e_latency
    # The prefill is what the first token waited for once the request was scheduled.
    assert stats.prompt_time is not None and 0 < stats.prompt_time <= stats.time_to_first_token
    assert stats.queue_time + stats.prompt_time == pytest.approx(stats.time_to_first_token)
    assert stats.decode_tokens_per_s > 0
    totals = llm.scheduler.aggregate_stats()
    assert totals.finished_requests == 1 and totals.generated_tokens == 24
    # 29 + 24 tokens in pages of 16 is 4 pages, all held by the request at its end: those in
    # the prefix cache too (each goes there once it fills), which it keeps locked until it is
    # released; then they are merely cached. The process's peak memory holds at least the KV
    # pool.
    assert totals.peak_used_pages == 4 and totals.used_pages == 0
    pool_bytes = llm.engine.kv_pool._storage.numel() * llm.engine.kv_pool._storage.element_size()
    assert totals.peak_memory_bytes > pool_bytes


def test_a_paused_request_keeps_its_pages_and_resumes_where_it_stopped(
    tiny_llama_dir: Path, reference: list[list[int]]
) -> None:
    """PAUSED (a client not reading): no steps, pages kept, the others go on; resumed, its
    greedy tokens are those of an undisturbed run. With only paused requests left the loop has
    nothing to run, so the server waits for messages instead of spinning."""
    scheduler = Scheduler(BatonConfig(model=str(tiny_llama_dir), dtype="float32", page_size=4))
    requests = prompts(24)[:2]
    for index, prompt in enumerate(requests):
        scheduler.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {"0": [], "1": []}

    def step() -> None:
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)

    while len(tokens["0"]) < 3:
        step()
    scheduler.set_paused("0", True)
    paused = scheduler.requests["0"]
    for _ in range(3):  # the batches already in flight finish
        step()
    held_pages, held_tokens = list(paused.page_table), len(tokens["0"])
    while scheduler.requests.get("1") is not None:
        step()
    assert tokens["1"] == reference[1]
    assert len(tokens["0"]) == held_tokens < len(reference[0])
    assert paused.page_table == held_pages and held_pages
    assert paused.status is SequenceStatus.PAUSED
    stats = scheduler.aggregate_stats()
    assert stats.paused_requests == 1 and stats.running_requests == 1
    assert not scheduler.has_runnable_work() and scheduler.step() == []
    scheduler.set_paused("0", False)
    assert scheduler.has_runnable_work()
    while scheduler.has_unfinished_requests():
        step()
    assert tokens["0"] == reference[0]
    kinds = [event.kind for event in paused.history]
    assert kinds.count(EventKind.PAUSED) == kinds.count(EventKind.RESUMED) == 1
    assert scheduler.aggregate_stats().paused_requests == 0


def test_a_request_paused_while_waiting_is_not_admitted_until_resumed(
    tiny_llama_dir: Path, reference: list[list[int]]
) -> None:
    """Paused before its admission: it takes no pages while the others run under KV pressure
    (the queue's later requests pass it), then, resumed, finishes with its undisturbed tokens."""
    scheduler = Scheduler(pressured_config(tiny_llama_dir))
    run_prompts = prompts(24)[:6]
    for index, prompt in enumerate(run_prompts):
        scheduler.add_request(str(index), prompt, GREEDY)
    scheduler.set_paused("0", True)  # paused while waiting: never admitted until resumed
    tokens: dict[str, list[int]] = {str(i): [] for i in range(6)}
    while any(scheduler.requests.get(str(i)) for i in range(1, 6)):
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
    assert tokens["0"] == [] and scheduler.requests["0"].page_table == []
    scheduler.set_paused("0", False)
    while scheduler.has_unfinished_requests():
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
    assert [tokens[str(i)] for i in range(6)] == reference[:6]


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "plain"])
def test_paused_requests_give_their_pages_to_the_ones_whose_clients_read(
    tiny_llama_dir: Path, reference: list[list[int]], disable_overlap: bool
) -> None:
    """Two paused requests hold 29 of 40 pages; a third, whose client reads, needs more than
    the rest. Paused ones are preempted for it (they once kept the pages, and the third
    waited forever), then, resumed, finish with their undisturbed tokens."""
    scheduler = Scheduler(pressured_config(tiny_llama_dir, disable_overlap))
    requests = prompts(24)
    paused_ids, reading_id = ("19", "1"), "6"  # prompts of 55, 52 and 51 tokens
    tokens: dict[str, list[int]] = {rid: [] for rid in (*paused_ids, reading_id)}

    def step() -> None:
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)

    for rid in paused_ids:
        scheduler.add_request(rid, requests[int(rid)], GREEDY)
    while min(len(tokens[rid]) for rid in paused_ids) < 3:
        step()
    for rid in paused_ids:
        scheduler.set_paused(rid, True)
    for _ in range(3):  # the batches already in flight finish
        step()
    assert scheduler.aggregate_stats().used_pages >= 29
    scheduler.add_request(reading_id, requests[int(reading_id)], GREEDY)
    for _ in range(500):
        if reading_id not in scheduler.requests:
            break
        step()
    assert tokens[reading_id] == reference[int(reading_id)]
    # The least urgent paused request (the later one) made room; the other one was enough.
    assert scheduler.requests["1"].status is SequenceStatus.WAITING_PREEMPT
    assert scheduler.requests["1"].page_table == []
    for rid in paused_ids:
        scheduler.set_paused(rid, False)
    while scheduler.has_unfinished_requests():
        step()
    for rid in paused_ids:
        assert tokens[rid] == reference[int(rid)]
    assert scheduler.aggregate_stats().used_pages == 0


def test_stream_interval_sends_the_first_token_then_every_n(
    tiny_llama_dir: Path, reference: list[list[int]]
) -> None:
    """--stream-interval 5: a request's first token goes at once, then five at a time, and its
    last output takes what is held; the tokens and logprobs are those of every-step outputs. An
    abort's final output carries none of what was held."""
    config = BatonConfig(model=str(tiny_llama_dir), dtype="float32", stream_interval=5)
    scheduler = Scheduler(config)
    with_logprobs = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    for index, prompt in enumerate(prompts(24)[:3]):
        scheduler.add_request(str(index), prompt, with_logprobs)
    scheduler.add_request("aborted", prompts(24)[3], GREEDY)
    sizes: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    finals = {}
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        if steps == 12:  # its first 6 tokens are out, and the next ones are held
            assert len(tokens["aborted"]) == 6
            scheduler.abort_request("aborted")
        for output in scheduler.step():
            if output.new_token_ids or not output.finished:
                sizes.setdefault(output.rid, []).append(len(output.new_token_ids))
            tokens.setdefault(output.rid, []).extend(output.new_token_ids)
            if output.logprobs is not None:
                assert len(output.logprobs) == len(output.new_token_ids)
            if output.finished:
                finals[output.rid] = output
    assert finals["aborted"].finish_reason == "abort" and finals["aborted"].new_token_ids == []
    for index in range(3):
        assert tokens[str(index)] == reference[index]
        assert sizes[str(index)] == [1, 5, 5, 5, 5, 3]
    assert sizes["aborted"][0] == 1 and set(sizes["aborted"][1:]) == {5}
    assert tokens["aborted"] == reference[3][: len(tokens["aborted"])]
