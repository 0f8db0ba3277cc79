"""Images through every API dialect (issue 28), each with its real client against a real server
on a loopback port: OpenAI `image_url` parts (data: URLs, and http(s) URLs when the server
fetches them), Anthropic base64 `image` blocks, Ollama `images` on /api/chat and
/api/generate. Each gives the tokens the engine gives for the same image and text; another
image gives other tokens; /tokenize and count_tokens count an image's run of tokens; and every
bad image is a 400 that names its limit, in each dialect's error shape, with nothing leaked.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import ollama
import openai
import pytest
from checkpoints import write_test_tokenizer
from helpers import bomb, png
from server_fixture import MODEL, RunningServer, running_server
from test_vision import drawn, make_gemma3, make_llava

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import TokenEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.server.settings import ServerSettings

# The test tokenizer's `<|pad|>`, which no text prompt holds: the checkpoint's image token,
# so that the chat template can write it.
IMAGE_TOKEN = 2
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|pad|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUESTION = "What is in this picture?"
NEW_TOKENS = 6
LIMIT_IMAGES = 2
MAX_PIXELS = 100 * 100


RED_DISK = png(drawn(61, 45))
NOISE = png(drawn(40, 77, seed=1))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = make_llava(tmp_path_factory.mktemp("llava"), "clip")
    config = (out / "config.json").read_text()
    (out / "config.json").write_text(
        config.replace('"image_token_index": 511', '"image_token_index": 2')
    )
    write_test_tokenizer(out, chat_template=TEMPLATE)
    return out


ENGINE_FIELDS = {
    "limit_mm_per_prompt": LIMIT_IMAGES,
    "max_image_pixels": MAX_PIXELS,
    "prefill_chunk": 16,
    "idle_prefill_chunk": 16,
    "kv_cache_tokens": 4096,
}


@pytest.fixture(scope="module")
def server(vlm_dir: Path) -> Iterator[RunningServer]:
    with running_server(vlm_dir, ServerSettings(MODEL), **ENGINE_FIELDS) as running:
        yield running


@pytest.fixture(scope="module")
def expected(vlm_dir: Path) -> Callable[..., str]:
    """The greedy text of an engine of its own (the server's steps in another thread) for one
    user turn of images then text, its prompt ids written by hand as the template writes them."""
    engine = Engine.from_pretrained(
        vlm_dir, EngineConfig.of(dtype="float32", device="cpu", **ENGINE_FIELDS)
    )
    tokenizer = engine.tokenizer

    def special(name: str) -> int:
        (token,) = tokenizer.encode(name, add_special_tokens=False)
        return token

    def text_of(images: list[bytes], text: str = QUESTION) -> str:
        ids = [tokenizer.bos_token_id, special("<|user|>"), *[IMAGE_TOKEN] * len(images)]
        ids += tokenizer.encode(text, add_special_tokens=False)
        ids += [special("<|end|>"), special("<|assistant|>")]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
        engine.add_request(ids, params, images=images)
        out: list[int] = []
        while engine.has_work:
            out += [t for e in engine.step() if isinstance(e, TokenEvent) for t in e.token_ids]
        return tokenizer.decode(out)

    return text_of


def openai_image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def anthropic_image(data: bytes) -> dict:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def ask_openai(gpt: openai.OpenAI, images: list[bytes], stream: bool = False) -> str:
    content = [*map(openai_image, images), {"type": "text", "text": QUESTION}]
    kw = {"model": MODEL, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    messages = [{"role": "user", "content": content}]
    if not stream:
        return gpt.chat.completions.create(messages=messages, **kw).choices[0].message.content
    chunks = gpt.chat.completions.create(messages=messages, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def ask_anthropic(claude: anthropic.Anthropic, images: list[bytes]) -> str:
    content = [*map(anthropic_image, images), {"type": "text", "text": QUESTION}]
    message = claude.messages.create(
        model=MODEL,
        max_tokens=NEW_TOKENS,
        messages=[{"role": "user", "content": content}],
        # This client version has no sampling arguments of its own.
        extra_body={"temperature": 0.0},
    )
    return "".join(block.text for block in message.content)


def ask_ollama_chat(llama: ollama.Client, images: list[bytes]) -> str:
    message = {"role": "user", "content": QUESTION, "images": images}
    options = {"temperature": 0.0, "num_predict": NEW_TOKENS}
    return llama.chat(model=MODEL, messages=[message], options=options).message.content


def ask_ollama_generate(llama: ollama.Client, images: list[bytes]) -> str:
    options = {"temperature": 0.0, "num_predict": NEW_TOKENS}
    return llama.generate(model=MODEL, prompt=QUESTION, images=images, options=options).response


def test_every_dialect_gives_the_engines_tokens_for_the_image(oai, claude, llama, expected) -> None:
    want = expected([RED_DISK])
    assert ask_openai(oai, [RED_DISK]) == want
    assert ask_openai(oai, [RED_DISK], stream=True) == want
    assert ask_anthropic(claude, [RED_DISK]) == want
    assert ask_ollama_chat(llama, [RED_DISK]) == want
    assert ask_ollama_generate(llama, [RED_DISK]) == want


def test_another_image_gives_other_tokens_and_two_images_are_placed_in_order(
    oai, claude, expected
) -> None:
    one, other = expected([RED_DISK]), expected([NOISE])
    assert one != other  # the image reaches the model
    assert ask_openai(oai, [NOISE]) == other
    both = expected([RED_DISK, NOISE])
    assert both != expected([NOISE, RED_DISK])
    assert ask_openai(oai, [RED_DISK, NOISE]) == both
    assert ask_anthropic(claude, [RED_DISK, NOISE]) == both


def test_ollama_show_lists_the_vision_capability(llama: ollama.Client) -> None:
    assert llama.show(MODEL).capabilities == ["completion", "vision", "embedding"]


def test_token_counts_include_each_images_run(server: RunningServer, vlm_dir: Path) -> None:
    """An image's placeholder counts as the run of tokens it becomes (the tiny CLIP tower:
    one token per 7x7 patch of its 42x42 input)."""
    run = (42 // 7) ** 2
    content = [openai_image(RED_DISK), {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    with server.client() as client:
        plain = client.post("/tokenize", json={"messages": [{"role": "user", "content": QUESTION}]})
        with_image = client.post("/tokenize", json={"messages": messages})
        assert with_image.status_code == 200, with_image.text
        assert with_image.json()["count"] == plain.json()["count"] + run
        assert with_image.json()["tokens"].count(IMAGE_TOKEN) == run
        claude_content = [anthropic_image(RED_DISK), {"type": "text", "text": QUESTION}]
        counted = client.post(
            "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": [{"role": "user", "content": claude_content}]},
        )
        assert counted.json() == {"input_tokens": with_image.json()["count"]}


# -- bad images ------------------------------------------------------------------------------


# case -> (the images a request sends, base64 text where the dialect takes it raw, what the
# 400's message says)
BAD = {
    "corrupt": ([b"this is not an image"], "image 0 is not a readable image"),
    "empty": ([b""], "image 0 is empty (0 bytes)"),
    "truncated": ([RED_DISK[:100]], "image 0 is not a readable image"),
    "too_many_pixels": ([png(drawn(120, 100))], "pixel cap of 10000 (--max-image-pixels)"),
    "bomb": ([bomb(10_000)], "is a decompression bomb"),
    "too_many": ([RED_DISK] * 3, "the limit of 2 per prompt (--limit-mm-per-prompt)"),
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bad_request(dialect: str, images: list[bytes] | str) -> tuple[str, dict]:
    """(path, body) of a request of `dialect` with the images; a str is sent as the image's
    base64 text or URL as it is."""
    raw = [images] if isinstance(images, str) else None
    if dialect == "openai":
        urls = raw or [data_url(i) for i in images]
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        content = [*parts, {"type": "text", "text": QUESTION}]
        return "/v1/chat/completions", {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
        }
    if dialect == "anthropic":
        if raw and raw[0].startswith("http"):
            sources = [{"type": "url", "url": raw[0]}]
        else:
            data = raw or [_b64(i) for i in images]
            sources = [{"type": "base64", "media_type": "image/png", "data": d} for d in data]
        content = [
            *({"type": "image", "source": s} for s in sources),
            {"type": "text", "text": QUESTION},
        ]
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        return "/v1/messages", body
    data = raw or [_b64(i) for i in images]
    if dialect == "ollama_chat":
        message = {"role": "user", "content": QUESTION, "images": data}
        return "/api/chat", {"model": MODEL, "messages": [message], "stream": False}
    return "/api/generate", {"model": MODEL, "prompt": QUESTION, "images": data, "stream": False}


def error_message(dialect: str, body: dict) -> str:
    """The message of each dialect's error shape."""
    if dialect == "openai":
        return body["error"]["message"]
    if dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    return body["error"]


