"""Structured outputs end to end through the offline engine: a constrained greedy row takes
transformers' argmax among the tokens its grammar allows, sampled rows always match their
constraint, unconstrained neighbours are untouched, through the overlap loop (which schedules a
row before its previous token, which its matcher must have consumed, is known), the plain loop,
the eager path and preemption."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.scheduler_proc.scheduler import Scheduler
from baton.structured_outputs import StructuredOutputsParams
from baton.validation import RequestError
from tests.helpers.decode_steps import CountingStep
from tests.helpers.hf_reference import hf_logits
from tests.helpers.tiny_models import EOS_ID, EXTRA_EOS_ID

ABC = [ord(c) for c in "abc"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONFIGS = [
    {},
    {"disable_overlap": True},
    {"enforce_eager": True},
    {"page_size": 4, "num_pages": 24, "max_model_len": 96},
]
CONFIG_IDS = ["overlap", "plain", "eager", "preempting"]


def constrained(temperature: float = 0.0, seed: int | None = None, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=64,  # room for the longest output SCHEMA allows (49 bytes)
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(10, 30))] for _ in range(count)]


def follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "age", "tags"}
        and re.fullmatch("[a-z]{1,6}", value["name"]) is not None
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 150
        and isinstance(value["tags"], list)
        and set(value["tags"]) <= {"x", "y"}
    )


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_constrained_greedy_is_transformers_argmax_among_allowed_tokens(
    tiny_llama_dir: Path, config: dict
) -> None:
    """`[abc]{24}` allows exactly bytes a, b, c 24 times, then only a stop token: a reference
    independent of the grammar engine."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", **config)
    batch = prompts(6)
    params = [constrained(regex="[abc]{24}"), SamplingParams(temperature=0, max_tokens=24)] * 3
    outputs = llm.generate(batch, params)
    if "num_pages" in config:
        assert llm.scheduler.aggregate_stats().preemptions > 0
    for prompt, output, p in zip(batch, outputs, params, strict=True):
        if p.structured_outputs is None:
            alone = LLM.generate(llm, prompt, p)[0]
            assert output.token_ids == alone.token_ids  # the mask stayed on its own rows
            continue
        assert output.finish_reason == "stop"
        *letters, stop = output.token_ids
        assert len(letters) == 24 and stop in (EOS_ID, EXTRA_EOS_ID)
        logits = hf_logits(tiny_llama_dir, prompt + letters)[len(prompt) - 1 :]
        for step, token in enumerate(letters):
            assert token == ABC[int(logits[step, ABC].argmax())], f"step {step}"


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_sampled_outputs_always_match_their_constraint(tiny_llama_dir: Path, config: dict) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", **config)
    kinds = [
        ({"json": SCHEMA, "disable_any_whitespace": True}, follows_schema),
        ({"regex": r"(cat|dog)-[0-9]{2,4}"}, lambda t: re.fullmatch(r"(cat|dog)-[0-9]{2,4}", t)),
        ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"grammar": 'root ::= "(" [a-e]+ ")"'}, lambda t: re.fullmatch(r"\([a-e]+\)", t)),
    ]
    batch = prompts(8, seed=9)
    params = [
        constrained(temperature=1.0, seed=seed, **kinds[seed % len(kinds)][0])
        for seed in range(len(batch))
    ]
    # Penalties and biases act on the same logits (the rows' histories), before the mask.
    params[1].repetition_penalty = 1.3
    params[2].logit_bias = {ord("g"): 5.0, ord("a"): -5.0}
    outputs = llm.generate(batch, params)
    if "num_pages" in config:
        assert llm.scheduler.aggregate_stats().preemptions > 0
    for seed, output in enumerate(outputs):
        assert output.finish_reason == "stop", output
        assert kinds[seed % len(kinds)][1](output.text), (seed, output.text)


def test_json_object_opens_an_object_and_logprobs_come_from_the_masked_distribution(
    tiny_llama_dir: Path,
) -> None:
    """Any JSON object may nest without end on a random model: every output that ends parses."""
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    json_object = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = [
        SamplingParams(
            temperature=0.8, seed=seed, max_tokens=60, logprobs=2, structured_outputs=json_object
        )
        for seed in range(4)
    ]
    outputs = llm.generate(prompts(4), params)
    for output in outputs:
        assert output.text.startswith("{")
        # "{" is the only token allowed first: the chosen token's logprob is log(1).
        assert output.logprobs[0].logprob == pytest.approx(0.0, abs=1e-6)
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)


