"""Start and stop our own server, one configuration at a time, for `bench --compare`."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerError(RuntimeError):
    pass


def parse_configs(items: list[str]) -> dict[str, list[str]]:
    """`['blocking=--no-chunked-prefill', 'chunk512=']` -> {name: [flags...]}, in order."""
    configs: dict[str, list[str]] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f'--compare wants NAME="FLAGS", got {item!r}')
        if name in configs:
            raise ValueError(f"--compare name {name!r} given twice")
        configs[name.strip()] = shlex.split(flags)
    return configs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


class ServerProcess:
    """`gapless serve` on a free loopback port; output goes to `log_path`."""

    def __init__(self, model_dir: Path, flags: list[str], served_name: str, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # Our host/port/name go last so they win over anything in `flags`: the client must
        # know where the server is and what it calls the model.
        self.cmd = [
            sys.executable,
            "-m",
            "gapless.cli",
            "serve",
            str(model_dir),
            *flags,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            served_name,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        # A file, not a pipe: nobody reads the server's output while it runs, and a full pipe
        # would block it.
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"server exited with code {self.proc.returncode} before "
                    f"becoming healthy: {shlex.join(self.cmd)}\n"
                    f"--- server log tail ---\n{_tail(self.log_path)}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerError(
            f"server not healthy after {timeout_s:.0f}s: {shlex.join(self.cmd)}\n"
            f"--- server log tail ---\n{_tail(self.log_path)}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
