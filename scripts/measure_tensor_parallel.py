"""Tensor-parallel overhead: one forward step at TP=1 (2 threads) and TP=2 (1 thread per rank).

    flock /work/bench.lock .venv/bin/python scripts/measure_tensor_parallel.py /tmp/q05

Both runners live in this process (rank 0; the TP=1 one uses 2 threads while the worker
waits) and their steps alternate, so that a shared machine's load hits both alike. Times the
decode step at batch 1 and 8 (128-token histories) and a fresh 512-token prompt chunk, and
prints the bytes each TP=2 step all-reduces and sends to rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gapless.bench.harness import Harness
from gapless.engine import distributed
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.model.loader import load_decoder

HISTORY = 128
BLOCKS_PER_SEQ = 41  # a 512-token chunk after 128 tokens of history, and a spare
BLOCKS = 8 * BLOCKS_PER_SEQ


def sharded_runner(path: str, dtype: str) -> ModelRunner:
    parallel = distributed.start(2, distributed.Launch(threads=1)).parallel
    parallel.broadcast(distributed.LoadModel(path, dtype))
    decoder = load_decoder(path, dtype, parallel.device, parallel)
    parallel.broadcast(distributed.AllocateKV(BLOCKS, 16))
    return ModelRunner(decoder, BLOCKS, 16)


def sequences(harness: Harness, batch: int, tokens: int) -> list[Request]:
    """batch sequences to run `tokens` tokens each: a decode after HISTORY tokens (their KV
    computed here, once), or a fresh prompt chunk."""
    requests = [harness.request(list(range(3, 3 + HISTORY + tokens))) for _ in range(batch)]
    if tokens == 1:
        harness.step([(r, HISTORY) for r in requests])
    return requests


def timed(harness: Harness, requests: list[Request], tokens: int, threads: int) -> float:
    """ms of one step of the requests' next `tokens` tokens each, left unbooked: every call
    runs the same step."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    harness.step([(r, tokens) for r in requests], book=False)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    two = sharded_runner(args.model, args.dtype)
    cfg, size = two.decoder.config, two.decoder.embed.element_size()
    # (tp, its harness, its threads)
    arms = (
        (1, Harness(ModelRunner(load_decoder(args.model, args.dtype), BLOCKS, 16)), 2),
        (2, Harness(two), 1),
    )
    for name, batch, tokens in (("decode b1", 1, 1), ("decode b8", 8, 1), ("chunk 512", 1, 512)):
        requests = {tp: sequences(harness, batch, tokens) for tp, harness, _ in arms}
        times: dict[int, list[float]] = {1: [], 2: []}
        for i in range(args.repeats + 1):  # the first round warms up
            for tp, harness, threads in arms:
                ms = timed(harness, requests[tp], tokens, threads)
                if i:
                    times[tp].append(ms)
        for tp, harness, _ in arms:
            for r in requests[tp]:
                harness.release(r)
        rows = batch * tokens
        reduced = 2 * cfg.num_layers * rows * cfg.hidden_size * size
        # the other rank's vocabulary slice of the logit rows
        sent = batch * -(-cfg.vocab_size // 2) * size
        for tp in (1, 2):
            t = times[tp]
            print(
                f"tp={tp} {name}: min {min(t):7.1f} ms, median {statistics.median(t):7.1f} ms"
                + (
                    f"; all-reduced {reduced / 1e6:.3f} MB in {2 * cfg.num_layers} all-reduces, "
                    f"logits sent to rank 0 {sent / 1e6:.3f} MB"
                    if tp == 2
                    else ""
                ),
                flush=True,
            )
    distributed.stop_all()


if __name__ == "__main__":
    main()
