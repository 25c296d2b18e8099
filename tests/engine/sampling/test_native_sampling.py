"""The native step's sampler (native/sampling/sampling.c): the torch sampler's rules, row by row.

With uniforms on an even grid, inverse-CDF sampling draws each token exactly as often as its
filtered probability says (to one draw in the grid's size), so the distribution is checked
without randomness; with the uniform a seeded generator draws, the native sampler picks the
torch sampler's token; and through the engine, a seeded sampled request decodes in the native
step to the eager path's tokens."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.decode_steps import CountingStep
from helpers.sampling import FILTER_CASES, SMALL_LOGITS, reference_distribution

from baton import LLM
from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.engine.batch.forward_batch import ForwardBatch, TokenHistory
from baton.engine.batch.seeded_uniforms import seeded_uniforms
from baton.engine.native.library import NativeKernels
from baton.engine.native.structs import RowSampling
from baton.engine.sampling.grammar_masks import GrammarMasks
from baton.engine.sampling.logit_adjustments import BadWordTokens, LogitAdjustments
from baton.engine.sampling.native_rows import NativeChoice
from baton.engine.sampling.sampler import Sampler
from baton.engine.sampling.sampling_plan import SamplingBatch
from baton.engine.sampling.token_counts import TokenCounts
from baton.sampling_params import SamplingParams

BYTE_BAD_WORDS = BadWordTokens(build_byte_tokenizer(), 300)


def choose(
    batch: ForwardBatch,
    histories: list[TokenHistory] | None = None,
    counts: list[TokenCounts] | None = None,
    vocab_size: int = 300,
) -> NativeChoice:
    return NativeChoice(
        batch, random.Random(0), histories, counts, BYTE_BAD_WORDS, GrammarMasks(), vocab_size
    )


# The torch sampler's cases, and a top-k past the vocabulary (no filter, best first).
CASES = [*FILTER_CASES, SamplingParams(top_k=100)]


def setting(params: SamplingParams, uniform: float) -> RowSampling:
    return RowSampling(params.temperature, params.top_p, params.min_p, uniform, params.top_k)


def describe(params: SamplingParams) -> str:
    return msgspec.json.encode(params).decode()


@pytest.mark.parametrize("params", CASES, ids=describe)
def test_an_even_grid_of_uniforms_draws_the_filtered_distribution(
    native: NativeKernels, params: SamplingParams
) -> None:
    draws = 4000
    logits = SMALL_LOGITS.repeat(draws, 1)
    grid = [setting(params, (j + 0.5) / draws) for j in range(draws)]
    tokens = torch.tensor(native.sample_rows(logits, grid))
    counts = torch.bincount(tokens, minlength=len(SMALL_LOGITS)).double()
    expected = reference_distribution(SMALL_LOGITS, params) * draws
    assert (counts - expected).abs().max() <= 1.0 + 1e-6


@pytest.mark.parametrize("params", CASES, ids=describe)
@pytest.mark.parametrize("vocab", [8, 32000])
def test_the_uniform_a_seeded_generator_draws_picks_the_torch_samplers_token(
    native: NativeKernels, params: SamplingParams, vocab: int
) -> None:
    """At 32000 random logits top_p alone overflows the native sampler's 1024-token prefix and
    sorts the whole vocabulary, as the torch sampler does."""
    generator = torch.Generator().manual_seed(5)
    logits = SMALL_LOGITS if vocab == 8 else torch.randn(vocab, generator=generator) * 2
    seeds = range(200 if vocab == 8 else 20)
    seeded = [msgspec.structs.replace(params, seed=seed) for seed in seeds]
    batch = SamplingBatch.from_params(
        seeded, [seeded_uniforms(p.seed, "cpu") for p in seeded], "cpu"
    )
    want = Sampler().sample(logits.repeat(len(seeded), 1), batch).token_ids.tolist()
    uniforms = [seeded_uniforms(p.seed, "cpu").take(1)[0] for p in seeded]
    got = native.sample_rows(logits.repeat(len(seeded), 1), [setting(params, u) for u in uniforms])
    assert got == want


def test_rows_that_are_no_distribution_fail_alone(native: NativeKernels) -> None:
    logits = torch.stack(
        [
            SMALL_LOGITS,
            torch.full((8,), float("nan")),
            torch.full((8,), float("-inf")),
            torch.tensor([0.0, float("inf"), 0, 0, 0, 0, 0, 0]),
            SMALL_LOGITS,
        ]
    )
    plain = setting(SamplingParams(temperature=0.7), 0.5)
    greedy = RowSampling(0.0, 1.0, 0.0, 0.0, 0)
    tokens = native.sample_rows(logits, [plain, plain, plain, plain, greedy])
    assert tokens[1:4] == [-1, -1, -1]
    assert tokens[0] >= 0 and tokens[4] == int(SMALL_LOGITS.argmax())


def test_sampled_rows_decode_in_the_native_step_as_on_the_eager_path(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Seeded rows of every filter, and greedy and unseeded rows beside them, in one batch:
    every decode step runs natively, and the seeded rows' tokens are the eager path's."""
    model_dir = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    prompts = [[3 + i, 4, 5, 6 + i] for i in range(6)]
    common = {"max_tokens": 8, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.9, seed=3, **common),
        SamplingParams(temperature=1.2, top_k=5, seed=4, **common),
        SamplingParams(top_p=0.8, seed=5, **common),
        SamplingParams(temperature=0.7, min_p=0.1, top_k=40, top_p=0.95, seed=6, **common),
        SamplingParams(temperature=0, **common),
        SamplingParams(temperature=1.0, **common),  # unseeded: any token, still native
    ]
    native = LLM(str(model_dir), dtype="float32")
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    eager = LLM(str(model_dir), dtype="float32", enforce_eager=True)
    got = [output.token_ids for output in native.generate(prompts, params)]
    want = [output.token_ids for output in eager.generate(prompts, params)]
    assert counting.batches == counting.chosen == 7  # every decode step, tokens chosen there
    assert got[:5] == want[:5]
    assert all(len(tokens) == 8 for tokens in got)
    # The same seeds again: the same tokens.
    assert [o.token_ids for o in native.generate(prompts[:4], params[:4])] == got[:4]


