"""Pipeline parallelism: the model's layers cut into contiguous stages, one rank each.

Stage 0 (rank 0, which also schedules and samples) holds the embeddings, the last stage the
final norm and lm_head; every stage holds its run of layers and the KV cache of those layers
only. A stage loads only its own tensors from the file. In a step, every rank builds the same
batch from rank 0's broadcast inputs (engine/runner.py); then each stage receives the hidden
states of the step's tokens from the one before it, runs its layers and sends them on, and the
last stage sends the logits (and the hidden rows an embedding asks for) back to rank 0. All
of it on the group's step collectives (send and recv), under the collective timeout. With
tensor parallelism too, each stage is `width` ranks that shard its layers (parallel.py), and
each sends to the same shard's rank of the next stage.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from gapless.model.config import ModelConfig
from gapless.model.parallel import ShardError, TensorParallel

# A ModelConfig's fields that hold one value per layer (the families' own included): a
# stage's build sees its layers' values only.
PER_LAYER_FIELDS = ("layer_windows", "sparse_layers", "rope_layers")

_LAYER = re.compile(r"^(?:model\.layers|blk)\.(\d+)\.")
EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass
class Stage:
    """This rank's stage, and the group's collectives (TensorParallel's, whatever the split),
    on which rank r is stage r."""

    ranks: TensorParallel
    stages: tuple[range, ...]  # every stage's layers, of the whole model's
    tied: bool  # lm_head is the embeddings: the last stage holds a copy of them
    # Ranks per stage, each holding a tensor-parallel shard of the stage (ranks.within_stage).
    width: int = 1

    @classmethod
    def of(cls, ranks: TensorParallel, counts: tuple[int, ...], tied: bool) -> Stage:
        """Rank `ranks.rank`'s stage, the stages holding `counts` layers each."""
        ends = list(accumulate(counts))
        stages = tuple(range(e - n, e) for n, e in zip(counts, ends, strict=True))
        return cls(ranks, stages, tied, ranks.size // len(counts))

    @property
    def index(self) -> int:
        return self.ranks.rank // self.width

    @property
    def layers(self) -> range:
        return self.stages[self.index]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == len(self.stages) - 1

    def keeps(self, name: str) -> bool:
        """Whether this stage loads the tensor of this Hugging Face name. Every stage keeps
        the final norm (a vector, which the families' builds take), the last one uses it."""
        if (layer := _LAYER.match(name)) is not None:
            return int(layer[1]) in self.layers
        if name == EMBEDDINGS:
            return self.first or (self.last and self.tied)
        return name == FINAL_NORM or (name == LM_HEAD and self.last)

    def local_weights(self, w: dict[str, object]) -> dict[str, object]:
        """The stage's tensors with its layers numbered from 0, as its build reads them. `w` is
        emptied: the build frees each float tensor once its linear holds a packed copy, which
        it could not while the loader's dict still held them all (the stage's load peaked at
        twice its weights)."""
        first = self.layers.start

        def local(name: str) -> str:
            found = _LAYER.match(name)
            if found is None:
                return name
            return f"model.layers.{int(found[1]) - first}.{name[found.end() :]}"

        return {local(name): w.pop(name) for name in list(w)}

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model's configuration as the stage's layers alone make it up."""
        cut = self.layers
        per_layer = {
            name: getattr(cfg, name)[cut.start : cut.stop]
            for name in PER_LAYER_FIELDS
            if hasattr(cfg, name)
        }
        return dataclasses.replace(cfg, num_layers=len(cut), **per_layer)

    # -- a step's traffic -----------------------------------------------------------------

    def receive_hidden(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """From the same shard's rank of the stage before."""
        x = torch.empty(rows, width, dtype=dtype, device=self.ranks.device)
        self.ranks.steps.recv([x], self.ranks.rank - self.width, 0).wait()
        return x

    def send_hidden(self, x: torch.Tensor) -> Callable[[], object]:
        """Starts sending to the same shard's rank of the next stage; returns what waits for
        the send to complete."""
        return self.ranks.steps.send([x.contiguous()], self.ranks.rank + self.width, 0).wait

    def send_result(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The last stage's logits, and hidden rows if any, to rank 0, from the stage's first
        rank (which gathered the logits of a split stage)."""
        if self.ranks.rank % self.width:
            return
        for t in (logits, hidden):
            if t is not None:
                self.ranks.steps.send([t.contiguous()], 0, 1).wait()

    def receive_result(
        self, logit_rows: int, vocab: int, hidden_rows: int | None, width: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank 0: the last stage's logits of a batch's logit rows, and its hidden rows when
        the batch has some (hidden_rows not None)."""
        last, device = self.ranks.size - self.width, self.ranks.device
        logits = torch.empty(logit_rows, vocab, device=device)
        self.ranks.steps.recv([logits], last, 1).wait()
        if hidden_rows is None:
            return logits, None
        hidden = torch.empty(hidden_rows, width, device=device)
        self.ranks.steps.recv([hidden], last, 1).wait()
        return logits, hidden


# -- where the stages cut the layers ------------------------------------------------------


def layer_counts(
    sizes: dict[str, int], cfg: ModelConfig, stages: int, chosen: str | None = None
) -> tuple[int, ...]:
    """How many layers each stage holds: `chosen` ("10,14"), checked, or a split of the
    layers by their bytes in the file (`sizes`, each tensor's, by its name there), with the embeddings counted to the first stage and
    the final norm and lm_head (a copy of the embeddings when tied) to the last."""
    if chosen is not None:
        return parse_layer_counts(chosen, cfg.num_layers, stages)
    if cfg.num_layers < stages:
        raise ShardError(f"{cfg.num_layers} layers do not split over {stages} pipeline stages")
    per_layer = [0] * cfg.num_layers
    first = last = 0
    for name, size in sizes.items():
        if (layer := _LAYER.match(name)) is not None:
            per_layer[int(layer[1])] += size
        elif name.startswith(("model.embed_tokens", "token_embd")):
            first += size
            last += size if cfg.tie_word_embeddings else 0
        elif name.startswith(("model.", "lm_head", "output")):  # not a vision tower's
            last += size
    return split_by_bytes(per_layer, first, last, stages)


def parse_layer_counts(chosen: str, num_layers: int, stages: int) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in chosen.split(","))
    except ValueError:
        raise ShardError(f"--pipeline-layers {chosen!r} is not a list of integers") from None
    if len(counts) != stages:
        raise ShardError(f"--pipeline-layers {chosen!r} names {len(counts)} stages, not {stages}")
    if min(counts) < 1:
        raise ShardError(f"--pipeline-layers {chosen!r}: every stage needs a layer")
    if sum(counts) != num_layers:
        raise ShardError(
            f"--pipeline-layers {chosen!r} adds up to {sum(counts)}, the model has {num_layers}"
        )
    return counts


def split_by_bytes(per_layer: list[int], first: int, last: int, stages: int) -> tuple[int, ...]:
    """Layer counts, each stage at least one, such that each stage's bytes (the first's plus
    `first`, the last's plus `last`) come as close to an even share as contiguous runs allow:
    each cut is placed where the running total crosses the next share."""
    sizes = per_layer.copy()
    sizes[0] += first
    sizes[-1] += last
    total, n = sum(sizes), len(sizes)
    bounds = [0]
    running = list(accumulate(sizes))
    for k in range(1, stages):
        target = total * k / stages
        lo, hi = bounds[-1] + 1, n - (stages - k)  # each stage keeps at least one layer
        cut = min(range(lo, hi + 1), key=lambda c: abs(running[c - 1] - target))
        bounds.append(cut)
    bounds.append(n)
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
