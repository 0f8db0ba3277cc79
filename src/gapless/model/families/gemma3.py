"""Gemma 3 (text): `Gemma3ForCausalLM`, config model_type `gemma3_text`, GGUF `gemma3`.

Against Llama's layer, as transformers' modeling_gemma3.py computes it:
- local layers attend in a sliding window, global ones to everything (5 local of every 6, or
  as `layer_types` says), each kind with its own rope base (rope_local_base_freq, and
  rope_theta with any rope_scaling for the global ones);
- RMSNorm computes in float32 and multiplies by (1 + weight); q and k get per-head RMSNorm;
  attention's and the MLP's outputs are normed again before the residual add (four norms);
- the MLP is GeGLU with tanh-approximated GELU;
- embeddings are scaled by sqrt(hidden) (in their dtype); attention scores by
  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; lm_head is tied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gapless.kernels import Linear
from gapless.kernels.decode_layers import DecodeSpec
from gapless.kernels.plans import KVCache
from gapless.kernels.quant import Quantized
from gapless.model.config import ConfigError, ModelConfig, base_fields, check_activation, parse_rope
from gapless.model.decoder import Body, Rope, Step, apply_rope, rms_norm, rope_inv_freq
from gapless.model.families import common
from gapless.model.families.common import Meta, Shapes

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("Gemma3ForCausalLM",)
GGUF_ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM"}
GGUF_NAMES = common.GGUF_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
SHARD_ROWS, SHARD_COLUMNS = common.SHARD_ROWS, common.SHARD_COLUMNS
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
SLIDING_WINDOW_PATTERN = 6  # transformers' and llama.cpp's default: every 6th layer is global


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """What Gemma 2's and Gemma 3's layers read."""

    query_pre_attn_scalar: float
    attention_bias: bool
    final_logit_softcapping: float | None


@dataclass(frozen=True)
class Gemma3Config(GemmaConfig):
    rope_local_theta: float  # the local (sliding-window) layers' rope base


def config(raw: dict) -> Gemma3Config:
    check_activation(raw, "hidden_activation", "gelu_pytorch_tanh")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional Gemma 3 (an embedding model) is unsupported")
    if raw.get("attn_logit_softcapping") is not None:
        raise ConfigError("attention logit soft-capping is unsupported")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one rope per layer type
        rope = parse_rope(params["full_attention"], DEFAULT_THETA["full_attention"])
        local = parse_rope(params["sliding_attention"], DEFAULT_THETA["sliding_attention"])
    else:  # as the Hub's checkpoints have it
        theta = raw.get("rope_theta", DEFAULT_THETA["full_attention"])
        rope = parse_rope(raw.get("rope_scaling"), theta)
        local = (raw.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"]), "default", {})
    if local[1] != "default":
        raise ConfigError(f"unsupported rope type {local[1]!r} for Gemma 3's local layers")
    pattern = (
        raw.get("sliding_window_pattern")
        or raw.get("_sliding_window_pattern")  # as transformers 4.5x saved it
        or SLIDING_WINDOW_PATTERN
    )
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    window = raw.get("sliding_window")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return Gemma3Config(
        **base_fields(
            {"tie_word_embeddings": True} | raw,
            windows,
            rope_theta=rope[0],
            rope_type=rope[1],
            rope_scaling=rope[2],
        ),
        rope_local_theta=float(local[0]),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
        attention_bias=raw.get("attention_bias", False),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def gguf_config(raw: dict, meta: Meta) -> dict:
    """llama.cpp's gemma3: a global layer every 6th unless the file says otherwise, local
    rope base 10000, and query_pre_attn_scalar head_dim, but hidden / heads for the 27B (62
    layers), as llama.cpp's loader has them."""
    layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    scalar = raw["hidden_size"] // heads if layers == 62 else raw["head_dim"]
    return raw | {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window_pattern": meta("attention.sliding_window_pattern", None),
        "rope_local_base_freq": meta("rope.freq_base_swa", DEFAULT_THETA["sliding_attention"]),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": meta("final_logit_softcapping", None),
    }


def tensor_shapes(cfg: Gemma3Config) -> Shapes:
    layer = common.norm_shapes(cfg, *NORMS)
    layer |= common.attention_shapes(cfg, cfg.attention_bias, cfg.attention_bias, qk_norm=True)
    layer |= common.mlp_shapes(cfg)
    return common.model_shapes(cfg, layer)


def from_gguf(
    cfg: Gemma3Config, name: str, w: torch.Tensor | Quantized
) -> torch.Tensor | Quantized:
    """llama.cpp's converter stores Gemma's norms with the 1 of (1 + weight) added (as
    transformers' GGUF loader undoes too)."""
    return w - 1 if name.endswith("norm.weight") else w  # type: ignore[operator]


@dataclass
class GemmaNorm:
    """Gemma's RMSNorm: in float32, times (1 + the checkpoint's weight)."""

    weight: torch.Tensor  # 1 + the checkpoint's, float32
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # Float32 activations (a quantized GGUF file's): our step op where it takes the
            # rows. Gemma's ~110 norms a step were ~900 of a 270M decode step's dispatches.
            return rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def gemma_norm(weight: torch.Tensor, eps: float) -> GemmaNorm:
    return GemmaNorm(1.0 + weight.float(), eps)


