"""The built-in byte-level tokenizer (the random model's, and the tests' tiny models').

It maps every UTF-8 byte to its own id (0..255) and adds a few special tokens after them, so any
text round-trips through encode/decode without a vocabulary file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.checkpoint.tokenizer import Tokenizer

BYTE_VOCAB_SIZE = 256
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
BYTE_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
# Role headers are plain text (bytes), so the template needs no extra special tokens.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_byte_tokenizer(vocab_size: int | None = None) -> Tokenizer:
    """A byte-level tokenizer: byte b is token b; BOS, EOS and PAD follow at 256, 257, 258.

    Encoding prepends BOS; decoding with `skip_special_tokens=True` returns the original text.
    With `vocab_size`, ids from 259 up to it become filler words (id 300 decodes to " w300").
    Encoding never produces them (there are no merges), but a model whose vocabulary is larger
    than the byte alphabet (the benchmark shapes) then decodes every id it samples to text, so
    servers that stream only non-empty text deltas still stream a chunk per token.
    """
    # Imported here: the launcher and the frontend read this module's constants (the random
    # model's config) and never load the tokenizers library.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors

    from baton.checkpoint.tokenizer import Tokenizer

    byte_to_char = byte_to_unicode()
    vocab = {byte_to_char[byte]: byte for byte in range(BYTE_VOCAB_SIZE)}
    for offset, token in enumerate(BYTE_SPECIAL_TOKENS):
        vocab[token] = BYTE_VOCAB_SIZE + offset
    space = byte_to_char[ord(" ")]
    for token_id in range(len(vocab), vocab_size or 0):
        vocab[f"{space}w{token_id}"] = token_id
    # No merges: BPE over the GPT-2 byte alphabet is then exactly one token per byte.
    tokenizer = Backend(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    bos_id = vocab[BOS_TOKEN]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    special_tokens = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    return Tokenizer(tokenizer, special_tokens, BYTE_CHAT_TEMPLATE)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, which the ByteLevel decoder expects."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    unprintable = [byte for byte in range(BYTE_VOCAB_SIZE) if byte not in table]
    for index, byte in enumerate(unprintable):
        table[byte] = chr(BYTE_VOCAB_SIZE + index)
    return table
