"""Tests for incremental detokenization: real tokenizers, streamed pushes vs. a full decode."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from baton.detokenizer_proc.incremental import DetokenizedDelta, IncrementalDetokenizer

STORIES_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "models" / "stories260K"
MULTILINGUAL = "héllo 世界 🎉, the quick brown fox jumps over the lazy dog. ça va? Ünïcödé ✓ 日本語"
END_TOKEN = "<|end|>"


def _byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the ByteLevel alphabet)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {byte: chr(byte) for byte in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def _byte_level_tokenizer(merges: Sequence[tuple[str, str]]) -> PreTrainedTokenizerBase:
    """A GPT-2 style byte-level BPE: every byte is a token, plus the given merges."""
    byte_chars = _byte_to_char()
    vocab = {byte_chars[byte]: byte for byte in range(256)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=END_TOKEN, clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerBase:
    """One token per byte: every multi-byte character is split across tokens."""
    return _byte_level_tokenizer([])


@pytest.fixture(scope="module")
def merged_byte_tokenizer() -> PreTrainedTokenizerBase:
    """Byte-level BPE whose merges make tokens that end or start inside a character."""
    chars = _byte_to_char()
    space, e4, b8, e7, f0, c3 = (chars[b] for b in (0x20, 0xE4, 0xB8, 0xE7, 0xF0, 0xC3))
    merges = [(space, e4), (b8, chars[0x96]), (e7, chars[0x95]), ("h", c3), (space, f0), ("l", "l")]
    tokenizer = _byte_level_tokenizer(merges)
    assert max(_encode(tokenizer, MULTILINGUAL)) >= 256  # the merges are in use
    return tokenizer


@pytest.fixture(scope="module")
def stories_tokenizer() -> PreTrainedTokenizerBase:
    """stories260K's SentencePiece-BPE tokenizer with byte fallback."""
    if not STORIES_DIR.is_dir():
        pytest.skip(f"{STORIES_DIR} is absent")
    return AutoTokenizer.from_pretrained(STORIES_DIR)


@pytest.fixture(params=["stories_tokenizer", "byte_tokenizer", "merged_byte_tokenizer"])
def any_tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    """Each of the three tokenizers in turn."""
    return request.getfixturevalue(request.param)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    tokenizer: PreTrainedTokenizerBase,
    generated: Sequence[int],
    *,
    prompt: Sequence[int] = (),
    stop: Sequence[str] = (),
    group_sizes: Sequence[int] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[IncrementalDetokenizer, list[DetokenizedDelta]]:
    """Push `generated` in groups (one token each by default) until done or stopped, then flush."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop, skip_special_tokens)
    deltas: list[DetokenizedDelta] = []
    position, sizes = 0, iter(group_sizes or [])
    while position < len(generated):
        size = next(sizes, 1)
        deltas.append(detokenizer.push(generated[position : position + size]))
        position += size
        if deltas[-1].stop_string is not None:
            return detokenizer, deltas
    deltas.append(DetokenizedDelta(detokenizer.flush(), None, 0))
    return detokenizer, deltas


def _joined(deltas: Sequence[DetokenizedDelta]) -> str:
    return "".join(delta.text for delta in deltas)


def _reference_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Reveal `text` one character at a time; cut before the first stop string to complete."""
    for end in range(1, len(text) + 1):
        longest = max((s for s in stops if s and text[:end].endswith(s)), key=len, default=None)
        if longest is not None:
            return text[: end - len(longest)], longest
    return text, None


def _assert_never_emits_what_is_later_trimmed(deltas: Sequence[DetokenizedDelta], final: str):
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        assert final.startswith(emitted), f"emitted {emitted!r} is not a prefix of {final!r}"


def test_one_token_at_a_time_never_breaks_characters(any_tokenizer: PreTrainedTokenizerBase):
    generated = _encode(any_tokenizer, MULTILINGUAL)
    detokenizer, deltas = _stream(any_tokenizer, generated)
    assert any("\ufffd" in any_tokenizer.decode([token]) for token in generated)  # split chars
    assert all("\ufffd" not in delta.text for delta in deltas)
    assert _joined(deltas) == any_tokenizer.decode(generated, skip_special_tokens=True)
    assert detokenizer.text == _joined(deltas) == MULTILINGUAL


