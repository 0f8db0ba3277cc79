"""The CLIP and SigLIP vision towers (`clip_vision_model`, `siglip_vision_model`), which LLaVA and
Gemma 3 put in front of their language models.

A plain ViT over one image at a time, as transformers' modeling_clip.py and modeling_siglip.py
compute it: patches by a strided convolution, learned position embeddings, pre-norm layers
(LayerNorm, bidirectional multi-head attention with biases, a two-linear MLP). CLIP's has a
class token and a LayerNorm before the layers; SigLIP's has neither, and its patch convolution
a bias. SigLIP's attention-pooling head is not used by either family.

Tensor names are the checkpoint's under the tower's prefix with the `vision_model.` level some
checkpoints add removed (model/vision.py): `embeddings.*`, `pre_layrnorm.*`,
`encoder.layers.{i}.*`, `post_layernorm.*`, `head.*`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gapless.kernels import Linear
from gapless.model.config import ConfigError
from gapless.model.families.common import Shapes, linear_shapes

if TYPE_CHECKING:
    from gapless.model.weights import Weights

MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VitConfig:
    clip: bool  # CLIP's class token and pre-layer norm; SigLIP has neither
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    eps: float
    activation: str
    use_head: bool  # SigLIP's attention-pooling head is in the checkpoint

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def config(raw: dict) -> VitConfig:
    """From a vision_config: transformers' defaults where a key is absent."""
    model_type = raw.get("model_type", "clip_vision_model")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"unsupported vision tower {model_type!r}; supported: {', '.join(MODEL_TYPES)}"
        )
    clip = model_type == "clip_vision_model"
    activation = raw.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise ConfigError(f"unsupported vision activation {activation!r}")
    return VitConfig(
        clip=clip,
        hidden_size=raw.get("hidden_size", 768),
        intermediate_size=raw.get("intermediate_size", 3072),
        num_layers=raw.get("num_hidden_layers", 12),
        num_heads=raw.get("num_attention_heads", 12),
        image_size=raw.get("image_size", 224),
        patch_size=raw.get("patch_size", 32 if clip else 16),
        eps=raw.get("layer_norm_eps", 1e-5 if clip else 1e-6),
        activation=activation,
        use_head=not clip and raw.get("vision_use_head", True),
    )


def tensor_shapes(cfg: VitConfig, prefix: str) -> Shapes:
    """Every tensor of the tower, under prefix."""
    d, inter, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    positions = cfg.num_patches + cfg.clip
    norm = {"weight": (d,), "bias": (d,)}
    shapes: Shapes = {
        "embeddings.patch_embedding.weight": (d, 3, p, p),
        "embeddings.position_embedding.weight": (positions, d),
    }
    shapes |= {f"post_layernorm.{k}": s for k, s in norm.items()}
    if cfg.clip:
        shapes["embeddings.class_embedding"] = (d,)
        shapes |= {f"pre_layrnorm.{k}": s for k, s in norm.items()}
    else:
        shapes["embeddings.patch_embedding.bias"] = (d,)
    attn = {f"self_attn.{m}_proj": (d, d) for m in ("q", "k", "v", "out")}
    layer = linear_shapes(attn | {"mlp.fc1": (inter, d), "mlp.fc2": (d, inter)}, bias=True)
    layer |= {f"layer_norm{i}.{k}": s for i in (1, 2) for k, s in norm.items()}
    for i in range(cfg.num_layers):
        shapes |= {f"encoder.layers.{i}.{name}": shape for name, shape in layer.items()}
    if cfg.use_head:
        head = {"attention.in_proj_weight": (3 * d, d), "attention.in_proj_bias": (3 * d,)}
        head |= {"probe": (1, 1, d)} | {f"layernorm.{k}": s for k, s in norm.items()}
        head |= linear_shapes({"attention.out_proj": (d, d)}, bias=True)
        head |= linear_shapes({"mlp.fc1": (inter, d), "mlp.fc2": (d, inter)}, bias=True)
        shapes |= {f"head.{name}": shape for name, shape in head.items()}
    return {prefix + name: shape for name, shape in shapes.items()}


