"""Model configuration read from a Hugging Face `config.json`.

Every supported architecture is the same pre-norm decoder; they differ only by the flags here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# architecture -> (q/k/v bias by default, per-head q/k RMSNorm, honours sliding_window by default)
ARCHITECTURES: dict[str, tuple[bool, bool, bool]] = {
    "LlamaForCausalLM": (False, False, False),
    "MistralForCausalLM": (False, False, True),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (False, True, False),
}
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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_type: str
    rope_scaling: dict
    # Per layer: attention window in tokens, or None for full attention.
    layer_windows: tuple[int | None, ...]
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def max_window(self) -> int | None:
        """The widest window any layer looks back; None if some layer attends to everything."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)  # type: ignore[type-var]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        default_bias, qk_norm, default_sliding = ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; supported: silu")
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]

        # transformers >= 5 nests rope settings in `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )

        num_layers = raw["num_hidden_layers"]
        window = raw.get("sliding_window")
        uses_window = raw.get("use_sliding_window", default_sliding) and window
        layer_types = raw.get("layer_types")
        if layer_types and uses_window:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = tuple([window if uses_window else None] * num_layers)

        bias = raw.get("attention_bias", default_bias)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=bias,
            # Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not.
            o_bias=bias and arch != "Qwen2ForCausalLM",
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=qk_norm,
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope,
            layer_windows=windows,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )
