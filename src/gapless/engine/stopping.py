"""Stop strings over a text stream: match across token boundaries, never leak a stop string.

Text that could be the start of a stop string is held back until the next delta settles it.
The work per delta is bounded by the stop strings' count and length, which SamplingParams
limits, not by the length of the stream.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any


class StopStringFilter:
    """Each delta may carry an item (its token's logprobs). An item comes out with the first
    emitted text of its delta, so the items emitted always belong to the text emitted: those
    of tokens cut off by the stop string never come out."""

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = stops
        self.include_stop = include_stop
        # Longest first: of two stops found at one index, the longer one wins.
        by_length = sorted(set(stops), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, by_length)))
        self._held = ""
        self._fed = 0  # characters fed so far
        self._emitted = 0  # characters returned so far
        self._items: deque[tuple[int, Any]] = deque()  # (where its delta starts, item)
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def feed(self, delta: str, item: Any = None) -> tuple[str, list[Any]]:
        """Returns the text safe to emit now and the items that belong to it; sets `stopped`
        once a stop string appears."""
        if self.stopped:
            return "", []
        if item is not None:
            self._items.append((self._fed, item))
        self._fed += len(delta)
        text = self._held + delta
        if match := self._pattern.search(text):
            self.stopped = True
            self.matched = match.group()
            out = text[: match.end() if self.include_stop else match.start()]
            self._held = ""
        else:
            keep = self._partial_suffix(text)
            out, self._held = text[: len(text) - keep], text[len(text) - keep :]
        self._emitted += len(out)
        items = self._take()
        if self.stopped:
            self._items.clear()
        return out, items

    def flush(self) -> tuple[str, list[Any]]:
        """At the end of the stream the held text was not a stop string after all."""
        held, self._held = self._held, ""
        if self.stopped:
            return "", []
        items = [item for _, item in self._items]
        self._items.clear()
        return held, items

    def _take(self) -> list[Any]:
        """The items whose delta starts within the text emitted so far."""
        items = []
        while self._items and self._items[0][0] < self._emitted:
            items.append(self._items.popleft()[1])
        return items

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            # Only a suffix that starts with the stop's first character can be its prefix; the
            # earliest such start gives the longest suffix, and only one longer than `longest`
            # matters.
            start = max(len(text) - len(stop) + 1, 0)
            end = len(text) - longest
            while (start := text.find(stop[0], start, end)) >= 0:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start += 1
        return longest
