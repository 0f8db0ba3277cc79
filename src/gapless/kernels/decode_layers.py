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

from collections.abc import Callable, Sequence
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
    """A pre-norm layer with a gated MLP, as the call takes it: Llama's, or with its quirks
    set, Gemma 3's. rope: the layer's rotary embedding, any object the decoder's step rotates
    by (layers that share one share its rotation); window: its attention window, whose KV group
    the step's plans say."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
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
    # Gemma's: norms of attention's and the MLP's outputs before each residual add, and GELU
    # (tanh-approximated) for silu.
    attention_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    gelu: bool = False


def _float(norm: torch.Tensor | None) -> torch.Tensor | None:
    return None if norm is None else norm.float().contiguous()


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
    """The native layers of a decoder: the rotations they take (ropes) and the windows whose
    KV groups they attend in (windows), by the index each layer has of them."""

    stack: object  # csrc's DecodeStack
    ropes: list[object]
    windows: list[int | None]
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
        rows = kernels.gguf_gemv_max_rows
        ropes: list[object] = []
        windows: list[int | None] = []
        layers = []
        for s in specs:
            assert isinstance(s, DecodeSpec)
            if s.head_dim not in paged.HEAD_DIMS:
                return f"head size {s.head_dim}"
            products = [_product(p, rows) for p in (s.qkv, s.o, s.gate, s.up, s.down)]
            if reason := next((p for p in products if isinstance(p, str)), None):
                return reason
            if not any(r is s.rope for r in ropes):
                ropes.append(s.rope)
            if s.window not in windows:
                windows.append(s.window)
            qkv, o, gate, up, down = products
            layers.append(
                ext.DecodeLayer(
                    input_norm=_float(s.input_norm),
                    mlp_norm=_float(s.mlp_norm),
                    q_norm=_float(s.q_norm),
                    k_norm=_float(s.k_norm),
                    attention_out_norm=_float(s.attention_out_norm),
                    mlp_out_norm=_float(s.mlp_out_norm),
                    qkv=qkv,
                    o=o,
                    gate=gate,
                    up=up,
                    down=down,
                    heads=s.heads,
                    kv_heads=s.kv_heads,
                    head_dim=s.head_dim,
                    window=s.window or 0,
                    eps=s.eps,
                    gelu=s.gelu,
                    rotation=next(i for i, r in enumerate(ropes) if r is s.rope),
                    group=windows.index(s.window),
                )
            )
        entry = attention.paged_attention_entry()
        stack = ext.DecodeStack(layers, entry, kernels.attention_dtype)
        return DecodeLayers(stack, ropes, windows, rows)

    def _groups(
        self, write_slots: torch.Tensor, plans: list, windows: dict
    ) -> list[tuple[torch.Tensor, list]]:
        """Each window's slots and plans: its KV group's, else the batch's."""
        return [windows.get(w, (write_slots, plans)) for w in self.windows]

    def takes(self, write_slots: torch.Tensor, plans: list, windows: dict) -> bool:
        """Whether a step of these slots, attention plans and window groups runs here:
        decodes only, each group's in one paged plan (kernels' switch read per call)."""
        rows = write_slots.shape[0]
        if rows > self.max_rows or not switched_on():
            return False
        return all(
            len(group_plans) == 1
            and isinstance(plan := group_plans[0], PagedPlan)
            and plan.last_keys is None
            and plan.key_blocks.shape[0] == rows
            for _, group_plans in self._groups(write_slots, plans, windows)
        )

    def run(
        self,
        x: torch.Tensor,
        kv_cache: list[KVCache],
        write_slots: torch.Tensor,
        plans: list,
        windows: dict,
        rotation: Callable[[object], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """x [T, hidden] through every layer, in place; their K/V written at their groups'
        slots. rotation: a rope's cos and signed sin for the step's positions."""
        groups = [
            (slots, group_plans[0].key_blocks, group_plans[0].num_keys)
            for slots, group_plans in self._groups(write_slots, plans, windows)
        ]
        self.stack.run(x, kv_cache, groups, [rotation(r) for r in self.ropes])  # type: ignore[attr-defined]
        return x
