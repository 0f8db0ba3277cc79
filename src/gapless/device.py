"""Where this process runs, apart from any kernel: its rank's device, the collectives'
backend, and the allocator's settings."""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

__all__ = ["collective_backend", "rank_device", "tune_allocator"]


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


@functools.cache
def tune_allocator() -> None:
    """Stops glibc from returning large freed blocks to the OS; once per process.

    Otherwise every big activation of a long prompt chunk is a fresh mmap that page-faults
    on first touch: elementwise ops on a 4096-token chunk ran ~3x slower here.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)
