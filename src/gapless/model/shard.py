"""Cutting a checkpoint's weights for one tensor-parallel rank, before any linear is built:
each module as its family's SHARD_ROWS and SHARD_COLUMNS say (families/common.py), the
vocabulary by rows. (parallel.py runs the ranks; shard_config cuts the config alike.)"""

from __future__ import annotations

import functools

import torch

from gapless.kernels.quant import BlockQuant, GroupQuant
from gapless.model.config import ModelConfig
from gapless.model.families import family_of
from gapless.model.families.common import EXPERT
from gapless.model.parallel import shard_config

Weight = torch.Tensor | GroupQuant | BlockQuant


def shard_weights(
    cfg: ModelConfig,
    w: dict[str, Weight],
    rank: int,
    size: int,
    dtype: torch.dtype,
    head: bool = True,
) -> dict[str, Weight]:
    """Replaces full weights under Hugging Face names by this rank's slices, in place, as the
    family's SHARD_ROWS and SHARD_COLUMNS say (families/common.py); a quantized weight that
    cannot be cut as it is is dequantized to dtype first. head: this rank holds lm_head (not
    so in a pipeline stage before the last)."""
    family = family_of(cfg.architecture)
    local = shard_config(cfg, size)
    d = cfg.head_dim
    first_kv = rank * cfg.num_kv_heads // size  # the replicated head when kv heads < ranks
    inter, expert = local.intermediate_size, getattr(local, "moe_intermediate_size", 0)
    cuts = {
        "q": slice(rank * local.num_heads * d, (rank + 1) * local.num_heads * d),
        "kv": slice(first_kv * d, (first_kv + local.num_kv_heads) * d),
        "mlp": slice(rank * inter, (rank + 1) * inter),
        "expert": slice(rank * expert, (rank + 1) * expert),
        "heads": slice(rank * local.num_heads, (rank + 1) * local.num_heads),
    }
    for name in list(w):
        # model.layers.{i}.{module}.{weight or bias}; every expert's module as one
        inner = EXPERT.sub("experts.", name.split(".", 3)[-1])
        module, _, kind = inner.rpartition(".")
        if family.SHARD_ROWS.get(inner) == "heads":  # a parameter, one per query head
            w[name] = w[name][cuts["heads"]].clone()  # type: ignore[index]
        elif module in family.SHARD_ROWS:
            w[name] = _rows(w[name], cuts[family.SHARD_ROWS[module]], dtype)
        elif module in family.SHARD_COLUMNS and kind == "weight":
            w[name] = _columns(w[name], cuts[family.SHARD_COLUMNS[module]], dtype)
        elif module in family.SHARD_COLUMNS and rank:
            del w[name]  # o's and down's bias: added once, by rank 0
    if not head:
        return w
    lm_head = w.pop("lm_head.weight", None)
    lm_head = w["model.embed_tokens.weight"] if lm_head is None else lm_head
    if isinstance(lm_head, GroupQuant):
        lm_head = lm_head.dequantize(dtype)
    vocab_slice = functools.partial(_vocab_slice, rank=rank, size=size)
    w["lm_head.weight"] = (
        lm_head.map_rows(vocab_slice) if isinstance(lm_head, BlockQuant) else vocab_slice(lm_head)
    )
    return w


def _rows(weight: Weight, rows: slice, dtype: torch.dtype) -> Weight:
    if isinstance(weight, BlockQuant):
        return weight.map_rows(lambda t: t[rows].clone())
    if isinstance(weight, GroupQuant):
        weight = weight.dequantize(dtype)
    return weight[rows].clone()


def _columns(weight: Weight, columns: slice, dtype: torch.dtype) -> torch.Tensor | BlockQuant:
    if isinstance(weight, BlockQuant):
        try:
            return weight.column_slice(columns)
        except ValueError:
            weight = weight.dequantize(dtype)
    if isinstance(weight, GroupQuant):
        weight = weight.dequantize(dtype)
    return weight[:, columns].contiguous()


def _vocab_slice(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows rank * n .. (rank + 1) * n of the vocabulary, n = ceil(vocab / size); the last
    slice is padded with zero rows (zero blocks: their scales are 0) so that every rank
    gathers the same shape."""
    n = -(-weight.shape[0] // size)
    rows = weight[rank * n : (rank + 1) * n]
    if len(rows) == n:
        return rows.clone()
    return torch.cat((rows, rows.new_zeros(n - len(rows), weight.shape[1])))
