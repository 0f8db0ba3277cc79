"""Soak test: drive a gapless server with a seeded mix of traffic and check that it leaks
nothing (memory, file descriptors, threads, KV blocks) and never fails a request.

    python scripts/soak.py --duration 600 --out /tmp/soak --plot -- MODEL --kv-memory 0.5

Everything after `--` goes to `gapless serve`. The script starts the server itself (so it
knows its pid for /proc), pauses the traffic now and then to sample the server idle, stops it
with SIGTERM, and writes samples.csv, summary.json, server.log (and soak.png with --plot) to
--out. Exit status 0 only if every check of the verdict passed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PATHS = {
    "openai.chat": "/v1/chat/completions",
    "openai.completions": "/v1/completions",
    "anthropic.messages": "/v1/messages",
    "ollama.chat": "/api/chat",
    "ollama.generate": "/api/generate",
}
WEIGHTS = (3, 2, 2, 2, 1)  # chat is what most clients send
# Finish reasons of a request that ended properly, in every dialect's words. "cancelled" and
# "error" are not among them: nobody cancels a request here except by disconnecting.
FINISHED = {"stop", "length", "tool_calls", "end_turn", "max_tokens", "stop_sequence", "tool_use"}
# Prompts are made of these (any text will do: only the token count matters).
WORDS = ["the", "a", "server", "token", "stream", "cache", "block", "queue", "river", "stone"]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}}
# What a soak must have sent at least once, however short or slow it is.
COVERAGE = {
    *PATHS,
    *("ok", "bad_request", "disconnect", "stream", "long_prompt", "n>1", "tools", "json_schema"),
}
IDLE_TIMEOUT_S = 60.0  # after the clients have stopped, the server must be idle within this
SERVE = [sys.executable, "-m", "gapless.cli", "serve"]
# oneDNN and ideep (under torch's CPU linears) cache a compiled primitive per input shape, and
# a server's step shapes change with every batch: the caches fill, up to the server's bound
# (gapless.device.SHAPE_CACHE_ENTRIES), about 0.15-0.7 MB an entry. A short run sets a lower
# bound (--shape-cache-entries) so that they are full within its warm-up.
SHAPE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@dataclass
class Plan:
    """One request to send, and what it should get."""

    dialect: str
    body: dict[str, Any] | bytes  # bytes: sent as is (malformed JSON)
    expect: str  # "ok", "bad_request" (a clear 4xx) or "disconnect"
    stream: bool = False
    n: int = 1
    cut_after: int = 0  # disconnect after this many stream lines
    features: list[str] = field(default_factory=list)

    def tags(self) -> set[str]:
        return {self.dialect, self.expect, *self.features}


@dataclass
class Outcome:
    kind: str  # ok, bad_request, disconnect or FAILURE
    dialect: str
    features: list[str]
    detail: str = ""


@dataclass
class Context:
    """What the traffic needs to know about the served model."""

    model: str
    max_model_len: int
    tokens_per_word: float

    def text(self, rng: random.Random, tokens: int) -> str:
        return " ".join(rng.choices(WORDS, k=max(1, int(tokens / self.tokens_per_word))))

    def long_tokens(self, rng: random.Random) -> int:
        # 1,000-3,000 tokens, with room for the template and 64 output tokens in the context.
        most = min(3000, int((self.max_model_len - 64) * 0.85))
        return rng.randint(min(1000, most // 2), most)


def make_plan(rng: random.Random, ctx: Context) -> Plan:
    if rng.random() < 0.08:
        return bad_plan(rng, ctx)
    dialect = rng.choices(list(PATHS), WEIGHTS)[0]
    stream = rng.random() < 0.5
    long = rng.random() < 0.1
    text = ctx.text(rng, ctx.long_tokens(rng) if long else rng.randint(5, 40))
    max_tokens = rng.randint(8, 64)
    plan = Plan(dialect, {}, "ok", stream, features=["long_prompt"] if long else [])
    if stream and rng.random() < 0.25:
        plan.expect, plan.cut_after = "disconnect", rng.randint(1, 4)
    user = [{"role": "user", "content": text}]
    body: dict[str, Any] = {"model": ctx.model, "stream": stream}
    if dialect.startswith("openai"):
        body["max_tokens"] = max_tokens
        body.update({"messages": user} if dialect == "openai.chat" else {"prompt": text})
        if rng.random() < 0.2:
            plan.n = body["n"] = rng.randint(2, 3)
        roll = rng.random()
        if roll < 0.1:
            schema = {"name": "person", "schema": PERSON}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
            plan.features.append("json_schema")
        elif roll < 0.2 and dialect == "openai.chat":
            # A forced call runs under a grammar, so it works whatever the chat template;
            # tool_choice auto would need a template whose call format the server can read.
            function = {"name": "get_weather", "parameters": WEATHER}
            body["tools"] = [{"type": "function", "function": function}]
            body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
            plan.features.append("tools")
    elif dialect == "anthropic.messages":
        body.update(max_tokens=max_tokens, messages=user)
        if rng.random() < 0.15:
            body["tools"] = [{"name": "get_weather", "input_schema": WEATHER}]
            body["tool_choice"] = {"type": "tool", "name": "get_weather"}
            plan.features.append("tools")
    else:
        body["options"] = {"num_predict": max_tokens}
        body.update({"messages": user} if dialect == "ollama.chat" else {"prompt": text})
    plan.body = body
    plan.features += ["stream"] * stream + ["n>1"] * (plan.n > 1)
    return plan


def bad_plan(rng: random.Random, ctx: Context) -> Plan:
    """A request the server must refuse with a 4xx and a JSON error that says why."""
    hi = [{"role": "user", "content": "hi"}]
    dialect, body = rng.choice(
        [
            ("openai.chat", {"messages": "hi"}),  # wrong type
            ("openai.chat", {"messages": hi, "max_tokens": -5}),
            ("openai.completions", {"prompt": "hi", "max_tokens": "ten"}),
            ("openai.chat", {"model": "no-such-model", "messages": hi}),
            ("openai.chat", {"messages": []}),
            ("openai.completions", b'{"prompt": "unfinished'),
            ("anthropic.messages", {"max_tokens": -1, "messages": hi}),
            ("anthropic.messages", {"model": "no-such-model", "max_tokens": 8, "messages": hi}),
            ("anthropic.messages", {"max_tokens": 8, "messages": []}),
            ("anthropic.messages", b"{not json"),
            ("ollama.chat", {"model": "no-such-model", "messages": hi}),
            ("ollama.chat", {"messages": []}),
            ("ollama.generate", {"prompt": 42}),
            ("ollama.chat", b'{"messages": ['),
        ]
    )
    if isinstance(body, dict):  # an error must come back as JSON even when a stream was asked
        body = {**body, "stream": rng.random() < 0.5}
    return Plan(dialect, body, "bad_request", features=["bad_request"])


def run_plan(client: httpx.Client, plan: Plan) -> Outcome:
    """Sends the request and classifies what came back."""
    if isinstance(plan.body, bytes):
        kwargs: dict[str, Any] = {"content": plan.body}
        kwargs["headers"] = {"content-type": "application/json"}
    else:
        kwargs = {"json": plan.body}
    path = PATHS[plan.dialect]
    try:
        if not plan.stream:
            return classify_whole(plan, client.post(path, **kwargs))
        with client.stream("POST", path, **kwargs) as response:
            if response.status_code != 200:
                response.read()
                return classify_whole(plan, response)
            return classify_stream(plan, response)
    except httpx.HTTPError as e:  # a timeout, a refused or reset connection: not our doing
        return _outcome(plan, f"{type(e).__name__}: {e}")
    except (ValueError, LookupError, TypeError, AttributeError) as e:  # a malformed reply
        return _outcome(plan, f"unreadable reply: {type(e).__name__}: {e}")


def _outcome(plan: Plan, problem: str | None, kind: str = "ok") -> Outcome:
    if problem is None:
        return Outcome(kind, plan.dialect, plan.features)
    return Outcome("FAILURE", plan.dialect, plan.features, f"{plan.dialect}: {problem}")


def classify_whole(plan: Plan, response: httpx.Response) -> Outcome:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        return _outcome(plan, f"{status} with a body that is not JSON: {response.text[:200]!r}")
    if plan.expect == "bad_request":
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        if 400 <= status < 500 and isinstance(message, str) and message:
            return _outcome(plan, None, "bad_request")
        return _outcome(plan, f"a bad request got {status} {str(body)[:200]}")
    if status != 200:
        return _outcome(plan, f"{status} {str(body)[:300]}")
    if plan.dialect.startswith("openai"):
        reasons = [c.get("finish_reason") for c in body.get("choices", [])]
        ok = len(reasons) == plan.n and FINISHED.issuperset(reasons)
    elif plan.dialect == "anthropic.messages":
        reasons = [body.get("stop_reason")]
        ok = body.get("type") == "message" and reasons[0] in FINISHED
    else:
        reasons = [body.get("done_reason")]
        ok = body.get("done") is True and reasons[0] in FINISHED
    return _outcome(plan, None if ok else f"ended without a finish reason: {reasons}")


def classify_stream(plan: Plan, response: httpx.Response) -> Outcome:
    """Reads the stream (or part of it, for a deliberate disconnect) and checks its end."""
    finished: dict[int, str] = {}  # choice index -> finish reason
    last: dict[str, Any] = {}
    done = False
    for lines, line in enumerate(response.iter_lines(), 1):
        if plan.expect == "disconnect" and lines > plan.cut_after:
            return _outcome(plan, None, "disconnect")  # leaving `with` closes the connection
        if not line or line.startswith((":", "event:")):
            continue  # SSE blank lines, prefill_progress comments and Anthropic event names
        if done:
            return _outcome(plan, f"data after the end of the stream: {line[:200]!r}")
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
            continue
        last = json.loads(payload)
        if "error" in last:
            return _outcome(plan, f"the stream failed: {payload[:300]}")
        for choice in last.get("choices", []):
            if choice.get("finish_reason"):
                finished[choice["index"]] = choice["finish_reason"]
        if last.get("type") == "message_delta":
            finished[0] = last["delta"].get("stop_reason")
        done = done or last.get("type") == "message_stop" or last.get("done") is True
        if last.get("done") is True:
            finished[0] = last.get("done_reason")
    if plan.expect == "disconnect":  # the stream ended before the cut: it must end well
        plan = Plan(plan.dialect, plan.body, "ok", n=plan.n, features=plan.features)
    ok = done and len(finished) == plan.n and FINISHED.issuperset(finished.values())
    return _outcome(plan, None if ok else f"the stream ended without a finish: {finished} {last}")


class Traffic:
    """Client workers, each a thread with its own seeded random stream, that can be paused."""

    def __init__(self, url: str, ctx: Context, seed: int, workers: int, timeout: float) -> None:
        self.url, self.ctx, self.seed, self.timeout = url, ctx, seed, timeout
        self.outcomes: list[Outcome] = []
        self.seen: set[str] = set()  # COVERAGE tags of requests that ended as they should
        self.cond = threading.Condition()
        self.go = self.stopping = False
        self.parked = 0
        self.threads = [
            threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)
        ]
        for thread in self.threads:
            thread.start()

    def _work(self, index: int) -> None:
        rng = random.Random(f"{self.seed}-{index}")
        while True:
            with self.cond:
                self.parked += 1
                self.cond.wait_for(lambda: self.go or self.stopping)
                self.parked -= 1
            if self.stopping:
                return
            # A client per run of traffic: closing it at a pause closes its keep-alive
            # connections, so the server's idle fd count holds no client sockets.
            with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
                while self.go:
                    outcome = run_plan(client, self._next_plan(rng))
                    self.outcomes.append(outcome)
                    if outcome.kind != "FAILURE":
                        self.seen |= {outcome.dialect, outcome.kind, *outcome.features}

    def _next_plan(self, rng: random.Random) -> Plan:
        """A random plan; until the whole COVERAGE has been seen, one of a missing kind if
        a few draws find one, so that a short or slow soak still sends the whole mix."""
        for _ in range(100):
            plan = make_plan(rng, self.ctx)
            if plan.tags() & (COVERAGE - self.seen) or self.seen >= COVERAGE:
                break
        return plan

    def set_running(self, go: bool) -> None:
        """Starts the traffic, or pauses it: each worker parks once its request has ended."""
        with self.cond:
            self.go = go
            self.cond.notify_all()

    def all_parked(self) -> bool:
        with self.cond:
            return not self.go and self.parked == len(self.threads)

    def stop(self) -> None:
        with self.cond:
            self.go, self.stopping = False, True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join(timeout=self.timeout)


def start_server(
    server_args: list[str], log_path: Path, shape_cache_entries: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Starts `gapless serve` on a free port; returns the process and its URL."""
    command = [*SERVE, *server_args, "--port", "0"]
    env = dict(os.environ)
    if shape_cache_entries is not None:
        env.update(dict.fromkeys(SHAPE_CACHE_VARIABLES, str(shape_cache_entries)))
    with log_path.open("wb") as log:  # a file, not a pipe: nobody has to keep draining it
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600  # the first start builds a kernel
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"Uvicorn running on (http://\S+)", log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log_path}")


