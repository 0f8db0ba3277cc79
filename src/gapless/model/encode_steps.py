"""An image's encode as resumable work, so that the engine can spread a long encode over steps
(docs/vision.md, "How an encode is cut across steps").

A vision family writes its encode as a generator that yields after each tower block and
returns the embeddings; its first unit of work is the patch embedding with the first block,
its last the merger or projector alone, so an encode of B blocks is B + 1 units. EncodeSteps
runs such a generator k units at a time, the hidden states kept between calls in the
generator's frame. Running it to the end performs the same operations in the same order as an
uncut encode, so the embeddings are equal bit for bit however the work is cut.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from gapless.model.images import PreparedImage

# What a family's encode generator is: it yields between units, and returns the embeddings.
EncodeWork = Generator[None, None, torch.Tensor]


class EncodeSteps:
    """One image's encode, run `advance(k)` units at a time; `embeds` once done."""

    def __init__(self, work: EncodeWork, units: int) -> None:
        self._work = work
        self.units = units
        self.done = 0
        self.embeds: torch.Tensor | None = None

    def advance(self, k: int) -> bool:
        """Runs up to k more units; whether the encode is complete."""
        while k > 0 and self.embeds is None:
            try:
                next(self._work)
            except StopIteration as stop:
                self.embeds = stop.value
            self.done += 1
            k -= 1
        return self.embeds is not None

    def finish(self) -> torch.Tensor:
        """The embeddings, running what is left of the encode."""
        while not self.advance(self.units):
            pass
        assert self.embeds is not None
        return self.embeds


class SteppedEncoder:
    """A vision family's encoder, its encode written once as work (`_encode`, yielding after
    each of its `encode_units` - 1 tower blocks): it is run cut (encode_steps) or whole."""

    @property
    def encode_units(self) -> int:
        """Units of an encode: the tower blocks it runs + 1 (the merger or projector)."""
        raise NotImplementedError

    def _encode(self, image: PreparedImage) -> EncodeWork:
        raise NotImplementedError

    def encode_steps(self, image: PreparedImage) -> EncodeSteps:
        """The image's encode, not yet started."""
        return EncodeSteps(self._encode(image), self.encode_units)

    def encode(self, image: PreparedImage) -> torch.Tensor:
        """[tokens, text hidden]: the image's embeddings at its placeholder tokens, in the
        decoder's dtype."""
        return self.encode_steps(image).finish()
