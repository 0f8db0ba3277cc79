"""Compiles our C++ kernels at install: every extension of kernels/extensions.py, once for each
instruction-set level the run-time choice may pick on x86-64, so that no machine compiles
at first use. Everything else about the package is in pyproject.toml.

An extension that does not compile (no compiler, no Python headers) is reported and left
out: the install goes on, and gapless then builds it on first use or runs torch's ops
(kernels/build.py). The test suite fails where a compiler exists and a build is missing.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
# Loaded by path: gapless itself is not importable before it is installed.
_spec = importlib.util.spec_from_file_location(
    "gapless_extensions", ROOT / "src" / "gapless" / "kernels" / "extensions.py"
)
extensions = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = extensions  # dataclasses look their module up
_spec.loader.exec_module(extensions)


def _kernel_builds() -> tuple[list, dict]:
    """setuptools' extensions, and the build command that compiles them."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # a build without torch: nothing to compile against
        return [], {}

    class BuildKernels(BuildExtension):
        """torch's extension build, each build in its own directory under build/ (so a
        re-install recompiles only what changed), and beside each its sources' digest, which
        build.py checks before it trusts a build. A build that fails is left out of the
        install, and so are all where torch finds no working compiler."""

        def build_extensions(self) -> None:
            self.built: set[str] = set()
            try:
                super().build_extensions()
            except Exception as e:  # noqa: BLE001 - no compiler: torch's check refuses it
                print(f"gapless: compiled no kernels ({e})", file=sys.stderr)
            # What setuptools copies and installs after the build: only what was built.
            self.extensions = [ext for ext in self.extensions if ext.name in self.built]

        def build_extension(self, ext) -> None:  # noqa: ANN001 - setuptools' Extension
            self.build_temp = str(ROOT / "build" / "kernels" / ext.name.rsplit(".", 1)[-1])
            start = time.monotonic()
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - a compiler or headers missing, in many forms
                print(f"gapless: could not compile {ext.name} ({e}); left out", file=sys.stderr)
                return
            self.built.add(ext.name)
            module = ext.name.rsplit(".", 1)[-1]
            where = [Path(self.get_ext_fullpath(ext.name)).parent]
            if self.editable_mode:  # the build is copied into the source tree; so is this
                build_py = self.get_finalized_command("build_py")
                where.append(Path(build_py.get_package_dir(extensions.PACKAGE)))
            for folder in where:
                (folder / f"{module}.digest").write_text(ext.digest)
            print(f"gapless: compiled {ext.name} in {time.monotonic() - start:.0f} s")

    modules = []
    for spec in extensions.EXTENSIONS:
        for module, level in spec.builds().items():
            ext = CppExtension(
                f"{extensions.PACKAGE}.{module}",
                [str(p.relative_to(ROOT)) for p in spec.source_paths()],
                # No debug info (Python's own flags ask for it): a third less compile time.
                extra_compile_args=[*spec.compile_flags(level), "-g0"],
                extra_link_args=["-fopenmp"],
            )
            ext.digest = spec.digest(level)
            modules.append(ext)
    return modules, {"build_ext": BuildKernels}


ext_modules, cmdclass = _kernel_builds()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