DIALECTS = ["openai", "anthropic", "ollama_chat", "ollama_generate"]


# Ollama takes images as base64 only: no URL to refuse.
CASES = [(d, c) for d in DIALECTS for c in [*BAD, "not_base64", "url_not_allowed"]]
CASES = [(d, c) for d, c in CASES if not (d.startswith("ollama") and c == "url_not_allowed")]


@pytest.mark.parametrize(("dialect", "case"), CASES)
def test_bad_image_is_a_400_naming_its_limit(
    server: RunningServer, dialect: str, case: str
) -> None:
    if case == "not_base64":
        images, says = (
            "data:image/png;base64,%%%" if dialect == "openai" else "%%%",
            "not valid base64",
        )
    elif case == "url_not_allowed":
        images, says = "http://127.0.0.1:9/cat.png", "--allow-image-urls"
    else:
        images, says = BAD[case]
    path, body = bad_request(dialect, images)
    with server.client() as client:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert says in error_message(dialect, r.json())
        if dialect == "openai":  # the part that sent the image (the first, for too many)
            assert r.json()["error"]["param"].startswith("messages[0].content[0]")
    engine = server.engine
    assert engine.kv.pool.num_used == 0 and not engine.has_work  # nothing admitted, nothing held


def test_text_only_model_refuses_images_before_its_template(checkpoint) -> None:
    """A text-only model's template would write an image part as text: the 400 says why."""
    with running_server(checkpoint("llama"), ServerSettings(MODEL)) as running:
        for dialect in DIALECTS:
            path, body = bad_request(dialect, [RED_DISK])
            with running.client() as client:
                r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            assert "this model takes no images" in error_message(dialect, r.json())


