"""The Responses API's stored responses: bounded in entries and in bytes, least recently used
evicted first.

Each entry is a response object as it was returned, and the conversation it answered (its
input items, those of the responses before it included), so a follow-up naming it with
`previous_response_id` continues the whole conversation even after the earlier responses were
evicted. Used on the event loop only, so it needs no lock.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gapless.server")


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as returned to the client
    items: list[dict[str, Any]]  # the conversation's input items, before `response["output"]`
    size: int  # bytes, as JSON

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up continues: the input, then this response's output."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Stores a response, evicting the least recently used ones until both caps hold;
        False (and nothing stored or evicted) when it alone is over the byte cap."""
        size = len(json.dumps([response, items], ensure_ascii=False).encode())
        if size > self.max_bytes or self.max_entries < 1:
            log.warning(
                "response %s is %d bytes, over the store's cap of %d: not stored",
                response["id"],
                size,
                self.max_bytes,
            )
            return False
        self.delete(response["id"])
        while self._entries and (
            len(self._entries) >= self.max_entries or self.bytes + size > self.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        self._entries[response["id"]] = StoredResponse(response, items, size)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None if unknown or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
