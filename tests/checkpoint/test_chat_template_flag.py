"""vLLM's --chat-template: a template, or its file, used instead of the model's by every part
that renders chats (the tokenizer process, the offline LLM), refused at start-up in one line
where it cannot be read or compiled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from baton import LLM
from baton.checkpoint.chat_template import read_chat_template
from baton.checkpoint.load import load_checkpoint
from baton.cli import build_parser
from baton.config import BatonConfig
from baton.config_cli import config_from_args
from baton.messages import ChatMessage
from baton.tokenizer_proc.chat import chat_prompt
from baton.tokenizer_proc.service import TokenizerService

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}[answer]"
CONVERSATION = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="yo")]
RENDERED = "<user>hi\n<assistant>yo\n[answer]"


def test_the_value_is_the_template_where_it_holds_a_brace_or_a_newline(tmp_path: Path) -> None:
    assert read_chat_template(TEMPLATE) == TEMPLATE
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    assert read_chat_template(str(file)) == TEMPLATE
    # An inline template is rarely a valid path (a name past 255 bytes raises, unless caught).
    long_template = TEMPLATE + "{# " + "x" * 400 + " #}"
    assert read_chat_template(long_template) == long_template
    with pytest.raises(ValueError, match="looks like a file path, and there is no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template does not compile"):
        read_chat_template("{% for m in messages %}unclosed")
    # Compiled, not only parsed: an unknown filter fails here, not in the tokenizer process.
    with pytest.raises(ValueError, match=r"--chat-template does not compile.*nosuchfilter"):
        read_chat_template("{{ messages | nosuchfilter }}")
    (tmp_path / "empty.jinja").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))


def test_it_replaces_the_models_template_where_chats_are_rendered(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = str(tiny_model_factory("qwen2"))
    own = load_checkpoint(model).tokenizer
    assert chat_prompt(own, CONVERSATION).text != RENDERED
    assert chat_prompt(load_checkpoint(model, TEMPLATE).tokenizer, CONVERSATION).text == RENDERED
    service = TokenizerService.from_config(BatonConfig(model=model, chat_template=TEMPLATE))
    assert chat_prompt(service.tokenizer, CONVERSATION).text == RENDERED
    llm = LLM(model, chat_template=TEMPLATE, dtype="float32")
    assert chat_prompt(llm.tokenizer, CONVERSATION).text == RENDERED
    # The built-in model has no template of its own; the flag gives it one.
    random_model = load_checkpoint("baton-random", TEMPLATE).tokenizer
    assert chat_prompt(random_model, CONVERSATION).text == RENDERED


def test_the_flag_has_vllms_name_and_the_launcher_refuses_a_bad_one_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = build_parser().parse_args(["launch", "--chat-template", TEMPLATE])
    assert config_from_args(args).chat_template == TEMPLATE
    from baton import launch

    argv = ["--model", "baton-random", "--chat-template", "/no/such.jinja", "--port", "1"]
    assert launch.main(argv) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "--chat-template '/no/such.jinja' looks like a file path" in record.getMessage()
