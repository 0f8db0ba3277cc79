"""LLaVA: `LlavaForConditionalGeneration`: a CLIP or SigLIP tower (vit.py), a two-layer MLP
projector, and any supported text family as the language model.

As transformers' modeling_llava.py computes an image's features: the tower's hidden states
after `vision_feature_layer` layers (negative: counted back from the last, whose states are
before post_layernorm; a list: those layers' states side by side), without the first (CLIP's
class token; a SigLIP tower's first patch) when `vision_feature_select_strategy` is `default`,
then linear_1, the activation, linear_2.
Only the layers up to the deepest one read are built. One image's features fill its
`image_seq_length` placeholder tokens (`image_token_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gapless.kernels import Linear
from gapless.model.config import ConfigError
from gapless.model.encode_steps import EncodeWork, SteppedEncoder
from gapless.model.families import vit
from gapless.model.families.common import Shapes, linear_shapes
from gapless.model.images import PreparedImage

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("LlavaForConditionalGeneration",)
TOWER = "vision_tower."
PROJECTOR = "multi_modal_projector."

# config.json saves a sub-config's keys only where they differ from transformers' defaults;
# Hub LLaVA checkpoints' text_config names little more than its model_type. The text families
# read Llama-style keys, so a bare text_config gets the defaults of its transformers class.
TEXT_DEFAULTS: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"]},
}


@dataclass(frozen=True)
class LlavaConfig:
    tower: vit.VitConfig
    text_hidden: int
    image_token_id: int
    feature_layers: tuple[int, ...]  # the tower's states read: after this many layers
    drop_class_token: bool
    activation: str
    projector_bias: bool

    @property
    def tokens_per_image(self) -> int:
        return self.tower.num_patches + self.tower.clip - self.drop_class_token


def text_config(raw: dict) -> dict:
    """The language model's config.json keys."""
    text = dict(raw.get("text_config") or {"model_type": "llama"})
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_DEFAULTS:
        raise ConfigError(
            f"unsupported LLaVA language model {model_type!r}; "
            f"supported: {', '.join(TEXT_DEFAULTS)}"
        )
    text = TEXT_DEFAULTS[model_type] | text
    # transformers ties the embeddings if either config says so.
    tied = raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")
    text["tie_word_embeddings"] = bool(tied)
    return text


def config(raw: dict, text_hidden: int) -> LlavaConfig:
    tower = vit.config(raw.get("vision_config") or {})
    layer = raw.get("vision_feature_layer", -2)
    layers = tuple(
        i % (tower.num_layers + 1) for i in (layer if isinstance(layer, list) else [layer])
    )
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ConfigError(f"unsupported vision_feature_select_strategy {strategy!r}")
    activation = raw.get("projector_hidden_act", "gelu")
    if activation not in vit.ACTIVATIONS:
        raise ConfigError(f"unsupported projector_hidden_act {activation!r}")
    return LlavaConfig(
        tower=tower,
        text_hidden=text_hidden,
        image_token_id=raw.get("image_token_index", raw.get("image_token_id", 32000)),
        feature_layers=layers,
        drop_class_token=strategy == "default",
        activation=activation,
        projector_bias=raw.get("multimodal_projector_bias", True),
    )


def tensor_shapes(cfg: LlavaConfig) -> Shapes:
    features = cfg.tower.hidden_size * len(cfg.feature_layers)
    projector = {"linear_1": (cfg.text_hidden, features), "linear_2": (cfg.text_hidden,) * 2}
    shapes = linear_shapes({PROJECTOR + m: s for m, s in projector.items()}, cfg.projector_bias)
    return vit.tensor_shapes(cfg.tower, TOWER) | shapes


@dataclass
class Llava(SteppedEncoder):
    cfg: LlavaConfig
    tower: vit.Tower
    linear_1: Linear
    linear_2: Linear

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def tokens(self, image: PreparedImage) -> int:
        return self.cfg.tokens_per_image

    def rope_positions(self, token_ids: list[int], images: list[PreparedImage]) -> None:
        return None  # an image's tokens rotate by their index, as text

    @property
    def encode_units(self) -> int:
        return max(self.cfg.feature_layers) + 1

    def _encode(self, image: PreparedImage) -> EncodeWork:
        pixels = torch.from_numpy(image.pixels)
        states = yield from self.tower.states(pixels, self.cfg.feature_layers)
        features = torch.cat(states, dim=-1)
        if self.cfg.drop_class_token:  # as transformers, whatever the tower: SigLIP's first patch
            features = features[1:]
        return self.linear_2(vit.ACTIVATIONS[self.cfg.activation](self.linear_1(features)))


def build(cfg: LlavaConfig, w: Weights) -> Llava:
    tower = vit.build(cfg.tower, w, TOWER, max(cfg.feature_layers), post_norm=False)
    return Llava(cfg, tower, w.linear(PROJECTOR + "linear_1"), w.linear(PROJECTOR + "linear_2"))
