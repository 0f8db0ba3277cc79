"""Mixtral: `MixtralForCausalLM`; GGUF `llama` files with experts (`llama.expert_count`).

Mistral's attention (model/families/llama.py runs it; `sliding_window` where set), and on every
layer Qwen3-MoE's mixture of experts (model/families/qwen3_moe.py) but routed as Mixtral
routes: the top `num_experts_per_tok` router logits, then a softmax over those alone. Each
expert (w1 gate, w3 up, w2 down) has `intermediate_size`.

llama.cpp writes Mixtral as a `llama` file (q/k rows permuted for its rope) whose layers hold
the experts as 3-D tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps); the llama family reads
its metadata and hands a file with experts to this one. Older files with one tensor per expert
(blk.N.ffn_gate.E) are refused as missing the stacked ones.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from gapless.model.decoder import Body
from gapless.model.families import common, llama, qwen3_moe
from gapless.model.families.common import Shapes
from gapless.model.families.qwen3_moe import MoeConfig, MoeNames

if TYPE_CHECKING:
    from gapless.model.weights import Weights

ARCHITECTURES = ("MixtralForCausalLM",)
GGUF_ARCHITECTURES: dict[str, str] = {}  # `llama` files, which llama.gguf_config reads
GGUF_NAMES = common.GGUF_NAMES | {
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.experts.w1": "ffn_gate_exps",
    "block_sparse_moe.experts.w3": "ffn_up_exps",
    "block_sparse_moe.experts.w2": "ffn_down_exps",
}
SHARD_ROWS = common.SHARD_ROWS | {
    "block_sparse_moe.experts.w1": "expert",
    "block_sparse_moe.experts.w3": "expert",
}
SHARD_COLUMNS = common.SHARD_COLUMNS | {"block_sparse_moe.experts.w2": "expert"}
NAMES = MoeNames("block_sparse_moe", "gate", "w1", "w3", "w2")
from_gguf = llama.unpermute_qk


def config(raw: dict) -> MoeConfig:
    # Mistral's attention: no bias, no q/k norms, sliding_window on every layer where set.
    cfg = llama.config(raw, flags=(False, False, True))
    return MoeConfig(
        **vars(cfg),
        num_experts=raw["num_local_experts"],
        experts_per_token=raw["num_experts_per_tok"],
        moe_intermediate_size=cfg.intermediate_size,
        norm_topk_prob=True,  # a softmax over the chosen: their weights sum to 1
        sparse_layers=(True,) * cfg.num_layers,
    )


def tensor_shapes(cfg: MoeConfig) -> Shapes:
    return qwen3_moe.tensor_shapes(cfg, NAMES)


def build(cfg: MoeConfig, w: Weights) -> Body:
    route = functools.partial(qwen3_moe.top_k_softmax, k=cfg.experts_per_token)
    return qwen3_moe.build_layers(cfg, w, route, NAMES)
