"""Round-to-nearest quantization of a float weight into the form the int8/int4 linears take
(`--quantize`; GroupQuant, in kernels/quant.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gapless.kernels.quant import GroupQuant

QUANTIZE_CHOICES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32


def quantize_int8(w: torch.Tensor) -> GroupQuant:
    """Symmetric int8, one scale per output row (codes -127..127)."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / 127
    codes = (w.float() / scale.clamp_min(torch.finfo(torch.float32).tiny)).round()
    return GroupQuant(codes.clamp(-127, 127).to(torch.int8), scale, None)


def quantize_int4(w: torch.Tensor, group_size: int) -> GroupQuant:
    """Affine 4-bit per group of columns: a group's min and max are codes 0 and 15."""
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide {cols} columns")
    groups = w.float().view(rows, -1, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 15
    codes = (groups - low[..., None]) / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    codes = codes.round().clamp(0, 15).to(torch.uint8).view(rows, cols)
    return GroupQuant(codes, scale, low)


def quantizer(method: str | None, group_size: int) -> Callable[[torch.Tensor], GroupQuant] | None:
    """The round-to-nearest quantizer `--quantize method` names; None for no quantization."""
    if method is None:
        return None
    if method == "int8":
        return quantize_int8
    if method == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        return lambda w: quantize_int4(w, group_size)
    raise ValueError(f"unknown quantization {method!r}; choose {' or '.join(QUANTIZE_CHOICES)}")
