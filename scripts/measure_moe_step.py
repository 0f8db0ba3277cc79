"""Decode step time of a mixture of experts against a dense model of the same active
parameters: bench/make_model.py's qwen3-30b-a3b-narrow (128 experts, 8 chosen per token) and
qwen3-30b-a3b-narrow-dense (one MLP of 8 experts' rows), in one process, steps interleaved.

    .venv/bin/python scripts/measure_moe_step.py DIR [--rounds N] [--context N] [--dtype D]
        [--threads N] [--batch N] [--profile N]

DIR holds the two checkpoints (made there on the first run: ~1.3 GB). Each round times one
decode step of each model, in turn, at the same context length; the figures are medians over
the rounds, and the ratio is the median of each round's MoE/dense. With --profile N, each
model's N steps after those run under torch.profiler: its ops by self time, and how many
op calls a step makes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gapless.bench.harness import Harness
from gapless.bench.make_model import make_model
from gapless.engine.runner import ModelRunner
from gapless.model.loader import load_decoder

PRESETS = ("qwen3-30b-a3b-narrow", "qwen3-30b-a3b-narrow-dense")


class Decoding:
    """`batch` sequences of one model, prefilled to the context, then decoded a step at a time
    (a token each)."""

    def __init__(self, path: Path, dtype: str, context: int, steps: int, batch: int) -> None:
        self.decoder = load_decoder(path, dtype)
        per = (context + steps) // 16 + 2
        self.harness = Harness(ModelRunner(self.decoder, per * batch, 16))
        gen = torch.Generator().manual_seed(0)
        vocab = self.decoder.config.vocab_size
        self.requests = [
            self.harness.request(
                torch.randint(0, vocab, (context + steps,), generator=gen).tolist()
            )
            for _ in range(batch)
        ]
        self.step(context)

    def step(self, tokens: int = 1) -> float:
        start = time.perf_counter()
        self.harness.step([(r, tokens) for r in self.requests])
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--profile", type=int, default=0, help="steps of each model to profile")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = [args.dir / preset for preset in PRESETS]
    for preset, path in zip(PRESETS, paths, strict=True):
        if not path.exists():
            make_model(path, preset)
    moe, dense = (
        Decoding(path, args.dtype, args.context, args.rounds + 5 + args.profile, args.batch)
        for path in paths
    )
    for _ in range(5):  # warm-up
        moe.step(), dense.step()
    times = [(moe.step(), dense.step()) for _ in range(args.rounds)]
    moe_ms, dense_ms = (1e3 * statistics.median(t) for t in zip(*times, strict=True))
    ratio = statistics.median(m / d for m, d in times)
    print(moe.decoder.kernels.describe())
    print(f"threads {torch.get_num_threads()}, context {args.context}, {args.rounds} rounds")
    print(
        f"batch-{args.batch} decode step: MoE {moe_ms:.2f} ms, dense {dense_ms:.2f} ms, "
        f"MoE/dense {ratio:.2f}x (median of per-round ratios)"
    )
    for name, model in (("MoE", moe), ("dense", dense)):
        if args.profile:
            profile(name, model, args.profile)


def profile(name: str, model: Decoding, steps: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model.step()
    ops = prof.key_averages()
    calls = sum(op.count for op in ops) / steps
    self_ms = sum(op.self_cpu_time_total for op in ops) / steps / 1e3
    print(f"\n{name}: {calls:.0f} op calls a step, {self_ms:.2f} ms of op self time a step")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
