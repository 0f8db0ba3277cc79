"""Linear layers: y = x @ weight.T + bias, with the two epilogues the MLP needs.

Every class here has the same three calls, so the decoder does not know which it got;
a weight-only quantized linear is one more class with them. NarrowLinear, for an lm_head
only, has the first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gapless.kernels import blocks, step_ops
from gapless.kernels.quant import BlockQuant, GroupQuant

# The most rows a decode batch (decodes and proposed tokens) holds: the quantized linears'
# integer paths (blocks.gemv, torch's int8/int4 ops) take up to this many, and the scheduler
# fills no step past it. A 17th row sends every quantized linear to its dequantizing path: on
# SmolLM2's Q4_1 file, 30 ms a step for 16 rows, 115 ms for 17; both int kernels beat
# dequantizing up to 16 rows here, int8's lost at 32 (docs/benchmarks.md).
DECODE_ROWS = 16


class PlainLinear:
    """Public ops only: runs on every device and dtype torch supports."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ weight.T + bias)"""
        return F.silu(F.linear(x, self.weight, self.bias))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ weight.T + bias) * other"""
        return F.linear(x, self.weight, self.bias) * other


class PackedLinear:
    """The weight repacked once into oneDNN's blocked layout (CPU).

    Packed for 512-row inputs: prompt chunks ran ~10% faster than with the batch-1 layout,
    decode the same. A decode step then streams weights at about 25 GB/s instead of 15 with
    F.linear. The epilogues run inside the matmul: no extra pass over the activations and no
    bf16 rounding in between (the MLP ran ~12% faster on 512-token chunks).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 512)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "swish", [], "")

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul")


class QuantizedLinear:
    """A weight-only quantized linear (see GroupQuant); what int8 and int4 share.

    Batches of up to `kernel_max_rows` rows (decode steps) run the int kernel, which reads
    the weight as it is stored: the fewer bytes, the faster a bandwidth-bound decode step.
    Larger batches (prompt chunks) dequantize the weight per call and run the dense matmul,
    which was faster there than the int kernels, in `dense_dtype` (None: the activations').
    The kernels take activations in `kernel_dtype`; with None, or for a shape the kernel
    cannot take, every batch takes the dense path: the fallback.
    """

    def __init__(
        self,
        weight: GroupQuant,
        bias: torch.Tensor | None,
        kernel_dtype: torch.dtype | None,
        kernel_max_rows: int,
        dense_dtype: torch.dtype | None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.kernel_dtype = kernel_dtype
        self.dense_dtype = dense_dtype
        fits = kernel_dtype is not None and self.kernel_fits(*weight.codes.shape)
        self.kernel_max_rows = kernel_max_rows if fits else 0

    @staticmethod
    def kernel_fits(rows: int, cols: int) -> bool:
        raise NotImplementedError

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.kernel_max_rows:
            dtype = self.dense_dtype or x.dtype
            y = F.linear(x.to(dtype), self.weight.dequantize(dtype)).to(x.dtype)
        else:
            y = self._kernel(x.to(self.kernel_dtype)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self(x))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x) * other


class Int8Linear(QuantizedLinear):
    """int8 codes with one scale per output row, on `_weight_int8pack_mm`."""

    def __init__(
        self,
        weight: GroupQuant,
        bias: torch.Tensor | None = None,
        kernel_dtype: torch.dtype | None = None,
        kernel_max_rows: int = 0,
        dense_dtype: torch.dtype | None = None,
    ) -> None:
        if weight.offset is not None or weight.group_size != weight.codes.shape[1]:
            raise ValueError("Int8Linear takes symmetric int8 codes with one scale per row")
        super().__init__(weight, bias, kernel_dtype, kernel_max_rows, dense_dtype)
        if self.kernel_max_rows:
            self.kernel_scale = weight.scale[:, 0].to(kernel_dtype)

    @staticmethod
    def kernel_fits(rows: int, cols: int) -> bool:
        # torch 2.13's CPU kernel returned NaNs, or crashed, for other widths.
        return cols % 16 == 0

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight.codes, self.kernel_scale)


class Int4Linear(QuantizedLinear):
    """4-bit codes with a scale and offset per group of 32, 64 or 128 columns, on the int4
    kernels, which compute (code - 8) * scale + zero: zero = offset + 8 * scale.

    The codes are kept twice: one a byte for the dense path, and two a byte in the kernel's
    own tiled layout, which is all a decode step reads.
    """

    def __init__(
        self,
        weight: GroupQuant,
        bias: torch.Tensor | None = None,
        kernel_dtype: torch.dtype | None = None,
        kernel_max_rows: int = 0,
        dense_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(weight, bias, kernel_dtype, kernel_max_rows, dense_dtype)
        if not self.kernel_max_rows:
            return
        zero = weight.offset + 8 * weight.scale
        # [cols / group, rows, 2]: each group's scales and zeros, as the kernels take them.
        self.scales_and_zeros = torch.stack((weight.scale.T, zero.T), dim=-1).to(kernel_dtype)
        codes = weight.codes
        if codes.device.type == "cuda":  # untested: no GPU was at hand
            pairs = codes[:, ::2] << 4 | codes[:, 1::2]  # even columns in the high nibble
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)

    @staticmethod
    def kernel_fits(rows: int, cols: int) -> bool:
        return rows % 16 == 0  # the CPU packing's requirement

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            mm = torch.ops.aten._weight_int4pack_mm
        else:
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x, self.packed, self.weight.group_size, self.scales_and_zeros)


