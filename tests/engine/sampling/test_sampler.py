"""Tests for the per-request sampler: greedy, filtered distributions, seeds and logprobs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from helpers.sampling import FILTER_CASES, SMALL_LOGITS, reference_distribution

from baton.engine.batch.seeded_uniforms import SeededUniforms, seeded_uniforms
from baton.engine.sampling.argmax import greedy_argmax
from baton.engine.sampling.sampler import Sampler
from baton.engine.sampling.sampling_plan import SamplingBatch
from baton.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _fixed_global_seed() -> None:
    torch.manual_seed(1234)


def make_batch(params: list[SamplingParams]) -> SamplingBatch:
    """A batch whose generators come from each request's seed, as the engine builds it."""
    generators = [seeded_uniforms(p.seed, "cpu") for p in params]
    return SamplingBatch.from_params(params, generators, "cpu")


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each token id was drawn, as a fraction of all draws."""
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


def describe(params: SamplingParams) -> str:
    """A short test id: the fields that differ from their defaults."""
    return msgspec.json.encode(params).decode()


@pytest.mark.parametrize("params", FILTER_CASES, ids=describe)
def test_unseeded_frequencies_match_filtered_distribution(params: SamplingParams) -> None:
    draws = 20_000
    logits = SMALL_LOGITS.repeat(draws, 1)
    tokens = Sampler().sample(logits, make_batch([params] * draws)).token_ids
    expected = reference_distribution(SMALL_LOGITS, params)
    assert tokens[expected[tokens] == 0].numel() == 0, "drew a token the filters remove"
    assert (frequencies(tokens, 8) - expected).abs().max() < 0.015


@pytest.mark.parametrize("params", FILTER_CASES, ids=describe)
def test_seeded_frequencies_match_filtered_distribution(params: SamplingParams) -> None:
    draws = 3_000
    seeded = [msgspec.structs.replace(params, seed=seed) for seed in range(draws)]
    logits = SMALL_LOGITS.repeat(draws, 1)
    tokens = Sampler().sample(logits, make_batch(seeded)).token_ids
    expected = reference_distribution(SMALL_LOGITS, params)
    assert tokens[expected[tokens] == 0].numel() == 0, "drew a token the filters remove"
    assert (frequencies(tokens, 8) - expected).abs().max() < 0.04


def test_nucleus_prefix_falls_back_to_full_sort_per_row() -> None:
    # With a 3-token prefix (mass 0.74) top_p=0.5 fits in it while top_p=0.85 overflows.
    draws = 10_000
    fits, overflows = SamplingParams(top_p=0.5), SamplingParams(top_p=0.85)
    params = [fits, overflows] * draws
    logits = SMALL_LOGITS.repeat(2 * draws, 1)
    tokens = Sampler(nucleus_prefix=3).sample(logits, make_batch(params)).token_ids
    for row_params, row_tokens in ((fits, tokens[0::2]), (overflows, tokens[1::2])):
        expected = reference_distribution(SMALL_LOGITS, row_params)
        assert row_tokens[expected[row_tokens] == 0].numel() == 0
        assert (frequencies(row_tokens, 8) - expected).abs().max() < 0.02


def test_filtered_tokens_never_drawn_on_large_vocab() -> None:
    vocab, rows = 2_000, 48
    logits = torch.randn(rows, vocab) * 4
    choices = [
        SamplingParams(top_k=20),
        SamplingParams(top_p=0.5),
        SamplingParams(top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.5, top_k=50, top_p=0.8),
        SamplingParams(min_p=0.1),
        SamplingParams(top_p=0.6, seed=7),
    ]
    params = [choices[i % len(choices)] for i in range(rows)]
    batch = make_batch(params)
    sampler = Sampler(nucleus_prefix=32)
    allowed = [reference_distribution(logits[i], params[i]) > 0 for i in range(rows)]
    for _ in range(5):
        tokens = sampler.sample(logits, batch).token_ids
        for i in range(rows):
            assert allowed[i][tokens[i]], f"row {i} ({params[i]}) drew filtered token {tokens[i]}"


@pytest.mark.parametrize("vocab", [32000, 151936, 64 * 7, 300, 1])
def test_greedy_argmax_equals_torch_argmax_ties_included(vocab: int) -> None:
    # Small integers make ties within and across blocks common; argmax takes the first maximum.
    logits = torch.randint(-3, 4, (24, vocab)).float()
    logits[0] = 0.0  # every token ties
    logits[1, :-1] = -1.0  # the maximum in the very last block
    logits[2] = float("-inf")
    logits[2, vocab // 2] = 0.5
    logits[3] = torch.randn(vocab)
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_greedy_variants_equal_argmax() -> None:
    logits = torch.randn(5, 300)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.3),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=0.0, min_p=0.5),
    ]
    batch = make_batch(params)
    assert batch.all_greedy
    assert torch.equal(Sampler().sample(logits, batch).token_ids, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_exact_and_logits_untouched() -> None:
    logits = torch.randn(8, 500)
    original = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,
        SamplingParams(top_k=10),
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.8, seed=5),
        greedy,
        SamplingParams(temperature=1.5),
        SamplingParams(min_p=0.2),
        greedy,
    ]
    greedy_rows = [0, 2, 4, 7]
    batch = make_batch(params)
    for _ in range(5):
        tokens = Sampler().sample(logits, batch).token_ids
        assert torch.equal(tokens[greedy_rows], logits[greedy_rows].argmax(dim=-1))
    assert torch.equal(logits, original)


def seeded_tokens(
    target: SamplingParams,
    position: int,
    neighbours: list[SamplingParams],
    steps: list[torch.Tensor],
) -> list[int]:
    """The target row's tokens over `steps` when placed at `position` among `neighbours`."""
    params = [*neighbours[:position], target, *neighbours[position:]]
    batch = make_batch(params)
    sampler = Sampler(nucleus_prefix=16)
    tokens = []
    for step_logits in steps:
        logits = torch.randn(len(params), step_logits.numel()) * 3
        logits[position] = step_logits
        tokens.append(int(sampler.sample(logits, batch).token_ids[position]))
    return tokens


