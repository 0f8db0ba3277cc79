"""Qwen3-MoE: `Qwen3MoeForCausalLM`, GGUF `qwen3moe`; and the mixture-of-experts layer that
Mixtral (model/families/mixtral.py) shares.

Qwen3's attention (per-head q/k RMSNorm, explicit head_dim; model/families/llama.py runs
it), and in place of the MLP a mixture of experts, as transformers' modeling_qwen3_moe.py
computes it: a router (a linear, hidden -> num_experts) scores the experts, softmax over all
of them, the top `num_experts_per_tok` chosen, their weights renormalized to sum to 1 where
`norm_topk_prob` says; each chosen expert is a SwiGLU MLP of `moe_intermediate_size`, its
output weighted. Layers in `mlp_only_layers`, or off every `decoder_sparse_step`-th, keep a
dense MLP of `intermediate_size`. The experts of a step run grouped (kernels/moe.py).

llama.cpp's qwen3moe files hold each layer's experts as three 3-D tensors (ffn_gate_exps,
ffn_up_exps, ffn_down_exps: [experts, rows, cols]), loaded as one linear per expert over a view
of the file's blocks; every layer is sparse and the weights are renormalized (llama.cpp's
loader has no key for either).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gapless.kernels import Linear
from gapless.kernels.moe import Experts, Glu, swiglu
from gapless.model.decoder import Body, RMSNorm, Rope
from gapless.model.families import common, llama
from gapless.model.families.common import Meta, Shapes
from gapless.model.families.llama import LlamaConfig

if TYPE_CHECKING:
    from gapless.model.weights import Weight, Weights

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
GGUF_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM"}
# The experts' modules without their index: llama.cpp stacks them into one tensor.
GGUF_NAMES = common.GGUF_NAMES | {
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
SHARD_ROWS = common.SHARD_ROWS | {
    "mlp.experts.gate_proj": "expert",
    "mlp.experts.up_proj": "expert",
}
SHARD_COLUMNS = common.SHARD_COLUMNS | {"mlp.experts.down_proj": "expert"}

# A router's logits [T, experts] -> each token's (weights, experts) [T, k].
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the chosen experts' weights renormalized to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: experts; False: a dense MLP

    def mlp_width(self, layer: int) -> int:
        if self.sparse_layers[layer]:
            return self.experts_per_token * self.moe_intermediate_size
        return self.intermediate_size


def config(raw: dict) -> MoeConfig:
    # Qwen3's attention: q/k norms, no bias, no window unless use_sliding_window.
    cfg = llama.config(raw, flags=(False, True, False))
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    # Hub checkpoints say num_experts; transformers 5 saves it as num_local_experts.
    experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
    sparse = tuple(
        i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_layers)
    )
    return MoeConfig(
        **vars(cfg),
        num_experts=experts,
        experts_per_token=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        sparse_layers=sparse,
    )


def gguf_config(raw: dict, meta: Meta) -> dict:
    """llama.cpp's qwen3moe: every layer sparse, the chosen weights renormalized."""
    return raw | {
        "num_experts": meta("expert_count", None),
        "num_experts_per_tok": meta("expert_used_count", None),
        "moe_intermediate_size": meta("expert_feed_forward_length", None),
        "norm_topk_prob": True,
    }


def from_gguf(cfg: MoeConfig, name: str, w: Weight) -> Weight:
    return w


# Module names of a mixture's parts: router, and each expert's gate, up and down.
@dataclass(frozen=True)
class MoeNames:
    block: str
    router: str
    gate: str
    up: str
    down: str


NAMES = MoeNames("mlp", "gate", "gate_proj", "up_proj", "down_proj")


def moe_shapes(cfg: MoeConfig, names: MoeNames) -> Shapes:
    """A mixture's router and experts, under `names.block`."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    shapes: Shapes = {f"{names.block}.{names.router}.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):  # in expert order: a GGUF tensor's leading index
        p = f"{names.block}.experts.{e}."
        shapes |= {
            f"{p}{names.gate}.weight": (inter, h),
            f"{p}{names.up}.weight": (inter, h),
            f"{p}{names.down}.weight": (h, inter),
        }
    return shapes


def tensor_shapes(cfg: MoeConfig, names: MoeNames = NAMES) -> Shapes:
    layer = common.norm_shapes(cfg, "input_layernorm", "post_attention_layernorm")
    layer |= common.attention_shapes(cfg, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm)
    shapes = common.model_shapes(cfg, layer)
    moe, dense = moe_shapes(cfg, names), common.mlp_shapes(cfg, cfg.mlp_bias)
    for i, sparse in enumerate(cfg.sparse_layers):
        shapes |= {f"model.layers.{i}.{n}": s for n, s in (moe if sparse else dense).items()}
    return shapes


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best logits, then a softmax over them (Mixtral's routing)."""
    best, experts = logits.float().topk(k, dim=-1)
    return best.softmax(dim=-1), experts


def softmax_top_k(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing: softmax over every expert, then the k best, renormalized if said;
    renormalized, that is top_k_softmax, in fewer ops."""
    if renormalize:
        return top_k_softmax(logits, k)
    return logits.float().softmax(dim=-1).topk(k, dim=-1)


@dataclass
class SparseMoe:
    router: Linear
    route: Route
    experts: Experts

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(self.router(h))
        return self.experts(h, experts, weights)


@dataclass
class MoeLayer(llama.PreNormLayer):
    """Llama's layer with a mixture of experts for its MLP."""

    moe: SparseMoe

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h)


def build_layers(
    cfg: MoeConfig,
    w: Weights,
    route: Route,
    names: MoeNames,
    rope: Rope | None = None,
    glu: Glu = swiglu,
) -> Body:
    """The layers, sparse ones routing by `route`, their experts gated by `glu`; dense ones
    are Llama's. rope: one other than the config's."""
    if rope is None:
        rope = llama.default_rope(cfg, w.device)
    layers: list[llama.PreNormLayer] = []
    for i, (window, sparse) in enumerate(zip(cfg.layer_windows, cfg.sparse_layers, strict=True)):
        parts = llama.attention_parts(cfg, w, i, rope, window)
        if not sparse:
            mlp = f"model.layers.{i}.mlp."
            gate, up, down = (w.linear(mlp + n) for n in ("gate_proj", "up_proj", "down_proj"))
            layers.append(llama.Layer(**parts, gate=gate, up=up, down=down))
            continue
        p = f"model.layers.{i}.{names.block}."
        experts = [p + f"experts.{e}." for e in range(cfg.num_experts)]
        moe = SparseMoe(
            # Not quantized by --quantize (nor by llama.cpp's quantizer): routing decides
            # which experts run at all.
            router=w.kernels.linear(
                w.take(p + names.router + ".weight"), w.take_optional(p + names.router + ".bias")
            ),
            route=route,
            experts=Experts(
                [w.linear(e + names.gate, e + names.up) for e in experts],
                [w.linear(e + names.down) for e in experts],
                glu,
            ),
        )
        layers.append(MoeLayer(**parts, moe=moe))
    return Body(layers, RMSNorm(w.take("model.norm.weight"), cfg.rms_norm_eps))


def build(cfg: MoeConfig, w: Weights) -> Body:
    k, renormalize = cfg.experts_per_token, cfg.norm_topk_prob
    return build_layers(
        cfg, w, functools.partial(softmax_top_k, k=k, renormalize=renormalize), NAMES
    )
