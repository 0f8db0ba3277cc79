"""Llama, Mistral, Qwen2 and Qwen3: one pre-norm decoder that differs by flags.

Each layer: RMSNorm, q/k/v projections (biased in Qwen2), per-head q/k RMSNorm (Qwen3),
rotary embedding (default, linear or llama3), attention (in a sliding window on Mistral's and
on the layers a config's `layer_types` says), o projection; RMSNorm, SwiGLU MLP.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gapless.kernels import Linear
from gapless.kernels.decode_layers import DecodeSpec
from gapless.kernels.plans import KVCache
from gapless.kernels.quant import Quantized
from gapless.model.config import ModelConfig, base_fields, check_activation
from gapless.model.decoder import Body, RMSNorm, Rope, Step, apply_rope, rms_norm, rope_inv_freq
from gapless.model.families import common
from gapless.model.families.common import Meta, Shapes

if TYPE_CHECKING:
    from gapless.model.weights import Weights

# architecture -> (q/k/v bias by default, per-head q/k RMSNorm, honours sliding_window by default)
ARCHITECTURES: dict[str, tuple[bool, bool, bool]] = {
    "LlamaForCausalLM": (False, False, False),
    "MistralForCausalLM": (False, False, True),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (False, True, False),
}
# general.architecture -> the Hugging Face architecture with the same decoder; Mistral's GGUF
# files are `llama`.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
GGUF_NAMES = common.GGUF_NAMES
SHARD_ROWS, SHARD_COLUMNS = common.SHARD_ROWS, common.SHARD_COLUMNS


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def config(raw: dict, flags: tuple[bool, bool, bool] | None = None) -> LlamaConfig:
    """flags: as ARCHITECTURES' (a family built on these layers), else the architecture's."""
    arch = raw["architectures"][0]
    default_bias, qk_norm, default_sliding = flags or ARCHITECTURES[arch]
    check_activation(raw, "hidden_act", "silu")
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", default_sliding) and window
    layer_types = raw.get("layer_types")
    if layer_types and uses_window:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        windows = tuple([window if uses_window else None] * num_layers)
    bias = raw.get("attention_bias", default_bias)
    return LlamaConfig(
        **base_fields(raw, windows),
        qkv_bias=bias,
        # Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not.
        o_bias=bias and arch != "Qwen2ForCausalLM",
        mlp_bias=raw.get("mlp_bias", False),
        qk_norm=qk_norm,
    )


def gguf_config(raw: dict, meta: Meta) -> dict:
    """config.json's keys of a GGUF file: the keys every llama.cpp file shares say it all,
    but a `llama` file with experts is Mixtral's (families/mixtral.py)."""
    if meta("expert_count", 0):
        return raw | {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": meta("expert_count", None),
            "num_experts_per_tok": meta("expert_used_count", None),
        }
    return raw


def tensor_shapes(cfg: LlamaConfig) -> Shapes:
    layer = common.norm_shapes(cfg, "input_layernorm", "post_attention_layernorm")
    layer |= common.attention_shapes(cfg, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm)
    layer |= common.mlp_shapes(cfg, cfg.mlp_bias)
    return common.model_shapes(cfg, layer)


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for its rope layout (`llama` files only).

    Per head, the converter interleaves the two rotated halves (rows 0, d/2, 1, d/2+1, ...);
    the rotate-half rope wants them back as two contiguous halves.
    """
    rest = w.shape[1:]
    return w.reshape(num_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def from_gguf(cfg: LlamaConfig, name: str, w: torch.Tensor | Quantized) -> torch.Tensor | Quantized:
    """A GGUF tensor (under its Hugging Face name) as the checkpoint holds it."""
    return unpermute_qk(cfg, name, w) if cfg.architecture == "LlamaForCausalLM" else w


def unpermute_qk(
    cfg: LlamaConfig, name: str, w: torch.Tensor | Quantized
) -> torch.Tensor | Quantized:
    """q/k projections as the checkpoint holds them, from a file whose converter permuted
    their rows (unpermute_rope_rows); other tensors as they are."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(name.split(".")[-2])
    if heads is None:
        return w
    unpermute = functools.partial(unpermute_rope_rows, num_heads=heads)
    return w.map_rows(unpermute) if isinstance(w, Quantized) else unpermute(w)


