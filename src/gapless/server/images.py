"""Images in API requests: each dialect's image forms read to their file's bytes, and the chat
template's content that places them.

The dialects read an OpenAI `image_url` part (a `data:` URL with base64, or an http(s) URL
when the server fetches them), an Anthropic `image` block (base64, or a URL) and Ollama's
`images` (base64) here. The bytes then go to the engine's admission (engine/admission.py),
which decodes and checks each image once: empty, unreadable, zero size, over the pixel cap,
too many. A message with images reaches the chat template as a list of parts, `{"type":
"text", "text": ...}` and `{"type": "image"}`, the shape vision-language templates render
their image placeholder from; a message without stays a string.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes, urlsplit

import httpx

from gapless.engine.admission import Admission, CheckedImages, RequestError
from gapless.server.protocol import invalid

MAX_REDIRECTS = 5


@dataclass(frozen=True)
class ImageReader:
    """How the server reads an image a request names: `data:` URLs and base64 always, http(s)
    URLs only when allowed, each fetch within max_bytes and timeout_s (the whole fetch)."""

    allow_urls: bool = False
    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0

    def url(self, url: Any, param: str) -> bytes:
        """The bytes of the image at a `data:` or http(s) URL."""
        if not isinstance(url, str):
            raise invalid("an image URL must be a string", param)
        try:
            scheme = urlsplit(url).scheme.lower()
        except ValueError as e:  # e.g. an unclosed IPv6 bracket
            raise invalid(f"{url!r} is not a valid URL: {e}", param) from e
        if scheme == "data":
            return _data_url(url, param)
        if scheme not in ("http", "https"):
            raise invalid(
                f"unsupported image URL scheme {scheme!r}: send a data: URL (base64) or, where "
                "the server allows it, an http(s) URL",
                param,
            )
        if not self.allow_urls:
            raise invalid(
                "this server does not fetch image URLs; send the image as a data: URL "
                "(base64), or start the server with --allow-image-urls",
                param,
            )
        return self._fetch(url, param)

    def _fetch(self, url: str, param: str) -> bytes:
        # A timeout on each socket read does not bound a fetch: each byte of a trickle comes
        # within it. Async I/O can be cut off mid-read, so the fetch runs as a coroutine under
        # one deadline, on an event loop of its own in the calling thread (a request's parse
        # runs off the server's loop, in a worker thread). Not asyncio.run: its exit waits for
        # the executor, where a name lookup may still be running past the deadline.
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(self._fetch_by_deadline(url, param))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _fetch_by_deadline(self, url: str, param: str) -> bytes:
        limit = f"the limit of {self.max_bytes} bytes (--image-url-max-mb)"
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                # No timeouts of httpx's own: the deadline above is the one, for every hop.
                httpx.AsyncClient(
                    follow_redirects=True, max_redirects=MAX_REDIRECTS, timeout=None
                ) as client,
                client.stream("GET", url) as response,
            ):
                if not response.is_success:
                    raise invalid(
                        f"fetching the image at {url} failed: HTTP {response.status_code}", param
                    )
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise invalid(
                        f"the image at {url} has {declared} bytes, more than {limit}", param
                    )
                data = bytearray()
                async for piece in response.aiter_bytes():
                    data += piece
                    if len(data) > self.max_bytes:
                        raise invalid(f"the image at {url} is larger than {limit}", param)
                return bytes(data)
        except TimeoutError as e:
            raise _timed_out(url, self.timeout_s, param) from e
        except httpx.TooManyRedirects as e:
            raise invalid(
                f"fetching the image at {url} failed: more than {MAX_REDIRECTS} redirects", param
            ) from e
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            # Some of httpx's errors carry no message: their class names the failure.
            raise invalid(
                f"fetching the image at {url} failed: {str(e) or type(e).__name__}", param
            ) from e


def _timed_out(url: str, timeout_s: float, param: str) -> Exception:
    return invalid(
        f"fetching the image at {url} took longer than {timeout_s:g} s (--image-url-timeout)",
        param,
    )


def _data_url(url: str, param: str) -> bytes:
    """A `data:[<media type>][;base64],<data>` URL's bytes (RFC 2397)."""
    header, comma, data = url[len("data:") :].partition(",")
    if not comma:
        raise invalid("a data: URL needs a comma before its data", param)
    if header.lower().endswith(";base64"):
        return decode_base64(data, param)
    return unquote_to_bytes(data)


def decode_base64(data: Any, param: str) -> bytes:
    """Base64 text's bytes, refused with the field's name if it is not base64."""
    if not isinstance(data, str):
        raise invalid("image data must be a base64 string", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid(f"image data is not valid base64: {e}", param) from e


@dataclass(frozen=True)
class SentImage:
    """An image's bytes, and the request's field that sent it (what its refusal names)."""

    data: bytes
    param: str


def check_images(admission: Admission, images: list[SentImage]) -> CheckedImages:
    """A request's images checked once by the engine's admission (before the chat template
    renders them: a text-only template would write an image part as text); a refusal names
    the image's field, or the first image's for one of them all (too many, a text-only
    model)."""
    try:
        return admission.check_images([image.data for image in images])
    except RequestError as e:
        match = re.fullmatch(r"images\[(\d+)\]", e.param or "")
        param = images[int(match[1]) if match else 0].param
        raise invalid(str(e), param, e.code) from e


def check_user_images(role: str, images: list[SentImage], param: str) -> None:
    """Images come in user turns only: chat templates place them there."""
    if images and role != "user":
        raise invalid(f"images are taken in user messages, not in a {role} message", param)


@dataclass
class MessageContent:
    """One message's content in order, text and images, as the chat template takes it."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    images: list[SentImage] = field(default_factory=list)

    def text(self, text: str) -> None:
        self.parts.append({"type": "text", "text": text})

    def image(self, data: bytes, param: str) -> None:
        self.parts.append({"type": "image"})
        self.images.append(SentImage(data, param))

    def template_content(self) -> str | list[dict[str, Any]]:
        """The texts joined as one string when there is no image (what text-only templates
        render), else the parts."""
        if not self.images:
            return "\n".join(part["text"] for part in self.parts)
        return self.parts
