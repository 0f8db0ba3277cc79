"""Tokenizer, chat template and streaming detokenizer, checked against transformers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from checkpoints import UNICODE_SAMPLE, write_test_tokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from gapless.model.demo import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_bpe_tokenizer,
    ensure_demo_checkpoint,
)
from gapless.model.tokenizer import NO_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n",
    "Ünïcödé: 中文 日本語 한국어 Ωμέγα",
    "emoji 😀🎉 flags 🇫🇷 skin 👍🏽 zwj 👩‍💻",
    "special text <|user|>hi<|end|> inline",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? <b>&</b> 中文 😀"},
    ],
    [
        {"role": "user", "content": "  spaces  \n"},
        {"role": "assistant", "content": "ok", "tool_calls": None},
    ],
]

# A whitespace-heavy template in the style of real ones: namespace, loop controls, trim,
# tojson on tools with HTML and non-ASCII characters.
RICH_TEMPLATE = """{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- set ns.system = message.content %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{{ bos_token }}
{%- if tools %}
<|system|>{{ ns.system }}
Tools: {{ tools | tojson }}<|end|>
{% elif ns.system %}
<|system|>{{ ns.system }}<|end|>
{% endif %}
{% for message in messages if message.role != 'system' %}
    {% if message.role not in ['user', 'assistant'] %}
        {{ raise_exception('role ' + message.role + ' is not supported') }}
    {% endif %}
<|{{ message.role }}|>
{{ message.content | trim }}{{ eos_token if message.role == 'assistant' else '<|end|>' }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

TOOLS = [{"name": "lookup", "description": 'Find <things> & "stuff" — vite', "parameters": {}}]


def _variant(src: Path, dst: Path, **config_changes: Any) -> Path:
    """Copy tokenizer files, changing tokenizer_config.json keys (None deletes a key)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


def _both(path: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


# --- encode / decode -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bos_in_files", "changes"),
    [
        (True, {}),
        (False, {}),
        (True, {"add_bos_token": None, "add_eos_token": None}),  # tokenizer.json decides
        (False, {"add_bos_token": None, "add_eos_token": None}),
    ],
    ids=["bos", "no-bos", "bos-post-processor-only", "no-post-processor"],
)
def test_encode_matches_transformers(
    test_tokenizer_dir: Path, tmp_path: Path, bos_in_files: bool, changes
) -> None:
    src = (
        test_tokenizer_dir
        if bos_in_files
        else write_test_tokenizer(tmp_path / "src", add_bos_token=False)
    )
    ours, hf = _both(_variant(src, tmp_path / "tok", **changes))
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == hf.encode(text, add_special_tokens=special), text
    first = 0 if bos_in_files else ours.backend.token_to_id("h")
    assert ours.encode("hi")[0] == first


def test_add_bos_token_flag_wins_over_post_processor(test_tokenizer_dir: Path, tmp_path) -> None:
    # A tokenizer_config flag that disagrees with tokenizer.json: gapless follows the flag, as
    # transformers 4.x did. transformers 5 ignores the flag whenever tokenizer.json exists.
    body = Tokenizer.from_pretrained(test_tokenizer_dir).encode("hi", add_special_tokens=False)
    off = _variant(test_tokenizer_dir, tmp_path / "off", add_bos_token=False)
    assert Tokenizer.from_pretrained(off).encode("hi") == body
    assert AutoTokenizer.from_pretrained(off).encode("hi") == [0, *body]

    no_pp = write_test_tokenizer(tmp_path / "no-pp", add_bos_token=False)
    on = _variant(no_pp, tmp_path / "on", add_bos_token=True, add_eos_token=True)
    assert Tokenizer.from_pretrained(on).encode("hi") == [0, *body, 6]
    assert AutoTokenizer.from_pretrained(on).encode("hi") == body


def test_bos_is_prepended(test_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    bos = tok.backend.token_to_id("<|bos|>")
    assert tok.bos_token_id == bos == 0
    assert tok.encode("hi") == [bos, *tok.encode("hi", add_special_tokens=False)]


def test_text_starting_with_bos_gets_one_bos(test_tokenizer_dir: Path) -> None:
    ours, hf = _both(test_tokenizer_dir)
    body = ours.encode("hi", add_special_tokens=False)
    assert ours.encode("<|bos|>hi") == [0, *body]
    # Deliberate difference: transformers doubles it, which no model saw in training.
    assert hf.encode("<|bos|>hi") == [0, 0, *body]
    assert ours.encode("<|bos|><|bos|>hi") == [0, 0, *body]  # text written twice stays twice


def test_decode_matches_transformers(test_tokenizer_dir: Path) -> None:
    ours, hf = _both(test_tokenizer_dir)
    for text in TEXTS:
        ids = ours.encode(text) + [ours.backend.token_to_id("<|end|>")]
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == "<|bos|>" + text


def test_vocab_and_special_ids(test_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    names = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    assert tok.vocab_size == 512 == len(AutoTokenizer.from_pretrained(test_tokenizer_dir))
    assert tok.special_ids == set(range(7))
    assert tok.convert_ids_to_tokens(range(7)) == names
    assert tok.eos_token_ids == {6}  # only tokenizer_config's eos_token without config.json


def test_token_text(test_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    (space_a,) = tok.encode(" a", add_special_tokens=False)
    assert tok.convert_ids_to_tokens([space_a]) == ["Ġa"]
    assert tok.token_text(space_a) == " a"
    assert tok.token_text(6) == "<|end|>"
    partial = tok.encode("中", add_special_tokens=False)
    assert len(partial) > 1 and tok.token_text(partial[0]) == "\ufffd"


# --- eos ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config_eos", "generation_eos", "expected"),
    [
        (1, [6, 1], {1, 6}),
        ([1, 3], 4, {1, 3, 4, 6}),
        (5, None, {5, 6}),
        (None, None, {6}),
    ],
)
def test_eos_ids_union(
    test_tokenizer_dir: Path, tmp_path: Path, config_eos, generation_eos, expected
) -> None:
    path = _variant(test_tokenizer_dir, tmp_path)
    (path / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert Tokenizer.from_pretrained(path).eos_token_ids == expected


def test_checkpoint_eos_ids(checkpoint) -> None:
    tok = Tokenizer.from_pretrained(checkpoint("llama"))
    assert tok.eos_token_ids == {1, 6}  # <|eos|> from config.json, <|end|> from the others


# --- chat template -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [CHAT_TEMPLATE, RICH_TEMPLATE, [{"name": "default", "template": RICH_TEMPLATE}]],
    ids=["demo", "rich", "named-list"],
)
def test_chat_template_matches_transformers(test_tokenizer_dir: Path, tmp_path: Path, template):
    if isinstance(template, list):
        template = [{"name": "tool_use", "template": "unused"}, *template]
    ours, hf = _both(_variant(test_tokenizer_dir, tmp_path, chat_template=template))
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"tools": TOOLS}):
                text = ours.apply_chat_template(messages, add_generation_prompt=gen, **extra)
                hf_kwargs = {"add_generation_prompt": gen, **extra}
                if isinstance(template, list) and extra:
                    # transformers picks a template named "tool_use" when tools are given;
                    # gapless always renders "default".
                    hf_kwargs["chat_template"] = "default"
                assert text == hf.apply_chat_template(messages, tokenize=False, **hf_kwargs)
                ids = hf.apply_chat_template(messages, return_dict=False, **hf_kwargs)
                assert ours.encode_chat(messages, gen, **extra) == ids


def test_chat_template_exact_text(test_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(messages) == (
        "<|bos|><|system|>S<|end|><|user|>U<|end|><|assistant|>"
    )
    ids = tok.encode_chat(messages)
    assert ids[:2] == [0, 5] and ids.count(0) == 1 and ids[-1] == 4


def test_chat_template_file_takes_precedence(test_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = _variant(test_tokenizer_dir, tmp_path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    ours, hf = _both(path)
    messages = CONVERSATIONS[1]
    assert (
        ours.apply_chat_template(messages)
        == "[You are terse.][What is 2+2?][4][And 3+3? <b>&</b> 中文 😀]"
    )
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)


def test_chat_template_errors(test_tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    with pytest.raises(ValueError, match="unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])

    broken = Tokenizer.from_pretrained(
        _variant(test_tokenizer_dir, tmp_path / "broken", chat_template="{% for m in messages %}")
    )
    with pytest.raises(ValueError, match="invalid chat template"):
        broken.apply_chat_template(CONVERSATIONS[0])

    none = Tokenizer.from_pretrained(
        _variant(test_tokenizer_dir, tmp_path / "none", chat_template=None)
    )
    with pytest.raises(ValueError, match=NO_CHAT_TEMPLATE):
        none.apply_chat_template(CONVERSATIONS[0])


# --- incremental detokenizer -------------------------------------------------------------------


def _sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-2-like BPE: ▁ for spaces, <0xNN> byte fallback, decoder that strips one space."""
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre
    corpus = [
        "The quick brown fox jumps over the lazy dog. " * 20,
        "def f():\n    return 42\n" * 20,
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=60,
        show_progress=False,
    )
    # A few CJK characters get their own piece, the rest fall back to bytes.
    trainer_tok.train_from_iterator([*corpus, "中文中文 éé"], trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for piece in ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]:
        vocab[piece] = len(vocab)
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.pre_tokenizer = pre
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    return Tokenizer(backend, config)


def _stream(tok: Tokenizer, ids: list[int], skip: bool, rng: random.Random) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        delta = detok.add(ids[i : i + n])
        i += n
        delta.encode("utf-8")  # raises on lone surrogates
        assert not delta.endswith("\ufffd"), (ids[:i], delta)
        deltas.append(delta)
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def _mixed_stream(tok: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """Random ids (invalid byte runs, specials) interleaved with encodings of real text."""
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.5:
            ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 6))]
        else:
            start = rng.randrange(len(UNICODE_SAMPLE))
            piece = UNICODE_SAMPLE[start : start + rng.randint(1, 30)]
            ids += tok.encode(piece, add_special_tokens=False)
    return ids[:length]


