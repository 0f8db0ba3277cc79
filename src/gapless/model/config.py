"""Model configuration read from a Hugging Face `config.json`.

`ModelConfig` holds what every family has and what the engine reads (sizes, heads, layer
windows, stop ids); each family (model/families/) subclasses it with its own fields and reads
its own keys (families.model_config hands them to the family the `architectures` name).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # The (global layers') rotary embedding: base, type and the type's other parameters.
    rope_theta: float
    rope_type: str
    rope_scaling: dict
    # Per layer: attention window in tokens, or None for full attention.
    layer_windows: tuple[int | None, ...]
    torch_dtype: str | None
    bos_token_id: int | None
    # A sequence classifier's labels (`*ForSequenceClassification`): its checkpoint holds the
    # head `score.weight` [num_labels, hidden] in place of lm_head. None: a causal LM.
    num_labels: int | None

    @property
    def max_window(self) -> int | None:
        """The widest window any layer looks back; None if some layer attends to everything."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)  # type: ignore[type-var]

    def mlp_width(self, layer: int) -> int:
        """The intermediate width a token's MLP computes at `layer` (a mixture: its chosen
        experts' together)."""
        return self.intermediate_size

    def prompt_work(self) -> Callable[[int, int], float]:
        """What `tokens` prompt tokens after `start` computed ones cost, in tokens of a fresh
        prompt: their projections and MLPs, plus their scores and weighted values against every
        key each layer's window shows them, counted in multiply-adds. A chunk after a long
        history costs more than its tokens: at SmolLM2-135M's shape a key costs a token's
        1/3,072, so a 512-token chunk after 7,680 keys costs 3.3x a fresh one."""
        h, d = self.hidden_size, self.head_dim
        projections = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        token = sum(projections + 3 * h * self.mlp_width(i) for i in range(self.num_layers))
        key = 2 * self.num_heads * self.head_dim / token
        windows = Counter(self.layer_windows).items()

        def work(tokens: int, start: int) -> float:
            keys = sum(layers * _keys_seen(tokens, start, w) for w, layers in windows)
            return tokens + keys * key

        return work


def _keys_seen(tokens: int, start: int, window: int | None) -> int:
    """Keys that positions start .. start + tokens - 1 attend to in all, each its own and up to
    window - 1 before it (None: all before it)."""
    end = start + tokens
    growing = end if window is None else min(end, max(start, window))
    # Positions below the window see p + 1 keys; the rest see the window's.
    keys = (growing * (growing + 1) - start * (start + 1)) // 2
    return keys + (end - growing) * (window or 0)


def parse_rope(rope: dict | None, default_theta: float) -> tuple[float, str, dict]:
    """(base, type, the type's other parameters) of one rope's settings."""
    rope = dict(rope or {})
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    return theta, rope_type, rope


def base_fields(raw: dict, layer_windows: tuple[int | None, ...], **rope: Any) -> dict[str, Any]:
    """ModelConfig's fields from the config.json keys every family names alike, but the
    layer windows (each family reads its own) and the rope, which a family passes as
    rope_theta, rope_type and rope_scaling where they are not the Llama-style keys'."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    if not rope:
        # transformers >= 5 nests rope settings in `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`.
        settings = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta, rope_type, scaling = parse_rope(settings, raw.get("rope_theta", 10000.0))
        rope = {"rope_theta": theta, "rope_type": rope_type, "rope_scaling": scaling}
    return {
        "architecture": raw["architectures"][0],
        "vocab_size": raw["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": raw["intermediate_size"],
        "num_layers": raw["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or hidden // heads,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": raw.get("max_position_embeddings", 4096),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "layer_windows": layer_windows,
        "torch_dtype": raw.get("torch_dtype") or raw.get("dtype"),
        "bos_token_id": raw.get("bos_token_id"),
        "num_labels": None,  # families.model_config sets a classifier's
        **rope,
    }


def check_activation(raw: dict, key: str, supported: str) -> None:
    act = raw.get(key, supported)
    if act != supported:
        raise ConfigError(f"unsupported {key} {act!r}; supported: {supported}")
