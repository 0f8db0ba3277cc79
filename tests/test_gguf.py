"""GGUF files load as they are: weights, config and tokenizer agree with transformers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from checkpoints import UNICODE_SAMPLE
from gguf import GGMLQuantizationType as QType
from helpers import require_our_kernels
from test_model import ModelRunner, Seq, prompt, run_chunks
from test_quantize import mean_kl, rel_err

from gapless.bench.gguf_files import write_gguf
from gapless.kernels.linear import BlockLinear, StackedLinear
from gapless.kernels.quant import BlockQuant
from gapless.model.gguf import dequantize, load_gguf, unpack
from gapless.model.loader import WeightError, load_decoder
from gapless.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! It's 2024: don't   stop\n\n  now.\tTabs and 12345 digits.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    UNICODE_SAMPLE,
    "<|user|>special <|end|> tokens<|assistant|>mid-text<|bos|>",
]


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory):
    """Factory: `gguf_file("llama", QType.Q4_0)` -> a GGUF file of that tiny checkpoint."""
    built = {}

    def get(arch: str, qtype: QType = QType.F32, pre: str = "gpt-2", **overrides) -> object:
        key = (arch, qtype, pre, tuple(sorted(overrides)))
        if key not in built:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{qtype.name}-{pre}.gguf"
            built[key] = write_gguf(checkpoint(arch, **overrides), out, qtype, pre)
        return built[key]

    return get


# A plain rope: llama3 rope scaling is written as a rope_freqs tensor, which gapless refuses.
PLAIN_LLAMA = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# What a smollm3 file can say: llama.cpp takes every 4th layer NoPE and no window.
SMOLLM3_AS_LLAMA_CPP = {
    "no_rope_layer_interval": 4,
    "use_sliding_window": False,
    "layer_types": None,
}
# llama.cpp takes a gemma2 file's query_pre_attn_scalar to be head_dim; its soft-caps (3 and 8
# here, not the defaults) and window are read from the file.
GEMMA2_AS_LLAMA_CPP = {"query_pre_attn_scalar": 32}
GGUF_ARCHS = {
    "llama": PLAIN_LLAMA,
    "llama_linear": {},
    "qwen2": {},
    "qwen3": {},
    "smollm3": SMOLLM3_AS_LLAMA_CPP,
    "gemma2": GEMMA2_AS_LLAMA_CPP,
}


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1])
def test_unpacked_types_dequantize_as_the_reference(qtype):
    gen = np.random.default_rng(0)
    w = (gen.standard_normal((48, 256)) * gen.uniform(0.01, 3, (48, 1))).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block has scale 0
    blocks = gguf.quants.quantize(w, qtype)
    quant = unpack(torch.from_numpy(blocks), qtype)
    assert quant.codes.shape == w.shape and quant.scale.shape == (48, 8)
    if qtype == QType.Q8_0:
        assert quant.codes.dtype == torch.int8 and quant.offset is None
    else:  # the form int4 kernels take: codes 0..15, scale and offset per group of 32
        assert quant.codes.dtype == torch.uint8 and int(quant.codes.max()) <= 15
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(quant.dequantize(), reference)


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_f32_gguf_logits_match_the_checkpoint(checkpoint, gguf_file, arch):
    ids = prompt(40)
    reference = load_decoder(checkpoint(arch, **GGUF_ARCHS[arch]), "float32")
    decoder, _ = load_gguf(gguf_file(arch, **GGUF_ARCHS[arch]), "float32")
    want = run_chunks(ModelRunner(reference, 8, 16), Seq(ids, 0), [40])
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [40])
    assert (got - want).abs().max().item() < 1e-4


def test_bf16_gguf_runs_as_the_checkpoint_in_bf16(checkpoint, gguf_file):
    # transformers' GGUF loader misreads BF16 tensors, so the reference is our own bf16 run.
    ids = prompt(40)
    reference = load_decoder(checkpoint("llama", **PLAIN_LLAMA), "bfloat16")
    decoder, _ = load_gguf(gguf_file("llama", QType.BF16, **PLAIN_LLAMA), "bfloat16")
    want = run_chunks(ModelRunner(reference, 8, 16), Seq(ids, 0), [40])
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [40])
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "arch,qtype",
    [
        ("llama", QType.F32),
        ("llama", QType.F16),
        ("llama", QType.Q8_0),
        ("llama", QType.Q4_0),
        ("llama", QType.Q4_1),
        ("qwen2", QType.Q4_1),
    ],
)
def test_gguf_logits_match_transformers_gguf_loader(gguf_file, monkeypatch, arch, qtype):
    from transformers import AutoModelForCausalLM

    # Dequantized float32, exactly: the quantized paths multiply in bf16 where that is fast
    # (test_a_q4_k_m_mix_... checks them against transformers).
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")
    path = gguf_file(arch, qtype, **GGUF_ARCHS[arch])
    ids = prompt(24)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    decoder, _ = load_gguf(path, "float32")
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [24])
    assert (got - want).abs().max().item() < 1e-4


# The mix of a Q4_K_M file that llama.cpp's llama-quantize writes: Q4_K for most linears,
# Q6_K for attn_v and ffn_down (it alternates; here all of them) and the output; Q5_0 and
# Q8_0 show up where a width is not a multiple of 256, or for small models' embeddings.
Q4_K_M_MIX = {
    "attn_v": QType.Q6_K,
    "ffn_down": QType.Q6_K,
    "output.": QType.Q6_K,
    "attn_output": QType.Q5_0,
    "token_embd": QType.Q8_0,
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_q4_k_m_mix_runs_in_its_blocks_as_transformers_reads_the_file(checkpoint, tmp_path, arch):
    ckpt = checkpoint(arch, hidden_size=256, intermediate_size=512, **GGUF_ARCHS[arch])
    path = write_gguf(ckpt, tmp_path / "mixed.gguf", QType.Q4_K, mix=Q4_K_M_MIX)
    from transformers import AutoModelForCausalLM

    ids = prompt(28)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0].log_softmax(-1)
    decoder, _ = load_gguf(path)
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    layer = decoder.layers[0]
    assert isinstance(decoder.embed, BlockQuant) and isinstance(layer.down, BlockLinear)
    assert isinstance(layer.qkv, StackedLinear)  # Q4_K q and k beside a Q6_K v
    # A 20-token chunk dequantizes tiles of the weights (bf16 products where the CPU has
    # them); the single-token steps after it quantize the activations to 8 bits per block.
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [20, 4, 1, 1, 1, 1]).log_softmax(-1)
    # bf16 rounds each input of a chunk's products to 8 significant bits, and 8-bit blocks
    # round a decode's inputs to 1/254 of their block's largest (Q8_K: of 256 values):
    # each linear's output moves by ~0.3% and ~0.5-1% (test_block_kernels checks the kernels
    # themselves exactly). Through this random model's two layers that made a mean KL of
    # 3e-4..1e-3 nats, and moved probabilities by up to 0.04.
    assert mean_kl(want, got) < 5e-3
    assert (got.exp() - want.exp()).abs().max().item() < 0.1


def test_quantized_tensors_hold_their_blocks_and_nothing_more(checkpoint, tmp_path):
    ckpt = checkpoint("qwen2", hidden_size=256, intermediate_size=512)
    path = write_gguf(ckpt, tmp_path / "mixed.gguf", QType.Q4_K, mix=Q4_K_M_MIX)
    decoder, _ = load_gguf(path)
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    file_bytes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    held = [
        w
        for layer in decoder.layers
        for lin in (layer.o, layer.gate, layer.up, layer.down, *layer.qkv.parts)
        for w in [lin.weight]
    ]
    held.append(decoder.embed)
    for w in held:
        assert isinstance(w, BlockQuant)
        # Its own storage, exactly its blocks: no float copy, no view of a larger buffer.
        assert w.blocks.untyped_storage().nbytes() == w.blocks.numel()
    # q, k and v of one layer: three tensors of the file, as many bytes as there.
    first = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")
    qkv = decoder.layers[0].qkv.parts
    assert [p.weight.blocks.numel() for p in qkv] == [file_bytes[n] for n in first]
    assert decoder.lm_head.weight is decoder.embed  # tied: one copy serves both
    quantized = [n for name, n in file_bytes.items() if "norm" not in name and "bias" not in name]
    assert sum(w.blocks.numel() for w in held) == sum(quantized)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0])
def test_quantized_gguf_runs_as_dequantized(gguf_file, monkeypatch, qtype):
    # In its blocks on our kernels.
    path, ids = gguf_file("llama", qtype, **PLAIN_LLAMA), prompt(32)
    decoder, _ = load_gguf(path, "float32")
    require_our_kernels(decoder.kernels.gguf_blocks, "our GGUF block kernels")
    layer = decoder.layers[0]
    assert all(isinstance(lin, BlockLinear) for lin in (layer.qkv, layer.down))
    monkeypatch.setenv("GAPLESS_KERNELS", "fallback")  # dequantized float32 weights
    dequantized, _ = load_gguf(path, "float32")
    want = run_chunks(ModelRunner(dequantized, 8, 16), Seq(ids, 0), [32])
    got = run_chunks(ModelRunner(decoder, 8, 16), Seq(ids, 0), [16, 16])
    # 16-row chunks run as decodes do: activations in 8 bits per block of 32 (llama.cpp's
    # scheme), each off by up to 1/254 of its block's largest, coarser than bf16 for the
    # small ones. Through two layers that moved the largest logit by ~5% here.
    assert rel_err(got, want) < 0.1 and mean_kl(want, got) < 5e-3


def test_prompt_chunks_multiply_dense_copies_where_they_fit(gguf_file, monkeypatch, caplog):
    """Kept beside the blocks, a dense copy of each weight runs the prompt chunks: the same
    weights and dtype as dequantizing the blocks every step, so the same logits up to the
    GEMMs' summation order; decodes still read the blocks."""
    path, ids = gguf_file("llama", QType.Q4_1, **PLAIN_LLAMA), prompt(48)
    copied, _ = load_gguf(path)
    require_our_kernels(copied.kernels.gguf_blocks, "our GGUF block kernels")
    linears = [lin for layer in copied.layers for lin in (layer.qkv, layer.o, layer.down)]
    assert copied.kernels.gguf_prompt_copies and all(lin.prompt_copy for lin in linears)
    assert copied.lm_head.narrow.prompt_copy is None  # it multiplies sampled rows only
    monkeypatch.setattr("gapless.model.gguf.PROMPT_COPIES_SHARE", 1e-9)
    with caplog.at_level("INFO", logger="gapless.model"):
        blocks_only, _ = load_gguf(path)
    assert not blocks_only.kernels.gguf_prompt_copies
    assert "would take more than" in caplog.text
    chunks = [40, 1, 1, 1, 1, 1, 1, 1, 1]  # a prompt chunk, then decode-sized rows
    want = run_chunks(ModelRunner(blocks_only, 8, 16), Seq(ids, 0), chunks)
    got = run_chunks(ModelRunner(copied, 8, 16), Seq(ids, 0), chunks)
    # The two paths sum the same bf16 products in other orders (AMX tiles against AVX-512
    # dot products: 1.04e-4 on a Sapphire Rapids, under 1e-4 on Zen 4); a copy of weights 1%
    # off gives about ten times the bound.
    assert mean_kl(want, got) < 3e-4 and rel_err(got, want) < 0.02