def scrape(url: str) -> dict[str, Any]:
    """The /metrics values the soak watches; finished requests by finish reason."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, Any] = {"finished": {}}
    for name, labels, value in re.findall(r"^gapless_(\w+)(\{.*\})? (\S+)$", text, re.M):
        if name == "requests_finished_total":
            values["finished"][re.sub(r'.*"(.*)".*', r"\1", labels)] = int(float(value))
        elif not labels:
            values[name] = float(value)
    return values


def fill_kv_cache(url: str, ctx: Context) -> None:
    """Writes every KV block once before the soak starts. The server reserves its KV cache but
    holds only the pages written (runner._zeroed), and the prefix cache hands out the least
    recently freed blocks first, so until every block has held something, resident memory
    grows with the blocks touched: growth a leak check must not count. A block that has held
    a prompt stays cached, not free, so no free block left means all were written."""
    rng = random.Random(0)
    for _ in range(256):  # a bound, in case the prefix cache is off and blocks return free
        if scrape(url)["kv_blocks_free"] == 0:
            return
        prompt = ctx.text(rng, ctx.long_tokens(rng))
        body = {"model": ctx.model, "prompt": prompt, "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def sample(pid: int, url: str, t: float, idle: bool) -> dict[str, Any]:
    # /proc first: the scrape's own connection is then not among the fds counted.
    status = Path(f"/proc/{pid}/status").read_text()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    m = scrape(url)
    return {
        "t": round(t, 2),
        "idle": idle,
        "rss_mib": int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024,
        "fds": fds,
        "threads": int(re.search(r"Threads:\s+(\d+)", status).group(1)),
        "kv_used": int(m["kv_blocks_used"]),
        "kv_cached": int(m["kv_blocks_cached"]),
        "running": int(m["requests_running"]),
        "waiting": int(m["requests_waiting"]),
        "generation_tokens": int(m["generation_tokens_total"]),
        "finished": " ".join(f"{k}={v}" for k, v in sorted(m["finished"].items())),
    }


def drive(
    args: argparse.Namespace,
    pid: int,
    url: str,
    traffic: Traffic,
    samples: list[dict[str, Any]],
    not_idle: list[float],
) -> None:
    """Runs the traffic for --duration, sampling the server every --sample-every seconds and
    pausing for an idle sample at the end of warm-up, every --idle-every seconds and at the
    end. Appends to samples, and to not_idle the times of pauses that found it busy."""
    start = time.monotonic()
    samples.append(sample(pid, url, 0.0, idle=True))  # before any traffic
    marks = {args.warmup} | {k * args.idle_every for k in range(1, int(args.duration))}
    pauses = sorted(t for t in marks if t < args.duration)
    next_sample, parked_at = args.sample_every, None
    traffic.set_running(True)
    while True:
        now = time.monotonic() - start
        if traffic.go and (now >= args.duration or (pauses and now >= pauses[0])):
            traffic.set_running(False)
        if traffic.all_parked():
            parked_at = now if parked_at is None else parked_at
            m = scrape(url)
            idle = m["requests_running"] + m["requests_waiting"] == 0
            if idle or now - parked_at > IDLE_TIMEOUT_S:
                if not idle:
                    not_idle.append(round(now, 1))
                time.sleep(1.0)  # the clients' closed connections take a moment to close
                now = time.monotonic() - start
                samples.append(sample(pid, url, now, idle=True))
                if now >= args.duration:
                    return
                # A pause that ran past the next mark stands for it.
                pauses, parked_at = [t for t in pauses if t > now], None
                traffic.set_running(True)
                continue
        if now >= next_sample:
            samples.append(sample(pid, url, now, idle=False))
            next_sample = now + args.sample_every
        time.sleep(0.2)


def verdict(
    samples: list[dict[str, Any]],
    outcomes: Counter[str],
    exit_code: int | None,
    not_idle: list[float],
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Each check: {"ok": bool, "detail": str}."""
    idle = [s for s in samples if s["idle"]]
    # Idle samples only: in-flight requests' buffers, KV and Python objects are then not
    # counted as growth. RSS is still a high-water mark (gapless tells glibc to keep what is
    # freed: device.tune_allocator), so the warm-up must have run the largest steps.
    after = [s for s in idle if s["t"] >= args.warmup]
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: bool, detail: str) -> None:
        checks[name] = {"ok": bool(ok), "detail": detail}

    if len(after) < 2:
        check("idle_samples", False, f"{len(after)} idle samples after warm-up; need 2")
    else:
        first, last = after[0], after[-1]
        growth = last["rss_mib"] / first["rss_mib"] - 1
        rss = f"{first['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB ({growth:+.2%})"
        check("rss_growth", growth <= args.max_rss_growth, rss)
        check("fds", last["fds"] <= first["fds"], f"{first['fds']} -> {last['fds']}")
        # Threads may exceed the first count by up to --concurrency without a leak: the server
        # parses requests on anyio's worker threads, a pool that gains a thread whenever more
        # parses overlap than it has idle threads (at most one per client worker) and drops
        # one only when a later call finds it idle for 10 s. A leak grows past that.
        slack = args.concurrency
        threads = f"{first['threads']} -> {last['threads']} (slack {slack})"
        check("threads", last["threads"] <= first["threads"] + slack, threads)
    check("went_idle", not not_idle, f"not idle {IDLE_TIMEOUT_S:.0f} s into pauses at {not_idle}")
    leaks = [(s["t"], s["kv_used"]) for s in idle if s["kv_used"] != 0]
    check("kv_idle", bool(idle) and not leaks, f"{len(idle)} idle samples; used != 0: {leaks}")
    check("no_failures", outcomes["FAILURE"] == 0, f"{outcomes['FAILURE']} failures")
    check("clean_exit", exit_code == 0, f"exit status {exit_code} on SIGTERM")
    return checks


