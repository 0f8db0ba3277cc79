"""Steps with our paged attention kernel against the paths it replaced, side by side in one
process (rounds interleaved, so drift hits both alike). Medians of ROUNDS steps.

Decodes (--shapes BATCHxCONTEXT) against the SDPA paths; prompt chunks (--chunks
TOKENSxHISTORY: one chunk after that many cached tokens) against the CPU flash op.

    flock /work/bench.lock .venv/bin/python scripts/measure_paged_attention.py MODEL_DIR \
        [--dtype bfloat16] [--shapes 1x512,4x512,16x1536,32x1024] [--chunks 512x0,512x7680]

With --kernel instead of a model: one decode attention call alone, per build level and KV
cache type (SmolLM2's heads: 9 q, 3 kv, D 64; Gemma 3 270M's: 4 q, 1 kv, D 256), as GB/s of
KV cache read and its share of a streaming read (torch's sum over 1 GiB of float32, the same
threads: where other processes share the cores, 1 thread is the steadier figure, since a
parallel call waits for its slowest thread). Each call reads another copy of the caches,
256 MB of them in all, so no call finds its keys in the L3 cache, as a step's 30 layers
find theirs.

    flock /work/bench.lock .venv/bin/python scripts/measure_paged_attention.py --kernel \
        [--levels avx2,avx512] [--shapes 1x8192,4x8192,1x32768,4x32768] [--query float32] \
        [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from measure_decode_bandwidth import streaming_read_gbps

from gapless.bench.harness import Harness
from gapless.device import tune_allocator
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.kernels import Kernels, kv_format
from gapless.kernels.paged import extension as paged_kernel
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


HEADS = {"smollm2": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # q heads, kv heads, head size
CACHES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8}
SPREAD_BYTES = 256 << 20  # caches' copies read in turn: well past the L3 cache


def kernel_gbps(
    level: str, heads: tuple[int, int, int], cache: torch.dtype, query: torch.dtype, shape: str
) -> float:
    """GB/s of KV cache one decode call on the build for `level` reads, median of ROUNDS
    passes over the copies."""
    ext = paged_kernel(level)
    if ext is None:
        raise SystemExit(f"the paged kernel for {level} did not build")
    q_heads, kv_heads, dim = heads
    batch, context = (int(x) for x in shape.split("x"))
    blocks = batch * context // BLOCK
    q = torch.randn(batch, q_heads, dim).to(query)
    tables = torch.randperm(blocks).view(batch, -1)  # scattered, as a long-running server's
    num_keys = torch.full((batch,), context)
    values = torch.randn(blocks, BLOCK, kv_heads, dim)
    one = kv_format.quantize_q8(values) if cache == torch.uint8 else values.to(cache)
    nbytes = 2 * one.numel() * one.element_size()
    copies = [(one.clone(), one.clone()) for _ in range(max(1, -(-SPREAD_BYTES // nbytes)))]
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for k, v in copies:
            ext.paged_attention(q, k, v, tables, num_keys, 1, 0, dim**-0.5, None)
        times.append((time.perf_counter() - start) / len(copies))
    return nbytes / statistics.median(times) / 1e9


def kernel_table(args: argparse.Namespace) -> None:
    stream = torch.ones(1 << 28)  # 1 GiB of float32
    best = max(streaming_read_gbps(stream) for _ in range(ROUNDS))
    query = getattr(torch, args.query)
    print(
        f"decode attention alone, {args.query} queries, {args.threads} threads; streaming read {best:.1f} GB/s"
    )
    print(
        f"{'level':>12} {'shape':>12} {'batch x keys':>13}  "
        + "  ".join(f"{c:>11}" for c in CACHES)
    )
    for level in args.levels.split(","):
        for name, heads in HEADS.items():
            for shape in args.shapes.split(","):
                rates = [
                    kernel_gbps(level, heads, cache, query, shape) for cache in CACHES.values()
                ]
                cells = "  ".join(f"{r:5.1f} {100 * r / best:3.0f}%" for r in rates)
                print(f"{level:>12} {name:>12} {shape:>13}  {cells}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--kernel", action="store_true", help="decode attention alone, GB/s")
    parser.add_argument("--levels", default="avx2,avx512")
    parser.add_argument("--query", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1x512,4x512,16x1536,32x1024", help="BATCHxCONTEXT")
    parser.add_argument("--chunks", default="", help="TOKENSxHISTORY, e.g. 512x0,512x7680")
    args = parser.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    if args.kernel:
        if args.shapes == parser.get_default("shapes"):
            args.shapes = "1x8192,4x8192,1x32768,4x32768"
        return kernel_table(args)
    if args.model_dir is None:
        parser.error("a model directory, or --kernel")
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
