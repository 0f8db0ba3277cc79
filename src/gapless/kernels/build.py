"""Building our C++ kernels (csrc/) for this CPU's instruction set on first use, cached
under ~/.cache/gapless/kernels, one build directory per extension and ISA flag set."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import platformdirs

from gapless.kernels.probe import machine

log = logging.getLogger("gapless.kernels")

# gcc flags per ISA the probe reports: the build is cached per flag set, so a cache shared
# by two machines never hands one the other's instructions.
ISA_CFLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512-vnni": ["-mavx512vnni"],
    "avx512-bf16": ["-mavx512bf16"],
}


def native_isa(among: Iterable[str] = ISA_CFLAGS) -> tuple[str, ...]:
    """The ISAs of `among` this CPU has (in the probe's order), which a build may use."""
    wanted = set(among) & ISA_CFLAGS.keys()
    return tuple(name for name in machine().cpu_isa if name in wanted)


def build_directory(name: str, isa: tuple[str, ...] | None = None) -> Path:
    """Where extension `name` built for `isa` (None: this CPU's) is built and cached."""
    isa = native_isa() if isa is None else isa
    module = "_".join([name, *(n.replace("-", "_") for n in isa)])  # a Python module name
    return Path(platformdirs.user_cache_dir("gapless")) / "kernels" / module


def load_extension(
    name: str,
    sources: list[Path],
    isa: tuple[str, ...] | None = None,
    cflags: tuple[str, ...] = ("-O3", "-fopenmp"),
    what: str | None = None,
) -> ModuleType | None:
    """Extension `name` compiled from `sources` with `cflags` and the flags of `isa` (None:
    all this CPU has), or None where it cannot be built (the caller's public path runs).
    `what` names it in the log lines."""
    from torch.utils.cpp_extension import load

    isa = native_isa() if isa is None else isa
    unknown = set(isa) - ISA_CFLAGS.keys()
    if unknown:
        raise ValueError(f"no compiler flags for ISA {sorted(unknown)}")
    flags = [flag for n in isa for flag in ISA_CFLAGS[n]]
    build_dir = build_directory(name, isa)
    what = what or build_dir.name
    log.info("kernels: loading %s (built on first use, ~30 s)", what)
    try:
        import fcntl  # POSIX; elsewhere the ImportError below means the public path runs

        build_dir.mkdir(parents=True, exist_ok=True)
        with (build_dir / "gapless.lock").open("w") as lock:
            # torch's own build lock is a plain file: a process killed mid-build leaves it, and
            # every later load would wait on it forever. Ours is a flock, which dies with its
            # process; whoever holds it knows any torch lock file left is stale.
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return load(
                name=build_dir.name,
                sources=[str(s) for s in sources],
                extra_cflags=[*cflags, *flags],
                build_directory=str(build_dir),
            )
    except Exception as e:  # noqa: BLE001 - a compiler, ninja or headers missing, in many forms
        log.warning("kernels: %s not built (%s); using the torch paths", what, e)
        return None
