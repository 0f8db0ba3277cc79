"""The page at / and its feed, GET /v1/live: the feed over httpx and a raw socket (auth, the
summary's format, no text, a viewer that never reads is dropped), and the page in a real
headless browser: Debian's chromium, driven by playwright (no browser download).

The browser test also screenshots the page while a long prompt prefills beside a decoding
stream; with GAPLESS_UPDATE_SCREENSHOT=1 it writes that to docs/live-page.png.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixture import MODEL, RunningServer, running_server

from gapless.engine.observability import stats
from gapless.server import live
from gapless.server.settings import ServerSettings

KEY = "live-page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHUNK = 16
LONG_PROMPT_TOKENS = 1200  # 75 chunks of 16 alone; more beside a decode, as its keys grow
SECRET = "zanzibar"  # a word of every prompt here, which the live view must never show
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "live-page.png"


@pytest.fixture(scope="module")
def server(demo_checkpoint: Path) -> Iterator[RunningServer]:
    # Small prefill chunks, also when idle, so a long prompt prefills over many steps. A small
    # send buffer on the connections, so a client that never reads fills it in seconds.
    with running_server(
        demo_checkpoint,
        ServerSettings(MODEL, api_key=KEY),
        send_buffer=16 * 1024,
        prefill_chunk=CHUNK,
        idle_prefill_chunk=CHUNK,
        kv_cache_tokens=20_000,
    ) as running:
        yield running


def auth_line() -> str:
    return "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())


def long_prompt(server: RunningServer, n: int, salt: str) -> list[int]:
    """n prompt ids holding SECRET; a distinct salt keeps prompts from sharing cached blocks."""
    text = f"{salt} {SECRET} " + "def handler(event, context): pass\n" * n
    return server.engine.tokenizer.encode(text)[:n]


def wait_until(condition: Any, what: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


def completion(
    server: RunningServer,
    prompt: str | list[int],
    max_tokens: int,
    started: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A streamed completion, read to the end: its chunks and prefill progress comments.
    `started` gets the live view's id of the request with its first token."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks, progress = [], []
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(": prefill_progress "):
                progress.append(json.loads(line.removeprefix(": prefill_progress ")))
            elif line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                if started is not None:
                    started["id"] = live_id(chunks[0])
    return {"chunks": chunks, "progress": progress}


def live_id(chunk: dict[str, Any]) -> str:
    """The live view's id of a request: the start of its response id, after the prefix."""
    return chunk["id"].removeprefix("cmpl-")[:8]


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # reported by the test that joins it
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def joined(thread: threading.Thread, result: dict[str, Any]) -> Any:
    thread.join(timeout=120)
    assert not thread.is_alive()
    if "error" in result:
        raise result["error"]
    return result["value"]


def summaries(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))


# -- the feed ---------------------------------------------------------------------------------


def test_page_is_served_without_the_key(server: RunningServer) -> None:
    page = httpx.get(f"{server.url}/", timeout=30)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for path, media_type in [("/page/app.js", "text/javascript"), ("/page/style.css", "text/css")]:
        asset = httpx.get(f"{server.url}{path}", timeout=30)
        assert asset.status_code == 200
        assert asset.headers["content-type"].startswith(media_type)
        assert f'"{path}"' in page.text  # the page loads it from this server, nothing else
    assert "http" not in page.text.replace("http-equiv", "")


