"""A decode step's layers in one native call (csrc/decode_layers.cpp), where torch ran each
layer as ~27 ops: the default model's batch-1 step made ~800 dispatches, a third of its time.

A family's layer gives what the call needs as data (`DecodeSpec`: its norms, products, heads
and window); the call runs the same row loops and block products as the ops do, on buffers of
its own, and attention on the paged kernel by address. It covers pre-norm SwiGLU layers on
GGUF blocks in a float32 run (Llama, Mistral, Qwen2 and Qwen3 files); anything else runs on
the ops, and `DecodeLayers.build` says why in the `kernels:` log line.

A step takes it when all its rows are decodes of one paged plan (kernels/plans.py) on the
block kernels' row limit, with no sliding-window KV group: prompt chunks keep their path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gapless.kernels import blocks, paged
from gapless.kernels.linear import BlockLinear, StackedLinear
from gapless.kernels.plans import KVCache, PagedPlan
from gapless.kernels.step_ops import switched_on

if TYPE_CHECKING:
    from gapless.kernels import Kernels, Linear


@dataclass(frozen=True)
class DecodeSpec:
    """A pre-norm layer with a SwiGLU MLP, as the call takes it. rope: the layer's rotary
    embedding (any object the decoder's step rotates by; one for every layer)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    eps: float
    rope: object


def _product(linear: Linear, rows: int) -> object | str:
    """The call's Product of a linear on GGUF blocks, or why it has none."""
    parts = linear.parts if isinstance(linear, StackedLinear) else [linear]
    if not all(isinstance(p, BlockLinear) for p in parts):
        return f"{type(linear).__name__} is not on GGUF blocks"
    if any(p.gemv_max_rows < rows for p in parts):  # type: ignore[union-attr]
        return "a linear's block kernel takes fewer rows"
    biases = [p.bias for p in parts]  # type: ignore[union-attr]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return "stacked parts with and without a bias"
    bias = None
    if biases[0] is not None:
        bias = torch.cat([b.float() for b in biases]).contiguous()  # type: ignore[union-attr]
    weights = [(p.weight.blocks, p.weight.qtype, p.weight.interleaved) for p in parts]  # type: ignore[union-attr]
    return blocks.extension().Product(weights, bias, parts[0].weight.cols)  # type: ignore[union-attr]


@dataclass
class DecodeLayers:
    """The native layers of a decoder, and the rope every one of them rotates by."""

    stack: object  # csrc's DecodeStack
    rope: object
    max_rows: int

    @staticmethod
    def build(specs: Sequence[DecodeSpec | str], kernels: Kernels) -> DecodeLayers | str:
        """The layers in one call, or why they run on the ops (a layer's own reason first)."""
        if reason := next((s for s in specs if isinstance(s, str)), None):
            return reason
        ext, attention = blocks.extension(), paged.extension()
        if kernels.device.type != "cpu" or ext is None or attention is None or not switched_on():
            return "our kernels are off"
        if kernels.dtype != torch.float32 or kernels.attention_dtype not in paged.QUERY_DTYPES:
            return f"a {kernels.dtype} run"
        specs = list(specs)  # type: ignore[assignment]
        if len({id(s.rope) for s in specs}) > 1:  # type: ignore[union-attr]
            return "layers with different rotations"
        rows = kernels.gguf_gemv_max_rows
        layers = []
        for s in specs:
            assert isinstance(s, DecodeSpec)
            if s.head_dim not in paged.HEAD_DIMS:
                return f"head size {s.head_dim}"
            products = [_product(p, rows) for p in (s.qkv, s.o, s.gate, s.up, s.down)]
            if reason := next((p for p in products if isinstance(p, str)), None):
                return reason
            norms = [n.float().contiguous() for n in (s.input_norm, s.post_norm)]
            qk_norms = [None if n is None else n.float().contiguous() for n in (s.q_norm, s.k_norm)]
            layers.append(
                ext.DecodeLayer(
                    *norms,
                    *qk_norms,
                    *products,
                    s.heads,
                    s.kv_heads,
                    s.head_dim,
                    s.window or 0,
                    s.eps,
                )
            )
        entry = attention.paged_attention_entry()
        stack = ext.DecodeStack(layers, entry, kernels.attention_dtype)
        return DecodeLayers(stack, specs[0].rope, rows)  # type: ignore[union-attr]

    def takes(self, plans: list, windows: dict, rows: int) -> bool:
        """Whether a step of these attention plans and window groups runs here: decodes
        only, one plan, no window group of their own (kernels' switch read per call)."""
        if len(plans) != 1 or windows or rows > self.max_rows:
            return False
        plan = plans[0]
        return (
            isinstance(plan, PagedPlan)
            and plan.last_keys is None
            and plan.key_blocks.shape[0] == rows
            and switched_on()
        )

    def run(
        self,
        x: torch.Tensor,
        kv_cache: list[KVCache],
        slots: torch.Tensor,
        plan: PagedPlan,
        rotation: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x [T, hidden] through every layer, in place; their K/V written at slots."""
        self.stack.run(x, kv_cache, slots, plan.key_blocks, plan.num_keys, *rotation)  # type: ignore[attr-defined]
        return x
