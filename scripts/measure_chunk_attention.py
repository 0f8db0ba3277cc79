"""The paged kernel's prompt-chunk attention alone: one chunk of TOKENS queries after HISTORY
cached keys (issue 38: 512 after 7,680), SmolLM2's heads (9 q, 3 kv, D 64) and Gemma 3
270M's (4 q, 1 kv, D 256), every KV cache type; GFLOP/s of the attention the queries ask
for (4 x heads x D per attended key, causal: no padding or masked keys counted). Compare
with scripts/dot_product_peak.cpp's figure for the same threads.

With --baseline, another build of the kernel (a .so, e.g. main's prebuilt one) runs beside
this tree's, rounds alternating, with the largest difference of their outputs. With --flash,
torch's CPU flash op runs beside them over a bf16 cache (attention.in_place, the path prompt
chunks took before our kernel had them), given the keys as one contiguous run: its best case.

    flock /work/bench.lock .venv/bin/python scripts/measure_chunk_attention.py \
        [--threads 1] [--chunk 512x7680] [--baseline path/to/paged_attention_....so] [--flash]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from gapless.kernels import attention, kv_format
from gapless.kernels.paged import extension

HEADS = {"smollm2": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # q heads, kv heads, head size
CACHES = {"bf16": torch.bfloat16, "f16": torch.float16, "int8": torch.uint8, "f32": torch.float32}
BLOCK = 16


def load_build(path: str) -> ModuleType:
    """A build of the paged kernel from its file (its module name is the file's stem)."""
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flash_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, history: int
) -> Callable[[], torch.Tensor]:
    """The flash op's call for the same chunk: the keys copied out of the blocks in order,
    once, so that the history is one run of consecutive slots."""
    keys = history + q.shape[0]
    flat_k, flat_v = (x[table].flatten(0, 1)[:keys].contiguous() for x in (k, v))
    k_cache, v_cache = flat_k[None], flat_v[None]  # one block of all the keys
    new_k, new_v = flat_k[history:], flat_v[history:]
    runs = [(0, history)] if history else []
    return lambda: attention.in_place(q, new_k, new_v, k_cache, v_cache, runs).view(q.shape)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", default="512x7680", help="TOKENSxHISTORY")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", help="another build of the kernel, a .so file")
    parser.add_argument("--flash", action="store_true", help="the CPU flash op too (bf16 cache)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, history = (int(x) for x in args.chunk.split("x"))
    builds = {"this tree": extension()}
    if args.baseline:
        builds = {"baseline": load_build(args.baseline), **builds}
    print(f"{n}-token chunk after {history} keys, {args.threads} threads, median of {args.rounds}")
    gen = torch.Generator().manual_seed(0)
    for name, (heads, kv_heads, dim) in HEADS.items():
        keys = history + n
        blocks = -(-keys // BLOCK)
        flops = 4 * heads * dim * (n * history + n * (n + 1) // 2)
        q = torch.randn(n, heads, dim, generator=gen).to(torch.bfloat16)
        tables = torch.randperm(blocks, generator=gen).view(1, -1)  # scattered blocks
        num_keys = torch.tensor([keys])
        kv = torch.randn(2, blocks, BLOCK, kv_heads, dim, generator=gen)
        for cache, dtype in CACHES.items():
            k, v = (kv_format.quantize_q8(x) if cache == "int8" else x.to(dtype) for x in kv)
            inputs = (q, k, v, tables, num_keys, n, 0, dim**-0.5, None)
            runs = {
                b: functools.partial(build.paged_attention, *inputs) for b, build in builds.items()
            }
            if args.flash and cache == "bf16":
                runs["flash op"] = flash_run(q, k, v, tables[0], history)
            outs = [run().float() for run in runs.values()][:2]  # and a warm-up
            times: dict[str, list[float]] = {b: [] for b in runs}
            for _ in range(args.rounds):
                for b, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[b].append(time.perf_counter() - start)
            cells = [
                f"{b} {1e3 * statistics.median(t):7.2f} ms {flops / statistics.median(t) / 1e9:6.1f} GFLOP/s"
                for b, t in times.items()
            ]
            if len(outs) == 2:
                cells.append(f"max diff {(outs[0] - outs[1]).abs().max().item():.2g}")
            print(f"{name:>12} {cache:>5}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
