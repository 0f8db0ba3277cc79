"""Load a GGUF file (llama.cpp's format) as it is: config, weights and tokenizer from one file.

The file is read with the `gguf` package, llama.cpp's own reader. Quantized tensors stay in
the file's blocks (`BlockQuant`), read once into memory, and run on our block kernels
(kernels/blocks.py) for every type those have. Where the kernels cannot be built (or on
CUDA), Q4_0 and Q4_1 unpack into 4-bit codes for torch's int4 op (`GroupQuant`), and other
types are dequantized to the run dtype at load, with a warning that names the type and what
it costs in memory. A type the `gguf` package cannot dequantize either is an error.
A mixture's experts, stacked by llama.cpp into one 3-D tensor per module, load as one weight
per expert, each a view of that tensor's rows (blocks, codes or floats alike).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from gapless.kernels import Kernels, blocks, resolve_dtype, select
from gapless.kernels.quant import BlockQuant, GroupQuant
from gapless.model.config import ModelConfig
from gapless.model.decoder import Decoder
from gapless.model.families import common, family_of, gguf_family, model_config
from gapless.model.gguf_tokenizer import field_value, tokenizer_from_gguf
from gapless.model.loader import (
    Weight,
    WeightError,
    build_decoder,
    check_names,
    check_shape,
)
from gapless.model.parallel import TensorParallel
from gapless.model.pipeline import Stage
from gapless.model.quantize import DEFAULT_INT4_GROUP_SIZE, quantizer
from gapless.model.tokenizer import Tokenizer

log = logging.getLogger("gapless.model")

# A GGUF file's prompt chunks multiply dense copies of its weights when the copies take at
# most this share of memory: without them a step with any prompt rows dequantizes and packs
# every weight (~45 ms a step on the default model, 2 Zen 4 cores, as much as ~80 prompt
# tokens cost), and with them 512-token chunk steps ran ~20% faster.
PROMPT_COPIES_SHARE = 1 / 8

UNPACKED_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1)
INT4_TYPES = (QType.Q4_0, QType.Q4_1)  # without our block kernels, run on torch's int4 op
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str, names: dict[str, str] = common.GGUF_NAMES) -> str:
    """The GGUF tensor name llama.cpp's converter gives a Hugging Face tensor name, by a
    family's GGUF_NAMES. Every expert's tensor of a module (mlp.experts.{e}.up_proj) has one
    name: llama.cpp stacks them into one 3-D tensor (GGUF_NAMES names mlp.experts.up_proj)."""
    if layer := _LAYER.fullmatch(hf_name):
        inner = common.EXPERT.sub("experts.", layer[2])
        if inner in names:  # a parameter without a module (gpt-oss's sinks): named whole
            return f"blk.{layer[1]}.{names[inner]}"
        module, _, param = inner.rpartition(".")
        return f"blk.{layer[1]}.{names[module]}.{param}"
    module, _, param = hf_name.rpartition(".")
    return f"{names[module]}.{param}"


def unpack(blocks: torch.Tensor, qtype: QType) -> GroupQuant:
    """Unpack the raw blocks of a Q8_0, Q4_0 or Q4_1 tensor, [rows, bytes per row] uint8."""
    rows = blocks.shape[0]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = blocks.view(rows, -1, block_bytes)

    def f16(start: int) -> torch.Tensor:  # a per-block float16 field, as float32
        return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()

    d = f16(0)
    if qtype == QType.Q8_0:
        return GroupQuant(blocks[..., 2:].contiguous().view(torch.int8).view(rows, -1), d, None)
    packed = blocks[..., 4 if qtype == QType.Q4_1 else 2 :]
    # A block's low nibbles hold its first 16 codes, the high nibbles the last 16.
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).view(rows, -1)
    # Q4_0 is d * (q - 8), written as d * q - 8d; both are exact in float32.
    offset = f16(2) if qtype == QType.Q4_1 else -8 * d
    return GroupQuant(codes, d, offset)


def _shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(reversed([int(n) for n in tensor.shape]))  # torch's dim order


def dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 (or its float type), in torch's dim order."""
    qtype = tensor.tensor_type
    shape = _shape(tensor)
    data = torch.from_numpy(tensor.data)
    if qtype in (QType.F32, QType.F16):
        return data.view(shape)
    if qtype == QType.BF16:
        return data.view(torch.bfloat16).view(shape)
    if qtype in UNPACKED_TYPES:
        return unpack(data.view(-1, data.shape[-1]), qtype).dequantize().view(shape)
    try:
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype)).view(shape)
    except NotImplementedError:
        raise WeightError(
            f"tensor {tensor.name} has GGUF type {qtype.name}, which neither our kernels nor "
            "the gguf package's reference can read"
        ) from None


