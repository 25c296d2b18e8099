"""Whether a model fits this machine's memory, asked before any weight is read: a model that
does not fit is refused in one line at start-up, not killed by the kernel's OOM killer minutes
into loading (issue 45: an 8B Q4_K_M sat 2.5 minutes, then the scheduler died at 24 GB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch

from baton.checkpoint.load import Checkpoint
from baton.config import ConfigurationError
from baton.engine.native.formats import BLOCK_FORMATS
from baton.engine.weights.gguf_weights import gguf_bytes_of_types

# What a CPU engine holds besides its weights and KV pool: the interpreter, torch and oneDNN, the
# native kernels' buffers, a step's activations (measured on the default model: about 400 MiB).
RUNTIME_BYTES = 512 << 20
_GIB = 2**30


def expected_weight_bytes(
    checkpoint: Checkpoint,
    element_bytes: int,
    held_as_stored: bool,
    block_copies: int = 0,
    stored_copy: bool = True,
) -> int:
    """The bytes the engine will hold for `checkpoint`'s weights: a GGUF held as stored, its
    file, plus `block_copies` more of its Q8_0/Q4_0/Q4_1 matrices (AVX-512 CPUs keep them once
    more in panels, AMX CPUs in tiles: about their stored size each); else every parameter at
    `element_bytes` (the compute dtype's), plus, where `stored_copy` (the plan reads stored
    weights in small batches), the stored copy of a bf16/f16 checkpoint or a GGUF."""
    if checkpoint.path is None:
        return 0  # the built-in random model: a few MB
    if checkpoint.gguf_file is not None and held_as_stored:
        copied = gguf_bytes_of_types(checkpoint.gguf_file, BLOCK_FORMATS) if block_copies else 0
        return checkpoint.gguf_file.stat().st_size + block_copies * copied
    config = checkpoint.config
    hidden, inter = config.hidden_size, config.intermediate_size
    attention = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    moe = config.moe
    mlps = sum(
        3 * hidden * inter
        if moe is None or not moe.is_sparse(layer)
        # (every expert, the router, and a shared expert with its gate)
        else hidden * (3 * moe.num_experts * moe.expert_intermediate_size + moe.num_experts)
        + hidden * (3 * moe.shared_intermediate_size + int(moe.shared_intermediate_size > 0))
        for layer in range(config.num_layers)
    )
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    computed = (config.num_layers * attention + mlps + embeddings) * element_bytes
    if not stored_copy:
        return computed
    stored = checkpoint.gguf_file.stat().st_size if checkpoint.gguf_file else 0
    if checkpoint.stored_compactly and not checkpoint.gguf_file:
        stored = computed * 2 // element_bytes  # bf16/f16 matrices, kept for small batches
    return computed + stored


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """What this process may still allocate: the kernel's MemAvailable, or less under a cgroup
    (v2) limit; None where neither can be read."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            headroom = int(limit) - current
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available


def check_fits(weight_bytes: int, kv_pool_bytes: int, available: int | None) -> None:
    """ConfigurationError, in one line naming the fix, when weights, KV pool and runtime need
    more than `available` bytes (nothing is checked where that is unknown). The KV pool counts
    whole: on a CPU it is resident only as its pages fill, but a pool that cannot fill would
    end the server under load instead of now."""
    if available is None:
        return
    needed = weight_bytes + kv_pool_bytes + RUNTIME_BYTES
    if needed <= available:
        return
    raise ConfigurationError(
        f"the model does not fit in this machine's memory: it needs about "
        f"{needed / _GIB:.1f} GiB (weights {weight_bytes / _GIB:.1f}, KV pool "
        f"{kv_pool_bytes / _GIB:.1f}, runtime {RUNTIME_BYTES / _GIB:.1f}) and "
        f"{available / _GIB:.1f} GiB are available: give a smaller --kv-cache-memory-bytes or "
        "--max-model-len, or a smaller quantization of the model"
    )


def return_freed_heap() -> None:
    """Give the heap that loading freed back to the system (glibc's malloc_trim; elsewhere a
    no-op). Loading makes transient copies (a GGUF's q/k rows reordered, a rank's shards cut
    out of whole tensors) and frees them, but malloc keeps the freed pages: a tensor-parallel
    rank of the 1B Q4_K_M shape held 381 MiB of weights and 178 MiB more of such pages."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def memory_in_use(device: torch.device) -> int:
    """Bytes in use: on a GPU, allocated by torch there; on a CPU, the process's resident
    memory (what the weights and their copies really hold, packed or repacked)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mib(num_bytes: int) -> str:
    """`num_bytes` in MiB, as the start-up lines give memory."""
    return f"{num_bytes / 2**20:,.0f} MiB"
