"""Four decoding streams' longest silence while a prompt with a 1,000-token image prefills
beside them, and the image encode's share of that prompt's time to first token.

Builds random-weight Qwen2.5-VL checkpoints with transformers' classes (bfloat16 weights):
- `realistic`: Qwen2.5-VL-3B's language model (hidden 2048, MLP 11008, 16 heads, 2 KV heads,
  vocabulary 151,936, tied embeddings) at `--layers` of its 36 layers, and Qwen2.5-VL's vision
  tower whole, as its Hub configs have it (32 blocks of hidden 1280, MLP 3420, 16 heads, patch
  14, merge 2, window 112 pixels, full attention in blocks 7, 15, 23 and 31; transformers'
  Qwen2_5_VLVisionConfig defaults hidden_size to 3584, which no Hub checkpoint uses);
- `tiny`: tests/test_vision.py's Qwen2.5-VL (3 blocks of 32, a language model of 2 layers of 64).
The image is 700 x 1120 pixels of noise: 25 x 40 merge units of 2 x 2 patches, so 1,000
placeholder tokens and 4,000 patches. Its prompt is 20 text tokens, the image, 10 text tokens.

The engine runs in this process (no HTTP), with its defaults (prompt chunks of 512 tokens while
others decode, dtype auto) and a timer around the encoder:
- stall (realistic): four streams decode; once each has 3 tokens the image prompt is added, and
  the longest gap between a stream's tokens while it prefills is set against a chunk step (a
  512-token chunk beside the decodes, median) and the longest of the steps that ran some of
  the encode's units (the scheduler cuts it by tower blocks);
- share (both): the image prompt alone on an idle engine: its time to first token and the
  encode's part of it.

    python scripts/measure_image_stall.py [--layers 4] [--rounds 3] [--out DIR] [--target-itl-ms X]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.model.demo import build_bpe_tokenizer, stdlib_sources, write_tokenizer_files

STREAMS = 4
TOKENIZER_VOCAB = 512
IMAGE_TOKEN = TOKENIZER_VOCAB - 1  # text ids stay below 500
IMAGE_SIZE = (700, 1120)  # width, height
CHUNK = 512

REALISTIC_TEXT = {
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
}
REALISTIC_TOWER = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
TINY_TEXT = {
    "vocab_size": TOKENIZER_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50_000.0, "mrope_section": [2, 3, 3]},
}
TINY_TOWER = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "patch_size": 14,
    "window_size": 56,
    "fullatt_block_indexes": [1],
}


def build(out: Path, text: dict[str, Any], tower: dict[str, Any]) -> Path:
    """A random-weight Qwen2.5-VL checkpoint, with a small BPE tokenizer and a Hub-style image
    processor config."""
    import transformers as tf
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    torch.manual_seed(0)
    config = tf.Qwen2_5_VLConfig(
        text_config=text,
        vision_config={**tower, "out_hidden_size": text["hidden_size"]},
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN - 1,
        vision_start_token_id=IMAGE_TOKEN - 2,
        vision_end_token_id=IMAGE_TOKEN - 3,
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # half the memory and time of a float32 init
    try:
        model = tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    del model
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 56 * 56,
        "max_pixels": 28 * 28 * 1280,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    tokenizer = build_bpe_tokenizer(TOKENIZER_VOCAB, stdlib_sources(), max_bytes=1_000_000)
    write_tokenizer_files(tokenizer, out)
    return out


class EncodeTimer:
    """Wraps an engine's runner: the start and end of each step's encode work (a few tower
    blocks of an image, as the scheduler cuts it), and the units it ran."""

    def __init__(self, engine: Engine) -> None:
        runner = engine.runner
        self.spans: list[tuple[float, float, int]] = []
        encode = runner.encode

        def timed(chunk: Any) -> None:
            units = sum(n for _, n in chunk.encodes)
            start = time.perf_counter()
            encode(chunk)
            if units:
                self.spans.append((start, time.perf_counter(), units))

        runner.encode = timed  # type: ignore[method-assign]

    def since(self, mark: int) -> float:
        """Seconds of encode work since len(spans) was mark."""
        return sum(end - start for start, end, _ in self.spans[mark:])


def image(seed: int) -> Image.Image:
    """Noise, a new image each seed: the prefix cache serves none of it."""
    width, height = IMAGE_SIZE
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [*rng.integers(10, 500, 20).tolist(), IMAGE_TOKEN, *rng.integers(10, 500, 10).tolist()]


def engine_of(path: Path, target_itl_ms: float | None) -> Engine:
    config = EngineConfig.of(
        kv_cache_tokens=8192, speculate="none", prefill_chunk=CHUNK, target_itl_ms=target_itl_ms
    )
    return Engine.from_pretrained(path, config)


def stall_round(engine: Engine, timer: EncodeTimer, seed: int) -> dict[str, float]:
    """One round: the streams' longest gap while the image prompt prefilled, the round's chunk
    steps (a full chunk beside the decodes) and the step that encoded, in seconds."""
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request([20 + i] * 8, params) for i in range(STREAMS)]
    times: dict[str, list[float]] = {s: [] for s in streams}

    def step() -> list[Any]:
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if isinstance(e, TokenEvent) and e.request_id in times:
                times[e.request_id].append(now)
        return events

    while min(len(t) for t in times.values()) < 3:
        step()
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    encodes = len(timer.spans)
    sent = time.perf_counter()
    intruder = engine.add_request(image_prompt(seed), first, images=[image(seed)])
    mark = encodes
    chunk_steps, encode_steps, answered = [], [], None
    while answered is None:
        events = step()
        decodes, prompt_tokens, elapsed = engine.last_step
        if len(timer.spans) > encodes:
            encode_steps.append((elapsed, timer.spans[-1][2]))
            encodes = len(timer.spans)
        elif prompt_tokens == CHUNK or (engine.config.target_itl_ms is not None and prompt_tokens):
            chunk_steps.append(elapsed)
        if any(isinstance(e, TokenEvent) and e.request_id == intruder for e in events):
            answered = time.perf_counter()
    step()  # a token after the answer, so that a gap spanning it is seen whole
    for s in streams:
        engine.cancel(s)
    while engine.has_work:
        engine.step()
    longest = max(
        b - a
        for ts in times.values()
        for a, b in zip(ts, ts[1:], strict=False)
        if b > sent and a < answered
    )
    before = [b - a for ts in times.values() for a, b in zip(ts, ts[1:], strict=False) if b <= sent]
    return {
        "longest": longest,
        "decode": statistics.median(before),
        "chunk": statistics.median(chunk_steps),
        "encode_step": max(t for t, _ in encode_steps),
        "encode_steps": len(encode_steps),
        "units": max(n for _, n in encode_steps),
        "encode": timer.since(mark),
    }


def ttft(engine: Engine, timer: EncodeTimer, seed: int) -> tuple[float, float]:
    """The image prompt alone: (time to first token, its encode), in seconds."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    mark = len(timer.spans)
    start = time.perf_counter()
    engine.add_request(image_prompt(seed), params, images=[image(seed)])
    while engine.has_work:
        engine.step()
    return time.perf_counter() - start, timer.since(mark)


