"""Pipeline parallelism's decode throughput: 8 streams decoding at P=2 (one thread per stage)
against one rank with 2 threads, and the pipeline's bubble.

    gapless bench make-model /tmp/q05 --preset qwen2.5-0.5b --seed 0
    flock /work/bench.lock .venv/bin/python scripts/measure_pipeline.py /tmp/q05

Both runners live in this process (rank 0, stage 0 of a 2-rank group; the one-rank runner
uses its threads while the worker waits) and their steps alternate, so that a shared
machine's load hits both alike. Each times the decode step of `--streams` sequences after
`--history` tokens. The one-rank runner also runs on 1 thread: that step's time is the work
both stages do between them (each on one thread), so the bubble, the share of the two stage
threads' time spent idle, is 1 - (one rank, 1 thread) / (2 x the P=2 step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gapless.bench.harness import Harness
from gapless.engine import distributed
from gapless.engine.builder import what_ranks_load
from gapless.engine.config import EngineConfig
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.model.checkpoint import load_model


def staged_runner(path: str, dtype: str, blocks: int) -> ModelRunner:
    parallel = distributed.start(2, distributed.Launch(threads=1)).parallel
    load = what_ranks_load(path, EngineConfig(dtype=dtype, pipeline_parallel_size=2))
    parallel.broadcast(load)
    decoder, _ = load.load(parallel)
    parallel.broadcast(distributed.AllocateKV(blocks, 16))
    print(f"stages hold {load.pipeline_layers} layers", flush=True)
    return ModelRunner(decoder, blocks, 16)


def decoding(harness: Harness, streams: int, history: int) -> list[Request]:
    """Sequences whose next step is a decode after `history` tokens (their KV computed here)."""
    requests = [harness.request(list(range(3, 3 + history + 1))) for _ in range(streams)]
    harness.step([(r, history) for r in requests])
    return requests


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--history", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    # Each runner's sequences: the one rank's twice (it runs two arms).
    blocks = 2 * args.streams * -(-(args.history + 1) // 16)
    staged = staged_runner(args.model, args.dtype, blocks)
    one = Harness(ModelRunner(load_model(args.model, args.dtype)[0], blocks, 16))
    arms = {
        "one rank, 2 threads": (one, 2),
        "one rank, 1 thread": (one, 1),
        "P=2, 1 thread each": (Harness(staged), 1),
    }
    requests = {name: decoding(h, args.streams, args.history) for name, (h, _) in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(args.repeats + 1):  # the first round warms up
        for name, (harness, threads) in arms.items():
            torch.set_num_threads(threads)
            start = time.perf_counter()
            harness.step([(r, 1) for r in requests[name]], book=False)
            elapsed = time.perf_counter() - start
            if i:
                times[name].append(elapsed)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        tokens_s = args.streams / medians[name]
        print(
            f"{name}: step min {min(t) * 1000:7.1f} ms, median {medians[name] * 1000:7.1f} ms,"
            f" {tokens_s:6.1f} tokens/s",
            flush=True,
        )
    two_threads, one_thread, staged_s = medians.values()
    print(f"P=2 tokens/s / one rank's on 2 threads: {two_threads / staged_s:.2f}")
    print(f"bubble: {1 - one_thread / (2 * staged_s):.0%} of the two stage threads' time")
    distributed.stop_all()


if __name__ == "__main__":
    main()