def _weight(tensor: gguf.ReaderTensor, kernels: Kernels) -> torch.Tensor | GroupQuant | BlockQuant:
    """A tensor in the form it runs in (see the module's docstring), in this process's memory:
    nothing still maps the file once the load is done."""
    qtype, dev = tensor.tensor_type, kernels.device
    # [rows, bytes per row]; a 3-D tensor's (experts') rows one after another
    rows = torch.from_numpy(tensor.data).view(-1, tensor.data.shape[-1])
    if qtype in FLOAT_TYPES:
        return dequantize(tensor).to(device=dev, dtype=kernels.dtype, copy=True)
    if kernels.gguf_blocks and blocks.supported(qtype):
        return BlockQuant(rows.to(dev, copy=True), int(qtype), _shape(tensor)[-1])
    if qtype in INT4_TYPES:
        return unpack(rows, qtype).map_rows(lambda t: t.to(dev))
    return dequantize(tensor).to(device=dev, dtype=kernels.dtype)


def _with_prompt_copies(kernels: Kernels, weights: dict[str, Weight]) -> Kernels:
    """The kernels, with prompt chunks on dense copies of the block weights
    (Kernels.gguf_prompt_copies) where all of them, the embedding's too, take at most
    PROMPT_COPIES_SHARE of the memory this process may use."""
    quantized = [w for w in weights.values() if isinstance(w, BlockQuant)]
    if not quantized:
        return kernels
    dtype = kernels.reduced_dtype or kernels.dtype
    size = sum(rows * cols for rows, cols in (w.shape for w in quantized)) * dtype.itemsize
    memory = _memory_limit()
    if size > memory * PROMPT_COPIES_SHARE:
        log.info(
            "GGUF prompt chunks dequantize the weights every step: %s copies (%.0f MB) would"
            " take more than 1/%d of the %.0f MB this process may use",
            dtype,
            size / 1e6,
            round(1 / PROMPT_COPIES_SHARE),
            memory / 1e6,
        )
        return kernels
    return dataclasses.replace(kernels, gguf_prompt_copies=True)