def share(name: str, engine: Engine, timer: EncodeTimer, runs: int, seed: int) -> None:
    ttft(engine, timer, seed)  # warm-up: first-use costs of the kernels
    results = [ttft(engine, timer, seed + 1 + i) for i in range(runs)]
    total = statistics.median(t for t, _ in results)
    encode = statistics.median(e for _, e in results)
    each = ", ".join(f"{t:.2f} s ({e / t:.0%})" for t, e in results)
    print(
        f"{name}: TTFT of the 1,000-token image prompt, median {total:.2f} s, encode "
        f"{encode:.2f} s: {encode / total:.0%} of it (runs: {each})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="language layers (of 36)")
    parser.add_argument("--rounds", type=int, default=3, help="stall rounds, and TTFT runs")
    parser.add_argument("--out", type=Path, help="keep the checkpoints here (built if absent)")
    parser.add_argument(
        "--target-itl-ms",
        type=float,
        help="the engine's latency target: chunks and encode units sized by its cost model "
        "(a chunk step is then any step with prompt tokens and no encode work)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        print(f"{torch.get_num_threads()} threads", flush=True)
        checkpoints = {
            "tiny": (TINY_TEXT, TINY_TOWER),
            "realistic": ({**REALISTIC_TEXT, "num_hidden_layers": args.layers}, REALISTIC_TOWER),
        }
        for name, (text, tower) in checkpoints.items():
            path = root / f"{name}-{text['num_hidden_layers']}"
            if not (path / "config.json").is_file():
                started = time.perf_counter()
                build(path, text, tower)
                print(f"built {name} in {time.perf_counter() - started:.0f} s", flush=True)
            engine = engine_of(path, args.target_itl_ms)
            timer = EncodeTimer(engine)
            [placed] = engine.admission.check_prompt(image_prompt(0), images=[image(0)]).images
            assert placed.length == 1000, placed.length
            share(name, engine, timer, args.rounds, seed=100)
            if name != "realistic":
                continue
            rounds = [stall_round(engine, timer, seed=200 + i) for i in range(args.rounds)]
            for i, r in enumerate(rounds):
                print(
                    f"round {i + 1}: longest gap {r['longest']:.2f} s; decode step "
                    f"{r['decode']:.3f} s, chunk step {r['chunk']:.2f} s, longest step with "
                    f"encode work {r['encode_step']:.2f} s (of {r['encode_steps']} steps, at "
                    f"most {r['units']} units a step; encode {r['encode']:.2f} s in all)",
                    flush=True,
                )
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(
                f"stall, median of {len(rounds)}: the streams' longest gap {med['longest']:.2f} s "
                f"against a chunk step of {med['chunk']:.2f} s; the longest step with encode "
                f"work {med['encode_step']:.2f} s (decode step alone {med['decode']:.3f} s)"
            )


if __name__ == "__main__":
    main()
