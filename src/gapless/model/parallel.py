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
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # What ProcessGroupGloo and ProcessGroupNCCL are: one backend's collectives for one group.
    from torch._C._distributed_c10d import Backend as Collectives

from gapless.model.config import ModelConfig


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
    # Pipeline and tensor parallelism both: the tensor-parallel group of this rank's stage
    # (ranks s * T ... s * T + T - 1 of this group are stage s's), whose all-reduces and
    # gathers its layers run on. None: no stage is split.
    within_stage: TensorParallel | None = None

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
            self.post(message)()
            return message
        length = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast([length]).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self.control.broadcast([data]).wait()
        return pickle.loads(data.numpy().tobytes())

    def post(self, message: object) -> Callable[[], None]:
        """Rank 0: starts broadcasting the message and returns at once, with what waits until
        every rank has it. A pipeline's rank 0 goes on with its stage of the next step while
        the later stages still run the one before, which take the message when they are done
        with it (gloo runs the broadcast on its own threads, in order)."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        length = torch.tensor([data.numel()])
        works = [self.control.broadcast([length]), self.control.broadcast([data])]

        def wait() -> None:
            for work in works:
                work.wait()

        return wait


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
