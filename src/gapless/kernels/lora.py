"""LoRA adapters' products on a step's rows, in the style of Punica's and S-LoRA's batched
kernels: each adapter's rows are gathered, multiplied through its A and B, and added back into
the base product. No weight is ever merged, so one step carries rows of several adapters and
of none, and a step without adapter rows runs exactly the base linears' calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gapless.kernels.linear import Linear


@dataclass
class Adapters:
    """The adapters resident on one decoder, by index, and the rows of the step now running
    on each. Every LoraLinear of the decoder holds this one object; the decoder sets `groups`
    from each step's batch (BatchInput.lora_groups) before its layers run."""

    names: list[str]
    # (adapter index, rows [N]) for each adapter with rows in the step; rows on the base
    # model are in none.
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class LoraProduct:
    """One adapter's low-rank update of one linear: delta = (x @ a.T) @ b.T."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], the adapter's scaling folded in


class LoraLinear:
    """A base linear and the updates of the resident adapters that target it (None where one
    does not), with the base's three calls. A fused linear (q, k and v) gets one product per
    adapter whose b places each part's update in its own output columns."""

    def __init__(
        self, base: Linear, adapters: Adapters, products: list[LoraProduct | None]
    ) -> None:
        self.base = base
        self.adapters = adapters
        self.products = products

    def _present(self) -> list[tuple[LoraProduct, torch.Tensor]]:
        """This step's products on this linear, each with its adapter's rows."""
        products = self.products
        return [(p, rows) for a, rows in self.adapters.groups if (p := products[a]) is not None]

    def _with_updates(
        self, x: torch.Tensor, y: torch.Tensor, present: list[tuple[LoraProduct, torch.Tensor]]
    ) -> torch.Tensor:
        for product, rows in present:
            xs = x.index_select(0, rows).to(product.a.dtype)
            delta = F.linear(F.linear(xs, product.a), product.b)
            y.index_add_(0, rows, delta.to(y.dtype))
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        present = self._present()
        return self._with_updates(x, y, present) if present else y

    # The epilogues come after the update: with adapter rows in the step, the base product is
    # taken without its fused epilogue, which then runs in torch over every row.

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        present = self._present()
        if not present:
            return self.base.silu(x)
        return F.silu(self._with_updates(x, self.base(x), present))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        present = self._present()
        if not present:
            return self.base.times(x, other)
        return self._with_updates(x, self.base(x), present) * other.to(x.dtype)
