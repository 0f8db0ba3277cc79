"""The form weight-only quantized weights take, read by the int8/int4 linears (see linear.py)
and written by model/quantize.py's on-load quantizers and model/gguf.py's unpacking."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupQuant:
    """A quantized [rows, cols] weight: value = scale * code + offset, per group of columns.

    codes: int8 (symmetric, offset None) or uint8 codes 0..15 (4-bit), [rows, cols];
    scale and offset: float32, [rows, cols / group size].
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.codes.shape
        # In place: ~6x faster here than addcmul with these broadcasts (prompt chunks
        # dequantize every weight per call).
        w = self.codes.view(rows, -1, self.group_size).to(dtype)
        w.mul_(self.scale[..., None].to(dtype))
        if self.offset is not None:
            w.add_(self.offset[..., None].to(dtype))
        return w.view(rows, cols)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupQuant:
        """The same rows moved (permuted, moved to a device) by fn, applied to each part."""
        offset = None if self.offset is None else fn(self.offset)
        return GroupQuant(fn(self.codes), fn(self.scale), offset)

    @staticmethod
    def cat(parts: list[GroupQuant]) -> GroupQuant:
        """The weights stacked by rows, as torch.cat of their float values would be."""
        offsets = [p.offset for p in parts]
        offset = None if offsets[0] is None else torch.cat(offsets)  # type: ignore[arg-type]
        return GroupQuant(
            torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), offset
        )
