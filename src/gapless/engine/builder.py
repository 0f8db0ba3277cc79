"""Assembly: the one place that sets up a process to run an engine and builds the engine's
parts from files. LLM, Engine.from_pretrained and `gapless serve` all build through it, so
a model runs the same under each (threads, allocator, oneDNN's cache bounds, the KV cache's
size, the ranks of a tensor-parallel group)."""

from __future__ import annotations

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
from gapless.kv.groups import LayerGroups, split_blocks
from gapless.model.checkpoint import load_model, read_model_config
from gapless.model.decoder import Decoder
from gapless.model.parallel import check_shardable
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


def build(
    path: str | Path, config: EngineConfig, group: distributed.Group | None = None
) -> tuple[Parts, Callable[[], object] | None]:
    """The parts of a checkpoint's engine, and what ends the tensor-parallel group this call
    formed, if it formed one. With tensor_parallel_size > 1 this process is rank 0 of
    `group` (gapless serve forms it first), or of a group this call forms on this host
    (spawning its other ranks), and every rank loads its shard. A group this call forms is
    this engine's alone. A build that fails ends the group before the error is raised, so a
    later build in this process starts afresh."""
    if config.tensor_parallel_size == 1:
        prepare_process(config.num_threads)
        return _build_local(path, config), None
    if is_vision_language(path):
        raise ValueError("tensor parallelism is not supported for vision-language models")
    check_shardable(read_model_config(path), config.tensor_parallel_size)  # spawns nothing
    owns_group = group is None
    if group is None:
        launch = distributed.Launch(threads=config.num_threads, device=config.device)
        group = distributed.start(config.tensor_parallel_size, launch, f"the engine of {path}")
    parallel = group.parallel
    quantize = (config.quantize, config.quantize_group_size)
    try:
        parallel.broadcast(distributed.LoadModel(str(path), config.dtype, *quantize))
        decoder, tokenizer = load_model(path, config.dtype, parallel.device, parallel, *quantize)
        runner = kv_runner(decoder, config)
        parallel.broadcast(
            distributed.AllocateKV(
                runner.num_blocks, runner.block_size, runner.window_blocks, runner.kv_cache_dtype
            )
        )
    except BaseException:
        group.abort()
        raise
    return Parts(decoder, tokenizer, config, runner), group.stop if owns_group else None


def _build_local(path: str | Path, config: EngineConfig) -> Parts:
    device = rank_device(config.device, 0)
    quantize = (config.quantize, config.quantize_group_size)
    if is_vision_language(path):
        if config.quantize is not None:
            raise ValueError("--quantize is not supported for vision-language models")
        if config.draft_model is not None:
            raise ValueError("a draft model is not supported for vision-language models")
        vision = load_vision_language(path, config.dtype, device)
        runner = kv_runner(vision.decoder, config, vision=vision)
        tokenizer = Tokenizer.from_pretrained(path)
        return Parts(vision.decoder, tokenizer, config, runner, vision=vision)
    decoder, tokenizer = load_model(path, config.dtype, device, None, *quantize)
    draft = None
    if config.draft_model is not None:
        draft, draft_tokenizer = load_model(
            config.draft_model, config.dtype, device, None, *quantize
        )
        check_draft((decoder, tokenizer), (draft, draft_tokenizer))
    return Parts(decoder, tokenizer, config, kv_runner(decoder, config, draft), draft)


def kv_runner(
    decoder: Decoder,
    config: EngineConfig,
    draft: Decoder | None = None,
    vision: VisionLanguageModel | None = None,
) -> ModelRunner:
    """A runner with the KV cache the config's budget affords: the layers grouped by window,
    each group's share of the budget by its bytes per token (kv/groups.py). The draft's pool
    holds as many tokens as the target's first group: its bytes count with that group's."""
    mcfg, scheduling = decoder.config, config.scheduler
    groups = LayerGroups.of(mcfg.layer_windows)
    cache_dtype = kv_cache_dtype(decoder, config)
    per_token = groups.bytes_per_token(ModelRunner.kv_bytes_per_layer_token(decoder, cache_dtype))
    if draft is not None:
        per_token[0] += ModelRunner.kv_bytes_per_token(draft, kv_cache_dtype(draft, config))
    num_blocks, window_blocks = split_blocks(
        groups,
        config.block_size,
        per_token,
        scheduling.max_num_seqs,
        scheduling.max_step_tokens(bool(config.latency_targets()[1])),
        config.max_model_len or mcfg.max_position_embeddings,
        config.kv_cache_tokens,
        int(config.kv_memory_gib * 2**30),
    )
    encoder = vision.encoder if vision is not None else None
    return ModelRunner(decoder, num_blocks, config.block_size, encoder, window_blocks, cache_dtype)


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
