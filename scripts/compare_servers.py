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
token (the bench's TPOT) rather than the median gap: a client starved of CPU reads two tokens
at once, which a gap would count as 0 ms. Requests go through the bench's own client.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from gapless.bench.client import RequestRecord, send_request
from gapless.bench.metrics import tpot, ttft
from gapless.bench.workloads import BenchRequest

PROMPT_TOKENS, STREAM_TOKENS, PREFILL_TOKENS = 64, 48, 1024


async def measure(client: httpx.AsyncClient, kind: str, model: str, vocab: int, seed: int) -> float:
    """One measurement of `kind` on the server `client` talks to, in ms."""
    rng = random.Random(seed)

    async def send(rid: int, prompt_tokens: int, max_tokens: int) -> RequestRecord:
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(prompt_tokens)]
        req = BenchRequest(rid, 0.0, prompt, max_tokens)
        rec = await send_request(client, req, model=model, t0=time.perf_counter())
        if not rec.ok or not rec.token_s:
            raise SystemExit(f"{client.base_url}: {rec.error or 'no token came'}")
        return rec

    if kind == "pf":
        rec = await send(0, PREFILL_TOKENS, 1)
        return ttft(rec.send_s, rec.token_s) * 1e3
    streams = 1 if kind == "b1" else 4
    recs = await asyncio.gather(*(send(i, PROMPT_TOKENS, STREAM_TOKENS) for i in range(streams)))
    return statistics.mean(tpot(r.send_s, r.token_s) for r in recs) * 1e3


async def compare(kind: str, rounds: int, vocab: int, servers: dict[str, tuple[str, str]]) -> None:
    times: dict[str, list[float]] = {name: [] for name in servers}
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per request
    clients = {
        name: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits)
        for name, (port, _) in servers.items()
    }
    for name, (_, model) in servers.items():  # warm-up, with a prompt no round uses
        await measure(clients[name], kind, model, vocab, seed=-1)
    for r in range(rounds):
        for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(await measure(clients[name], kind, servers[name][1], vocab, r))
        print(f"{kind} round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()))
    for client in clients.values():
        await client.aclose()
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