# -- image URLs ------------------------------------------------------------------------------


class _Images(http.server.BaseHTTPRequestHandler):
    """An image host, well-behaved or not. /disk.png: an image; /slow.png: the image after a
    pause; /trickle.png: the image a byte at a time, each well within any timeout per read;
    /silent.png: no answer at all; /loop.png: a redirect to itself; /slow_hops.png: the same
    after a pause, each hop within the fetch's timeout; /endless.png: bytes without end, with
    no Content-Length; anything else: 404."""

    pause_s = 2.0
    trickle_gap_s = 0.5
    hop_s = 0.3
    silent_reached = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 (the http.server API's name)
        with contextlib.suppress(ConnectionError):  # the server under test gave up waiting
            match self.path:
                case "/disk.png" | "/slow.png":
                    if self.path == "/slow.png":
                        time.sleep(self.pause_s)
                    self._image_headers()
                    self.wfile.write(RED_DISK)
                case "/trickle.png":
                    self._image_headers()
                    for byte in RED_DISK:
                        self.wfile.write(bytes([byte]))
                        time.sleep(self.trickle_gap_s)
                case "/silent.png":
                    self.silent_reached.set()
                    self.rfile.read(1)  # until the fetch hangs up
                case "/loop.png" | "/slow_hops.png":
                    if self.path == "/slow_hops.png":
                        time.sleep(self.hop_s)
                    self.send_response(302)
                    self.send_header("Location", self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                case "/endless.png":
                    self.send_response(200)  # HTTP/1.0: the body ends when the host closes
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    while True:
                        self.wfile.write(bytes(64 * 1024))
                case _:
                    self.send_error(404)

    def _image_headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(RED_DISK)))
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_port}"
    host.shutdown()
    host.server_close()
    thread.join()