def test_prompt_context_matches_decoding_prompt_and_output_together(
    any_tokenizer: PreTrainedTokenizerBase,
):
    # The prompt ends in byte tokens, and the output continues them with a character of its own.
    prompt = _encode(any_tokenizer, "Once upon a time 世界")
    # SentencePiece's normalizer puts a space in front of the encoded text by itself.
    sentencepiece = any_tokenizer.decode(_encode(any_tokenizer, "a") * 2) == "a a"
    words = _encode(any_tokenizer, "there was" if sentencepiece else " there was")
    generated = _encode(any_tokenizer, "a界")[1:] + words
    _, deltas = _stream(any_tokenizer, generated, prompt=prompt)
    together = any_tokenizer.decode(prompt + generated)
    assert _joined(deltas) == together[len(any_tokenizer.decode(prompt)) :]
    # SentencePiece strips the leading space of the first token decoded on its own; the prompt
    # context must keep it.
    assert _joined(_stream(any_tokenizer, words, prompt=prompt)[1]) == " there was"


def test_skipped_special_tokens_do_not_eat_the_next_space(stories_tokenizer):
    eos = stories_tokenizer.eos_token_id
    generated = (
        _encode(stories_tokenizer, "Hello") + [eos] * 8 + _encode(stories_tokenizer, "world")
    )
    for skip in (True, False):
        _, deltas = _stream(stories_tokenizer, generated, skip_special_tokens=skip)
        assert _joined(deltas) == stories_tokenizer.decode(generated, skip_special_tokens=skip)
    assert _joined(_stream(stories_tokenizer, generated)[1]) == "Hello world"


def test_stop_string_spanning_three_tokens(stories_tokenizer):
    generated = _encode(stories_tokenizer, "Once upon a time there was a little girl named Lily.")
    prefixes = [stories_tokenizer.decode(generated[:end]) for end in range(len(generated) + 1)]
    sizes = [len(prefixes[i + 1]) - len(prefixes[i]) for i in range(len(generated))]
    index = next(i for i in range(len(generated) - 2) if min(sizes[i : i + 3]) >= 2)
    # From the last character of token `index` to the first of token `index + 2`.
    stop = prefixes[index + 3][len(prefixes[index + 1]) - 1 : len(prefixes[index + 2]) + 1]
    expected = prefixes[index + 1][:-1]
    assert len(stop) == sizes[index + 1] + 2 and prefixes[-1].count(stop) == 1
    _, deltas = _stream(stories_tokenizer, generated, stop=[stop])
    assert len(deltas) == index + 3 and deltas[-1].stop_string == stop
    assert all(delta.stop_string is None for delta in deltas[:-1])
    assert _joined(deltas) == expected
    _assert_never_emits_what_is_later_trimmed(deltas, expected)


def test_partial_match_is_held_then_released(byte_tokenizer):
    generated = _encode(byte_tokenizer, "the fox ran")
    detokenizer, deltas = _stream(byte_tokenizer, generated, stop=["foo"])
    emitted = [_joined(deltas[: i + 1]) for i in range(len(deltas))]
    assert emitted[4] == "the " and emitted[5] == "the "  # "f", then "fo" are held back
    assert emitted[6] == "the fox"  # "x" shows it was not "foo"
    assert detokenizer.text == _joined(deltas) == "the fox ran"
    assert all(delta.stop_string is None for delta in deltas)


def test_stop_string_at_the_very_first_token(stories_tokenizer):
    generated = _encode(stories_tokenizer, "Once upon a time")
    detokenizer, deltas = _stream(stories_tokenizer, generated, stop=["Once"])
    assert deltas == [DetokenizedDelta("", "Once", 1)] and detokenizer.text == ""
    with pytest.raises(RuntimeError):
        detokenizer.push(generated[1:2])
    assert detokenizer.flush() == ""


