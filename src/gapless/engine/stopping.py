"""Stop strings over a text stream: match across token boundaries, never leak a stop string.

Text that could be the start of a stop string is held back until the next delta settles it.
"""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Returns the text safe to emit now; sets `stopped` once a stop string appears."""
        if self.stopped or not self.stops:
            return "" if self.stopped else delta
        text = self._held + delta
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            index, stop = min(hits)
            self.stopped = True
            self._held = ""
            return text[: index + len(stop)] if self.include_stop else text[:index]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the stream the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
