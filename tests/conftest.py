"""Shared fixtures: the test tokenizer and tiny checkpoints, built once per session, and the
clients (HTTP and each dialect's own) of whichever `server` the requesting module runs."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

# Make tests/checkpoints.py importable as `checkpoints` from every test module.
sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint, write_test_tokenizer  # noqa: E402
from helpers import WITHOUT_KERNELS  # noqa: E402
from server_fixture import RunningServer  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Every cache the tests and the servers they start write (a kernel built on first use,
    the demo model) goes to one temporary folder for the run, never the user's."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="gapless-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ["XDG_CACHE_HOME"], ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if WITHOUT_KERNELS:
        terminalreporter.write_line(
            "GAPLESS_TEST_WITHOUT_KERNELS=1: tests of our C++ kernels skipped where they did"
            " not build; their fast paths were not tested",
            yellow=True,
            bold=True,
        )


@pytest.fixture(scope="session")
def test_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json + tokenizer_config.json of the shared ~512-token test tokenizer."""
    return write_test_tokenizer(tmp_path_factory.mktemp("test-tokenizer"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `checkpoint("qwen2", max_shard_size="60KB")` -> checkpoint directory.

    Arguments are those of checkpoints.make_checkpoint; each distinct call is built once.
    """
    built: dict[str, Path] = {}

    def get(arch: str, **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            out_dir = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[key] = make_checkpoint(out_dir, arch, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="module")
def llama_dir(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="session")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: `vlm("gemma3")` -> a tiny vision-language checkpoint (test_vision.CHECKPOINTS
    names them) with the test tokenizer; each built once."""
    from test_vision import CHECKPOINTS

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            path = CHECKPOINTS[name](tmp_path_factory.mktemp(name))
            write_test_tokenizer(path)
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gapless-demo checkpoint, built in a temp cache so tests never touch the user's."""
    from gapless.model.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo-cache"))


# GAPLESS_TEST_KV_CACHE_DTYPE=int8 (or float16, bfloat16, float32) runs every engine the
# tests build with --kv-cache-dtype auto on that KV cache type instead: int8 only where the
# model's head size allows it (a multiple of 32), auto elsewhere. For running the engine's
# tests (prefix cache, sliding windows, speculation, tensor parallelism, images) on each type.
KV_CACHE_DTYPE = os.environ.get("GAPLESS_TEST_KV_CACHE_DTYPE")


@pytest.fixture(autouse=True)
def kv_cache_dtype_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from gapless.kernels import Kernels

    if KV_CACHE_DTYPE is None:
        return
    resolve = Kernels.kv_cache_dtype

    def overridden(self: Kernels, name: str, head_dim: int) -> Any:
        if name == "auto" and (KV_CACHE_DTYPE != "int8" or head_dim % 32 == 0):
            name = KV_CACHE_DTYPE
        return resolve(self, name, head_dim)

    monkeypatch.setattr(Kernels, "kv_cache_dtype", overridden)


@pytest.fixture(params=["auto", "fallback"])
def kernels_choice(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on the kernels the probe picks, and again on the public-op fallbacks."""
    monkeypatch.setenv("GAPLESS_KERNELS", request.param)
    return request.param


@pytest.fixture
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture
def llama(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url)
