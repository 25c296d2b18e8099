"""GGUF checkpoints (llama.cpp's single-file format): architecture (gguf_config.py) and
tokenizer from the file alone, as vLLM and llama.cpp load them; the weights are the engine's
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

import functools
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

from baton.checkpoint import gguf_config
from baton.checkpoint.gguf_config import hf_config
from baton.checkpoint.model_config import CheckpointError

logger = logging.getLogger(__name__)

# Written into the converted folder: one whose files are all present is complete.
CONVERTED_MARKER = "gguf_source.json"
# Part of the cache key: a change to the conversion (here, or in transformers' tokenizer
# converter) must not reuse folders an older one wrote. The config's conversion is keyed by its
# module's source (`_config_source_digest`): no version to forget to bump.
CONVERSION_VERSION = 4


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
        _config_source_digest(),
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


@functools.cache
def _config_source_digest() -> str:
    """A digest of gguf_config.py, which builds the converted config.json."""
    return hashlib.sha256(Path(gguf_config.__file__).read_bytes()).hexdigest()[:16]


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
