"""Scheduling for pipeline stages: Vajra's stage- and step-processed counters, a prompt's chunks
filling several stages while a sampling step waits for its token, each decode micro-batch's
share of the decoding sequences, and two real stages' schedulers keeping one micro-batch in
flight per stage and reporting only step-processed tokens."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from helpers.distributed_ranks import run_ranks

from baton.config import BatonConfig
from baton.distributed.process_group import Ranks
from baton.sampling_params import SamplingParams
from baton.scheduler_proc import errors
from baton.scheduler_proc.batch_policy import BatchPolicy
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.request_order import RequestOrder
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.waiting_queue import WaitingQueue

PAGE = 4


def pipelined(prompt_len: int = 10, stages: int = 2, max_tokens: int = 4) -> tuple:
    """A sequence as a scheduler of `stages` stages makes it: one step in flight per stage, none
    on a placeholder token."""
    kv = KVCacheManager(32, PAGE, enable_prefix_caching=True)
    seq = Sequence(
        "r",
        list(range(1, prompt_len + 1)),
        SamplingParams(),
        max_tokens,
        PAGE,
        max_in_flight=stages,
        on_placeholders=False,
    )
    seq.match_and_add_prefix(kv)
    return seq, kv


def progress(seq: Sequence) -> tuple[int, int]:
    return seq.num_stage_processed, seq.num_step_processed


# --- the counters on one sequence ----------------------------------------------------------------
def test_a_prompts_chunks_run_ahead_of_those_applied_by_the_pipelines_depth() -> None:
    seq, kv = pipelined(prompt_len=10)
    assert progress(seq) == (0, 0)
    seq.schedule_prefill(4, kv)
    assert progress(seq) == (4, 0) and seq.can_schedule
    seq.schedule_prefill(4, kv)  # a second chunk while the first is still in the pipeline
    assert progress(seq) == (8, 0)
    assert not seq.can_schedule  # one chunk per stage
    with pytest.raises(errors.NotIdle):
        seq.schedule_prefill(2, kv)
    seq.apply_prefill(None)  # only an apply moves the step-processed tokens
    assert progress(seq) == (8, 4) and seq.can_schedule
    seq.apply_prefill(None)
    assert progress(seq) == (8, 8)
    assert seq.output_ids == []


def test_three_stages_take_three_chunks_before_any_is_applied() -> None:
    seq, kv = pipelined(prompt_len=14, stages=3)
    for stage_processed in (4, 8, 12):
        assert seq.can_schedule
        seq.schedule_prefill(4, kv)
        assert progress(seq) == (stage_processed, 0)
    assert not seq.can_schedule
    seq.apply_prefill(None)
    seq.schedule_prefill(2, kv)  # the final chunk: 14 handed to the first stage, 4 applied
    assert progress(seq) == (14, 4)


def test_nothing_is_scheduled_while_a_sampled_token_is_in_the_pipeline() -> None:
    """After the final chunk (which samples) is scheduled, the next step's input is unknown: the
    sequence waits, though fewer steps than stages are in flight, and no output exists until
    that chunk is applied."""
    seq, kv = pipelined(prompt_len=10)
    seq.schedule_prefill(4, kv)
    seq.apply_prefill(None)
    step = seq.schedule_prefill(6, kv)
    assert step.samples and seq.num_pending == 1 < seq.max_in_flight
    assert not seq.can_schedule
    with pytest.raises(errors.NotIdle):
        seq.schedule_decode(kv)
    assert progress(seq) == (10, 4)
    assert seq.output_ids == [] and seq.num_output_tokens == 0
    seq.apply_prefill(50)
    assert progress(seq) == (10, 10)
    assert seq.output_ids == [50] and seq.can_schedule
    for token in (51, 52):
        seq.schedule_decode(kv)
        assert not seq.can_schedule  # a decode samples too: one at a time
        assert progress(seq) == (len(seq.tokens), len(seq.tokens) - 1)
        seq.apply_decode(token)
        assert progress(seq) == (len(seq.tokens) - 1, len(seq.tokens) - 1)
        assert seq.can_schedule
    assert seq.output_ids == [50, 51, 52]


def test_the_overlap_loop_schedules_on_a_placeholder_where_a_pipeline_waits() -> None:
    """The same sequence with placeholders allowed (the overlap loop): its decode is scheduled
    while the prefill's token is still being sampled."""
    kv = KVCacheManager(32, PAGE, enable_prefix_caching=True)
    seq = Sequence("r", list(range(1, 9)), SamplingParams(), 4, PAGE, max_in_flight=2)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(8, kv)
    assert seq.can_schedule
    seq.schedule_decode(kv)
    assert progress(seq) == (9, 0) and seq.num_placeholders == 2


