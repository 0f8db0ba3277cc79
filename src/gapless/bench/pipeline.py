"""`gapless bench pipeline`: pipeline parallelism through the engine, with its steps in
flight: 8 streams' decode
tokens/s at P=2 (one thread per stage) against one rank on 2 threads, and the longest gap in
4 streams' tokens while a long prompt arrives, at the same prompt budget.

    gapless bench make-model /tmp/q05 --preset qwen2.5-0.5b --seed 0
    gapless bench pipeline /tmp/q05 --rounds 3

Every arm lives in this process (the P=2 engine's rank 0 here, its stage 1 a spawned worker
that waits idle while the others run) and the arms alternate round by round, so that a
shared machine's load hits them alike. torch's thread count is the process's: each arm sets
its own before it runs. One rank on 1 thread runs micro-batches of 8 / P streams: the work
the two stages share between them, so the bubble, the share of the two stage threads' time
spent idle, is 1 - (that step) x P / (2 x the P=2 time per 8 / P tokens of each stream).
"""

from __future__ import annotations

import statistics
import sys
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


ONE, HALF, STAGED = "one rank, 2 threads", "one rank, 1 thread, half the streams", "P=2"


def run(
    model: str,
    dtype: str = "bfloat16",
    streams: int = 8,
    tokens: int = 64,
    long_tokens: int = 4096,
    rounds: int = 3,
    pipeline_layers: str | None = None,
) -> dict:
    """The three arms, alternating round by round: each one's decode tokens/s and, for one
    rank on 2 threads and P=2, the longest gap and the long prompt's TTFT, per round and as
    medians, with the P=2 ratios and the bubble."""
    common = {"dtype": dtype, "speculate": "none", "max_model_len": long_tokens + 256}
    split = {"pipeline_layers": pipeline_layers} if pipeline_layers else {}
    staged = LLM(model, pipeline_parallel_size=2, **split, **common)
    one = LLM(model, num_threads=2, **common)
    vocab = min(one.engine.decoder.config.vocab_size, one.tokenizer.vocab_size)
    arms = {ONE: (one, 2, streams), HALF: (one, 1, streams // 2), STAGED: (staged, 1, streams)}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    stalls: dict[str, list[tuple[float, float]]] = {ONE: [], STAGED: []}
    try:
        for round in range(rounds):
            for name, (llm, threads, n) in arms.items():
                rates[name].append(decode_rate(llm, threads, n, tokens, vocab))
                print(f"{name}: {rates[name][-1]:.1f} decode tokens/s", file=sys.stderr)
            for name in stalls:
                llm, threads, _ = arms[name]
                stalls[name].append(stall(llm, threads, long_tokens, vocab, 1000 + round))
                gap, ttft = stalls[name][-1]
                print(f"{name}: max gap {gap * 1e3:.0f} ms, TTFT {ttft:.2f} s", file=sys.stderr)
    finally:
        staged.close()
    rate = {name: statistics.median(r) for name, r in rates.items()}
    gap_ms = {n: statistics.median(g for g, _ in s) * 1e3 for n, s in stalls.items()}
    ttft_s = {n: statistics.median(t for _, t in s) for n, s in stalls.items()}
    return {
        "bench": "pipeline",
        "config": {
            "model": model,
            "dtype": dtype,
            "streams": streams,
            "tokens": tokens,
            "long_tokens": long_tokens,
            "rounds": rounds,
            "pipeline_layers": pipeline_layers,
        },
        "decode_tokens_per_s": rates,
        "stalls_s": {n: [list(p) for p in s] for n, s in stalls.items()},
        "medians": {"decode_tokens_per_s": rate, "max_gap_ms": gap_ms, "long_ttft_s": ttft_s},
        "decode_ratio": rate[STAGED] / rate[ONE],
        # One rank on one thread makes `streams / 2` tokens per step; the stages' threads
        # together have 2 / rate thread-seconds per token, of which 1 / that rate is work.
        "bubble": 1 - (rate[STAGED] / rate[HALF]) / 2,
        "max_gap_ratio": gap_ms[STAGED] / gap_ms[ONE],
    }


def format_pipeline_table(results: dict) -> str:
    m = results["medians"]
    lines = [
        "| arm | decode tokens/s | longest gap (ms) | long TTFT (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, rate in m["decode_tokens_per_s"].items():
        gap, ttft = m["max_gap_ms"].get(name), m["long_ttft_s"].get(name)
        cells = [f"{rate:.1f}", "-" if gap is None else f"{gap:.0f}"]
        cells.append("-" if ttft is None else f"{ttft:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"| P=2 against one rank | {results['decode_ratio']:.2f}x "
        f"(bubble {results['bubble']:.0%}) | {results['max_gap_ratio']:.2f}x | |"
    )
    return "\n".join(lines) + "\n"
