"""A checkpoint's weights as a family's build takes them (families/: build(cfg, weights))."""

from __future__ import annotations

import torch

from gapless.kernels import Kernels, Linear
from gapless.kernels.linear import StackedLinear
from gapless.kernels.quant import BlockQuant, GroupQuant, Quantized
from gapless.model.quantize import Quantizer

Weight = torch.Tensor | Quantized


class Weights:
    """A checkpoint's weights under Hugging Face names, which a family's build takes one by
    one: as they are (norms), or as linears over the kernels, quantized if asked."""

    def __init__(
        self,
        weights: dict[str, Weight],
        kernels: Kernels,
        quantize: Quantizer | None,
    ) -> None:
        self.weights = weights
        self.kernels = kernels
        self.quantize = quantize
        self.device = kernels.device

    def take(self, name: str) -> torch.Tensor:
        return self.weights.pop(name)  # type: ignore[return-value]

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.weights.pop(name, None)  # type: ignore[return-value]

    def quantized(self, weight: Weight) -> Weight:
        if self.quantize is not None and isinstance(weight, torch.Tensor):
            return self.quantize(weight)
        return weight

    def linear(self, *modules: str) -> Linear:
        """One linear of the modules' weights (and biases, where they have them) stacked by
        output rows: q, k and v fused run as one matmul. Weights of different forms cannot be
        stacked (a Q4_K_M file keeps some attn_v in Q6_K beside Q4_K q and k): they run as one
        linear each, their outputs concatenated."""
        weights = [self.quantized(self.weights.pop(m + ".weight")) for m in modules]
        has_bias = modules[0] + ".bias" in self.weights
        biases = [self.weights.pop(m + ".bias") if has_bias else None for m in modules]
        if len({(type(w), getattr(w, "qtype", None)) for w in weights}) > 1:
            parts = [self.kernels.linear(w, b) for w, b in zip(weights, biases, strict=True)]
            return StackedLinear(parts)
        bias = torch.cat(biases) if has_bias else None  # type: ignore[arg-type]
        return self.kernels.linear(_stacked(weights), bias)


def _stacked(parts: list[Weight]) -> Weight:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], GroupQuant | BlockQuant):
        return type(parts[0]).cat(parts)  # type: ignore[arg-type]
    return torch.cat(parts)  # type: ignore[arg-type]
