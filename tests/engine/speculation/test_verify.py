"""Tests for speculative-decoding verification: target distributions, greedy and sampled rows.

The statistical tests use fixed seeds, so they are deterministic; each compares counts with the
expected distribution by Pearson's chi-square and requires a p-value above ALPHA = 1e-6, so they
would also pass for all but about one seed in a million per check. The alternatives they must
catch (a wrong filter, resampling from p instead of the residual) give p-values below 1e-30.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from helpers.sampling import reference_distribution

from baton.engine.batch.seeded_uniforms import SeededUniforms
from baton.engine.sampling.sampler import Sampler, _draw
from baton.engine.sampling.sampling_plan import SamplingBatch
from baton.engine.speculation.verify import (
    accept_matching,
    keep_matching_draws,
    target_probs,
    verify_sampled,
)
from baton.sampling_params import SamplingParams

ALPHA = 1e-6

# Distinct, shuffled logits (as tests/engine/sampling/test_sampler.py): vocabulary order differs
# from probability order, and no filter threshold below lies within 0.015 of a boundary.
SMALL_LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.0, 0.0, 1.5, -0.5, 0.6])


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df), exactly: the regularised upper gamma function
    Q(df/2, x/2), from Q(1/2, y) = erfc(sqrt(y)) or Q(1, y) = exp(-y) and the recurrence
    Q(a + 1, y) = Q(a, y) + y**a * exp(-y) / Gamma(a + 1). (Matches scipy.stats.chi2.sf.)"""
    y = statistic / 2
    a, q = (1.0, math.exp(-y)) if df % 2 == 0 else (0.5, math.erfc(math.sqrt(y)))
    while a < df / 2:
        q += math.exp(a * math.log(y) - y - math.lgamma(a + 1)) if y > 0 else 0.0
        a += 1
    return q


def chi2_pvalue(tokens: list[int], expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value of `tokens` against `expected` probabilities; a token of zero
    expected probability fails the test outright (filtered tokens must never come out)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew a token of zero probability: {counts.tolist()}"
    predicted = expected.double()[support] * len(tokens)
    statistic = float(((counts[support] - predicted) ** 2 / predicted).sum())
    return chi2_sf(statistic, int(support.sum()) - 1)


def test_chi2_sf_known_values() -> None:
    # Textbook critical values: P(chi2(1) >= 3.841) = P(chi2(4) >= 9.488) = 0.05, and
    # P(chi2(7) >= 24.322) = 0.001.
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(9.488, 4) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(24.322, 7) == pytest.approx(0.001, abs=1e-5)
    assert chi2_sf(0.0, 3) == pytest.approx(1.0)


# ---- target_probs ------------------------------------------------------------------------------


TARGET_CASES = [
    (SamplingParams(temperature=0.7), 8),
    (SamplingParams(top_k=3), 3),
    (SamplingParams(top_p=0.8), 4),
    (SamplingParams(top_k=0, top_p=0.8), 4),  # top_k 0 is off
    (SamplingParams(min_p=0.2), 4),
    (SamplingParams(temperature=1.3, top_k=5, top_p=0.65), 3),
    (SamplingParams(top_p=0.85, min_p=0.2), 3),  # min-p keeps 4, top-p 3 of them
    (SamplingParams(temperature=0.8, top_k=4, min_p=0.25), 3),
    (SamplingParams(temperature=1.2, top_k=20), 8),  # top_k past the vocabulary keeps all
]


@pytest.mark.parametrize(
    ("params", "kept"), TARGET_CASES, ids=[msgspec.json.encode(p).decode() for p, _ in TARGET_CASES]
)
def test_target_probs_is_what_the_sampler_draws(params: SamplingParams, kept: int) -> None:
    torch.manual_seed(1234)
    probs = target_probs(SMALL_LOGITS.unsqueeze(0), params)[0]
    assert probs.dtype == torch.float32
    assert int((probs > 0).sum()) == kept
    assert torch.allclose(probs.double(), reference_distribution(SMALL_LOGITS, params), atol=1e-6)
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
    draws = 20_000
    batch = SamplingBatch.from_params([params] * draws, [None] * draws, "cpu")
    tokens = Sampler().sample(SMALL_LOGITS.repeat(draws, 1), batch).token_ids
    # Zeros exactly where filtered: every kept token is drawn, no filtered one ever is.
    assert set(tokens.tolist()) == set((probs > 0).nonzero().flatten().tolist())
    assert chi2_pvalue(tokens.tolist(), probs) > ALPHA


def test_target_probs_rows_are_independent() -> None:
    logits = torch.stack([SMALL_LOGITS, SMALL_LOGITS.flip(0), SMALL_LOGITS * 3])
    for params in (SamplingParams(top_p=0.8, min_p=0.1), SamplingParams(top_k=4, min_p=0.3)):
        rows = target_probs(logits, params)
        for i in range(3):
            assert torch.equal(rows[i], target_probs(logits[i : i + 1], params)[0])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(top_k=1)])
def test_target_probs_rejects_greedy_params(params: SamplingParams) -> None:
    with pytest.raises(ValueError, match="greedy"):
        target_probs(SMALL_LOGITS.unsqueeze(0), params)


