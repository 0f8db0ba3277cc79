"""Model families, one module each (as mlx-lm keeps one file per architecture).

A family module declares, in plain torch over the kernels seam:
- ARCHITECTURES: the config.json `architectures` names it reads;
- GGUF_ARCHITECTURES: llama.cpp's `general.architecture` names -> the Hugging Face one;
- config(raw) -> its ModelConfig subclass, from config.json's keys;
- gguf_config(raw, meta) -> config.json's keys of a GGUF file: raw holds those of the
  metadata every llama.cpp file writes alike (model/gguf.py), meta(key, default) reads its own;
- tensor_shapes(cfg) -> {Hugging Face tensor name: shape}: every tensor a checkpoint holds;
- GGUF_NAMES: {Hugging Face module: llama.cpp's tensor name} (common.GGUF_NAMES, and its own);
- SHARD_ROWS, SHARD_COLUMNS: {Hugging Face module: how tensor parallelism cuts it} (common's,
  and its own: a mixture's experts, gpt-oss's sinks; model/shard.py cuts by them);
- from_gguf(cfg, name, w) -> w: a GGUF tensor, under its Hugging Face name, as the checkpoint
  holds it (llama.cpp's converters permute rows or shift norms for some families);
- build(cfg, weights) -> decoder.Body: its layers and final norm, from the checked weights
  (weights.Weights hands out norms and fused linears); a layer's `forward(x, step, kv_cache)`
  runs it over a step's batch (decoder.Step: rotations, KV write and attention, all-reduce).

Optionally, split_fused(cfg, weights) -> weights: a checkpoint's fused projections split into
the q/k/v and gate/up tensors that tensor parallelism shards (parallel.py); and
gguf_tensor_shapes(cfg), where llama.cpp's converter splits some of them (gpt-oss's experts):
a file's tensors under the names split_fused gives.

The engine, scheduler, KV cache and server do not change with a family. Adding one is a
module here, listed in FAMILIES, and its parity test against transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType

from gapless.model.config import ConfigError, ModelConfig
from gapless.model.families import (
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mixtral,
    phi3,
    qwen3_moe,
    smollm3,
)

FAMILIES: tuple[ModuleType, ...] = (
    llama,
    gemma3,
    phi3,
    smollm3,
    gemma2,
    qwen3_moe,
    mixtral,
    gpt_oss,
)


def gguf_architecture(architecture: str) -> str:
    """llama.cpp's `general.architecture` for a model of config.json's `architecture` (what
    Ollama calls its family): LlamaForCausalLM is `llama`, GptOssForCausalLM `gpt-oss`, and
    Mistral and Mixtral, which llama.cpp writes as `llama` files, `llama` too."""
    for family in FAMILIES:
        for name, hf_architecture in family.GGUF_ARCHITECTURES.items():
            if hf_architecture == architecture:
                return name
    if architecture in llama.ARCHITECTURES or architecture in mixtral.ARCHITECTURES:
        return "llama"
    # The vision-language families, whose GGUF files gapless does not read: their own name.
    return architecture.removesuffix("ForConditionalGeneration").lower()


def family_of(architecture: str | None) -> ModuleType:
    """The family that reads config.json's architecture."""
    for family in FAMILIES:
        if architecture in family.ARCHITECTURES:
            return family
    names = [name for family in FAMILIES for name in family.ARCHITECTURES]
    raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(names)}")


# Sequence classifiers on a family's decoder (a reranker's cross-encoder head): architecture ->
# the causal LM whose layers they run. Their config is that LM's, with num_labels set.
CLASSIFIERS = {
    f"{name}ForSequenceClassification": f"{name}ForCausalLM" for name in ("Llama", "Qwen2", "Qwen3")
}


def model_config(raw: dict) -> ModelConfig:
    """The config of the family that reads raw's architecture (its ModelConfig subclass)."""
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    decoder = CLASSIFIERS.get(architecture)  # type: ignore[arg-type]
    if decoder is None:
        return family_of(architecture).config(raw)
    # transformers writes a classifier's labels as id2label (num_labels is derived from it).
    num_labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 2
    if num_labels != 1:
        raise ConfigError(
            f"{architecture} with {num_labels} labels: only a one-label head (a relevance "
            "score, as rerankers have) is served"
        )
    cfg = family_of(decoder).config(raw | {"architectures": [decoder]})
    return dataclasses.replace(cfg, num_labels=num_labels)


def read_config_json(path: str | Path) -> ModelConfig:
    """The config of a checkpoint directory's config.json."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"no config.json in {path}")
    return model_config(json.loads(config_path.read_text()))


def gguf_family(architecture: str) -> tuple[ModuleType, str]:
    """The family of a GGUF file's general.architecture, and the Hugging Face architecture."""
    for family in FAMILIES:
        if architecture in family.GGUF_ARCHITECTURES:
            return family, family.GGUF_ARCHITECTURES[architecture]
    names = [name for family in FAMILIES for name in family.GGUF_ARCHITECTURES]
    raise ValueError(
        f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(names)}"
    )
