"""The KV cache's storage formats: one record of them (KV_CACHE_DTYPES, by the name
--kv-cache-dtype gives) and of what one token's head takes in each (kv_cache_row). Every
Python path that asks whether a cache holds int8 rows asks is_int8_rows; the C++ kernels
(csrc/paged_attention.cpp, csrc/step_ops.cpp) take such a cache as a uint8 tensor, INT8_ROWS.

The int8 KV cache's bytes: one head's D values of one token as D int8 codes followed by
D / 32 float16 scales, a scale per 32 consecutive values (llama.cpp's q8_0 grouping, so the
same bytes per token: 34 per 32 values). Codes first keep each 32 of them where a vector load
finds them; the scales follow in the same row, so a key's head is one read.

Value i of a head is codes[i] * scales[i // 32], with scale = max |x| / 127 over its 32, rounded
to float16 before the codes are taken, so a code never leaves [-127, 127].
"""

from __future__ import annotations

import torch

Q8_GROUP = 32  # values per scale
# The storage type of a cache of int8 rows: bytes, codes and scales together.
INT8_ROWS = torch.uint8
# The KV cache's storage types, by --kv-cache-dtype name.
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": INT8_ROWS,
}
STORAGE_TYPES = tuple(KV_CACHE_DTYPES.values())


def is_int8_rows(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of this storage type holds int8 rows (the format below)."""
    return cache_dtype == INT8_ROWS


def kv_cache_row(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one token's head in a KV cache of this storage type: its last dim."""
    return q8_row_bytes(head_dim) if is_int8_rows(cache_dtype) else head_dim


def kv_cache_name(cache_dtype: torch.dtype) -> str:
    """A storage type's name, as --kv-cache-dtype spells it."""
    return next(name for name, dt in KV_CACHE_DTYPES.items() if dt == cache_dtype)


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one token's head in the int8 cache."""
    if head_dim % Q8_GROUP:
        raise ValueError(f"an int8 KV cache needs a head size that is a multiple of {Q8_GROUP}")
    return head_dim + 2 * (head_dim // Q8_GROUP)


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) as int8 cache rows [..., q8_row_bytes(D)] INT8_ROWS."""
    groups = x.float().unflatten(-1, (-1, Q8_GROUP))
    scales = (groups.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    wide = scales.float()
    codes = torch.where(wide > 0, groups / wide, 0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat((codes.flatten(-2).view(INT8_ROWS), scales.squeeze(-1).view(INT8_ROWS)), -1)


def dequantize_q8(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Int8 cache rows [..., q8_row_bytes(D)] as values [..., D] in dtype."""
    head_dim = rows.shape[-1] * Q8_GROUP // (Q8_GROUP + 2)
    codes = rows[..., :head_dim].view(torch.int8).float().unflatten(-1, (-1, Q8_GROUP))
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float().unsqueeze(-1)
    return (codes * scales).flatten(-2).to(dtype)
