"""Speculative decoding end to end (n-gram drafts) on the tiny random models, and on stories260K
where drafts must be accepted often: greedy outputs equal to those without speculation in the
overlap and plain loops, under chunked prefill, prefix hits, preemption and slot reuse; max_tokens
and stop tokens exact although accepted drafts run past them; pages back in the pool; the
spec_decode counters; rows that must not speculate (min_tokens); logprobs of accepted drafts;
stop strings; sampled requests.
Exact-distribution statistics are tests/engine/speculation/test_verify.py's."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.engine.speculation.draft_budget import DraftBudget
from baton.llm import RequestOutput
from baton.scheduler_proc import batch_result
from baton.scheduler_proc.batch_result import kept_tokens
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_stats import AggregateStats

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])


def repetitive(seed: int, length: int) -> list[int]:
    """A short random unit repeated: n-gram lookups find drafts in it from the start."""
    rng = random.Random(seed)
    unit = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
    return (unit * length)[:length]


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Mostly repetitive prompts of 12 to 60 tokens, and a few random ones."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        length = rng.randint(12, 60)
        if index % 4 == 3:
            out.append([rng.randrange(256) for _ in range(length)])
        else:
            out.append(repetitive(seed * 1000 + index, length))
    return out


def llm(model: Path, overlap: bool = True, spec: bool = True, **config: object) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        disable_overlap=not overlap,
        speculative_config=SPEC if spec else None,
        **config,
    )


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.token_ids for output in outputs]


def drained(engine: LLM) -> AggregateStats:
    """Stats once the loop is idle: `generate` returns at the last final output, maybe while a
    batch that still holds a finished request's pages is in flight (deferred freeing)."""
    scheduler = engine.scheduler
    for _ in range(3):
        if not scheduler.has_unfinished_requests():
            break
        assert scheduler.step() == []
    assert not scheduler.has_unfinished_requests()
    return scheduler.aggregate_stats()


def assert_pool_whole(stats: AggregateStats) -> None:
    assert stats.used_pages == 0
    assert stats.free_pages + stats.cached_pages == stats.total_pages


def assert_some_accepted_and_rejected(outputs: list[RequestOutput]) -> None:
    stats = [output.stats for output in outputs]
    assert any(s.spec_accepted_tokens > 0 for s in stats), "no draft was ever accepted"
    assert any(s.spec_draft_tokens > s.spec_accepted_tokens for s in stats), "none rejected"
    assert all(s.spec_draft_tokens >= s.spec_accepted_tokens >= 0 for s in stats)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    """Greedy outputs without speculation, plenty of KV pages, the plain loop."""
    return token_ids(llm(tiny_llama_dir, overlap=False, spec=False).generate(prompts(16), GREEDY))


# --- greedy outputs equal ----------------------------------------------------------------------
@OVERLAP
def test_greedy_output_equal_with_and_without_speculation(
    tiny_model_dir: Path, overlap: bool
) -> None:
    requests = prompts(8, seed=1)
    expected = llm(tiny_model_dir, overlap, spec=False).generate(requests, GREEDY)
    engine = llm(tiny_model_dir, overlap)
    outputs = engine.generate(requests, GREEDY)
    assert token_ids(outputs) == token_ids(expected)
    assert [o.finish_reason for o in outputs] == ["length"] * len(requests)
    assert_some_accepted_and_rejected(outputs)
    assert_pool_whole(drained(engine))


@OVERLAP
@pytest.mark.parametrize("batch_order", ["prefill-first", "decode-first"])
def test_chunked_prefill_and_preemption(
    tiny_llama_dir: Path, reference: list[list[int]], overlap: bool, batch_order: str
) -> None:
    # Chunks of 16 for prompts up to 60 tokens; 40 pages of 4 tokens for 16 requests of up to 84.
    engine = llm(
        tiny_llama_dir,
        overlap,
        chunk_size=16,
        page_size=4,
        num_pages=40,
        max_model_len=160,
        batch_order=batch_order,
    )
    outputs = engine.generate(prompts(16), GREEDY)
    assert token_ids(outputs) == reference
    stats = drained(engine)
    assert stats.preemptions > 0
    assert sum(o.stats.preemptions for o in outputs) == stats.preemptions
    assert_some_accepted_and_rejected(outputs)
    assert_pool_whole(stats)
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_running_requests))