def test_the_prefix_cache_takes_only_step_processed_pages() -> None:
    """Pages of a chunk still in the pipeline are not shared: another stage may still be
    writing them."""
    seq, kv = pipelined(prompt_len=13)
    seq.schedule_prefill(4, kv)
    seq.schedule_prefill(8, kv)
    seq.apply_prefill(None)
    seq.cache_computed_prefix(kv)
    assert kv.cache.num_cached_pages == 1  # the first chunk's page; not the second's two
    seq.apply_prefill(None)
    seq.cache_computed_prefix(kv)
    assert kv.cache.num_cached_pages == 3


# --- each decode micro-batch's share -------------------------------------------------------------
def decoding_policy(count: int, stages: int) -> BatchPolicy:
    """A policy over `count` sequences, each prefilled and applied, all decoding next."""
    config = BatonConfig(model="unused", pipeline_parallel_size=stages, chunk_size=256)
    kv = KVCacheManager(64, PAGE, enable_prefix_caching=False)
    order = RequestOrder("fcfs")
    waiting = WaitingQueue(order)
    policy = BatchPolicy(
        config, kv, order, [], waiting, list(range(8)), lambda seq: False, max_model_len=256
    )
    for index in range(count):
        seq = Sequence(
            f"r{index}",
            [index + 1] * 5,
            SamplingParams(),
            8,
            PAGE,
            max_in_flight=stages,
            on_placeholders=stages == 1,
            arrival_time=float(index),
        )
        waiting.insert(seq)
    rows = policy.next_batch()
    assert len(rows) == count and all(row.step.is_prefill for row in rows)
    for row in rows:
        row.seq.apply_prefill(100)
    return policy


@pytest.mark.parametrize(
    ("count", "stages", "shares"),
    [
        (5, 1, [5]),
        (5, 2, [3, 2]),
        (4, 2, [2, 2]),
        (1, 2, [1]),
        (5, 3, [2, 2, 1]),
        (7, 3, [3, 3, 1]),
    ],
)
def test_a_decode_micro_batch_takes_its_share_of_the_decoding_sequences(
    count: int, stages: int, shares: list[int]
) -> None:
    """ceil(decoding / stages) a micro-batch; the rest go in the next ones, while those already
    in flight wait for their tokens."""
    policy = decoding_policy(count, stages)
    batches = [policy.next_batch() for _ in range(len(shares) + 1)]
    assert [len(rows) for rows in batches] == [*shares, 0]
    rids = [row.seq.rid for rows in batches for row in rows]
    assert sorted(rids) == [f"r{index}" for index in range(count)]  # each exactly once
    assert all(not row.step.is_prefill for rows in batches for row in rows)
    # The first micro-batch's tokens come back: its sequences make the next one.
    for row in batches[0]:
        row.seq.apply_decode(7)
    again = policy.next_batch()
    assert [row.seq.rid for row in again] == [row.seq.rid for row in batches[0]]


