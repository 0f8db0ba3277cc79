"""A long prompt's time to its one output token through `gapless serve` (HTTP) and through
LLM.generate in this process, alternating request by request, and each side's engine-step
time around it (the server's from /metrics), with its minor page faults and system time:
issue 37's server-over-engine ratio.

    .venv/bin/python scripts/measure_server_overhead.py [--tokens 4096] [--rounds 4]

Default model, prefix cache off, `--speculate none`; the server is started once and kept
running beside this process's engine; both warm up on a 512-token prompt first.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gapless import LLM, SamplingParams
from gapless.model.default_model import installed_default_model

PORT = 8232


def step_seconds(client: httpx.Client) -> float:
    text = client.get(f"http://127.0.0.1:{PORT}/metrics").text
    return float(re.search(r"^gapless_step_time_seconds_sum (\S+)", text, re.M).group(1))


def faults_and_system_s(pid: int | None) -> tuple[int, float]:
    """A process's minor page faults and system CPU seconds so far (None: this one)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_minflt, usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def since(before: tuple[int, float], after: tuple[int, float]) -> tuple[int, float]:
    return after[0] - before[0], after[1] - before[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    prompts = [
        [100 + (i * 7 + r * 13) % 40000 for i in range(args.tokens)]
        for r in range(2 * args.rounds + 2)
    ]
    flags = ["--no-prefix-cache", "--speculate", "none"]
    cmd = [sys.executable, "-m", "gapless.cli", "serve", "--port", str(PORT), *flags]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in server.stderr:  # type: ignore[union-attr]
        if "largest step done" in line:
            break
    llm = LLM(str(installed_default_model()), enable_prefix_cache=False, speculate="none")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    body = {"max_tokens": 1, "temperature": 0}
    llm.generate([prompts[0][:512]], params)
    walls: dict[str, list[float]] = {"server": [], "engine": []}
    steps: dict[str, list[float]] = {"server": [], "engine": []}
    kernel: dict[str, list[tuple[int, float]]] = {"server": [], "engine": []}
    try:
        with httpx.Client(timeout=600) as client:
            url = f"http://127.0.0.1:{PORT}/v1/completions"
            client.post(url, json={**body, "prompt": prompts[1][:512]}).raise_for_status()
            for r in range(args.rounds):
                before, start = step_seconds(client), time.perf_counter()
                usage = faults_and_system_s(server.pid)
                client.post(url, json={**body, "prompt": prompts[2 + 2 * r]}).raise_for_status()
                walls["server"].append(time.perf_counter() - start)
                kernel["server"].append(since(usage, faults_and_system_s(server.pid)))
                steps["server"].append(step_seconds(client) - before)
                before, start = llm.engine.metrics.step_time.sum, time.perf_counter()
                usage = faults_and_system_s(None)
                llm.generate([prompts[3 + 2 * r]], params)
                walls["engine"].append(time.perf_counter() - start)
                kernel["engine"].append(since(usage, faults_and_system_s(None)))
                steps["engine"].append(llm.engine.metrics.step_time.sum - before)
    finally:
        server.terminate()
        server.wait(30)
    for side in walls:
        print(
            f"{side}: wall {[round(t, 2) for t in walls[side]]} s, median "
            f"{statistics.median(walls[side]):.2f}; steps {[round(t, 2) for t in steps[side]]} s;"
            f" minor faults {[f for f, _ in kernel[side]]}, system"
            f" {[round(t, 2) for _, t in kernel[side]]} s"
        )
    ratio = statistics.median(walls["server"]) / statistics.median(walls["engine"])
    print(f"server/engine (median wall): {ratio:.3f}")


if __name__ == "__main__":
    main()