def test_a_file_of_dequantized_weights_runs_float32_by_default(gguf_file):
    # As files with int4 weights do; in bf16 Gemma 3 270M's Q4_K_M file fell into loops.
    decoder, _ = load_gguf(gguf_file("llama", QType.Q8_0, **PLAIN_LLAMA))
    assert decoder.dtype == torch.float32


def test_tokenizer_matches_the_checkpoints(checkpoint, gguf_file):
    from transformers import AutoTokenizer

    path = gguf_file("qwen2")
    _, ours = load_gguf(path, "float32")
    # The checkpoint directory's tokenizer, as gapless reads it (test_tokenizer.py checks that
    # against transformers), and transformers' own tokenizer from the same GGUF file.
    from_dir = Tokenizer.from_pretrained(checkpoint("qwen2"))
    hf_gguf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == from_dir.encode(text) == hf_gguf(text).input_ids, text
        assert (
            ours.decode(ids)
            == from_dir.decode(ids)
            == hf_gguf.decode(ids, skip_special_tokens=True)
        )
    assert ours.bos_token == "<|bos|>" and ours.eos_token == "<|end|>"
    assert ours.special_ids == from_dir.special_ids


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_pre_tokenizers_match_transformers(gguf_file, pre):
    from transformers import AutoTokenizer

    path = gguf_file("qwen2", pre=pre)
    _, ours = load_gguf(path, "float32")
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids, text


