"""Where a prompt chunk may end around its images, and the encode work it brings.

An image the chunk reaches unencoded is encoded a few units at a time (its tower's blocks,
+ 1 for its projector: model/encode_steps.py), before the step's forward. Each unit is
charged against the budget as the image's encode cost over its units, rounded up (the cost:
`encode_cost`, the cost model's estimate of its time in prompt tokens, which it keeps for a
vision-language model with or without a latency target; its placeholder tokens until it has
timed an encode); the step runs the units the budget leaves after the chunk's text before
the image. The chunk stops before an image whose encode does not complete in the step (a
chunk of 0 tokens only encodes), and takes what the budget leaves once it completes. A chunk
that starts at an image its budget affords no unit of still runs one if it is the step's
first prompt chunk: such a step exceeds the budget by a unit.

An image whose tokens attend to each other both ways (Gemma 3) is never cut by a chunk: its
earlier tokens attend to its later ones, which must be in the same forward. A chunk that
would end inside one ends before it instead; when nothing would be left (the chunk starts at
the image, or inside it after a prefix-cache hit), it runs to the image's end, past the
budget, if it is the step's first prompt chunk, and else waits for the next step. (So the
chunk that reaches such an image once its encode is complete takes all of it.)
"""

from __future__ import annotations

from collections.abc import Callable

from gapless.engine.request import Request


def plan_encodes(
    request: Request,
    n: int,
    budget: int,
    first: bool,
    encode_cost: Callable[[int, int], int] | None,
) -> tuple[int, list[tuple[int, int]], int]:
    """The request's next chunk of at most n tokens beside the encode work of the images it
    reaches unencoded, within `budget` prompt tokens and their charge: (its tokens, the
    (image, units) encoded, their charge). `first`: no other prompt chunk is in the step yet.
    `encode_cost(placeholder tokens, chunk start)`: an encode's charge (None: its placeholder
    tokens)."""
    start = request.num_scheduled
    encodes: list[tuple[int, int]] = []
    charge = 0
    for i, image in enumerate(request.images):
        offset = image.start - start
        if i in request.image_embeds or image.end <= start:
            continue
        if offset >= n:
            break
        cost = image.length if encode_cost is None else encode_cost(image.length, start)
        per_unit = max(1, -(-cost // image.units))
        left = request.encode_units_left(i)
        units = left
        if not request.whole_prefill:
            units = min(left, max(0, budget - max(offset, 0) - charge) // per_unit)
            if not units and offset <= 0 and not encodes and first:
                units = 1  # at the image, a unit past the budget is the only way on
        if units:
            encodes.append((i, units))
            charge += units * per_unit
        if units < left:
            return max(offset, 0), encodes, charge  # the prompt waits for the encode
        if not request.whole_prefill:
            n = min(n, budget - charge)
    return max(n, 0), encodes, charge


def keep_images_whole(request: Request, n: int, extend: bool) -> int:
    """How many of the request's next n tokens to take so that the chunk does not end inside
    an image that attends both ways: fewer, ending before it; or, when that leaves none, to
    its end if `extend`, else none."""
    start = request.num_scheduled
    end = start + n
    for image in request.images:
        if image.bidirectional and image.start < end < image.end:
            if image.start > start:
                return image.start - start
            return image.end - start if extend else 0
    return n
