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
from pathlib import Path
from types import ModuleType

import torch

from gapless.kernels import build

NAME = "gapless_paged_attention"
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
HEAD_DIMS = (16, 32, 64, 128, 256)  # compiled in; other models decode on SDPA
PREFILL_HEAD_DIMS = (32, 64, 128, 256)  # prompt chunks: whole vectors of bf16 pairs
ISA = ("avx2", "avx512", "avx512-bf16")  # what its code uses; more flags would only rebuild it


def build_directory() -> Path:
    """Where the kernel for this CPU's ISA flags is built and cached."""
    return build.build_directory(NAME, build.native_isa(ISA))


@functools.cache
def extension() -> ModuleType | None:
    """The kernel compiled for this CPU, or None where it cannot be built."""
    # -ffast-math lets gcc vectorize expf; the kernel has no infinities or NaNs to lose.
    cflags = ("-O3", "-fopenmp", "-ffast-math")
    what = "our paged attention kernel"
    return build.load_extension(NAME, [SOURCE], build.native_isa(ISA), cflags, what)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_keys: torch.Tensor,
    window: int | None,
    last_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """n new queries per sequence, q [B * n, H, D], whose keys are already in the caches
    [blocks, block_size, Hkv, D]. Sequence b has the first num_keys[b] keys of its row of
    block_tables [B, width]; its queries are the last n of them, and each attends causally
    (from `window` keys before its own, if set), or, prompt chunks, up to its last key in
    last_keys [B * n] (counted as num_keys counts) where given. Returns [B * n, H * D]."""
    scale = q.shape[-1] ** -0.5
    n = q.shape[0] // block_tables.shape[0]
    out = extension().paged_attention(  # type: ignore[union-attr]
        q.contiguous(), k_cache, v_cache, block_tables, num_keys, n, window or 0, scale, last_keys
    )
    return out.view(q.shape[0], -1)