def plot(samples: list[dict[str, Any]], warmup: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    t = [s["t"] for s in samples]
    idle = [s for s in samples if s["idle"]]
    top.plot(t, [s["rss_mib"] for s in samples], label="RSS")
    top.plot([s["t"] for s in idle], [s["rss_mib"] for s in idle], "ro", label="idle")
    top.set_ylabel("resident memory (MiB)")
    for key in ("kv_used", "kv_cached"):
        bottom.plot(t, [s[key] for s in samples], label=key.replace("_", " "))
    bottom.plot([s["t"] for s in idle], [s["kv_used"] for s in idle], "ro", label="idle used")
    bottom.set_ylabel("KV blocks")
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        ax.axvline(warmup, color="grey", linestyle="--")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    own, server_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] [-- gapless serve arguments]",
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="client workers (%(default)s)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds (%(default)s)")
    p.add_argument("--idle-every", type=float, default=60.0, help="seconds (%(default)s)")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds (%(default)s)")
    p.add_argument("--max-rss-growth", type=float, default=0.05, help="fraction (%(default)s)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=180.0,
        help="seconds; a request still unanswered then is a FAILURE (%(default)s)",
    )
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    p.add_argument("--plot", action="store_true", help="write soak.png")
    p.add_argument(
        "--shape-cache-entries",
        type=int,
        help="the server's per-shape op caches hold this many entries (default: its own bound)",
    )
    return p.parse_args(own), server_args


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(server_args, args.out / "server.log", args.shape_cache_entries)
    exit_code: int | None = None
    samples: list[dict[str, Any]] = []
    not_idle: list[float] = []
    crash = ""
    traffic: Traffic | None = None
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        probe = " ".join(WORDS * 20)
        info = httpx.post(f"{url}/tokenize", json={"prompt": probe}, timeout=30).json()
        ctx = Context(model, info["max_model_len"], info["count"] / len(WORDS * 20))
        fill_kv_cache(url, ctx)
        traffic = Traffic(url, ctx, args.seed, args.concurrency, args.request_timeout)
        drive(args, proc.pid, url, traffic, samples, not_idle)
        traffic.stop()
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=90)  # the drain has nothing to wait for
    except subprocess.TimeoutExpired:
        print("the server did not exit within 90 s of SIGTERM", file=sys.stderr)
    except httpx.HTTPError as e:  # /metrics unreachable: the server died or hangs
        crash = f"{type(e).__name__}: {e}; see {args.out / 'server.log'}"
    finally:
        if traffic is not None:
            traffic.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    outcomes = traffic.outcomes if traffic else []
    checks = verdict(samples, Counter(o.kind for o in outcomes), exit_code, not_idle, args)
    checks["server_up"] = {"ok": not crash, "detail": crash or "answered throughout"}
    summary = summarize(checks, outcomes, samples, server_args, args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if samples:
        with (args.out / "samples.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(samples[0]))
            writer.writeheader()
            writer.writerows(samples)
        if args.plot:
            plot(samples, args.warmup, args.out / "soak.png")
    for name, c in checks.items():
        print(f"{'PASS' if c['ok'] else 'FAIL'} {name}: {c['detail']}")
    print(f"{len(outcomes)} requests: {summary['outcomes']}; features {summary['features']}")
    for detail in summary["failures"][:10]:
        print("  FAILURE", detail)
    return 0 if summary["passed"] else 1


def summarize(
    checks: dict[str, dict[str, Any]],
    outcomes: list[Outcome],
    samples: list[dict[str, Any]],
    server_args: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    by_dialect: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        by_dialect[o.dialect][o.kind] += 1
    return {
        "passed": all(c["ok"] for c in checks.values()),
        "checks": checks,
        "requests": len(outcomes),
        "outcomes": dict(Counter(o.kind for o in outcomes)),
        "by_dialect": {d: dict(c) for d, c in sorted(by_dialect.items())},
        "features": dict(Counter(f for o in outcomes if o.kind != "FAILURE" for f in o.features)),
        "failures": [o.detail for o in outcomes if o.kind == "FAILURE"][:50],
        "idle_samples": [s for s in samples if s["idle"]],
        "server_args": server_args,
        "args": {k: str(v) for k, v in vars(args).items()},
    }


if __name__ == "__main__":
    sys.exit(main())
