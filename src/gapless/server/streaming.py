"""Engine events as a dialect's response bytes: a Renderer per dialect turns tokens and the
finish into its chunks (SSE or NDJSON lines, streamed) or into one JSON body (whole)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from gapless.engine.events import Event, FinishedEvent, ProgressEvent, TokenEvent
from gapless.server import protocol
from gapless.server.protocol import APIError

log = logging.getLogger("gapless.server")

# Characters that str.splitlines, and so many clients' line readers (httpx's iter_lines among
# them), take for line ends, which JSON leaves raw: a generated one would cut a streamed line.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def stream_json(obj: Any) -> str:
    """obj as JSON on one line, whatever its text holds (UTF-8 otherwise, not \\u escapes)."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_ENDS)


def sse(obj: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event; `event` names its type (Anthropic's streams name every event)."""
    text = obj if isinstance(obj, str) else stream_json(obj)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def progress_comment(event: ProgressEvent) -> bytes:
    """Prefill progress as an SSE comment, which SSE clients skip."""
    info = json.dumps({"processed": event.processed, "total": event.total})
    return f": prefill_progress {info}\n\n".encode()


def ndjson(obj: dict[str, Any]) -> bytes:
    return stream_json(obj).encode() + b"\n"


# -- rendering ------------------------------------------------------------------------------


class Renderer:
    """One request's engine events in one dialect: the pieces of its stream, or one JSON
    object once it has finished."""

    stream_media_type = "text/event-stream; charset=utf-8"

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finishes: list[FinishedEvent] = []  # one per choice of a request for n

    # Streaming.
    def opening(self) -> list[bytes]:
        return []

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return []

    def token(self, event: TokenEvent) -> list[bytes]:
        raise NotImplementedError

    def finished(self, event: FinishedEvent) -> list[bytes]:
        """The stream's last pieces after a successful finish."""
        raise NotImplementedError

    def failed(self, error: APIError) -> list[bytes]:
        """The stream's last pieces when the request failed after the stream began."""
        raise NotImplementedError

    # Not streaming.
    def absorb(self, event: TokenEvent) -> None:
        self.text.append(event.text)

    def absorb_finished(self, event: FinishedEvent) -> None:
        self.finishes.append(event)

    def response(self, finished: FinishedEvent) -> dict[str, Any]:
        raise NotImplementedError


async def stream_body(
    renderer: Renderer, events: AsyncIterator[Event], request_id: str
) -> AsyncIterator[bytes]:
    try:
        for piece in renderer.opening():
            yield piece
        async for event in events:
            if isinstance(event, ProgressEvent):
                pieces = renderer.progress(event)
            elif isinstance(event, TokenEvent):
                pieces = renderer.token(event)
            elif event.finish_reason == "error":
                # The whole request fails: closing the events cancels its other choices.
                error = protocol.server_error(event.error or "the request failed in the engine")
                for piece in renderer.failed(error):
                    yield piece
                return
            else:
                pieces = renderer.finished(event)
            for piece in pieces:
                yield piece
    except Exception as e:  # this request fails alone; its stream still ends properly
        log.exception("request %s failed", request_id)
        for piece in renderer.failed(protocol.server_error(f"{type(e).__name__}: {e}")):
            yield piece
    finally:
        await events.aclose()


async def json_body(renderer: Renderer, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The response once every choice has finished (the events end after the last)."""
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                renderer.absorb(event)
            elif isinstance(event, FinishedEvent):
                if event.finish_reason == "error":
                    raise protocol.server_error(event.error or "the request failed in the engine")
                renderer.absorb_finished(event)
    finally:
        await events.aclose()
    yield json.dumps(renderer.response(renderer.finishes[-1]), ensure_ascii=False).encode()
