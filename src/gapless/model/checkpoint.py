"""Load a checkpoint in any supported format: a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from gapless.device import release_freed_memory
from gapless.model.config import ModelConfig
from gapless.model.decoder import Decoder
from gapless.model.families import read_config_json
from gapless.model.gguf import is_gguf, load_gguf, read_gguf_config, tensor_sizes
from gapless.model.loader import load_decoder
from gapless.model.parallel import TensorParallel
from gapless.model.pipeline import Stage
from gapless.model.quantize import DEFAULT_INT4_GROUP_SIZE
from gapless.model.tokenizer import Tokenizer


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    parallel: TensorParallel | None = None,
    quantize: str | None = None,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    stage: Stage | None = None,
) -> tuple[Decoder, Tokenizer]:
    """The decoder (this rank's shard of it, with `parallel`; this pipeline stage's part of
    it, with `stage`) and the tokenizer; quantize as load_decoder's."""
    args = (dtype, device, parallel, quantize, group_size, stage)
    if is_gguf(path):
        decoder, tokenizer = load_gguf(path, *args)
    else:
        decoder = load_decoder(path, *args)
        tokenizer = Tokenizer.from_pretrained(path)
    release_freed_memory()
    return decoder, tokenizer


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's configuration alone, without reading its weights."""
    return read_gguf_config(path) if is_gguf(path) else read_config_json(path)


def tensor_bytes(path: str | Path) -> dict[str, int]:
    """Each tensor's bytes as stored, by its name in the file, from the headers alone."""
    if is_gguf(path):
        return tensor_sizes(path)
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = (
        {path / f for f in json.loads(index.read_text())["weight_map"].values()}
        if index.is_file()
        else {path / "model.safetensors"}
    )
    sizes = {}
    for file in files:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[name] = end - start
    return sizes
