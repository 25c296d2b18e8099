"""Penalties and logit bias against a plain per-token reference of vLLM's rules."""

from __future__ import annotations

import pytest
import torch

from baton.engine.forward_batch import TokenHistory
from baton.engine.logit_adjustments import LogitAdjustments
from baton.engine.sampler import Sampler, SamplingBatch
from baton.sampling_params import SamplingParams

VOCAB = 12


def reference(logits: list[float], params: SamplingParams, history: TokenHistory) -> list[float]:
    """vLLM's order, one token at a time: bias, repetition (prompt and output), then frequency
    and presence (output only)."""
    outputs = history.tokens[history.prompt_len :]
    adjusted = []
    for token, logit in enumerate(logits):
        logit += (params.logit_bias or {}).get(token, 0.0)
        if token in history.tokens:
            penalty = params.repetition_penalty
            logit = logit / penalty if logit > 0 else logit * penalty
        count = outputs.count(token)
        logit -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        adjusted.append(logit)
    return adjusted


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(frequency_penalty=0.6),
    SamplingParams(presence_penalty=-1.2),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(
        repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.1, logit_bias={0: 2.5}
    ),
]


@pytest.mark.parametrize(
    "params", CASES, ids=["repetition", "frequency", "presence", "bias", "all"]
)
def test_each_adjustment_follows_the_reference(params: SamplingParams) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator) * 3
    original = logits.clone()
    history = TokenHistory([1, 3, 3, 5, 2, 2, 2, 9], prompt_len=4)  # outputs: 2 (x3), 9
    plain = SamplingParams()
    adjustments = LogitAdjustments.build([plain, params, plain], [None, history, None], "cpu")
    assert adjustments is not None
    adjusted = adjustments.apply_(logits)
    assert adjusted is logits  # in place: the sampler copies first when logprobs are asked
    assert torch.equal(adjusted[0], original[0]) and torch.equal(adjusted[2], original[2])
    expected = reference(original[1].tolist(), params, history)
    assert adjusted[1].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_rows_without_a_history_build_nothing() -> None:
    assert LogitAdjustments.build([SamplingParams()] * 2, [None, None], "cpu") is None


def test_a_history_of_only_the_prompt_has_no_output_penalty() -> None:
    """Before the first output token only the repetition penalty (over the prompt) acts."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=1.0)
    history = TokenHistory([1, 2], prompt_len=2)
    adjustments = LogitAdjustments.build([params], [history], "cpu")
    assert adjustments is not None
    logits = adjustments.apply_(torch.tensor([[1.0, 4.0, -3.0, 5.0]]))
    assert logits.tolist() == [[1.0, 2.0, -6.0, 5.0]]


def test_greedy_takes_the_adjusted_argmax_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([[0.0, 4.0, 3.0, 1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1)
    history = TokenHistory([1], prompt_len=1)  # token 1 seen: 4.0 / 2 falls below token 2
    batch = SamplingBatch.from_params([params], [None], "cpu", [history])
    output = Sampler().sample(logits, batch)
    assert logits.tolist() == [[0.0, 4.0, 3.0, 1.0]]  # copied before adjusting: logprobs asked
    assert output.token_ids.tolist() == [2]
    raw = torch.log_softmax(logits, dim=-1)
    assert output.logprobs is not None and output.top_logprob_ids is not None
    assert output.logprobs.tolist() == pytest.approx([raw[0, 2].item()])
    assert output.top_logprob_ids.tolist() == [[1]]  # the raw distribution's best
