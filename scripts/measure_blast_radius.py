"""A bystander stream's longest silence while one hostile request is handled.

Starts `gapless serve MODEL` in its own process, streams a greedy completion from this one,
and, 20 tokens in, sends one hostile body from a third process (curl), so the client costs
of the hostile request land on no process that is being measured. Prints, per case, the
bystander's median inter-token gap and its longest gap after the hostile request was sent.

    python scripts/measure_blast_radius.py [MODEL]
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HOSTILE = {
    "top_k 1e20": {"prompt": "def add(a, b):", "max_tokens": 4, "top_k": 10**20},
    "15.7 MB prompt": {"prompt": "x = 1; " * 2_240_000},
    "1M stop strings": {"prompt": "y", "max_tokens": 30, "stop": [f"s{i}" for i in range(10**6)]},
    "lone surrogate": {"prompt": "def f(\ud800):"},
    "300k-message chat": {"messages": [{"role": "user", "content": "hi"}] * 300_000},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bystander(url: str, hostile: Path | None, endpoint: str) -> tuple[float, float, str]:
    body = {
        "prompt": "import os\n",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    times: list[float] = []
    attack = None
    with (
        httpx.Client(base_url=url, timeout=300) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            times.append(time.perf_counter())
            if len(times) == 20 and hostile is not None:
                attack = subprocess.Popen(
                    ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", url + endpoint,
                     "-H", "content-type: application/json", "--data-binary", f"@{hostile}"],
                    stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
    status = attack.communicate()[0] if attack else "-"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) * 1000, max(gaps[18:]) * 1000, status


def main() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = sys.argv[1:2]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("gapless")), "serve", *model, "--port", str(port),
         "--log-level", "warning"]
    )  # fmt: skip
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            median, longest, _ = bystander(url, None, "")
            print(f"alone: median gap {median:.1f} ms, longest {longest:.1f} ms")
            for name, payload in HOSTILE.items():
                path = Path(tmp) / "body.json"
                path.write_text(json.dumps(payload))
                endpoint = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
                median, longest, status = bystander(url, path, endpoint)
                print(
                    f"{name}: HTTP {status}; bystander median gap {median:.1f} ms, "
                    f"longest {longest:.1f} ms"
                )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
