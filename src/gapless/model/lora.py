"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read and
checked against their base at start, and attached to its decoder's linears as per-request
updates (kernels/lora.py). What gapless cannot apply exactly is refused here, with the reason.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from gapless.kernels.lora import Adapters, LoraLinear, LoraProduct
from gapless.model.config import ModelConfig
from gapless.model.decoder import Decoder

# PEFT's target module -> the layer's linear it updates (q, k and v are one fused linear).
TARGETS = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
# The architectures whose layers hold exactly these linears (llama.Layer, gemma3's layer).
ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
}
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


class AdapterError(ValueError):
    """An adapter that cannot be served on its base; the message names it and why."""


@dataclass
class Adapter:
    """One adapter's updates: (layer, PEFT module) -> (A [r, in], B [out, r] times the
    adapter's scaling)."""

    name: str
    updates: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def parse_flag(spec: str) -> tuple[str, Path]:
    """--lora NAME=PATH as (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise AdapterError(f"--lora takes NAME=PATH, got {spec!r}")
    return name, Path(path)


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a target module's weight in the base."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]


def read_adapter(name: str, path: Path, cfg: ModelConfig) -> Adapter:
    """The adapter at path, checked against the base's config; AdapterError naming the
    adapter and the problem otherwise."""

    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {reason}")

    if cfg.architecture not in ARCHITECTURES:
        raise refuse(f"adapters are not supported on {cfg.architecture}")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise refuse("no adapter_config.json")
    raw = json.loads(config_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {raw['peft_type']!r} is not LoRA")
    if raw.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported: it rescales the merged weight")
    if raw.get("bias", "none") != "none":
        raise refuse(f"bias {raw['bias']!r} is not supported, only 'none'")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if raw.get(key):
            raise refuse(f"{key} is not supported")
    targets = raw.get("target_modules")
    if not isinstance(targets, list):
        raise refuse(f"target_modules must be a list of module names, got {targets!r}")
    if lacking := sorted(set(targets) - set(TARGETS)):
        raise refuse(f"target modules gapless lacks: {', '.join(lacking)}")
    rank, alpha = raw["r"], raw["lora_alpha"]
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    try:
        tensors = safetensors.torch.load_file(path / "adapter_model.safetensors")
    except Exception as exc:  # a missing, truncated or corrupt file alike
        raise refuse(f"cannot read adapter_model.safetensors: {exc}") from exc
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match[2] not in targets:
            raise refuse(f"unexpected tensor {key}")
        layer, module, which = int(match[1]), match[2], match[3]
        if layer >= cfg.num_layers:
            raise refuse(f"{key}: the base has {cfg.num_layers} layers")
        parts.setdefault((layer, module), {})[which] = tensor
    updates = {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise refuse(f"{where} has lora_A or lora_B without the other")
        out, inp = module_shape(cfg, module)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise refuse(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank"
                f" {rank} on the base's {(out, inp)} weight"
            )
        updates[layer, module] = (a.float(), b.float() * scale)
    return Adapter(name, updates)


def attach(decoder: Decoder, adapters: list[Adapter]) -> Adapters:
    """Wraps each layer linear that some adapter updates in a LoraLinear over them all (an
    adapter's index is its place in the list), and gives the decoder their Adapters."""
    cfg, dtype = decoder.config, decoder.dtype
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # Each part's output columns in the fused linear.
    columns = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    resident = Adapters([adapter.name for adapter in adapters])
    for i, layer in enumerate(decoder.layers):
        for linear in ("qkv", "o", "gate", "up", "down"):
            modules = [m for m, target in TARGETS.items() if target == linear]
            products = [_product(a, i, modules, columns, dtype) for a in adapters]
            if any(products):
                base = getattr(layer, linear)
                setattr(layer, linear, LoraLinear(base, resident, products))
    decoder.adapters = resident
    return resident


def _product(
    adapter: Adapter,
    layer: int,
    modules: list[str],
    columns: dict[str, tuple[int, int]],
    dtype: torch.dtype,
) -> LoraProduct | None:
    """The adapter's update of one linear of a layer, from its modules' updates stacked by
    rank: a fused linear's b is block diagonal, each part's rank onto its own columns."""
    parts = [(m, adapter.updates[layer, m]) for m in modules if (layer, m) in adapter.updates]
    if not parts:
        return None
    if len(modules) == 1:
        a, b = parts[0][1]
        return LoraProduct(a.to(dtype), b.to(dtype))
    a = torch.cat([a for _, (a, _) in parts])
    b = torch.zeros(columns["v_proj"][1], len(a))
    rank = 0
    for module, (part_a, part_b) in parts:
        first, end = columns[module]
        b[first:end, rank : rank + len(part_a)] = part_b
        rank += len(part_a)
    return LoraProduct(a.to(dtype), b.to(dtype))
