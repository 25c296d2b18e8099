"""Initialising MKL's vector math before any parallel torch math runs (CPU).

torch's CPU elementwise math (cos, sin, exp, log, tanh, ...) calls MKL's vector math library
(VML) chunk by chunk, one chunk per OpenMP thread. VML sets itself up on its first call, and
that set-up is not thread-safe: when the process's first VML call runs on two threads at once,
one of them may compute its chunk at VML's lowest accuracy (EP, about 11 correct bits) although
torch asks for the highest (HA). Seen with torch 2.13.0+cpu in 10-20 % of fresh processes, on
the AMX Xeon with and without AVX2 emulation: the first half of the RoPE cos table, the
engine's first such call, was off by up to 1.5e-4, and every later token drifted from the same
model's (docs/design.md, "VML's first call").
"""

from __future__ import annotations

import torch


def initialize_vector_math() -> None:
    """Make one VML call on one element (one thread: far below torch's grain size), so that
    VML's set-up is done before any call that runs on several threads. Idempotent and cheap."""
    torch.ones(1).exp()