def test_earliest_stop_string_wins(byte_tokenizer):
    generated = _encode(byte_tokenizer, "the quick brown fox jumps over the lazy dog")
    for stops in (["lazy", "fox", "quick"], ["quick", "lazy", "fox"]):
        for sizes in (None, [len(generated)], [3] * 20):
            _, deltas = _stream(byte_tokenizer, generated, stop=stops, group_sizes=sizes)
            assert (_joined(deltas), deltas[-1].stop_string) == ("the ", "quick")


def test_first_completed_stop_wins_regardless_of_grouping(byte_tokenizer):
    generated = _encode(byte_tokenizer, "xabcdefg")
    for sizes in (None, [len(generated)], [2, 6]):
        _, deltas = _stream(byte_tokenizer, generated, stop=["abcde", "bcd"], group_sizes=sizes)
        assert (_joined(deltas), deltas[-1].stop_string) == _reference_stop("xabcdefg", ["bcd"])


def test_nothing_later_trimmed_is_ever_emitted(any_tokenizer: PreTrainedTokenizerBase):
    text = "the lazy cat saw the lazy dog and the lazy dog saw it"
    generated = _encode(any_tokenizer, text)
    stops = ["the lazy dog", "saw the lazy dot"]
    expected = _reference_stop(text, stops)
    assert expected == ("the lazy cat saw ", "the lazy dog")
    for sizes in (None, [2] * 30, [5, 1, 7, 2, 9, 3, 11]):
        _, deltas = _stream(any_tokenizer, generated, stop=stops, group_sizes=sizes)
        assert (_joined(deltas), deltas[-1].stop_string) == expected
        _assert_never_emits_what_is_later_trimmed(deltas, expected[0])


def test_min_tokens_holds_back_stop_strings(byte_tokenizer):
    """vLLM ignores stop strings until min_tokens outputs exist (byte tokenizer: a token a byte)."""
    detokenizer = IncrementalDetokenizer(byte_tokenizer, [], stop=[","], min_tokens=5)
    assert detokenizer.push(_encode(byte_tokenizer, "a,b")) == DetokenizedDelta("a,b", None, 3)
    assert detokenizer.push(_encode(byte_tokenizer, ",")) == DetokenizedDelta(",", None, 1)
    # The fifth token may stop: the check runs from the min_tokens-th output on.
    assert detokenizer.push(_encode(byte_tokenizer, "c,d")) == DetokenizedDelta("c", ",", 2)
    assert detokenizer.text == "a,b,c"


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(byte_tokenizer):
    kept = IncrementalDetokenizer(byte_tokenizer, [], stop=[","], include_stop_str_in_output=True)
    assert kept.push(_encode(byte_tokenizer, "a,b")) == DetokenizedDelta("a,", ",", 2)
    ids = _encode(byte_tokenizer, "xyz")
    spelled = IncrementalDetokenizer(byte_tokenizer, [], include_stop_str_in_output=True)
    assert spelled.push(ids, ends_on_stop_token=True).text + spelled.flush() == "xyz"
    # By default the token that stopped the request is counted but not spelled out.
    plain = IncrementalDetokenizer(byte_tokenizer, [])
    assert plain.push(ids, ends_on_stop_token=True).text + plain.flush() == "xy"


def test_push_after_flush_is_an_error(byte_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_tokenizer, [], stop=["zz"])
    assert detokenizer.push(_encode(byte_tokenizer, "a z")) == DetokenizedDelta("a ", None, 3)
    assert detokenizer.flush() == "z" and detokenizer.text == "a z"
    with pytest.raises(RuntimeError):
        detokenizer.push([1])


