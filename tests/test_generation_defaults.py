"""The model's sampling defaults (vLLM's --generation-config): read, checked, and given to the
requests that leave a parameter unset, over HTTP and offline."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.checkpoint.model_config import CheckpointError
from baton.cli import build_parser
from baton.config import BatonConfig
from baton.config_cli import config_from_args
from baton.frontend.chat_protocol import ChatCompletionRequest
from baton.frontend.params import chat_choices, completion_choices
from baton.frontend.protocol import CompletionRequest
from baton.generation_defaults import SamplingDefaults, load_sampling_defaults

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def with_generation_config(source: Path, folder: Path, config: dict) -> Path:
    """A copy of the checkpoint at `source` whose generation_config.json has `config`'s keys too."""
    shutil.copytree(source, folder)
    file = folder / "generation_config.json"
    existing = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**existing, **config}))
    return folder


@pytest.fixture
def qwen_like_dir(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> Path:
    return with_generation_config(
        tiny_model_factory("qwen2"), tmp_path / "model", {**QWEN_LIKE, "max_new_tokens": 6}
    )


def defaults_of(model: str, setting: str, overrides: dict | None, **config: object):
    return load_sampling_defaults(
        BatonConfig(
            model=model, generation_config=setting, override_generation_config=overrides, **config
        )
    )


def test_auto_reads_the_models_file_vllm_ignores_it_and_overrides_win(qwen_like_dir: Path) -> None:
    model = str(qwen_like_dir)
    assert defaults_of(model, "auto", None) == SamplingDefaults(**QWEN_LIKE, max_tokens=6)
    assert defaults_of(model, "vllm", None) == SamplingDefaults()
    assert defaults_of(model, "vllm", {"temperature": 0.2}) == SamplingDefaults(temperature=0.2)
    overridden = defaults_of(model, "auto", {"top_k": 5, "max_new_tokens": None})
    assert (overridden.top_k, overridden.max_tokens, overridden.top_p) == (5, None, 0.8)
    # A folder given by path; keys outside vLLM's six (do_sample, eos ids...) play no part.
    other = qwen_like_dir.parent / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"min_p": 0.1, "do_sample": true}')
    assert defaults_of(model, str(other), None) == SamplingDefaults(min_p=0.1)
    # The built-in model and a model without the file have none.
    assert defaults_of("baton-random", "auto", None) == SamplingDefaults()


@pytest.mark.parametrize(
    ("setting", "overrides", "message"),
    [
        ("/no/such/folder", None, "generation_config.json: missing"),
        ("auto", {"temperature": -1}, "temperature must be in"),
        ("auto", {"top_p": "high"}, r"got `str` - at `\$.top_p`"),
        ("auto", {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ],
)
def test_a_bad_generation_config_is_one_checkpoint_error(
    qwen_like_dir: Path, setting: str, overrides: dict | None, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        defaults_of(str(qwen_like_dir), setting, overrides)


def test_the_launcher_refuses_a_missing_generation_config_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from baton import launch

    argv = ["--model", "baton-random", "--generation-config", "/no/such", "--port", "1"]
    assert launch.main(argv) == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "/no/such/generation_config.json: missing" in record.getMessage()


def test_the_flags_take_vllms_names_and_a_json_object() -> None:
    args = ["launch", "--generation-config", "vllm", "--override-generation-config"]
    config = config_from_args(build_parser().parse_args([*args, '{"temperature": 0.3}']))
    assert (config.generation_config, config.override_generation_config) == (
        "vllm",
        {"temperature": 0.3},
    )
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*args, bad])


def test_requests_take_the_defaults_only_where_they_leave_a_field_unset() -> None:
    defaults = SamplingDefaults(**QWEN_LIKE, min_p=0.05, max_tokens=6)
    [plain] = completion_choices(CompletionRequest(prompt="a"), 1, defaults)
    assert (plain.params.temperature, plain.params.top_p, plain.params.top_k) == (0.7, 0.8, 20)
    assert (plain.params.min_p, plain.params.repetition_penalty) == (0.05, 1.05)
    # max_new_tokens caps the request's max_tokens (completions' default of 16 included).
    assert plain.params.max_tokens == 6
    explicit = CompletionRequest(prompt="a", temperature=0, top_k=-1, max_tokens=3)
    [chosen] = completion_choices(explicit, 1, defaults)
    assert (chosen.params.temperature, chosen.params.top_k, chosen.params.top_p) == (0, -1, 0.8)
    assert chosen.params.max_tokens == 3
    # A chat without max_tokens keeps none: the scheduler runs it to max_new_tokens or the
    # context's end, whichever comes first, once the prompt's length is known.
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=2)
    assert [c.params.max_tokens for c in chat_choices(chat, defaults)] == [None, None]
    assert [c.params.temperature for c in chat_choices(chat, defaults)] == [0.7, 0.7]
    # Without defaults, SamplingParams' own.
    [none] = completion_choices(CompletionRequest(prompt="a"), 1)
    assert (none.params.temperature, none.params.top_k, none.params.max_tokens) == (1.0, -1, 16)


def test_offline_generate_without_params_samples_with_the_models_defaults(
    qwen_like_dir: Path,
) -> None:
    llm = LLM(str(qwen_like_dir), override_generation_config={"temperature": 0})
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0, 20, None)
    [output] = llm.generate([[5, 6, 7]])
    assert len(output.token_ids) == 6 or output.finish_reason == "stop"
    # Near the context's end, the context's end comes first (no refusal, as vLLM's).
    prompt = ([5, 6, 7] * llm.engine.max_model_len)[: llm.engine.max_model_len - 3]
    [output] = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True))
    assert (len(output.token_ids), output.finish_reason) == (3, "length")
    # Explicit params are used as given.
    [output] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(output.token_ids) == 2
    assert LLM(str(qwen_like_dir), generation_config="vllm").get_default_sampling_params() == (
        SamplingParams()
    )


def test_under_speculation_a_penalty_default_is_left_out(
    qwen_like_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen2.5's generation config sets repetition_penalty 1.05, which --speculative-config
    cannot apply: its other defaults stay, and the server says so once."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    config = BatonConfig(model=str(qwen_like_dir), speculative_config=ngram)
    defaults = load_sampling_defaults(config, announce=True)
    assert defaults.repetition_penalty is None and defaults.temperature == 0.7
    assert "repetition_penalty 1.05 is not applied" in caplog.text
    llm = LLM(str(qwen_like_dir), speculative_config=ngram)
    assert len(llm.generate([[5, 6, 7]])[0].token_ids) <= 6  # served, not refused
