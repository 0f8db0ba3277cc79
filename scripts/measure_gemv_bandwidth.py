"""How close the decode product (blocks.gemv) comes to this machine's memory bandwidth.

    .venv/bin/python scripts/measure_gemv_bandwidth.py [--threads 2] [--rounds 5]

Per type (Q4_0, Q4_1, Q8_0): 48 weights of [4864, 896] (the 0.5B bench model's MLP shape,
118-222 MB a type, well past L3), multiplied one after another as a decode step walks its
layers, in the file's layout and with rows interleaved, batch 1 and 4; against a streaming
read of as many bytes (torch's sum over float32). Figures are GB/s of weight bytes, the best
of `rounds` passes; the variants alternate within each round, so a shared machine slows all.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from gapless.kernels import blocks

ROWS, COLS, COPIES = 4864, 896, 48
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def gbps(start: float, nbytes: int) -> float:
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    for name, qtype in TYPES.items():
        raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
        plain = [raw.clone() for _ in range(COPIES)]
        inter = [blocks.interleave(b, qtype, COLS) for b in plain]
        nbytes = COPIES * raw.numel()
        stream = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for m in (1, 4):
                x = torch.randn(m, COLS)
                for layout, weights, flag in (("file", plain, False), ("interleaved", inter, True)):
                    start = time.perf_counter()
                    for b in weights:
                        blocks.gemv(x, b, qtype, flag)
                    results.setdefault(f"b{m} {layout}", []).append(gbps(start, nbytes))
            start = time.perf_counter()
            stream.sum()
            results.setdefault("stream", []).append(gbps(start, nbytes))
        line = ", ".join(f"{k} {max(v):.1f}" for k, v in results.items())
        print(f"{name} ({nbytes / 1e6:.0f} MB, {args.threads} threads), GB/s: {line}")


if __name__ == "__main__":
    main()
