"""Completions' `echo` and vLLM's `prompt_logprobs` through the official `openai` client,
checked against the offline `LLM`: the prompt's text before the output, with `logprobs` the
prompt tokens' logprobs before the output's (the first token's null), and with `max_tokens: 0`
the prompt alone, as vLLM answers (lm-evaluation-harness scores a continuation this way)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import openai
import pytest
from helpers.frontend_http import MODEL_NAME, greedy

from baton import LLM
from baton.frontend.echo import Echo
from baton.frontend.params import completion_choices
from baton.frontend.protocol import CompletionRequest
from baton.messages import GenerateDelta

PROMPT = "Once upon a time"
TOLERANCE = 1e-4


def assert_logprobs_layout(logprobs: object) -> None:
    """Parallel lists whose offsets run over the tokens' texts."""
    tokens = logprobs.tokens
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(tokens)
    assert logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]


def assert_scores_match(values: list[float], expected: list[float]) -> None:
    assert len(values) == len(expected)
    for value, reference in zip(values, expected):
        assert math.isclose(value, reference, abs_tol=TOLERANCE)


def test_echo_puts_the_prompt_before_the_output(client: openai.OpenAI, offline: LLM) -> None:
    expected = greedy(offline, PROMPT, max_tokens=8)
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True, n=2
    )
    for choice in response.choices:
        assert choice.text == PROMPT + expected.text and choice.logprobs is None
    assert response.usage.completion_tokens == 2 * len(expected.token_ids)
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True, stream=True
    )
    texts = [chunk.choices[0].text for chunk in streamed]
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + expected.text


def test_echo_of_token_ids_decodes_them(client: openai.OpenAI, offline: LLM) -> None:
    prompt_ids = offline.tokenizer.encode(PROMPT)  # BOS first: echoed as vLLM decodes it
    expected = greedy(offline, prompt_ids, max_tokens=4)
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=4, temperature=0, echo=True
    )
    decoded = offline.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert response.choices[0].text == decoded + expected.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_scores_the_prompt_then_the_output(
    client: openai.OpenAI, offline: LLM, stream: bool
) -> None:
    expected = greedy(offline, PROMPT, max_tokens=6, logprobs=2, prompt_logprobs=2)
    prompt_ids = expected.prompt_token_ids
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=2,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = [chunk.choices[0] for chunk in response]
        text = "".join(chunk.text for chunk in chunks)
        fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        logprobs = SimpleNamespace(
            **{
                name: [v for chunk in chunks for v in getattr(chunk.logprobs, name)]
                for name in fields
            }
        )
        # The first chunk carries the whole prompt, scored, and the first output token.
        assert len(chunks[0].logprobs.tokens) == len(prompt_ids) + 1
    else:
        text, logprobs = response.choices[0].text, response.choices[0].logprobs
    assert text == PROMPT + expected.text
    assert_logprobs_layout(logprobs)
    num_prompt = len(prompt_ids)
    assert len(logprobs.tokens) == num_prompt + len(expected.token_ids)
    # The first prompt token has nothing before it to give it a probability.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    # The BOS, then the prompt's tokens as they read in it (SentencePiece's leading space).
    assert logprobs.tokens[0] == "<s>"
    assert "".join(logprobs.tokens[1:num_prompt]) == " " + PROMPT
    scores = [entry.logprob for entry in expected.prompt_logprobs + expected.logprobs]
    assert_scores_match(logprobs.token_logprobs[1:], scores)
    for top, entry in zip(logprobs.top_logprobs[1:], expected.prompt_logprobs):
        # The top 2, and the prompt's own token where it is not among them.
        assert 2 <= len(top) <= 3
        assert_scores_match(sorted(top.values(), reverse=True)[:2], [lp for _, lp in entry.top])


def test_echo_without_output_returns_the_scored_prompt(client: openai.OpenAI, offline: LLM) -> None:
    """`max_tokens: 0` with echo: the prompt alone, its tokens scored (one token is generated
    and dropped, as vLLM does)."""
    expected = greedy(offline, PROMPT, max_tokens=1, prompt_logprobs=0)
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, stream=stream
        )
        (choice,) = next(iter(response)).choices if stream else response.choices
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert_logprobs_layout(choice.logprobs)
        assert len(choice.logprobs.tokens) == len(expected.prompt_token_ids)
        assert choice.logprobs.token_logprobs[0] is None
        assert_scores_match(
            choice.logprobs.token_logprobs[1:], [e.logprob for e in expected.prompt_logprobs]
        )


