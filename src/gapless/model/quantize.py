"""Round-to-nearest quantization of a float weight at load (`--quantize`).

Where our block kernels run, into GGUF's own block formats, so that one kernel family serves
files and on-load quantization alike: int8 is Q8_0 (a scale per 32 columns), int4 with groups
of 32 is Q4_1 (a scale and a minimum per 32). Elsewhere, and for int4 groups of 64 or 128,
into GroupQuant codes for torch's int8/int4 ops (kernels/quant.py)."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

from gapless.kernels.quant import BlockQuant, GroupQuant

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


def quantize_blocks(w: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> BlockQuant:
    """w in GGUF blocks of qtype, by the `gguf` package's quantizer (llama.cpp's rounding)."""
    rows, cols = w.shape
    blocks = gguf.quants.quantize(w.float().cpu().numpy(), qtype)
    return BlockQuant(torch.from_numpy(blocks).to(w.device), int(qtype), cols)


Quantizer = Callable[[torch.Tensor], GroupQuant | BlockQuant]


def quantizer(method: str | None, group_size: int, blocks: bool = False) -> Quantizer | None:
    """The round-to-nearest quantizer `--quantize method` names, into GGUF blocks if blocks
    (our block kernels run); None for no quantization."""
    if method is None:
        return None
    if method == "int8":
        return (
            (lambda w: quantize_blocks(w, gguf.GGMLQuantizationType.Q8_0))
            if blocks
            else quantize_int8
        )
    if method == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if blocks and group_size == 32:
            return lambda w: quantize_blocks(w, gguf.GGMLQuantizationType.Q4_1)
        return lambda w: quantize_int4(w, group_size)
    raise ValueError(f"unknown quantization {method!r}; choose {' or '.join(QUANTIZE_CHOICES)}")