PENALTIES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(frequency_penalty=0.6, presence_penalty=0.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.1),
]


@pytest.mark.parametrize("params", PENALTIES, ids=describe)
def test_penalties_change_the_logits_as_the_torch_samplers_do(
    native: NativeKernels, params: SamplingParams
) -> None:
    """In place, before the row's token is chosen."""
    greedy = msgspec.structs.replace(params, temperature=0.0)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)) * 3
    history = TokenHistory([1, 3, 3, 5, 2, 2, 2, 9], prompt_len=4)
    adjustments = LogitAdjustments.build([greedy], [history], "cpu")
    assert adjustments is not None
    want = adjustments.apply_(logits.clone())[0]
    got = logits.clone()
    choice = choose(one_row_batch(greedy, []), [history], [TokenCounts.of(history)], 64)
    tokens = native.sample_rows(got, choice.settings)
    assert torch.equal(got[0], want) and not torch.equal(want, logits[0])
    assert tokens == [int(want.argmax())]


def test_penalized_rows_decode_in_the_native_step_as_on_the_eager_path(
    native: NativeKernels, tiny_model_factory: Callable[..., Path]
) -> None:
    """Greedy and seeded sampled rows with penalties beside a plain one: every decode step
    chooses its tokens natively, and every row's tokens are the eager path's."""
    model_dir = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    # The first two rows share a prompt whose greedy continuation (of this model) the
    # penalties change.
    prompts = [[4, 4, 5, 4, 7], [4, 4, 5, 4, 7], [5, 4, 5, 4, 8], [6, 4, 5, 4, 9], [7, 4, 5, 4]]
    common = {"max_tokens": 12, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, **common),
        SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.0, **common),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=3, **common),
        SamplingParams(top_p=0.8, top_k=20, presence_penalty=-0.5, seed=4, **common),
        SamplingParams(temperature=0, **common),
    ]
    native = LLM(str(model_dir), dtype="float32")
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    eager = LLM(str(model_dir), dtype="float32", enforce_eager=True)
    got = [output.token_ids for output in native.generate(prompts, params)]
    want = [output.token_ids for output in eager.generate(prompts, params)]
    assert counting.batches == counting.chosen == 11
    assert got == want
    plain = native.generate(
        prompts[:2],
        [
            msgspec.structs.replace(
                p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0
            )
            for p in params[:2]
        ],
    )
    assert all(o.token_ids != tokens for o, tokens in zip(plain, got))  # penalties count