def test_constrained_rows_decode_in_the_native_step(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """A model with compact weights (bf16 stored, float32 computed): each decode step masks its
    constrained rows and chooses every token natively. Greedy rows take transformers' argmax
    among the allowed bytes, sampled ones match their constraint, a plain neighbour is
    untouched, and logprobs come from the masked distribution."""
    model_dir = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="float32")
    if llm.engine.decode_step is None:
        pytest.skip("no native decode step on this machine (it needs AVX2 and a C compiler)")
    counting = llm.engine.decode_step = CountingStep(llm.engine.decode_step)
    batch = prompts(4)
    params = [
        constrained(regex="[abc]{24}"),
        SamplingParams(temperature=0, max_tokens=24),
        constrained(temperature=1.0, seed=3, regex=r"(cat|dog)-[0-9]{2,4}"),
        SamplingParams(
            temperature=0.8,
            seed=1,
            max_tokens=60,
            logprobs=2,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
    ]
    outputs = llm.generate(batch, params)
    assert counting.batches == counting.chosen > 0
    *letters, stop = outputs[0].token_ids
    assert len(letters) == 24 and stop in (EOS_ID, EXTRA_EOS_ID)
    logits = hf_logits(model_dir, batch[0] + letters)[len(batch[0]) - 1 :]
    for step, token in enumerate(letters):
        assert token == ABC[int(logits[step, ABC].argmax())], f"step {step}"
    assert outputs[1].token_ids == llm.generate(batch[1], params[1])[0].token_ids
    assert re.fullmatch(r"(cat|dog)-[0-9]{2,4}", outputs[2].text)
    assert outputs[3].text.startswith("{")
    assert outputs[3].logprobs[0].logprob == pytest.approx(0.0, abs=1e-6)


def test_a_complete_grammar_ends_the_output_despite_min_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    params = constrained(choice=["yes", "no"])
    params.min_tokens = 5
    (output,) = llm.generate(prompts(1)[0], params)
    assert (output.text, output.finish_reason) in (("yes", "stop"), ("no", "stop"))


def test_a_batch_with_a_constraint_the_tokenizer_cannot_serve_queues_nothing(
    tiny_llama_dir: Path,
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    batch = [constrained(regex="a"), constrained(grammar="start: <[99999]>")]
    with pytest.raises(RequestError, match="does not compile"):
        llm.generate(prompts(2), batch)
    assert not llm.scheduler.requests and not llm.scheduler.has_unfinished_requests()


def test_speculative_decoding_refuses_structured_outputs(tiny_llama_dir: Path) -> None:
    config = BatonConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    scheduler = Scheduler(config)
    with pytest.raises(RequestError, match="structured outputs"):
        scheduler.add_request("json", [5, 6, 7], constrained(json_object=True))
    scheduler.shutdown()


def test_a_constraint_the_tokenizer_cannot_serve_is_a_request_error(tiny_llama_dir: Path) -> None:
    scheduler = Scheduler(BatonConfig(model=str(tiny_llama_dir), dtype="float32"))
    with pytest.raises(RequestError, match="does not compile"):
        scheduler.add_request("bad", [5, 6], constrained(grammar="start: <[99999]>"))
    scheduler.add_request("good", [5, 6], constrained(regex="a"))
    assert list(scheduler.requests) == ["good"]
    scheduler.shutdown()


def test_llm_chat_under_a_reasoning_parser_constrains_after_the_reasoning(
    tmp_path: Path,
) -> None:
    """As vLLM's LLM: the reasoning is free, the constraint starts after </think>, and the text
    stays whole. Without the parser the constraint starts at the first token."""
    from tests.helpers.tiny_models import write_thinking_checkpoint

    model = str(write_thinking_checkpoint(tmp_path / "thinking"))
    end = 260  # its </think>
    ask = [{"role": "user", "content": "Hi"}]
    free = SamplingParams(temperature=0, max_tokens=12, logit_bias={end: 3.0})
    constrained = SamplingParams(
        temperature=0,
        max_tokens=12,
        logit_bias={end: 3.0},
        structured_outputs=StructuredOutputsParams(regex="[ab]{5}"),
    )
    thinking = LLM(model, dtype="float32", reasoning_parser="qwen3")
    reasoning = thinking.chat(ask, free)[0].text.partition("</think>")[0]
    (output,) = thinking.chat(ask, constrained)
    before, tag, content = output.text.partition("</think>")
    assert (before, tag) == (reasoning, "</think>") and re.fullmatch("[ab]{5}", content)
    (plain,) = LLM(model, dtype="float32").chat(ask, constrained)
    assert re.fullmatch("[ab]{5}", plain.text)
