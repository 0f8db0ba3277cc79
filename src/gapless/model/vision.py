"""Images in the prompt: a vision-language checkpoint as a text decoder plus a vision encoder, and
each image's embeddings as a media region of the prompt (how the engine is to consume them:
docs/vision.md).

A vision family (a module in model/families/, listed in VISION_FAMILIES here) declares:
- ARCHITECTURES: the config.json `architectures` names it reads;
- text_config(raw) -> the language model's config.json keys, which a text family reads;
- config(raw, text_hidden) -> its vision config;
- tensor_shapes(vcfg) -> {name: shape} of its tower and projector (names as `rename` leaves
  them: `vision_tower.*`, `multi_modal_projector.*`, `visual.*`);
- build(vcfg, weights) -> a VisionEncoder, whose encode is written once as work cut by tower
  blocks (encode_steps.SteppedEncoder), so the engine can spread it over steps;
- optionally adapt_decoder(vcfg, decoder): what its language model does beyond its text family
  (Qwen2.5-VL's M-RoPE).

The region is the prompt's run of the encoder's `image_token_id`, one image after another, each
`tokens(image)` long; the decoder takes the embeddings at those rows instead of the token's
(decoder.BatchInput.embeds), so a prompt chunk that cuts a region takes its slice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

from gapless.kernels import resolve_dtype, select
from gapless.model.config import ConfigError
from gapless.model.decoder import Decoder
from gapless.model.encode_steps import EncodeSteps
from gapless.model.families import gemma3_vision, llava, model_config, qwen2_5_vl
from gapless.model.images import ImageProcessor, PreparedImage
from gapless.model.loader import (
    WeightError,
    Weights,
    build_decoder,
    expected_shapes,
    read_weights,
    stored_dtype,
)

VISION_FAMILIES: tuple[ModuleType, ...] = (llava, gemma3_vision, qwen2_5_vl)

# Where checkpoints put the language model and the vision side, by the transformers version
# that saved them, -> the names the families read (first match wins).
PREFIXES = (
    ("language_model.model.", "model."),  # before 4.52
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # 4.52 on
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.visual.", "visual."),
)


def rename(name: str) -> str:
    """A vision-language checkpoint's tensor name -> the name our families read."""
    for old, new in PREFIXES:
        if name.startswith(old):
            name = new + name.removeprefix(old)
            break
    # CLIP's and SigLIP's transformers classes nest their modules one level deeper.
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


def vision_family_of(architecture: str | None) -> ModuleType:
    for family in VISION_FAMILIES:
        if architecture in family.ARCHITECTURES:
            return family
    names = [name for family in VISION_FAMILIES for name in family.ARCHITECTURES]
    raise ConfigError(
        f"unsupported vision-language architecture {architecture!r}; supported: {', '.join(names)}"
    )


def is_vision_language(path: str | Path) -> bool:
    """Whether a checkpoint is a directory whose config names a vision-language architecture."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or [None]
    return any(architectures[0] in family.ARCHITECTURES for family in VISION_FAMILIES)


class VisionEncoder(Protocol):
    @property
    def image_token_id(self) -> int:
        """The placeholder token an image's region is made of."""
        ...

    def tokens(self, image: PreparedImage) -> int:
        """How many placeholder tokens the image takes in the prompt."""
        ...

    @property
    def encode_units(self) -> int:
        """Units of work an encode is cut into: its tower's blocks + 1 (encode_steps.py)."""
        ...

    def encode_steps(self, image: PreparedImage) -> EncodeSteps:
        """The image's encode as resumable work, run a few units a step by the engine."""
        ...

    def encode(self, image: PreparedImage) -> torch.Tensor:
        """The image's embeddings [tokens, text hidden], in the decoder's dtype: its encode
        steps run to the end."""
        ...

    def rope_positions(
        self, token_ids: list[int], images: list[PreparedImage]
    ) -> torch.Tensor | None:
        """The prompt's M-RoPE positions [3, T] (Qwen2.5-VL); None: each token's index."""
        ...


@dataclass
class VisionLanguageModel:
    decoder: Decoder
    encoder: VisionEncoder
    processor: ImageProcessor
    # Gemma 3: an image's tokens attend to each other both ways (docs/vision.md): the
    # engine computes each image's tokens in one chunk, each attending up to the image's end.
    bidirectional_images: bool = False


def load_vision_language(
    path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu"
) -> VisionLanguageModel:
    """A vision-language checkpoint directory: its language model as a Decoder of its text
    family, its vision tower and projector as a VisionEncoder, its image processor."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    family = vision_family_of((raw.get("architectures") or [None])[0])
    cfg = model_config(family.text_config(raw))
    vcfg = family.config(raw, cfg.hidden_size)
    dev = torch.device(device)
    # A vision-language config may keep its dtype at the top, outside its text config.
    stored = stored_dtype(cfg.torch_dtype or raw.get("torch_dtype") or raw.get("dtype"))
    kernels = select(dev, resolve_dtype(dtype, dev, False, stored), False, exact_kv=True)
    text_shapes = expected_shapes(cfg)
    shapes = text_shapes | family.tensor_shapes(vcfg)
    weights = read_weights(path, shapes, cfg.tie_word_embeddings, kernels.dtype, dev, rename)
    text = {name: weights.pop(name) for name in text_shapes}
    vision = Weights(weights, kernels, None)  # type: ignore[arg-type]
    encoder = family.build(vcfg, vision)
    if vision.weights:
        raise WeightError(f"{family.__name__} left tensor {next(iter(vision.weights))} unused")
    decoder = build_decoder(cfg, text, kernels)
    if hasattr(family, "adapt_decoder"):
        family.adapt_decoder(vcfg, decoder)
    processor = ImageProcessor.from_pretrained(path)
    return VisionLanguageModel(decoder, encoder, processor, family is gemma3_vision)


@dataclass
class MediaRegion:
    """One image's placeholder tokens in a prompt: positions start..end-1 take embeds' rows."""

    start: int
    embeds: torch.Tensor  # [end - start, hidden]
    key: str  # the image's content hash: what the prefix cache keys these positions by

    @property
    def end(self) -> int:
        return self.start + len(self.embeds)


def image_key(image: PreparedImage) -> str:
    """A hash of what the encoder sees: equal keys, equal embeddings."""
    digest = hashlib.blake2b(image.pixels.tobytes(), digest_size=16)
    digest.update(repr((image.pixels.shape, image.grid)).encode())
    return digest.hexdigest()


def mrope_slice(prompt: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """M-RoPE positions [3, end - start] of tokens start..end-1 of a sequence whose prompt's
    are `prompt` [3, prompt length]: past it, decoded tokens' index moved by what the images'
    grids saved, the same on t, h and w."""
    n = prompt.shape[1]
    decoded = torch.arange(max(start, n), max(end, n)) + int(prompt.max()) + 1 - n
    return torch.cat((prompt[:, start:end], decoded.expand(3, -1)), dim=1)


def chunk_embeds(
    regions: list[MediaRegion], start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a prompt chunk of positions start..end-1 gives the decoder as BatchInput.embeds
    (rows counted from the chunk's first): the slices of the regions it cuts; None if none."""
    rows, embeds = [], []
    for region in regions:
        lo, hi = max(start, region.start), min(end, region.end)
        if lo < hi:
            rows.append(torch.arange(lo - start, hi - start))
            embeds.append(region.embeds[lo - region.start : hi - region.start])
    if not rows:
        return None
    device = embeds[0].device
    return torch.cat(rows).to(device), torch.cat(embeds)
