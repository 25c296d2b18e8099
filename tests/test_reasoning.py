"""The reasoning split of a reply's text (baton/reasoning.py): whole, and streamed in every
chunking, with the tags' parts held back until they are known."""

from __future__ import annotations

import pytest

from baton.reasoning import ReasoningSplit, split_reasoning


@pytest.mark.parametrize(
    ("text", "in_reasoning", "expected"),
    [
        ("\nLet me see.\n</think>\n\nParis.", True, ("\nLet me see.\n", "\n\nParis.")),
        # The model writes the opening tag itself (Qwen3's first template): it is dropped.
        ("<think>\nHmm.</think>Paris.", True, ("\nHmm.", "Paris.")),
        ("  <think>Hmm.</think>Paris.", True, ("Hmm.", "Paris.")),
        # Only a leading <think> opens the block; a later one is reasoning text.
        ("a <think> b</think>c", True, ("a <think> b", "c")),
        # Cut before the block closed (max_tokens): all reasoning, no content.
        ("\nStill thinking", True, ("\nStill thinking", None)),
        ("Still thinking </thi", True, ("Still thinking </thi", None)),
        ("<thi", True, ("<thi", None)),
        # The first </think> closes the block; a later one is content.
        ("a</think>b</think>c", True, ("a", "b</think>c")),
        ("a</think>", True, ("a", None)),
        # A reply whose prompt closed the block (enable_thinking false) is all content.
        ("<think>a</think>b", False, (None, "<think>a</think>b")),
        ("", True, ("", None)),
    ],
)
def test_a_whole_reply(text: str, in_reasoning: bool, expected: tuple) -> None:
    assert split_reasoning(text, in_reasoning) == expected


@pytest.mark.parametrize(
    "text",
    [
        "\nLet me see.\n</think>\n\nParis.",
        "<think>\nHmm.</think>Paris.",
        "  <think>Hmm.</think>Paris.",
        "a <think> b</think>c",
        "Still thinking </thi",
        "a</think>b</think>c",
        "<</<think><</think></",
    ],
)
def test_every_chunking_streams_the_whole_replys_split(text: str) -> None:
    """Chunks of one, two and three characters, and the text cut at every point."""
    reasoning, content = split_reasoning(text, True)
    chunkings = [[text[i : i + size] for i in range(0, len(text), size)] for size in (1, 2, 3)]
    chunkings += [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    for chunks in chunkings:
        split = ReasoningSplit(in_reasoning=True)
        streamed = [split.feed(chunk) for chunk in chunks]
        assert "".join(r for r, _ in streamed) + split.finish() == reasoning
        assert "".join(c for _, c in streamed) == (content or "")


def test_a_tag_is_held_back_only_while_it_may_be_one() -> None:
    split = ReasoningSplit(in_reasoning=True)
    assert split.feed("<th") == ("", "")  # may open the block
    assert split.feed("ink>Hmm </") == ("Hmm ", "")  # "</" may close it
    assert split.feed("b>") == ("</b>", "")
    assert split.feed("</think>Paris") == ("", "Paris")
    assert split.feed(" is big.") == ("", " is big.")
    assert split.finish() == ""
