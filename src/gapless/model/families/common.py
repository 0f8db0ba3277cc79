"""What the families' modules share: tensor names and shapes that most checkpoints spell alike,
in Hugging Face's and in llama.cpp's (GGUF) names."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gapless.model.config import ModelConfig

# A GGUF file's metadata: meta(key, default) is the file's `{architecture}.{key}`.
Meta = Callable[[str, Any], Any]

# Hugging Face module -> llama.cpp's tensor name, for the modules named alike across families;
# a family adds or overrides its own (Gemma's extra norms, Phi-3's fused projections).
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

Shapes = dict[str, tuple[int, ...]]

# A layer's tensor names with every expert's module as one: mlp.experts.{e}.up_proj is
# mlp.experts.up_proj (as llama.cpp stacks them, and as tensor parallelism cuts them alike).
EXPERT = re.compile(r"experts\.(\d+)\.")

# Tensor parallelism (model/parallel.py): module -> how its weight is cut over the ranks. By
# rows: "q" (the query heads' rows), "kv" (the KV heads'), "mlp" (the MLP's), "expert" (each
# expert's MLP's); "heads": one value per query head. SHARD_COLUMNS cuts the projections back
# by those columns (their biases go to rank 0). A family adds its own modules' names.
SHARD_ROWS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "mlp.gate_proj": "mlp",
    "mlp.up_proj": "mlp",
}
SHARD_COLUMNS = {"self_attn.o_proj": "q", "mlp.down_proj": "mlp"}


def model_shapes(cfg: ModelConfig, layer: Shapes) -> Shapes:
    """Every tensor of a decoder whose layers hold `layer` (names under model.layers.{i}.):
    embeddings, final norm, and lm_head unless tied (a classifier: its head `score` instead,
    as transformers' *ForSequenceClassification holds it)."""
    h = cfg.hidden_size
    shapes: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if cfg.num_labels is not None:
        shapes["score.weight"] = (cfg.num_labels, h)
    elif not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def attention_shapes(
    cfg: ModelConfig, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False
) -> Shapes:
    """q, k, v and o projections (self_attn.*), with biases and per-head q/k norms if said."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    qkv = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    shapes = linear_shapes(qkv, qkv_bias) | linear_shapes({"self_attn.o_proj": (h, q)}, o_bias)
    if qk_norm:
        shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    return shapes


def mlp_shapes(cfg: ModelConfig, bias: bool = False) -> Shapes:
    """A gated MLP's gate, up and down projections (mlp.*)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    mlp = {"mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    return linear_shapes(mlp, bias)


def linear_shapes(modules: dict[str, tuple[int, int]], bias: bool = False) -> Shapes:
    """Linears' weights [out, in], and their biases [out] if said, by module name."""
    shapes: Shapes = {f"{m}.weight": shape for m, shape in modules.items()}
    if bias:
        shapes |= {f"{m}.bias": shape[:1] for m, shape in modules.items()}
    return shapes


def norm_shapes(cfg: ModelConfig, *names: str) -> Shapes:
    """Layer norms over the hidden size, each `{name}.weight`."""
    return {f"{name}.weight": (cfg.hidden_size,) for name in names}
