"""AVX2-only CPUs are guarded wherever the suite runs.

On a CPU with more than AVX2, the engine, bf16 and offline-benchmark tests run again in a
subprocess under torch's and oneDNN's own AVX2 emulation (`ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`, which on the AMX machine reproduced the AVX2-only failures exactly),
so a change that breaks AVX2-only machines fails CI on any machine. On an AVX2-only CPU the whole
suite already runs that path, and this test skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]
AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# Everything that computes with the engine on bf16 or float32 weights, packed or not.
GUARDED_TESTS = ["tests/engine", "tests/test_llm.py", "tests/bench/test_offline.py"]
# Not rerun: the default model (a GGUF) computes in float32 on every CPU, as the rest covers,
# and its transformers reference alone takes a minute to load; and the tests whose code has no
# ISA-dependent path (file parsing, tokenizers, the thread pool's protocol, grammars, drafting
# rules), which only lengthened the suite.
ISA_FREE_MODULES = [
    "tests/engine/weights/test_gguf_file.py",
    "tests/engine/native/test_thread_pool.py",
    "tests/engine/sampling/test_grammar.py",
    "tests/engine/attention/test_flashinfer_api.py",
    "tests/engine/speculation/test_ngram.py",
    "tests/engine/speculation/test_draft_budget.py",
]
NOT_RERUN = [arg for module in ISA_FREE_MODULES for arg in ("--ignore", module)]
NOT_RERUN += ["-k", "not tokenizer"]  # test_gguf's tokenizer conversions


@pytest.mark.slow
def test_engine_and_bf16_tests_pass_as_on_an_avx2_only_cpu() -> None:
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        pytest.skip("this CPU runs the AVX2 path itself: the whole suite covers it")
    env = {**os.environ, **AVX2_EMULATION}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    capability = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert capability.stdout.strip() == "AVX2", "torch ignored ATEN_CPU_CAPABILITY"
    # In the subprocess torch reports AVX2, so this test skips there: no recursion.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GUARDED_TESTS]
    command += NOT_RERUN
    result = subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"under AVX2 emulation:\n{result.stdout[-6000:]}"
