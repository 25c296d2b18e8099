"""`SamplingParams.prompt_logprobs`, as vLLM's: each prompt token's log-probability given the
tokens before it, and the top-n there, equal to transformers' float32 log-softmax at every
position, through chunked prefill, the overlap and plain loops, the native decode step (a
one-token chunk beside decodes), the prefix cache and preemption."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.engine.sampling.torch_rows import SCORING_SLICE_ROWS
from baton.sampling_params import InvalidSamplingParam
from baton.scheduler_proc.scheduler import Scheduler
from baton.validation import RequestError
from tests.helpers.hf_reference import hf_logits

TOLERANCE = 1e-4
NUM_TOP = 3


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 60) for _ in range(rng.randrange(2, 40))] for _ in range(count)]


def scored(num_top: int = NUM_TOP, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=num_top)


def assert_prompt_logprobs_match_transformers(
    model_dir: Path, prompt: list[int], entries: list, num_top: int = NUM_TOP
) -> None:
    """One entry per prompt token after the first: its logprob and the top-n, as transformers'."""
    reference = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row = reference[position]
        expected = float(row[prompt[position + 1]])
        assert entry.logprob == pytest.approx(expected, abs=TOLERANCE), position
        # 1 + the tokens more likely; a near-tie may order either way.
        surer, tied = (
            int((row > expected + TOLERANCE).sum()),
            int(((row - expected).abs() <= TOLERANCE).sum()),
        )
        assert surer + 1 <= entry.rank <= surer + tied, position
        assert len(entry.top) == num_top
        top_values, top_ids = row.topk(num_top)
        assert [value for _, value in entry.top] == pytest.approx(
            top_values.tolist(), abs=TOLERANCE
        )
        # Ids may swap only where their logprobs tie.
        for (token, value), expected_id in zip(entry.top, top_ids.tolist()):
            assert token == expected_id or float(row[token]) == pytest.approx(value, abs=TOLERANCE)


class CountingStep:
    """The engine's native decode step, counting the steps whose logits it hands back (rather
    than only its argmax): those the sampler or the scoring reads."""

    def __init__(self, step: object) -> None:
        self._step = step
        self.logits_steps = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._step, name)

    def __call__(self, *args: object) -> object:
        self.logits_steps += not args[-1]
        return self._step(*args)


@pytest.mark.parametrize(
    "config",
    [
        {"chunk_size": 8},
        {"chunk_size": 8, "disable_overlap": True},
        {"chunk_size": 8, "enforce_eager": True},
        # bf16 weights (compact: the native decode step runs), decodes first and a budget of 2
        # tokens: a prompt is scored one token a step beside another request's decode.
        {"chunk_size": 2, "batch_order": "decode-first"},
        {"page_size": 4, "num_pages": 24, "max_model_len": 56},
    ],
    ids=["chunked-overlap", "chunked-plain", "eager", "native-step", "preempting"],
)
def test_prompt_logprobs_match_transformers(
    tiny_model_factory: Callable[..., Path], config: dict
) -> None:
    native = "batch_order" in config
    model_dir = tiny_model_factory(
        "llama", weights_dtype=torch.bfloat16 if native else torch.float32
    )
    llm = LLM(str(model_dir), dtype="float32", **config)
    if native:
        llm.engine.decode_step = CountingStep(llm.engine.decode_step)
    batch = prompts(6)
    # Every other request scores its prompt: the others' outputs must not change.
    params = [
        scored(max_tokens=8) if i % 2 else SamplingParams(temperature=0, max_tokens=8)
        for i in range(len(batch))
    ]
    outputs = llm.generate(batch, params)
    if native:
        assert llm.engine.decode_step.logits_steps > 0
    if "num_pages" in config:
        assert llm.scheduler.aggregate_stats().preemptions > 0
    plain = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8))
    for i, (prompt, output) in enumerate(zip(batch, outputs, strict=True)):
        assert output.token_ids == plain[i].token_ids
        if i % 2:
            assert_prompt_logprobs_match_transformers(model_dir, prompt, output.prompt_logprobs)
        else:
            assert output.prompt_logprobs is None


def test_a_long_prompt_is_scored_in_slices(tiny_llama_dir: Path) -> None:
    """More scored positions in one chunk than the engine turns into log-probabilities at once
    (SCORING_SLICE_ROWS), and no top-n."""
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    head = llm.engine.model.lm_head
    head_rows: list[int] = []
    head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[0]))
    rng = random.Random(3)
    prompt = [rng.randrange(3, 60) for _ in range(600)]
    output = llm.generate(prompt, scored(num_top=0))[0]
    assert_prompt_logprobs_match_transformers(tiny_llama_dir, prompt, output.prompt_logprobs, 0)
    # The head never saw more scored positions at once than a slice.
    assert max(head_rows) == SCORING_SLICE_ROWS and sum(head_rows) >= len(prompt) - 1


def test_scored_prompts_skip_the_prefix_cache_but_fill_it(tiny_llama_dir: Path) -> None:
    """A cached position gives no logits, so a scored prompt computes all of its positions
    (as vLLM's), and its pages serve later requests."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", page_size=4)
    prompt = prompts(1, seed=9)[0] * 2
    first = llm.generate(prompt, scored())[0]
    second = llm.generate(prompt, scored())[0]
    assert first.stats.cached_tokens == second.stats.cached_tokens == 0
    assert second.prompt_logprobs == first.prompt_logprobs
    unscored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0]
    assert unscored.stats.cached_tokens > 0


def test_a_one_token_prompt_has_nothing_to_score(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    output = llm.generate([7], scored())[0]
    assert output.prompt_logprobs == [] and len(output.token_ids) == 3


def test_prompt_logprobs_range_and_speculation_are_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidSamplingParam, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(InvalidSamplingParam, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()
    config = BatonConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    scheduler = Scheduler(config)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        scheduler.add_request("scored", [5, 6, 7], scored())
    assert not scheduler.requests
    scheduler.shutdown()
