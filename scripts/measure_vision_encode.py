"""How long one image's encode takes on a realistic-shape vision tower with random weights: the
step the engine will have to fit beside decodes (docs/vision.md).

The default shape is llava-1.5's tower, CLIP ViT-L/14 at 336 pixels (24 layers of 1024, 577
tokens; LLaVA reads the states after 23 layers, so 23 run), through gapless.model.families.vit
on the kernels the probe picks. Prints the median of `--runs` encodes after one warm-up.

    python scripts/measure_vision_encode.py [--dtype float32] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gapless.kernels import resolve_dtype, select
from gapless.model.families import vit
from gapless.model.weights import Weights

VIT_L_336 = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    kernels = select(cpu, resolve_dtype(args.dtype, cpu, False), False)
    cfg = vit.config(VIT_L_336)
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(shape, generator=gen) * 0.02).to(kernels.dtype)
        for name, shape in vit.tensor_shapes(cfg, "").items()
    }
    layers = cfg.num_layers - 1
    tower = vit.build(cfg, Weights(weights, kernels, None), "", layers, post_norm=False)  # type: ignore[arg-type]
    size = cfg.image_size
    pixels = torch.from_numpy(np.random.default_rng(0).standard_normal((3, size, size)))
    times = []
    with torch.inference_mode():
        for _ in range(args.runs + 1):
            start = time.perf_counter()
            for _ in tower.states(pixels.float(), (layers,)):  # layer by layer, to the end
                pass
            times.append(time.perf_counter() - start)
    tokens = cfg.num_patches + 1
    print(
        f"{tokens} tokens, {layers} layers, {kernels.dtype}, {torch.get_num_threads()} threads: "
        f"median {statistics.median(times[1:]):.2f} s (runs: {', '.join(f'{t:.2f}' for t in times)})"
    )


if __name__ == "__main__":
    main()