def _has_partial_utf8_pieces(tok: Tokenizer) -> bool:
    # Pieces of 2+ bytes that are not whole UTF-8 text (e.g. the first two bytes of 中).
    return any(
        tok.token_text(i) == "\ufffd" and len(tok.convert_ids_to_tokens([i])[0]) >= 2
        for i in range(tok.vocab_size)
    )


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_streams(test_tokenizer_dir: Path, kind: str, skip: bool) -> None:
    if kind == "byte-level":
        tok = Tokenizer.from_pretrained(test_tokenizer_dir)
        assert _has_partial_utf8_pieces(tok)
    else:
        tok = _sentencepiece_style_tokenizer()
        assert len(tok.byte_fallback_ids) == 256
    rng = random.Random(1234)
    for _ in range(20):
        ids = _mixed_stream(tok, rng, 400)
        assert "".join(_stream(tok, ids, skip, rng)) == tok.decode(ids, skip)


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_detokenizer_real_text_has_no_replacement_chars(test_tokenizer_dir: Path, kind) -> None:
    if kind == "byte-level":
        tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    else:
        tok = _sentencepiece_style_tokenizer()
    text = "Hello world 中文 😀 👩‍💻 ünï " + UNICODE_SAMPLE
    ids = tok.encode(text)
    deltas = _stream(tok, ids, True, random.Random(0))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_style_stream_and_token_text() -> None:
    tok = _sentencepiece_style_tokenizer()
    ids = tok.encode("The quick fox 中😀!")
    assert tok.convert_ids_to_tokens(ids) == [
        "<s>", "▁The", "▁quick", "▁fox", "▁", "中",
        "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x21>",
    ]  # fmt: skip
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    # The decoder strips the first space only; byte pieces wait for the end of their run.
    assert deltas == ["", "The", " quick", " fox", " ", "中", "", "", "", "", "", "😀!"]
    assert [tok.token_text(i) for i in ids[:6]] == ["<s>", " The", " quick", " fox", " ", "中"]
    assert tok.token_text(ids[6]) == "\ufffd"


