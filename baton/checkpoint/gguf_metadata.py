"""GGUF checkpoints (llama.cpp's single-file format): architecture and tokenizer from the file
alone, as vLLM and llama.cpp load them; the weights are the engine's
(engine/weights/gguf_weights.py).

Parsing a GGUF's metadata takes seconds (a 49K-token vocabulary is read entry by entry), and every
server process needs the config and most need the tokenizer, so the first load converts the
metadata into a Hugging Face folder (config.json and the tokenizer files, chat template
included) in a cache keyed by the file's path, size and modification time; later loads read that
folder like any checkpoint. The tokenizer is converted by transformers' GGUF converter, in a
short-lived subprocess (transformers imports torch, which no process but the scheduler should
hold) unless this process has imported transformers already.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from baton.checkpoint.model_config import FREQ_FACTORS_ROPE, CheckpointError

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp writes a Mixtral as a "llama" with experts (`llama.expert_count`).
GGUF_EXPERTS_OF_LLAMA = "MixtralForCausalLM"
# transformers' model types where llama.cpp's architecture names differ.
_HF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Written into the converted folder: one whose files are all present is complete.
CONVERTED_MARKER = "gguf_source.json"
# Part of the cache key: a change to the conversion (here, or in transformers' tokenizer
# converter) must not reuse folders an older one wrote.
CONVERSION_VERSION = 2
# Metadata keys (after "<architecture>.") without which no config can be built.
REQUIRED_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
)


def gguf_cache_root() -> Path:
    """Where converted GGUF metadata is kept: $XDG_CACHE_HOME/baton/gguf (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "baton" / "gguf"


def converted_folder(gguf_file: Path) -> Path:
    """The HF-style folder (config.json, tokenizer) for `gguf_file`, converted on first use."""
    gguf_file = gguf_file.resolve()
    try:
        stat = gguf_file.stat()
    except OSError as error:
        raise CheckpointError(f"{gguf_file}: unreadable: {error}") from error
    source = (
        gguf_file,
        stat.st_size,
        stat.st_mtime_ns,
        CONVERSION_VERSION,
        importlib.metadata.version("transformers"),
    )
    key = ":".join(map(str, source))
    folder = gguf_cache_root() / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (folder / CONVERTED_MARKER).is_file():
        return folder
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        _convert(gguf_file, partial)
        (partial / CONVERTED_MARKER).write_text(json.dumps({"gguf": key}))
        # Atomic: a process that finds the folder finds it whole.
        os.rename(partial, folder)
    except OSError as error:
        # Another process (a sibling server process) may have converted the same file meanwhile:
        # its folder is as good as ours. Otherwise the cache is not writable.
        if not (folder / CONVERTED_MARKER).is_file():
            raise CheckpointError(
                f"{gguf_file}: cannot write its converted metadata under {gguf_cache_root()} "
                f"(set XDG_CACHE_HOME to a writable folder): {error}"
            ) from error
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _convert(gguf_file: Path, target: Path) -> None:
    reader = _open(gguf_file)
    config = hf_config(reader, gguf_file)
    _check_tensor_types(reader, gguf_file)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    reason = _build_tokenizer(gguf_file, target)
    if reason is not None:
        raise CheckpointError(f"{gguf_file}: cannot build its tokenizer: {reason}")
    logger.info("converted the metadata of %s (once; cached)", gguf_file.name)


def _build_tokenizer(gguf_file: Path, target: Path) -> str | None:
    """Save the GGUF's tokenizer files into `target`; why it could not, or None."""
    if "transformers" in sys.modules:
        # This process holds transformers (and torch) already: a subprocess would only spend
        # seconds importing them again.
        try:
            _save_tokenizer(gguf_file, target)
        except Exception as error:  # the converter raises many types for a bad tokenizer
            return " ".join(f"{type(error).__name__}: {error}".split())  # one line, as below
        return None
    command = [sys.executable, "-m", __name__, str(gguf_file), str(target)]
    converted = subprocess.run(command, capture_output=True, text=True)
    if converted.returncode != 0:
        return (converted.stderr.strip().splitlines() or ["no output"])[-1]
    return None


def _open(gguf_file: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(gguf_file)
    except Exception as error:  # truncated or not GGUF: the reader raises several types
        raise CheckpointError(f"{gguf_file}: not a readable GGUF file: {error}") from error


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# llama.cpp's tensor of RoPE frequency factors (the config's FREQ_FACTORS_ROPE scaling).
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def hf_config(reader: Any, gguf_file: Path) -> dict[str, Any]:
    """A Hugging Face config.json for the GGUF's model; CheckpointError for an architecture
    Baton does not run."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf_file}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{gguf_file}: RoPE scaling {scaling!r} is not supported")
    missing = [f"{arch}.{key}" for key in REQUIRED_KEYS if _field(reader, f"{arch}.{key}") is None]
    if missing:
        raise CheckpointError(f"{gguf_file}: GGUF metadata lacks {', '.join(missing)}")
    names = {tensor.name for tensor in reader.tensors}
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden_size = _field(reader, f"{arch}.embedding_length")
    eos_ids = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    experts = _field(reader, f"{arch}.expert_count") or 0
    mixtral = arch == "llama" and experts > 0
    return {
        "architectures": [GGUF_EXPERTS_OF_LLAMA if mixtral else GGUF_ARCHITECTURES[arch]],
        "model_type": "mixtral" if mixtral else _HF_MODEL_TYPES.get(arch, arch),
        "vocab_size": _field(reader, f"{arch}.vocab_size") or len(tokens),
        "hidden_size": hidden_size,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "rms_norm_eps": _decimal(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _decimal(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_freq_factors(reader),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names or "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(i for i in eos_ids if i is not None)),
        # llama.cpp and transformers compute a GGUF in float32, whatever its storage types.
        "torch_dtype": "float32",
        **(_experts_config(reader, arch) if experts else {}),
    }


def _experts_config(reader: Any, arch: str) -> dict[str, Any]:
    """A mixture of experts' config.json fields (moe_config.py reads them) from its GGUF:
    every layer routes (llama.cpp has no dense layers among sparse ones for these), and the
    top-k weights are renormalised as llama.cpp does for each architecture (Qwen3-MoE and
    Mixtral: yes, Qwen2-MoE: no; it reads no setting of the file's for it)."""
    fields: dict[str, Any] = {
        "num_experts_per_tok": _field(reader, f"{arch}.expert_used_count"),
        "norm_topk_prob": arch != "qwen2moe",
    }
    if arch == "llama":
        return {**fields, "num_local_experts": _field(reader, f"{arch}.expert_count")}
    return {
        **fields,
        "num_experts": _field(reader, f"{arch}.expert_count"),
        "moe_intermediate_size": _field(reader, f"{arch}.expert_feed_forward_length"),
        "shared_expert_intermediate_size": _field(
            reader, f"{arch}.expert_shared_feed_forward_length", 0
        ),
        "decoder_sparse_step": 1,
    }


def _rope_freq_factors(reader: Any) -> dict[str, Any] | None:
    """The GGUF's RoPE frequency factors as the converted config's rope scaling, None without
    them: llama.cpp's converter stores a Llama 3.1+ model's llama3 scaling as `rope_freqs`, one
    factor per rotary frequency that divides it (1 for short wavelengths, the scaling factor for
    long ones, a blend between). Kept as the file's float32 values, so the frequencies are
    computed as llama.cpp computes them."""
    import gguf

    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    return {"rope_type": FREQ_FACTORS_ROPE, "factors": [float(value) for value in factors]}


def _decimal(value: float) -> float:
    """The decimal a float32 field was written from (1e-05, not 9.99999974737875e-06)."""
    return float(f"{value:.7g}")


def _check_tensor_types(reader: Any, gguf_file: Path) -> None:
    """CheckpointError naming any storage type the `gguf` package cannot dequantize, tried on
    one tensor of each type (a few bytes each), so the failure comes at load, not mid-way."""
    import gguf

    tried: set[int] = set()
    for tensor in reader.tensors:
        if tensor.tensor_type in tried:
            continue
        tried.add(tensor.tensor_type)
        try:
            gguf.quants.dequantize(tensor.data[:1], tensor.tensor_type)
        except NotImplementedError as error:
            raise CheckpointError(
                f"{gguf_file}: tensor {tensor.name!r} is stored as "
                f"{tensor.tensor_type.name}, which cannot be dequantized: {error}"
            ) from error


def _save_tokenizer(gguf_file: Path, target: Path) -> None:
    """The GGUF's tokenizer, saved as tokenizer files (in this process or the subprocess)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(str(target))


if __name__ == "__main__":
    _save_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
