"""The bytes a decode step reads per second, against a streaming read of this machine (issue
24's bandwidth target: at least 70% of it on the 0.5B Q4_K_M file; issue 38's: the same at
7-8k tokens of context, weights plus the KV cache the step reads).

    .venv/bin/python scripts/measure_decode_bandwidth.py FILE.gguf [--threads 2] [--rounds 5]
        [--batch B] [--context TOKENS] [--kv-cache-dtype TYPE]

A step reads every tensor of the file once: the layers' weights, and the lm_head (the token
embeddings, when tied). An untied file's embeddings are gathered a row a token, so they are
not counted. The step time is the engine's batch-1 time per token (128 tokens, greedy, no
server), median of `rounds`; with --context, each of the batch's prompts has that many
tokens, and a step also reads every stream's KV so far (counted at its mean length over the
128 tokens, in the cache's bytes per token, in each layer as many keys as its window shows);
the streaming read is torch's sum over a float32 buffer of 1 GiB with the same threads, best
of `rounds`. Rounds alternate the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from gapless.bench.engine_only import engine_for, run_engine
from gapless.bench.workloads import BenchRequest
from gapless.engine.runner import ModelRunner

TOKENS = 128


def weight_bytes(path: str) -> int:
    tensors = gguf.GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def streaming_read_gbps(buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9


def step_time(engine, vocab: int, batch: int, context: int, tokens: int, seed: int) -> float:
    """Seconds a decode step of `batch` streams takes, each after a `context`-token prompt,
    timed after their prefills (from the last stream's first token)."""
    rng = np.random.default_rng(seed)
    reqs = [
        BenchRequest(i, 0.0, rng.integers(4, vocab, context).tolist(), tokens) for i in range(batch)
    ]
    records, _ = run_engine(engine, reqs)
    start = max(r.token_s[0] for r in records)
    end = min(r.token_s[-1] for r in records)
    steps = min(sum(1 for t in r.token_s if start < t <= end) for r in records)
    return (end - start) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32, help="prompt tokens per stream")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    kv_tokens = args.batch * (args.context + TOKENS + 64)
    engine = engine_for(
        args.gguf,
        [
            "--threads",
            str(args.threads),
            "--speculate",
            "none",
            "--kv-cache-dtype",
            args.kv_cache_dtype,
        ]
        + ["--kv-cache-tokens", str(max(kv_tokens, 4096))],
    )
    torch.set_num_threads(args.threads)
    vocab = engine.admission.token_vocab_size
    weights = weight_bytes(args.gguf)
    per_layer_token = ModelRunner.kv_bytes_per_layer_token(
        engine.decoder, engine.runner.kv_cache_dtype
    )
    # A sliding layer reads only the keys its window shows (Gemma 3: 5 layers in 6).
    length = args.context + TOKENS / 2
    keys = sum(min(length, w or length) for w in engine.decoder.config.layer_windows)
    kv = args.batch * keys * per_layer_token
    nbytes = weights + kv
    buffer = torch.ones(2**28)  # 1 GiB, well past any cache
    step_time(engine, vocab, args.batch, args.context, 16, seed=99)  # warm-up
    steps, reads = [], []
    for r in range(args.rounds):
        steps.append(step_time(engine, vocab, args.batch, args.context, TOKENS, seed=r))
        reads.append(streaming_read_gbps(buffer))
    step = statistics.median(steps)
    decode, stream = nbytes / step / 1e9, max(reads)
    print(
        f"{args.gguf}: {weights / 2**20:.0f} MiB of weights and {kv / 2**20:.0f} MiB of"
        f" {engine.runner.kv_cache_dtype} KV a step (batch {args.batch}, context"
        f" {args.context}), step "
        f"{1e3 * step:.2f} ms (rounds {', '.join(f'{1e3 * s:.2f}' for s in steps)}): "
        f"{decode:.1f} GB/s; streaming read {stream:.1f} GB/s (rounds "
        f"{', '.join(f'{g:.1f}' for g in reads)}); {100 * decode / stream:.0f}%"
    )


if __name__ == "__main__":
    main()
