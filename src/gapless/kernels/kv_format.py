"""The int8 KV cache's bytes: one head's D values of one token as D int8 codes followed by
D / 32 float16 scales, a scale per 32 consecutive values (llama.cpp's q8_0 grouping, so the
same bytes per token: 34 per 32 values). Codes first keep each 32 of them where a vector load
finds them; the scales follow in the same row, so a key's head is one read.

Value i of a head is codes[i] * scales[i // 32], with scale = max |x| / 127 over its 32, rounded
to float16 before the codes are taken, so a code never leaves [-127, 127].
"""

from __future__ import annotations

import torch

Q8_GROUP = 32  # values per scale


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one token's head in the int8 cache."""
    if head_dim % Q8_GROUP:
        raise ValueError(f"an int8 KV cache needs a head size that is a multiple of {Q8_GROUP}")
    return head_dim + 2 * (head_dim // Q8_GROUP)


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) as int8 cache rows [..., q8_row_bytes(D)] uint8."""
    groups = x.float().unflatten(-1, (-1, Q8_GROUP))
    scales = (groups.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    wide = scales.float()
    codes = torch.where(wide > 0, groups / wide, 0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat(
        (codes.flatten(-2).view(torch.uint8), scales.squeeze(-1).view(torch.uint8)), -1
    )


def dequantize_q8(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Int8 cache rows [..., q8_row_bytes(D)] as values [..., D] in dtype."""
    head_dim = rows.shape[-1] * Q8_GROUP // (Q8_GROUP + 2)
    codes = rows[..., :head_dim].view(torch.int8).float().unflatten(-1, (-1, Q8_GROUP))
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float().unsqueeze(-1)
    return (codes * scales).flatten(-2).to(dtype)
