"""A mixture of experts' feed-forward, run grouped by expert over all the tokens of a step.

Each token is routed to k experts (the family decides which, and their weights). The step's
(token, expert) pairs are sorted by expert, so that each expert that any token chose runs
once, as one linear call over all of its rows, and the weighted outputs are added back to
their tokens. A decode batch calls each chosen expert once; a 512-token prompt chunk calls
each of, say, 128 experts once over its ~32 rows, never once per token.

The experts are linears like any other (kernels/linear.py): GGUF blocks stay blocks, each
expert's rows a view of the file's 3-D tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gapless.kernels.linear import Linear

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Experts:
    """Gated MLPs, expert e computing down[e](glu(gate[e](x), up[e](x))); by default
    glu(g, u) = silu(g) * u, fused into the linears' epilogues where they have them."""

    def __init__(
        self, gate: list[Linear], up: list[Linear], down: list[Linear], glu: Glu | None = None
    ) -> None:
        self.gate, self.up, self.down, self.glu = gate, up, down, glu

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's output for rows h."""
        if self.glu is None:
            return self.down[e](self.up[e].times(h, self.gate[e].silu(h)))
        return self.down[e](self.glu(self.gate[e](h), self.up[e](h)))

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden]; experts [T, k], each token's chosen experts; weights [T, k], what
        each one's output counts. Returns the weighted sums [T, hidden]."""
        k = experts.shape[1]
        chosen = experts.flatten()
        order = chosen.argsort(stable=True)
        tokens = order // k  # the token of each pair, pairs grouped by expert
        rows = x[tokens]
        outs, start = [], 0
        # One host sync per layer: the expert loop needs each expert's row count.
        for e, n in enumerate(torch.bincount(chosen, minlength=len(self.down)).tolist()):
            if n:
                outs.append(self.expert(e, rows[start : start + n]))
                start += n
        weighted = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, weighted)
