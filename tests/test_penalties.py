"""Penalties, logit bias, allowed tokens and bad words end to end: greedy tokens against
transformers' logits with the penalties applied by transformers' own repetition processor and
vLLM's frequency, presence, allowed-token and bad-word rules, through the overlap loop's
placeholders, preemption and the native decode step."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.scheduler_proc.scheduler import Scheduler
from baton.validation import RequestError
from tests.helpers.decode_steps import CountingStep
from tests.helpers.hf_reference import hf_logits

MAX_TOKENS = 20
# float32 rounding may break a near-tie either way; a real bug moves logits far more.
TOLERANCE = 1e-3


def greedy(**adjustments: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **adjustments)


PARAMS = [
    greedy(repetition_penalty=1.6),
    greedy(frequency_penalty=1.5, presence_penalty=0.5),
    greedy(),
    greedy(repetition_penalty=1.3, logit_bias={7: 3.0, 11: -100.0}),
    greedy(presence_penalty=-2.0),
    greedy(allowed_token_ids=[5, 9, 17, 33, 36]),
    greedy(bad_words=["!", "#$"], frequency_penalty=0.5),
]
# The byte tokenizer spells a bad word with its bytes' ids (no space variant is as short).
BAD_WORD_TOKENS = {"!": [(33,)], "#$": [(35, 36)]}


def penalized(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[int]
) -> torch.Tensor:
    """The reference: bias, transformers' repetition penalty over prompt and outputs, then
    frequency and presence over the outputs."""
    scores = logits.clone().unsqueeze(0)
    for token_id, bias in (params.logit_bias or {}).items():
        scores[0, token_id] += bias
    if params.repetition_penalty != 1.0:
        processor = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        scores = processor(torch.tensor([prompt + outputs]), scores)
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=scores.shape[1])
    scores[0] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.allowed_token_ids is not None:
        allowed = torch.full_like(scores[0], float("-inf"))
        allowed[params.allowed_token_ids] = 0.0
        scores[0] += allowed
    for word in params.bad_words or ():
        for *prefix, last in BAD_WORD_TOKENS[word]:
            if not prefix or outputs[-len(prefix) :] == prefix:
                scores[0, last] = float("-inf")
    return scores[0]


def assert_penalized_greedy(
    model_dir: Path, prompt: list[int], generated: list[int], params: SamplingParams
) -> None:
    """Teacher-forced: each generated token is the reference's argmax given the ones before."""
    logits = hf_logits(model_dir, prompt + generated[:-1])[len(prompt) - 1 :]
    for step, token in enumerate(generated):
        scores = penalized(logits[step], params, prompt, generated[:step])
        best = int(scores.argmax())
        assert token == best or scores[best] - scores[token] < TOLERANCE, (
            f"step {step}: generated {token}, reference {best} "
            f"({scores[token].item():.5f} vs {scores[best].item():.5f})"
        )


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(11)
    # Few distinct ids, so prompts repeat tokens and the penalties have something to act on.
    return [[rng.randrange(3, 40) for _ in range(rng.randrange(6, 30))] for _ in range(count)]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"disable_overlap": True},
        {"enforce_eager": True},
        {"page_size": 4, "num_pages": 24, "max_model_len": 56},
    ],
    ids=["overlap", "plain", "eager", "preempting"],
)
def test_penalized_greedy_matches_transformers(tiny_llama_dir: Path, config: dict) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", **config)
    batch = prompts(len(PARAMS))
    outputs = llm.generate(batch, PARAMS)
    if "num_pages" in config:
        assert llm.scheduler.aggregate_stats().preemptions > 0
    for prompt, output, p in zip(batch, outputs, PARAMS, strict=True):
        assert len(output.token_ids) == MAX_TOKENS
        assert_penalized_greedy(tiny_llama_dir, prompt, output.token_ids, p)


def test_adjusted_greedy_in_the_native_step_matches_transformers(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Every adjustment keeps the native decode step, which applies it before its argmax (a
    model with compact weights: bf16 stored, float32 computed)."""
    model_dir = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="float32")
    if llm.engine.decode_step is None:
        pytest.skip("no native decode step on this machine (it needs AVX2 and a C compiler)")
    counting = llm.engine.decode_step = CountingStep(llm.engine.decode_step)
    batch = prompts(len(PARAMS))
    outputs = llm.generate(batch, PARAMS)
    assert counting.chosen == MAX_TOKENS - 1  # every decode step chose its tokens natively
    for prompt, output, p in zip(batch, outputs, PARAMS, strict=True):
        assert_penalized_greedy(model_dir, prompt, output.token_ids, p)


def test_penalties_change_the_output(tiny_llama_dir: Path) -> None:
    """The check above could pass with penalties ignored if they never changed a token."""
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    prompt = prompts(1)[0]
    plain = llm.generate(prompt, greedy())[0].token_ids
    for changed in (
        greedy(repetition_penalty=1.6),
        greedy(frequency_penalty=1.5),
        greedy(presence_penalty=2.0),
        greedy(logit_bias={7: 100.0}),
        greedy(allowed_token_ids=[5, 9]),
        greedy(bad_words=[_two_byte_character(plain)]),
    ):
        assert llm.generate(prompt, changed)[0].token_ids != plain, changed


def _two_byte_character(tokens: list[int]) -> str:
    """A character whose UTF-8 bytes follow each other in `tokens` (the byte tokenizer's ids):
    as a bad word, it bans its second byte after its first."""
    for first, second in itertools.pairwise(tokens):
        if 0xC2 <= first <= 0xDF and 0x80 <= second <= 0xBF:
            return bytes([first, second]).decode()
    raise AssertionError(f"no two-byte character in {tokens}")


def test_speculative_decoding_refuses_penalties_with_a_typed_error(tiny_llama_dir: Path) -> None:
    config = BatonConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    scheduler = Scheduler(config)
    with pytest.raises(RequestError, match="speculative"):
        scheduler.add_request("biased", [5, 6, 7], greedy(logit_bias={3: 1.0}))
    scheduler.add_request("plain", [5, 6, 7], greedy())
    assert list(scheduler.requests) == ["plain"]
    scheduler.shutdown()