# --- two real stages -----------------------------------------------------------------------------
CHUNK = 8
PROMPTS = [
    [(7 * j + 3) % 250 for j in range(21)],  # three chunks
    [(5 * j + 1) % 250 for j in range(5)],
    [(11 * j + 2) % 250 for j in range(13)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def scheduler_config(model: str, stages: int) -> BatonConfig:
    """A float32 engine on one thread (the AVX2 plan on every CPU), prompts in small chunks."""
    return BatonConfig(
        model=model,
        dtype="float32",
        max_cpu_isa="avx2",
        num_threads=1,
        omp_threads_bind="nobind",
        pipeline_parallel_size=stages,
        chunk_size=CHUNK,
        page_size=PAGE,
        num_pages=64,
        max_model_len=256,
        max_running_requests=8,
    )


def drive(model: str, ranks: Ranks) -> dict[str, Any]:
    """Every step of this rank's scheduler over PROMPTS: the micro-batch it launched (each row's
    request, whether a prefill, its tokens, and how many sequences were decoding), the batches
    left in flight, the outputs with their sequence's state when returned, and every running
    sequence's counters."""
    torch.set_num_threads(1)
    scheduler = Scheduler(scheduler_config(model, ranks.pp.size), ranks=ranks)
    launched: list[dict[str, Any]] = []
    schedule = scheduler.policy.next_batch

    def next_batch() -> list:
        decoding = sum(1 for seq in scheduler.running if seq.prefill_done)
        rows = schedule()
        rows_seen = [(row.seq.rid, row.step.is_prefill, row.step.num_tokens) for row in rows]
        launched.append({"rows": rows_seen, "decoding": decoding})
        return rows

    scheduler.policy.next_batch = next_batch
    seqs = {}
    for index, prompt in enumerate(PROMPTS):
        scheduler.add_request(f"r{index}", prompt, GREEDY)
        seqs[f"r{index}"] = scheduler.requests[f"r{index}"]
    steps = []
    try:
        while scheduler.has_unfinished_requests():
            outputs = scheduler.step()
            step = {
                "batch": launched[-1],
                "in_flight": len(scheduler._in_flight),
                "outputs": [],
                "running": {
                    seq.rid: (seq.num_stage_processed, seq.num_step_processed, seq.prefill_len)
                    for seq in scheduler.running
                },
            }
            for output in outputs:
                seq = seqs[output.rid]
                step["outputs"].append(
                    {
                        "rid": output.rid,
                        "new": list(output.new_token_ids),
                        "finished": output.finished,
                        "output_ids": list(seq.output_ids),
                        "tokens": len(seq.tokens),
                        "counters": progress(seq),
                    }
                )
            steps.append(step)
            assert len(steps) < 500, "the requests never finished"
    finally:
        scheduler.shutdown()
    return {"steps": steps, "free": scheduler.kv.available_pages, "pages": scheduler.kv.num_pages}


@pytest.fixture(scope="module")
def two_stages(tiny_model_factory) -> dict[int, dict[str, Any]]:
    """Each stage's record of serving PROMPTS (tiny Llama: one layer a stage)."""
    model = str(tiny_model_factory("llama"))
    results = run_ranks(functools.partial(drive, model), size=2, stages=2, timeout_s=120)
    for status, value in results.values():
        assert status == "ok", value
    return {rank: value for rank, (_, value) in results.items()}


def test_both_stages_schedule_and_report_alike(two_stages: dict[int, dict[str, Any]]) -> None:
    """Replicated decisions: the same micro-batches and the same outputs on every rank."""
    assert two_stages[0]["steps"] == two_stages[1]["steps"]
    for record in two_stages.values():
        assert record["free"] == record["pages"]  # every page back in the pool


def test_one_micro_batch_stays_in_flight_per_stage_but_the_one_launched_into(
    two_stages: dict[int, dict[str, Any]],
) -> None:
    """Two stages: after a step that launched, one micro-batch in flight (the pipeline's depth);
    after one that launched nothing, the oldest one's results are taken and none is left."""
    steps = two_stages[1]["steps"]
    launching = [step for step in steps if step["batch"]["rows"]]
    idle = [step for step in steps if not step["batch"]["rows"]]
    assert launching and idle  # both kinds happen (a lone decoding sequence alternates)
    assert all(step["in_flight"] == 1 for step in launching)
    assert all(step["in_flight"] == 0 for step in idle)
    # The first step's micro-batch is still in the pipeline: no output yet.
    assert steps[0]["outputs"] == []


def test_a_prompts_chunks_fill_both_stages(two_stages: dict[int, dict[str, Any]]) -> None:
    """The 21-token prompt's first two chunks are in the pipeline at once; a decoding sequence
    never has more than its one step in flight."""
    steps = two_stages[0]["steps"]
    assert steps[1]["running"]["r0"][:2] == (2 * CHUNK, CHUNK)
    for step in steps:
        for stage_processed, step_processed, prefill_len in step["running"].values():
            assert 0 <= stage_processed - step_processed <= 2 * CHUNK
            if step_processed >= prefill_len:  # decoding
                assert stage_processed - step_processed <= 1


def test_outputs_are_only_step_processed_tokens(two_stages: dict[int, dict[str, Any]]) -> None:
    """Each output's tokens are its sequence's newest, already applied: every token known but
    the newest has been through every stage, and nothing more is in the pipeline for it."""
    collected: dict[str, list[int]] = {}
    finished = set()
    for step in two_stages[0]["steps"]:
        for output in step["outputs"]:
            rid = output["rid"]
            assert rid not in finished
            collected.setdefault(rid, []).extend(output["new"])
            assert output["output_ids"] == collected[rid]
            if output["finished"]:
                finished.add(rid)
                continue  # (its pages are released: its counters start over)
            assert output["counters"] == (output["tokens"] - 1, output["tokens"] - 1)
    assert finished == {"r0", "r1", "r2"}
    assert all(len(tokens) == GREEDY.max_tokens for tokens in collected.values())


def test_each_decode_micro_batch_takes_half_of_the_decoding_sequences(
    two_stages: dict[int, dict[str, Any]],
) -> None:
    """ceil(decoding / 2) rows a decode micro-batch: with three decoding, two and then one."""
    decode_batches = [
        step["batch"]
        for step in two_stages[0]["steps"]
        if step["batch"]["rows"] and not any(prefill for _, prefill, _ in step["batch"]["rows"])
    ]
    assert decode_batches
    for batch in decode_batches:
        assert len(batch["rows"]) <= -(-batch["decoding"] // 2)
    sizes = [len(batch["rows"]) for batch in decode_batches if batch["decoding"] == 3]
    assert 2 in sizes and 1 in sizes