def test_image_urls_are_fetched_within_their_limits_when_allowed(
    vlm_dir: Path, image_host: str, expected
) -> None:
    settings = ServerSettings(
        MODEL, allow_image_urls=True, image_url_timeout_s=0.5, image_url_max_mb=1.0
    )
    with running_server(vlm_dir, settings, **ENGINE_FIELDS) as running:
        gpt = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        content = [
            {"type": "image_url", "image_url": {"url": f"{image_host}/disk.png"}},
            {"type": "text", "text": QUESTION},
        ]
        reply = gpt.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=NEW_TOKENS,
            temperature=0.0,
        )
        assert reply.choices[0].message.content == expected([RED_DISK])
        claude = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0)
        url_block = {"type": "image", "source": {"type": "url", "url": f"{image_host}/disk.png"}}
        message = claude.messages.create(
            model=MODEL,
            max_tokens=NEW_TOKENS,
            messages=[{"role": "user", "content": [url_block, {"type": "text", "text": QUESTION}]}],
            extra_body={"temperature": 0.0},
        )
        assert message.content[0].text == expected([RED_DISK])
        with running.client() as client:
            for url, says in (
                (f"{image_host}/slow.png", "took longer than 0.5 s (--image-url-timeout)"),
                (f"{image_host}/missing.png", "HTTP 404"),
                ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
                ("http://[::1/a.png", "is not a valid URL"),
            ):
                path, body = bad_request("openai", url)
                r = client.post(path, json=body)
                assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert running.engine.kv.pool.num_used == 0


def test_an_image_url_over_the_size_limit_is_refused(vlm_dir: Path, image_host: str) -> None:
    small = len(RED_DISK) / 2 / 2**20  # MiB: half the image
    settings = ServerSettings(MODEL, allow_image_urls=True, image_url_max_mb=small)
    with running_server(vlm_dir, settings, **ENGINE_FIELDS) as running, running.client() as client:
        path, body = bad_request("openai", f"{image_host}/disk.png")
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "(--image-url-max-mb)" in r.json()["error"]["message"]


FETCH_TIMEOUT_S = 1.0
FETCH_MAX_MB = 0.25


@pytest.fixture(scope="module")
def fetching_server(vlm_dir: Path) -> Iterator[RunningServer]:
    settings = ServerSettings(
        MODEL,
        allow_image_urls=True,
        image_url_timeout_s=FETCH_TIMEOUT_S,
        image_url_max_mb=FETCH_MAX_MB,
    )
    with running_server(vlm_dir, settings, **ENGINE_FIELDS) as running:
        yield running


TOOK_TOO_LONG = "took longer than 1 s (--image-url-timeout)"
HOSTILE_HOSTS = {
    "trickle.png": TOOK_TOO_LONG,
    "silent.png": TOOK_TOO_LONG,
    "slow_hops.png": TOOK_TOO_LONG,
    "loop.png": "failed: more than 5 redirects",
    "endless.png": f"is larger than the limit of {int(FETCH_MAX_MB * 2**20)} bytes",
}


@pytest.mark.parametrize(("name", "says"), HOSTILE_HOSTS.items())
def test_a_hostile_image_host_holds_a_request_no_longer_than_the_fetch_timeout(
    fetching_server: RunningServer, image_host: str, name: str, says: str
) -> None:
    """Whatever the host does (a trickle, no answer, redirects without end, a body without
    end), its fetch ends by the deadline: a 400 naming the field, within the timeout and a
    second."""
    path, body = bad_request("openai", f"{image_host}/{name}")
    start = time.monotonic()
    with fetching_server.client() as client:
        r = client.post(path, json=body)
    elapsed = time.monotonic() - start
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert elapsed < FETCH_TIMEOUT_S + 1