@dataclass
class PreNormLayer:
    """Llama's layer up to its feed-forward: RMSNorm, attention, residual add; RMSNorm, and the
    feed-forward each subclass defines (`mlp`), residual add."""

    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused: one matmul instead of three
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    rope: Rope | None  # None: no rotary embedding (SmolLM3's NoPE layers)
    window: int | None
    cfg: LlamaConfig
    # A logit per head that joins each softmax's denominator (gpt-oss's attention sinks).
    sinks: torch.Tensor | None = field(default=None, kw_only=True)

    def forward(self, x: torch.Tensor, step: Step, kv_cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(h)
        # q and k heads side by side, so one rotation covers both.
        qk_size = (heads + kv_heads) * head_dim
        qk = qkv[:, :qk_size].view(-1, heads + kv_heads, head_dim)
        v = qkv[:, qk_size:].view(-1, kv_heads, head_dim)
        if self.q_norm is not None:
            q = rms_norm(qk[:, :heads], self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(qk[:, heads:], self.k_norm, cfg.rms_norm_eps)
            qk = torch.cat((q, k), dim=1)
        if self.rope is not None:
            qk = apply_rope(qk, *step.rotation(self.rope))
        attn = step.attend(qk[:, :heads], qk[:, heads:], v, kv_cache, self.window, sinks=self.sinks)
        x = x + step.all_reduce(self.o(attn))
        h = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        return x + step.all_reduce(self.mlp(h))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Layer(PreNormLayer):
    """With a SwiGLU MLP."""

    gate: Linear
    up: Linear
    down: Linear

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(self.up.times(h, self.gate.silu(h)))

    def decode_spec(self) -> DecodeSpec | str:
        """This layer as a decode step's one native call takes it, or why it cannot."""
        if self.rope is None:
            return "a layer without a rotary embedding (NoPE)"
        if self.sinks is not None:
            return "attention sinks"
        cfg = self.cfg
        return DecodeSpec(
            input_norm=self.input_norm,
            mlp_norm=self.post_norm,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            qkv=self.qkv,
            o=self.o,
            gate=self.gate,
            up=self.up,
            down=self.down,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            window=self.window,
            eps=cfg.rms_norm_eps,
            rope=self.rope,
        )


def default_rope(cfg: LlamaConfig, device: torch.device) -> Rope:
    """The rope the config describes."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling)
    return Rope(inv_freq.to(device))


def attention_parts(
    cfg: LlamaConfig, w: Weights, i: int, rope: Rope | None, window: int | None
) -> dict[str, Any]:
    """PreNormLayer's fields of layer i, its weights taken from w."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    return {
        "input_norm": w.take(p + "input_layernorm.weight"),
        "qkv": w.linear(attn + "q_proj", attn + "k_proj", attn + "v_proj"),
        "o": w.linear(attn + "o_proj"),
        "q_norm": w.take_optional(attn + "q_norm.weight"),
        "k_norm": w.take_optional(attn + "k_norm.weight"),
        "post_norm": w.take(p + "post_attention_layernorm.weight"),
        "sinks": w.take_optional(attn + "sinks"),
        "rope": rope,
        "window": window,
        "cfg": cfg,
    }


def build(
    cfg: LlamaConfig, w: Weights, rope: Rope | None = None, no_rope: Collection[int] = ()
) -> Body:
    """The layers; rope: one other than the config's (a family built on these layers);
    no_rope: the layers that rotate nothing (NoPE)."""
    if rope is None:
        rope = default_rope(cfg, w.device)
    layers = []
    for i, window in enumerate(cfg.layer_windows):
        mlp = f"model.layers.{i}.mlp."
        layers.append(
            Layer(
                **attention_parts(cfg, w, i, None if i in no_rope else rope, window),
                gate=w.linear(mlp + "gate_proj"),
                up=w.linear(mlp + "up_proj"),
                down=w.linear(mlp + "down_proj"),
            )
        )
    return Body(layers, RMSNorm(w.take("model.norm.weight"), cfg.rms_norm_eps))
