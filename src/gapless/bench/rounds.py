"""`gapless bench decode`: servers already running (ours, llama-server, vLLM...), compared by
alternating identical requests between them, round by round.

Kinds:
- bN: N streams at once, each a fresh PROMPT-token prompt and STREAM tokens: their mean time
  per output token after the first (the bench's TPOT);
- pf: one fresh PREFILL-token prompt, 1 token: its time to first token.

Each round sends the same fresh prompts (random token ids, seeded by the round) to every
server in turn, in reverse order every other round, each on a fresh connection. On a shared
machine whose speed swings for seconds to minutes, the servers of one round then see the same
phase, so the median of the rounds' ratios (the first server's time over each other's) carries
over where a median of whole runs, one server after another, does not. Time per token rather
than the median gap: a client starved of CPU reads two tokens at once, which a gap would count
as 0 ms.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

from gapless.bench.client import RequestRecord, send_request
from gapless.bench.metrics import tpot, ttft
from gapless.bench.workloads import BenchRequest


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int = 64  # each bN stream's prompt
    stream_tokens: int = 48  # each bN stream's output
    prefill_tokens: int = 1024  # pf's prompt


@dataclass(frozen=True)
class Server:
    url: str
    model: str


def parse_server(text: str) -> tuple[str, Server]:
    """NAME=URL@MODEL; a bare port stands for http://127.0.0.1:PORT, and MODEL defaults to
    NAME (llama-server answers whatever model is named)."""
    name, eq, rest = text.partition("=")
    url, _, model = rest.partition("@")
    if not eq or not name or not url:
        raise ValueError(f"{text!r}: give NAME=URL@MODEL (or NAME=PORT@MODEL)")
    if url.isdigit():
        url = f"http://127.0.0.1:{url}"
    return name, Server(url.rstrip("/"), model or name)


def parse_kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    for kind in kinds:
        if kind != "pf" and not (kind[:1] == "b" and kind[1:].isdigit() and int(kind[1:]) > 0):
            raise ValueError(f"kind {kind!r}: give bN (N streams decoding) or pf")
    return kinds


def batch_size(kind: str) -> int | None:
    """The streams of a bN kind; None for pf."""
    return None if kind == "pf" else int(kind[1:])


async def measure(
    client: httpx.AsyncClient, kind: str, model: str, vocab: int, seed: int, shape: Shape
) -> float:
    """One measurement of `kind` on the server `client` talks to, in ms."""
    rng = random.Random(seed)

    async def send(rid: int, prompt_tokens: int, max_tokens: int) -> RequestRecord:
        prompt = [rng.randrange(min(1000, vocab // 4), vocab - 1) for _ in range(prompt_tokens)]
        req = BenchRequest(rid, 0.0, prompt, max_tokens)
        rec = await send_request(client, req, model=model, t0=time.perf_counter())
        if not rec.ok or not rec.token_s:
            raise RuntimeError(f"{client.base_url}: {rec.error or 'no token came'}")
        return rec

    if kind == "pf":
        rec = await send(0, shape.prefill_tokens, 1)
        return ttft(rec.send_s, rec.token_s) * 1e3
    streams = batch_size(kind) or 1
    recs = await asyncio.gather(
        *(send(i, shape.prompt_tokens, shape.stream_tokens) for i in range(streams))
    )
    return statistics.mean(tpot(r.send_s, r.token_s) for r in recs) * 1e3


async def compare(
    kinds: list[str],
    rounds: int,
    vocab: int,
    servers: dict[str, Server],
    shape: Shape = Shape(),
    timeout_s: float = 600.0,
) -> dict[str, dict[str, list[float]]]:
    """{kind: {server: ms per round}}: every server measured in every round of every kind."""
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per request
    clients = {
        name: httpx.AsyncClient(base_url=s.url, timeout=timeout_s, limits=limits)
        for name, s in servers.items()
    }
    times: dict[str, dict[str, list[float]]] = {}
    try:
        for kind in kinds:
            times[kind] = {name: [] for name in servers}
            for name, s in servers.items():  # warm-up, with a prompt no round uses
                await measure(clients[name], kind, s.model, vocab, -1, shape)
            for r in range(rounds):
                for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                    ms = await measure(clients[name], kind, servers[name].model, vocab, r, shape)
                    times[kind][name].append(ms)
                row = ", ".join(f"{n} {t[-1]:.2f}" for n, t in times[kind].items())
                print(f"{kind} round {r + 1}: {row} ms", file=sys.stderr)
    finally:
        for client in clients.values():
            await client.aclose()
    return times


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Per kind: each server's median ms and, for each server after the first, the median
    (and range) of the rounds' ratios: the first server's time over its."""
    out: dict[str, dict] = {}
    for kind, by_server in times.items():
        first, *others = by_server
        ratios = {}
        for name in others:
            r = [a / b for a, b in zip(by_server[first], by_server[name], strict=True)]
            ratios[name] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        out[kind] = {
            "median_ms": {n: statistics.median(t) for n, t in by_server.items()},
            "reference": first,
            "ratio": ratios,
        }
    return out


def format_rounds_table(summary: dict[str, dict]) -> str:
    """One row per kind: each server's median, and its ratio against the first."""
    names = list(next(iter(summary.values()))["median_ms"]) if summary else []
    lines = [
        "| kind | "
        + " | ".join(f"{n} (ms)" for n in names)
        + " | "
        + " | ".join(f"{n} against {names[0]}" for n in names[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(names) - 1),
    ]
    for kind, s in summary.items():
        cells = [f"{s['median_ms'][n]:.2f}" for n in names]
        cells += [
            f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
            for r in (s["ratio"][n] for n in names[1:])
        ]
        label = "prefill (TTFT)" if kind == "pf" else f"decode batch {batch_size(kind)} (TPOT)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def decode_rates(summary: dict[str, dict]) -> dict[str, dict[int, float]]:
    """{server: {batch size: output tokens/s, all streams together}} from the bN medians."""
    rates: dict[str, dict[int, float]] = {}
    for kind, s in summary.items():
        if (n := batch_size(kind)) is None:
            continue
        for name, ms in s["median_ms"].items():
            rates.setdefault(name, {})[n] = n * 1e3 / ms
    return rates
