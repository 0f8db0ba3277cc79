"""What a loaded model is, as the APIs describe it: its family, its parameters, how its weights
are held, and its context. Ollama's /api/show, /api/tags and /api/ps and OpenAI's model card
read this one description."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from gapless.kernels.quant import BlockQuant, Quantized
from gapless.model.decoder import Decoder
from gapless.model.families import gguf_architecture
from gapless.model.loader import expected_shapes


@dataclass(frozen=True)
class ModelDescription:
    family: str  # llama.cpp's `general.architecture` (Ollama's family)
    parameter_count: int
    quantization_level: str  # the GGUF block type holding the most bytes, INT8/INT4, or F32...
    held_bytes: int  # of the tensors this process holds for the model
    context_length: int

    @property
    def parameter_size(self) -> str:
        """As Ollama writes it: 135M, 8.0B."""
        count = self.parameter_count
        if count >= 10**9:
            return f"{count / 10**9:.1f}B"
        return f"{count / 10**6:.0f}M" if count >= 10**6 else f"{count / 10**3:.0f}K"


def describe(decoder: Decoder, context_length: int) -> ModelDescription:
    held, quantized = _tensors(decoder)
    return ModelDescription(
        family=gguf_architecture(decoder.config.architecture),
        parameter_count=sum(math.prod(s) for s in expected_shapes(decoder.config).values()),
        quantization_level=_quantization_level(decoder, quantized),
        held_bytes=held,
        context_length=context_length,
    )


def _tensors(decoder: Decoder) -> tuple[int, list[Quantized]]:
    """The bytes of the tensors this process holds for the model (the weights, and small
    buffers such as a layer's rope frequencies), each counted once (tied ones share a
    tensor), and its quantized weights: all that is reachable from the decoder's embedding,
    layers and head (a classifier's)."""
    seen: set[int] = set()
    total, quantized = 0, []
    todo: list[Any] = [decoder.embed, decoder.final_norm, decoder.lm_head, decoder.classifier]
    todo += decoder.layers
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
            continue
        if isinstance(obj, Quantized):
            quantized.append(obj)
        if isinstance(obj, list | tuple):
            todo.extend(obj)
        elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("gapless."):
            todo.extend(vars(obj).values())  # a layer, a linear, a norm, quantized weights
    return total, quantized


def _quantization_level(decoder: Decoder, quantized: list[Quantized]) -> str:
    """The GGUF block type that holds the most bytes (Q4_K for a Q4_K_M file); INT8 or INT4
    for torch's int linears (int8's GroupQuant has no offset); else the float type's name."""
    held: Counter[str] = Counter()
    for w in quantized:
        if isinstance(w, BlockQuant):
            held[w.type_name] += w.blocks.numel()
    if held:
        return held.most_common(1)[0][0]
    if quantized:
        return "INT8" if quantized[0].offset is None else "INT4"  # type: ignore[union-attr]
    floats = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    return floats.get(decoder.dtype, str(decoder.dtype))
