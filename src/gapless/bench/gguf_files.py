"""GGUF files written with the `gguf` package's writer, as llama.cpp's converter writes them:
the tests' tiny files, and the bench model's (scripts/make_bench_gguf.py).

`write_gguf` turns a Hugging Face checkpoint (the tests' tiny ones: tests/checkpoints.py) into a
GGUF file:
metadata from config.json, the byte-level BPE tokenizer from tokenizer.json, tensors renamed,
the q/k rows of `llama` files permuted for llama.cpp's rope, and 2-D weights quantized.

The `gguf` package cannot quantize K-quants; `random_blocks` makes valid blocks of any type
instead (random codes and scales, with finite f16 scale fields), so a file can mix types as
a Q4_K_M file does. Such a tensor's values are random, not the checkpoint's: tests compare
against readers of the same file (transformers' GGUF loader, gguf.quants.dequantize).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file

from gapless.model.families import common, family_of, gguf_architecture
from gapless.model.gguf import gguf_name


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, interleave the two rotate-half halves of q/k rows."""
    return w.reshape(num_heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offsets of each block's f16 scale fields (d, and dmin where the type has one), in
# ggml's block layouts; the other bytes (codes, sub-block scales) take any value.
F16_FIELDS = {
    QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q8_0: (0,), QType.IQ4_NL: (0,), QType.IQ4_XS: (0,),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
    QType.Q6_K: (208,), QType.IQ2_XXS: (0,),
}  # fmt: skip


def random_blocks(
    shape: tuple[int, int],
    qtype: QType,
    rng: np.random.Generator,
    std: float = 0.05,
    signed: bool = False,
) -> np.ndarray:
    """Valid blocks of qtype, uint8 [rows, bytes per row], whose values have about this std
    (every value is linear in the f16 fields, so they are scaled to it). signed: each f16
    field of either sign (as the kernels' tests want), not only positive."""
    qtype = QType(qtype)
    rows, cols = shape
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)

    def set_scales(scale: float) -> None:
        for offset in F16_FIELDS[qtype]:
            field = rng.uniform(0.5, 1.0, (rows, cols // elems)) * scale
            if signed:
                field *= rng.choice([-1, 1], field.shape)
            blocks[..., offset : offset + 2] = (
                field.astype(np.float16).view(np.uint8).reshape(rows, cols // elems, 2)
            )

    set_scales(1.0)
    values = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    set_scales(std / max(float(values.std()), 1e-12))
    return blocks.reshape(rows, -1)


def add_tensor(
    writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: QType, rng: np.random.Generator
) -> None:
    if qtype == QType.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == QType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        try:
            blocks = gguf.quants.quantize(w, qtype)
        except NotImplementedError:  # the `gguf` package cannot quantize K-quants
            blocks = random_blocks(w.shape, qtype, rng)
        writer.add_tensor(name, blocks, raw_dtype=qtype)


def add_byte_level_tokenizer(
    writer: gguf.GGUFWriter, ckpt: Path, pre: str, pad_to: int | None = None
) -> None:
    """pad_to: the token list padded with unused `[PAD{i}]` tokens to this many, as llama.cpp's
    converter pads it to the embedding's rows (llama.cpp refuses a file whose token count and
    embedding rows differ)."""
    spec = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((ckpt / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    vocab |= {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in special else 1 for t in tokens]
    padding = range(len(tokens), pad_to or len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in padding])
    writer.add_token_types(types + [5] * len(padding))
    writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(config["add_bos_token"])
    writer.add_chat_template(config["chat_template"])


def split_gpt_oss_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's converter: gate_up_proj [experts, in, 2 * out] (gate the even columns, up the
    odd) into stacked gate and up [experts, out, in], down_proj transposed alike."""
    out = {}
    for name, w in tensors.items():
        base, _, fused = name.rpartition(".")
        if fused == "gate_up_proj":
            out[f"{base}.gate_proj.weight"] = w[..., ::2].transpose(0, 2, 1)
            out[f"{base}.up_proj.weight"] = w[..., 1::2].transpose(0, 2, 1)
        elif fused == "gate_up_proj_bias":
            out[f"{base}.gate_proj.bias"] = w[..., ::2]
            out[f"{base}.up_proj.bias"] = w[..., 1::2]
        elif fused == "down_proj":
            out[f"{base}.down_proj.weight"] = w.transpose(0, 2, 1)
        elif fused == "down_proj_bias":
            out[f"{base}.down_proj.bias"] = w
        else:
            out[name] = w
    return out


def write_gguf(
    ckpt: Path,
    out: Path,
    qtype: QType = QType.F32,
    pre: str = "gpt-2",
    drop: Iterable[str] = (),
    mix: dict[str, QType] | None = None,
    pad_vocab: bool = False,
) -> Path:
    """Write checkpoint `ckpt` as GGUF file `out`, 2-D weights in `qtype`, without `drop`.
    mix: the type of the tensors whose GGUF name contains a key (e.g. {"attn_v": Q6_K}), as a
    Q4_K_M file gives some tensors more bits. pad_vocab: the token list padded to the
    config's vocab_size (see add_byte_level_tokenizer), so that llama.cpp loads the file."""
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = gguf_architecture(cfg["architectures"][0])
    family = family_of(cfg["architectures"][0])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    if arch in ("gemma2", "gemma3"):  # llama.cpp's loader knows the rest (local rope, pattern)
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_vocab_size(cfg["vocab_size"])
    if num_experts := cfg.get("num_experts") or cfg.get("num_local_experts"):
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gpt-oss":
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif scaling.get("rope_type", "default") != "default":
        raise ValueError(f"this writer does not write rope scaling {scaling}")
    add_byte_level_tokenizer(writer, ckpt, pre, cfg["vocab_size"] if pad_vocab else None)

    drop = set(drop)
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}  # stacked by llama.cpp into one 3-D tensor
    # float32 numpy: a bf16 checkpoint (the bench model's) has no numpy dtype
    checkpoint = {k: v.float().numpy() for k, v in load_file(ckpt / "model.safetensors").items()}
    if arch == "gpt-oss":
        checkpoint = split_gpt_oss_experts(checkpoint)
    for hf_name, w in checkpoint.items():
        name = gguf_name(hf_name, family.GGUF_NAMES)
        if name in drop or (hf_name == "lm_head.weight" and cfg["tie_word_embeddings"]):
            continue
        if arch in ("llama", "smollm3") and ("q_proj" in hf_name or "k_proj" in hf_name):
            w = permute_rope_rows(w, heads if "q_proj" in hf_name else kv_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's (1 + w)
        if expert := common.EXPERT.search(hf_name):
            experts.setdefault(name, {})[int(expert[1])] = w
        else:
            tensors[name] = w
    for name, by_index in experts.items():
        tensors[name] = np.stack([by_index[e] for e in sorted(by_index)])
    for name, w in tensors.items():
        kind = next((t for part, t in (mix or {}).items() if part in name), qtype)
        add_tensor(writer, name, w, kind if w.ndim >= 2 else QType.F32, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
