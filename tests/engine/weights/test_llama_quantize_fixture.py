"""A GGUF made by llama.cpp's own quantizer, loaded as stored: its mixed k-quants multiplied in
their blocks give transformers' tokens; and a GGUF held as stored takes its file's size in memory.

The fixture tests/fixtures/tiny-llama-Q3_K_M.gguf is a seeded random tiny Llama (2 layers, hidden
256, FFN 512, 4 heads / 2 KV heads, vocabulary 512, tied head) written in float32 by
`baton.bench.gguf_export.export_gguf` as tiny-llama-f32.gguf, then quantized with
`llama-quantize tiny-llama-f32.gguf tiny-llama-Q3_K_M.gguf Q3_K_M`, llama.cpp built from the
llama-cpp-python 0.3.36 sdist (commit 0c1e570). Q3_K_M stores q, k, gate and up in Q3_K, v in
Q5_K, o and down in Q4_K, and the embedding (the tied head) in Q6_K.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.models.layers import Linear
from baton.engine.native.formats import PARTS
from baton.hardware import isa_rank

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-llama-Q3_K_M.gguf"
REPO_ROOT = Path(__file__).resolve().parents[3]
MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2") or shutil.which("cc") is None,
    reason="a GGUF is held as stored by the native kernels: an AVX2 CPU and a C compiler",
)


def stored_formats(linear: Linear) -> list[str]:
    """The formats a linear layer's stored weight is in: one, or each part's."""
    compact = linear.compact
    return [part.format for part in compact.parts] if compact.format == PARTS else [compact.format]


def test_a_llama_quantize_q3_k_m_gguf_held_as_stored_gives_transformers_tokens(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(FIXTURE), max_model_len=256)
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # Every matrix held in the file's blocks, none as float32.
    assert linears and all(linear.compact is not None and linear.stored_only for linear in linears)
    assert all(linear.weight.numel() == 0 for linear in linears)
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        # q and k in Q3_K, v in Q5_K: one fused weight of three parts, each in its own format.
        assert attention.qkv_proj.compact.format == PARTS
        assert stored_formats(attention.qkv_proj) == ["q3_k", "q3_k", "q5_k"]
        assert stored_formats(attention.o_proj) == ["q4_k"]
        assert stored_formats(mlp.gate_up_proj) == ["q3_k"]  # gate and up: both Q3_K
        assert stored_formats(mlp.down_proj) == ["q4_k"]
    assert model.embedding_stored is not None and model.embedding_stored.format == "q6_k"
    assert model.embed_tokens.numel() == 0

    # transformers dequantizes the GGUF itself (gguf's numpy code) into float32 weights.
    shutil.copy(FIXTURE, tmp_path / FIXTURE.name)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=FIXTURE.name, dtype=torch.float32
    ).eval()
    # The 40-token prompt is past the compact kernels' 32 rows: its prefill multiplies the
    # blocks a float32 slab at a time; the others, and every decode step, in the compact kernels.
    prompts = [
        [1, 2, 3, 4, 5],
        [40, 41, 42],
        [7] * 40,
        [100, 200, 50, 25],
        [300 + i for i in range(45)],
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == 16
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output.token_ids])).logits[0]
        # Teacher-forced: each of Baton's tokens is transformers' argmax after the same prefix.
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == output.token_ids


# Run in a fresh interpreter, so that what this test process allocated before (the checkpoint's
# export) cannot be reused unseen by the load it measures; torch and baton are imported before
# the first reading, so imports do not count.
RSS_PROBE = """
import json, os, sys
import torch
from baton import LLM
from baton.engine.models.layers import Linear

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
llm = LLM(sys.argv[1], max_model_len=256, kv_cache_memory_bytes=16 << 20)
after = rss()
model = llm.engine.model
linears = [m for m in model.modules() if isinstance(m, Linear)]
held, blocks, layouts = set(), 0, 0
def count(tensor):
    key = (tensor.untyped_storage().data_ptr(), tensor.data_ptr())
    if key in held:
        return 0
    held.add(key)
    return tensor.nbytes
for linear in linears:
    for part in (linear.compact.parts or (linear.compact,)) if linear.compact else ():
        blocks += count(part.data)
        layouts += sum(count(t) for t in (part.panels, part.tiles) if t is not None)
blocks += count(model.embedding_stored.data) if model.embedding_stored is not None else 0
print(json.dumps({
    "growth": after - before,
    "linears": len(linears),
    "stored": all(m.compact is not None and m.stored_only for m in linears),
    "float32_weights": sum(m.weight.numel() for m in linears),
    "embedding": model.embed_tokens.numel(),
    "embedding_stored": model.embedding_stored is not None,
    "blocks": blocks,
    "layouts": layouts,
}))
"""

# Measured on a Zen AVX2 machine, loading a 4-layer hidden-1024 Llama (vocabulary 8192, untied)
# from its 79 MiB Q8_0 GGUF: RSS grew 116 MiB, 37 MiB beyond the file (the native library, the
# tokenizer, the KV pool's first pages, buffers). AVX-512 CPUs also hold each Q8_0 matrix in
# panels of 16 features, AMX ones in tiles: those copies are counted from the model and added
# to the bound. The model's float32 matrices would be 296 MiB more: file + 150 MiB (+ those
# copies) lies well between.
OVERHEAD_BYTES = 150 * MIB


def test_a_gguf_held_as_stored_takes_its_file_size_in_memory(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(
        "llama",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = export_gguf(model_dir, "float32", tmp_path / "wide-Q8_0.gguf", "Q8_0")
    file_bytes = path.stat().st_size
    # (in_features 1024 and 4096: whole 32-weight blocks, 34 bytes each.)
    float32_matrix_bytes = (
        4 * (1024 * (1024 + 2 * 256) + 1024 * 1024 + 3 * 1024 * 4096) + 2 * 8192 * 1024
    ) * 4
    assert float32_matrix_bytes > 3 * file_bytes
    probe = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO_ROOT,
        env=os.environ.copy(),
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    # No float32 matrix: every linear layer and the embedding hold only the file's blocks.
    assert result["linears"] > 0 and result["stored"]
    assert result["float32_weights"] == 0
    assert result["embedding"] == 0 and result["embedding_stored"]
    # The matrices' blocks are the file's bytes (less its metadata and F32 norms), held once.
    assert file_bytes - 2 * MIB < result["blocks"] <= file_bytes
    growth, layouts = result["growth"], result["layouts"]
    print(
        f"RSS growth {growth / MIB:.1f} MiB: file {file_bytes / MIB:.1f} MiB, "
        f"panels/tiles {layouts / MIB:.1f} MiB"
    )
    assert growth <= file_bytes + layouts + OVERHEAD_BYTES
    # float32 copies of the matrices would overshoot the bound by far more than its margin.
    assert float32_matrix_bytes > OVERHEAD_BYTES + 100 * MIB
