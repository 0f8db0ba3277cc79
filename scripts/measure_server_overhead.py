"""A long prompt's time to its one output token through `gapless serve` (HTTP) and through
LLM.generate in this process, alternating request by request, and each side's engine-step
time around it (the server's from /metrics): issue 37's server-over-engine ratio.

    .venv/bin/python scripts/measure_server_overhead.py [--tokens 4096] [--rounds 4]

Default model, prefix cache off, `--speculate none`; the server is started once and kept
running beside this process's engine; both warm up on a 512-token prompt first.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import httpx

from gapless import LLM, SamplingParams
from gapless.model.default_model import installed_default_model

PORT = 8232


def step_seconds(client: httpx.Client) -> float:
    text = client.get(f"http://127.0.0.1:{PORT}/metrics").text
    return float(re.search(r"^gapless_step_time_seconds_sum (\S+)", text, re.M).group(1))


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
    try:
        with httpx.Client(timeout=600) as client:
            url = f"http://127.0.0.1:{PORT}/v1/completions"
            client.post(url, json={**body, "prompt": prompts[1][:512]}).raise_for_status()
            for r in range(args.rounds):
                before, start = step_seconds(client), time.perf_counter()
                client.post(url, json={**body, "prompt": prompts[2 + 2 * r]}).raise_for_status()
                walls["server"].append(time.perf_counter() - start)
                steps["server"].append(step_seconds(client) - before)
                before, start = llm.engine.metrics.step_time.sum, time.perf_counter()
                llm.generate([prompts[3 + 2 * r]], params)
                walls["engine"].append(time.perf_counter() - start)
                steps["engine"].append(llm.engine.metrics.step_time.sum - before)
    finally:
        server.terminate()
        server.wait(30)
    for side in walls:
        print(
            f"{side}: wall {[round(t, 2) for t in walls[side]]} s, median "
            f"{statistics.median(walls[side]):.2f}; steps {[round(t, 2) for t in steps[side]]} s"
        )
    ratio = statistics.median(walls["server"]) / statistics.median(walls["engine"])
    print(f"server/engine (median wall): {ratio:.3f}")


if __name__ == "__main__":
    main()
