"""Streaming client for OpenAI-compatible `/v1/completions`: one task per request.

Token timing follows `vllm bench serve`: every streamed chunk that has choices is a token
arrival. A chunk that says how many tokens it carries (`token_ids`, or `logprobs.tokens`)
counts as that many tokens, all stamped with the chunk's arrival time, so ITL gets k-1 zero
gaps for it. Chunks without either count as one token, except a final chunk with empty text
that only carries `finish_reason`. Completion token counts come from `usage` when the server
sends it; the timeline keeps what was observed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from gapless.bench.workloads import BenchRequest, tenant_key

PROGRESS_COMMENT = "prefill_progress"

# Short common words are one token in most BPE vocabularies, so a text prompt of N words is
# close to N tokens; usage reports the exact count.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "was",
    "with",
    "as",
    "at",
    "by",
    "be",
    "this",
    "from",
    "or",
    "an",
    "are",
    "not",
    "but",
    "had",
    "his",
    "they",
    "you",
    "have",
    "one",
    "all",
    "were",
    "her",
    "she",
    "there",
    "can",
    "out",
    "we",
    "which",
    "their",
]


@dataclass
class RequestRecord:
    rid: int
    tag: str
    send_s: float  # all times are seconds since bench start
    prompt_tokens: int
    max_tokens: int
    token_s: list[float] = field(default_factory=list)
    progress: list[tuple[float, int, int]] = field(default_factory=list)  # (t, processed, total)
    completion_tokens: int = 0
    end_s: float | None = None
    error: str | None = None
    cancelled: bool = False
    cancel_phase: str | None = None  # "prefill" (no token yet) or "decode"
    service_class: str | None = None  # the mix workload's, as sent
    tenant: str | None = None
    text: str = ""  # the output, to check that configurations agree
    cached_tokens: int | None = None  # as the server's usage reported them

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    @property
    def prefill_window(self) -> tuple[float, float]:
        """[send, first token]; [send, end] if no token ever came (error or early cancel)."""
        end = self.token_s[0] if self.token_s else (self.end_s or self.send_s)
        return (self.send_s, end)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefill_window"] = list(self.prefill_window)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        d = {k: v for k, v in d.items() if k != "prefill_window"}
        d["progress"] = [tuple(p) for p in d.get("progress", [])]
        return cls(**d)


def parse_sse_line(line: str) -> tuple[str, Any]:
    """Classify one SSE line: ("data", obj), ("done", None), ("progress", (processed, total)),
    ("comment", text) or ("skip", None) for blank lines and other fields."""
    if line.startswith(":"):
        text = line[1:].strip()
        if text.startswith(PROGRESS_COMMENT):
            try:
                info = json.loads(text[len(PROGRESS_COMMENT) :])
                return "progress", (int(info["processed"]), int(info["total"]))
            except (ValueError, KeyError, TypeError):
                return "comment", text
        return "comment", text
    if line.startswith("data:"):
        payload = line[5:].strip()
        if payload == "[DONE]":
            return "done", None
        return "data", json.loads(payload)
    return "skip", None


def tokens_in_chunk(chunk: dict[str, Any]) -> int:
    """How many output tokens a completion chunk delivers (see module docstring)."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0  # usage-only chunk
    choice = choices[0]
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs") or {}
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    if not choice.get("text") and choice.get("finish_reason") is not None:
        return 0
    return 1


def text_prompt(ids: list[int]) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