def test_smollm_splits_every_digit(gguf_file):
    # As SmolLM's own tokenizer and llama.cpp do (transformers' GGUF loader does not).
    _, ours = load_gguf(gguf_file("qwen2", pre="smollm"), "float32")
    ids = ours.encode("year 2024", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids)[-4:] == ["2", "0", "2", "4"]


def test_chat_template_renders_as_the_checkpoints(checkpoint, gguf_file):
    _, ours = load_gguf(gguf_file("qwen2"), "float32")
    theirs = Tokenizer.from_pretrained(checkpoint("qwen2"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi ✓"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert ours.encode_chat(messages) == theirs.encode_chat(messages)


def test_missing_tensor_is_an_error_naming_it(checkpoint, tmp_path):
    path = write_gguf(checkpoint("qwen2"), tmp_path / "m.gguf", drop=["blk.1.ffn_up.weight"])
    with pytest.raises(WeightError, match=r"missing tensor blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def test_a_type_nothing_reads_is_an_error_naming_it(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "llama")
    block_bytes = gguf.GGML_QUANT_SIZES[QType.Q8_1][1]
    writer.add_tensor("w", np.zeros((2, block_bytes), np.uint8), raw_dtype=QType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [tensor] = gguf.GGUFReader(tmp_path / "x.gguf", "c").tensors
    with pytest.raises(WeightError, match="tensor w has GGUF type Q8_1"):
        dequantize(tensor)


def test_a_type_without_our_kernel_is_dequantized_with_a_warning(checkpoint, tmp_path, caplog):
    ckpt = checkpoint("qwen2", hidden_size=256, intermediate_size=512)
    path = write_gguf(ckpt, tmp_path / "iq2.gguf", QType.Q8_0, mix={"ffn_up": QType.IQ2_XXS})
    decoder, _ = load_gguf(path)
    assert isinstance(decoder.layers[0].up.weight, torch.Tensor)  # dense, in memory
    assert "GGUF IQ2_XXS weights have no kernel here: dequantized at load" in caplog.text


def test_llm_serves_a_gguf_file_as_its_checkpoint(checkpoint, gguf_file):
    from gapless import LLM, SamplingParams
    from gapless.model.gguf import model_name

    path = gguf_file("qwen2")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = LLM(path, dtype="float32", kv_cache_tokens=256).generate(["def f(x):"], params)
    theirs = LLM(checkpoint("qwen2"), dtype="float32", kv_cache_tokens=256).generate(
        ["def f(x):"], params
    )
    assert ours[0].token_ids == theirs[0].token_ids
    assert model_name(path) == "qwen2-F32-gpt-2"


def write_sentencepiece_gguf(out):
    """A GGUF with only a `llama` (sentencepiece BPE) tokenizer, as converted Llama 2 files
    have it: <unk> <s> </s>, 256 byte pieces, then pieces scored by their merge order."""
    from tokenizers import models, pre_tokenizers, trainers

    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    trained.train_from_iterator([TEXTS[0] * 20, TEXTS[1] * 20, UNICODE_SAMPLE * 20], trainer)
    learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [piece for piece, _ in learned if piece not in tokens]
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    from gapless.model.gguf_tokenizer import tokenizer_from_gguf

    path = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*TEXTS, " leading space", "byte fallback: 𝔘𝔫𝔦 ☃"]:
        ids = ours.encode(text)
        assert ids[0] == 1  # <s>: sentencepiece files get BOS unless they say otherwise
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert len(ours.encode(TEXTS[1])) < len(TEXTS[1]) / 3  # merges, not single characters
    assert ours.byte_fallback_ids  # the streaming detokenizer holds back partial characters
