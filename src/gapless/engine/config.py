"""The engine's options: each one `option(...)` field (options.py), which `gapless serve`'s
flags, `LLM(**options)` and the range checks all read. The scheduler's are on
SchedulerConfig (scheduler.py), the launch's on Launch (distributed.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gapless.engine import distributed
from gapless.engine.options import check, option, split
from gapless.engine.request import POOLINGS
from gapless.engine.sampling_params import SERVICE_CLASSES
from gapless.engine.scheduler import SchedulerConfig
from gapless.kernels import DTYPES, KV_CACHE_DTYPES
from gapless.model.quantize import (
    DEFAULT_INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    QUANTIZE_CHOICES,
    quantizer,
)

# The --help sections of the image options and the KV disk tier's.
IMAGES = "images (vision-language models)"
KV_DISK = "KV disk tier"


@dataclass
class EngineConfig:
    """The engine's options (see options.py); `EngineConfig.of(**options)` takes them, the
    scheduler's included, by name."""

    dtype: str = option(
        "auto",
        "auto: a checkpoint's own dtype (config.json's torch_dtype) where the device is fast "
        "in it, else float32 on CPUs (bfloat16 on CUDA); for GGUF files and --quantize, "
        "bfloat16 on CUDA, float32 on CPUs",
        choices=("auto", *DTYPES),
    )
    device: str = option("auto", "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...")
    quantize: str | None = option(
        None,
        "quantize the linears' float weights at load, into GGUF blocks where our block kernels "
        "run: int8 (Q8_0, a scale per 32) or int4 (Q4_1, a scale and minimum per 32); "
        "embeddings and norms stay in --dtype. A GGUF file's quantized weights run as they "
        "are without this flag",
        choices=QUANTIZE_CHOICES,
    )
    quantize_group_size: int = option(
        DEFAULT_INT4_GROUP_SIZE,
        "int4: columns per scale and offset (32: Q4_1 blocks; 64, 128: torch's int4 op)",
        choices=INT4_GROUP_SIZES,
    )
    block_size: int = option(16, "tokens per KV cache block", positive=True, cli=False)
    kv_cache_tokens: int | None = option(
        None, "KV cache size in tokens", positive=True, metavar="N", exclusive="kv"
    )
    kv_memory_gib: float = option(
        2.0,
        "KV cache size in GiB",
        positive=True,
        flag="--kv-memory",
        metavar="GIB",
        exclusive="kv",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's storage type, whatever attention computes in: int8 keeps q8_0's 34 "
        "bytes per 32 values (a head size that is a multiple of 32); auto: a checkpoint's "
        "run dtype (exact); for GGUF files and --quantize bfloat16 where attention runs in "
        "it, else float16 on CPUs with F16C, else float32",
        choices=("auto", *KV_CACHE_DTYPES),
    )
    kv_disk: str | None = option(
        None,
        "keep full prompt blocks' KV in this directory too, as a second tier under the "
        "prefix cache: a restart, a replica sharing the directory, or a prefix evicted from "
        "RAM loads it instead of computing it (docs/server.md, The KV disk tier)",
        metavar="DIR",
        section=KV_DISK,
    )
    kv_disk_gb: float = option(
        10.0,
        "the most GB --kv-disk's directory holds; beyond it the least recently used blocks "
        "are deleted",
        positive=True,
        metavar="GB",
        section=KV_DISK,
    )
    max_model_len: int | None = option(
        None, "context length (default: the model's maximum)", positive=True
    )
    target_itl_ms: float | None = option(
        None,
        "size prefill chunks so decode steps stay under this inter-token latency (every "
        "service class's target but those --class-itl-ms names)",
        positive=True,
        metavar="MS",
    )
    class_itl_ms: str | None = option(
        None,
        "inter-token latency targets by service class, e.g. interactive=150,standard=400: "
        "each step's prompt chunks are sized so that the strictest class decoding in it meets "
        "its target",
        metavar="CLASS=MS,...",
    )
    class_ttft_ms: str | None = option(
        None,
        "time-to-first-token targets by service class, e.g. interactive=2000: /metrics and "
        "the live page count the first tokens that missed them",
        metavar="CLASS=MS,...",
    )
    max_queue: int | None = option(
        None, "waiting requests beyond this get 503 (default: no limit)", minimum=0
    )
    num_threads: int | None = option(
        None,
        "CPU threads for torch (per rank; default: its share)",
        positive=True,
        flag="--threads",
    )
    tensor_parallel_size: int = option(
        1,
        "split the model over N ranks (processes), on this host or --nnodes hosts",
        positive=True,
        metavar="N",
        section=distributed.TENSOR_PARALLELISM,
    )
    pipeline_parallel_size: int = option(
        1,
        "split the model's layers into N stages, one rank (process) each, or "
        "--tensor-parallel-size ranks each, on this host or --nnodes hosts; a stage's ranks "
        "load and hold only its weights and KV",
        positive=True,
        metavar="N",
        section=distributed.TENSOR_PARALLELISM,
    )
    pipeline_layers: str | None = option(
        None,
        "layers per pipeline stage, e.g. 10,14 (default: the layers split by their bytes, "
        "the embeddings counted to the first stage, lm_head to the last)",
        metavar="N,N,...",
        section=distributed.TENSOR_PARALLELISM,
    )
    pooling: str = option(
        "last",
        "how an embedding pools the final hidden states: the last token's (as decoder "
        "embedding models such as Qwen3-Embedding) or the mean over the prompt; then "
        "L2-normalized",
        choices=POOLINGS,
    )
    reranker: bool = option(
        False,
        "score rerank and score requests' pairs as a yes/no reranker (Qwen3-Reranker's "
        "recipe: P(yes) of the last token's yes and no logits); *ForSequenceClassification "
        "checkpoints score by their head without it",
    )
    speculate: str = option(
        "ngram",
        "speculative decoding: ngram proposes what followed the latest earlier match of a "
        "request's last tokens in its own prompt and output, and the step's forward verifies "
        "it (the output is the same, and distributed the same, as without); none decodes one "
        "token a step; draft proposes --draft-model's greedy tokens",
        choices=("none", "ngram", "draft"),
    )
    draft_model: str | None = option(
        None,
        "with --speculate draft: a small model (HF directory or GGUF file) with the target's "
        "tokenizer; its KV takes a share of the KV budget, so that both pools hold the same "
        "number of tokens",
        metavar="PATH",
    )
    lora: tuple[str, ...] = option(
        (),
        "serve the LoRA adapter at PATH (PEFT's adapter_config.json and "
        "adapter_model.safetensors) as the model NAME, beside the base model; repeat for more. "
        "Every adapter stays resident; requests on different adapters share a step",
        metavar="NAME=PATH",
    )
    num_speculative_tokens: int = option(
        5,
        "the most proposed tokens a request verifies in a step; its own number follows how "
        "many of its proposals were accepted lately, down to 0",
        positive=True,
        metavar="K",
    )
    limit_mm_per_prompt: int = option(
        4,
        "the most images one prompt may hold (a vision-language model's)",
        minimum=0,
        section=IMAGES,
    )
    max_image_pixels: int = option(
        4096 * 4096,
        "the most pixels (width x height) an image may have; checked on its header, before "
        "its pixels are decoded",
        positive=True,
        section=IMAGES,
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        quantizer(self.quantize, self.quantize_group_size)  # its own messages name the choices
        check(self)
        self.latency_targets()  # raises on a malformed --class-*-ms
        if (self.speculate == "draft") != (self.draft_model is not None):
            raise ValueError("--speculate draft and --draft-model go together")
        if self.draft_model is not None and self.world_size > 1:
            raise ValueError("a draft model runs without tensor or pipeline parallelism")
        if self.kv_disk is not None and self.world_size > 1:
            # Each rank holds its own shard's KV: the tier would need every rank's files.
            raise ValueError("--kv-disk runs without tensor or pipeline parallelism, for now")
        if self.lora and self.world_size > 1:
            raise ValueError("--lora runs without tensor or pipeline parallelism")
        self.lora = tuple(self.lora or ())  # the flag's list, or None when not given
        if self.pipeline_layers is not None and self.pipeline_parallel_size == 1:
            raise ValueError("--pipeline-layers needs --pipeline-parallel-size 2 or more")

    @property
    def world_size(self) -> int:
        """The ranks (processes) the engine runs on."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def latency_targets(self) -> tuple[dict[str, float], dict[str, float]]:
        """The TTFT and ITL targets by service class, in seconds; a class without one is
        absent. --target-itl-ms is the ITL target of every class --class-itl-ms leaves out."""
        itl = {c: self.target_itl_ms / 1000 for c in SERVICE_CLASSES if self.target_itl_ms}
        itl |= _class_targets("class_itl_ms", self.class_itl_ms)
        return _class_targets("class_ttft_ms", self.class_ttft_ms), itl

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """From options by name, the engine's and the scheduler's alike."""
        mine, scheduler = split(options, cls, SchedulerConfig)
        return cls(**mine, scheduler=SchedulerConfig(**scheduler))


def _class_targets(name: str, value: str | None) -> dict[str, float]:
    """`interactive=150,standard=400` (milliseconds) as seconds by class."""
    targets: dict[str, float] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        service_class, _, ms = item.partition("=")
        service_class = service_class.strip()
        if service_class not in SERVICE_CLASSES:
            classes = ", ".join(SERVICE_CLASSES)
            raise ValueError(f"{name}: {service_class!r} is not a service class ({classes})")
        try:
            seconds = float(ms) / 1000
        except ValueError:
            raise ValueError(f"{name}: {item.strip()!r} is not CLASS=MILLISECONDS") from None
        if not seconds > 0 or seconds == float("inf"):
            raise ValueError(f"{name}: {service_class}'s target must be positive, got {ms!r}")
        targets[service_class] = seconds
    return targets
