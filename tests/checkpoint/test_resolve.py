"""Config parsing, checkpoint resolution and validation, and the built-in random model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import EOS_ID, EXTRA_EOS_ID, VOCAB_SIZE, tiny_hf_model
from safetensors.torch import save_file
from transformers import AutoConfig

from baton.checkpoint.load import CheckpointError, load_checkpoint
from baton.checkpoint.model_config import ModelConfig
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.checkpoint.source import load_model_config
from baton.engine.models.causal_lm import CausalLM
from baton.engine.weights.checkpoint_tensors import iter_weights

LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config_json(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / model_dir.name
    shutil.copytree(model_dir, target)
    return target


def _rewrite_config(model_dir: Path, **changes: object) -> None:
    config = _config_json(model_dir)
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


# --- config parsing ---------------------------------------------------------------------------


def test_config_matches_transformers_own_parsing(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_hf(_config_json(tiny_model_dir))
    reference = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.architecture == reference.architectures[0]
    assert config.num_layers == reference.num_hidden_layers
    assert config.num_heads == reference.num_attention_heads
    assert config.num_kv_heads == reference.num_key_value_heads
    expected_head_dim = getattr(reference, "head_dim", None) or (
        reference.hidden_size // reference.num_attention_heads
    )
    assert config.head_dim == expected_head_dim
    assert config.rope_theta == reference.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings == reference.tie_word_embeddings
    assert config.vocab_size == VOCAB_SIZE
    assert config.eos_token_ids == (EOS_ID,)
    assert config.torch_dtype == "float32"


def test_variant_flags(tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_qwen3_dir: Path) -> None:
    llama = ModelConfig.from_hf(_config_json(tiny_llama_dir))
    qwen2 = ModelConfig.from_hf(_config_json(tiny_qwen2_dir))
    qwen3 = ModelConfig.from_hf(_config_json(tiny_qwen3_dir))
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    assert llama.head_dim == 24 and llama.head_dim != llama.hidden_size // llama.num_heads
    assert llama.rope_scaling == {"rope_type": "llama3", **LLAMA3_ROPE}
    assert qwen2.rope_scaling is None and qwen2.rope_theta == 1e6


def test_old_and_new_rope_styles_parse_identically(tiny_llama_dir: Path) -> None:
    new_style = _config_json(tiny_llama_dir)
    assert "rope_parameters" in new_style
    old_style = {key: value for key, value in new_style.items() if key != "rope_parameters"}
    old_style["rope_theta"] = 10000.0
    old_style["rope_scaling"] = {"type": "llama3", **LLAMA3_ROPE}
    old_style["torch_dtype"] = old_style.pop("dtype", "float32")
    assert ModelConfig.from_hf(old_style) == ModelConfig.from_hf(new_style)


def test_defaults_list_eos_and_dtype_key() -> None:
    config = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 32,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "max_position_embeddings": 128,
            "eos_token_id": [5, 7],
            "dtype": "bfloat16",
            "rope_scaling": {"rope_type": "default"},
        }
    )
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 8 and config.num_kv_heads == 8
    assert config.eos_token_ids == (5, 7)
    assert config.torch_dtype == "bfloat16"
    assert config.rope_scaling is None and config.rope_theta == 10000.0
    assert not config.tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM"),
        (  # Phi-3's 128k variants without their factors (tests/engine/models/test_phi3.py)
            {"architectures": ["Phi3ForCausalLM"], "rope_parameters": {"rope_type": "longrope"}},
            "longrope short_factor must be a list of 12 numbers > 0",
        ),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 5},
            "5 experts per token of 4: need 1 <= top-k <= experts",
        ),
        (
            {
                "architectures": ["Qwen2MoeForCausalLM"],
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 0,
            },
            "the experts' intermediate size must be positive",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        # Values that once loaded, or failed with a message naming no key.
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"hidden_size": "abc"}, "hidden_size must be a positive integer, got 'abc'"),
        ({"intermediate_size": 2.5}, "intermediate_size must be a positive integer"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be a positive integer"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_unsupported_configs_are_rejected(tiny_llama_dir: Path, change: dict, message: str) -> None:
    config = {**_config_json(tiny_llama_dir), **change}
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(config)


# --- checkpoint folders -----------------------------------------------------------------------


def test_load_folder(tiny_qwen2_dir: Path) -> None:
    checkpoint = load_checkpoint(str(tiny_qwen2_dir))
    assert checkpoint.name == tiny_qwen2_dir.name
    assert checkpoint.path == tiny_qwen2_dir
    # config.json's EOS first, then generation_config.json's extra one.
    assert checkpoint.eos_token_ids == (EOS_ID, EXTRA_EOS_ID)
    assert (
        checkpoint.tokenizer.decode(checkpoint.tokenizer.encode("héllo"), skip_special_tokens=True)
        == "héllo"
    )
    reference = tiny_hf_model("qwen2").state_dict()
    weights = dict(iter_weights(checkpoint))
    assert "lm_head.weight" not in weights  # tied: transformers does not save it
    assert weights.keys() == reference.keys() - {"lm_head.weight"}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)


def test_sharded_checkpoint_loads_like_single_file(
    tiny_model_factory, tiny_llama_dir: Path
) -> None:
    sharded_dir = tiny_model_factory("llama", max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 2
    sharded = load_checkpoint(str(sharded_dir))
    single = load_checkpoint(str(tiny_llama_dir))
    assert sharded.config == single.config
    sharded_weights = dict(iter_weights(sharded))
    single_weights = dict(iter_weights(single))
    assert sharded_weights.keys() == single_weights.keys()
    for name, tensor in single_weights.items():
        assert torch.equal(sharded_weights[name], tensor), name


def test_hub_ids_are_downloaded(monkeypatch: pytest.MonkeyPatch, tiny_qwen3_dir: Path) -> None:
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append((repo_id, allow_patterns))
        return str(tiny_qwen3_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    checkpoint = load_checkpoint("some-org/tiny-qwen3")
    assert checkpoint.name == "some-org/tiny-qwen3"
    assert checkpoint.config.architecture == "Qwen3ForCausalLM"
    [(repo_id, patterns)] = calls
    assert repo_id == "some-org/tiny-qwen3"
    assert "*.safetensors" in patterns and "*.bin" not in patterns


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_config", "config.json"),
        ("bad_json", "config.json"),
        ("bad_architecture", "GPT2LMHeadModel"),
        ("no_weights", "model.safetensors"),
        ("no_tokenizer", "tokenizer"),
        ("missing_shard", "model-00002"),
        ("bad_generation_config", "generation_config.json"),
    ],
)
def test_malformed_folders(
    tmp_path: Path, tiny_model_factory, tiny_llama_dir: Path, breakage: str, message: str
) -> None:
    source = (
        tiny_model_factory("llama", max_shard_size="40KB")
        if breakage == "missing_shard"
        else tiny_llama_dir
    )
    model_dir = _copy(source, tmp_path)
    if breakage == "no_config":
        (model_dir / "config.json").unlink()
    elif breakage == "bad_json":
        (model_dir / "config.json").write_text("{not json")
    elif breakage == "bad_architecture":
        _rewrite_config(model_dir, architectures=["GPT2LMHeadModel"])
    elif breakage == "no_weights":
        (model_dir / "model.safetensors").unlink()
    elif breakage == "no_tokenizer":
        (model_dir / "tokenizer.json").unlink()
        (model_dir / "tokenizer_config.json").unlink()
    elif breakage == "missing_shard":
        next(model_dir.glob("model-00002-*.safetensors")).unlink()
    elif breakage == "bad_generation_config":
        (model_dir / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(str(model_dir))


def test_missing_local_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        load_checkpoint(str(tmp_path / "absent"))


def test_bad_safetensors_file(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path)
    (model_dir / "model.safetensors").write_bytes(b"garbage")
    checkpoint = load_checkpoint(str(model_dir))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        next(iter_weights(checkpoint))


def test_float16_checkpoint_is_cast_on_load(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path)
    weights = dict(iter_weights(load_checkpoint(str(tiny_llama_dir))))
    save_file({name: t.half() for name, t in weights.items()}, str(model_dir / "model.safetensors"))
    config = load_checkpoint(str(model_dir)).config
    model = CausalLM(config, torch.float32, "cpu")
    model.load_weights(iter_weights(load_checkpoint(str(model_dir))))
    assert model.norm.weight.dtype == torch.float32
    torch.testing.assert_close(model.norm.weight, weights["model.norm.weight"].half().float())


# --- the built-in random model ------------------------------------------------------------------

UTF8_SAMPLES = [
    "",
    "Hello, world!",
    "  leading and trailing spaces \t\n",
    "héllo wörld — ça va? ñ",
    "日本語のテキスト, 中文, 한국어",
    "emoji 🎉🧪👩‍👩‍👧 and combining e\u0301",
    "\x00\x01 control \x7f bytes",
]


def test_default_model_needs_no_files(random_checkpoint) -> None:
    assert random_checkpoint.name == "baton-random"
    assert random_checkpoint.path is None
    config = random_checkpoint.config
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_kv_heads < config.num_heads
    assert config.vocab_size == len(random_checkpoint.tokenizer)
    assert random_checkpoint.eos_token_ids == (random_checkpoint.tokenizer.eos_token_id,)


@pytest.mark.parametrize("text", UTF8_SAMPLES)
def test_default_tokenizer_round_trips_utf8(random_checkpoint, text: str) -> None:
    tokenizer = random_checkpoint.tokenizer
    ids = tokenizer.encode(text)
    # One token per UTF-8 byte, after BOS: byte b is token b.
    assert ids == [tokenizer.bos_token_id, *text.encode("utf-8")]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_default_chat_template(random_checkpoint) -> None:
    tokenizer = random_checkpoint.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.chat_template is not None
    text = tokenizer.chat_template.render(messages, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_default_weights_are_deterministic(random_checkpoint) -> None:
    first = list(iter_weights(random_checkpoint))
    second = list(iter_weights(load_checkpoint(RANDOM_MODEL_NAME)))
    assert [name for name, _ in first] == [name for name, _ in second]
    for (name, a), (_, b) in zip(first, second, strict=True):
        assert torch.equal(a, b), name
    # Distinct tensors, not one repeated draw.
    assert not torch.equal(first[1][1], first[-1][1])


def test_model_config_alone_matches_the_checkpoints(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    assert load_model_config(str(tiny_qwen2_dir)) == load_checkpoint(str(tiny_qwen2_dir)).config
    assert load_model_config(RANDOM_MODEL_NAME) == load_checkpoint(RANDOM_MODEL_NAME).config
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        load_model_config(str(tmp_path / "missing"))
