"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library from the file's metadata.

A GGUF has no tokenizer.json: it stores the vocabulary under llama.cpp's `tokenizer.ggml.*`
keys. Two kinds are rebuilt: `gpt2` (byte-level BPE from tokens and merges, split the way
`tokenizer.ggml.pre` names) and `llama` (sentencepiece-style BPE with byte fallback, whose
merges follow from the token scores). Ids match transformers' GGUF tokenizer on the same file.
"""

from __future__ import annotations

from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from gapless.model.tokenizer import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL, USER_DEFINED = 3, 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


# tokenizer.ggml.pre -> how text is split before the merges apply.
BYTE_LEVEL_PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    # SmolLM was trained with every digit its own piece (llama.cpp splits `\p{N}` first too).
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_split()]
    ),
    "qwen2": lambda: _split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split(_QWEN2_SPLIT),
    "llama-bpe": lambda: _split(_LLAMA3_SPLIT),
    "llama3": lambda: _split(_LLAMA3_SPLIT),
}


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value, or `default` where the file lacks the key."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _byte_level(reader: gguf.GGUFReader, vocab: dict[str, int]) -> tokenizers.Tokenizer:
    pre = field_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in BYTE_LEVEL_PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: "
            f"{', '.join(BYTE_LEVEL_PRE_TOKENIZERS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    backend.pre_tokenizer = BYTE_LEVEL_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges the pair whose joined piece scores highest: every split of a
    piece into two vocabulary pieces is a merge, ranked by the joined piece's score."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = sorted(
            ((a, b) for a, b in splits if a in ids and b in ids),
            key=lambda p: (ids[p[0]], ids[p[1]]),
        )
        ranked += [(-score, len(a), len(b), a, b) for a, b in pairs]
    # sorted() is stable, so equal keys keep the vocabulary order above.
    ranked.sort(key=lambda r: r[:3])
    return [(a, b) for *_, a, b in ranked]


def _sentencepiece(
    reader: gguf.GGUFReader, vocab: dict[str, int], tokens: list[str], unk: str | None
) -> tokenizers.Tokenizer:
    merges = merges_from_scores(tokens, field_value(reader, "tokenizer.ggml.scores"))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix_space = field_value(reader, "tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describe, with its chat template and stop ids."""
    kind = field_value(reader, "tokenizer.ggml.model")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("this GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    vocab = {t: i for i, t in enumerate(tokens)}

    def token(key: str) -> str | None:
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[token_id]

    if kind == "gpt2":
        backend = _byte_level(reader, vocab)
    elif kind == "llama":
        backend = _sentencepiece(reader, vocab, tokens, token("unknown"))
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {kind!r}; supported: gpt2, llama")

    # Control tokens (<|im_start|>, <s>) and user-defined ones (<think>) match whole in text;
    # only control tokens are special (dropped when decoding with skip_special_tokens).
    types = field_value(reader, "tokenizer.ggml.token_type") or []
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types, strict=False)
            if k == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED
        ]
    )
    config = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
        "add_bos_token": field_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama"),
        "add_eos_token": field_value(reader, "tokenizer.ggml.add_eos_token", False),
    }
    eos_ids = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return Tokenizer(
        backend,
        config,
        field_value(reader, "tokenizer.chat_template"),
        [i for i in eos_ids if i is not None],
    )
