"""The non-streamed body both generation endpoints build: choices in order, usage summed."""

from __future__ import annotations

from baton.frontend.choices_response import response_body
from baton.frontend.generation import ChoiceOutput
from baton.messages import Usage


def test_choices_come_in_index_order_and_each_prompt_counts_once() -> None:
    def output(index: int, group: int, completion: int) -> ChoiceOutput:
        usage = Usage(prompt_tokens=10 + group, completion_tokens=completion, cached_tokens=group)
        return ChoiceOutput(index, group, texts=[f"c{index}"], finish_reason="length", usage=usage)

    # Two prompts (groups 0 and 1), two choices each, finishing out of order.
    outputs = [output(3, 1, 4), output(0, 0, 1), output(2, 1, 3), output(1, 0, 2)]
    body = response_body(
        {"id": "x"}, outputs, lambda out: {"index": out.index, "text": out.text}, with_stats=False
    )
    assert body["id"] == "x"
    assert body["choices"] == [{"index": i, "text": f"c{i}"} for i in range(4)]
    assert body["usage"] == {
        "prompt_tokens": 10 + 11,
        "completion_tokens": 1 + 2 + 3 + 4,
        "total_tokens": 21 + 10,
        "prompt_tokens_details": {"cached_tokens": 0 + 1},
    }
