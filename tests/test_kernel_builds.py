"""Our C++ kernels as the install leaves them (setup.py, kernels/extensions.py): every build
of every extension compiled, the one this CPU runs chosen without a compiler, and the probe
choosing our kernels here. Each build's products are checked where the CPU runs it, in
test_block_kernels.py and test_kernels.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import require_our_kernels

from gapless import kernels
from gapless.kernels import blocks, build, paged, probe
from gapless.kernels.extensions import EXTENSIONS, GGUF_BLOCKS, LEVELS, PACKAGE, PAGED_ATTENTION
from gapless.kernels.machine import Machine, machine

CPU = torch.device("cpu")
BUILDS = [
    pytest.param(ext, level, id=module)
    for ext in EXTENSIONS
    for module, level in ext.builds().items()
]


@pytest.mark.parametrize(("ext", "level"), BUILDS)
def test_every_build_of_every_extension_was_compiled_at_install(ext, level):
    """On any x86-64 CPU, every level's build, whether this CPU runs it or not."""
    path = build.installed(ext, level)
    require_our_kernels(path is not None, f"{ext.module(level)}, compiled at install")
    assert path.stat().st_size > 0


def test_the_probe_chooses_our_kernels_on_this_machine():
    """The builds for this CPU's level, with no compiler run: GGUF blocks, step ops and paged
    decodes in float32 (over f16 and int8 caches too); where the CPU multiplies bf16 fast,
    attention in bf16, and prompt chunks on our kernel too."""
    level = build.cpu_level()
    require_our_kernels(blocks.extension() is not None, "our GGUF block kernels")
    require_our_kernels(paged.extension() is not None, "our paged attention kernel")
    assert blocks.extension().__name__ == f"{PACKAGE}.{GGUF_BLOCKS.module(level)}"
    assert paged.extension().__name__ == f"{PACKAGE}.{PAGED_ATTENTION.module(level)}"
    chosen = kernels.select(CPU, torch.float32, quantized=True)
    assert chosen.gguf_blocks and chosen.paged_decode and probe.step_ops_work()
    assert all(probe.paged_decode_works(torch.float32, c) for c in (torch.float16, torch.uint8))
    if machine().fast_cpu_bf16 and probe.packed_linear_works(torch.bfloat16):
        assert chosen.reduced_dtype == torch.bfloat16
        assert kernels.select(CPU, torch.bfloat16).paged_decode
        # Prompt chunks on our kernel where its build has bf16 dot products or AMX tiles.
        assert chosen.paged_prefill == ("avx512-bf16" in LEVELS[level])
        assert chosen.attention_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("isa", "level"),
    [
        ((), "portable"),
        (("avx2",), "avx2"),
        (("avx2", "avx-vnni"), "avx-vnni"),  # an Intel core without AVX-512
        (("avx2", "avx512"), "avx512"),
        (("avx2", "avx512", "avx512-bf16"), "avx512"),  # bf16 without VNNI: no level has it
        (("avx2", "avx512", "avx512-vnni"), "avx512-vnni"),
        (("avx2", "avx512", "avx512-vnni", "avx512-bf16"), "avx512-bf16"),
        (("avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx"), "amx"),
        (("avx2", "avx-vnni", "avx512", "avx512-vnni", "avx512-bf16", "amx"), "amx"),
    ],
)
def test_a_cpu_runs_the_highest_level_it_has_every_instruction_of(monkeypatch, isa, level):
    monkeypatch.setattr(build, "machine", lambda: Machine("cpu", isa, "DEFAULT", None))
    assert build.cpu_level() == level


@pytest.mark.parametrize("level", ["portable", "avx2"])
def test_gapless_kernels_set_to_a_level_runs_the_cpu_as_one_of_that_level(level):
    """What a benchmark of an AVX2 machine's paths on a larger CPU relies on: the CPU's flags
    capped to the level's (F16C kept), our builds for it, and what follows from the flags:
    float32 compute, and a float16 KV cache where the CPU has F16C."""
    if missing := set(LEVELS[level]) - set(machine().cpu_isa):
        pytest.skip(f"this CPU lacks {sorted(missing)}: no cap can give it them")
    code = f"""
import torch
from gapless import kernels
from gapless.kernels import blocks, build
from gapless.kernels.extensions import GGUF_BLOCKS, LEVELS
from gapless.kernels.machine import machine
assert set(machine().cpu_isa) <= {{*LEVELS[{level!r}], "f16c"}}, machine().cpu_isa
assert build.cpu_level() == {level!r}
assert blocks.extension().__name__.endswith(GGUF_BLOCKS.module({level!r}))
chosen = kernels.select(torch.device("cpu"), torch.float32, quantized=True)
assert chosen.reduced_dtype is None and chosen.attention_dtype == torch.float32
narrow = torch.float16 if "f16c" in machine().cpu_isa else torch.float32
assert chosen.kv_cache_dtype("auto", 64) == narrow
"""
    require_our_kernels(
        blocks.extension(level) is not None, f"the {level} build of our block kernels"
    )
    env = {**os.environ, "GAPLESS_KERNELS": level}
    subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=True)


def test_a_build_older_than_its_sources_is_not_used(caplog):
    """Sources edited after the install (here: other flags) make its build stale: it is not
    loaded, and the log says so."""
    level = build.cpu_level()
    edited = replace(PAGED_ATTENTION, cflags=(*PAGED_ATTENTION.cflags, "-DEDITED"))
    with caplog.at_level(logging.WARNING, "gapless.kernels"):
        assert build.prebuilt(edited, level) is None
    assert "older than its sources" in caplog.text
    missing = replace(PAGED_ATTENTION, name="never_built")
    with caplog.at_level(logging.WARNING, "gapless.kernels"):
        assert build.prebuilt(missing, level) is None
    assert "never_built for" in caplog.text and "was not compiled at install" in caplog.text


def test_a_first_use_build_compiles_and_a_killed_ones_lock_does_not_hang_it():
    """The fallback for an install that could not compile: built now, and cached. torch's
    build lock is a plain file, which a killed build leaves behind; a later build must not
    wait on it forever."""
    level = "portable"
    stale = build.cache_directory(PAGED_ATTENTION, level) / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.touch()
    code = (
        "from gapless.kernels import build, extensions;"
        f"m = build.compile_now(extensions.PAGED_ATTENTION, {level!r});"
        "assert m is not None and hasattr(m, 'paged_attention')"
    )
    subprocess.run([sys.executable, "-c", code], timeout=240, check=True)
    assert not stale.exists()
