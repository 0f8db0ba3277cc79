"""The forms weight-only quantized weights take: a GGUF file's own blocks (BlockQuant, read by
BlockLinear and the block kernels), and codes with a scale and offset per group (GroupQuant,
read by torch's int8/int4 ops where our block kernels cannot be built)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
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


@dataclass(frozen=True)
class BlockQuant:
    """A quantized [rows, cols] weight held as a GGUF file's own blocks, in ggml's layout:
    each row is cols / block elements blocks of a fixed size (csrc/gguf_blocks.h). Nothing is
    unpacked: decode steps read these bytes, prompt chunks dequantize tiles of them.

    blocks: uint8 [rows, bytes per row]; qtype: ggml's type number (GGMLQuantizationType);
    interleaved: the rows interleaved by 16 (blocks.interleave), the layout BlockLinear runs
    decodes fastest on. Such a weight is built for our kernels only, once its rows are final:
    it gathers rows (a tied lm_head's serve the embedding lookups) but does not move, cut or
    stack them.
    """

    blocks: torch.Tensor
    qtype: int
    cols: int
    interleaved: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    @property
    def block_elems(self) -> int:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.qtype)][0]

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.qtype).name

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.interleaved:
            from gapless.kernels import blocks as block_kernels

            return block_kernels.dequantize(self.blocks, self.qtype, self.cols, dtype, True)
        return dequantize_blocks(self.blocks, self.qtype, self.cols, dtype)

    def interleave(self) -> BlockQuant:
        """The same weight with its rows interleaved (see interleaved)."""
        from gapless.kernels import blocks as block_kernels

        interleaved = block_kernels.interleave(self._file_layout(), self.qtype, self.cols)
        return BlockQuant(interleaved, self.qtype, self.cols, True)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows at index (any shape), dequantized: an embedding lookup. [*index, cols]"""
        if self.interleaved:
            from gapless.kernels import blocks as block_kernels

            rows = block_kernels.take_rows(self.blocks, self.qtype, self.cols, index.flatten())
        else:  # index_select, not blocks[index]: that took ~0.3 ms for one row here
            rows = self.blocks.index_select(0, index.flatten())
        flat = dequantize_blocks(rows, self.qtype, self.cols, dtype)
        return flat.view(*index.shape, self.cols)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockQuant:
        """The same rows moved (permuted, sliced, moved to a device) by fn."""
        return BlockQuant(fn(self._file_layout()), self.qtype, self.cols)

    def _file_layout(self) -> torch.Tensor:
        if self.interleaved:
            raise ValueError("interleaved blocks are read by our decode kernels only")
        return self.blocks

    def column_slice(self, columns: slice) -> BlockQuant:
        """Columns start..stop, which must fall on block boundaries: whole blocks are cut."""
        n = self.block_elems
        start, stop = columns.start or 0, columns.stop or self.cols
        if start % n or stop % n:
            raise ValueError(f"columns {start}:{stop} cut {self.type_name} blocks of {n}")
        size = self.blocks.shape[1] // (self.cols // n)
        cut = self._file_layout()[:, start // n * size : stop // n * size].contiguous()
        return BlockQuant(cut, self.qtype, stop - start)

    @staticmethod
    def cat(parts: list[BlockQuant]) -> BlockQuant:
        """The weights stacked by rows; all of one type."""
        if len({(p.qtype, p.cols) for p in parts}) > 1:
            raise ValueError("stacking weights of different block types or widths")
        stacked = torch.cat([p._file_layout() for p in parts])
        return BlockQuant(stacked, parts[0].qtype, parts[0].cols)


def dequantize_blocks(
    blocks: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows of GGUF blocks [rows, bytes per row] as floats [rows, cols]: on our kernel where
    it has the type, else on the `gguf` package's reference (numpy, on the CPU)."""
    from gapless.kernels import blocks as block_kernels

    if blocks.device.type == "cpu" and block_kernels.supported(qtype):
        return block_kernels.dequantize(blocks, qtype, cols, dtype)
    values = gguf.quants.dequantize(blocks.cpu().numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values).view(-1, cols).to(device=blocks.device, dtype=dtype)


Quantized = GroupQuant | BlockQuant  # both keep their rows apart: map_rows, cat
