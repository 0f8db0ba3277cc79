"""What a request must pass to be admitted: each check once, for the engine and the server.

Engine.add_request runs them, so the Python API refuses what the server refuses. The server's
dialects run them while they parse a request, off the event loop, and hand the engine a
CheckedPrompt, which add_request does not scan again. Every refusal is a RequestError naming
the field in the engine's terms (prompt, max_tokens, top_k, stop_token_ids); the server
renames it to the request's field (server/endpoint.py, admission_errors).
"""

from __future__ import annotations

from typing import Any

from gapless.engine.sampling_params import SamplingParams
from gapless.model.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request that can never run; `param` names the offending field."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class CheckedPrompt(list[int]):
    """Prompt ids that passed Admission.check_prompt: add_request takes them as they are."""


class Admission:
    """The checks of one engine's requests against its tokenizer, context and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # The model's: the width of its logits, so what top_k and sampled ids range over.
        self.vocab_size = vocab_size
        # A prompt's ids must be ones the model embeds and the tokenizer spells (echo and
        # prompt logprobs show them as text).
        self.token_vocab_size = min(vocab_size, tokenizer.vocab_size)

    def check_length(self, num_chars: int) -> None:
        """Refuses, before tokenizing, a text too long to fit the context with any tokenization:
        a 15 MB prompt costs nothing, instead of seconds of tokenizing and gigabytes of memory."""
        if self.tokenizer.surely_exceeds(num_chars, self.max_model_len):
            raise RequestError(
                f"the prompt has {num_chars} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids, unless its length alone refuses it."""
        self.check_length(len(text))
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens)
        except ValueError as e:  # text that is not valid Unicode
            raise RequestError(str(e), "prompt", None) from e

    def encode_chat(self, messages: list[dict[str, Any]], /, **template_kwargs: Any) -> list[int]:
        """A conversation's ids through the checkpoint's chat template, unless the length of
        its contents alone refuses it. Messages are in the shape transformers'
        apply_chat_template takes; template_kwargs (tools, ...) are the template's variables,
        whatever their names (`self` too)."""
        # The rendered prompt holds every message's content.
        self.check_length(
            sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        )
        try:
            return self.tokenizer.encode_chat(messages, **template_kwargs)
        except ValueError as e:  # no template, or the template rejected the conversation
            raise RequestError(str(e), "prompt", None) from e

    def check_prompt(
        self, prompt: str | list[int], output: bool = True, truncate: bool = False
    ) -> CheckedPrompt:
        """A prompt's ids (a text is encoded), refused if empty, if they leave no room for
        output in the context, or if one is outside the vocabulary.

        An embedding's prompt (output=False) has no output, so it may fill the context; with
        truncate, one longer than the context keeps its first tokens that fit instead."""
        if isinstance(prompt, CheckedPrompt):
            return prompt
        most = self.max_model_len - 1 if output else self.max_model_len
        ids = prompt
        if isinstance(prompt, str) and truncate:
            # Only the text's start is encoded: a cut that surely holds about twice the tokens
            # kept, so that those lie far from the cut, where it encodes as the whole text.
            cut = prompt[: 4 * self.tokenizer.max_token_chars * most]
            ids = self._encode(cut) if cut else []
        elif isinstance(prompt, str):
            # An empty text is an empty prompt, even where the tokenizer would add BOS to it.
            ids = self.encode(prompt) if prompt else []
        if not ids:
            raise RequestError("the prompt is empty", "prompt", None)
        if truncate:
            ids = ids[:most]
        if len(ids) > most:
            if output:
                context = (
                    f"{self.max_model_len} tokens, prompt and output together (at most "
                    f"{most} leave room for output)"
                )
            else:
                context = f"{self.max_model_len} tokens"
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but this model's context is {context}",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )
        self.check_token_ids(ids, "prompt")
        return CheckedPrompt(ids)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Token ids a client sent as text (a prompt, ids to detokenize) must be in the
        vocabulary."""
        _check_ids(ids, self.token_vocab_size, param)

    def output_budget(self, requested: int | None, prompt_len: int) -> int:
        """max_tokens for a checked prompt of prompt_len tokens: `requested` if the context has
        room for it, all the room there is when None. (SamplingParams refuses a negative one.)"""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise RequestError(
                f"max_tokens can be at most {room}: this model's maximum context length is "
                f"{self.max_model_len} tokens, and the prompt has {prompt_len} of them "
                f"({prompt_len + requested} were requested)",
                "max_tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
        return requested

    def check_params(self, params: SamplingParams) -> None:
        """The sampling options bounded by the model's vocabulary: top_k and stop_token_ids.
        (SamplingParams checked the others when it was made.)"""
        if params.top_k > self.vocab_size:
            raise RequestError(
                f"top_k must be at most the vocabulary size {self.vocab_size}, got {params.top_k}",
                "top_k",
                None,
            )
        _check_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param, None
        )
