"""OpenAI's `response_format` and vLLM's `structured_outputs` over HTTP, through the official
client on stories260K: outputs that follow their schema, regex or choice (streamed too), the
same tokens as the offline engine, and each malformed constraint a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from helpers.frontend_http import MODEL_NAME

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.frontend.params import completion_choices
from baton.frontend.protocol import CompletionRequest
from baton.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["cat", "dog", "bird"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["animal", "legs"],
    "additionalProperties": False,
}
STORY = [{"role": "user", "content": "Tell me about a pet."}]
# A schema whose only definition refers to itself: no value ends it.
LOOPING = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def test_chat_json_schema_follows_the_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=STORY,
        max_completion_tokens=64,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    assert value["animal"] in ("cat", "dog", "bird") and 0 <= value["legs"] <= 8
    assert set(value) == {"animal", "legs"}


def test_completion_structured_outputs_equal_the_offline_engine(
    client: openai.OpenAI, offline: LLM
) -> None:
    constraint = {"regex": r"(Once|One day), [a-z]+ [a-z]+\."}
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": constraint},
    )
    expected = offline.generate(
        "Once upon a time",
        SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**constraint)
        ),
    )[0]
    assert response.choices[0].text == expected.text
    assert re.fullmatch(constraint["regex"], expected.text), expected.text


def test_streamed_choice_and_json_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=STORY,
        max_tokens=16,
        temperature=1.0,
        seed=7,
        n=3,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["happy", "sad", "sleepy"]}},
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(text in ("happy", "sad", "sleepy") for text in texts), texts
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=STORY,
        max_tokens=8,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert response.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            "invalid json constraint",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid regex"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one constraint",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "got 0"),
        # No output satisfies these: llguidance says only "NoExtensionBias", once compiled.
        (
            {"structured_outputs": {"regex": r"[^\s\S]"}},
            "structured_outputs",
            "invalid regex constraint: the regex matches no text",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": LOOPING}}},
            "response_format",
            "$refs only refer to each other or to themselves, with no base case",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            None,
            "cannot both constrain",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, None, "structural_tag"),
        ({"response_format": {"type": "json_schema"}}, None, "needs `json_schema`"),
        ({"response_format": {"type": "structural_tag"}}, None, "response_format"),
        # vLLM ignores these since 0.12 (unconstrained output, 200): refused, never silent.
        ({"guided_json": {"type": "object"}}, None, 'send `structured_outputs: {"json": ...}`'),
        ({"guided_choice": ["a", "b"]}, None, "`guided_choice` was removed in vLLM 0.12"),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_malformed_constraints_are_400(
    http: httpx.Client,
    restricted_frontend: BatonConfig,
    endpoint: str,
    fields: dict,
    param: str | None,
    message: str,
) -> None:
    body = {"model": restricted_frontend.served_model_name, "max_tokens": 4, **fields}
    if endpoint == "completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = STORY
    response = http.post(f"/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


def test_every_structured_outputs_field_reaches_the_params() -> None:
    fields = {"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": " ?"}
    body = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": fields})
    (choice,) = completion_choices(body, max_choices=4)
    assert choice.params.structured_outputs == StructuredOutputsParams(**fields)
