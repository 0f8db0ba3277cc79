"""Phi-3 and Phi-4: `Phi3ForCausalLM`, GGUF `phi3`.

Llama's layer (model/families/llama.py runs it) with:
- q, k and v in one fused `qkv_proj`, gate and up in one `gate_up_proj` (gate's rows first),
  split at load into the tensors tensor parallelism shards, and fused again as Llama's are;
- LongRoPE (`rope_scaling` type `longrope`, formerly `su`): per-frequency factors, short ones
  up to original_max_position_embeddings and long ones past it, and an attention factor on
  cos and sin; a partial rotary embedding (`partial_rotary_factor`, Phi-4-mini's 0.75);
- `sliding_window`, where set, on every layer.

transformers rotates a whole sequence by the long factors once it passes
original_max_position_embeddings (recomputing what it had cached). Here the rotation is per
position, as the KV cache keeps it: a position past it rotates by the long factors, one
before it by the short ones. Up to original_max_position_embeddings tokens the two agree
exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gapless.kernels.quant import Quantized
from gapless.model.config import ConfigError, base_fields, check_activation
from gapless.model.decoder import Body, Rope, rope_inv_freq
from gapless.model.families import common, llama
from gapless.model.families.common import Meta, Shapes
from gapless.model.families.llama import LlamaConfig

if TYPE_CHECKING:
    from gapless.model.weights import Weight, Weights

ARCHITECTURES = ("Phi3ForCausalLM",)
GGUF_ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
GGUF_NAMES = common.GGUF_NAMES | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
SHARD_ROWS, SHARD_COLUMNS = common.SHARD_ROWS, common.SHARD_COLUMNS
ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope"}


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    rotary_dim: int  # the first rotary_dim dims of each head rotate
    original_max_position_embeddings: int


def config(raw: dict) -> Phi3Config:
    check_activation(raw, "hidden_act", "silu")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = ROPE_TYPES.get(rope.pop("rope_type", rope.pop("type", "default")))
    if rope_type is None:
        raise ConfigError(f"unsupported rope type for Phi-3; supported: {', '.join(ROPE_TYPES)}")
    partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    original = rope.pop(
        "original_max_position_embeddings",
        raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096)),
    )
    fields = base_fields(
        raw,
        (raw.get("sliding_window"),) * raw["num_hidden_layers"],
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=rope,
    )
    return Phi3Config(
        **fields,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        rotary_dim=int(fields["head_dim"] * partial),
        original_max_position_embeddings=original,
    )


def gguf_config(raw: dict, meta: Meta) -> dict:
    """llama.cpp's phi3: a partial rotary embedding's dims. Files with LongRoPE carry their
    factors as tensors (rope_factors_long, _short), which are refused as unexpected."""
    rotary = meta("rope.dimension_count", raw["head_dim"])
    return raw | {"partial_rotary_factor": rotary / raw["head_dim"]}


def tensor_shapes(cfg: Phi3Config) -> Shapes:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layer = common.norm_shapes(cfg, "input_layernorm", "post_attention_layernorm")
    layer |= common.linear_shapes(
        {
            "self_attn.qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),
            "self_attn.o_proj": (h, cfg.num_heads * d),
            "mlp.gate_up_proj": (2 * inter, h),
            "mlp.down_proj": (h, inter),
        }
    )
    return common.model_shapes(cfg, layer)


def from_gguf(cfg: Phi3Config, name: str, w: Weight) -> Weight:
    return w


def split_fused(cfg: Phi3Config, w: dict[str, Weight]) -> dict[str, Weight]:
    """qkv_proj into q/k/v_proj, gate_up_proj into gate/up_proj, by rows."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    parts = {
        "self_attn.qkv_proj": {
            "q_proj": (0, q),
            "k_proj": (q, q + kv),
            "v_proj": (q + kv, q + 2 * kv),
        },
        "mlp.gate_up_proj": {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)},
    }
    for i in range(cfg.num_layers):
        for fused, split in parts.items():
            weight = w.pop(f"model.layers.{i}.{fused}.weight")
            module = fused.split(".")[0]
            for name, (start, end) in split.items():
                w[f"model.layers.{i}.{module}.{name}.weight"] = _rows(weight, start, end)
    return w


def _rows(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, Quantized):
        return weight.map_rows(lambda t: t[start:end])
    return weight[start:end]


def longrope(cfg: Phi3Config, device: torch.device) -> Rope:
    """transformers' _compute_longrope_parameters: inv_freq = 1 / (factor * base ** (i / dim))
    for the short factors and the long ones, and the attention factor on cos and sin."""
    scaling, dim = cfg.rope_scaling, cfg.rotary_dim
    original = cfg.original_max_position_embeddings
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = cfg.rope_theta**exponents

    def inv_freq(factors: list[float]) -> torch.Tensor:
        return (1.0 / (torch.tensor(factors, dtype=torch.float32) * base)).to(device)

    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return Rope(
        inv_freq(scaling["short_factor"]),
        attention_factor,
        inv_freq(scaling["long_factor"]),
        long_from=original,
    )


def build(cfg: Phi3Config, w: Weights) -> Body:
    if cfg.rope_type == "longrope":
        rope = longrope(cfg, w.device)
    else:
        rope = Rope(rope_inv_freq(cfg.rotary_dim, cfg.rope_theta).to(w.device))
    return llama.build(cfg, w, rope)