def test_detokenizer_holds_split_character(test_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    ids = tok.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # 'a' and a multi-token emoji
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[0] == "a" and deltas[-1] == "😀" and set(deltas[1:-1]) == {""}
    cut = IncrementalDetokenizer(tok)
    assert [cut.add([ids[0]]), cut.add(ids[1:-1])] == ["a", ""]
    assert cut.flush() == "\ufffd"  # the stream really ended mid-character


def test_detokenizer_window_stays_small(test_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    sizes: list[int] = []
    decode = tok.decode

    def spy(ids, skip_special_tokens=True):
        sizes.append(len(ids))
        return decode(ids, skip_special_tokens)

    tok.decode = spy  # type: ignore[method-assign]
    ids = tok.encode(UNICODE_SAMPLE * 20)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == UNICODE_SAMPLE * 20
    assert max(sizes) <= 8


# --- demo checkpoint ---------------------------------------------------------------------------


def test_bpe_training_is_deterministic() -> None:
    first = build_bpe_tokenizer(300, max_bytes=200_000)
    assert first.to_str() == build_bpe_tokenizer(300, max_bytes=200_000).to_str()
    assert first.get_vocab_size() == 300
    assert [first.id_to_token(i) for i in range(7)] == list(SPECIAL_TOKENS)


def test_demo_checkpoint(demo_checkpoint: Path) -> None:
    from safetensors import safe_open

    config = json.loads((demo_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 4096
    tok = Tokenizer.from_pretrained(demo_checkpoint)
    assert tok.vocab_size == 4096
    assert tok.eos_token_ids == {1, 6}  # <|eos|>, <|end|>
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[:2] == [0, 3] and ids[-2:] == [6, 4]
    with safe_open(str(demo_checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (4096, 256)
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
    assert len(names) == 2 + 4 * 9 and "lm_head.weight" not in names  # tied embeddings
    # A second call reuses the complete checkpoint instead of rebuilding it.
    mtime = (demo_checkpoint / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint(demo_checkpoint.parent) == demo_checkpoint
    assert (demo_checkpoint / "model.safetensors").stat().st_mtime_ns == mtime


def test_token_bytes_concatenate_to_the_utf8_of_the_text(test_tokenizer_dir):
    tok = Tokenizer.from_pretrained(test_tokenizer_dir)
    text = "def f(x): return '今日は 😀 ß'"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    # Some token is a fragment of a character: its bytes are not valid UTF-8 on their own.
    assert any(tok.token_text(i) == "\ufffd" for i in ids)
