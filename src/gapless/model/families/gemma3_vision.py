"""Gemma 3's vision side: `Gemma3ForConditionalGeneration` (model_type `gemma3`): a SigLIP tower
(vit.py) before our gemma3 text family.

As transformers' modeling_gemma3.py computes an image's features: the tower's last states
(post_layernorm included), average-pooled from its patch grid down to `mm_tokens_per_image`
(256: 64x64 patches of an 896-pixel image in 4x4 squares), Gemma's RMSNorm (float32, times
1 + w; the tower's eps), then a projection to the text hidden size. The prompt holds
`boi`, `mm_tokens_per_image` image tokens, `eoi`.

transformers attends both ways among one image's tokens when given the token_type_ids its
processor returns (a causal mask OR'ed with "same image"); so does the engine, which computes
each image in one chunk (docs/vision.md, "Gemma 3: attention both ways inside an image").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gapless.kernels import Linear
from gapless.model.encode_steps import EncodeWork, SteppedEncoder
from gapless.model.families import vit
from gapless.model.families.common import Shapes
from gapless.model.families.gemma3 import GemmaNorm, gemma_norm
from gapless.model.images import PreparedImage

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
TOWER = "vision_tower."
PROJECTOR = "multi_modal_projector."


@dataclass(frozen=True)
class Gemma3VisionConfig:
    tower: vit.VitConfig
    text_hidden: int
    image_token_id: int
    tokens_per_image: int
    boi_token_id: int  # <start_of_image>, what the chat template writes for an image
    eoi_token_id: int  # <end_of_image>


# config.json saves text_config's keys only where they differ from transformers' defaults
# (Gemma3TextConfig's): the Hub's Gemma 3 checkpoints name their sizes and little else.
TEXT_DEFAULTS = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def text_config(raw: dict) -> dict:
    """The language model's config.json keys: our gemma3 family reads them."""
    text = TEXT_DEFAULTS | dict(raw.get("text_config") or {})
    return text | {"tie_word_embeddings": raw.get("tie_word_embeddings", True)}


def config(raw: dict, text_hidden: int) -> Gemma3VisionConfig:
    return Gemma3VisionConfig(
        tower=vit.config({"model_type": "siglip_vision_model"} | raw.get("vision_config", {})),
        text_hidden=text_hidden,
        image_token_id=raw.get("image_token_index", raw.get("image_token_id", 262_144)),
        tokens_per_image=raw.get("mm_tokens_per_image", 256),
        boi_token_id=raw.get("boi_token_index", 255_999),
        eoi_token_id=raw.get("eoi_token_index", 256_000),
    )


def tensor_shapes(cfg: Gemma3VisionConfig) -> Shapes:
    hidden = cfg.tower.hidden_size
    return vit.tensor_shapes(cfg.tower, TOWER) | {
        PROJECTOR + "mm_input_projection_weight": (hidden, cfg.text_hidden),
        PROJECTOR + "mm_soft_emb_norm.weight": (hidden,),
    }


@dataclass
class Gemma3Vision(SteppedEncoder):
    cfg: Gemma3VisionConfig
    tower: vit.Tower
    norm: GemmaNorm
    projection: Linear

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def tokens(self, image: PreparedImage) -> int:
        return self.cfg.tokens_per_image

    def expand_markup(self, text: str, token_text: Callable[[int], str]) -> str:
        """A rendered chat as Gemma 3's processor rewrites it before tokenizing: where the
        template wrote `<start_of_image>` for an image, blank lines around the image's
        start, its placeholder (one here; admission expands it) and its end. The newlines
        merge with the text around them, so they are text, not ids added later."""
        boi, eoi = token_text(self.cfg.boi_token_id), token_text(self.cfg.eoi_token_id)
        image = token_text(self.cfg.image_token_id)
        return text.replace(boi, f"\n\n{boi}{image}{eoi}\n\n")

    def rope_positions(self, token_ids: list[int], images: list[PreparedImage]) -> None:
        return None  # an image's tokens rotate by their index, as text

    @property
    def encode_units(self) -> int:
        return self.cfg.tower.num_layers + 1

    def _encode(self, image: PreparedImage) -> EncodeWork:
        layers = (self.cfg.tower.num_layers,)
        (last,) = yield from self.tower.states(torch.from_numpy(image.pixels), layers)
        states = self.tower.post(last)  # [patches, hidden]
        side = self.cfg.tower.image_size // self.cfg.tower.patch_size
        kernel = side // round(self.cfg.tokens_per_image**0.5)
        grid = states.T.reshape(1, -1, side, side)
        pooled = F.avg_pool2d(grid, kernel, kernel).flatten(2)[0].T  # [tokens, hidden]
        return self.projection(self.norm(pooled))


def build(cfg: Gemma3VisionConfig, w: Weights) -> Gemma3Vision:
    tower = vit.build(cfg.tower, w, TOWER, cfg.tower.num_layers, post_norm=True)
    norm = gemma_norm(w.take(PROJECTOR + "mm_soft_emb_norm.weight"), cfg.tower.eps)
    # transformers multiplies by the weight as stored, [vision hidden, text hidden].
    weight = w.take(PROJECTOR + "mm_input_projection_weight")
    return Gemma3Vision(cfg, tower, norm, w.kernels.linear(weight.T.contiguous()))