async def send_request(
    client: httpx.AsyncClient,
    req: BenchRequest,
    *,
    model: str,
    t0: float,
    ignore_eos: bool = True,
    use_text: bool = False,
    temperature: float = 0.0,
) -> RequestRecord:
    """Stream one completion, stamping every event relative to `t0` (a perf_counter value).
    Sampled (temperature > 0) with the request's number as its seed, so runs repeat."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": text_prompt(req.prompt)
        if use_text and isinstance(req.prompt, list)
        else req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature > 0:
        body["seed"] = req.rid
    if req.service_class is not None and req.send_class:
        body["service_class"] = req.service_class
    headers = {} if req.tenant is None else {"Authorization": f"Bearer {tenant_key(req.tenant)}"}
    rec = RequestRecord(req.rid, req.tag, time.perf_counter() - t0, len(req.prompt), req.max_tokens)
    rec.service_class, rec.tenant = req.service_class, req.tenant
    try:
        async with asyncio.timeout(req.cancel_after_s):  # None: never
            await _stream(client, body, headers, req, rec, t0)
    except TimeoutError:
        _mark_cancelled(rec)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end_s = time.perf_counter() - t0
    if rec.completion_tokens == 0:
        rec.completion_tokens = len(rec.token_s)
    return rec


def _mark_cancelled(rec: RequestRecord) -> None:
    rec.cancelled = True
    rec.cancel_phase = "decode" if rec.token_s else "prefill"


async def _stream(
    client: httpx.AsyncClient,
    body: dict,
    headers: dict[str, str],
    req: BenchRequest,
    rec: RequestRecord,
    t0: float,
) -> None:
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            rec.error = f"HTTP {resp.status_code}: {detail}"
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter() - t0
            kind, payload = parse_sse_line(line)
            if kind == "done":
                return
            if kind == "progress":
                rec.progress.append((now, *payload))
            elif kind == "data":
                if "error" in payload:
                    rec.error = str(payload["error"])
                    return
                rec.token_s.extend([now] * tokens_in_chunk(payload))
                if choices := payload.get("choices"):
                    rec.text += choices[0].get("text") or ""
                usage = payload.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    rec.completion_tokens = int(usage["completion_tokens"])
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                if (
                    req.cancel_after_tokens is not None
                    and len(rec.token_s) >= req.cancel_after_tokens
                ):
                    # Leaving the `stream` block closes the connection: the server sees a
                    # disconnect, exactly as when a user closes a chat tab.
                    _mark_cancelled(rec)
                    return


async def run_requests(
    url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    ignore_eos: bool = True,
    use_text: bool = False,
    temperature: float = 0.0,
    timeout_s: float = 600.0,
    show_progress: bool = True,
    desc: str = "requests",
) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival offset, or a follow-up turn its offset after the turn
    before it ended; returns records (by rid) and the duration."""
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), timeout=timeout_s, limits=limits
    ) as client:
        with tqdm(total=len(requests), desc=desc, unit="req", disable=not show_progress) as bar:
            ended = {r.rid: asyncio.Event() for r in requests}

            async def one(req: BenchRequest) -> RequestRecord:
                if req.after is None:
                    await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
                else:
                    await ended[req.after].wait()
                    await asyncio.sleep(req.arrival_s)
                rec = await send_request(
                    client,
                    req,
                    model=model,
                    t0=t0,
                    ignore_eos=ignore_eos,
                    use_text=use_text,
                    temperature=temperature,
                )
                bar.update(1)
                ended[req.rid].set()
                return rec

            records = await asyncio.gather(*(one(r) for r in requests))
    duration = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.rid), duration


# The counters of speculative decoding in our server's /metrics (server/metrics.py).
SPECULATION_COUNTERS = (
    "gapless_speculative_proposed_tokens_total",
    "gapless_speculative_accepted_tokens_total",
)


def speculation_counts(url: str, timeout_s: float = 30.0) -> tuple[float, float] | None:
    """Proposed and accepted speculative tokens so far, from the server's /metrics; None from a
    server that exports neither (another server, or none at all)."""
    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    values = {}
    for line in resp.text.splitlines():
        name, _, value = line.partition(" ")
        if name in SPECULATION_COUNTERS:
            values[name] = float(value)
    if len(values) < len(SPECULATION_COUNTERS):
        return None
    proposed, accepted = (values[name] for name in SPECULATION_COUNTERS)
    return proposed, accepted


def acceptance(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict:
    """The run's speculative tokens, from the counts before and after it: proposed, accepted
    and their ratio (None where unknown, or nothing was proposed)."""
    if before is None or after is None:
        return {}
    proposed, accepted = after[0] - before[0], after[1] - before[1]
    return {
        "speculative_proposed": int(proposed),
        "speculative_acceptance": accepted / proposed if proposed else None,
    }


def served_max_model_len(url: str, model: str, timeout_s: float = 30.0) -> int | None:
    """The context length the server reports for `model` in /v1/models (ours and vLLM give
    `max_model_len`); None if it reports none."""
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return None
    card = next((c for c in cards if c.get("id") == model), None)
    value = None if card is None else card.get("max_model_len")
    return int(value) if value else None
