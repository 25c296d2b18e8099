"""The offline LLM end to end: greedy tokens equal transformers', whatever the batching."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    CORE_VARIANTS,
    EOS_ID,
    EXTRA_EOS_ID,
    assert_greedy_matches_hf,
    hf_greedy_generate,
    load_hf_model,
)

from baton import LLM, SamplingParams
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.config import ConfigurationError
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.validation import PromptTooLongError, RequestError

PROMPT_LENGTHS = (1, 5, 17, 40, 64, 100, 200, 300)
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and transformers' greedy continuations on the tiny Llama."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    return prompts, [hf_greedy_generate(tiny_llama_dir, p, NEW_TOKENS) for p in prompts]


def test_greedy_matches_transformers(tiny_model_dir: Path) -> None:
    prompts = random_prompts(PROMPT_LENGTHS)
    llm = LLM(str(tiny_model_dir), dtype="float32")
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy_generate(tiny_model_dir, prompt, NEW_TOKENS)
        assert output.finish_reason == "length"


# bf16 rounding moves these models' logits by up to ~0.2 each (see test_model's bf16 test), so
# two of them by up to ~0.4 relative to each other: a bf16 engine's greedy token may differ from
# float32 transformers' only where their top two are closer than that.
BF16_TIE_TOLERANCE = 0.5


@pytest.mark.parametrize("variant", CORE_VARIANTS)
def test_a_bf16_checkpoint_serves_with_default_flags(tiny_model_factory, variant: str) -> None:
    """`--dtype auto` on a bf16 checkpoint: float32 (whose greedy tokens are transformers'
    float32 ones, token for token), with bf16 GEMMs for batches past the native step's where
    this CPU has native bf16 (their rows rounded to bf16)."""
    model_dir = tiny_model_factory(variant, weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir))
    native = detect_cpu_capabilities().native_bf16
    if not native:
        expected = ("float32", None)
    elif shutil.which("cc"):  # the native kernels build
        expected = ("float32", "bfloat16")
    else:
        expected = ("bfloat16", None)
    assert (llm.engine.plan.dtype, llm.engine.plan.gemm_dtype) == expected
    prompts = random_prompts((5, 40, 100), seed=3)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        if native:
            assert_greedy_matches_hf(model_dir, prompt, output.token_ids, BF16_TIE_TOLERANCE)
        else:
            assert output.token_ids == hf_greedy_generate(model_dir, prompt, NEW_TOKENS)


def test_max_cpu_isa_avx2_plans_an_avx2_machine_on_any_machine(tiny_model_factory) -> None:
    """The plan an AVX2-only CPU gets, wherever the test runs: float32, token for token."""
    model_dir = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir), max_cpu_isa="avx2")
    assert llm.engine.plan.dtype == "float32" and llm.engine.cpu.isa in ("default", "avx2")
    prompts = random_prompts((7, 64), seed=4)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        assert output.token_ids == hf_greedy_generate(model_dir, prompt, NEW_TOKENS)


def test_explicit_bfloat16_runs_on_every_cpu(tiny_model_factory) -> None:
    """`--dtype bfloat16` is honoured without native bf16 too (unpacked, by conversion)."""
    model_dir = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="bfloat16")
    caps = detect_cpu_capabilities()
    assert llm.engine.plan.dtype == "bfloat16"
    assert llm.engine.plan.pack_weights == caps.can_pack("bfloat16")
    prompts = random_prompts((9, 50), seed=5)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids, BF16_TIE_TOLERANCE)


@pytest.mark.parametrize(
    "options",
    [
        {"disable_overlap": True},
        {"chunk_size": 7},  # every prompt but the shortest is split into chunks
        {"page_size": 1},
        {"page_size": 16, "chunk_size": 64},
        {"batch_order": "decode-first", "chunk_size": 48},
        {"enable_prefix_caching": False},
        {"max_running_requests": 3},
        # 25 pages of 16 tokens: the 300-token prompt alone needs 21, so requests wait for pages.
        {"num_pages": 25, "max_model_len": 400},
    ],
    ids=repr,
)
def test_batching_does_not_change_greedy_tokens(
    tiny_llama_dir: Path, llama_reference: tuple[list[list[int]], list[list[int]]], options: dict
) -> None:
    prompts, expected = llama_reference
    llm = LLM(str(tiny_llama_dir), dtype="float32", **options)
    together = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == expected
    assert_pool_idle(llm)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_request_that_cannot_be_sampled_fails_alone(
    tiny_llama_dir: Path, llama_reference, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """A row whose logits are NaN (here: poisoned by temperature) ends with "error"; its batch
    neighbours keep their exact greedy tokens and every page returns to the pool."""
    poison = 0.625
    prompts, expected = llama_reference
    llm = LLM(str(tiny_llama_dir), dtype="float32", disable_overlap=not overlap)
    sample = llm.engine.sampler.sample

    def poisoned_sample(logits, batch):
        logits = logits.clone()
        for group in batch.groups:
            rows = torch.arange(len(logits)) if group.rows is None else group.rows
            logits[rows[group.temperatures.flatten() == poison]] = float("nan")
        return sample(logits, batch)

    monkeypatch.setattr(llm.engine.sampler, "sample", poisoned_sample)
    bad = SamplingParams(temperature=poison, max_tokens=8, min_tokens=8)
    outputs = llm.generate([*prompts, prompts[2]], [GREEDY] * len(prompts) + [bad])
    assert (outputs[-1].finish_reason, outputs[-1].token_ids) == ("error", [])
    assert [output.token_ids for output in outputs[:-1]] == expected
    assert_pool_idle(llm)


def test_seed_makes_unseeded_sampling_reproducible() -> None:
    """--seed seeds the generator of requests without a seed of their own (vLLM's meaning)."""
    params = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True)

    def sampled(seed: int) -> list[int]:
        return (
            LLM(RANDOM_MODEL_NAME, seed=seed, num_pages=16, max_model_len=256)
            .generate("hello", params)[0]
            .token_ids
        )

    first = sampled(123)
    assert sampled(123) == first
    assert sampled(124) != first


