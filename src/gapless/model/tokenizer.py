"""Tokenizer and streaming detokenizer for Hugging Face checkpoints, without `transformers`.

Behaviour follows `transformers.AutoTokenizer` on the same files (encode ids, chat template
text and ids, decode), which the tests check, so prompts match what a model was trained on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors

NO_CHAT_TEMPLATE = "this checkpoint has no chat template; use /v1/completions"
INVALID_UNICODE = "the text is not valid Unicode: it holds a lone surrogate such as \\ud800"

# The names transformers exposes to chat templates when they are set.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# A message's reasoning goes by these names; transformers shows it to a template under the
# first two whichever was given (Qwen3's templates read `reasoning_content`, gpt-oss's
# `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as plain strings or AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _load_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # transformers gives a separate chat_template.jinja precedence over the config entry.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(f"chat templates {sorted(named)} include none named 'default'")
        return named["default"]
    return template


def is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (JSON can spell one: "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a chat template: a None field is absent, and
    reasoning is under `thinking` and `reasoning_content` whatever its name."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"invalid chat template: {e}") from e


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as a printable character: printable Latin-1 bytes as
    themselves, the rest as code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table |= {chr(256 + i): b for i, b in enumerate(shifted)}
    return table


_BYTE_LEVEL_DECODE = _byte_level_alphabet()


def _contains_decoder(spec: Any, kind: str) -> bool:
    if isinstance(spec, dict):
        return spec.get("type") == kind or any(_contains_decoder(v, kind) for v in spec.values())
    if isinstance(spec, list):
        return any(_contains_decoder(v, kind) for v in spec)
    return False


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode and chat templating."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """`config` is the tokenizer_config.json content; `eos_token_ids` extra stop ids."""
        config = config or {}
        self._backend = backend
        # tokenizer.json may carry truncation/padding meant for training; a server must never
        # silently cut or pad a prompt (transformers also disables them unless asked).
        backend.no_truncation()
        backend.no_padding()
        self._sync_added_tokens(config.get("added_tokens_decoder") or {})

        self.special_token_strings: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_token_strings[name] = content
        self.bos_token: str | None = self.special_token_strings.get("bos_token")
        self.eos_token: str | None = self.special_token_strings.get("eos_token")
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        eos_id = self._id_of(self.eos_token)
        # The one record of the tokens that end generation (the engine reads it): this, config.json's
        # and generation_config.json's for a checkpoint; a GGUF file's eos and eot.
        self.eos_token_ids: set[int] = set(eos_token_ids) | _id_set(eos_id)

        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_post_processor(
                bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
            )
        # If the post-processor prepends BOS, a text that already starts with it must not get a
        # second one (transformers would double it; a model never saw that in training).
        auto_prefix = backend.encode("", add_special_tokens=True).ids[:1]
        self._adds_bos = self.bos_token_id is not None and auto_prefix == [self.bos_token_id]

        added = backend.get_added_tokens_decoder()
        self.special_ids: set[int] = {i for i, tok in added.items() if tok.special}
        self.special_ids |= {
            i for i in map(self._id_of, self.special_token_strings.values()) if i is not None
        }
        self.vocab_size: int = max(
            backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1
        )

        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None

        decoder = backend.decoder
        # Decoders pickle to their JSON spec: cheaper than serializing the whole tokenizer.
        decoder_spec = None if decoder is None else json.loads(decoder.__getstate__())
        # ByteFallback decodes a run of <0xNN> pieces all-or-nothing, so the detokenizer must
        # know which ids are byte pieces (see IncrementalDetokenizer).
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if _contains_decoder(decoder_spec, "ByteFallback"):
            self.byte_fallback_ids = frozenset(
                i
                for piece, i in backend.get_vocab(with_added_tokens=False).items()
                if _BYTE_FALLBACK_PIECE.fullmatch(piece)
            )
        self._byte_level = _contains_decoder(decoder_spec, "ByteLevel")
        self._anchor = self._find_anchor()
        # A piece spells at least as many characters as it covers in the input (byte-level
        # pieces one per byte, sentencepiece pieces one per character), so this bounds how
        # much text one token can stand for.
        self.max_token_chars: int = max(map(len, backend.get_vocab(with_added_tokens=True)))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory holding tokenizer.json and friends."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found (only fast tokenizers are supported)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        eos_ids = _id_set(_read_json(path / "config.json").get("eos_token_id"))
        eos_ids |= _id_set(_read_json(path / "generation_config.json").get("eos_token_id"))
        return cls(backend, config, _load_chat_template(path, config), sorted(eos_ids))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _sync_added_tokens(self, declared: dict[str, Any]) -> None:
        # transformers re-registers tokenizer_config's added tokens, so their flags (special,
        # lstrip, ...) win over tokenizer.json's. Only same-id updates are applied: adding a
        # token elsewhere would shift ids the model was trained with.
        current = self._backend.get_added_tokens_decoder()
        for key, spec in declared.items():
            token_id = int(key)
            token = AddedToken(
                spec["content"],
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", True),
                special=spec.get("special", False),
            )
            if repr(current.get(token_id)) == repr(token):
                continue
            if self._backend.token_to_id(token.content) == token_id or (
                self._backend.token_to_id(token.content) is None
                and token_id == self._backend.get_vocab_size(with_added_tokens=True)
            ):
                self._backend.add_tokens([token])

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        # Mirrors transformers: explicit add_bos_token/add_eos_token replace tokenizer.json's
        # post-processor with one built from exactly these flags.
        bos, eos = self.bos_token, self.eos_token
        add_bos = add_bos and self.bos_token_id is not None
        add_eos = add_eos and eos is not None and self._id_of(eos) is not None
        single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
        pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
        special: list[tuple[str, int]] = []
        if add_bos:
            special.append((bos, self.bos_token_id))
        if add_eos:
            special.append((eos, self._id_of(eos)))
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )

    def _find_anchor(self) -> tuple[int, str] | None:
        # A plain one-character token to decode in front of a token, so token_text() sees the
        # token mid-text (sentencepiece decoders strip a leading space from the first token).
        for char in "aeox0.":
            token_id = self._backend.token_to_id(char)
            if token_id is not None and self.decode([token_id], False) == char:
                return token_id, char
        return None

    def surely_exceeds(self, num_chars: int, max_tokens: int) -> bool:
        """Whether a text of num_chars characters must encode to more than max_tokens tokens.

        Decided without encoding it, so a huge text is refused at once. The factor 2 leaves
        room for normalizers that merge characters.
        """
        return num_chars > 2 * self.max_token_chars * max_tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not is_unicode(text):
            raise ValueError(INVALID_UNICODE)
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._adds_bos and ids[:2] == [self.bos_token_id] * 2:
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_text(self, token_id: int) -> str:
        """The text one token contributes mid-sequence (U+FFFD for a partial UTF-8 byte)."""
        if self._anchor is None:
            return self._backend.decode([token_id], skip_special_tokens=False)
        anchor_id, anchor_text = self._anchor
        text = self._backend.decode([anchor_id, token_id], skip_special_tokens=False)
        return text[len(anchor_text) :] if text.startswith(anchor_text) else text

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes, also when they are part of a character."""
        piece = self._backend.id_to_token(token_id)
        if piece is None or token_id in self.special_ids:
            return self.token_text(token_id).encode()
        if byte := _BYTE_FALLBACK_PIECE.fullmatch(piece):
            return bytes([int(byte.group(1), 16)])
        if self._byte_level:
            return bytes(_BYTE_LEVEL_DECODE.get(c, 0) for c in piece)
        return self.token_text(token_id).encode()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages to prompt text; extra kwargs (e.g. tools) go to the template.

        `messages` and `add_generation_prompt` are always these arguments: a kwarg of the same
        name cannot replace them.
        """
        if self.chat_template is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        messages = [_template_message(m) for m in messages]
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self.special_token_strings)
        variables.update(kwargs)
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
        try:
            return self._compiled_template.render(variables)
        except Exception as e:  # a template is a program: any failure is the template's
            raise ValueError(f"chat template error: {e}") from e

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids for a conversation, as transformers' apply_chat_template(tokenize=True)."""
        # The template writes any BOS itself; adding special tokens again would double it.
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas, in time proportional to the new tokens.

    Only a short window is decoded each step: `ids[prefix:]` is compared with the cached
    decode of `ids[prefix:read]`, and the difference is the delta. Both decodes start at the
    same token, so decoders that treat the first token specially (sentencepiece strips its
    leading space) affect them alike. `read` only advances to a point where the text ends in a
    complete character, which makes it a clean restart point for the next window.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is unfinished)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        if self._ends_in_byte_piece():
            return ""
        window = self._tok.decode(self._ids[self._prefix :], self._skip)
        # U+FFFD at the end may be a character whose remaining bytes are still to come.
        if len(window) <= len(self._prefix_text) or window.endswith("\ufffd"):
            return ""
        delta = self._delta(window)
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        return delta

    def flush(self) -> str:
        """At end of stream: whatever is still held back, even an unfinished character."""
        delta = self._delta(self._tok.decode(self._ids[self._prefix :], self._skip))
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return delta

    def _delta(self, window: str) -> str:
        if window.startswith(self._prefix_text):
            delta = window[len(self._prefix_text) :]
        else:
            # A decoder that rewrites earlier text: fall back to diffing the full decode.
            full = self._tok.decode(self._ids, self._skip)
            delta = full[len(self._text) :] if full.startswith(self._text) else ""
        self._text += delta
        return delta

    def _ends_in_byte_piece(self) -> bool:
        # ByteFallback turns a whole run of <0xNN> pieces into U+FFFDs if any byte in it is
        # invalid, so a character completed by the run can still be undone by the next piece.
        # Holding text while the stream ends in a byte piece never splits such a run. The cost:
        # byte-coded text (a rare CJK character, an emoji) shows up one token late, when the
        # run ends; and a run of n pieces costs O(n^2) to decode, harmless for real runs.
        byte_ids = self._tok.byte_fallback_ids
        if not byte_ids:
            return False
        skipped = self._tok.special_ids if self._skip else ()
        for token_id in reversed(self._ids):
            if token_id not in skipped:
                return token_id in byte_ids
        return False
