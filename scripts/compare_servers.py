"""Servers already running, compared by alternating identical requests between them.

    .venv/bin/python scripts/compare_servers.py KIND --rounds N --vocab-size V \
        NAME=PORT:MODEL [NAME=PORT:MODEL ...]

KIND:
- b1: one stream, a 64-token prompt, 48 tokens: its time per output token after the first;
- b4: four such streams at once: their mean time per output token;
- pf: one 1,024-token prompt, 1 token: time to first token.

Each round sends the same fresh prompts (random token ids, seeded by the round) to every
server in turn, in reverse order every other round, each on a fresh connection. On a shared
machine whose speed swings for seconds to minutes, the servers of one round then see the same
phase, and the median of the rounds' ratios (the first server's time over each other's)
carries over where a median of whole runs, one server after another, does not. Time per
token rather than the median gap: a client starved of CPU reads two tokens at once, which a
gap would count as 0 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

PROMPT_TOKENS, STREAM_TOKENS, PREFILL_TOKENS = 64, 48, 1024


async def stream_stamps(
    client: httpx.AsyncClient, port: str, model: str, prompt: list[int], max_tokens: int
) -> list[float]:
    """Seconds from the request to each token's chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    start, stamps = time.perf_counter(), []
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"port {port}: HTTP {resp.status_code}: {(await resp.aread())[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            if choice.get("finish_reason") is None or choice.get("text"):  # not a bare ending
                stamps.append(time.perf_counter() - start)
    return stamps


async def measure(
    client: httpx.AsyncClient, kind: str, port: str, model: str, vocab: int, seed: int
) -> float:
    """One measurement of `kind` on one server, in ms."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, vocab - 1000) for _ in range(n)]

    if kind == "pf":
        return (await stream_stamps(client, port, model, prompt(PREFILL_TOKENS), 1))[0] * 1e3
    prompts = [prompt(PROMPT_TOKENS) for _ in range(1 if kind == "b1" else 4)]
    runs = await asyncio.gather(
        *(stream_stamps(client, port, model, p, STREAM_TOKENS) for p in prompts)
    )
    return statistics.mean((s[-1] - s[0]) / (len(s) - 1) for s in runs) * 1e3


async def compare(kind: str, rounds: int, vocab: int, servers: dict[str, tuple[str, str]]) -> None:
    times: dict[str, list[float]] = {name: [] for name in servers}
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per request
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for port, model in servers.values():  # warm-up, with a prompt no round uses
            await measure(client, kind, port, model, vocab, seed=-1)
        for r in range(rounds):
            for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                port, model = servers[name]
                times[name].append(await measure(client, kind, port, model, vocab, seed=r))
            print(
                f"{kind} round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items())
            )
    print(
        f"{kind} medians (ms): "
        + ", ".join(f"{n} {statistics.median(t):.2f}" for n, t in times.items())
    )
    first, *others = servers
    for name in others:
        ratios = [a / b for a, b in zip(times[first], times[name], strict=True)]
        print(
            f"{kind} {first} / {name}: median of the rounds' ratios {statistics.median(ratios):.2f}"
            f" ({min(ratios):.2f}-{max(ratios):.2f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("kind", choices=("b1", "b4", "pf"))
    p.add_argument("servers", nargs="+", help="NAME=PORT:MODEL, the first the reference")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--vocab-size", type=int, required=True)
    args = p.parse_args()
    servers = {}
    for spec in args.servers:
        name, _, where = spec.partition("=")
        port, _, model = where.partition(":")
        servers[name] = (port, model)
    asyncio.run(compare(args.kind, args.rounds, args.vocab_size, servers))


if __name__ == "__main__":
    main()