def test_settings_go_to_the_batch_rows_that_sample() -> None:
    """A row that samples nothing (a prefill chunk's) may come first: every setting still goes
    to its own batch row, and a plain greedy row takes the argmax."""
    hot = SamplingParams(temperature=0.9, top_k=7, seed=2)
    batch = ForwardBatch(
        input_ids=[5, 6, 7],
        kv_starts=[0, 3, 3],
        q_lens=[1, 1, 1],
        page_tables=[[0], [1], [2]],
        slots=[0, 1, 2],
        sample_rows=[1, 2],
        sampling_params=[hot, SamplingParams(temperature=0)],
        generators=[seeded_uniforms(2, "cpu"), None],
        suppressed_token_ids=[[], []],
    )
    settings = choose(batch).settings
    assert settings is not None and len(settings) == 3
    assert settings[0].temperature == settings[2].temperature == 0.0
    assert (settings[1].temperature, settings[1].top_k) == (pytest.approx(0.9), 7)
    assert settings[1].uniform == pytest.approx(
        float(torch.rand(1, generator=torch.Generator().manual_seed(2)))
    )
    plain = dataclasses.replace(batch, sampling_params=[SamplingParams(temperature=0)] * 2)
    assert choose(plain).settings is None


def one_row_batch(params: SamplingParams, suppressed: list[int]) -> ForwardBatch:
    return ForwardBatch(
        input_ids=[5],
        kv_starts=[8],
        q_lens=[1],
        page_tables=[[0]],
        slots=[0],
        sample_rows=[0],
        sampling_params=[params],
        generators=[seeded_uniforms(params.seed, "cpu")],
        suppressed_token_ids=[suppressed],
    )


ADJUSTED = [
    SamplingParams(temperature=0, logit_bias={3: 4.0, 7: -100.0}, repetition_penalty=1.3),
    SamplingParams(temperature=0, bad_words=["\x09\x05", "\x07"], frequency_penalty=0.5),
    SamplingParams(temperature=0, presence_penalty=0.7, logprobs=5),
    SamplingParams(temperature=0.8, seed=9, logit_bias={2: 1.5}, logprobs=0),
    SamplingParams(temperature=1.1, top_k=6, seed=4, repetition_penalty=1.2, logprobs=3),
    SamplingParams(temperature=0, allowed_token_ids=[2, 6, 9, 11], logit_bias={6: 2.0}),
    SamplingParams(temperature=0.9, seed=5, allowed_token_ids=[0, 4, 7], logprobs=2),
]


@pytest.mark.parametrize("params", ADJUSTED, ids=describe)
@pytest.mark.parametrize("suppressed", [[], [1, 4]], ids=["free", "min_tokens"])
def test_adjusted_rows_and_their_logprobs_are_the_torch_samplers(
    native: NativeKernels, params: SamplingParams, suppressed: list[int]
) -> None:
    """Bias, penalties, bad words and suppressed stop tokens change the logits before the
    choice, as the torch sampler's adjustments do; the logprobs stay the raw logits'."""
    history = TokenHistory([1, 3, 3, 5, 2, 2, 2, 9], prompt_len=4)  # the output ends with 9
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 2
    counts = [TokenCounts.of(history)] if params.penalizes else None
    choice = choose(one_row_batch(params, suppressed), [history], counts)
    got = choice.output(
        one_row_batch(params, suppressed), native.sample_rows(logits.clone(), choice.settings)
    )
    sampling = SamplingBatch.from_params(
        [params],
        [seeded_uniforms(params.seed, "cpu")],
        "cpu",
        [history],
        BYTE_BAD_WORDS,
        suppressed=[suppressed],
    )
    want = Sampler().sample(logits.clone(), sampling)
    assert got.token_ids == [want.token_ids.tolist()] and not got.failed_rows
    if params.logprobs is None:
        assert got.logprobs is None
        return
    assert got.logprobs[0][0] == pytest.approx(want.logprobs[0].item(), abs=1e-5)
    top = got.top_logprobs[0][0]
    assert [token for token, _ in top] == want.top_logprob_ids[0].tolist()
    assert [value for _, value in top] == pytest.approx(want.top_logprobs[0].tolist(), abs=1e-5)
    raw = torch.log_softmax(logits[0], dim=-1)
    assert got.logprobs[0][0] == pytest.approx(raw[got.token_ids[0][0]].item(), abs=1e-5)


