"""A 512-token prompt chunk step on GGUF blocks against the same model's dense weights (issue
24's target: at most 1.1x the dense bf16 step).

    .venv/bin/python scripts/measure_chunk_step.py GGUF DENSE_DIR [--rounds N]

DENSE_DIR: the same model as a checkpoint directory (for the default model:
scripts/export_smollm2_hf.py DIR --dtype bfloat16). Three arms, each a fresh 512-token prompt
alone in a step, alternating in one process (median of N each, after one warm-up), so that a
machine shared with other work slows them alike: the blocks with rows interleaved (as loaded
now), in the file's layout, and the dense weights. Engine only, 2 threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gapless.bench.harness import Harness
from gapless.engine.runner import ModelRunner
from gapless.kernels import blocks
from gapless.model.checkpoint import load_model

CHUNK, BLOCK = 512, 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("gguf")
    p.add_argument("dense")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(2)
    interleaved, _ = load_model(args.gguf, "auto")
    original = blocks.can_interleave
    blocks.can_interleave = lambda qtype: False  # type: ignore[assignment]
    file_layout, _ = load_model(args.gguf, "auto")
    blocks.can_interleave = original  # type: ignore[assignment]
    dense, _ = load_model(args.dense, "auto")
    arms = {"blocks, interleaved": interleaved, "blocks, file layout": file_layout, "dense": dense}
    for name, decoder in arms.items():
        print(f"{name}: {decoder.kernels.describe()}")
    harnesses = {name: Harness(ModelRunner(d, CHUNK // BLOCK, BLOCK)) for name, d in arms.items()}
    ids = torch.randint(0, dense.config.vocab_size, (CHUNK,)).tolist()
    # Unbooked, each step runs the prompt again from its first token: a fresh prompt each time.
    prompts = {name: harness.request(ids) for name, harness in harnesses.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds + 1):
        for name, harness in harnesses.items():
            start = time.perf_counter()
            harness.step([(prompts[name], CHUNK)], book=False)
            times[name].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}
    print(
        f"{CHUNK}-token chunk step, median of {args.rounds} each, interleaved: "
        + ", ".join(f"{name} {ms:.0f} ms" for name, ms in medians.items())
        + f"; blocks / dense {medians['blocks, interleaved'] / medians['dense']:.2f}x"
    )


if __name__ == "__main__":
    main()
