"""SmolLM3: `SmolLM3ForCausalLM`, config model_type `smollm3`, GGUF `smollm3`.

Llama's layer (model/families/llama.py runs it), as transformers' modeling_smollm3.py
computes it, but the layers that `no_rope_layers` marks 0 (every `no_rope_layer_interval`-th,
4 by default: layers 4, 8, ...) apply no rotary embedding (NoPE). A window, where
`use_sliding_window` is set, on the layers `layer_types` names sliding (by default the NoPE
ones, as transformers' config has it).

llama.cpp's smollm3 files carry no key for the NoPE layers: its loader takes every 4th, and
no window; its converter permutes q/k rows as for `llama` files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gapless.model.decoder import Body
from gapless.model.families import common, llama
from gapless.model.families.common import Meta
from gapless.model.families.llama import LlamaConfig

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("SmolLM3ForCausalLM",)
GGUF_ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM"}
GGUF_NAMES = common.GGUF_NAMES
SHARD_ROWS, SHARD_COLUMNS = common.SHARD_ROWS, common.SHARD_COLUMNS
NO_ROPE_LAYER_INTERVAL = 4  # transformers' default, and llama.cpp's fixed step
tensor_shapes = llama.tensor_shapes
from_gguf = llama.unpermute_qk


@dataclass(frozen=True)
class SmolLM3Config(LlamaConfig):
    rope_layers: tuple[bool, ...]  # per layer: q and k rotate; False: NoPE


def config(raw: dict) -> SmolLM3Config:
    interval = raw.get("no_rope_layer_interval", NO_ROPE_LAYER_INTERVAL)
    layers = range(raw["num_hidden_layers"])
    rope_layers = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in layers]
    windowed = raw.get("use_sliding_window", False) and raw.get("sliding_window") is not None
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if windowed and not rope else "full_attention" for rope in rope_layers
    ]
    # Llama's flags: no q/k/v bias, no q/k norms, no window unless use_sliding_window.
    cfg = llama.config(raw | {"layer_types": layer_types}, flags=(False, False, False))
    return SmolLM3Config(**vars(cfg), rope_layers=tuple(bool(rope) for rope in rope_layers))


def gguf_config(raw: dict, meta: Meta) -> dict:
    """llama.cpp's smollm3: every 4th layer NoPE, no window (its loader reads none)."""
    return raw | {"no_rope_layer_interval": NO_ROPE_LAYER_INTERVAL, "use_sliding_window": False}


def build(cfg: SmolLM3Config, w: Weights) -> Body:
    no_rope = [i for i, rope in enumerate(cfg.rope_layers) if not rope]
    return llama.build(cfg, w, no_rope=no_rope)