def test_alone_equals_together(tiny_llama_dir: Path, llama_reference) -> None:
    prompts, expected = llama_reference
    llm = LLM(str(tiny_llama_dir), dtype="float32", chunk_size=32)
    for prompt, tokens in zip(prompts[::3], expected[::3]):
        assert llm.generate([prompt], GREEDY)[0].token_ids == tokens


def test_shared_prefixes_hit_the_cache(tiny_llama_dir: Path) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(150)]
    prompts = [prefix + [rng.randrange(256) for _ in range(n)] for n in (1, 9, 33)]
    expected = [hf_greedy_generate(tiny_llama_dir, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(tiny_llama_dir), dtype="float32", page_size=16)
    first = llm.generate(prompts[:1], GREEDY)[0]
    assert first.stats.cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY)
    assert [first.token_ids] + [o.token_ids for o in rest] == expected
    # 150 shared tokens = 9 whole pages of 16 cached by the first request.
    assert [o.stats.cached_tokens for o in rest] == [144, 144]
    # The same prompt again: everything but the last page is served from the cache.
    again = llm.generate(prompts[2:], GREEDY)[0]
    assert again.token_ids == expected[2]
    assert again.stats.cached_tokens == (len(prompts[2]) - 1) // 16 * 16
    assert_pool_idle(llm)


def test_stop_token_ids_and_eos(tiny_llama_dir: Path, llama_reference) -> None:
    prompts, expected = llama_reference
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    stop_at = expected[4][5]
    output = llm.generate(
        prompts[4], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_at])
    )[0]
    cut = expected[4].index(stop_at) + 1
    assert output.token_ids == expected[4][:cut] and output.finish_reason == "stop"
    # The stop token is reported but not spelled out (vLLM): the text is that of the tokens before.
    assert output.text == llm.tokenizer.decode(expected[4][: cut - 1])
    spelled = SamplingParams(
        temperature=0, max_tokens=32, stop_token_ids=[stop_at], include_stop_str_in_output=True
    )
    assert llm.generate(prompts[4], spelled)[0].text == llm.tokenizer.decode(expected[4][:cut])
    # Without ignore_eos the checkpoint's EOS ids (config.json's + generation_config.json's) stop.
    eos_ids = {EOS_ID, EXTRA_EOS_ID}
    for prompt, tokens in zip(prompts, expected):
        hits = [i for i, t in enumerate(tokens) if t in eos_ids]
        output = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
        if hits:
            assert output.token_ids == tokens[: hits[0] + 1] and output.finish_reason == "stop"
        else:
            assert output.token_ids == tokens and output.finish_reason == "length"