def test_a_loglikelihood_request_as_lm_evaluation_harness_sends_it(
    client: openai.OpenAI, offline: LLM
) -> None:
    """Several token-id prompts (context + continuation) in one request, `max_tokens: 1`,
    `echo`, `logprobs: 1`, read as lm-evaluation-harness reads them: the continuation's logprobs
    are `token_logprobs[context_len:-1]`, and it is greedy when each is its top one's."""
    context = offline.tokenizer.encode("Once upon a time, there was a")
    continuations = [
        offline.tokenizer.encode(" little girl", add_special_tokens=False),
        offline.tokenizer.encode(" purple elephant", add_special_tokens=False),
    ]
    prompts = [context + continuation for continuation in continuations]
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    choices = sorted(response.choices, key=lambda choice: choice.index)
    for prompt, choice in zip(prompts, choices, strict=True):
        reference = greedy(offline, prompt, max_tokens=1, prompt_logprobs=1).prompt_logprobs
        expected = [entry.logprob for entry in reference[len(context) - 1 :]]
        token_logprobs = choice.logprobs.token_logprobs[len(context) : -1]
        assert_scores_match(token_logprobs, expected)
        top = choice.logprobs.top_logprobs[len(context) : -1]
        is_greedy = all(lp == max(alts.values()) for lp, alts in zip(token_logprobs, top))
        assert is_greedy == all(
            entry.top[0][1] == entry.logprob for entry in reference[len(context) - 1 :]
        )


def test_echo_without_output_keeps_the_finish_reason() -> None:
    """The dropped token's finish reason stays, as vLLM's: a failed request reads "error",
    never a complete-looking "length"."""
    for reason in ("length", "stop", "error", "abort"):
        delta = GenerateDelta(
            request_id="r", token_ids=[5], text="x", finished=True, finish_reason=reason
        )
        echoed = Echo("The prompt", "instead_of_output").apply(delta)
        assert (echoed.text, echoed.token_ids, echoed.finish_reason) == ("The prompt", [], reason)
    before = Echo("The prompt", "before_output")
    first, second = (GenerateDelta(request_id="r", token_ids=[5], text="x") for _ in range(2))
    assert [before.apply(first).text, before.apply(second).text] == ["The promptx", "x"]


def test_vllm_prompt_logprobs_field_on_completions_and_chat(
    client: openai.OpenAI, offline: LLM
) -> None:
    """vLLM's `prompt_logprobs`: null, then per prompt token `{id: {logprob, rank,
    decoded_token}}` for it and its top-n (ranks 1..n); per choice on completions, once at the
    top of a chat response."""
    expected = greedy(offline, PROMPT, max_tokens=2, prompt_logprobs=2)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        logprobs=1,
        extra_body={"prompt_logprobs": 2},
    )
    choice = response.choices[0]
    assert choice.text == expected.text
    assert len(choice.logprobs.tokens) == 2  # no echo: the output's logprobs alone
    scored = choice.model_extra["prompt_logprobs"]
    prompt_ids = expected.prompt_token_ids
    assert scored[0] is None and len(scored) == len(prompt_ids)
    for index, (position, entry) in enumerate(zip(scored[1:], expected.prompt_logprobs), 1):
        own = position[str(prompt_ids[index])]
        assert math.isclose(own["logprob"], entry.logprob, abs_tol=TOLERANCE)
        assert own["rank"] == entry.rank and own["decoded_token"]
        tops = sorted((v for k, v in position.items() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert_scores_match([v["logprob"] for v in tops][:2], [lp for _, lp in entry.top])
        assert 2 <= len(position) <= 3
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        n=2,
        extra_body={"prompt_logprobs": 0},
    )
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat.usage.prompt_tokens
    assert all(len(position) == 1 for position in scored[1:])  # the prompt's own token only
    # vLLM's rule: a chat echo with top_logprobs scores the prompt with that many alternatives.
    echoed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"echo": True},
    )
    assert all(len(position) >= 2 for position in echoed.model_extra["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in (chat.choices[0].model_extra or {})


def test_prompt_logprobs_are_refused_streamed_and_out_of_range(client: openai.OpenAI) -> None:
    """As vLLM: a streamed response has no place for them, so asking for alternatives there is
    a 400 (0 passes, and nothing is scored); 21 is past the range."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(**chat, stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model=MODEL_NAME, prompt="a", stream=True, extra_body={"prompt_logprobs": 2}
        )
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL_NAME, prompt="a", extra_body={"prompt_logprobs": 21})
    streamed = CompletionRequest.model_validate(
        {"prompt": "a", "stream": True, "prompt_logprobs": 0}
    )
    assert [c.params.prompt_logprobs for c in completion_choices(streamed, 8)] == [None]
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="a",
            stream=True,
            max_tokens=2,
            extra_body={"prompt_logprobs": 0},
        )
    )
    assert chunks and "prompt_logprobs" not in (chunks[0].choices[0].model_extra or {})
