"""Structured output: a grammar per request, and the token mask it allows at each step.

llguidance compiles JSON schemas, regular expressions and Lark grammars lazily, so a matcher
is ready at once and computes each step's mask on the CPU in tens of microseconds; why this
library and not xgrammar or outlines-core is in docs/server.md ("Structured output").

A grammar travels in SamplingParams as llguidance's serialized grammar text: the builders
below make it from what a request asks for, and `GrammarCompiler.check` refuses one that
cannot compile before the request is admitted.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import torch

from gapless.model.tokenizer import Tokenizer

_BIT = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar that does not compile, or output it rejects."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """Output that is one JSON value valid for the schema; whitespace is kept compact."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema,
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
    except ValueError as e:
        raise GrammarError(str(e)) from e


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """Output that is exactly one of the strings."""
    # A JSON string literal is a valid Lark string literal.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in choices)
    )


class GrammarCompiler:
    """Matchers over one model's vocabulary. The vocabulary index takes about 2 s to build for
    a 49k-token vocabulary, so it is built at the first constrained request, not at startup."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._index: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._index is None:
                self._index = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=self._eos_ids,
                )
            return self._index

    def check(self, grammar: str) -> None:
        """Raises GrammarError saying what is wrong with a grammar that cannot compile."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self._vocabulary())
        if error:
            raise GrammarError(error.strip())

    def matcher(self, grammar: str) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMatcher(matcher, self._vocab_size)


class GrammarMatcher:
    """One request's position in its grammar; advanced by each token it accepts."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary: the tokens the grammar allows next."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        allowed = ((words[:, None] >> _BIT) & 1).flatten()[: self._vocab_size].bool()
        if not allowed.any():  # sampling would divide by zero
            raise GrammarError("the grammar allows no token here")
        return allowed

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(self._matcher.get_error() or f"the grammar rejects token {token}")

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the output is finished."""
        return self._matcher.is_stopped()
