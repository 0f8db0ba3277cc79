"""Seeded random-weight checkpoints in Hugging Face format (Qwen2, Qwen3, Qwen3-MoE), for
benchmarks that need a real model's shapes and costs but not its answers."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

from gapless.model import families
from gapless.model.loader import expected_shapes

# Qwen3-30B-A3B at half its width (hidden 2048, experts of 768), 4 of its 48 layers and a
# vocabulary in the same proportion to the layers' active weights (~9%), as a mixture of
# experts and as a dense model of the same active parameters: 8 chosen experts of 384 rows
# against one MLP of 8 * 384 (the router's 128 rows are the mixture's only extra).
_QWEN3_NARROW: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=8 * 384,
    vocab_size=4096,
)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
    "qwen3-30b-a3b-narrow": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        **_QWEN3_NARROW,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        norm_topk_prob=True,
    ),
    "qwen3-30b-a3b-narrow-dense": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", **_QWEN3_NARROW
    ),
}


def model_config(preset: str) -> dict:
    p = PRESETS[preset]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        **p,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "max_window_layers": p["num_hidden_layers"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the config's checkpoint, as its family declares them."""
    return list(expected_shapes(families.model_config(cfg)).items())


def write_random_safetensors(
    path: Path, shapes: list[tuple[str, tuple[int, ...]]], seed: int
) -> None:
    """Write bf16 tensors one at a time, so peak memory is one tensor, not the model.

    The safetensors layout is simple enough to stream by hand: a little-endian u64 header
    length, a JSON header of dtype/shape/byte offsets (padded to 8 bytes), then raw data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        size = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            # bf16 bits reinterpreted as int16 so numpy can hand out the raw bytes.
            f.write(t.view(torch.int16).numpy().data)


def _special_ids(out: Path) -> dict[str, int]:
    """bos/eos/pad ids as declared by the tokenizer files, whatever the tokenizer helper chose."""
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    added = {
        t["content"]: t["id"]
        for t in json.loads((out / "tokenizer.json").read_text()).get("added_tokens", [])
    }
    ids = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        tok = tok_cfg.get(key)
        name = tok.get("content") if isinstance(tok, dict) else tok
        if name in added:
            ids[f"{key}_id"] = added[name]
    return ids


def make_model(out_dir: str | Path, preset: str = "qwen2.5-0.5b", seed: int = 0) -> Path:
    """Write config, weights, generation config and tokenizer to `out_dir` (must not exist or
    be empty). Files land in a temp dir renamed at the end, so a crash leaves no half model."""
    from gapless.model.demo import build_bpe_tokenizer, write_tokenizer_files

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        cfg = model_config(preset)
        tokenizer = build_bpe_tokenizer(cfg["vocab_size"])
        write_tokenizer_files(tokenizer, tmp, model_max_length=cfg["max_position_embeddings"])
        cfg.update(_special_ids(tmp))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen_cfg = {
            k: v for k, v in cfg.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
        write_random_safetensors(tmp / "model.safetensors", tensor_shapes(cfg), seed)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
