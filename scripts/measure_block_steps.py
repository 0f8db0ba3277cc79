"""Engine-only step times of one model: batch-1 and batch-4 decode steps, and a 512-token
prompt chunk beside 4 decodes (the step gapless interleaves), plus resident memory after load.

    .venv/bin/python scripts/measure_block_steps.py MODEL [--no-blocks] [--dtype D] [--rounds N]

MODEL is a GGUF file (its quantized weights in their blocks, on our kernels) or a checkpoint
directory (dense). --no-blocks runs a GGUF file as before the block kernels: Q4_0/Q4_1 on
torch's int4 op, other types dequantized at load. One model per process, so that resident
memory is its own; run the variants one after another and compare medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gapless.kernels.probe
from gapless.bench.harness import Harness
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.model.checkpoint import load_model

CONTEXT, CHUNK = 256, 512


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--no-blocks", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=20, help="decode steps timed per batch size")
    args = p.parse_args()
    if args.no_blocks:
        gapless.kernels.probe.gguf_blocks_work = lambda: False  # type: ignore[assignment]
        gapless.kernels.gguf_blocks_work = lambda: False  # type: ignore[attr-defined]
    torch.set_num_threads(2)
    before = rss_mib()
    decoder, _ = load_model(args.model, args.dtype)
    loaded = rss_mib()
    streams = 4
    seq_blocks = (CONTEXT + args.rounds + CHUNK) // 16 + 2
    harness = Harness(ModelRunner(decoder, (streams + 1) * seq_blocks, 16))
    gen = torch.Generator().manual_seed(0)
    vocab = decoder.config.vocab_size

    def request(n: int) -> Request:
        return harness.request(torch.randint(0, vocab, (n,), generator=gen).tolist())

    def step(chunks: list[tuple[Request, int]]) -> float:
        start = time.perf_counter()
        harness.step(chunks)
        return time.perf_counter() - start

    decodes = [request(CONTEXT + 2 * args.rounds + 4) for _ in range(streams)]
    for r in decodes:
        step([(r, CONTEXT)])
    one = [step([(decodes[0], 1)]) for _ in range(args.rounds)]
    four = [step([(r, 1) for r in decodes]) for _ in range(args.rounds)]
    mixed = []
    for _ in range(3):  # a fresh prompt's first chunk beside the 4 decodes; the first warms up
        prompt = request(CHUNK)
        mixed.append(step([*((r, 1) for r in decodes), (prompt, CHUNK)]))
        harness.release(prompt)
    print(decoder.kernels.describe())
    print(
        f"decode b1 {1e3 * statistics.median(one):.1f} ms, b4 {1e3 * statistics.median(four):.1f}"
        f" ms, 512-token chunk + 4 decodes {1e3 * statistics.median(mixed[1:]):.0f} ms;"
        f" RSS after load {loaded:.0f} MiB ({loaded - before:+.0f} by the load)"
    )


if __name__ == "__main__":
    main()
