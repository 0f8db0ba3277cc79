"""What this machine is: its CPU's name and instruction sets, torch's CPU dispatch, and its
GPU, read once per process (the probe, probe.py, tries what it can run fast).

`GAPLESS_KERNELS` chooses among our kernels: `auto` (the default) runs the fastest the probe
finds; `fallback` forces the public ops everywhere (F.linear, F.scaled_dot_product_attention),
e.g. to rule the fast paths out; a level of extensions.LEVELS (`avx2`, `avx-vnni`, ...) runs
this CPU as one with only that level's instruction sets would run: our builds for it, and
every choice that follows from the CPU's flags (float32 without fast bf16, the KV cache's
`auto` type). Torch's own kernels take their caps from torch's variables
(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from gapless.kernels.extensions import LEVELS

# /proc/cpuinfo flag -> the name the startup line and the roofline report use.
ISA_FLAGS = {
    "f16c": "f16c",  # float16 <-> float32 conversion: every x86-64 CPU since 2013
    "avx2": "avx2",
    "avx_vnni": "avx-vnni",  # AVX-VNNI: VNNI's integer dots on 256-bit vectors, VEX-encoded
    "avx512f": "avx512",
    "avx512_vnni": "avx512-vnni",
    "avx512_bf16": "avx512-bf16",
    "amx_bf16": "amx",
}


@dataclass(frozen=True)
class Machine:
    cpu_name: str
    cpu_isa: tuple[str, ...]  # of ISA_FLAGS' values, in that order
    torch_cpu_capability: str  # what torch's own CPU kernels were dispatched to
    cuda: str | None  # name and compute capability of device 0

    @property
    def fast_cpu_bf16(self) -> bool:
        return "amx" in self.cpu_isa or "avx512-bf16" in self.cpu_isa


def kernels_setting() -> str:
    """GAPLESS_KERNELS, checked: auto, fallback or a level (see above)."""
    choice = os.environ.get("GAPLESS_KERNELS", "auto")
    if choice not in ("auto", "fallback", *LEVELS):
        raise ValueError(
            f"GAPLESS_KERNELS={choice!r}: choose auto, fallback or a level ({', '.join(LEVELS)})"
        )
    return choice


@functools.cache
def machine() -> Machine:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    name = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line),
        platform.processor() or platform.machine(),
    )
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in cpuinfo.splitlines()
            if line.startswith("flags")
        ),
        [],
    )
    isa = tuple(label for flag, label in ISA_FLAGS.items() if flag in flags)
    if (cap := kernels_setting()) in LEVELS:
        isa = tuple(label for label in isa if label in LEVELS[cap] or label == "f16c")
    cuda = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        cuda = f"{torch.cuda.get_device_name(0)} sm_{major}{minor}"
    return Machine(name, isa, torch.backends.cpu.get_cpu_capability(), cuda)
