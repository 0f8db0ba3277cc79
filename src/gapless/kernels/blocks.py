"""Matmuls straight from a GGUF file's quantized blocks (csrc/gguf_*.cpp), compiled at
install for each instruction-set level like the paged kernel (extensions.py, build.py).

Why kernels of our own: a float copy of a quantized weight is 4-8x its bytes in memory and
in every decode step's reads. Here the weight stays in the file's blocks. Decode rows (a
few activation rows) are quantized to 8 bits per block and dotted with the blocks as stored,
so a step streams the quantized bytes and nothing else; prompt chunks dequantize a tile of
weight rows at a time into a small buffer and multiply there (never the whole weight).
The same build holds the step's small ops (step_ops.py) and the experts' grouped linears
(moe.py).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from gapless.kernels import build
from gapless.kernels.extensions import GGUF_BLOCKS


@functools.cache
def extension(level: str | None = None) -> ModuleType | None:
    """The kernels built for `level` (None: this CPU's), or None where they cannot be."""
    return build.load(GGUF_BLOCKS, level)


def supported(qtype: int) -> bool:
    """Whether our kernels (built for this CPU) have ggml type `qtype`."""
    ext = extension()
    return ext is not None and ext.has_type(qtype)


def can_interleave(qtype: int) -> bool:
    """Whether our kernels (built for this CPU) interleave rows of ggml type `qtype`."""
    ext = extension()
    return ext is not None and ext.can_interleave(qtype)


def interleave(blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """Blocks uint8 [R, bytes per row], R a multiple of 16, with their rows interleaved by 16
    (csrc/gguf_blocks.h): the same bytes permuted, so that a decode product unpacks and
    scales 16 rows per vector instruction (what llama.cpp calls repacking)."""
    return extension().interleave(blocks, qtype, cols)  # type: ignore[union-attr]


def take_rows(blocks: torch.Tensor, qtype: int, cols: int, index: torch.Tensor) -> torch.Tensor:
    """Rows index [n] of interleaved blocks (as `interleave` gives them), in the file's layout:
    an embedding lookup from them."""
    return extension().take_rows(blocks, qtype, cols, index, True)  # type: ignore[union-attr]


def dequantize(
    blocks: torch.Tensor,
    qtype: int,
    cols: int,
    dtype: torch.dtype = torch.float32,
    interleaved: bool = False,
) -> torch.Tensor:
    """Blocks uint8 [R, bytes per row] (interleaved: as `interleave` gives them) as [R, cols]
    float32 or bfloat16, exactly the values the `gguf` package's dequantize gives."""
    return extension().dequantize(blocks, qtype, cols, dtype, interleaved)  # type: ignore[union-attr]


def gemv(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, interleaved: bool = False
) -> torch.Tensor:
    """x float32 [M, K] times the blocks' [N, K] transposed, in float32 [M, N], for a few
    rows (decode): x quantized to 8 bits per block, integer dots with the blocks."""
    return extension().gemv(x, blocks, qtype, interleaved)  # type: ignore[union-attr]


def mm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    interleaved: bool = False,
    silu: bool = False,
    times: torch.Tensor | None = None,
) -> torch.Tensor:
    """x float32 or bfloat16 [M, K] times the blocks' [N, K] transposed, in x's dtype, for
    many rows (prompt chunks): a tile of weight rows dequantized at a time. silu: silu of the
    product; times [M, N]: the product times it (the MLP's epilogues, fused)."""
    ext = extension()
    return ext.mm(x, blocks, qtype, interleaved, silu, times)  # type: ignore[union-attr]