def test_stop_strings_trim_text(default_llm: LLM) -> None:
    full = default_llm.generate("abc", SamplingParams(temperature=0, max_tokens=24))[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:5]
    output = default_llm.generate("abc", SamplingParams(temperature=0, max_tokens=24, stop=stop))[0]
    assert output.finish_reason == "stop"
    assert output.text == text[: text.index(stop)]
    assert len(output.token_ids) < len(full.token_ids)


def test_a_stream_interval_changes_no_output(default_llm: LLM) -> None:
    """Tokens held back under --stream-interval: the same tokens, text and stop-string cut."""
    held = LLM(RANDOM_MODEL_NAME, stream_interval=4)
    full = default_llm.generate("abc", SamplingParams(temperature=0, max_tokens=24))[0]
    stop = full.text[7:9]
    for params in (
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, stop=stop),
    ):
        expected, output = default_llm.generate("abc", params)[0], held.generate("abc", params)[0]
        assert (output.token_ids, output.text) == (expected.token_ids, expected.text)
        assert output.finish_reason == expected.finish_reason
        assert output.logprobs == expected.logprobs
    assert_pool_idle(held)


def test_special_tokens_stay_in_the_text_when_asked(default_llm: LLM) -> None:
    """vLLM's SamplingParams.skip_special_tokens: EOS, forced by a bias, shows only if false."""
    eos = default_llm.engine.checkpoint.eos_token_ids[0]
    forced = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "logit_bias": {eos: 100}}
    skipped, kept = default_llm.generate(
        ["abc", "abc"],
        [SamplingParams(**forced), SamplingParams(**forced, skip_special_tokens=False)],
    )
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    eos_text = default_llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert skipped.text == "" and kept.text == eos_text * 3 and eos_text


def test_seeded_sampling_is_reproducible_across_batches(default_llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = default_llm.generate("hello", seeded)[0].token_ids
    others = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, ignore_eos=True)] * 3
    batch = default_llm.generate(
        ["x", "hello", "yz", "long prompt"], [others[0], seeded, *others[1:]]
    )
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert default_llm.generate("hello", other_seed)[0].token_ids != alone