def test_a_row_that_is_no_distribution_reports_no_logprobs(native: NativeKernels) -> None:
    params = SamplingParams(temperature=0.7, logprobs=2)
    batch = one_row_batch(params, [])
    choice = choose(batch)
    got = choice.output(
        batch, native.sample_rows(torch.full((1, 8), float("nan")), choice.settings)
    )
    assert got.failed_rows == [0] and got.token_ids == [[0]]
    assert math.isnan(got.logprobs[0][0])
    assert [token for token, _ in got.top_logprobs[0][0]] == [-1, -1]


def test_rows_with_logprobs_bias_bad_words_allowed_tokens_and_min_tokens_decode_natively(
    native: NativeKernels, tiny_model_factory: Callable[..., Path]
) -> None:
    """Every decode step of such a batch chooses its tokens in the native step, and tokens and
    logprobs are the eager path's."""
    model_dir = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    prompts = [[4, 4, 5, 4, 7], [5, 4, 5, 4, 8], [6, 4, 5, 4, 9], [7, 4, 5, 4], [8, 4]]
    common = {"max_tokens": 10, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0, logprobs=3, **common),
        SamplingParams(temperature=0.8, seed=2, logprobs=0, repetition_penalty=1.4, **common),
        SamplingParams(temperature=0, logit_bias={67: 5.0, 115: -100.0}, **common),
        SamplingParams(temperature=0, bad_words=["C"], min_tokens=4, max_tokens=10),
        SamplingParams(temperature=0.7, seed=8, allowed_token_ids=[67, 98, 99, 100], **common),
    ]
    llm = LLM(str(model_dir), dtype="float32")
    counting = llm.engine.decode_step = CountingStep(llm.engine.decode_step)
    eager = LLM(str(model_dir), dtype="float32", enforce_eager=True)
    got = llm.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert counting.batches == counting.chosen == 9
    assert set(got[4].token_ids) <= {67, 98, 99, 100}
    for got_output, want_output in zip(got, want, strict=True):
        assert got_output.token_ids == want_output.token_ids
        if got_output.logprobs is not None:
            assert [step.logprob for step in got_output.logprobs] == pytest.approx(
                [step.logprob for step in want_output.logprobs], abs=1e-5
            )
            assert [[token for token, _ in step.top] for step in got_output.logprobs] == [
                [token for token, _ in step.top] for step in want_output.logprobs
            ]


def test_a_grammar_mask_leaves_only_its_tokens_and_logprobs_see_it(native: NativeKernels) -> None:
    """70 logits: three words of bits, the last one partial. The mask applies before the
    logprobs, as the torch path masks the logits before its sampler."""
    allowed = [2, 33, 65]
    bits = (ctypes.c_int32 * 3)()
    for token in allowed:
        bits[token // 32] |= 1 << (token % 32)
    logits = torch.randn(1, 70, generator=torch.Generator().manual_seed(7))
    values, ids = (ctypes.c_float * 3)(), (ctypes.c_int32 * 2)()
    setting = RowSampling()
    setting.allowed_bits = ctypes.addressof(bits)
    setting.logprobs, setting.top_ids, setting.num_top = (
        ctypes.addressof(values),
        ctypes.addressof(ids),
        2,
    )
    (token,) = native.sample_rows(logits.clone(), [setting])
    masked = torch.full_like(logits[0], float("-inf"))
    masked[allowed] = logits[0, allowed]
    want = torch.log_softmax(masked, dim=-1)
    assert token == int(masked.argmax())
    assert values[0] == pytest.approx(want[token].item(), abs=1e-6)
    assert list(ids) == want.topk(2).indices.tolist()
