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

from gapless.kernels import DTYPES, Kernels, resolve_dtype, select
from gapless.kernels.quant import GroupQuant
from gapless.model.config import ModelConfig
from gapless.model.decoder import Decoder
from gapless.model.families import family_of, read_config_json
from gapless.model.parallel import TensorParallel, shard_config
from gapless.model.pipeline import Stage
from gapless.model.quantize import DEFAULT_INT4_GROUP_SIZE, Quantizer, quantizer
from gapless.model.shard import shard_weights
from gapless.model.weights import Weight, Weights


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
    """Every tensor of the checkpoint, by Hugging Face name, as its family declares them."""
    return family_of(cfg.architecture).tensor_shapes(cfg)


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
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    tied = cfg.tie_word_embeddings
    return read_weights(path, expected_shapes(cfg), tied, dtype, device, keep=keep)


def read_weights(
    path: Path,
    expected: dict[str, tuple[int, ...]],
    tied: bool,
    dtype: torch.dtype,
    device: torch.device,
    rename: Callable[[str], str] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, exactly those expected, by name. rename: a stored name -> the
    name expected (a vision-language checkpoint nests its language model's); keep: which of
    them to read (a pipeline stage's), all checked."""
    files = _tensor_files(path)
    stored = {rename(name) if rename else name: name for name in files}
    # Checkpoints may carry buffers we recompute, or an lm_head copy of tied embeddings.
    ignorable = {n for n in stored if n.endswith("rotary_emb.inv_freq")}
    if tied:
        ignorable.add("lm_head.weight")
    check_names(set(expected), set(stored) - ignorable, path)

    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in (n for n in expected if keep is None or keep(n)):
        by_file.setdefault(files[stored[name]], []).append(name)
    bar = tqdm(
        total=sum(map(len, by_file.values())), desc="loading weights", unit="tensor", delay=1.0
    )
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                shape = tuple(f.get_slice(stored[name]).get_shape())
                check_shape(name, shape, expected[name])
                weights[name] = f.get_tensor(stored[name]).to(device=device, dtype=dtype)
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
    stage: Stage | None = None,
) -> Decoder:
    """quantize: None, "int8" or "int4" (with group_size): the linears' weights (lm_head
    too), quantized round-to-nearest at load; embeddings and norms stay in dtype. With
    `stage`, only that pipeline stage's tensors are read."""
    path = Path(path)
    quantizer(quantize, group_size)  # a bad choice fails before the weights are read
    cfg = read_config_json(path)
    dev = torch.device(device)
    quantized = quantize is not None
    dt = resolve_dtype(dtype, dev, quantized, None if quantized else stored_dtype(cfg.torch_dtype))
    kernels = select(dev, dt, quantized, exact_kv=not quantized)
    weights = load_weights(path, cfg, dt, dev, stage.keeps if stage is not None else None)
    quantize_fn = quantizer(quantize, group_size, kernels.gguf_blocks)
    return build_decoder(cfg, weights, kernels, quantize_fn, parallel, stage)


def stored_dtype(torch_dtype: str | None) -> torch.dtype:
    """A checkpoint's own dtype from its config.json's torch_dtype: float32 where it names
    none (or one we do not run), as transformers loads it then."""
    return DTYPES.get(torch_dtype or "float32", torch.float32)


def build_decoder(
    cfg: ModelConfig,
    w: dict[str, Weight],
    kernels: Kernels,
    quantize: Quantizer | None = None,
    parallel: TensorParallel | None = None,
    stage: Stage | None = None,
) -> Decoder:
    """A Decoder from checked weights under Hugging Face names (the dict is consumed).

    Weights already quantized (from a GGUF file) run as they are; quantize, if given, turns
    the float weights of the linears into quantized ones. With `parallel`, of this rank's
    shard, cut before any linear is built (shard.shard_weights). With `stage`, of that
    pipeline stage's tensors (Stage.keeps), its layers built alone; the decoder keeps the
    whole model's config.
    """
    family = family_of(cfg.architecture)
    build_cfg = cfg
    if stage is not None:
        w = stage.local_weights(w)  # type: ignore[assignment]
        build_cfg = stage.config(cfg)
    if hasattr(family, "split_fused"):
        w = family.split_fused(build_cfg, w)
    if parallel is not None:
        head = stage is None or stage.last
        w = shard_weights(cfg, w, parallel.rank, parallel.size, kernels.dtype, head)
        cfg, build_cfg = shard_config(cfg, parallel.size), shard_config(build_cfg, parallel.size)
    weights = Weights(w, kernels, quantize)
    body = family.build(build_cfg, weights)
    embed = w.pop("model.embed_tokens.weight", None)
    lm_head = classifier = None
    if cfg.num_labels is not None:
        if stage is not None or parallel is not None:
            raise WeightError("a sequence classifier runs on one rank: no tensor or pipeline split")
        classifier = w.pop("score.weight").float()
    elif stage is None or stage.last:
        # A tied lm_head that is quantized gets its own quantized copy of the embeddings.
        lm_head = kernels.lm_head(
            weights.quantized(embed if cfg.tie_word_embeddings else w.pop("lm_head.weight"))
        )
    if stage is not None and not stage.first:
        embed = None
    if isinstance(embed, GroupQuant):  # torch's int ops have no lookup
        embed = embed.dequantize(kernels.dtype)
    if w:
        raise WeightError(f"{family.__name__} left tensor {next(iter(w))} unused")
    return Decoder(
        cfg,
        embed,
        body.layers,
        body.final_norm,
        lm_head,
        kernels,
        parallel,
        body.embed_scale,
        body.logit_softcap,
        stage,
        classifier,
    )
