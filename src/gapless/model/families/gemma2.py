"""Gemma 2: `Gemma2ForCausalLM`, config model_type `gemma2`, GGUF `gemma2`.

Gemma 3's layer (model/families/gemma3.py runs it: four norms in float32 times (1 + weight),
GeGLU MLP, scaled embeddings, query_pre_attn_scalar, tied lm_head), as transformers'
modeling_gemma2.py computes it, but:
- every other layer attends in a sliding window, starting with the first (or as
  `layer_types` says); one rotary embedding for all of them;
- no per-head q/k norms;
- attention scores are soft-capped before the softmax, attn_logit_softcapping *
  tanh(scores / attn_logit_softcapping): no fused attention op takes a cap, so these layers
  attend on the explicit path (kernels/plans.py); logits are soft-capped likewise by
  final_logit_softcapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gapless.model.config import ConfigError, base_fields, check_activation
from gapless.model.decoder import Body, Rope, rope_inv_freq
from gapless.model.families import common, gemma3
from gapless.model.families.common import Meta, Shapes
from gapless.model.families.gemma3 import GemmaConfig

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("Gemma2ForCausalLM",)
GGUF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM"}
GGUF_NAMES = gemma3.GGUF_NAMES
SHARD_ROWS, SHARD_COLUMNS = common.SHARD_ROWS, common.SHARD_COLUMNS
from_gguf = gemma3.from_gguf  # llama.cpp stores Gemma 2's norms as (1 + weight) too
# transformers' Gemma2Config defaults, and llama.cpp's where a file does not say.
ATTN_SOFTCAP, FINAL_SOFTCAP, WINDOW = 50.0, 30.0, 4096


@dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    attn_logit_softcapping: float | None


def config(raw: dict) -> Gemma2Config:
    check_activation(raw, "hidden_activation", "gelu_pytorch_tanh")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional Gemma 2 is unsupported")
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    window = raw.get("sliding_window", WINDOW)
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return Gemma2Config(
        **base_fields({"tie_word_embeddings": True} | raw, windows),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
        attention_bias=raw.get("attention_bias", False),
        final_logit_softcapping=raw.get("final_logit_softcapping", FINAL_SOFTCAP),
        attn_logit_softcapping=raw.get("attn_logit_softcapping", ATTN_SOFTCAP),
    )


def gguf_config(raw: dict, meta: Meta) -> dict:
    """llama.cpp's gemma2: a sliding window on every other layer (4096 unless the file says),
    soft-caps as the file says (else 50 and 30), and query_pre_attn_scalar head_dim, but
    hidden / heads for the 27B (46 layers), as llama.cpp's loader has them."""
    layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    scalar = raw["hidden_size"] // heads if layers == 46 else raw["head_dim"]
    return raw | {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": raw["sliding_window"] or WINDOW,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": meta("attn_logit_softcapping", ATTN_SOFTCAP),
        "final_logit_softcapping": meta("final_logit_softcapping", FINAL_SOFTCAP),
    }


def tensor_shapes(cfg: Gemma2Config) -> Shapes:
    layer = common.norm_shapes(cfg, *gemma3.NORMS)
    layer |= common.attention_shapes(cfg, cfg.attention_bias, cfg.attention_bias)
    layer |= common.mlp_shapes(cfg)
    return common.model_shapes(cfg, layer)


def build(cfg: Gemma2Config, w: Weights) -> Body:
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling)
    rope = Rope(inv_freq.to(w.device))
    ropes = [rope] * cfg.num_layers
    return gemma3.build_layers(cfg, w, ropes, cfg.attn_logit_softcapping)