@dataclass
class LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@dataclass
class Layer:
    norm1: LayerNorm
    qkv: Linear  # q, k and v fused
    out: Linear
    norm2: LayerNorm
    fc1: Linear
    fc2: Linear
    num_heads: int
    act: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]: one image's patches, which all attend to each other."""
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).permute(1, 2, 0, 3)
        # 4-D: on the CPU a 3-D input takes SDPA's unfused math path, 3x slower at 4,000 keys.
        attn = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # [heads, N, dim]
        x = x + self.out(attn.transpose(0, 1).reshape(n, d))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


@dataclass
class Tower:
    cfg: VitConfig
    patch_weight: torch.Tensor  # [hidden, 3, P, P]
    patch_bias: torch.Tensor | None
    class_embedding: torch.Tensor | None  # CLIP's
    positions: torch.Tensor  # [patches (+ 1), hidden]
    pre_norm: LayerNorm | None  # CLIP's
    layers: list[Layer]
    post_norm: LayerNorm | None

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [3, H, W] (the config's image size) -> the first layer's input [patches (+
        CLIP's class token first), hidden]."""
        w = self.patch_weight
        x = F.conv2d(pixels[None].to(w.device, w.dtype), w, self.patch_bias, self.cfg.patch_size)
        x = x.flatten(2)[0].T  # [patches, hidden], row by row
        if self.class_embedding is not None:
            x = torch.cat((self.class_embedding[None], x))
        x = x + self.positions
        return x if self.pre_norm is None else self.pre_norm(x)

    def states(
        self, pixels: torch.Tensor, after: tuple[int, ...]
    ) -> Generator[None, None, list[torch.Tensor]]:
        """The states after each number of layers in `after` (0: the embeddings), as
        transformers' hidden_states[i] (none of them post-normed), yielding after each layer: a
        family's encode steps (model/encode_steps.py) take it with `yield from`, so the
        embedding runs with the first layer."""
        x = self.embed(pixels)
        kept = {0: x} if 0 in after else {}
        last = max(after)
        for i, layer in enumerate(self.layers[:last], 1):
            x = layer.forward(x)
            if i in after:
                kept[i] = x
            yield
        return [kept[i] for i in after]

    def post(self, x: torch.Tensor) -> torch.Tensor:
        """post_layernorm, if built."""
        return x if self.post_norm is None else self.post_norm(x)


def build(cfg: VitConfig, w: Weights, prefix: str, num_layers: int, post_norm: bool) -> Tower:
    """The tower's first num_layers layers, and post_layernorm if post_norm; the tensors of
    the parts not built are dropped."""

    def norm(name: str) -> LayerNorm:
        return LayerNorm(w.take(name + ".weight"), w.take(name + ".bias"), cfg.eps)

    p = prefix
    layers = []
    for i in range(num_layers):
        layer = f"{p}encoder.layers.{i}."
        attn = layer + "self_attn."
        layers.append(
            Layer(
                norm1=norm(layer + "layer_norm1"),
                qkv=w.linear(attn + "q_proj", attn + "k_proj", attn + "v_proj"),
                out=w.linear(attn + "out_proj"),
                norm2=norm(layer + "layer_norm2"),
                fc1=w.linear(layer + "mlp.fc1"),
                fc2=w.linear(layer + "mlp.fc2"),
                num_heads=cfg.num_heads,
                act=ACTIVATIONS[cfg.activation],
            )
        )
    tower = Tower(
        cfg=cfg,
        patch_weight=w.take(p + "embeddings.patch_embedding.weight"),
        patch_bias=w.take_optional(p + "embeddings.patch_embedding.bias"),
        class_embedding=w.take_optional(p + "embeddings.class_embedding"),
        positions=w.take(p + "embeddings.position_embedding.weight"),
        pre_norm=norm(p + "pre_layrnorm") if cfg.clip else None,
        layers=layers,
        post_norm=norm(p + "post_layernorm") if post_norm else None,
    )
    for name in [n for n in w.weights if n.startswith(p)]:
        w.take(name)
    return tower
