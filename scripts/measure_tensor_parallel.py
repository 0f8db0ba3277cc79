"""Tensor-parallel overhead: one forward step at TP=1 (2 threads) and TP=2 (1 thread per rank).

    flock /work/bench.lock .venv/bin/python scripts/measure_tensor_parallel.py /tmp/q05

Times the decode step at batch 1 and 8 (128-token histories) and a 512-token prompt chunk on
rank 0's ModelRunner, and prints the bytes each step all-reduces and gathers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gapless import SamplingParams
from gapless.engine import distributed
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.engine.scheduler import ScheduledChunk
from gapless.model.loader import load_decoder

HISTORY = 128
BLOCKS_PER_SEQ = 41  # a 512-token chunk after 128 tokens of history, and a spare
BLOCKS = 8 * BLOCKS_PER_SEQ


def runner_for(path: str, dtype: str, tp: int) -> ModelRunner:
    if tp == 1:
        torch.set_num_threads(2)
        return ModelRunner(load_decoder(path, dtype), BLOCKS, 16)
    parallel = distributed.start(tp, distributed.Launch(threads=1))
    parallel.broadcast(distributed.LoadModel(path, dtype))
    decoder = load_decoder(path, dtype, parallel.device, parallel)
    parallel.broadcast(distributed.AllocateKV(BLOCKS, 16))
    return ModelRunner(decoder, BLOCKS, 16)


def sequences(n: int, length: int) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(f"s{i}", list(range(3, 3 + length)), SamplingParams())
        req.block_table = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
        reqs.append(req)
    return reqs


def step_ms(runner: ModelRunner, chunks: list[ScheduledChunk], repeats: int) -> float:
    runner.execute(chunks, set())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(chunks, set())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    for tp in args.tp:
        runner = runner_for(args.model, args.dtype, tp)
        cfg, size = runner.decoder.config, runner.decoder.embed.element_size()
        for name, batch, tokens in (
            ("decode b1", 1, 1),
            ("decode b8", 8, 1),
            ("chunk 512", 1, 512),
        ):
            reqs = sequences(batch, HISTORY + tokens)
            for req in reqs:
                req.num_computed = HISTORY if tokens == 1 else 0
            if tokens == 1:  # the histories' KV, once
                runner.execute([ScheduledChunk(r, HISTORY) for r in reqs], set())
            ms = step_ms(runner, [ScheduledChunk(r, tokens) for r in reqs], 3 if tokens > 1 else 10)
            rows = batch * tokens
            reduced = 2 * cfg.num_layers * rows * cfg.hidden_size * size if tp > 1 else 0
            gathered = batch * cfg.vocab_size * size if tp > 1 else 0
            print(
                f"tp={tp} {name}: {ms:7.1f} ms/step; all-reduced {reduced / 1e6:.2f} MB "
                f"({2 * cfg.num_layers} all-reduces), logits gathered {gathered / 1e6:.2f} MB",
                flush=True,
            )
        distributed.stop()


if __name__ == "__main__":
    main()
