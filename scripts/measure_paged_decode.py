"""Decode steps with our paged decode kernel against the SDPA paths it replaced, side by side
in one process (rounds interleaved, so drift hits both alike). Medians of ROUNDS steps.

    flock /work/bench.lock .venv/bin/python scripts/measure_paged_decode.py MODEL_DIR \
        [--dtype bfloat16] [--shapes 1x512,4x512,16x1536,32x1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import ScheduledChunk
from gapless.kernels import tune_allocator
from gapless.model.loader import load_decoder

ROUNDS, BLOCK = 8, 16


def prefilled(runner: ModelRunner, batch: int, context: int) -> list[Request]:
    """batch sequences with context tokens cached, each in its own blocks."""
    per_seq = context // BLOCK + 2 + ROUNDS * 2 // BLOCK
    requests = []
    for b in range(batch):
        ids = [int(i) for i in torch.randint(100, 4000, (context + 2 * ROUNDS + 2,))]
        request = Request(f"d{b}", ids, SamplingParams())
        request.block_table = list(range(b * per_seq, (b + 1) * per_seq))
        for start in range(0, context, 2048):
            n = min(2048, context - start)
            runner.execute([ScheduledChunk(request, n)], set())
            request.num_computed += n
        requests.append(request)
    return requests


def step(runner: ModelRunner, requests: list[Request]) -> float:
    start = time.perf_counter()
    runner.execute([ScheduledChunk(r, 1) for r in requests], set())
    for r in requests:
        r.num_computed += 1
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1x512,4x512,16x1536,32x1024", help="BATCHxCONTEXT")
    args = parser.parse_args()
    tune_allocator()
    torch.set_num_threads(2)
    decoder = load_decoder(args.model_dir, args.dtype)
    kernels = decoder.kernels
    if not kernels.paged_decode:
        raise SystemExit("the paged decode kernel is not available here")
    print(f"{args.model_dir}, {args.dtype}, 2 threads; decode step ms, median of {ROUNDS}")
    print(f"{'batch':>5} {'context':>7} {'SDPA paths':>10} {'paged':>7} {'ratio':>6}")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        blocks = batch * (context // BLOCK + 2 + ROUNDS * 2 // BLOCK)
        runner = ModelRunner(decoder, blocks, BLOCK)
        requests = prefilled(runner, batch, context)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(ROUNDS):
            for paged in (False, True):
                kernels.paged_decode = paged
                times[paged].append(step(runner, requests))
        kernels.paged_decode = True
        sdpa, ours = (1e3 * statistics.median(times[p]) for p in (False, True))
        print(f"{batch:5} {context:7} {sdpa:10.1f} {ours:7.1f} {sdpa / ours:5.2f}x", flush=True)
        del runner


if __name__ == "__main__":
    main()
