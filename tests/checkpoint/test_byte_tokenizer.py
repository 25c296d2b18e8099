"""The byte-level tokenizer of the built-in model and the benchmark shapes."""

from __future__ import annotations

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer

TEXT = "Bytes: ünïcödé ✓"


def test_bytes_round_trip_behind_bos() -> None:
    tokenizer = build_byte_tokenizer()
    ids = tokenizer.encode(TEXT)
    assert ids[0] == 256 and ids[1:] == list(TEXT.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert len(tokenizer) == 259


def test_filler_words_spell_every_id_up_to_the_vocab_size() -> None:
    tokenizer = build_byte_tokenizer(vocab_size=300)
    assert len(tokenizer) == 300
    assert tokenizer.decode([259, 299]) == " w259 w299"
    # Encoding is unchanged: fillers are never produced from text.
    assert tokenizer.encode(TEXT) == build_byte_tokenizer().encode(TEXT)
    assert tokenizer.encode(" w259") == [256, *b" w259"]
