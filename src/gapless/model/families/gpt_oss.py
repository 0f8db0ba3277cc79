"""gpt-oss: `GptOssForCausalLM`.

Llama's layer (model/families/llama.py runs it) with Qwen3-MoE's mixture of experts for its
MLP (model/families/qwen3_moe.py), as transformers' modeling_gpt_oss.py computes it:
- attention with biases (q, k, v and o) and sinks: a learned logit per head that joins each
  softmax's denominator, so a head's weights may sum to less than 1. No fused kernel takes a
  sink: these layers attend on the explicit-scores path (kernels/attention.explicit), slower
  than the other families' attention, as Gemma 2's soft-capped layers do;
- sliding-window and full layers alternating (or as `layer_types` says);
- YaRN rope (`rope_type` yarn: frequencies blended between the original and the `factor`-
  interpolated ones by a ramp over `beta_fast`..`beta_slow` rotations, cos and sin scaled
  by 0.1 ln(factor) + 1);
- a router with a bias: the top `num_experts_per_tok` logits, then a softmax over them;
- experts with biases, each a clamped SwiGLU: gate clamped above at `swiglu_limit`, up to
  +-limit, out = (up + 1) * gate * sigmoid(`swiglu_alpha` * gate).

The checkpoint holds each layer's experts as 3-D tensors in `x @ W` order, gate and up
interleaved by column (mlp.experts.gate_up_proj [experts, hidden, 2 * inter]); they are split
at load into one [out, in] linear per expert, as Qwen3-MoE's are. OpenAI's released
checkpoints hold the experts in MXFP4 (`quantization_config` mxfp4): refused at load, with a
message saying how to dequantize them (transformers' `Mxfp4Config(dequantize=True)`, then
`save_pretrained`): this reads no MXFP4 blocks, and a dequantized copy costs 4x their memory
in bfloat16, 8x in float32 (gpt-oss-20b's ~12 GB of experts as ~48 or ~96 GB).

llama.cpp's `gpt-oss` GGUF files are read. Its converter splits gate_up_proj into stacked
ffn_gate_exps and ffn_up_exps ([experts, out, in], biases beside them), so a file's experts
arrive as Qwen3-MoE's do and split_fused leaves them; the sinks are attn_sinks.weight, the
router ffn_gate_inp, the second norm post_attention_norm. Their experts are MXFP4 blocks, which
our kernels do not have: model/gguf.py dequantizes them at load to the run dtype, with a
warning of the memory it costs (gpt-oss-20b's ~12 GB of blocks ~4x larger in bfloat16, ~8x in
float32), as it does any type without a kernel. The SwiGLU's alpha and limit have no keys:
OpenAI's 1.702 and 7, as llama.cpp's graph fixes them. The file has no key for YaRN's `truncate`:
false, as OpenAI's config.json says (llama.cpp's rope rounds the ramp's ends; transformers,
told false, does not).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gapless.kernels.moe import Glu
from gapless.model.config import ConfigError, base_fields, check_activation
from gapless.model.decoder import Body, Rope
from gapless.model.families import common, qwen3_moe
from gapless.model.families.common import Meta, Shapes
from gapless.model.families.qwen3_moe import MoeConfig, MoeNames

if TYPE_CHECKING:
    from gapless.model.weights import Weight, Weights

ARCHITECTURES = ("GptOssForCausalLM",)
GGUF_ARCHITECTURES = {"gpt-oss": "GptOssForCausalLM"}
GGUF_NAMES = common.GGUF_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.sinks": "attn_sinks.weight",  # a parameter the file holds as a tensor
    "mlp.router": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
SHARD_ROWS = qwen3_moe.SHARD_ROWS | {"self_attn.sinks": "heads"}
SHARD_COLUMNS = qwen3_moe.SHARD_COLUMNS
NAMES = MoeNames("mlp", "router", "gate_proj", "up_proj", "down_proj")  # after split_fused
DEFAULT_THETA = 150_000.0


@dataclass(frozen=True)
class GptOssConfig(MoeConfig):
    swiglu_alpha: float
    swiglu_limit: float


def config(raw: dict) -> GptOssConfig:
    check_activation(raw, "hidden_act", "silu")
    if (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        raise ConfigError(
            "gpt-oss checkpoints with MXFP4 experts are not read: load it with transformers "
            "(quantization_config=Mxfp4Config(dequantize=True)) and save_pretrained it, then "
            "serve that (4x the experts' memory)"
        )
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", DEFAULT_THETA)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {rope_type!r} for gpt-oss; supported: yarn")
    layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = raw.get("sliding_window")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    fields = base_fields(raw, windows, rope_theta=theta, rope_type=rope_type, rope_scaling=rope)
    bias = raw.get("attention_bias", True)
    return GptOssConfig(
        **fields,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=False,
        num_experts=raw["num_local_experts"],
        experts_per_token=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["intermediate_size"],
        norm_topk_prob=True,
        sparse_layers=(True,) * layers,
        swiglu_alpha=raw.get("swiglu_alpha", 1.702),
        swiglu_limit=raw.get("swiglu_limit", 7.0),
    )


def gguf_config(raw: dict, meta: Meta) -> dict:
    rope = raw["rope_scaling"] or {}
    return raw | {
        "num_local_experts": meta("expert_count", None),
        "num_experts_per_tok": meta("expert_used_count", None),
        "intermediate_size": meta("expert_feed_forward_length", None),
        "rope_scaling": rope | {"truncate": False} if rope.get("rope_type") == "yarn" else rope,
    }


def tensor_shapes(cfg: GptOssConfig) -> Shapes:
    h, inter, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    layer = common.norm_shapes(cfg, "input_layernorm", "post_attention_layernorm")
    layer |= common.attention_shapes(cfg, cfg.qkv_bias, cfg.o_bias)
    layer |= {
        "self_attn.sinks": (cfg.num_heads,),
        "mlp.router.weight": (n, h),
        "mlp.router.bias": (n,),
        "mlp.experts.gate_up_proj": (n, h, 2 * inter),
        "mlp.experts.gate_up_proj_bias": (n, 2 * inter),
        "mlp.experts.down_proj": (n, inter, h),
        "mlp.experts.down_proj_bias": (n, h),
    }
    return common.model_shapes(cfg, layer)


def gguf_tensor_shapes(cfg: GptOssConfig) -> Shapes:
    """A GGUF file's tensors, under the names split_fused gives a checkpoint's."""
    inter, h = cfg.moe_intermediate_size, cfg.hidden_size
    fused = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    layer = {f"mlp.experts.{name}" for name in fused}
    shapes = {n: s for n, s in tensor_shapes(cfg).items() if n.split(".", 3)[-1] not in layer}
    for i in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}."
            shapes |= {
                f"{p}gate_proj.weight": (inter, h),
                f"{p}gate_proj.bias": (inter,),
                f"{p}up_proj.weight": (inter, h),
                f"{p}up_proj.bias": (inter,),
                f"{p}down_proj.weight": (h, inter),
                f"{p}down_proj.bias": (h,),
            }
    return shapes


def from_gguf(cfg: GptOssConfig, name: str, w: Weight) -> Weight:
    return w


def split_fused(cfg: GptOssConfig, w: dict[str, Weight]) -> dict[str, Weight]:
    """Each layer's 3-D experts into Qwen3-MoE's per-expert gate, up and down [out, in]
    linears with biases (the names tensor parallelism cuts): gate the even columns of
    gate_up_proj, up the odd ones. A GGUF file's experts arrive split already."""
    if "model.layers.0.mlp.experts.gate_up_proj" not in w:
        return w
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up, gate_up_bias = w.pop(p + "gate_up_proj"), w.pop(p + "gate_up_proj_bias")
        down, down_bias = w.pop(p + "down_proj"), w.pop(p + "down_proj_bias")
        for e in range(cfg.num_experts):
            parts = {
                "gate_proj": (gate_up[e, :, ::2], gate_up_bias[e, ::2]),  # type: ignore[index]
                "up_proj": (gate_up[e, :, 1::2], gate_up_bias[e, 1::2]),  # type: ignore[index]
                "down_proj": (down[e], down_bias[e]),  # type: ignore[index]
            }
            for name, (weight, bias) in parts.items():
                w[f"{p}{e}.{name}.weight"] = weight.T.contiguous()
                w[f"{p}{e}.{name}.bias"] = bias
    return w


def yarn_rope(cfg: GptOssConfig, device: torch.device) -> Rope:
    """transformers' _compute_yarn_parameters, without mscale and mscale_all_dim (gpt-oss sets
    neither)."""
    params, dim, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    factor, original = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        """The dim whose frequency turns `rotations` times over the original context."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    # Below `low` the original frequencies, above `high` the interpolated ones, a ramp between.
    inv_freq = (1 / (factor * freqs)) * ramp + (1 / freqs) * (1 - ramp)
    return Rope(inv_freq.to(device), attention_factor)


def clamped_swiglu(alpha: float, limit: float) -> Glu:
    """gpt-oss's expert activation, on gate's and up's outputs."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)

    return glu


def build(cfg: GptOssConfig, w: Weights) -> Body:
    rope = yarn_rope(cfg, w.device) if cfg.rope_type == "yarn" else None
    route = functools.partial(qwen3_moe.top_k_softmax, k=cfg.experts_per_token)
    glu = clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit)
    return qwen3_moe.build_layers(cfg, w, route, NAMES, rope, glu)