@OVERLAP
def test_prefix_hits(tiny_llama_dir: Path, overlap: bool) -> None:
    first = repetitive(7, 44)
    # Shares 40 tokens (10 whole pages of 4) with the first, then goes its own way.
    second = [*first[:40], 11, 22, 33, 44, 55, 66]
    outputs = {}
    for spec in (False, True):
        engine = llm(tiny_llama_dir, overlap, spec=spec, page_size=4)
        outputs[spec] = engine.generate([first], GREEDY) + engine.generate([second], GREEDY)
        assert_pool_whole(drained(engine))
    assert token_ids(outputs[True]) == token_ids(outputs[False])
    assert outputs[True][0].stats.cached_tokens == 0
    assert outputs[True][1].stats.cached_tokens == 40
    assert outputs[True][1].stats.spec_draft_tokens > 0


@OVERLAP
def test_slots_reused_by_later_requests(
    tiny_llama_dir: Path, reference: list[list[int]], overlap: bool
) -> None:
    """Two slots for 16 requests: the engine's per-slot verdicts (what the slot's latest step
    yielded and rejected) pass from one request to the next."""
    engine = llm(tiny_llama_dir, overlap, max_running_requests=2, page_size=4)
    outputs = engine.generate(prompts(16), GREEDY)
    assert token_ids(outputs) == reference
    assert_some_accepted_and_rejected(outputs)
    assert_pool_whole(drained(engine))


@OVERLAP
def test_to_the_context_end_in_a_pool_of_one_context(stories260k_dir: Path, overlap: bool) -> None:
    """Every request runs to max_model_len (drafts stop at the context's end), in a pool that
    holds one such request: the steps scheduled on optimistic ends must not need more."""
    options = {"max_model_len": 64, "page_size": 4, "num_pages": 16}
    plain = llm(stories260k_dir, overlap, spec=False, **options)
    requests = [plain.tokenizer.encode(text) for text in STORY_PROMPTS]
    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=64 - len(p)) for p in requests
    ]
    expected = plain.generate(requests, params)
    engine = llm(stories260k_dir, overlap, **options)
    outputs = engine.generate(requests, params)
    assert token_ids(outputs) == token_ids(expected)
    assert [len(o.prompt_token_ids) + len(o.token_ids) for o in outputs] == [64] * len(requests)
    assert sum(o.stats.spec_accepted_tokens for o in outputs) > 0
    stats = drained(engine)
    assert stats.preemptions > 0
    assert_pool_whole(stats)


# --- max_tokens and stop tokens exact ----------------------------------------------------------
def first_repeat_free_stop(tokens: list[int], earliest: int = 3) -> tuple[int, int]:
    """A token of `tokens` at its first occurrence, at `earliest` or later: (index, token)."""
    for index in range(earliest, len(tokens)):
        if tokens[index] not in tokens[:index]:
            return index, tokens[index]
    raise AssertionError(f"every token after {earliest} repeats an earlier one: {tokens}")


@OVERLAP
def test_stop_tokens_and_max_tokens_exact(
    tiny_llama_dir: Path, reference: list[list[int]], overlap: bool
) -> None:
    requests = prompts(16)[:8]
    params = []
    expected_tokens = []
    expected_reasons = []
    for index, tokens in enumerate(reference[:8]):
        if index % 2:
            max_tokens = 1 + index  # 2, 4, 6, 8
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            expected_tokens.append(tokens[:max_tokens])
            expected_reasons.append("length")
        else:
            stop_at, stop = first_repeat_free_stop(tokens, earliest=3 + index)
            params.append(
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
            )
            expected_tokens.append(tokens[: stop_at + 1])
            expected_reasons.append("stop")
    plain = llm(tiny_llama_dir, overlap, spec=False).generate(requests, params)
    assert token_ids(plain) == expected_tokens
    assert [o.finish_reason for o in plain] == expected_reasons
    engine = llm(tiny_llama_dir, overlap)
    outputs = engine.generate(requests, params)
    assert token_ids(outputs) == expected_tokens
    assert [o.finish_reason for o in outputs] == expected_reasons
    assert [o.stats.generated_tokens for o in outputs] == [len(t) for t in expected_tokens]
    assert sum(o.stats.spec_draft_tokens for o in outputs) > 0
    assert_pool_whole(drained(engine))


