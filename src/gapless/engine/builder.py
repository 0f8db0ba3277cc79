"""Assembly: the one place that sets up a process to run an engine and builds the engine's
parts from files. LLM, Engine.from_pretrained and `gapless serve` all build through it, so
a model runs the same under each (threads, allocator, oneDNN's cache bounds, the KV cache's
size, the ranks of a tensor-parallel group).

The KV cache is sized here alone: kv_runner asks kv/groups.py's split_blocks for each layer
group's blocks, from the budget, the context and the largest step (SchedulerConfig says how
many tokens a step holds), and max_model_len caps requests at what the pool then holds."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gapless.device import prepare_process, rank_device
from gapless.engine import distributed
from gapless.engine.config import EngineConfig
from gapless.engine.cost_model import LEARNING_CHUNK, StepCostModel
from gapless.engine.draft import check_draft
from gapless.engine.runner import ModelRunner
from gapless.kv.block_pool import BlockPool
from gapless.kv.disk import DiskTier
from gapless.kv.groups import KVGroup, LayerGroups, split_blocks
from gapless.kv.manager import KVManager
from gapless.model import lora
from gapless.model.checkpoint import load_model, read_model_config, tensor_bytes
from gapless.model.decoder import Decoder
from gapless.model.parallel import check_shardable
from gapless.model.pipeline import layer_counts
from gapless.model.tokenizer import Tokenizer
from gapless.model.vision import VisionLanguageModel, is_vision_language, load_vision_language


@dataclass
class Parts:
    """What an engine is made of, loaded and sized (Engine(**vars(parts)) assembles it)."""

    decoder: Decoder
    tokenizer: Tokenizer
    config: EngineConfig
    runner: ModelRunner
    draft: Decoder | None = None
    vision: VisionLanguageModel | None = None
    model: Path | None = None  # where the weights came from


def build(
    path: str | Path, config: EngineConfig, group: distributed.Group | None = None
) -> tuple[Parts, Callable[[], object] | None]:
    """The parts of a checkpoint's engine, and what ends the tensor- or pipeline-parallel
    group this call formed, if it formed one. With several ranks this process is rank 0 of
    `group` (gapless serve forms it first), or of a group this call forms on this host
    (spawning its other ranks), and every rank loads its shard or stage. A group this call
    forms is this engine's alone. A build that fails ends the group before the error is
    raised, so a later build in this process starts afresh."""
    if config.world_size == 1:
        prepare_process(config.num_threads)
        return _build_local(path, config), None
    load = what_ranks_load(path, config)  # its checks spawn nothing
    owns_group = group is None
    if group is None:
        launch = distributed.Launch(
            threads=config.num_threads,
            device=config.device,
            stage_size=config.tensor_parallel_size,
        )
        owner = f"the engine of {path}"
        group = distributed.start(config.world_size, launch, owner, group_kind(config))
    parallel = group.parallel
    try:
        parallel.broadcast(load)
        decoder, tokenizer = load.load(parallel)
        runner = kv_runner(decoder, config)
        parallel.broadcast(
            distributed.AllocateKV(
                runner.num_blocks, runner.block_size, runner.window_blocks, runner.kv_cache_dtype
            )
        )
    except BaseException:
        group.abort()
        raise
    parts = Parts(decoder, tokenizer, config, runner, model=Path(path))
    return parts, group.stop if owns_group else None


def what_ranks_load(path: str | Path, config: EngineConfig) -> distributed.LoadModel:
    """What rank 0 tells every rank to load: the model, and with pipeline parallelism where
    its stages cut the layers. Raises ShardError where the model does not split as asked,
    before any rank starts."""
    kind = group_kind(config)
    if is_vision_language(path):
        raise ValueError(f"{kind}ism is not supported for vision-language models")
    cfg = read_model_config(path)
    quantize = (config.quantize, config.quantize_group_size)
    load = distributed.LoadModel(str(path), config.dtype, *quantize)
    check_shardable(cfg, config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:
        stages, chosen = config.pipeline_parallel_size, config.pipeline_layers
        load.pipeline_layers = layer_counts(tensor_bytes(path), cfg, stages, chosen)
        load.tied = cfg.tie_word_embeddings
    return load


def group_kind(config: EngineConfig) -> str:
    return "pipeline parallel" if config.pipeline_parallel_size > 1 else "tensor parallel"


def _build_local(path: str | Path, config: EngineConfig) -> Parts:
    device = rank_device(config.device, 0)
    quantize = (config.quantize, config.quantize_group_size)
    if is_vision_language(path):
        if config.quantize is not None:
            raise ValueError("--quantize is not supported for vision-language models")
        if config.draft_model is not None:
            raise ValueError("a draft model is not supported for vision-language models")
        if config.lora:
            raise ValueError("--lora is not supported for vision-language models")
        vision = load_vision_language(path, config.dtype, device)
        runner = kv_runner(vision.decoder, config, vision=vision)
        tokenizer = Tokenizer.from_pretrained(path)
        return Parts(vision.decoder, tokenizer, config, runner, vision=vision, model=Path(path))
    decoder, tokenizer = load_model(path, config.dtype, device, None, *quantize)
    attach_adapters(decoder, config.lora)
    draft = None
    if config.draft_model is not None:
        draft, draft_tokenizer = load_model(
            config.draft_model, config.dtype, device, None, *quantize
        )
        check_draft((decoder, tokenizer), (draft, draft_tokenizer))
    runner = kv_runner(decoder, config, draft)
    return Parts(decoder, tokenizer, config, runner, draft, model=Path(path))


def attach_adapters(decoder: Decoder, specs: tuple[str, ...]) -> None:
    """Reads every --lora adapter (each NAME=PATH) and attaches them all to the decoder;
    an adapter that cannot be served fails the start, naming it."""
    if not specs:
        return
    named = [lora.parse_flag(spec) for spec in specs]
    names = [name for name, _ in named]
    if len(set(names)) < len(names):
        raise lora.AdapterError(f"--lora names an adapter twice: {', '.join(names)}")
    lora.attach(decoder, [lora.read_adapter(n, p, decoder.config) for n, p in named])


def kv_runner(
    decoder: Decoder,
    config: EngineConfig,
    draft: Decoder | None = None,
    vision: VisionLanguageModel | None = None,
) -> ModelRunner:
    """A runner with the KV cache the config's budget affords: the layers grouped by window,
    each group's share of the budget by its bytes per token (kv/groups.py). The draft's pool
    holds as many tokens as the target's first group: its bytes count with that group's.
    Under pipeline parallelism the budget is each stage's, whose cache holds only its layers:
    a group's bytes per token are those of the stage with the most of its layers."""
    mcfg, scheduling = decoder.config, config.scheduler
    groups = LayerGroups.of(mcfg.layer_windows)
    cache_dtype = kv_cache_dtype(decoder, config)
    per_layer = ModelRunner.kv_bytes_per_layer_token(decoder, cache_dtype)
    per_token = groups.bytes_per_token(per_layer)
    if decoder.stage is not None:
        stages = decoder.stage.stages
        most = [max(sum(layer in s for layer in g) for s in stages) for g in groups.layers]
        per_token = [per_layer * n for n in most]
    if draft is not None:
        per_token[0] += ModelRunner.kv_bytes_per_token(draft, kv_cache_dtype(draft, config))
    num_blocks, window_blocks = split_blocks(
        groups,
        config.block_size,
        per_token,
        scheduling.max_num_seqs,
        scheduling.max_step_tokens(bool(config.latency_targets()[1])),
        context_length(decoder, config),
        config.kv_cache_tokens,
        int(config.kv_memory_gib * 2**30),
    )
    encoder = vision.encoder if vision is not None else None
    return ModelRunner(decoder, num_blocks, config.block_size, encoder, window_blocks, cache_dtype)


