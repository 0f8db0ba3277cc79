"""Attention straight from the paged KV cache: a small C++ kernel (csrc/), compiled for this
CPU's instruction set on first use and cached (~/.cache/gapless/kernels).

Why a kernel of our own: every public route reads a decode's history at 1-2 GB/s here.
Gathering each sequence's blocks, padding, masking and calling SDPA copies the whole history
every layer, and the CPU flash op spends its time on three query rows per KV head. The kernel
walks each sequence's block table in place, once per KV head for all the query heads that
share it. Prompt chunks in bf16, on CPUs with AVX512-BF16, run on it too: the flash op
computes bf16 attention at the float32 rate, the kernel on the bf16 dot-product instruction
at over twice that (docs/benchmarks.md has the figures). Where it cannot be built (no
compiler, no Python headers) the probe says no and the public path runs.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import platformdirs
import torch

from gapless.kernels.probe import machine

log = logging.getLogger("gapless.kernels")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
HEAD_DIMS = (16, 32, 64, 128, 256)  # compiled in; other models decode on SDPA
PREFILL_HEAD_DIMS = (32, 64, 128, 256)  # prompt chunks: whole vectors of bf16 pairs
# gcc flags per ISA the probe reports: the build is cached per flag set, so a cache shared
# by two machines never hands one the other's instructions.
ISA_CFLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512-bf16": ["-mavx512bf16"],
}


def build_directory() -> Path:
    """Where the kernel for this CPU's ISA flags is built and cached."""
    isa = [name.replace("-", "_") for name in machine().cpu_isa if name in ISA_CFLAGS]
    name = "_".join(["gapless_paged_attention", *isa])  # a Python module name
    return Path(platformdirs.user_cache_dir("gapless")) / "kernels" / name


@functools.cache
def extension() -> ModuleType | None:
    """The kernel compiled for this CPU, or None where it cannot be built."""
    from torch.utils.cpp_extension import load

    flags = [flag for name in machine().cpu_isa for flag in ISA_CFLAGS.get(name, [])]
    # -ffast-math lets gcc vectorize expf; the kernel has no infinities or NaNs to lose.
    cflags = ["-O3", "-fopenmp", "-ffast-math", *flags]
    build_dir = build_directory()
    log.info("kernels: loading our paged attention kernel (built on first use, ~30 s)")
    try:
        import fcntl  # POSIX; elsewhere the ImportError below means SDPA decodes

        build_dir.mkdir(parents=True, exist_ok=True)
        with (build_dir / "gapless.lock").open("w") as lock:
            # torch's own build lock is a plain file: a process killed mid-build leaves it, and
            # every later load would wait on it forever. Ours is a flock, which dies with its
            # process; whoever holds it knows any torch lock file left is stale.
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return load(
                name=build_dir.name,
                sources=[str(SOURCE)],
                extra_cflags=cflags,
                build_directory=str(build_dir),
            )
    except Exception as e:  # noqa: BLE001 - a compiler, ninja or headers missing, in many forms
        log.warning("kernels: our paged attention kernel not built (%s); using the torch paths", e)
        return None


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_keys: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """n new queries per sequence, q [B * n, H, D], whose keys are already in the caches
    [blocks, block_size, Hkv, D]. Sequence b has the first num_keys[b] keys of its row of
    block_tables [B, width]; its queries are the last n of them, and each attends causally
    (the last `window` keys up to its own, if set). Returns [B * n, H * D]."""
    scale = q.shape[-1] ** -0.5
    n = q.shape[0] // block_tables.shape[0]
    out = extension().paged_attention(  # type: ignore[union-attr]
        q.contiguous(), k_cache, v_cache, block_tables, num_keys, n, window or 0, scale
    )
    return out.view(q.shape[0], -1)