def _random_stories_ids(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, n: int
) -> list[int]:
    """Random pieces, specials, and valid UTF-8 spelled as byte-fallback tokens.

    Invalid byte runs are left out: HF's ByteFallback decoder turns a whole run of byte tokens into
    U+FFFD once any of it is invalid, retroactively changing text no streaming decoder can recall.
    """
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    pieces = [i for i, token in enumerate(vocab) if not token.startswith("<0x")]
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.8:
            ids.append(rng.choice(pieces))
        else:
            char = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF)]))
            ids.extend(tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in char.encode()]))
    return ids


def _check_random_stream(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, generated: list[int], trial: int
) -> None:
    """Stream `generated` in random groups, without and then with random stop strings."""
    skip = trial % 2 == 0
    prompt = _encode(tokenizer, "One day, 世界 said") if trial % 3 == 0 else []
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip)
    together = tokenizer.decode(prompt + generated, skip_special_tokens=skip)
    assert together.startswith(prompt_text)
    full = together[len(prompt_text) :]
    stream = {"prompt": prompt, "skip_special_tokens": skip}
    stream["group_sizes"] = [rng.randrange(1, 6) for _ in generated]
    assert _joined(_stream(tokenizer, generated, **stream)[1]) == full
    if len(full) > 2:
        start = rng.randrange(len(full) - 1)
        stops = [full[start : start + rng.randrange(1, 5)], "".join(rng.sample(full, 2))]
        # A stop string containing U+FFFD could only complete at flush(), which reports none.
        stops = [stop.replace("\ufffd", "?") for stop in stops]
        expected = _reference_stop(full, stops)
        _, deltas = _stream(tokenizer, generated, stop=stops, **stream)
        assert (_joined(deltas), deltas[-1].stop_string) == expected
        _assert_never_emits_what_is_later_trimmed(deltas, expected[0])


def test_random_stories_streams_match_full_decode_and_stop_reference(stories_tokenizer):
    rng = random.Random(1234)
    for trial in range(300):
        generated = _random_stories_ids(stories_tokenizer, rng, rng.randrange(1, 60))
        _check_random_stream(stories_tokenizer, rng, generated, trial)


def test_random_byte_level_streams_match_full_decode_and_stop_reference(
    byte_tokenizer, merged_byte_tokenizer
):
    rng = random.Random(4321)
    for tokenizer in (byte_tokenizer, merged_byte_tokenizer):
        for trial in range(300):
            # Byte-level decoding is lossy but local, so any ids work, broken UTF-8 included.
            generated = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
            _check_random_stream(tokenizer, rng, generated, trial)


def test_per_push_work_stays_bounded_over_a_long_generation(stories_tokenizer):
    generated = _random_stories_ids(stories_tokenizer, random.Random(7), 2000)
    recorder = mock.Mock(wraps=stories_tokenizer)  # records every decode call, then runs it
    detokenizer = IncrementalDetokenizer(recorder, _encode(stories_tokenizer, "Hi"), ["\n\n\n"])
    recorder.decode.reset_mock()
    for token in generated:
        detokenizer.push([token])
    window_lengths = [len(call.args[0]) for call in recorder.decode.call_args_list]
    assert len(window_lengths) <= 2 * len(generated)
    assert max(window_lengths) <= 16
    full = stories_tokenizer.decode(generated, skip_special_tokens=True)
    assert detokenizer.text + detokenizer.flush() == full


def test_several_tokens_at_once_end_at_the_token_that_completes_the_stop_string(byte_tokenizer):
    """A speculative step hands over several tokens: the output keeps those up to the one that
    completed the stop string, as one token at a time would, and says how many."""
    generated = _encode(byte_tokenizer, "abc STOP xyz")
    detokenizer = IncrementalDetokenizer(byte_tokenizer, [], stop=["STOP"])
    assert detokenizer.push(generated[:4]) == DetokenizedDelta("abc ", None, 4)
    assert detokenizer.push(generated[4:]) == DetokenizedDelta("", "STOP", 4)  # "S", "T", "O", "P"
    assert detokenizer.text == "abc "
    # Without stop strings every token is kept in one go.
    plain = IncrementalDetokenizer(byte_tokenizer, [])
    assert plain.push(generated).num_tokens == len(generated)