class BlockLinear:
    """A weight held as GGUF blocks (BlockQuant), on our block kernels (blocks.py).

    Up to `gemv_max_rows` rows (decode steps), the activations are quantized to 8 bits per
    block and multiplied with the blocks as they are stored: a step reads the file's bytes
    and nothing more. Larger batches (prompt chunks) dequantize one tile of rows at a time
    into `dense_dtype` (None: the activations') and multiply there.

    With `interleave`, the types our kernels interleave (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are
    held with their rows interleaved by 16 instead of the file's layout, in place of it: the
    same bytes, on which a decode step unpacks and scales 16 rows per vector instruction.

    With `prompt_copy` (the weight dequantized into `dense_dtype` once, as a dense linear
    without the bias), prompt chunks multiply that instead: dequantizing and packing every
    weight cost a step with any prompt rows ~45 ms on the default model (2 Zen 4 cores),
    whatever their number.
    """

    def __init__(
        self,
        weight: BlockQuant,
        bias: torch.Tensor | None = None,
        gemv_max_rows: int = DECODE_ROWS,
        dense_dtype: torch.dtype | None = None,
        prompt_copy: Linear | None = None,
        interleave: bool = True,
    ) -> None:
        rows = weight.shape[0]
        if interleave and rows % 16 == 0 and blocks.can_interleave(weight.qtype):
            weight = weight.interleave()
        self.weight = weight
        self.bias = bias
        self.gemv_max_rows = gemv_max_rows
        self.dense_dtype = dense_dtype
        self.prompt_copy = prompt_copy

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return as_dtype(self._product(x), x.dtype)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, silu=True)

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self._product(x, times=other)

    def _product(
        self, x: torch.Tensor, silu: bool = False, times: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T + bias, then the epilogue, in the dtype it was computed in: the MLP's
        gated product stays there (bf16 on prompt chunks) until `down`, and on prompt chunks
        the kernel applies the epilogue tile by tile, as the dense linear does."""
        w = self.weight
        if x.shape[0] <= self.gemv_max_rows:
            y = blocks.gemv(as_dtype(x, torch.float32), w.blocks, w.qtype, w.interleaved)
        else:
            x = as_dtype(x, self.dense_dtype or x.dtype)
            copy = self.prompt_copy
            if self.bias is None:  # nothing comes between the product and the epilogue
                times = None if times is None else as_dtype(times, x.dtype)
                if copy is None:
                    return blocks.mm(x, w.blocks, w.qtype, w.interleaved, silu, times)
                if silu:
                    return copy.silu(x)
                return copy(x) if times is None else copy.times(x, times)
            y = blocks.mm(x, w.blocks, w.qtype, w.interleaved) if copy is None else copy(x)
        y = y if self.bias is None else y + self.bias
        y = F.silu(y) if silu else y
        return y if times is None else y * times


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: x itself where it is already, as even a no-op x.to(dtype) is a dispatch
    (~300 of a decode step were)."""
    return x if x.dtype == dtype else x.to(dtype)


class StackedLinear:
    """Linears whose outputs are concatenated: weights of one layer that one call cannot
    take together, such as GGUF blocks of two types."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self(x))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x) * other


class NarrowLinear:
    """An lm_head read narrower than float32 (a bf16 copy, or GGUF blocks against 8-bit
    activations): half the bytes or fewer a decode step reads. Its best logits are then
    recomputed exactly, from the float32 weight or the blocks' exact values.

    A narrow read rounds logits (steps of 0.125 near 24 in bf16). That tied the default
    model's two best first tokens ('The' 24.80, 'L' 24.77 in float32) and changed its greedy
    answer. The top `exact_top` logits of each row, where greedy and nucleus choices are
    made, are exact; the rest keep the narrow read's rounding.
    """

    def __init__(
        self,
        weight: torch.Tensor | BlockQuant,
        narrow: PlainLinear | PackedLinear | BlockLinear,
        narrow_dtype: torch.dtype | None,
        exact_top: int = 16,
    ) -> None:
        self.weight = weight
        self.narrow = narrow  # the same weight, read narrow, on inputs in narrow_dtype
        self.narrow_dtype = narrow_dtype
        self.exact_top = min(exact_top, weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        narrow_x = x if self.narrow_dtype is None else x.to(self.narrow_dtype)
        logits = self.narrow(narrow_x).to(x.dtype)
        top = step_ops.top_k_indices(logits, self.exact_top)
        w = self.weight
        rows = w.rows(top, x.dtype) if isinstance(w, BlockQuant) else w[top]
        exact = torch.einsum("rh,rkh->rk", x, rows)
        return logits.scatter_(1, top, exact)


Linear = (
    PlainLinear
    | PackedLinear
    | Int8Linear
    | Int4Linear
    | BlockLinear
    | StackedLinear
    | NarrowLinear
)
