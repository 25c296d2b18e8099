"""The offline LLM's refusals: a batch it refuses leaves no request queued, and it serves on."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.validation import OverloadedError, RequestError

FITS = "fine"
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The built-in model, with room for two waiting requests (to reach a full queue)."""
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


def test_a_batch_the_scheduler_refuses_is_aborted(llm: LLM) -> None:
    """A full queue refuses the third prompt: the two queued before it are aborted, as vLLM's
    LLM aborts what it added."""
    with pytest.raises(OverloadedError):
        llm.generate([FITS] * 3, SHORT)
    assert_nothing_queued(llm)
    assert [len(o.token_ids) for o in llm.generate([FITS] * 2, SHORT)] == [2, 2]


def assert_nothing_queued(llm: LLM) -> None:
    """The scheduler holds no request: none waiting, none running."""
    scheduler = llm.scheduler
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
