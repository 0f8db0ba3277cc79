"""Batch-1 decode and 512-token prefill of the 0.5B bench model, float vs --quantize.

.venv/bin/gapless bench make-model /tmp/quant_q05
flock /work/bench.lock .venv/bin/python scripts/measure_quant_speed.py /tmp/quant_q05
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from gapless.bench.harness import Harness
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.model.gguf import is_gguf, load_gguf
from gapless.model.loader import load_decoder

CONTEXT, DECODE_STEPS, CHUNK = 128, 16, 512
RUNS = [  # (dtype, quantize)
    ("float32", None),
    ("bfloat16", None),
    ("float32", "int8"),
    ("bfloat16", "int8"),
    ("float32", "int4"),
    ("bfloat16", "int4"),
]


def run(harness: Harness, request: Request, n: int, book: bool = True) -> float:
    """Seconds to run the request's next n tokens."""
    start = time.perf_counter()
    harness.step([(request, n)], book=book)
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(2)
    model_dir, only = sys.argv[1], sys.argv[2:]
    ids = [int(i) for i in torch.randint(100, 4000, (CHUNK + CONTEXT + DECODE_STEPS,))]
    print(f"threads 2; decode: batch 1 at context {CONTEXT}, median of {DECODE_STEPS} steps")
    print(f"{'dtype':9} {'weights':8} {'decode ms/step':>14} {'prefill 512 ms':>15}")
    for dtype, quantize in RUNS:
        if only and (quantize or "float") not in only:
            continue
        if is_gguf(model_dir):
            if quantize:
                continue
            decoder = load_gguf(model_dir, dtype)[0]
        else:
            decoder = load_decoder(model_dir, dtype, quantize=quantize)
        harness = Harness(ModelRunner(decoder, len(ids) // 16 + 2, 16))
        # A fresh 512-token prompt each time (unbooked, it runs again from its first token),
        # the first a warm-up.
        prompt = harness.request(ids[:CHUNK])
        prefill = [run(harness, prompt, CHUNK, book=False) for _ in range(3)]
        harness.release(prompt)
        request = harness.request(ids[: CONTEXT + DECODE_STEPS])
        run(harness, request, CONTEXT)
        decode = [run(harness, request, 1) for _ in range(DECODE_STEPS)]
        print(
            f"{dtype:9} {quantize or 'float':8} {1e3 * statistics.median(decode):14.1f}"
            f" {1e3 * statistics.median(prefill[1:]):15.0f}",
            flush=True,
        )
        del harness, decoder


if __name__ == "__main__":
    main()
