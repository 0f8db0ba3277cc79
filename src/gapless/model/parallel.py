"""Tensor parallelism, Megatron-style: which slice of each weight a rank holds, and the two
collectives its forward needs.

q/k/v and gate/up are split by output features (each rank owns whole heads and a slice of
the MLP), o and down by input features: each rank's o and down produce a partial sum of the
full hidden state, and one all-reduce per projection adds them. GGUF blocks are cut as they
are, by whole rows, and by whole blocks of columns where a rank's columns start and end on a
block; a weight whose columns would cut a block is dequantized first. KV heads are split with their
query heads; when there are fewer KV heads than ranks, each rank keeps the one KV head its
query heads read (replicated, as vLLM does). lm_head is split by vocabulary and rank 0
gathers the logits. The embedding and the norms are replicated: they are small and need no
communication. A mixture's experts are each cut as a dense MLP is (every rank holds a slice of
every expert, so routing needs nothing between ranks), and its router is replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # What ProcessGroupGloo and ProcessGroupNCCL are: one backend's collectives for one group.
    from torch._C._distributed_c10d import Backend as Collectives

from gapless.kernels.quant import BlockQuant, GroupQuant
from gapless.model.config import ModelConfig

Weight = torch.Tensor | GroupQuant | BlockQuant


class ShardError(ValueError):
    pass


class RankFailed(RuntimeError):
    """A tensor-parallel step failed: a rank died, hung or erred. The ranks' collectives are
    out of step from then on, so no further step can run."""


def _just_the_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class TensorParallel:
    rank: int
    size: int
    # Called directly, not through torch.distributed's functions, which take only groups
    # registered with its one default group (engine/distributed.py makes these without one).
    steps: Collectives  # the forward's, with the collective timeout
    control: Collectives  # step broadcasts (gloo); workers wait on it while the server idles
    device: str  # this rank's
    # Explains a failed step, naming the rank(s) at fault where the launcher can tell.
    diagnose: Callable[[BaseException], str] = _just_the_error

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.allreduce([x]).wait()  # a sum
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets every rank's vocabulary slice side by side, [R, padded vocab]; the
        other ranks get their own slice back."""
        to_rank_0 = dist.GatherOptions()
        to_rank_0.rootRank = 0
        if self.rank:
            self.steps.gather([], [logits], to_rank_0).wait()
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.steps.gather([parts], [logits], to_rank_0).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, message: object = None) -> object:
        """Rank 0's message, on every rank: its pickle's length, then the pickle."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            length = torch.tensor([data.numel()])
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast([length]).wait()
        if self.rank:
            data = torch.empty(int(length), dtype=torch.uint8)
        self.control.broadcast([data]).wait()
        return message if self.rank == 0 else pickle.loads(data.numpy().tobytes())


def check_shardable(cfg: ModelConfig, size: int) -> None:
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    if heads % size:
        raise ShardError(f"{heads} attention heads do not split over {size} ranks")
    if kv_heads % size and size % kv_heads:
        raise ShardError(
            f"{kv_heads} KV heads neither split over {size} ranks nor divide it (to replicate)"
        )
    if cfg.intermediate_size % size:
        raise ShardError(f"intermediate size {cfg.intermediate_size} does not split over {size}")
    if (experts := getattr(cfg, "moe_intermediate_size", 0)) % size:
        raise ShardError(f"experts' intermediate size {experts} does not split over {size}")


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's view: its heads and MLP slice. vocab_size stays whole, since the decoder
    returns gathered logits; lm_head is always its own tensor (a slice even when tied)."""
    check_shardable(cfg, size)
    experts = getattr(cfg, "moe_intermediate_size", None)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        tie_word_embeddings=False,
        **({} if experts is None else {"moe_intermediate_size": experts // size}),
    )


_EXPERT = re.compile(r"experts\.\d+\.")


def shard_weights(
    cfg: ModelConfig, w: dict[str, Weight], rank: int, size: int, dtype: torch.dtype
) -> dict[str, Weight]:
    """Replaces full weights under Hugging Face names by this rank's slices, in place; a
    quantized weight that cannot be cut as it is is dequantized to dtype first."""
    local = shard_config(cfg, size)
    d = cfg.head_dim
    q_rows = slice(rank * local.num_heads * d, (rank + 1) * local.num_heads * d)
    first_kv = rank * cfg.num_kv_heads // size  # the replicated head when kv heads < ranks
    kv_rows = slice(first_kv * d, (first_kv + local.num_kv_heads) * d)
    inter = local.intermediate_size
    mlp_rows = slice(rank * inter, (rank + 1) * inter)
    expert = getattr(local, "moe_intermediate_size", 0)
    expert_rows = slice(rank * expert, (rank + 1) * expert)
    rows = {
        "self_attn.q_proj": q_rows,
        "self_attn.k_proj": kv_rows,
        "self_attn.v_proj": kv_rows,
        "mlp.gate_proj": mlp_rows,
        "mlp.up_proj": mlp_rows,
        # Experts (Qwen3-MoE's names, Mixtral's), each as a dense MLP is cut.
        "mlp.experts.gate_proj": expert_rows,
        "mlp.experts.up_proj": expert_rows,
        "block_sparse_moe.experts.w1": expert_rows,
        "block_sparse_moe.experts.w3": expert_rows,
    }
    columns = {
        "self_attn.o_proj": q_rows,
        "mlp.down_proj": mlp_rows,
        "mlp.experts.down_proj": expert_rows,
        "block_sparse_moe.experts.w2": expert_rows,
    }
    heads = slice(rank * local.num_heads, (rank + 1) * local.num_heads)
    for name in list(w):
        # model.layers.{i}.{module}.{weight or bias}; every expert's module as one
        module, _, kind = _EXPERT.sub("experts.", name.split(".", 3)[-1]).rpartition(".")
        if module == "self_attn" and kind == "sinks":  # one per query head (gpt-oss)
            w[name] = w[name][heads].clone()  # type: ignore[index]
        elif module in rows:
            w[name] = _rows(w[name], rows[module], dtype)
        elif module in columns and kind == "weight":
            w[name] = _columns(w[name], columns[module], dtype)
        elif module in columns and rank:
            del w[name]  # o's and down's bias: added once, by rank 0
    head = w.pop("lm_head.weight", None)
    head = w["model.embed_tokens.weight"] if head is None else head
    if isinstance(head, GroupQuant):
        head = head.dequantize(dtype)
    vocab_slice = functools.partial(_vocab_slice, rank=rank, size=size)
    w["lm_head.weight"] = (
        head.map_rows(vocab_slice) if isinstance(head, BlockQuant) else vocab_slice(head)
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
