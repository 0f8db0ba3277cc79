"""Chained hashes of full prompt blocks: equal hashes mean equal whole prefixes. A block's
tokens are ids, or for an image's rows (its content key, the offset into the image)
(Request.hash_tokens).

A hash is the first 8 bytes of BLAKE2b over the parent's hash and the block's tokens, as an
unsigned 64-bit integer: the same in every process and on every machine (Python's own hash
of a string is salted per process), so that the disk tier (kv/disk.py) and another server
sharing its directory find a block by it.

A sequence on a LoRA adapter computes other K/V from the same tokens: its chain starts from
its adapter's root (adapter_root) instead of 0, so that no block is shared across adapters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def block_hashes(
    token_ids: Sequence[int | tuple[str, int]], block_size: int, parent: int = 0
) -> list[int]:
    """Hash of each full block, chained through its parent so it identifies the whole prefix."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = repr(tuple(token_ids[start : start + block_size])).encode()
        digest = hashlib.blake2b(parent.to_bytes(8, "little") + block, digest_size=8).digest()
        parent = int.from_bytes(digest, "little")
        hashes.append(parent)
    return hashes


def adapter_root(adapter: str | None) -> int:
    """The hash a chain of blocks computed on this LoRA adapter starts from (0: the base
    model's)."""
    if adapter is None:
        return 0
    digest = hashlib.blake2b(b"lora adapter " + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
