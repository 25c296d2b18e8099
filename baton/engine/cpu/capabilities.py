"""Detect this CPU's capabilities, once, in one place (see `compute_plan.py` and
`baton/hardware.py` for what they decide).

The ISA comes from the kernel's CPU flags, capped by what torch and oneDNN were told to use
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`
makes an AVX-512 machine behave as an AVX2-only one) and by `--max-cpu-isa`. Whether oneDNN can
pack weights of a dtype is not inferred but tried, on a tiny weight: that is the call that fails
on CPUs without its bf16 path.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from baton.hardware import ISA_LEVELS, CpuCapabilities, isa_rank

# The flags each level needs on top of the previous one (Linux /proc/cpuinfo names).
_LEVEL_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16"},
}
_REPORTED_FLAGS = sorted(set().union(*_LEVEL_FLAGS.values()) | {"avx512_vnni", "avx_vnni"})
_TORCH_CAPABILITY_CAP = {"DEFAULT": "default", "AVX2": "avx2"}  # AVX512: no cap


def isa_from_flags(flags: set[str]) -> str:
    """The highest ISA level whose flags (and all lower levels' flags) are all present."""
    level = "default"
    for candidate in ISA_LEVELS[1:]:
        if not _LEVEL_FLAGS[candidate] <= flags:
            break
        level = candidate
    return level


def onednn_isa_cap(value: str) -> str | None:
    """The ISA level an ONEDNN_MAX_CPU_ISA value allows (None: no cap, e.g. ALL)."""
    value = value.strip().upper()
    if value in ("", "ALL", "DEFAULT"):
        return None
    if "AMX" in value:
        return "amx"
    if value.startswith(("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10")):
        return "avx512_bf16"
    if value.startswith("AVX512"):
        return "avx512"
    if value.startswith("AVX2"):
        return "avx2"
    return "default"  # SSE41, AVX


def parse_cpuinfo(text: str) -> tuple[str, str, set[str]]:
    """(model name with family and model numbers, vendor, flags) of the first processor in
    /proc/cpuinfo's text. The numbers tell CPU generations apart where the name does not
    ("AMD EPYC" is Zen 3 as family 25 model 1, Zen 5 as family 26)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name", "unknown")
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    return model, fields.get("vendor_id", ""), set(fields.get("flags", "").split())


def _packable_dtypes() -> tuple[str, ...]:
    """The weight dtypes oneDNN packs here and then multiplies correctly (tried, not guessed)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    packable = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        try:
            weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 1)
            out = torch.ops.mkldnn._linear_pointwise(
                torch.ones(2, 16, dtype=dtype), weight, None, "none", [], ""
            )
        except (RuntimeError, AttributeError):
            continue
        if torch.equal(out, torch.full((2, 16), 16, dtype=dtype)):
            packable.append(name)
    return tuple(packable)


@functools.cache
def detect_cpu_capabilities(max_isa: str | None = None) -> CpuCapabilities:
    """This CPU's capabilities, its ISA capped at `max_isa` (`--max-cpu-isa`) if given."""
    cpuinfo = Path("/proc/cpuinfo")
    model, vendor, flags = parse_cpuinfo(cpuinfo.read_text() if cpuinfo.exists() else "")
    torch_capability = torch.backends.cpu.get_cpu_capability()
    detected = isa_from_flags(flags) if flags else "avx2"
    if not flags and torch_capability == "AVX512":
        detected = "avx512"  # no flags to read (not Linux): trust torch's own dispatch
    caps = {
        "ATEN_CPU_CAPABILITY": _TORCH_CAPABILITY_CAP.get(torch_capability),
        "ONEDNN_MAX_CPU_ISA": onednn_isa_cap(os.environ.get("ONEDNN_MAX_CPU_ISA", "")),
        "--max-cpu-isa": max_isa,
    }
    isa, limited_by = detected, None
    for source, cap in caps.items():
        if cap is not None and isa_rank(cap) < isa_rank(isa):
            isa, limited_by = cap, source
    return CpuCapabilities(
        model_name=model,
        num_cpus=os.cpu_count() or 1,  # the machine's, not this process's (it may be bound)
        isa=isa,
        detected_isa=detected,
        limited_by=limited_by,
        flags=tuple(flag for flag in _REPORTED_FLAGS if flag in flags),
        torch_capability=torch_capability,
        packable_dtypes=_packable_dtypes(),
        vendor=vendor,
    )
