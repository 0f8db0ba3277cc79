"""The engine on a CUDA device: decode rate at batch 1/4/16, a lone 2,048-token prompt's
prefill, and the stall probe (4 streams decode, a 4,096-token prompt arrives), in process.

    python scripts/measure_cuda.py MODEL [--flags "--dtype bfloat16"] [--rounds 3]

MODEL: a checkpoint directory or GGUF file (`gapless bench make-model DIR` writes the bench
0.5B shape). Prints one JSON line per measurement; medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

import numpy as np
import torch

from gapless.bench.engine_only import engine_for, run_engine
from gapless.bench.metrics import gaps_during
from gapless.bench.workloads import BenchRequest, WorkloadSpec, build_workload


def decode_rate(engine, vocab: int, batch: int, tokens: int, seed: int) -> float:
    """Tokens/s of `batch` streams decoding `tokens` each, timed after their prefill."""
    rng = np.random.default_rng(seed)
    reqs = [BenchRequest(i, 0.0, rng.integers(4, vocab, 32).tolist(), tokens) for i in range(batch)]
    records, _ = run_engine(engine, reqs)
    rates = [(len(r.token_s) - 1) / (r.token_s[-1] - r.token_s[0]) for r in records]
    return sum(rates)


def prefill_rate(engine, vocab: int, tokens: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    reqs = [BenchRequest(0, 0.0, rng.integers(4, vocab, tokens).tolist(), 1)]
    records, _ = run_engine(engine, reqs)
    return tokens / (records[0].token_s[0] - records[0].send_s)


def stall_probe(engine, vocab: int, seed: int) -> dict[str, float]:
    spec = WorkloadSpec(
        "stall", seed=seed, vocab_size=vocab, stream_tokens=512, long_tokens=4096, long_at=0.5
    )
    records, _ = run_engine(engine, build_workload(spec))
    streams = [r.token_s for r in records if r.tag != "long"]
    long = next(r for r in records if r.tag == "long")
    window = (long.send_s, long.token_s[0])
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False)]
    return {
        "max_stall_ms": 1e3
        * max((g for s in streams for g in gaps_during(s, window)), default=0.0),
        "long_ttft_ms": 1e3 * (long.token_s[0] - long.send_s),
        "itl_p50_ms": 1e3 * statistics.median(gaps),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--flags", default="")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engine = engine_for(args.model, shlex.split(args.flags))
    vocab = engine.admission.token_vocab_size
    print(
        json.dumps(
            {
                "model": str(args.model),
                "flags": args.flags,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                "kernels": engine.runner.decoder.kernels.describe(),
            }
        ),
        flush=True,
    )
    decode_rate(engine, vocab, 4, 16, seed=99)  # warm-up: allocator, kernels, autotuning
    prefill_rate(engine, vocab, 2048, seed=98)
    for batch in (1, 4, 16):
        rates = [decode_rate(engine, vocab, batch, 128, seed=r) for r in range(args.rounds)]
        print(
            json.dumps({"decode_batch": batch, "tok_s": statistics.median(rates), "rounds": rates}),
            flush=True,
        )
    rates = [prefill_rate(engine, vocab, 2048, seed=10 + r) for r in range(args.rounds)]
    print(json.dumps({"prefill_2048_tok_s": statistics.median(rates), "rounds": rates}), flush=True)
    probes = [stall_probe(engine, vocab, seed=20 + r) for r in range(args.rounds)]
    print(
        json.dumps(
            {
                "stall": {k: statistics.median(x[k] for x in probes) for k in probes[0]},
                "rounds": probes,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
