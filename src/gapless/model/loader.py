"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a Decoder."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from gapless.device import tune_allocator
from gapless.kernels import Kernels, Linear, resolve_dtype, select
from gapless.kernels.quant import GroupQuant
from gapless.model.config import ModelConfig
from gapless.model.decoder import Decoder, Layer
from gapless.model.parallel import TensorParallel, shard_config, shard_weights
from gapless.model.quantize import DEFAULT_INT4_GROUP_SIZE, quantizer


class WeightError(ValueError):
    pass


def _tensor_files(path: Path) -> dict[str, Path]:
    """Maps each tensor name to the file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise WeightError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    """A safetensors file, memory-mapped; a damaged one (a truncated download) is a
    WeightError naming it."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise WeightError(f"{file} is not a readable safetensors file: {e}") from e


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if cfg.qkv_bias:
            layer |= {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
            }
        if cfg.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            layer |= {
                "mlp.gate_proj.bias": (inter,),
                "mlp.up_proj.bias": (inter,),
                "mlp.down_proj.bias": (h,),
            }
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        shapes |= {p + k: v for k, v in layer.items()}
    return shapes


def check_names(expected: set[str], present: set[str], path: Path) -> None:
    """Loading is strict: a missing or an unknown tensor is an error naming it."""
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing:
        raise WeightError(f"missing tensor {missing[0]} ({len(missing)} missing) in {path}")
    if extra:
        raise WeightError(f"unexpected tensor {extra[0]} ({len(extra)} unexpected) in {path}")


def check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise WeightError(f"tensor {name} has shape {list(shape)}, expected {list(expected)}")


def load_weights(
    path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    files = _tensor_files(path)
    expected = expected_shapes(cfg)
    # Checkpoints may carry buffers we recompute, or an lm_head copy of tied embeddings.
    ignorable = {n for n in files if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        ignorable.add("lm_head.weight")
    check_names(set(expected), set(files) - ignorable, path)

    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    bar = tqdm(total=len(expected), desc="loading weights", unit="tensor", delay=1.0)
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                check_shape(name, tuple(f.get_slice(name).get_shape()), expected[name])
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
                bar.update()
    bar.close()
    return weights


def load_decoder(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    parallel: TensorParallel | None = None,
    quantize: str | None = None,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
) -> Decoder:
    """quantize: None, "int8" or "int4" (with group_size): the linears' weights (lm_head
    too), quantized round-to-nearest at load; embeddings and norms stay in dtype."""
    path = Path(path)
    quantize_fn = quantizer(quantize, group_size)
    cfg = ModelConfig.from_pretrained(path)
    dev = torch.device(device)
    quantized = quantize is not None
    dt = resolve_dtype(dtype, dev, quantized)
    weights = load_weights(path, cfg, dt, dev)
    return build_decoder(cfg, weights, select(dev, dt, quantized), quantize_fn, parallel)


Weight = torch.Tensor | GroupQuant


def build_decoder(
    cfg: ModelConfig,
    w: dict[str, Weight],
    kernels: Kernels,
    quantize: Callable[[torch.Tensor], GroupQuant] | None = None,
    parallel: TensorParallel | None = None,
) -> Decoder:
    """A Decoder from checked weights under Hugging Face names (the dict is consumed).

    Weights already quantized (from a GGUF file) run as they are; quantize, if given, turns
    the float weights of the linears into quantized ones. With `parallel`, of this rank's
    shard, cut before any linear is built; a GGUF file's quantized tensors are dequantized
    first (they are not sharded as they are).
    """
    tune_allocator()
    if parallel is not None:
        w = {
            n: t.dequantize(kernels.dtype) if isinstance(t, GroupQuant) else t for n, t in w.items()
        }
        w = shard_weights(cfg, w, parallel.rank, parallel.size)
        cfg = shard_config(cfg, parallel.size)

    def quantized(weight: Weight) -> Weight:
        if quantize is not None and isinstance(weight, torch.Tensor):
            return quantize(weight)
        return weight

    def linear(weight: Weight, bias: torch.Tensor | None = None) -> Linear:
        return kernels.linear(quantized(weight), bias)

    def cat(*names: str) -> Weight | None:
        if names[0] not in w:
            return None
        parts = [w.pop(n) for n in names]
        if isinstance(parts[0], GroupQuant):
            return GroupQuant.cat(parts)
        return torch.cat(parts)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        layers.append(
            Layer(
                input_norm=w.pop(p + "input_layernorm.weight"),
                qkv=linear(
                    cat(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                    cat(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                ),
                o=linear(w.pop(attn + "o_proj.weight"), w.pop(attn + "o_proj.bias", None)),
                q_norm=w.pop(attn + "q_norm.weight", None),
                k_norm=w.pop(attn + "k_norm.weight", None),
                post_norm=w.pop(p + "post_attention_layernorm.weight"),
                gate=linear(w.pop(mlp + "gate_proj.weight"), w.pop(mlp + "gate_proj.bias", None)),
                up=linear(w.pop(mlp + "up_proj.weight"), w.pop(mlp + "up_proj.bias", None)),
                down=linear(w.pop(mlp + "down_proj.weight"), w.pop(mlp + "down_proj.bias", None)),
            )
        )
    embed = w.pop("model.embed_tokens.weight")
    # A tied lm_head that is quantized gets its own quantized copy of the embeddings.
    lm_head = kernels.lm_head(
        quantized(embed if cfg.tie_word_embeddings else w.pop("lm_head.weight"))
    )
    if isinstance(embed, GroupQuant):
        embed = embed.dequantize(kernels.dtype)
    return Decoder(cfg, embed, layers, w.pop("model.norm.weight"), lm_head, kernels, parallel)