def test_the_feed_requires_the_key(server: RunningServer) -> None:
    for headers in [{}, {"Authorization": "Bearer wrong"}]:
        r = httpx.get(f"{server.url}{live.PATH}", headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    # The same key in the other header the API takes works too.
    with httpx.stream("GET", f"{server.url}{live.PATH}", headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert next(summaries(r))["kv_blocks"]["total"] == server.engine.kv.pool.num_blocks
    feed = server.server.app.state.live_feed
    wait_until(lambda: not feed.viewers, "the viewer did not leave with its stream")


def test_summaries_show_counts_and_never_text(server: RunningServer) -> None:
    prompt = long_prompt(server, 600, "summaries")  # prefills over a few summaries
    seen: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{server.url}{live.PATH}", headers=AUTH, timeout=60) as r:
        raw: list[str] = []
        lines = r.iter_lines()
        assert next(lines).startswith(": ")  # a comment at once: the stream is open
        started = time.monotonic()
        thread, result = in_thread(completion, server, prompt, 80)
        for line in lines:
            raw.append(line)
            if line.startswith("data: "):
                seen.append(json.loads(line.removeprefix("data: ")))
                rows = seen[-1]["requests"]
                if not thread.is_alive() and not rows:
                    break
        elapsed = time.monotonic() - started
        streamed = joined(thread, result)
    text = "".join(c["choices"][0]["text"] for c in streamed["chunks"])
    feed = "\n".join(raw)
    assert SECRET not in feed
    assert len(text) > 8  # 80 tokens: too long to be in the feed by chance
    # Nor as the feed's JSON would write it (the demo model writes code: newlines, quotes).
    assert text not in feed and json.dumps(text)[1:-1] not in feed

    summary = seen[-1]
    assert set(summary) == {
        "steps",
        "steps_per_s",
        "last_step",
        "kv_blocks",
        "running",
        "waiting",
        "requests",
    }
    assert set(summary["last_step"]) == {"decode_tokens", "prefill_tokens", "ms"}
    assert set(summary["kv_blocks"]) == {"used", "cached", "total"}
    rows = [row for s in seen for row in s["requests"]]
    assert rows
    assert set(rows[0]) == {
        "id",
        "index",
        "state",
        "class",
        "tenant",
        "prompt_tokens",
        "computed",
        "reloaded",
        "generated",
        "age_s",
        "ttft_s",
    }
    assert {row["prompt_tokens"] for row in rows} == {len(prompt)}
    assert {row["class"] for row in rows} == {"interactive"}  # a streamed request's default
    assert {row["tenant"] for row in rows} == {None}  # no --api-keys
    assert {row["id"] for row in rows} == {live_id(streamed["chunks"][0])}
    prefilling = [r["computed"] for r in rows if r["state"] == "prefilling"]
    assert prefilling and prefilling == sorted(prefilling)
    assert all(c % CHUNK == 0 for c in prefilling)
    decoding = [r["generated"] for r in rows if r["state"] == "decoding"]
    assert decoding and decoding == sorted(decoding) and decoding[-1] <= 80
    assert any(s["last_step"]["prefill_tokens"] == CHUNK for s in seen)
    # At most 10 summaries a second (the engine thread publishes one per 100 ms at most).
    assert len(seen) <= 10 * elapsed + 2


def test_a_viewer_that_never_reads_is_dropped(server: RunningServer) -> None:
    """The viewer's queue holds live.QUEUE_SIZE summaries: one whose socket is full (it
    reads nothing) falls behind by that many and is dropped, its connection closed."""
    feed = server.server.app.state.live_feed
    dropped = feed.dropped
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(f"GET {live.PATH} HTTP/1.1\r\nHost: x\r\n{auth_line()}\r\n".encode())
    # Summaries flow while requests run; a second viewer that reads keeps up throughout.
    deadline = time.monotonic() + 90
    with httpx.stream("GET", f"{server.url}{live.PATH}", headers=AUTH, timeout=60) as reader:
        kept_up = summaries(reader)
        while feed.dropped == dropped:
            assert time.monotonic() < deadline, "the viewer that never reads was not dropped"
            threads = [in_thread(completion, server, f"{SECRET} {i}", 100) for i in range(8)]
            for thread, result in threads:
                joined(thread, result)
                next(kept_up)
        # The reader is still there; the dropped viewer was told to end (it leaves the set
        # when its response coroutine finishes, which may come a moment later).
        assert [v.end for v in feed.viewers if v.end != "dropped"] == [None]
        next(kept_up)
    # What the kernel held arrives, then the end of the connection: nothing more was queued.
    sock.settimeout(30)
    received = b""
    while piece := sock.recv(65536):
        received += piece
    sock.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert feed.dropped == dropped + 1


# -- the page, in a browser -------------------------------------------------------------------

RECORD_TOKENS = """() => {
  window.__tokens = [];
  const messages = document.getElementById("messages");
  new MutationObserver(() => {
    const reply = messages.querySelector(".message.assistant:last-child");
    if (reply && reply.dataset.tokens) window.__tokens.push(Number(reply.dataset.tokens));
  }).observe(messages, {subtree: true, childList: true, attributes: true});
}"""

RECORD_RENDERS = """() => {
  window.__renders = [];
  const body = document.querySelector("#requests tbody");
  new MutationObserver(() => {
    window.__renders.push([...body.rows].map((row) => ({...row.dataset})));
  }).observe(body, {childList: true});
}"""


def rows_where(condition: str) -> str:
    """A page condition: some row of the live view satisfies `condition` (of `r.dataset`)."""
    rows = "[...document.querySelectorAll('#requests tbody tr')]"
    return f"{rows}.some((row) => {{ const r = row.dataset; return {condition}; }})"


def wait_for(page: Any, condition: str, timeout: float = 30) -> None:
    """Polls a page condition. (Playwright's wait_for_function evaluates it inside the page,
    which the page's Content-Security-Policy forbids, rightly; evaluate() goes around it.)"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(0.03)


def text_is(element_id: str, text: str) -> str:
    return f"document.getElementById({element_id!r}).textContent === {text!r}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(
            "the browser test needs Debian's chromium and chromium-driver: "
            "apt-get install -y chromium chromium-driver"
        )
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'"
    )
    with sync_api.sync_playwright() as playwright:
        # Debian's chromium, not one playwright would download; small containers have a small
        # /dev/shm.
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--disable-dev-shm-usage"]
        )
        yield chromium
        chromium.close()


def test_the_page_chats_and_shows_the_server_live(
    server: RunningServer, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 440})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # Everything the page does is allowed by its Content-Security-Policy.
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
    page.goto(f"{server.url}/")

    # The page asks for the key, and works once it has it.
    wait_for(page, text_is("live-state", "needs the API key"))
    page.fill("#key", KEY)
    page.click("#key-form button")
    wait_for(page, text_is("live-state", "live"))
    wait_for(page, text_is("model", MODEL))

    # A chat: the reply's tokens arrive one by one. (Greedy, so that the reply is the same on
    # every run: this one does not end early with an end-of-text token.)
    page.evaluate(RECORD_TOKENS)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "200")
    page.fill("#prompt", f"{SECRET}: write a function")
    page.press("#prompt", "Enter")
    wait_for(page, "document.querySelector('.message.assistant .meta')?.textContent.includes(', ')")
    tokens = page.evaluate("window.__tokens")
    assert len(set(tokens)) >= 3 and tokens == sorted(tokens), tokens
    assert page.inner_text(".message.assistant .text")
    assert page.inner_text(".message.assistant .meta") == "200 tokens, length"

    # Stop aborts the stream; the server cancels the request.
    cancelled = server.engine.metrics.requests_finished.get("cancelled", 0)
    page.fill("#max_tokens", "3000")
    page.fill("#prompt", "and another one")
    page.press("#prompt", "Enter")
    reply = "document.querySelector('.message.assistant:last-child')"
    wait_for(page, f"Number({reply}?.dataset.tokens) >= 3")
    page.click("#stop")
    wait_for(page, f"{reply}.querySelector('.meta').textContent.endsWith('stopped')")
    finished = server.engine.metrics.requests_finished
    wait_until(
        lambda: finished.get("cancelled", 0) == cancelled + 1,
        lambda: f"the stopped request was not cancelled: {finished}, {stats(server.engine)}",
    )

    # Clear forgets the conversation; a short one for the picture.
    page.click("#clear")
    assert page.evaluate("document.querySelectorAll('.message').length") == 0
    page.fill("#temperature", "0.7")
    page.fill("#max_tokens", "12")
    page.fill("#prompt", f"{SECRET}: hello")
    page.press("#prompt", "Enter")
    wait_for(page, f"{reply}?.querySelector('.meta').textContent.includes(', ')")

    # A long prompt prefills, chunk by chunk, beside a decoding stream.
    page.evaluate(RECORD_RENDERS)
    decode: dict[str, str] = {}
    decoding = in_thread(completion, server, f"{SECRET} decode", 400, decode)
    wait_until(lambda: "id" in decode, "the decoding stream did not start")
    wait_for(page, rows_where(f"r.id === '{decode['id']}' && +r.generated > 0"))
    prompt = long_prompt(server, LONG_PROMPT_TOKENS, "page")
    n = len(prompt)
    prefilling = in_thread(completion, server, prompt, 4)
    wait_for(
        page,
        rows_where(f"r.prompt === '{n}' && r.state === 'prefilling' && +r.computed >= {4 * CHUNK}"),
    )
    screenshot = page.screenshot(full_page=True)
    live_text = page.inner_html("#live")
    long_request = joined(*prefilling)
    decode_request = joined(*decoding)
    renders = page.evaluate("window.__renders")
    assert not errors

    (tmp_path / "live-page.png").write_bytes(screenshot)
    if os.environ.get("GAPLESS_UPDATE_SCREENSHOT"):
        SCREENSHOT.write_bytes(screenshot)

    # The long request's bar moved: several values below 100%, one per chunk or more.
    long_id, decode_id = live_id(long_request["chunks"][0]), decode["id"]
    assert decode_id == live_id(decode_request["chunks"][0])
    progress = []  # the long request's computed tokens, and the decoding one's count beside
    for rows in renders:
        by_id = {row["id"]: row for row in rows}
        long_row, decode_row = by_id.get(long_id), by_id.get(decode_id)
        if long_row and long_row["state"] == "prefilling" and decode_row:
            assert long_row["prompt"] == str(n)
            progress.append((int(long_row["computed"]), int(decode_row["generated"])))
    computed = [c for c, _ in progress]
    generated = [g for _, g in progress]
    assert len({c for c in computed if c < n}) >= 2, progress
    assert computed == sorted(computed), progress
    # ... while the other stream's token count kept increasing.
    assert generated == sorted(generated) and len(set(generated)) >= 2, progress
    assert long_request["progress"][-1] == {"processed": n, "total": n}

    # Ids, counts and timings only: no prompt text in the live view (the chat shows its own).
    assert SECRET not in live_text
    assert SECRET in page.inner_text("#chat")
    page.close()
