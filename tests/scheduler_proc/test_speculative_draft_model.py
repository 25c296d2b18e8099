"""Speculative decoding with a draft model, end to end: greedy output unchanged (a draft that
agrees with the target, and one that does not), and sampled output keeping the target's
distribution through rejection sampling with the draft's own probabilities."""

from __future__ import annotations

import math
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.engine.batch.seeded_uniforms import uniforms
from baton.engine.sampling.sampler import _draw
from baton.engine.speculation import speculator

OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])


def spec(draft: Path, k: int = 3) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(rng.randint(8, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def other_draft(tiny_model_factory) -> Path:
    """A tiny Llama with other weights: its drafts are mostly rejected."""
    return tiny_model_factory("llama", seed=1)


@pytest.fixture(scope="module")
def nearby_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with noise on every weight: a draft distribution close to the target's
    but not equal, so drafts are accepted, rejected and resampled from the residual."""
    directory = tmp_path_factory.mktemp("nearby_draft")
    for path in tiny_llama_dir.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, directory / path.name)
    weights = load_file(tiny_llama_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    noisy = {
        name: weight + 0.3 * weight.float().std() * torch.randn(weight.shape, generator=generator)
        if weight.numel() > 1
        else weight
        for name, weight in weights.items()
    }
    save_file({name: weight.to(weights[name].dtype) for name, weight in noisy.items()},
              directory / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return directory


@OVERLAP
@pytest.mark.parametrize("draft_kind", ["same", "other"])
def test_greedy_output_unchanged(
    tiny_llama_dir: Path, other_draft: Path, overlap: bool, draft_kind: str
) -> None:
    """Chunked prefill (chunks of 16), a shared prefix and preemption (a small pool) in the mix."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # Two rounds: the second's prompt shares 30 tokens with one of the first's.
    rounds = [[*prompts(6), [3] * 30 + [4, 5]], [[3] * 30 + [6, 7]]]
    config = {"dtype": "float32", "chunk_size": 16, "page_size": 4, "num_pages": 40}
    config["max_model_len"] = 80
    plain = LLM(str(tiny_llama_dir), disable_overlap=True, **config)
    draft = tiny_llama_dir if draft_kind == "same" else other_draft
    engine = LLM(
        str(tiny_llama_dir), disable_overlap=not overlap, speculative_config=spec(draft), **config
    )
    outputs = []
    for batch in rounds:
        reference = plain.generate(batch, params)
        outputs += engine.generate(batch, params)
        assert [o.token_ids for o in outputs[-len(batch) :]] == [o.token_ids for o in reference]
    stats = [o.stats for o in outputs]
    drafted = sum(s.spec_draft_tokens for s in stats)
    accepted = sum(s.spec_accepted_tokens for s in stats)
    assert drafted > 0
    if draft_kind == "same":  # the target drafting for itself: every draft is its own argmax
        assert accepted == drafted
    else:
        assert accepted < drafted
    assert sum(s.preemptions for s in stats) > 0
    assert sum(s.cached_tokens for s in stats) > 0


def second_tokens(engine: LLM, prompt: list[int], num: int) -> Counter[int]:
    """The second output token of `num` seeded samples (top-k 4, so few values are possible):
    with max_tokens 3 it comes from a speculative step with one draft, accepted or resampled."""
    params = [
        SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=seed)
        for seed in range(num)
    ]
    return Counter(output.token_ids[1] for output in engine.generate([prompt] * num, params))


def two_sample_chi2(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """The two-sample chi-square statistic over the values seen (rare ones pooled), and its
    degrees of freedom."""
    stat, bins, rare_a, rare_b = 0.0, 0, 0, 0
    for value in set(a) | set(b):
        if a[value] + b[value] < 20:
            rare_a, rare_b = rare_a + a[value], rare_b + b[value]
            continue
        stat += (a[value] - b[value]) ** 2 / (a[value] + b[value])
        bins += 1
    if rare_a + rare_b:
        stat += (rare_a - rare_b) ** 2 / (rare_a + rare_b)
        bins += 1
    return stat, bins - 1


def far_beyond_chance(stat: float, dof: int) -> bool:
    """Past the mean by 6 standard deviations (for these degrees of freedom, a chance of well
    under 1e-6 when the distributions are equal)."""
    return stat > dof + 6 * math.sqrt(2 * dof)


def buggy_verify_sampled(probs, drafts, draft_probs, generator):
    """Rejection sampling with the classic bug: a rejected draft is replaced by a draw from p,
    not from the residual max(0, p - q)."""
    for index, token in enumerate(drafts):
        p, q = float(probs[index, token]), float(draft_probs[index, token])
        if uniforms(generator, (1,), probs.device).item() * q >= p:
            return [*drafts[:index], int(_draw(probs[index : index + 1], generator)[0])]
    return [*drafts, int(_draw(probs[len(drafts) :], generator)[0])]


def test_sampled_output_keeps_the_target_distribution(
    tiny_llama_dir: Path, nearby_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4,000 seeded samples with a nearby model drafting against 4,000 without speculation:
    the second token's distribution is the same; and the test has the power to see the bug
    of resampling from p (its statistic lands far past the bound)."""
    prompt = prompts(1)[0]
    num = 4000
    # Without speculation the batch may be wide; with it, 16 rows and their drafts stay within
    # the native step's row cap, so every row gets its draft.
    plain = second_tokens(LLM(str(tiny_llama_dir), dtype="float32"), prompt, num)
    speculating = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_running_requests=16,
        speculative_config=spec(nearby_draft, k=1),
    )
    drafted = second_tokens(speculating, prompt, num)
    totals = speculating.scheduler.aggregate_stats()
    assert totals.spec_decode_num_draft_tokens > num // 2  # most second tokens were verified
    assert 0 < totals.spec_decode_num_accepted_tokens < totals.spec_decode_num_draft_tokens
    stat, dof = two_sample_chi2(plain, drafted)
    assert dof >= 3 and not far_beyond_chance(stat, dof), (stat, dof, plain, drafted)
    monkeypatch.setattr(speculator, "verify_sampled", buggy_verify_sampled)
    buggy = second_tokens(speculating, prompt, num)
    stat, dof = two_sample_chi2(plain, buggy)
    assert far_beyond_chance(stat, dof), (stat, dof, plain, buggy)
