"""Where this process runs, apart from any kernel: its rank's device, the collectives'
backend, and the allocator's settings."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

__all__ = ["collective_backend", "prepare_process", "rank_device", "tune_allocator"]


def collective_backend(device: str) -> str:
    """torch.distributed's backend for the step collectives between ranks on this device."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """The device of the local_rank-th rank on a host, its own GPU or the CPU, made this
    process's current device (NCCL needs that)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    return device


# Entries in oneDNN's primitive cache and ideep's, each keyed by an op's shapes: a step's
# token count is a new shape for every linear, and at their default of 1,024 entries the
# caches held ~0.15-0.6 MB per prompt of a new length, for good (the soak test's demo-model
# server grew 420 -> 1,046 MiB in 150 s). 128 hold the hot linears of ~25 batch sizes.
SHAPE_CACHE_ENTRIES = "128"


def prepare_process(threads: int | None) -> None:
    """Sets this process up to run a model: its OpenMP threads (None: torch's default, one
    per core) and its allocator (tune_allocator); before the model loads."""
    if threads:
        torch.set_num_threads(threads)
    tune_allocator()


@functools.cache
def tune_allocator() -> None:
    """Bounds the per-shape op caches, and stops glibc from returning large freed blocks to
    the OS; once per process, before the first oneDNN op (the caches read their sizes then)
    and before the thread that runs the engine allocates (async_engine.engine_thread).

    Without the second, every big activation of a long prompt chunk is a fresh mmap that
    page-faults on first touch: elementwise ops on a 4096-token chunk ran ~3x slower here.
    Resident memory is then a high-water mark: it rises to the largest step's and stays.
    That holds for the main heap only: a thread's own arena is made of 64 MiB heaps that glibc
    shrinks as it frees, whatever the thresholds. With the server's engine on its own thread,
    a 4,096-token prompt page-faulted 250-350k times (0.55 s of system time, the step 3-4%
    slower than the same prompt from the main thread, 23k faults); so every thread allocates
    from the main heap.
    """
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, SHAPE_CACHE_ENTRIES)  # a user's setting wins
    if not sys.platform.startswith("linux"):
        return
    libc = _glibc()
    if libc is None:
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)
    libc.mallopt(m_arena_max, 1)


def release_freed_memory() -> None:
    """Hands the heap's free pages back to the OS, which tune_allocator stops glibc from doing
    on its own: for after a load, whose scratch is freed by then (a GGUF reader's parsed
    fields: ~550 MiB for Gemma 3's 262k-token vocabulary, resident until this)."""
    libc = _glibc() if sys.platform.startswith("linux") else None
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None