def _memory_limit() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit if lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _experts(w: Weight, n: int) -> list[Weight]:
    """A 3-D tensor of n experts' weights as each expert's [rows, cols]: views, no copy."""
    if isinstance(w, torch.Tensor):
        return list(w.unbind(0))
    per = (w.blocks if isinstance(w, BlockQuant) else w.codes).shape[0] // n
    return [w.map_rows(lambda t, e=e: t[e * per : (e + 1) * per]) for e in range(n)]


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and which tensors it has) describe."""
    arch = field_value(reader, "general.architecture")
    family, hf_arch = gguf_family(arch)

    def meta(key: str, default: object = None) -> object:
        return field_value(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length") or hidden // heads
    rotary = meta("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are unsupported")
    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):  # a family's config refuses what it lacks
        raise ValueError(
            f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear, yarn"
        )
    tokens = reader.get_field("tokenizer.ggml.tokens")
    window = meta("attention.sliding_window")
    # The same keys a config.json has, so that the family's parser reads both; these are the
    # ones every llama.cpp file writes alike, and the family adds its own.
    raw = {
        "architectures": [hf_arch],
        "vocab_size": meta("vocab_size") or len(tokens.data),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta("context_length", 4096),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "rope_scaling": (
            {"rope_type": scaling, "factor": meta("rope.scaling.factor")}
            | (
                {"original_max_position_embeddings": meta("rope.scaling.original_context_length")}
                if scaling == "yarn"
                else {}
            )
            if scaling != "none"
            else None
        ),
        "sliding_window": window,
        "use_sliding_window": window is not None,
        # llama.cpp writes no flags for these: the tensors are there or not.
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_gate.bias" in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
    }
    return model_config(family.gguf_config(raw, meta))


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its file mapping.

    The reader parses metadata as one array slice per value, and an np.memmap slice costs
    several µs in Python: SmolLM2's 49k-token vocabulary took ~5 s to parse, ~2 s this way.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._data = mapped.view(np.ndarray)


def load_gguf(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    parallel: TensorParallel | None = None,
    quantize: str | None = None,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    stage: Stage | None = None,
) -> tuple[Decoder, Tokenizer]:
    """The decoder and tokenizer of a GGUF file. quantize (see load_decoder) applies to the
    weights that are float after load. With `stage`, only that pipeline stage's tensors are
    read."""
    path = Path(path)
    quantizer(quantize, group_size)  # a bad choice fails before the file is read
    # Copy-on-write: tensors view the mapped file without a copy and are never written back.
    reader = _Reader(path, "c")
    cfg = read_config(reader)
    dev = torch.device(device)
    # `auto` runs a file of quantized weights in float32 on CPUs, as it runs any quantized
    # weights: llama.cpp keeps activations in float32, and in bf16 Gemma 3 270M's greedy
    # continuation of "The capital of France is" fell into a loop (" the capital of the
    # country of France. It is the capital of the country ...").
    quantized = quantize is not None or any(
        t.tensor_type not in FLOAT_TYPES for t in reader.tensors
    )
    run_dtype = resolve_dtype(dtype, dev, quantized)
    kernels = select(dev, run_dtype, quantized)
    family = family_of(cfg.architecture)
    # GGUF name -> the Hugging Face tensors it holds: one, or every expert's, in expert order
    expected: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    # Where llama.cpp's converter splits what a checkpoint fuses, the family says the split.
    shapes = getattr(family, "gguf_tensor_shapes", family.tensor_shapes)(cfg)
    for n, shape in shapes.items():
        expected.setdefault(gguf_name(n, family.GGUF_NAMES), []).append((n, shape))
    check_names(set(expected), {t.name for t in reader.tensors}, path)
    weights: dict[str, Weight] = {}
    dequantized: Counter[str] = Counter()  # bytes grown by dequantizing, by type
    for tensor in reader.tensors:
        parts = expected[tensor.name]
        stacked = (len(parts),) if len(parts) > 1 else ()
        check_shape(tensor.name, _shape(tensor), (*stacked, *parts[0][1]))
        if stage is not None and not stage.keeps(parts[0][0]):
            continue
        w = _weight(tensor, kernels)
        if tensor.tensor_type not in FLOAT_TYPES and isinstance(w, torch.Tensor):
            grown = w.numel() * w.element_size() - int(tensor.n_bytes)
            dequantized[tensor.tensor_type.name] += grown
        split = _experts(w, len(parts)) if stacked else [w]
        for (hf_name, _), part in zip(parts, split, strict=True):
            weights[hf_name] = family.from_gguf(cfg, hf_name, part)
    for name, grown in dequantized.items():
        log.warning(
            "GGUF %s weights have no kernel here: dequantized at load, %.0f MB more in memory",
            name,
            grown / 1e6,
        )
    quantize_fn = quantizer(quantize, group_size, kernels.gguf_blocks)
    kernels = _with_prompt_copies(kernels, weights)
    decoder = build_decoder(cfg, weights, kernels, quantize_fn, parallel, stage)
    return decoder, tokenizer_from_gguf(reader)


def read_gguf_config(path: str | Path) -> ModelConfig:
    return read_config(_Reader(path, "r"))


def tensor_sizes(path: str | Path) -> dict[str, int]:
    """Each tensor's bytes in the file, by its llama.cpp name."""
    return {t.name: int(t.n_bytes) for t in _Reader(path, "r").tensors}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def model_name(path: str | Path) -> str:
    """The name a model is served under by default: a directory's name, a file's stem."""
    path = Path(path).resolve()
    return path.stem if is_gguf(path) else path.name
