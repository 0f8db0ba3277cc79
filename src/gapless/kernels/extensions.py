"""Our C++ extensions (csrc/) and the instruction-set levels each is compiled for.

The one table that setup.py reads to compile every (extension, level) pair at install, and
that build.py reads to load the build this CPU runs. It imports nothing of gapless (nor
torch), so setup.py can load it by its path before gapless is installed.

A level is cumulative: a CPU runs it when it has every instruction set in it, and runs the
highest such level. An extension takes from a level only the flags its code tests for, so
levels that differ in nothing it uses share one build (the paged kernel has no VNNI code).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")

# gcc flags per instruction set, under the names the probe reports (machine.ISA_FLAGS).
ISA_CFLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx-vnni": ("-mavxvnni",),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512-vnni": ("-mavx512vnni",),
    "avx512-bf16": ("-mavx512bf16",),
    "amx": ("-mamx-tile", "-mamx-bf16"),
}

# Every level the run-time choice may pick on x86-64, lowest first.
LEVELS = {
    "portable": (),
    "avx2": ("avx2",),
    "avx-vnni": ("avx2", "avx-vnni"),  # Intel cores without AVX-512: Alder Lake and later
    "avx512": ("avx2", "avx512"),
    "avx512-vnni": ("avx2", "avx512", "avx512-vnni"),
    "avx512-bf16": ("avx2", "avx512", "avx512-vnni", "avx512-bf16"),
    "amx": ("avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx"),
}


@dataclass(frozen=True)
class Extension:
    name: str
    sources: tuple[str, ...]  # in csrc/
    cflags: tuple[str, ...]
    uses: tuple[str, ...]  # the instruction sets its code tests for (#if defined(__AVX2__)...)

    def isa(self, level: str) -> tuple[str, ...]:
        """The instruction sets its build for `level` is compiled with."""
        return tuple(name for name in LEVELS[level] if name in self.uses)

    def module(self, level: str) -> str:
        """The Python module name of its build for `level`, shared by levels that give it
        the same flags."""
        isa = "_".join(n.replace("-", "_") for n in self.isa(level))
        return f"{self.name}_{isa or 'portable'}"

    def compile_flags(self, level: str) -> list[str]:
        """Every flag its build for `level` is compiled with."""
        return [*self.cflags, *(flag for name in self.isa(level) for flag in ISA_CFLAGS[name])]

    def source_paths(self) -> list[Path]:
        return [CSRC / s for s in self.sources]

    def digest(self, level: str) -> str:
        """A hash of what its build for `level` is made of: the sources, every header in
        csrc/, and the flags. A build whose digest (written beside it) differs is stale."""
        h = hashlib.sha256()
        for path in [*self.source_paths(), *sorted(CSRC.glob("*.h"))]:
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        h.update(" ".join(self.compile_flags(level)).encode())
        return h.hexdigest()[:16]

    def builds(self) -> dict[str, str]:
        """Each distinct build's module name -> the lowest level that gives it."""
        out: dict[str, str] = {}
        for level in LEVELS:
            out.setdefault(self.module(level), level)
        return out


# -ffast-math lets gcc vectorize expf; the kernel has no infinities or NaNs to lose.
PAGED_ATTENTION = Extension(
    "paged_attention",
    ("paged_attention.cpp",),
    ("-O3", "-fopenmp", "-ffast-math"),
    ("avx2", "avx512", "avx512-bf16", "amx"),
)
# The GGUF block kernels, with the step's small ops and the experts' grouped linears. No FMA
# contraction: dequantize's d * code + m must round as the `gguf` package's numpy.
GGUF_BLOCKS = Extension(
    "gguf_blocks",
    (
        "gguf_ops.cpp",
        "gguf_q32.cpp",
        "gguf_kquants.cpp",
        "step_ops.cpp",
        "expert_ops.cpp",
        "decode_layers.cpp",
    ),
    ("-O3", "-fopenmp", "-ffp-contract=off"),
    ("avx2", "avx-vnni", "avx512", "avx512-vnni"),
)
EXTENSIONS = (PAGED_ATTENTION, GGUF_BLOCKS)

# The package the install puts the builds in (build.py imports them from there).
PACKAGE = "gapless.kernels.prebuilt"