class StepSpy:
    """Records what each step yielded per request, and what the scheduler kept of it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: dict[str, list[list[int]]] = {}
        self.cuts: list[tuple[str | None, int, int]] = []  # (reason, yielded, kept)
        monkeypatch.setattr(batch_result, "kept_tokens", self)

    def __call__(self, seq: Sequence, tokens: list[int], eos_token_ids: list[int]) -> tuple:
        kept, reason = kept_tokens(seq, tokens, eos_token_ids)
        self.steps.setdefault(seq.rid, []).append(list(tokens))
        if len(kept) < len(tokens):
            self.cuts.append((reason, len(tokens), len(kept)))
        return kept, reason


STORY_PROMPTS = [
    "Tom and Sue went to the park. Tom and Sue",
    "Once upon a time, there was a little girl named Lily. Lily",
    "The cat sat on the mat. The cat",
]


@OVERLAP
def test_drafts_cut_at_stop_tokens_and_max_tokens(
    stories260k_dir: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trained model accepts drafts often: steps yield several tokens, so a stop token or
    max_tokens falls inside a step's accepted drafts, and the tokens after it are dropped."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spy = StepSpy(monkeypatch)
    free_run = llm(stories260k_dir, overlap).generate(STORY_PROMPTS, long)
    # Per prompt, a token first output inside a step's accepted drafts (not the step's last).
    requests, params, expected = [], [], []
    for prompt, output in zip(STORY_PROMPTS, free_run):
        index = 0
        for step in spy.steps[output.request_id]:
            for offset, token in enumerate(step[:-1]):
                if token not in output.token_ids[: index + offset]:
                    requests.append(prompt)
                    params.append(msgspec.structs.replace(long, stop_token_ids=[token]))
                    expected.append(output.token_ids[: index + offset + 1])
                    break
            else:
                index += len(step)
                continue
            break
    assert requests, "no token ever came first out of an accepted draft"
    plain = llm(stories260k_dir, overlap, spec=False).generate(requests, params)
    assert token_ids(plain) == expected
    spy.cuts.clear()
    engine = llm(stories260k_dir, overlap)
    outputs = engine.generate(requests, params)
    assert token_ids(outputs) == expected
    assert [o.finish_reason for o in outputs] == ["stop"] * len(requests)
    assert {reason for reason, _, _ in spy.cuts} == {"stop"}
    # max_tokens inside a step: every limit from 1 to 20 on each prompt, 8 rows at a time (on
    # a CPU the engine verifies drafts only within a small batch token budget).
    requests = [prompt for prompt in STORY_PROMPTS for _ in range(20)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 21)]
    spy.cuts.clear()
    engine = llm(stories260k_dir, overlap, max_running_requests=8)
    outputs = engine.generate(requests, params * len(STORY_PROMPTS))
    want = [o.token_ids[:m] for o in free_run for m in range(1, 21)]
    assert token_ids(outputs) == want
    assert all(o.finish_reason == "length" for o in outputs)
    if overlap:
        # A step scheduled while the previous one was in flight counted on one token from it:
        # when both accept drafts, the second one runs past max_tokens.
        assert "length" in {reason for reason, _, _ in spy.cuts}
    else:
        # Without overlap each step's drafts stay within max_tokens.
        assert spy.cuts == []
    assert_pool_whole(drained(engine))


@OVERLAP
def test_eos_stops_as_without_speculation(tiny_llama_dir: Path, overlap: bool) -> None:
    # The tiny model often samples <|eos|> or <|pad|> (its second EOS) early on.
    requests = prompts(16, seed=2)
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = llm(tiny_llama_dir, overlap, spec=False).generate(requests, params)
    outputs = llm(tiny_llama_dir, overlap).generate(requests, params)
    assert token_ids(outputs) == token_ids(expected)
    reasons = [o.finish_reason for o in outputs]
    assert reasons == [o.finish_reason for o in expected]
    assert "stop" in reasons and "length" in reasons


# --- pages back in the pool ---------------------------------------------------------------------
def test_abort_mid_speculation_frees_everything(
    tiny_llama_dir: Path, reference: list[list[int]]
) -> None:
    config = BatonConfig(
        model=str(tiny_llama_dir), dtype="float32", page_size=4, speculative_config=SPEC
    )
    scheduler = Scheduler(config)
    requests = prompts(16)[:3]
    for index, prompt in enumerate(requests):
        scheduler.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    finals = {}

    def step() -> None:
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
            if output.finished:
                finals[output.rid] = output

    victim = scheduler.requests["1"]

    def speculating_in_flight() -> bool:
        steps = victim._pending
        return victim.in_flight_batches == 1 and bool(steps) and steps[-1].num_drafts > 0

    for _ in range(40):
        step()
        if victim.num_speculative_steps and speculating_in_flight():
            break
    assert speculating_in_flight(), "the victim never had a speculative step in flight"
    scheduler.abort_request("1")
    assert victim.page_table  # not freed while the in-flight batch may still use its pages
    tokens_at_abort = len(tokens["1"])
    while scheduler.has_unfinished_requests():
        step()
    assert finals["1"].finish_reason == "abort"
    assert len(tokens["1"]) == tokens_at_abort
    assert tokens["1"] == reference[1][:tokens_at_abort]
    assert tokens["0"] == reference[0] and tokens["2"] == reference[2]
    assert victim.page_table == [] and "1" not in scheduler.requests
    stats = scheduler.aggregate_stats()
    assert_pool_whole(stats)
    assert scheduler.kv.cache.num_evictable_pages == stats.cached_pages
    assert sorted(scheduler.free_slots) == list(range(config.max_running_requests))


# --- counters -----------------------------------------------------------------------------------
def test_aggregate_counters_sum_the_requests(tiny_llama_dir: Path) -> None:
    config = BatonConfig(
        model=str(tiny_llama_dir), dtype="float32", page_size=4, speculative_config=SPEC
    )
    scheduler = Scheduler(config)
    requests = prompts(16, seed=3)[:10]
    for index, prompt in enumerate(requests):
        scheduler.add_request(str(index), prompt, GREEDY)
    finals = {}
    previous = (0, 0, 0)
    while scheduler.has_unfinished_requests():
        for output in scheduler.step():
            if output.finished:
                finals[output.rid] = output
        stats = scheduler.aggregate_stats()
        counters = (
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
        )
        # Running requests count too, so the totals only grow.
        assert all(now >= before for now, before in zip(counters, previous))
        previous = counters
    num_drafts, draft_tokens, accepted = previous
    assert draft_tokens >= accepted > 0 and 0 < num_drafts <= draft_tokens
    assert draft_tokens == sum(o.stats.spec_draft_tokens for o in finals.values())
    assert accepted == sum(o.stats.spec_accepted_tokens for o in finals.values())
    assert draft_tokens <= num_drafts * SPEC["num_speculative_tokens"]
    assert stats.generated_tokens == 24 * len(requests)


# --- rows that do not speculate ----------------------------------------------------------------
@OVERLAP
def test_min_tokens_rows_do_not_speculate_and_logprobs_rows_do(
    tiny_llama_dir: Path,
    reference: list[list[int]],
    overlap: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests = prompts(16)[:5]
    requests[3] = prompts(16)[1]  # whose greedy output has an EOS
    index, stop = first_repeat_free_stop(reference[2], earliest=2)
    params = [
        GREEDY,  # speculates, in the same batches as the others
        # Speculates too: each accepted draft gets its log-probability, as without speculation.
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        # Its stop token is suppressed for the first 12 outputs: it must not come out of a draft.
        SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop], min_tokens=12
        ),
        # EOS suppressed throughout (the tiny model samples EOS early on otherwise).
        SamplingParams(temperature=0, max_tokens=24, min_tokens=24),
        # min_tokens with no stop token to suppress: nothing keeps it from speculating.
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=24),
    ]
    assert index < 12
    expected = llm(tiny_llama_dir, overlap, spec=False).generate(requests, params)
    # Both suppressions did change the output.
    assert token_ids(expected)[2][index] != stop
    assert len(token_ids(expected)[3]) == 24 and token_ids(expected)[3] != reference[1]
    engine = llm(tiny_llama_dir, overlap)
    early = []
    original = Sequence.schedule_speculative

    def spy(seq: Sequence, num_drafts: int, kv: object) -> object:
        suppressing = seq.params.stop_token_ids or not seq.params.ignore_eos
        if suppressing and seq.num_output_tokens < seq.params.min_tokens:
            early.append((seq.rid, seq.num_output_tokens))
        return original(seq, num_drafts, kv)

    monkeypatch.setattr(Sequence, "schedule_speculative", spy)
    outputs = engine.generate(requests, params)
    assert early == []
    assert token_ids(outputs) == token_ids(expected)
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected]
    drafts = [o.stats.spec_draft_tokens for o in outputs]
    assert drafts[0] > 0 and drafts[1] > 0 and drafts[4] > 0
    assert drafts[3] == 0
    got, want = outputs[1].logprobs, expected[1].logprobs
    assert got is not None and want is not None and len(got) == len(want) == 24
    for mine, theirs in zip(got, want):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    assert_pool_whole(drained(engine))


# --- sampled requests --------------------------------------------------------------------------
@OVERLAP
def test_sampled_requests_run_and_finish(
    tiny_llama_dir: Path, reference: list[list[int]], overlap: bool
) -> None:
    requests = prompts(16)[:6]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=10 + i)
        for i in range(5)
    ] + [GREEDY]  # a greedy row verified in the same batches
    runs = []
    for _ in range(2):
        engine = llm(tiny_llama_dir, overlap)
        outputs = engine.generate(requests, params)
        assert [len(o.token_ids) for o in outputs] == [16] * 5 + [24]
        assert [o.finish_reason for o in outputs] == ["length"] * 6
        assert outputs[5].token_ids == reference[5]
        assert sum(o.stats.spec_draft_tokens for o in outputs[:5]) > 0
        assert_pool_whole(drained(engine))
        runs.append(token_ids(outputs))
    assert runs[0] == runs[1]  # seeded per request: the same tokens again


@OVERLAP
def test_seeded_sampled_tokens_do_not_depend_on_the_drafts_verified(
    stories260k_dir: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """n-gram drafts are kept while the plain sampler's draws match them, and the uniforms past
    a mismatch go back to the request's stream: a seeded request samples the very tokens it
    samples without speculation, whatever drafts the budget (timed on the machine) lets it
    verify. Here the budget verifies every draft, on a trained model that accepts many."""
    requests = STORY_PROMPTS * 2
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=10 + i)
        for i in range(len(requests))
    ]
    without = token_ids(llm(stories260k_dir, overlap, spec=False).generate(requests, params))
    monkeypatch.setattr(DraftBudget, "trim", lambda self, slots, drafts, *rows: drafts)
    engine = llm(stories260k_dir, overlap)
    outputs = engine.generate(requests, params)
    assert token_ids(outputs) == without
    drafted = sum(o.stats.spec_draft_tokens for o in outputs)
    accepted = sum(o.stats.spec_accepted_tokens for o in outputs)
    assert 0 < accepted < drafted  # drafts kept and drafts turned down, uniforms given back
    assert_pool_whole(drained(engine))


# --- the token budget ---------------------------------------------------------------------------
def test_decode_first_token_budget_counts_draft_tokens(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk_size = 16
    config = BatonConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        chunk_size=chunk_size,
        batch_order="decode-first",
        speculative_config=SPEC,
    )
    scheduler = Scheduler(config)
    batches: list[list[tuple[bool, int]]] = []
    launch = scheduler._launch

    def spy(rows: list) -> None:
        batches.append([(row.step.is_prefill, row.step.num_tokens) for row in rows])
        launch(rows)

    monkeypatch.setattr(scheduler, "_launch", spy)
    requests = prompts(16, seed=4)[:6]
    for index, prompt in enumerate(requests):
        scheduler.add_request(str(index), prompt, GREEDY)
    while scheduler.has_unfinished_requests():
        scheduler.step()
    mixed = [
        batch for batch in batches if any(p for p, _ in batch) and any(not p for p, _ in batch)
    ]
    assert any(
        n > 1 for batch in mixed for p, n in batch if not p
    )  # speculative rows with prefills
    assert all(sum(n for _, n in batch) <= chunk_size for batch in mixed)


@OVERLAP
def test_stop_strings_end_where_they_would_without_speculation(
    stories260k_dir: Path, overlap: bool
) -> None:
    """A speculative step may yield tokens past a stop string: text, token ids and finish
    reasons still end at the token that completed it, as without speculation."""
    stories = [
        "Once upon a time there was a little girl. Once upon a time there was a little",
        "Lily and Tom went to the park. Lily and Tom",
    ]
    plain = LLM(str(stories260k_dir), dtype="float32", disable_overlap=not overlap)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    speculating = LLM(
        str(stories260k_dir),
        dtype="float32",
        disable_overlap=not overlap,
        speculative_config=spec,
    )
    for stop in (["park"], ["She loved"], ["and"]):
        params = SamplingParams(temperature=0, max_tokens=80, stop=stop)
        expected = plain.generate(stories, params)
        outputs = speculating.generate(stories, params)
        assert [(o.text, o.token_ids, o.finish_reason) for o in outputs] == [
            (o.text, o.token_ids, o.finish_reason) for o in expected
        ]
    assert speculating.scheduler.aggregate_stats().spec_decode_num_accepted_tokens > 0


def test_accepted_drafts_get_their_logprobs(stories260k_dir: Path) -> None:
    """Log-probabilities (and the top alternatives) of every token, accepted drafts included,
    as without speculation."""
    story = ["Once upon a time there was a little girl. Once upon a time there was a little"]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3)
    expected = LLM(str(stories260k_dir), dtype="float32").generate(story, params)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    engine = LLM(str(stories260k_dir), dtype="float32", speculative_config=spec)
    output = engine.generate(story, params)[0]
    assert output.stats.spec_accepted_tokens > 0
    assert output.token_ids == expected.token_ids
    assert output.logprobs is not None and expected.logprobs is not None
    assert len(output.logprobs) == len(expected.logprobs) == len(expected.token_ids)
    for mine, theirs in zip(output.logprobs, expected.logprobs):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-4)
