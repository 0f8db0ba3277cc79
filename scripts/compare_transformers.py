"""gapless against transformers on the same checkpoint, side by side in one process.

Prefill: tokens/s for one fresh prompt chunk. Decode: ms per step at batch 1 and 8 with a
256-token context. Both run in the same dtype and thread count, interleaved, median of
--reps. Model forward only (no sampling, no server) for both.

    python scripts/compare_transformers.py /tmp/q05 --dtype bfloat16

Needs `transformers` (a test dependency of gapless).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from gapless.bench.harness import Harness
from gapless.bench.roofline import median_time
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.model.loader import load_decoder

BLOCK = 16


def ours(path: Path, dtype: str, prompt: int, batch_sizes: list[int], context: int, reps: int):
    decoder = load_decoder(path, dtype)
    per_seq = -(-(max(prompt, context) + 2) // BLOCK)
    harness = Harness(ModelRunner(decoder, per_seq * max(batch_sizes), BLOCK))
    gen = torch.Generator().manual_seed(0)

    def request(n: int, cached: int) -> Request:
        ids = torch.randint(0, decoder.config.vocab_size, (n,), generator=gen).tolist()
        return harness.request(ids, cached=cached)

    # Unbooked steps: each rep runs the same chunk at the same context.
    fresh = request(prompt, 0)
    prefill = median_time(lambda: harness.step([(fresh, prompt)], book=False), reps)
    harness.release(fresh)
    decode = {}
    for b in batch_sizes:
        chunks = [(request(context + 1, context), 1) for _ in range(b)]
        decode[b] = median_time(lambda chunks=chunks: harness.step(chunks, book=False), reps)
        for r, _ in chunks:
            harness.release(r)
    return prefill, decode


def reference(path: Path, dtype: str, prompt: int, batch_sizes: list[int], context: int, reps: int):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt), generator=gen)
    with torch.inference_mode():
        # logits_to_keep=1: like gapless, compute the lm_head for the last position only.
        prefill = median_time(lambda: model(ids, logits_to_keep=1), reps)
        decode = {}
        for b in batch_sizes:
            history = torch.randint(0, vocab, (b, context), generator=gen)
            cache = DynamicCache()
            model(history, past_key_values=cache, use_cache=True)
            step = torch.randint(0, vocab, (b, 1), generator=gen)

            def one_step(cache: DynamicCache = cache, step: torch.Tensor = step) -> None:
                model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache.crop(-1)  # drop the step again: the context stays fixed

            decode[b] = median_time(one_step, reps)
    return prefill, decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int)
    p.add_argument("--out", type=Path, default=Path("results/vs-transformers.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = (args.model_dir, args.dtype, args.prompt, args.batch, args.context, args.reps)
    ref_prefill, ref_decode = reference(*runs)
    our_prefill, our_decode = ours(*runs)
    rows = [("prefill tok/s", args.prompt / ref_prefill, args.prompt / our_prefill)]
    rows += [
        (f"decode ms/step, batch {b}", ref_decode[b] * 1e3, our_decode[b] * 1e3) for b in args.batch
    ]
    print(
        f"{args.model_dir} {args.dtype}, {torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"{'':28} {'transformers':>12} {'gapless':>10} {'gapless speed-up':>17}")
    for name, ref, ours_ in rows:
        speedup = ours_ / ref if name.startswith("prefill") else ref / ours_
        print(f"{name:28} {ref:12.1f} {ours_:10.1f} {speedup:16.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"model_dir": str(args.model_dir), "out": str(args.out)},
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
