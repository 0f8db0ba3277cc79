"""Prompt lookup: a request's proposed tokens from its own text. Where its last few tokens
occurred before (in the prompt, or in what it has written), what followed them then is
proposed to follow now: code edits, quotes and structured output repeat themselves."""

from __future__ import annotations

from typing import Protocol

# Matches of the last NGRAM_MAX, then fewer, down to NGRAM_MIN tokens. A single token matches
# almost anywhere and rarely predicts what follows.
NGRAM_MAX = 4
NGRAM_MIN = 2
_WIDTH = 4  # bytes per token id in the searched buffer


class Tokens(Protocol):
    """A request's tokens so far, prompt then output (Request is one)."""

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


class PromptLookup:
    """One request's proposer. It keeps the request's tokens (prompt, then accepted output)
    as little-endian int32, so the latest earlier match of its last tokens is one bytes.rfind
    away, however long the prompt."""

    def __init__(self) -> None:
        self._tokens = bytearray()
        self._count = 0

    def propose(self, request: Tokens, k: int) -> list[int]:
        """Up to k tokens to follow the request's tokens: what followed the latest earlier
        occurrence of its last NGRAM_MAX tokens, else of fewer, down to NGRAM_MIN. (Its tokens
        only ever grow: rejected proposals never join them.)"""
        data, total = self._tokens, request.num_tokens
        for token in request.tokens(self._count, total):
            data += token.to_bytes(_WIDTH, "little")
        self._count = total
        # Matches must end before the last token, so that something follows them.
        end = len(data) - _WIDTH
        for n in range(min(NGRAM_MAX, total - 1), NGRAM_MIN - 1, -1):
            needle = bytes(data[-n * _WIDTH :])
            stop = end
            while (at := data.rfind(needle, 0, stop)) >= 0:
                if at % _WIDTH == 0:  # not a match straddling token boundaries
                    follow = at // _WIDTH + n
                    return request.tokens(follow, min(follow + k, total))
                stop = at + len(needle) - 1
        return []
