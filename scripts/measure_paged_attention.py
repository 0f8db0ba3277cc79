"""Steps with our paged attention kernel against the paths it replaced, side by side in one
process (rounds interleaved, so drift hits both alike). Medians of ROUNDS steps.

Decodes (--shapes BATCHxCONTEXT) against the SDPA paths; prompt chunks (--chunks
TOKENSxHISTORY: one chunk after that many cached tokens) against the CPU flash op.

    flock /work/bench.lock .venv/bin/python scripts/measure_paged_attention.py MODEL_DIR \
        [--dtype bfloat16] [--shapes 1x512,4x512,16x1536,32x1024] [--chunks 512x0,512x7680]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gapless.bench.harness import Harness
from gapless.device import tune_allocator
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.kernels import Kernels
from gapless.model.loader import load_decoder

ROUNDS, BLOCK = 8, 16


def prefilled(harness: Harness, batch: int, context: int) -> list[Request]:
    """batch sequences with context tokens cached, and tokens for ROUNDS * 2 more or one
    chunk."""
    per_seq = harness.runner.num_blocks // batch
    requests = []
    for _ in range(batch):
        request = harness.request([int(i) for i in torch.randint(100, 4000, (per_seq * BLOCK,))])
        for start in range(0, context, 2048):
            harness.step([(request, min(2048, context - start))])
        requests.append(request)
    return requests


def step(harness: Harness, requests: list[Request], tokens: int) -> float:
    """A decode step (tokens 1), or the same prompt chunk again."""
    start = time.perf_counter()
    harness.step([(r, tokens) for r in requests], book=tokens == 1)
    return time.perf_counter() - start


def compare(
    kernels: Kernels, switch: str, harness: Harness, requests: list[Request], tokens: int
) -> str:
    """Median ms per step without and with the kernel, and their ratio."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for paged in (False, True):
            setattr(kernels, switch, paged)
            times[paged].append(step(harness, requests, tokens))
    setattr(kernels, switch, True)
    before, ours = (1e3 * statistics.median(times[p]) for p in (False, True))
    return f"{before:10.1f} {ours:7.1f} {before / ours:5.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1x512,4x512,16x1536,32x1024", help="BATCHxCONTEXT")
    parser.add_argument("--chunks", default="", help="TOKENSxHISTORY, e.g. 512x0,512x7680")
    args = parser.parse_args()
    tune_allocator()
    torch.set_num_threads(2)
    decoder = load_decoder(args.model_dir, args.dtype)
    print(f"{args.model_dir}, {args.dtype}, 2 threads; step ms, median of {ROUNDS}")
    tables = (  # switch, shapes, their two columns, the path it replaces
        ("paged_decode", args.shapes, "batch", "context", "SDPA paths"),
        ("paged_prefill", args.chunks, "chunk", "history", "flash op"),
    )
    for switch, spec, first, second, before in tables:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in spec.split(",") if shape]
        if not shapes:
            continue
        if not getattr(decoder.kernels, switch):
            raise SystemExit(f"{switch}: the paged kernel is not available here")
        print(f"{first:>5} {second:>7} {before:>10} {'paged':>7} {'ratio':>6}")
        for size, history in shapes:
            # A decode step of `size` sequences, or one prompt chunk of `size` tokens.
            batch, tokens = (size, 1) if switch == "paged_decode" else (1, size)
            harness = Harness(
                ModelRunner(decoder, batch * ((history + tokens) // BLOCK + 4), BLOCK)
            )
            requests = prefilled(harness, batch, history)
            print(
                f"{size:5} {history:7} {compare(decoder.kernels, switch, harness, requests, tokens)}"
            )
            del harness


if __name__ == "__main__":
    main()
