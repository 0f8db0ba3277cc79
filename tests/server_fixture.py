"""A real gapless server on a loopback port, in this process, plus SSE helpers for the tests.

The listening socket is bound before the server thread starts, so a client connecting early
waits in the accept backlog instead of failing: no polling for readiness.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.server.app import GaplessServer
from gapless.server.batch_store import BatchStore
from gapless.server.settings import ServerSettings
from gapless.server.tenants import Tenants

MODEL = "tiny-llama"


@dataclass
class RunningServer:
    url: str
    server: GaplessServer
    thread: threading.Thread

    @property
    def engine(self) -> Engine:
        return self.server.state.engine

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {
            name: float(value)
            for name, value in re.findall(r"^(gapless_[a-z_]+) (\S+)$", text, re.MULTILINE)
        }

    def wait_for_metric(self, name: str, want: float, timeout: float = 10) -> None:
        """Polls /metrics (the server's only view of this state) until `name` equals `want`."""
        deadline = time.monotonic() + timeout
        while (value := self.metrics()[name]) != want:
            assert time.monotonic() < deadline, f"{name} is {value}, expected {want}"
            time.sleep(0.02)


@contextmanager
def running_server(
    model_dir: Path,
    settings: ServerSettings | None = None,
    send_buffer: int | None = None,
    tenants: Tenants | None = None,
    warming: Future | None = None,
    batch_store: BatchStore | None = None,
    **engine_fields: Any,
) -> Iterator[RunningServer]:
    """send_buffer: SO_SNDBUF of the listening socket, which its connections inherit (the
    kernel's own buffers then fill sooner for a client that does not read); warming: as
    GaplessServer's, /health is 503 until it is done; batch_store: as GaplessServer's."""
    fields = {"dtype": "float32", "device": "cpu", **engine_fields}
    engine = Engine.from_pretrained(model_dir, EngineConfig.of(**fields))
    settings = settings or ServerSettings(MODEL)
    server = GaplessServer(
        engine,
        settings,
        log_level="warning",
        tenants=tenants,
        warming=warming,
        batch_store=batch_store,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, args=([sock],), name="test-server", daemon=True)
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", server, thread)
    try:
        ready = warming is None or warming.done()
        assert httpx.get(f"{running.url}/health", timeout=60).status_code == (200 if ready else 503)
        yield running
    finally:
        server.shutdown()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


@dataclass
class SSE:
    """One streamed response, parsed: data objects, prefill_progress comments, [DONE]."""

    data: list[dict[str, Any]]
    progress: list[tuple[int, int]]
    done: bool  # the stream ended with `data: [DONE]`

    @property
    def token_chunks(self) -> list[dict[str, Any]]:
        return [
            c for c in self.data if c.get("choices") and c["choices"][0]["finish_reason"] is None
        ]

    @property
    def finish_reason(self) -> str | None:
        finals = [c for c in self.data if c.get("choices") and c["choices"][0]["finish_reason"]]
        return finals[-1]["choices"][0]["finish_reason"] if finals else None

    @property
    def usage(self) -> dict[str, Any] | None:
        return next((c["usage"] for c in self.data if c.get("usage")), None)


class SSEReader:
    """Reads an SSE response line by line, so a test can act mid-stream."""

    def __init__(self, response: httpx.Response) -> None:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        self.lines = response.iter_lines()
        self.sse = SSE([], [], False)

    def next_event(self) -> str:
        """Consumes up to the next non-blank line; returns "data", "progress" or "done"."""
        for line in self.lines:
            if not line:
                continue
            assert not self.sse.done, f"data after [DONE]: {line!r}"
            if line.startswith(": prefill_progress "):
                info = json.loads(line.removeprefix(": prefill_progress "))
                assert set(info) == {"processed", "total"}
                self.sse.progress.append((info["processed"], info["total"]))
                return "progress"
            assert line.startswith("data: "), line
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                self.sse.done = True
                return "done"
            self.sse.data.append(json.loads(payload))
            return "data"
        raise AssertionError("the stream ended without [DONE]")

    def read_until(self, kind: str) -> None:
        while self.next_event() != kind:
            pass

    def read_all(self) -> SSE:
        if not self.sse.done:
            self.read_until("done")
        # Nothing may follow [DONE].
        assert all(not line for line in self.lines)
        return self.sse


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> SSE:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        return SSEReader(response).read_all()