TARGETS = [
    SamplingParams(temperature=0.9, seed=42),
    SamplingParams(top_k=30, top_p=0.95, seed=42),
    SamplingParams(top_p=0.4, seed=42),  # always inside the 16-token nucleus prefix
    SamplingParams(top_p=0.97, seed=42),  # always needs the full sort
    SamplingParams(min_p=0.01, temperature=1.2, seed=42),
]


@pytest.mark.parametrize("target", TARGETS, ids=describe)
def test_seeded_row_is_independent_of_its_batch(target: SamplingParams) -> None:
    steps = [torch.randn(400) * 2 for _ in range(8)]
    neighbours = [
        SamplingParams(top_k=5),
        SamplingParams(top_k=100, top_p=0.5, seed=1),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, seed=target.seed),
        SamplingParams(min_p=0.3),
    ]
    alone = seeded_tokens(target, 0, [], steps)
    assert len(set(alone)) > 1, "steps too peaked to tell sequences apart"
    assert seeded_tokens(target, 0, neighbours, steps) == alone
    assert seeded_tokens(target, 3, neighbours, steps) == alone
    assert seeded_tokens(target, 6, neighbours[::-1], steps) == alone
    other_seed = msgspec.structs.replace(target, seed=43)
    assert seeded_tokens(other_seed, 2, neighbours, steps) != alone


def test_greedy_rows_leave_their_generator_untouched() -> None:
    generator = seeded_uniforms(9, "cpu")
    params = [SamplingParams(temperature=0.0, seed=9), SamplingParams(top_p=0.5)]
    batch = SamplingBatch.from_params(params, [generator, None], "cpu")
    Sampler().sample(torch.randn(2, 50), batch)
    assert generator.take(3) == SeededUniforms(9, "cpu").take(3)  # no draw was taken


def test_logprobs_come_from_raw_distribution() -> None:
    logits = torch.randn(5, 200) * 2
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=3),
        SamplingParams(logprobs=0),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=2.0, logprobs=1, seed=4),
    ]
    out = Sampler().sample(logits, make_batch(params))
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_logprob_ids is not None and out.top_logprob_ids.shape == (5, 5)
    for row, n in ((0, 3), (1, 0), (3, 5), (4, 1)):
        chosen = reference[row, out.token_ids[row]].item()
        assert math.isclose(out.logprobs[row].item(), chosen, abs_tol=1e-5)
        values, ids = reference[row].topk(n)
        assert torch.equal(out.top_logprob_ids[row, :n], ids)
        assert torch.allclose(out.top_logprobs[row, :n].double(), values, atol=1e-5)
    assert math.isnan(out.logprobs[2].item())
    assert (out.top_logprob_ids[2] == -1).all()


def test_logprobs_absent_or_empty() -> None:
    logits = torch.randn(3, 40)
    none_asked = Sampler().sample(logits, make_batch([SamplingParams()] * 3))
    assert none_asked.logprobs is None and none_asked.top_logprobs is None
    only_chosen = Sampler().sample(logits, make_batch([SamplingParams(logprobs=0)] * 3))
    assert only_chosen.top_logprob_ids is not None and only_chosen.top_logprob_ids.shape == (3, 0)
    assert only_chosen.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1).gather(1, only_chosen.token_ids.unsqueeze(1))
    assert torch.allclose(only_chosen.logprobs, expected.squeeze(1))


def test_from_params_rejects_mismatched_generators() -> None:
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.from_params([SamplingParams()], [], "cpu")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=0.7, min_p=0.1, seed=5),
    ],
    ids=["plain", "top_k", "top_p", "min_p_seeded"],
)
def test_a_nan_row_fails_alone(params: SamplingParams) -> None:
    """NaN probabilities once drew an id past the vocabulary and failed the whole batch."""
    logits = SMALL_LOGITS.repeat(3, 1)
    logits[1] = float("nan")
    rows = [SamplingParams(temperature=0), params, SamplingParams(temperature=0, logprobs=2)]
    generators = [None, seeded_uniforms(params.seed, "cpu"), None]
    out = Sampler().sample(logits, SamplingBatch.from_params(rows, generators, "cpu"))
    assert out.failed.tolist() == [False, True, False]
    assert out.token_ids.tolist() == [1, 0, 1]  # the failed row's id is made valid
    assert out.logprobs is not None and math.isfinite(float(out.logprobs[2]))
