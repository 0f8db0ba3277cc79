"""Pipeline parallelism through the engine, with its steps in flight: 8 streams' decode
tokens/s at P=2 (one thread per stage) against one rank on 2 threads, and the longest gap in
4 streams' tokens while a long prompt arrives, at the same prompt budget.

    gapless bench make-model /tmp/q05 --preset qwen2.5-0.5b --seed 0
    flock /work/bench.lock .venv/bin/python scripts/measure_pipeline.py /tmp/q05

Every arm lives in this process (the P=2 engine's rank 0 here, its stage 1 a spawned worker
that waits idle while the others run) and the arms alternate round by round, so that a
shared machine's load hits them alike. torch's thread count is the process's: each arm sets
its own before it runs. One rank on 1 thread runs micro-batches of 8 / P streams: the work
the two stages share between them, so the bubble, the share of the two stage threads' time
spent idle, is 1 - (that step) x P / (2 x the P=2 time per 8 / P tokens of each stream).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.llm import LLM
from gapless.engine.sampling_params import SamplingParams


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_until(llm: LLM, threads: int, done: Callable[[], bool], on_event: Callable) -> None:
    torch.set_num_threads(threads)
    while not done():
        for event in llm.engine.step():
            on_event(event, time.perf_counter())


def decode_rate(llm: LLM, threads: int, streams: int, tokens: int, vocab: int) -> float:
    """Decode tokens/s of `streams` greedy streams (128-token prompts), counted from the step
    after every stream has its first token."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = {llm.engine.add_request(prompt(i, 128, vocab), params) for i in range(streams)}
    first: set[str] = set()
    counted, finished, start = 0, set(), 0.0

    def on_event(event: object, now: float) -> None:
        nonlocal counted, start
        if isinstance(event, TokenEvent) and event.request_id in ids:
            if len(first) == streams:
                counted += len(event.token_ids)
            first.add(event.request_id)
            if len(first) == streams and not start:
                start = now
        elif isinstance(event, FinishedEvent):
            finished.add(event.request_id)

    run_until(llm, threads, lambda: len(finished) == streams, on_event)
    return counted / (time.perf_counter() - start)


def stall(llm: LLM, threads: int, long_tokens: int, vocab: int, seed: int) -> tuple[float, float]:
    """The longest gap between consecutive tokens of 4 decoding streams while a
    `long_tokens` prompt prefills beside them, and that prompt's time to first token. The
    prompt is new to the arm (`seed`): the prefix cache holds the earlier rounds'."""
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    streams = [llm.engine.add_request(prompt(100 + i, 64, vocab), params) for i in range(4)]
    last: dict[str, float] = {}
    gaps: list[float] = []
    long_id, arrived, first_token = "", 0.0, 0.0

    def on_event(event: object, now: float) -> None:
        nonlocal first_token
        if not isinstance(event, TokenEvent):
            return
        if event.request_id == long_id:
            first_token = now
        elif event.request_id in last and long_id:
            gaps.append(now - last[event.request_id])
        last[event.request_id] = now

    steps = iter(range(20))  # the streams decode a while first
    run_until(llm, threads, lambda: next(steps, None) is None, on_event)
    arrived = time.perf_counter()
    long_id = llm.engine.add_request(prompt(seed, long_tokens, vocab), SamplingParams(max_tokens=1))
    run_until(llm, threads, lambda: bool(first_token), on_event)
    for rid in streams:
        llm.engine.cancel(rid)
    run_until(llm, threads, lambda: not llm.engine.has_work, lambda *_: None)
    return max(gaps), first_token - arrived


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="each decoding stream's")
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pipeline-layers", help="the stages' layers (default: split by bytes)")
    args = ap.parse_args()
    common = {"dtype": args.dtype, "speculate": "none", "max_model_len": args.long_tokens + 256}
    split = {"pipeline_layers": args.pipeline_layers} if args.pipeline_layers else {}
    staged = LLM(args.model, pipeline_parallel_size=2, **split, **common)
    one = LLM(args.model, num_threads=2, **common)
    vocab = min(one.engine.decoder.config.vocab_size, one.tokenizer.vocab_size)
    half = args.streams // 2
    arms = {
        "one rank, 2 threads": (one, 2, args.streams),
        f"one rank, 1 thread, {half} streams": (one, 1, half),
        "P=2, 1 thread a stage": (staged, 1, args.streams),
    }
    rates: dict[str, list[float]] = {name: [] for name in arms}
    stalls: dict[str, list[tuple[float, float]]] = {name: [] for name in (*arms,)}
    for round in range(args.rounds):
        for name, (llm, threads, streams) in arms.items():
            rates[name].append(decode_rate(llm, threads, streams, args.tokens, vocab))
            print(f"{name}: {rates[name][-1]:.1f} decode tokens/s", flush=True)
        for name in ("one rank, 2 threads", "P=2, 1 thread a stage"):
            llm, threads, _ = arms[name]
            stalls[name].append(stall(llm, threads, args.long_tokens, vocab, 1000 + round))
            gap, ttft = stalls[name][-1]
            print(f"{name}: max gap {gap * 1e3:.0f} ms, long TTFT {ttft:.2f} s", flush=True)
    rate = {name: statistics.median(r) for name, r in rates.items()}
    two_threads, one_thread, p2 = rate.values()
    print(f"\nmedians of {args.rounds} rounds, {args.streams} streams of {args.tokens} tokens:")
    for name, r in rate.items():
        print(f"  {name}: {r:.1f} tokens/s")
    print(f"P=2 / one rank on 2 threads: {p2 / two_threads:.2f}")
    # One rank on one thread makes `half` tokens per step; the stages' threads together
    # have 2 / p2 thread-seconds per token, of which 1 / one_thread is work.
    print(f"bubble: {1 - (p2 / one_thread) / 2:.0%} of the two stage threads' time")
    for name in ("one rank, 2 threads", "P=2, 1 thread a stage"):
        gap = statistics.median(g for g, _ in stalls[name])
        ttft = statistics.median(t for _, t in stalls[name])
        print(f"  {name}: max gap {gap * 1e3:.0f} ms, long TTFT {ttft:.2f} s (medians)")
    gaps = [statistics.median(g for g, _ in stalls[n]) for n in stalls if stalls[n]]
    print(f"P=2 max gap / one rank's: {gaps[1] / gaps[0]:.2f}")
    staged.close()


if __name__ == "__main__":
    main()
