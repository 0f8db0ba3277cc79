"""The disk tier under the prefix cache (--kv-disk DIR, --kv-disk-gb N): full prompt blocks'
K/V kept in files, so that a restart, another replica, or a prefix evicted from RAM finds
them there instead of computing them again.

What is stored: one file per full block and KV group, named by the block's chain hash
(prefix_cache.py) and the group, holding that group's layers' keys and values for the
block, [layers, 2, block_size, kv_heads, row] in the cache's own storage type, as a
safetensors file whose metadata carries the fingerprint, the hash, the group and a CRC-32 of
the data. Where: DIR/<fingerprint>/, the fingerprint being a digest of everything that makes
K/V valid (the weights, family, dtypes, block size, tokenizer: builder.kv_disk_fingerprint),
so two models or two KV dtypes never read each other's files, and two servers of one model
share them.

Durability: a file is written under a temporary name in the same directory and renamed
(os.replace), so a reader sees a whole file or none, and a crash mid-write leaves only a
temporary file, which nothing reads and eviction removes in its turn. Every read checks
the metadata and the checksum: a truncated, corrupted or foreign file is skipped, counted
and deleted, and its tokens are computed instead. Any failure of the disk (full, read-only,
the directory gone) costs only the tier: it is logged and counted, and requests compute.

Eviction is least recently used by bytes, across every process sharing the directory: a
read touches its file's modification time, and when this process's count of the
directory's bytes passes the cap it rescans the directory and deletes the oldest files down
to 90% of it.

Reads and writes run on this tier's own threads, never the step's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

log = logging.getLogger("gapless.kv")

SUFFIX = ".kv"
# Evicting down to this share of the cap leaves room for a while of writes between scans.
EVICT_TO = 0.9


@dataclass
class DiskStats:
    """The tier's counters (/metrics: gapless_kv_disk_*)."""

    hits: int = 0  # blocks read and checked
    misses: int = 0  # blocks looked up and not found
    bytes_read: int = 0
    bytes_written: int = 0
    skipped: int = 0  # files that failed their checks: computed instead
    evictions: int = 0  # files deleted to stay under the cap
    errors: int = 0  # reads or writes the file system refused