# ---- accept_matching ---------------------------------------------------------------------------


def test_accept_matching() -> None:
    assert accept_matching([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, then bonus
    assert accept_matching([5, 6, 7, 8], [4, 6, 7]) == [5]  # none accepted
    assert accept_matching([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # stops at the first mismatch
    assert accept_matching([5], []) == [5]  # no drafts
    with pytest.raises(ValueError):
        accept_matching([5, 6], [5, 6])


# ---- verify_sampled ----------------------------------------------------------------------------

# Different target distributions at the m + 1 = 4 verified positions (V = 5); every probability is
# >= 0.05 so each chi-square cell below expects at least 5 counts.
P = torch.tensor(
    [
        [0.50, 0.20, 0.15, 0.10, 0.05],
        [0.05, 0.10, 0.25, 0.40, 0.20],
        [0.30, 0.05, 0.05, 0.30, 0.30],
        [0.10, 0.35, 0.20, 0.05, 0.30],
    ]
)
# The draft model's distributions at the 3 draft positions, far from P.
Q = torch.tensor(
    [
        [0.10, 0.40, 0.10, 0.30, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.05, 0.40, 0.05, 0.40, 0.10],
    ]
)
TRIALS = 10_000


def run_trials(
    verify, probs: torch.Tensor, drafts: list[int] | None, draft_probs: torch.Tensor | None
) -> list[list[int]]:
    """TRIALS seeded verifications; drafts None: drawn from `draft_probs` anew for each trial."""
    generator = SeededUniforms(2024, "cpu")
    if drafts is None:
        assert draft_probs is not None
        draft_generator = torch.Generator().manual_seed(7)
        sampled = torch.multinomial(
            draft_probs, TRIALS, replacement=True, generator=draft_generator
        )
        return [verify(probs, row, draft_probs, generator) for row in sampled.T.tolist()]
    return [verify(probs, drafts, draft_probs, generator) for _ in range(TRIALS)]


def check_target_distribution(
    outputs: list[list[int]], probs: torch.Tensor, acceptance: list[float]
) -> int:
    """The token at position k, over the trials that accepted the first k drafts, follows
    probs[k]; the draft at k is accepted with probability acceptance[k] given the ones before.
    Returns how many positions were tested: those reached by >= 400 trials (>= 20 expected
    counts per chi-square cell)."""
    for k in range(probs.shape[0]):
        reached = [out for out in outputs if len(out) > k]
        if len(reached) < 400:
            return k
        pvalue = chi2_pvalue([out[k] for out in reached], probs[k])
        assert pvalue > ALPHA, f"position {k}: p-value {pvalue:.3g} over {len(reached)} trials"
        if k < len(acceptance):
            rate = sum(len(out) > k + 1 for out in reached) / len(reached)
            sigma = math.sqrt(acceptance[k] * (1 - acceptance[k]) / len(reached))
            assert abs(rate - acceptance[k]) < 6 * sigma, (k, rate, acceptance[k])
    return probs.shape[0]


def drawn_verification(
    probs: torch.Tensor, drafts: list[int], draft_probs: None, generator: SeededUniforms
) -> list[int]:
    """Deterministic drafts as the speculator verifies them: the plain draw (one uniform) at
    every position, then `keep_matching_draws`."""
    assert draft_probs is None
    return keep_matching_draws(_draw(probs, generator).tolist(), drafts, generator)


# Drafts, and how many positions enough trials reach to be tested: with p_k(d_k) = 0.5, 0.4,
# 0.3 about 10k, 5k, 2k and 600 trials reach positions 0..3; with 0.05, 0.05, 0.05 about 10k,
# 500 and 25.
@pytest.mark.parametrize(
    ("drafts", "tested"),
    [([0, 3, 0], 4), ([4, 0, 1], 2), ([], 1)],
    ids=["likely-drafts", "unlikely-drafts", "no-drafts"],
)
def test_deterministic_drafts_keep_the_target_distribution(drafts: list[int], tested: int) -> None:
    probs = P[: len(drafts) + 1]
    outputs = run_trials(drawn_verification, probs, drafts, None)
    assert all(out[:-1] == drafts[: len(out) - 1] for out in outputs)
    # One-hot q: draft k is accepted with probability p_k(d_k).
    acceptance = [float(P[k, d]) for k, d in enumerate(drafts)]
    assert check_target_distribution(outputs, probs, acceptance) == tested
    # One uniform per token emitted: each trial's tokens are the plain draws from the stream.
    stream = SeededUniforms(2024, "cpu")
    for out in outputs[:200]:
        assert out == _draw(probs[: len(out)], stream).tolist()


def test_sampled_drafts_keep_the_target_distribution() -> None:
    outputs = run_trials(verify_sampled, P, None, Q)
    # Draft k is accepted with probability sum_x min(p_k(x), q_k(x)): 0.55, 0.75, 0.55.
    # About 10k, 5.5k, 4.1k and 2.3k trials reach positions 0..3.
    acceptance = torch.minimum(P[:3], Q).sum(dim=1).tolist()
    assert check_target_distribution(outputs, P, acceptance) == 4


def resample_from_p(
    probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, generator
) -> list[int]:
    """The common bug: accept as speculative sampling does, but on rejection draw from p_k."""
    q = torch.ones(len(drafts)) if draft_probs is None else draft_probs[range(len(drafts)), drafts]
    uniform = generator.rand((len(drafts),), torch.device("cpu"))
    for k, draft in enumerate(drafts):
        if uniform[k] * q[k] >= probs[k, draft]:
            return [*drafts[:k], int(_draw(probs[k : k + 1], generator)[0])]
    return [*drafts, int(_draw(probs[-1:], generator)[0])]


@pytest.mark.parametrize("sampled_drafts", [False, True], ids=["deterministic", "draft-model"])
def test_the_check_catches_resampling_from_p(sampled_drafts: bool) -> None:
    # Resampling from p outputs x at position 0 with probability min(p, q)(x) + (1 - beta) p(x),
    # beta = sum min(p, q). Deterministic d_0 = 0 (p = 0.5): [0.75, 0.1, 0.075, 0.05, 0.025]
    # against p_0 = [0.5, 0.2, 0.15, 0.1, 0.05], chi-square distance sum (r - p)^2 / p = 0.25;
    # draft model Q[0]: [0.325, 0.29, 0.1675, 0.145, 0.0725], distance 0.134. Over 10k trials the
    # expected statistic is ~2500 or ~1340 with 4 degrees of freedom: p-value far below 1e-100.
    # The same seeds and drafts through the real verifications pass: the tests above.
    drafts, draft_probs = (None, Q) if sampled_drafts else ([0, 3, 0], None)
    outputs = run_trials(resample_from_p, P, drafts, draft_probs)
    assert chi2_pvalue([out[0] for out in outputs], P[0]) < 1e-30
    with pytest.raises(AssertionError, match="position 0"):
        check_target_distribution(outputs, P, [])


def test_seeded_verification_is_reproducible() -> None:
    def run(generator: SeededUniforms | None) -> list[list[int]]:
        return [verify_sampled(P, [1, 2, 3], Q, generator) for _ in range(50)]

    assert run(SeededUniforms(3, "cpu")) == run(SeededUniforms(3, "cpu"))
    torch.manual_seed(3)
    unseeded = run(None)
    torch.manual_seed(3)
    assert run(None) == unseeded


def test_no_drafts_with_an_empty_draft_distribution() -> None:
    generator = SeededUniforms(0, "cpu")
    out = verify_sampled(P[:1], [], torch.empty(0, 5), generator)
    assert len(out) == 1 and 0 <= out[0] < 5


def test_rejecting_a_token_the_filters_removed() -> None:
    # A filtered token (p = 0) is never accepted, and the residual never yields it.
    probs = target_probs(SMALL_LOGITS.repeat(2, 1), SamplingParams(top_k=3))
    filtered = int(SMALL_LOGITS.argmin())
    generator = SeededUniforms(0, "cpu")
    uniform_q = torch.full((1, probs.shape[1]), 1.0 / probs.shape[1])
    for _ in range(200):
        out = verify_sampled(probs, [filtered], uniform_q, generator)
        assert len(out) == 1 and probs[0, out[0]] > 0
        out = drawn_verification(probs, [filtered], None, generator)
        assert len(out) == 1 and probs[0, out[0]] > 0


def test_empty_residual_falls_back_to_p() -> None:
    # Rounding can leave p <= q everywhere while p(d) < q(d) rejects the draft: the residual
    # max(0, p - q) then holds no mass. Simulated at scale with p summing to 0.5.
    probs = torch.tensor([[0.25, 0.25, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    generator = SeededUniforms(0, "cpu")
    rejected = 0
    for _ in range(200):
        out = verify_sampled(probs, [0], draft_probs, generator)
        rejected += len(out) == 1
        assert out[0] in (0, 1)  # the fallback draws from p_0, never a zero-probability token
    assert 50 < rejected < 150  # p/q = 0.5: about half the drafts went through the fallback


def test_nan_probabilities_raise() -> None:
    nan_logits = SMALL_LOGITS.clone()
    nan_logits[3] = float("nan")
    probs = target_probs(torch.stack([SMALL_LOGITS, nan_logits]), SamplingParams(top_p=0.9))
    assert not probs[0].isnan().any()
    generator = SeededUniforms(0, "cpu")
    with pytest.raises(ValueError, match="NaN"):
        verify_sampled(probs, [1], torch.full((1, 8), 0.125), generator)
    bad_q = torch.full((1, 8), float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        verify_sampled(probs[[0, 0]], [1], bad_q, generator)


def test_malformed_inputs_raise() -> None:
    with pytest.raises(ValueError):
        verify_sampled(P, [1, 2], Q[:2], None)  # 2 drafts need 3 rows
    with pytest.raises(ValueError):
        verify_sampled(P, [1, 2, 3], Q[:2], None)
    with pytest.raises(ValueError):
        verify_sampled(P, [1, 2, 5], Q, None)  # outside the vocabulary
