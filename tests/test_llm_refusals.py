"""The offline LLM's refusals: a batch it refuses leaves no request queued, and it serves on."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.validation import RequestError

FITS = "fine"
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The built-in model, with room for two waiting requests (so batches overflow the queue)."""
    return LLM(RANDOM_MODEL_NAME, max_waiting_requests=2)


@pytest.mark.parametrize(
    ("prompts", "params", "priority", "refusal"),
    [
        ([FITS, [10**9]], SHORT, None, "outside the vocabulary"),
        ([FITS, FITS], [SHORT, SamplingParams(temperature=-1)], None, "temperature"),
        ([FITS, FITS], SHORT, [0, 1], "Got priority 1 but Priority scheduling is not enabled."),
    ],
)
def test_a_refused_prompt_queues_none_of_its_batch(
    llm: LLM, prompts: list, params: object, priority: list[int] | None, refusal: str
) -> None:
    """Once each prompt was validated as it was queued: the ones before a refused prompt stayed
    in the scheduler, computed for nobody."""
    with pytest.raises(RequestError, match=refusal):
        llm.generate(prompts, params, priority=priority)  # type: ignore[arg-type]
    assert_nothing_queued(llm)
    assert len(llm.generate(FITS, SHORT)[0].token_ids) == 2


def test_more_prompts_than_the_waiting_queue_holds_all_run(llm: LLM) -> None:
    """vLLM's LLM takes any number of prompts: past `max_waiting_requests` (2 here) they join
    the scheduler as it admits the earlier ones, outputs in prompt order."""
    prompts = [[5 + i, 9, 13 + i] for i in range(7)]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    together = llm.generate(prompts, greedy)
    alone = [llm.generate(prompt, greedy)[0] for prompt in prompts]
    assert [o.prompt_token_ids for o in together] == prompts
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert_nothing_queued(llm)


def test_more_prompts_than_one_clients_share_of_the_queue_all_run() -> None:
    """The LLM is one client: past `max_queued_requests_per_client` (2 here), fewer than
    `max_waiting_requests`, its prompts join as the scheduler admits the earlier ones too."""
    llm = LLM(RANDOM_MODEL_NAME, max_queued_requests_per_client=2)
    outputs = llm.generate([[5 + i, 9, 13 + i] for i in range(5)], SHORT)
    assert [len(output.token_ids) for output in outputs] == [2] * 5
    assert_nothing_queued(llm)


def test_a_request_the_server_can_never_run_queues_none_of_its_batch() -> None:
    """Penalties under speculative decoding: the scheduler's own refusal, made before the
    batch's first request is queued."""
    llm = LLM(
        RANDOM_MODEL_NAME,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(RequestError, match="speculative"):
        llm.generate([FITS, FITS], [SHORT, SamplingParams(max_tokens=2, presence_penalty=1.0)])
    assert_nothing_queued(llm)
    assert len(llm.generate(FITS, SHORT)[0].token_ids) == 2


def assert_nothing_queued(llm: LLM) -> None:
    """The scheduler holds no request: none waiting, none running."""
    scheduler = llm.scheduler
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running


@pytest.mark.parametrize(
    "ranks", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"data_parallel_size": 2}]
)
def test_several_ranks_or_replicas_are_refused_before_loading(ranks: dict[str, int]) -> None:
    """One engine runs in the LLM's process: anything more needs the launcher, said at once
    rather than served by one engine as if the flag were not there."""
    with pytest.raises(ValueError, match="need `baton launch`"):
        LLM(RANDOM_MODEL_NAME, **ranks)
