"""The weight bytes a batch-1 decode step reads per second, against a streaming read of this
machine (issue 24's bandwidth target: at least 70% of it on the 0.5B Q4_K_M file).

    .venv/bin/python scripts/measure_decode_bandwidth.py FILE.gguf [--threads 2] [--rounds 5]

A step reads every tensor of the file once: the layers' weights, and the lm_head (the token
embeddings, when tied). An untied file's embeddings are gathered a row a token, so they are
not counted. The step time is the engine's batch-1 time per token (128 tokens, greedy, no
server), median of `rounds`; the streaming read is torch's sum over a float32 buffer of 1 GiB
with the same threads, best of `rounds`. Rounds alternate the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch
from measure_cuda import decode_rate

from gapless.bench.engine_only import engine_for


def weight_bytes(path: str) -> int:
    tensors = gguf.GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def streaming_read_gbps(buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    engine = engine_for(args.gguf, ["--threads", str(args.threads), "--speculate", "none"])
    torch.set_num_threads(args.threads)
    vocab = engine.admission.token_vocab_size
    nbytes = weight_bytes(args.gguf)
    buffer = torch.ones(2**28)  # 1 GiB, well past any cache
    decode_rate(engine, vocab, 1, 16, seed=99)  # warm-up
    steps, reads = [], []
    for r in range(args.rounds):
        steps.append(1 / decode_rate(engine, vocab, 1, 128, seed=r))
        reads.append(streaming_read_gbps(buffer))
    step = statistics.median(steps)
    decode, stream = nbytes / step / 1e9, max(reads)
    print(
        f"{args.gguf}: {nbytes / 2**20:.0f} MiB of weights a step, batch-1 step "
        f"{1e3 * step:.2f} ms (rounds {', '.join(f'{1e3 * s:.2f}' for s in steps)}): "
        f"{decode:.1f} GB/s; streaming read {stream:.1f} GB/s (rounds "
        f"{', '.join(f'{g:.1f}' for g in reads)}); {100 * decode / stream:.0f}%"
    )


if __name__ == "__main__":
    main()
