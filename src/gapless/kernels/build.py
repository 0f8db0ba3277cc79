"""Loading our C++ kernels: the build the install compiled for this CPU's instruction-set
level (setup.py, extensions.py), checked against its sources' digest. Where the install
could not compile it, or its sources changed since, it is compiled now, once, and cached
under ~/.cache/gapless/kernels; where that fails too, the caller's torch path runs."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from pathlib import Path
from types import ModuleType

import platformdirs

from gapless.kernels.extensions import LEVELS, PACKAGE, Extension
from gapless.kernels.machine import machine

log = logging.getLogger("gapless.kernels")


def cpu_level() -> str:
    """The highest level (extensions.LEVELS) whose instruction sets this CPU all has."""
    have = set(machine().cpu_isa)
    return [level for level, isa in LEVELS.items() if set(isa) <= have][-1]


def installed(ext: Extension, level: str) -> Path | None:
    """The file of its build for `level` that the install left, where there is one and its
    digest says it was built from the sources as they are now; else None, logged. Loads
    nothing (a CPU without the level's instructions may not run its initializers)."""
    spec = importlib.util.find_spec(f"{PACKAGE}.{ext.module(level)}")
    if spec is None or spec.origin is None:
        log.warning("kernels: %s for %s was not compiled at install", ext.name, level)
        return None
    digest = Path(spec.origin).with_name(f"{ext.module(level)}.digest")
    if not digest.is_file() or digest.read_text() != ext.digest(level):
        log.warning("kernels: the installed %s for %s is older than its sources", ext.name, level)
        return None
    return Path(spec.origin)


def prebuilt(ext: Extension, level: str) -> ModuleType | None:
    """Its build for `level` as the install left it, or None (see `installed`)."""
    if installed(ext, level) is None:
        return None
    return importlib.import_module(f"{PACKAGE}.{ext.module(level)}")


def cache_directory(ext: Extension, level: str) -> Path:
    """Where a build on first use of `ext` for `level` is compiled and cached."""
    return Path(platformdirs.user_cache_dir("gapless")) / "kernels" / f"gapless_{ext.module(level)}"


def load(ext: Extension, level: str | None = None) -> ModuleType | None:
    """`ext` built for `level` (None: this CPU's): the install's build, else one compiled
    now, else None (the caller's torch path runs)."""
    level = level or cpu_level()
    return prebuilt(ext, level) or compile_now(ext, level)


def compile_now(ext: Extension, level: str) -> ModuleType | None:
    """`ext` for `level` compiled on first use (a minute or two on 2 cores) and cached, or
    None where it cannot be (no compiler, ninja or headers)."""
    from torch.utils.cpp_extension import load as torch_load

    build_dir = cache_directory(ext, level)
    log.warning(
        "kernels: building %s for %s on first use (1-2 min on 2 cores, unless cached in %s)",
        ext.name,
        level,
        build_dir,
    )
    start = time.monotonic()
    try:
        import fcntl  # POSIX; elsewhere the ImportError below means the torch path runs

        build_dir.mkdir(parents=True, exist_ok=True)
        with (build_dir / "gapless.lock").open("w") as lock:
            # torch's own build lock is a plain file: a process killed mid-build leaves it, and
            # every later load would wait on it forever. Ours is a flock, which dies with its
            # process; whoever holds it knows any torch lock file left is stale.
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            module = torch_load(
                name=build_dir.name,
                sources=[str(s) for s in ext.source_paths()],
                extra_cflags=ext.compile_flags(level),
                build_directory=str(build_dir),
            )
    except Exception as e:  # noqa: BLE001 - a compiler, ninja or headers missing, in many forms
        log.warning("kernels: %s for %s not built (%s); using the torch paths", ext.name, level, e)
        return None
    log.warning("kernels: %s for %s ready in %.0f s", ext.name, level, time.monotonic() - start)
    return module
