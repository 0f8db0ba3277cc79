"""Image preprocessing for the vision-language families, as their transformers image processors
(the Pillow backend) compute it, read from the checkpoint's preprocessor config.

Every layout runs the same steps, each where the config says: the image in RGB (transparency
composited onto white), padded to a square of the mean colour (LLaVA's `do_pad`), resized by
Pillow with the processor's filter, centre-cropped, rescaled (in float64, then float32, as
transformers does) and normalized in float32. Sizes:
- `shortest_edge` (CLIP, LLaVA): the short side to that many pixels, the long one in proportion
  (truncated), then the crop;
- `height` and `width` (SigLIP, Gemma 3: 896x896 for the released checkpoints): exactly that;
- Qwen2-VL's (Qwen2.5-VL's) `smart_resize`: both sides to multiples of patch * merge, the pixel
  count within min_pixels..max_pixels, then the patches flattened as its vision tower reads
  them, each repeated over temporal_patch_size frames.
Gemma 3's pan-and-scan (extra crops of a wide image) is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from gapless.model.config import ConfigError

# The processors' names in config files; the "Fast" (torchvision) ones compute the same steps.
SQUARE_PAD = ("LlavaImageProcessor",)
PATCHIFY = ("Qwen2VLImageProcessor",)
KNOWN = (
    "CLIPImageProcessor",
    "SiglipImageProcessor",
    "Gemma3ImageProcessor",
    *SQUARE_PAD,
    *PATCHIFY,
)


@dataclass(frozen=True)
class PreparedImage:
    """An image as its vision tower takes it: pixels [3, H, W] float32, or for Qwen2-VL's
    layout the flattened patches [N, 3 * T * P * P] and their grid (frames, rows, columns)."""

    pixels: np.ndarray
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class ImageProcessor:
    kind: str  # one of KNOWN
    size: dict[str, int]
    resample: int  # a PIL.Image.Resampling value
    crop: tuple[int, int] | None  # (height, width) of the centre crop, if any
    rescale: float | None
    mean: tuple[float, ...] | None  # normalize by these, if given
    std: tuple[float, ...] | None
    pad_square: bool
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        """From preprocessor_config.json, or processor_config.json's `image_processor`."""
        path = Path(path)
        if (file := path / "preprocessor_config.json").is_file():
            return cls.from_dict(json.loads(file.read_text()))
        if (file := path / "processor_config.json").is_file():
            return cls.from_dict(json.loads(file.read_text())["image_processor"])
        raise ConfigError(f"no preprocessor_config.json or processor_config.json in {path}")

    @classmethod
    def from_dict(cls, raw: dict) -> ImageProcessor:
        kind = raw.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
        if kind not in KNOWN:
            raise ConfigError(
                f"unsupported image processor {kind!r}; supported: {', '.join(KNOWN)}"
            )
        if raw.get("do_pan_and_scan"):
            raise ConfigError("Gemma 3's pan-and-scan is unsupported")
        size = dict(raw.get("size") or {})
        if kind in PATCHIFY:  # the Hub's configs name the bounds min_pixels and max_pixels
            size = {
                "shortest_edge": raw.get("min_pixels") or size.get("shortest_edge", 56 * 56),
                "longest_edge": raw.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280),
            }
        crop = raw.get("crop_size") if raw.get("do_center_crop") else None
        normalize = raw.get("do_normalize", True)
        return cls(
            kind=kind,
            size=size,
            resample=raw.get("resample", Image.Resampling.BICUBIC),
            crop=None if crop is None else (crop["height"], crop["width"]),
            rescale=raw.get("rescale_factor", 1 / 255) if raw.get("do_rescale", True) else None,
            mean=tuple(raw["image_mean"]) if normalize else None,
            std=tuple(raw["image_std"]) if normalize else None,
            pad_square=kind in SQUARE_PAD and bool(raw.get("do_pad")),
            patch_size=raw.get("patch_size", 14),
            merge_size=raw.get("merge_size", 2),
            temporal_patch_size=raw.get("temporal_patch_size", 2),
        )

    def __call__(self, image: Image.Image) -> PreparedImage:
        rgb = to_rgb(image)
        if self.pad_square and self.mean is not None:
            rgb = pad_to_square(rgb, tuple(int(m * 255) for m in self.mean))
        rgb = np.asarray(
            Image.fromarray(rgb).resize(self.resized(*rgb.shape[:2])[::-1], self.resample)
        )
        if self.crop is not None:
            rgb = center_crop(rgb, *self.crop)
        pixels = rgb.transpose(2, 0, 1)  # [3, H, W]
        if self.rescale is not None:
            pixels = (pixels.astype(np.float64) * self.rescale).astype(np.float32)
        else:
            pixels = pixels.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        if self.kind in PATCHIFY:
            return self.patchify(pixels)
        return PreparedImage(np.ascontiguousarray(pixels))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the image after the resize."""
        size = self.size
        if self.kind in PATCHIFY:
            factor = self.patch_size * self.merge_size
            return smart_resize(height, width, factor, size["shortest_edge"], size["longest_edge"])
        if "shortest_edge" in size:
            short, long = sorted((height, width))
            new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        return size["height"], size["width"]

    def patchify(self, pixels: np.ndarray) -> PreparedImage:
        """Qwen2-VL's layout: patches ordered merge window by merge window (so that the tower's
        merger takes consecutive rows), each flattened as (channel, frame, row, column)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        c, h, w = pixels.shape
        rows, cols = h // p, w // p
        patches = pixels.reshape(c, rows // m, m, p, cols // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [rows/m, cols/m, m, m, c, p, p]
        patches = np.repeat(patches[:, :, :, :, :, None], t, axis=5)
        return PreparedImage(patches.reshape(rows * cols, c * t * p * p), (1, rows, cols))


def to_rgb(image: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8; transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"))


def pad_to_square(rgb: np.ndarray, colour: tuple[int, ...]) -> np.ndarray:
    """The image centred on a square of the colour (the shorter side padded)."""
    height, width, _ = rgb.shape
    side = max(height, width)
    out = np.empty((side, side, 3), dtype=rgb.dtype)
    out[:] = colour
    top, left = (side - height) // 2, (side - width) // 2
    out[top : top + height, left : left + width] = rgb
    return out


def center_crop(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    h, w, _ = rgb.shape
    if height > h or width > w:  # the processors pad first; no supported layout gets here
        raise ValueError(f"a {h}x{w} image is smaller than its {height}x{width} crop")
    top, left = (h - height) // 2, (w - width) // 2
    return rgb[top : top + height, left : left + width]


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's: sides rounded to multiples of factor, the area brought within the bounds
    with the aspect ratio kept as well as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a {height}x{width} image's aspect ratio is over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w
