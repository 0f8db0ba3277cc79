"""Tiny random-weight checkpoints for tests, saved by transformers exactly as on the Hub.

Every architecture gapless supports gets a 2-layer model whose quirks (GQA, rope scaling,
biases, q/k norms, head_dim != hidden/heads, sliding window, tied or untied embeddings) are
switched on, so a runtime that ignores one of them disagrees with transformers.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

from gapless.model.demo import build_bpe_tokenizer, stdlib_sources, write_tokenizer_files

TEST_VOCAB_SIZE = 512

# Repeated so BPE learns merges inside multi-byte characters: the vocab then has pieces that
# are fragments of a UTF-8 character, which the detokenizer tests need.
UNICODE_SAMPLE = (
    "今日は良い天気ですね。我们一起去公园散步吧。데이터를 처리합니다. "
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷. Ünïcödé àéîõü ß Ωμέγα Привет мир! "
    "数学: ∑ ∫ √ ∞ ≠ ≤. 中文文本，日本語テキスト。\n"
)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    # 10x the usual init: near-uniform logits would make greedy decoding degenerate and let
    # small numerical mistakes in a runtime go unnoticed.
    "initializer_range": 0.2,
}

# arch -> (transformers model class, config class, config values on top of _COMMON)
ARCH_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        },
    ),
    "llama_linear": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 24}),
    # 7 layers: local ones (window 24, shorter than the test prompts) on both sides of a
    # global one (the 6th); each kind its own rope, the global one scaled as Gemma 3 4B's is.
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 7,
            "head_dim": 32,
            "sliding_window": 24,
            "query_pre_attn_scalar": 48,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # LongRoPE with a short original context (128: the parity tests' prompts stay inside it,
    # where transformers rotates by the short factors), half the head rotary, a window.
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        {
            "sliding_window": 48,
            "original_max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.2, 1.5, 2.5],
                "long_factor": [1.5, 3.0, 6.0, 12.0],
            },
        },
    ),
    # 4 layers, every 2nd NoPE (layers 1 and 3), windows (24) on layers 1 and 2: each of
    # rope / NoPE with and without a window.
    "smollm3": (
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        {
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 24,
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        },
    ),
    # 4 layers, local (window 24) and global alternating; caps low enough that tanh bends
    # these random weights' attention scores and logits.
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "sliding_window": 24,
            "query_pre_attn_scalar": 48,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    # Mixtures of experts (MOE_ARCHS, tests/test_moe.py; not in ARCHS, whose tests would run
    # them twice).
    # 3 layers, the middle one dense (mlp_only_layers); 8 experts, 3 chosen per token.
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "tie_word_embeddings": False,
        },
    ),
    # 4 experts, 2 chosen per token; a window (24) on every layer, as Mistral's.
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 24},
    ),
    # 3 layers: windowed (24), full, windowed; YaRN as gpt-oss-20b's but for a 64-token
    # original context; a SwiGLU limit low enough to clamp these random weights' gates.
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": 24,
            "swiglu_limit": 2.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}

# The dense checkpoints, which test_model's parity tests run, and the mixtures of experts.
ARCHS = tuple(a for a, (*_, keys) in ARCH_SPECS.items() if "num_experts_per_tok" not in keys)
MOE_ARCHS = tuple(a for a in ARCH_SPECS if a not in ARCHS)


@lru_cache(maxsize=1)
def shared_tokenizer() -> tokenizers.Tokenizer:
    """The shared ~512-token byte-level BPE; trained once per process (well under a second)."""
    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "unicode_sample.txt"
        sample.write_text(UNICODE_SAMPLE * 200, encoding="utf-8")
        files = [sample, *stdlib_sources()]
        return build_bpe_tokenizer(TEST_VOCAB_SIZE, files, max_bytes=1_000_000)


def write_test_tokenizer(out_dir: Path, **kwargs: Any) -> Path:
    """Write the test tokenizer's files; kwargs go to write_tokenizer_files."""
    write_tokenizer_files(shared_tokenizer(), out_dir, **kwargs)
    return out_dir


def _perturb_constant_params(model: Any, seed: int) -> None:
    # transformers starts norms at 1 (Gemma's, stored as w in (1 + w), at 0) and biases at 0;
    # a runtime that skipped them, or loaded q_norm into k_norm, would still match. Random
    # values around the start make such mistakes visible.
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # gpt-oss's experts' too: gate_up_proj_bias
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
            elif "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)


def _to_hf4_style(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-5 config.json the way most Hub checkpoints (saved by 4.x) look."""
    cfg = dict(cfg)
    if cfg["model_type"] == "gemma3_text":
        # One rope per layer type: the global one's keys as Llama's, the local one's base apart.
        ropes = cfg.pop("rope_parameters")
        cfg["rope_parameters"] = ropes["full_attention"]
        cfg["rope_local_base_freq"] = ropes["sliding_attention"]["rope_theta"]
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] in ("qwen2", "qwen3"):
        # 4.x Qwen configs carry no layer_types; they name a sliding window and switch it off
        # with use_sliding_window=false (Qwen2.5 ships sliding_window=32768 that way). A small
        # window here makes a runtime that applies it anyway diverge from transformers.
        cfg.pop("layer_types", None)
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = 32 if cfg["model_type"] == "qwen2" else None
        cfg["max_window_layers"] = 28
    return cfg


def _check_same_meaning(saved_dir: Path, original: Any) -> None:
    # Guards the hf4 rewrite: transformers must read back what the model was built with.
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(saved_dir)
    for field in ("rope_parameters", "head_dim", "layer_types", "tie_word_embeddings"):
        want, got = getattr(original, field, None), getattr(loaded, field, None)
        if want != got:
            raise AssertionError(f"{saved_dir}: {field} reads back as {got!r}, not {want!r}")


def make_checkpoint(
    out_dir: Path,
    arch: str,
    *,
    max_shard_size: str | int | None = None,
    config_style: str = "hf4",
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Save a tiny random `arch` model plus tokenizer files into `out_dir`.

    config_style "hf4" writes config.json as transformers 4.x did (rope_theta/rope_scaling,
    torch_dtype), which is what most Hub checkpoints contain; "hf5" keeps the file exactly as
    the installed transformers 5 saves it (rope_parameters, dtype). `max_shard_size` (e.g.
    "60KB") saves a sharded checkpoint with model.safetensors.index.json.
    """
    import torch
    import transformers

    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    if config_style not in ("hf4", "hf5"):
        raise ValueError(f"config_style must be 'hf4' or 'hf5', not {config_style!r}")
    model_cls_name, config_cls_name, arch_values = ARCH_SPECS[arch]
    out_dir = Path(out_dir)
    write_test_tokenizer(out_dir)
    tok = shared_tokenizer()
    bos_id = tok.token_to_id("<|bos|>")
    end_id = tok.token_to_id("<|end|>")
    eos_id = tok.token_to_id("<|eos|>")

    values = {
        **_COMMON,
        **arch_values,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": tok.token_to_id("<|pad|>"),
        **config_overrides,
    }
    config = getattr(transformers, config_cls_name)(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32).eval()
    _perturb_constant_params(model, seed)

    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kwargs)

    config_path = out_dir / "config.json"
    saved = json.loads(config_path.read_text(encoding="utf-8"))
    if config_style == "hf4":
        saved = _to_hf4_style(saved)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # A list, as Llama 3 instruct checkpoints have it: both ids end generation.
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": [end_id, eos_id],
        "transformers_version": transformers.__version__,
    }
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config, indent=2) + "\n", encoding="utf-8"
    )
    _check_same_meaning(out_dir, model.config)
    return out_dir