def context_length(decoder: Decoder, config: EngineConfig) -> int:
    """The context asked for: --max-model-len, else the model's."""
    return config.max_model_len or decoder.config.max_position_embeddings


def max_model_len(decoder: Decoder, config: EngineConfig, kv: KVManager) -> int:
    """The longest a request may grow: the context asked for, but where every layer keeps
    every key no more than the pool holds (a longer sequence could be preempted and never
    fit again)."""
    if decoder.config.max_window is None:
        return min(context_length(decoder, config), kv.capacity_tokens())
    return context_length(decoder, config)


def kv_manager(runner: ModelRunner, config: EngineConfig, model: Path | None) -> KVManager:
    """The KV manager of the runner's cache: a block pool per layer group, each group's
    window with it, and with --kv-disk the disk tier under the prefix cache. `model`: the
    file or directory the weights came from (None: built in memory, which a disk tier
    cannot tell from another model: it is refused)."""
    windows, bs = runner.groups.windows, runner.block_size
    sliding = [
        KVGroup(BlockPool(n, bs), w) for n, w in zip(runner.window_blocks, windows[1:], strict=True)
    ]
    prefix_cache = config.scheduler.enable_prefix_cache
    disk = None
    if config.kv_disk is not None and prefix_cache:
        if model is None:
            raise ValueError("--kv-disk needs a model loaded from a file or directory")
        disk = DiskTier(
            config.kv_disk,
            int(config.kv_disk_gb * 1e9),
            kv_disk_fingerprint(runner, config, model),
            runner.block_shapes(),
            runner.kv_cache_dtype,
        )
    return KVManager(BlockPool(runner.num_blocks, bs), windows[0], sliding, prefix_cache, disk)


def kv_disk_fingerprint(runner: ModelRunner, config: EngineConfig, model: Path) -> str:
    """A digest of everything that makes a block's K/V valid for this engine: the weights and
    tokenizer (every file of the model: a GGUF file holds both), how the weights were
    quantized at load, the family, the compute and KV storage types, the block size and the
    layer groups. Two servers of the same files and
    options share blocks; any difference gives another directory."""
    digest = hashlib.sha256()
    files = sorted(p for p in model.rglob("*") if p.is_file()) if model.is_dir() else [model]
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    decoder = runner.decoder
    facts = (
        decoder.config.architecture,
        config.quantize,
        config.quantize_group_size,
        str(decoder.dtype),
        str(runner.kv_cache_dtype),
        runner.block_size,
        runner.groups,
        "rank 0 of 1",  # the tier runs on one rank (EngineConfig refuses it under parallelism)
    )
    digest.update(repr(facts).encode())
    return digest.hexdigest()[:32]


def kv_cache_dtype(decoder: Decoder, config: EngineConfig) -> torch.dtype:
    """The storage type of this model's KV cache under config.kv_cache_dtype (a draft model
    resolves its own: its kernels and head size may differ)."""
    return decoder.kernels.kv_cache_dtype(config.kv_cache_dtype, decoder.config.head_dim)


def cost_model(config: EngineConfig, vision: bool) -> StepCostModel | None:
    """The step cost model, where something asks for step prices: a latency target (its
    prompt budget), or images (with a target or without: a tower block costs as many as a
    few hundred prompt tokens on a CPU, where its placeholder tokens' share said ~30;
    docs/vision.md)."""
    _, itl_targets = config.latency_targets()
    if not itl_targets and not vision:
        return None
    scheduling = config.scheduler
    return StepCostModel(
        min(scheduling.prefill_chunk, LEARNING_CHUNK), scheduling.idle_prefill_chunk
    )