def test_the_server_answers_others_while_a_fetch_waits(
    fetching_server: RunningServer, image_host: str
) -> None:
    """A fetch waits off the server's event loop: another request is answered meanwhile."""
    _Images.silent_reached.clear()
    path, body = bad_request("openai", f"{image_host}/silent.png")
    with (
        ThreadPoolExecutor(1) as pool,
        fetching_server.client() as fetcher,
        fetching_server.client() as other,
    ):
        fetch = pool.submit(fetcher.post, path, json=body)
        assert _Images.silent_reached.wait(FETCH_TIMEOUT_S)
        assert other.get("/health").status_code == 200
        assert not fetch.done()
        assert fetch.result().status_code == 400


# -- Gemma 3's image markup --------------------------------------------------------------------

# The template writes Gemma 3's <start_of_image> (here the test tokenizer's <|system|>) for an
# image, and its processor rewrites that in the text before tokenizing.
GEMMA_TEMPLATE = TEMPLATE.replace("<|pad|>", "<|system|>")


def test_gemma3s_image_mark_is_rewritten_as_its_processor_does(tmp_path: Path) -> None:
    out = make_gemma3(tmp_path / "gemma3")
    config = json.loads((out / "config.json").read_text())
    # <|pad|> the image token, <|system|> its start, <|eos|> its end: special tokens, so that
    # the text can spell them
    config |= {"image_token_index": IMAGE_TOKEN, "boi_token_index": 5, "eoi_token_index": 1}
    (out / "config.json").write_text(json.dumps(config))
    write_test_tokenizer(out, chat_template=GEMMA_TEMPLATE)
    with running_server(out, ServerSettings(MODEL), **ENGINE_FIELDS) as running:
        tokenizer = running.engine.tokenizer
        content = [openai_image(RED_DISK), {"type": "text", "text": QUESTION}]
        messages = [{"role": "user", "content": content}]
        with running.client() as client:
            got = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
            # what Gemma3Processor makes of the rendered chat: blank lines around the image's
            # start, its 16 tokens and its end, tokenized with the text around them
            start = tokenizer.encode("<|bos|><|user|>\n\n<|system|>", add_special_tokens=False)
            end = tokenizer.encode(
                f"<|eos|>\n\n{QUESTION}<|end|><|assistant|>", add_special_tokens=False
            )
            assert got == start + [IMAGE_TOKEN] * 16 + end
            body = {"model": MODEL, "messages": messages, "max_tokens": NEW_TOKENS}
            reply = client.post("/v1/chat/completions", json={**body, "temperature": 0})
            assert reply.status_code == 200, reply.text
        engine = Engine.from_pretrained(
            out, EngineConfig.of(dtype="float32", device="cpu", **ENGINE_FIELDS)
        )
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
        engine.add_request(start + [IMAGE_TOKEN] + end, params, images=[RED_DISK])
        ids: list[int] = []
        while engine.has_work:
            ids += [t for e in engine.step() if isinstance(e, TokenEvent) for t in e.token_ids]
        assert reply.json()["choices"][0]["message"]["content"] == tokenizer.decode(ids)


def test_an_image_outside_a_user_turn_is_refused(server: RunningServer) -> None:
    """Chat templates place images in user turns: elsewhere a 400 names the message."""
    image = openai_image(RED_DISK)
    assistant = {"role": "assistant", "content": [image]}
    openai_body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}, assistant]}
    ollama_message = {"role": "assistant", "content": "", "images": [_b64(RED_DISK)]}
    ollama_body = {"model": MODEL, "messages": [ollama_message], "stream": False}
    with server.client() as client:
        r = client.post("/v1/chat/completions", json=openai_body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content"
        assert "images are taken in user messages" in r.json()["error"]["message"]
        r = client.post("/api/chat", json=ollama_body)
        assert r.status_code == 400
        assert r.json()["error"].startswith("messages[0].images: images are taken in user")
