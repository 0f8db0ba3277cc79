"""Chained hashes of full prompt blocks: equal hashes mean equal whole prefixes. A block's
tokens are ids, or for an image's rows (its content key, the offset into the image)
(Request.hash_tokens)."""

from __future__ import annotations

from collections.abc import Sequence


def block_hashes(
    token_ids: Sequence[int | tuple[str, int]], block_size: int, parent: int = 0
) -> list[int]:
    """Hash of each full block, chained through its parent so it identifies the whole prefix."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes
