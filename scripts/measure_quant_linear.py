"""Milliseconds for the linears of the 0.5B bench model's first LAYERS layers (more bytes than
the L3 cache in every format), per batch of M rows: float (oneDNN-packed), the int8/int4
kernels, and the dense path of the quantized linears (dequantize per call, then matmul).

    flock /work/bench.lock .venv/bin/python scripts/measure_quant_linear.py [LAYERS (6)]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from gapless.kernels.linear import Int4Linear, Int8Linear, PackedLinear
from gapless.model.quantize import quantize_int4, quantize_int8

HIDDEN, INTER, QKV = 896, 4864, 1152  # Qwen2.5-0.5B
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
ROWS = [1, 8, 16, 32, 64, 128, 512]


def ms(linears: list, dtype: torch.dtype, m: int, reps: int = 3) -> float:
    xs = {k: torch.randn(m, k, dtype=dtype) for k in (HIDDEN, INTER)}
    run: Callable[[], None] = lambda: [f(xs[f_in]) for f, f_in in linears]  # noqa: E731
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(layers) for n, k in SHAPES]
    ins = [k for _ in range(layers) for _, k in SHAPES]
    params = sum(w.numel() for w in weights)
    print(f"{layers} layers, {params / 1e6:.0f}M weights, threads 2")
    int8 = [quantize_int8(w) for w in weights]
    int4 = [quantize_int4(w, 32) for w in weights]
    variants: dict[str, tuple[list, torch.dtype, list[int]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        variants[f"{name} packed"] = ([PackedLinear(w.to(dtype)) for w in weights], dtype, ROWS)
        variants[f"int8 dense {name}"] = ([Int8Linear(q) for q in int8], dtype, ROWS)
        variants[f"int4 dense {name}"] = ([Int4Linear(q) for q in int4], dtype, ROWS)
    for kdtype in (torch.float32, torch.bfloat16):
        name = str(kdtype).removeprefix("torch.")
        rows = ROWS if kdtype == torch.bfloat16 else [1]
        variants[f"int8 kernel {name}"] = (
            [Int8Linear(q, None, kdtype, 512) for q in int8],
            kdtype,
            rows,
        )
        variants[f"int4 kernel {name}"] = (
            [Int4Linear(q, None, kdtype, 512) for q in int4],
            kdtype,
            rows,
        )
    print("ms per pass over all linears; M = rows in the batch")
    print(f"{'':20}" + "".join(f"{m:>9}" for m in ROWS))
    for label, (linears, dtype, rows) in variants.items():
        cells = [f"{ms(list(zip(linears, ins, strict=True)), dtype, m):9.1f}" for m in rows]
        print(f"{label:20}" + "".join(cells), flush=True)
        del linears


if __name__ == "__main__":
    main()