@dataclass
class Layer:
    """Gemma 3's layer, and Gemma 2's (model/families/gemma2.py): without q/k norms, with
    attention-logit soft-capping."""

    input_norm: GemmaNorm
    qkv: Linear  # q, k and v projections fused
    o: Linear
    q_norm: GemmaNorm | None
    k_norm: GemmaNorm | None
    post_attention_norm: GemmaNorm
    pre_feedforward_norm: GemmaNorm
    post_feedforward_norm: GemmaNorm
    gate: Linear
    up: Linear
    down: Linear
    rope: Rope
    window: int | None
    cfg: GemmaConfig
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)

    def forward(self, x: torch.Tensor, step: Step, kv_cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv(self.input_norm(x))
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        q = qkv[:, :q_size].view(-1, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = apply_rope(torch.cat((q, k), dim=1), *step.rotation(self.rope))
        q, k = qk[:, :heads], qk[:, heads:]
        if (scale := self.query_scale) != 1.0:
            q = q * scale
        attn = step.attend(q, k, v, kv_cache, self.window, self.attn_softcap)
        x = x + self.post_attention_norm(step.all_reduce(self.o(attn)))
        h = self.pre_feedforward_norm(x)
        mlp = self.down(self.up.times(h, F.gelu(self.gate(h), approximate="tanh")))
        return x + self.post_feedforward_norm(step.all_reduce(mlp))

    @property
    def query_scale(self) -> float:
        """A factor on the rotated queries: attention scales scores by head_dim ** -0.5,
        Gemma's by query_pre_attn_scalar ** -0.5."""
        return (self.cfg.head_dim / self.cfg.query_pre_attn_scalar) ** 0.5

    def decode_spec(self) -> DecodeSpec | str:
        """This layer as a decode step's one native call takes it, or why it cannot."""
        cfg = self.cfg
        if self.attn_softcap is not None:
            return "attention soft-capping (Gemma 2)"
        if self.q_norm is None or self.k_norm is None:
            return "a Gemma layer without q/k norms"
        if self.query_scale != 1.0:  # GGUF files' is 1: llama.cpp reads head_dim
            return "a query_pre_attn_scalar other than head_dim"
        norms = (
            self.input_norm,
            self.q_norm,
            self.k_norm,
            self.post_attention_norm,
            self.pre_feedforward_norm,
            self.post_feedforward_norm,
        )
        eps = {n.eps for n in norms}
        if len(eps) > 1:
            return "norms with different epsilons"
        return DecodeSpec(
            input_norm=self.input_norm.weight,
            mlp_norm=self.pre_feedforward_norm.weight,
            q_norm=self.q_norm.weight,
            k_norm=self.k_norm.weight,
            qkv=self.qkv,
            o=self.o,
            gate=self.gate,
            up=self.up,
            down=self.down,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            window=self.window,
            eps=eps.pop(),
            rope=self.rope,
            attention_out_norm=self.post_attention_norm.weight,
            mlp_out_norm=self.post_feedforward_norm.weight,
            gelu=True,
        )


def build(cfg: Gemma3Config, w: Weights) -> Body:
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling)
    global_rope = Rope(inv_freq.to(w.device))
    local_rope = Rope(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta).to(w.device))
    ropes = [global_rope if window is None else local_rope for window in cfg.layer_windows]
    return build_layers(cfg, w, ropes)


def build_layers(
    cfg: GemmaConfig, w: Weights, ropes: list[Rope], attn_softcap: float | None = None
) -> Body:
    """Gemma's layers, each with its rope; q/k norms where the checkpoint has them."""
    eps = cfg.rms_norm_eps

    def norm(name: str) -> GemmaNorm | None:
        weight = w.take_optional(name + ".weight")
        return None if weight is None else gemma_norm(weight, eps)

    layers = []
    for i, (window, rope) in enumerate(zip(cfg.layer_windows, ropes, strict=True)):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        norms = [gemma_norm(w.take(p + name + ".weight"), eps) for name in NORMS]
        layers.append(
            Layer(
                input_norm=norms[0],
                qkv=w.linear(attn + "q_proj", attn + "k_proj", attn + "v_proj"),
                o=w.linear(attn + "o_proj"),
                q_norm=norm(attn + "q_norm"),
                k_norm=norm(attn + "k_norm"),
                post_attention_norm=norms[1],
                pre_feedforward_norm=norms[2],
                post_feedforward_norm=norms[3],
                gate=w.linear(mlp + "gate_proj"),
                up=w.linear(mlp + "up_proj"),
                down=w.linear(mlp + "down_proj"),
                rope=rope,
                window=window,
                cfg=cfg,
                attn_softcap=attn_softcap,
            )
        )
    return Body(
        layers,
        gemma_norm(w.take("model.norm.weight"), eps),
        embed_scale=cfg.hidden_size**0.5,
        logit_softcap=cfg.final_logit_softcapping,
    )
