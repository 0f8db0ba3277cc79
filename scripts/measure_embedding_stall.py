"""Four decoding streams' longest silence while a long embedding input prefills beside them.

Starts `gapless serve MODEL` (the default model if none is given) in its own process and
streams four greedy completions from threads of this one. Once each stream has 20 tokens, a
third process (curl, so that its client costs land on no process being measured) sends one
intruder, and the streams' gaps are read from when it was sent until its answer came:

- nothing: the streams alone, over as long as the round's embedding was in flight;
- a 4,096-token prompt to /v1/completions (max_tokens 1): it prefills in chunks, so the
  streams' longest gap is a chunk step (4 decode tokens and a prompt chunk in one forward);
- the same 4,096 tokens to /v1/embeddings: the acceptance is that the streams' longest gap
  stays within that chunk step.

    python scripts/measure_embedding_stall.py [MODEL] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

STREAMS = 4
INPUT_TOKENS = 4096
WARM_TOKENS = 20  # each stream's tokens before the intruder is sent
SENTENCE = "The river runs past the old mill, and the miller counts the sacks of grain. "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def long_text(url: str, tokens: int) -> str:
    """Text of exactly `tokens` tokens for this server's tokenizer (whole words)."""
    words = (SENTENCE * (tokens // 8)).split(" ")
    count = httpx.post(f"{url}/tokenize", json={"prompt": " ".join(words)}, timeout=60)
    while count.json()["count"] > tokens:
        words = words[: -max(1, (count.json()["count"] - tokens) // 2)]
        count = httpx.post(f"{url}/tokenize", json={"prompt": " ".join(words)}, timeout=60)
    return " ".join(words)


def stream(url: str, index: int, times: list[float], stop: threading.Event) -> None:
    body = {
        "prompt": f"Story {index}: once upon a time",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        # One token a step, so that each gap is a step (speculation can emit several).
        "speculate": False,
    }
    with (
        httpx.Client(base_url=url, timeout=600) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
            if stop.is_set():
                return  # closing the connection cancels the request


def round_(
    url: str, intruder: tuple[str, Path] | None, window: float
) -> tuple[float, float, float]:
    """The streams' median gap and longest gap while the intruder was in flight (or, with
    none, over `window` seconds); returns (median ms, longest ms, seconds in flight)."""
    times: list[list[float]] = [[] for _ in range(STREAMS)]
    stop = threading.Event()
    threads = [
        threading.Thread(target=stream, args=(url, i, times[i], stop)) for i in range(STREAMS)
    ]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < WARM_TOKENS:
        if not all(t.is_alive() for t in threads):
            raise RuntimeError("a stream ended before its 20th token")
        time.sleep(0.01)
    start = time.perf_counter()
    if intruder is None:
        time.sleep(window)
    else:
        endpoint, body = intruder
        subprocess.run(
            ["curl", "-sf", "-o", "/dev/null", url + endpoint,
             "-H", "content-type: application/json", "--data-binary", f"@{body}"],
            check=True,
        )  # fmt: skip
    end = time.perf_counter()
    time.sleep(0.5)  # a token or two after the end, so a gap spanning it is seen whole
    stop.set()
    for t in threads:
        t.join()
    gaps, longest = [], 0.0
    for ts in times:
        pairs = list(zip(ts, ts[1:], strict=False))
        gaps += [b - a for a, b in pairs]
        longest = max([longest] + [b - a for a, b in pairs if b > start and a < end])
    return statistics.median(gaps) * 1000, longest * 1000, end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint or GGUF (default: the default model)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each case")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [str(Path(sys.executable).with_name("gapless")), "serve"]
    server = subprocess.Popen(
        [*serve, *([args.model] if args.model else []), "--port", str(port),
         "--log-level", "warning"]
    )  # fmt: skip
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        text = long_text(url, INPUT_TOKENS)
        cases = {
            "4,096-token prompt (chunked prefill)": "/v1/completions",
            "4,096-token embedding": "/v1/embeddings",
        }
        with tempfile.TemporaryDirectory() as tmp:
            bodies = iter(range(10**6))

            def intruder(endpoint: str) -> tuple[str, Path]:
                # A new first word each time, so the prefix cache serves none of it.
                n = next(bodies)
                body = Path(tmp) / f"{n}.json"
                if endpoint == "/v1/embeddings":
                    body.write_text(json.dumps({"input": f"{n}. {text}"}))
                else:
                    body.write_text(json.dumps({"prompt": f"{n}. {text}", "max_tokens": 1}))
                return endpoint, body

            # A first round of each pays one-time costs (the first long prefill); not counted.
            for endpoint in cases.values():
                round_(url, intruder(endpoint), 0)
            results: dict[str, list[tuple[float, float, float]]] = {}
            for i in range(args.rounds):
                for name, endpoint in cases.items():
                    results.setdefault(name, []).append(round_(url, intruder(endpoint), 0))
                window = results["4,096-token embedding"][-1][2]
                results.setdefault("nothing", []).append(round_(url, None, window))
                got = {name: f"{runs[-1][1]:.0f} ms" for name, runs in results.items()}
                print(f"round {i + 1}: longest gaps {got}", flush=True)
        for name in ("nothing", *cases):
            runs = results[name]
            longest = ", ".join(f"{r[1]:.0f}" for r in runs)
            print(
                f"{name}: streams' median gap {statistics.median(r[0] for r in runs):.0f} ms; "
                f"longest gap per round {longest} ms (median "
                f"{statistics.median(r[1] for r in runs):.0f}); in flight "
                f"{statistics.median(r[2] for r in runs):.2f} s"
            )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
