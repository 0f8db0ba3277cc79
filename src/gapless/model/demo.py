"""A tiny, self-made tokenizer and random-weight checkpoint, so gapless runs with no downloads.

The tokenizer is a byte-level BPE trained on the installed Python standard library; the
checkpoint is a small Llama whose weights come from a seeded generator. Both are deterministic,
so tests and demos see the same ids and weights on every machine with the same Python.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

DEMO_MODEL_NAME = "gapless-demo"
# Bump when the recipe changes so stale caches are never reused.
DEMO_DIR_NAME = "gapless-demo-v1"

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
)

# Each message is `<|role|>content<|end|>`; the model answers after `<|assistant|>` and stops by
# emitting `<|end|>`, which is why `<|end|>` is the tokenizer's eos token. Roles are checked so
# that a role string can never smuggle arbitrary special-token text into the prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def stdlib_sources() -> list[Path]:
    """The standard library's `.py` files in a stable order (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    third_party = {"site-packages", "dist-packages"}
    return sorted(
        path
        for path in root.rglob("*.py")
        if not third_party.intersection(path.relative_to(root).parts)
    )


def _read_capped(files: Iterable[Path], max_bytes: int) -> Iterator[str]:
    remaining = max_bytes
    for path in files:
        if remaining <= 0:
            return
        data = path.read_bytes()[:remaining]
        remaining -= len(data)
        # A cut can split a character; dropping the fragment keeps training deterministic.
        yield data.decode("utf-8", errors="ignore")


def build_bpe_tokenizer(
    vocab_size: int,
    files: Iterable[Path] | None = None,
    max_bytes: int = 4_000_000,
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE with gapless' special tokens on `files` (default: the stdlib)."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocab, so any text can be encoded without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sources = stdlib_sources() if files is None else list(files)
    tokenizer.train_from_iterator(_read_capped(sources, max_bytes), trainer=trainer)
    return tokenizer


def _added_token_json(token: tokenizers.AddedToken) -> dict[str, Any]:
    return {
        "content": token.content,
        "lstrip": token.lstrip,
        "normalized": token.normalized,
        "rstrip": token.rstrip,
        "single_word": token.single_word,
        "special": token.special,
    }


def write_tokenizer_files(
    tokenizer: tokenizers.Tokenizer,
    out_dir: Path,
    eos_token: str = "<|end|>",
    bos_token: str = "<|bos|>",
    pad_token: str = "<|pad|>",
    add_bos_token: bool = True,
    chat_template: str | list[dict[str, str]] | None = CHAT_TEMPLATE,
    model_max_length: int = 4096,
) -> None:
    """Write tokenizer.json and tokenizer_config.json the way a Hugging Face checkpoint has them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Work on a copy: the post-processor below must not leak into the caller's tokenizer.
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    bos_id = tokenizer.token_to_id(bos_token)
    if add_bos_token:
        if bos_id is None:
            raise ValueError(f"bos token {bos_token!r} is not in the vocabulary")
        # Same template transformers builds from `add_bos_token`, so tokenizer.json alone
        # (read by plain `tokenizers` users) and tokenizer_config.json agree.
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token}:0 $A:0",
            pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
            special_tokens=[(bos_token, bos_id)],
        )
    else:
        tokenizer.post_processor = None
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)

    added = tokenizer.get_added_tokens_decoder()
    config: dict[str, Any] = {
        "added_tokens_decoder": {str(i): _added_token_json(added[i]) for i in sorted(added)},
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "bos_token": bos_token,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "model_max_length": model_max_length,
        "pad_token": pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _demo_weights(vocab_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = cfg["hidden_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    q_out = cfg["num_attention_heads"] * head_dim
    kv_out = cfg["num_key_value_heads"] * head_dim
    inter = cfg["intermediate_size"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[p + "input_layernorm.weight"] = ones()
        tensors[p + "post_attention_layernorm.weight"] = ones()
    tensors["model.norm.weight"] = ones()
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _build_demo_checkpoint(out_dir: Path) -> None:
    from safetensors.torch import save_file

    tokenizer = build_bpe_tokenizer(vocab_size=4096)
    write_tokenizer_files(tokenizer, out_dir)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bos_id = tokenizer.token_to_id("<|bos|>")
    end_id = tokenizer.token_to_id("<|end|>")
    eos_id = tokenizer.token_to_id("<|eos|>")
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": end_id,
        "pad_token_id": tokenizer.token_to_id("<|pad|>"),
    }
    _write_json(out_dir / "config.json", cfg)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": [end_id, eos_id]},
    )
    save_file(_demo_weights(vocab_size, cfg), str(out_dir / "model.safetensors"), {"format": "pt"})


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def shipped_demo_checkpoint() -> Path | None:
    """The trained demo checkpoint packaged with gapless, or None if this install lacks it.

    It is made by scripts/train_demo_model.py (see docs/demo-model.md); until it ships, callers
    fall back to the random-weight `ensure_demo_checkpoint()`.
    """
    path = Path(__file__).resolve().parent.parent / "demo_model"
    return path if _is_complete(path) else None


def ensure_demo_checkpoint(cache_dir: Path | None = None) -> Path:
    """Return the demo checkpoint's directory, building it on first use (a few seconds)."""
    if cache_dir is None:
        import platformdirs

        cache_dir = Path(platformdirs.user_cache_dir("gapless"))
    final = Path(cache_dir) / DEMO_DIR_NAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the destination so the rename is atomic (same filesystem): readers see
    # either no checkpoint or a whole one, even if this process dies half way.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIR_NAME}-", dir=final.parent))
    try:
        _build_demo_checkpoint(tmp)
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first; its checkpoint is identical, so use it.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
