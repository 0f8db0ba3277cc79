"""Attention straight from the paged KV cache: a small C++ kernel (csrc/paged_attention.cpp),
compiled at install for each instruction-set level (extensions.py, build.py).

Why a kernel of our own: every public route reads a decode's history at 1-2 GB/s here.
Gathering each sequence's blocks, padding, masking and calling SDPA copies the whole history
every layer, and the CPU flash op spends its time on three query rows per KV head. The kernel
walks each sequence's block table in place, once per KV head for all the query heads that
share it. Prompt chunks in bf16, on CPUs with AVX512-BF16, run on it too: the flash op
computes bf16 attention at the float32 rate there, the kernel on the bf16 dot-product
instruction at over twice that; with AMX, its build for AMX multiplies on the tiles, where
the flash op took 1.2-2x its time (docs/benchmarks.md has the figures). Where it cannot be built (no
compiler, no Python headers) the probe says no and the public path runs.

The cache has its own dtype, whatever the query's: any of kv_format.py's storage types
(float32, bf16, f16, or int8 rows: head sizes that are multiples of 32). The kernel reads each in place,
converting a vector at a time, for decodes and prompt chunks alike: no dequantized copy of a
history. `supports` says which (query dtype, cache dtype) pairs each build runs.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from gapless.kernels import build
from gapless.kernels.extensions import LEVELS, PAGED_ATTENTION
from gapless.kernels.kv_format import STORAGE_TYPES

HEAD_DIMS = (16, 32, 64, 128, 256)  # compiled in; other models decode on SDPA
PREFILL_HEAD_DIMS = (32, 64, 128, 256)  # prompt chunks: whole vectors of bf16 pairs
QUERY_DTYPES = (torch.float32, torch.bfloat16)  # the output's dtype too


def supports(
    query_dtype: torch.dtype, cache_dtype: torch.dtype, prefill: bool, level: str | None = None
) -> bool:
    """Whether the build for `level` (None: this CPU's) attends queries of query_dtype over
    a cache of cache_dtype: decodes (prefill False) or prompt chunks (True). Decodes run every
    pair on every build; prompt chunks need bf16 queries and AVX512-BF16."""
    if query_dtype not in QUERY_DTYPES or cache_dtype not in STORAGE_TYPES:
        return False
    if not prefill:
        return True
    return query_dtype == torch.bfloat16 and "avx512-bf16" in LEVELS[level or build.cpu_level()]


@functools.cache
def extension(level: str | None = None) -> ModuleType | None:
    """The kernel built for `level` (None: this CPU's), or None where it cannot be."""
    return build.load(PAGED_ATTENTION, level)


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
    [blocks, block_size, Hkv, D] (int8 rows: [blocks, block_size, Hkv, D + D / 16], see
    kv_format.py), of a dtype `supports` pairs with q's. Sequence b has the first
    num_keys[b] keys of its row of block_tables [B, width]; its queries are the last n of
    them, and each attends causally (from `window` keys before its own, if set), or, prompt
    chunks, up to its last key in last_keys [B * n] (counted as num_keys counts) where
    given. Returns [B * n, H * D] in q's dtype."""
    scale = q.shape[-1] ** -0.5
    n = q.shape[0] // block_tables.shape[0]
    out = extension().paged_attention(  # type: ignore[union-attr]
        q.contiguous(), k_cache, v_cache, block_tables, num_keys, n, window or 0, scale, last_keys
    )
    return out.view(q.shape[0], -1)