class DiskTier:
    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        fingerprint: str,
        shapes: Sequence[tuple[int, ...]],
        dtype: torch.dtype,
    ) -> None:
        """`shapes`: each KV group's block shape, [layers, 2, block_size, kv_heads, row];
        `dtype`: the cache's storage type."""
        self.dir = Path(root) / fingerprint
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.shapes = [tuple(s) for s in shapes]
        self.dtype = dtype
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._bytes = 0  # of the directory, as of the last scan and this process's writes since
        self._failing: set[str] = set()  # kinds of failure logged already
        self._reads = ThreadPoolExecutor(2, thread_name_prefix="gapless-kv-disk-read")
        self._writes = ThreadPoolExecutor(
            1, thread_name_prefix="gapless-kv-disk-write", initializer=_lowest_priority
        )
        self._queued: set[str] = set()  # names being written by this process
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._failed("open", exc)

    def path(self, block_hash: int, group: int) -> Path:
        return self.dir / f"{block_hash:016x}-{group}{SUFFIX}"

    def holds(self, block_hash: int, group: int) -> bool:
        """Whether a file for this block exists (it is checked when read)."""
        return self.path(block_hash, group).is_file()

    def missed(self, blocks: int) -> None:
        """Counts prompt blocks looked up and not found."""
        with self._lock:
            self.stats.misses += blocks

    # -- writing ------------------------------------------------------------------------------

    def write(self, block_hash: int, group: int, kv: torch.Tensor) -> None:
        """Stores a block's K/V (a tensor the caller gives up), on the writer thread; nothing
        if the file exists or is being written."""
        name = self.path(block_hash, group).name
        with self._lock:
            if name in self._queued:
                return
            self._queued.add(name)
        self._writes.submit(self._write, block_hash, group, kv)

    def _write(self, block_hash: int, group: int, kv: torch.Tensor) -> None:
        path = self.path(block_hash, group)
        try:
            if path.exists():
                return
            data = kv.contiguous()
            metadata = {
                "fingerprint": self.fingerprint,
                "hash": f"{block_hash:016x}",
                "group": str(group),
                "crc32": str(_crc32(data)),
            }
            blob = save_safetensors({"kv": data}, metadata)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                self.dir.mkdir(parents=True, exist_ok=True)  # deleted under us: start again
                tmp.write_bytes(blob)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            with self._lock:
                self.stats.bytes_written += len(blob)
                self._bytes += len(blob)
                over = self._bytes > self.max_bytes
            if over:
                self._evict()
        except OSError as exc:
            self._failed("write", exc)
        finally:
            with self._lock:
                self._queued.discard(path.name)

    def _scan(self) -> list[tuple[float, int, Path]]:
        """The directory's files, oldest first (mtime, bytes, path); resets the byte count.
        Temporary files count by their age too: one a crash left behind soon becomes the
        oldest, while one another process is writing is the newest."""
        files = []
        for entry in os.scandir(self.dir):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # deleted by another process meanwhile
            if entry.name.endswith((SUFFIX, ".tmp")):
                files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        files.sort()
        with self._lock:
            self._bytes = sum(size for _, size, _ in files)
        return files

    def _evict(self) -> None:
        files = self._scan()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= EVICT_TO * self.max_bytes:
                break
            path.unlink(missing_ok=True)  # another process may have evicted it first
            total -= size
            if path.suffix == SUFFIX:
                with self._lock:
                    self.stats.evictions += 1
        with self._lock:
            self._bytes = total

    # -- reading ------------------------------------------------------------------------------

    def read(self, block_hash: int, group: int) -> Future[torch.Tensor | None]:
        """The block's K/V, read and checked on a reader thread; None if it is missing or
        fails a check (then counted, and the file deleted)."""
        return self._reads.submit(self._read, block_hash, group)

    def _read(self, block_hash: int, group: int) -> torch.Tensor | None:
        path = self.path(block_hash, group)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
            return None
        except OSError as exc:
            self._failed("read", exc)
            return None
        try:
            kv = self._check(blob, block_hash, group)
        except (SafetensorError, ValueError, KeyError) as exc:
            with self._lock:
                self.stats.skipped += 1
            log.warning("kv disk: skipped %s (%s); its tokens are computed", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        # Recently used, for every process's eviction (if evicted meanwhile, what was read is
        # whole and checked).
        with contextlib.suppress(OSError):
            os.utime(path)
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += len(blob)
        return kv

    def _check(self, blob: bytes, block_hash: int, group: int) -> torch.Tensor:
        """The file's K/V, if its metadata and checksum say it is this block's."""
        if len(blob) < 8:
            raise ValueError("truncated")
        size = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + size])
        metadata = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(metadata, dict):
            raise ValueError("no metadata")
        expected = {"fingerprint": self.fingerprint, "hash": f"{block_hash:016x}"}
        expected["group"] = str(group)
        if any(metadata.get(k) != v for k, v in expected.items()):
            raise ValueError("another model's or block's file")
        kv = load_safetensors(blob)["kv"]
        if kv.dtype != self.dtype or tuple(kv.shape) != self.shapes[group]:
            raise ValueError(f"a {kv.dtype} block of shape {tuple(kv.shape)}")
        if str(_crc32(kv)) != metadata.get("crc32"):
            raise ValueError("checksum mismatch")
        return kv

    def _failed(self, kind: str, exc: OSError) -> None:
        """Counts a refusal of the file system, and logs the first of each kind."""
        with self._lock:
            self.stats.errors += 1
            first = kind not in self._failing
            self._failing.add(kind)
        if first:
            log.warning(
                "kv disk: %s failed in %s (%s); requests compute instead", kind, self.dir, exc
            )

    def flush(self) -> None:
        """Waits for the writes queued so far."""
        self._writes.submit(lambda: None).result()

    def close(self) -> None:
        """Waits for the writes queued; reads in progress finish."""
        self._writes.shutdown(wait=True)
        self._reads.shutdown(wait=True)


def _lowest_priority() -> None:
    """The writer yields the cores to the step: a write may wait, a token should not. Linux
    sets a thread's nice value by its id; elsewhere this does nothing."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _crc32(data: torch.Tensor) -> int:
    return zlib.crc32(data.contiguous().view(torch.uint8).numpy())