def test_logprobs(default_llm: LLM) -> None:
    output = default_llm.generate(
        "hi", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    assert len(output.logprobs) == 4
    for token, entry in zip(output.token_ids, output.logprobs):
        top_ids = [token_id for token_id, _ in entry.top]
        assert (
            len(entry.top) == 3 and top_ids[0] == token
        )  # greedy: the chosen token is the top one
        assert entry.logprob == pytest.approx(entry.top[0][1]) and entry.logprob <= 0


def test_invalid_requests_raise_typed_errors(default_llm: LLM) -> None:
    max_len = default_llm.engine.max_model_len
    with pytest.raises(PromptTooLongError):
        default_llm.generate([[1] * max_len], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        default_llm.generate("x", SamplingParams(temperature=-1))
    with pytest.raises(RequestError, match="outside the vocabulary"):  # the tokenizer's wording
        default_llm.generate([[10**9]], SamplingParams())
    with pytest.raises(RequestError, match="Got priority 1 but Priority scheduling is not"):
        default_llm.generate("x", SamplingParams(), priority=[1])  # vLLM's: fcfs has no priority
    # The engine keeps serving after rejected requests.
    assert default_llm.generate("ok", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    assert_pool_idle(default_llm)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(default_llm: LLM) -> None:
    """vLLM's `truncate_prompt_tokens`: the last k tokens (-1: the last max_model_len), so a
    prompt past the context is served; the output is the truncated prompt's."""
    max_len = default_llm.engine.max_model_len
    prompt = [random.Random(4).randrange(3, 200) for _ in range(max_len + 40)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tail = default_llm.generate(prompt[-7:], greedy)[0]
    truncated = default_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=7),
    )[0]
    assert truncated.prompt_token_ids == prompt[-7:] and truncated.token_ids == tail.token_ids
    # -1 keeps max_model_len tokens, which leave no room for an output: the context error.
    with pytest.raises(PromptTooLongError):
        default_llm.generate(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            default_llm.generate(prompt, SamplingParams(truncate_prompt_tokens=bad))
    assert_pool_idle(default_llm)


def assert_pool_idle(llm: LLM) -> None:
    """Every page is free or merely cached (evictable): nothing leaked, nothing still locked."""
    stats = llm.scheduler.aggregate_stats()
    assert stats.running_requests == stats.waiting_requests == 0
    assert stats.used_pages == 0
    assert llm.scheduler.kv.cache.num_evictable_pages == stats.cached_pages


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(RANDOM_MODEL_NAME)


def test_stories260k_text_and_eos_match_transformers(stories260k_dir: Path) -> None:
    # The first three end their story with EOS within 300 tokens; the last one loops to the limit.
    prompts = [
        "The little dog",
        "One day, a girl named Sue",
        "Once upon a time, there was a big bear.",
        "Lily and Tom went to the park",
    ]
    llm = LLM(str(stories260k_dir), dtype="float32")
    tokenizer = llm.tokenizer
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=300))
    model = load_hf_model(stories260k_dir)
    for prompt, output in zip(prompts, outputs):
        prompt_ids = tokenizer.encode(prompt)
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=300
            )
        hf_ids = generated[0, len(prompt_ids) :].tolist()
        assert output.token_ids == hf_ids
        if len(hf_ids) < 300:  # transformers stopped on generation_config.json's EOS ids [1, 2]
            assert hf_ids[-1] in (1, 2) and output.finish_reason == "stop"
        else:
            assert output.finish_reason == "length"
        full_text = tokenizer.decode(prompt_ids + hf_ids, skip_special_tokens=True)
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        assert output.text == full_text[len(prompt_text) :]
    assert [o.finish_reason for o in outputs] == ["stop", "stop", "stop", "length"]


def test_min_tokens_suppresses_eos_and_stop_ids(tiny_llama_dir: Path, llama_reference) -> None:
    prompts, expected = llama_reference
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    eos_ids = {EOS_ID, EXTRA_EOS_ID}
    first_eos = {
        i: next(k for k, t in enumerate(tokens) if t in eos_ids)
        for i, tokens in enumerate(expected)
        if eos_ids & set(tokens)
    }
    assert first_eos, "the reference must reach an EOS for this test to mean anything"
    for index, position in first_eos.items():
        minimum = min(position + 4, NEW_TOKENS)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=minimum)
        output = llm.generate(prompts[index], params)[0]
        # Identical up to the EOS, which is now replaced by the next-best token.
        assert output.token_ids[:position] == expected[index][:position]
        assert not eos_ids & set(output.token_ids[:minimum])
        assert output.token_ids[position] != expected[index][position]
        # The boundary: min_tokens = position + 1 still forbids EOS as output number position + 1.
        exact = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=position + 1)
        assert llm.generate(prompts[index], exact)[0].token_ids[position] not in eos_ids
    stop_at = expected[4][5]
    params = SamplingParams(
        temperature=0,
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        stop_token_ids=[stop_at],
        min_tokens=12,
    )
    output = llm.generate(prompts[4], params)[0]
    assert stop_at not in output.token_ids[:12] and len(output.token_ids) >= 12
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate("x", SamplingParams(max_tokens=2, min_tokens=3))


def test_a_kv_cache_smaller_than_one_request_is_refused_naming_the_fix() -> None:
    """Once accepted: a request of max_model_len tokens could then never finish."""
    with pytest.raises(ConfigurationError) as refused:
        LLM(RANDOM_MODEL_NAME, num_pages=2, max_model_len=512)
    assert str(refused.value) == (
        "the KV cache holds 32 tokens (2 pages of 16), less than one request of max_model_len "
        "512: give --num-gpu-blocks-override at least 32, or --max-model-len 32 or less"
    )
    with pytest.raises(ConfigurationError, match="give --kv-cache-memory-bytes at least"):
        LLM(RANDOM_MODEL_NAME, kv_cache_memory_bytes=1, max_model_len=512)
    assert (
        LLM(RANDOM_MODEL_NAME, num_pages=32, max_model_len=512).engine.num_pages == 32
    )  # exactly one fits
