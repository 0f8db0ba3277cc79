"""A mixture of experts' feed-forward, run grouped by expert over all the tokens of a step.

Each token is routed to k experts (the family decides which, and their weights). The step's
(token, expert) pairs are sorted by expert, so that each expert that any token chose runs
once, as one linear call over all of its rows, and the weighted outputs are added back to
their tokens. A decode batch calls each chosen expert once; a 512-token prompt chunk calls
each of, say, 128 experts once over its ~32 rows, never once per token.

The experts are linears like any other (kernels/linear.py): GGUF blocks stay blocks, on the
same block kernels. Each expert's gate and up projections are one linear (their rows
stacked): with 128 experts of a few hundred rows each, a decode's cost is in the number of
calls and short reads as much as in the bytes; with gate and up apart, 8 such experts
(Qwen3-30B-A3B's at half width, bf16) decoded a token 1.2-1.9x slower here. For the same
reason the chosen experts' linears run in one parallel region, each on one thread
(`run_each`), not each as a parallel region of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gapless.kernels import blocks, step_ops
from gapless.kernels.linear import Linear, PackedLinear

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def run_each(linears: list[Linear], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """linears[i](inputs[i]) for each i: in one parallel region, each on one thread, where
    every weight is oneDNN-packed on the CPU (expert_ops.cpp says why), else one by one."""
    if all(isinstance(linear, PackedLinear) for linear in linears) and step_ops.switched_on():
        weights = [linear.weight for linear in linears]
        biases = [linear.bias for linear in linears]
        return blocks.extension().packed_linears(inputs, weights, biases)  # type: ignore[union-attr]
    return [linear(x) for linear, x in zip(linears, inputs, strict=True)]


class Experts:
    """Gated MLPs, expert e computing down[e](glu(gate, up)) where gate and up are the two
    halves of gate_up[e](x); glu is SwiGLU unless a family says otherwise."""

    def __init__(self, gate_up: list[Linear], down: list[Linear], glu: Glu = swiglu) -> None:
        self.gate_up, self.down, self.glu = gate_up, down, glu

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden]; experts [T, k], each token's chosen experts; weights [T, k], what
        each one's output counts. Returns the weighted sums [T, hidden]."""
        k = experts.shape[1]
        chosen = experts.flatten()
        if x.shape[0] == 1:  # a lone decode: nothing to sort
            ids, rows = chosen.tolist(), [x] * k
        else:
            order = chosen.argsort(stable=True)
            tokens = order // k  # the token of each pair, pairs grouped by expert
            # One host sync per layer: the expert loop needs each expert's row count.
            counts = torch.bincount(chosen, minlength=len(self.down)).tolist()
            ids = [e for e, n in enumerate(counts) if n]
            rows = list(x[tokens].split([counts[e] for e in ids]))
        gate_up = torch.cat(run_each([self.gate_up[e] for e in ids], rows))
        half = gate_up.shape[-1] // 2
        hidden = self.glu(gate_up[:, :half], gate_up[:, half:]).split([len(r) for r in rows])
        out = torch.cat(run_each([self.down[e] for e in ids], list(hidden)))
        if x.shape[0] == 1:
            return (out * weights.view(k, 1).to(x.dtype)).sum(0, keepdim=True)
        weighted = out * weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, weighted)
