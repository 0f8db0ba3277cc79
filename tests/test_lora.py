"""LoRA adapters per request (--lora): an adapter's request computes what transformers computes
with peft's merged adapter; requests on different adapters and on none share steps and get
what each gets alone; the prefix cache never serves one adapter's blocks to another; and an
adapter gapless cannot serve is refused at start, naming it and why.

The adapters are made with peft on the tiny checkpoints (tests/checkpoints.py), their lora_B
drawn at random: peft starts it at zero, where an adapter changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import ollama
import openai
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from server_fixture import MODEL, running_server
from test_model import hf_model, prompt

from gapless import LLM, SamplingParams
from gapless.bench.gguf_files import write_gguf
from gapless.model.lora import AdapterError

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    out: Path,
    targets: list[str] = ALL_MODULES,
    rank: int = 4,
    alpha: int = 8,
    seed: int = 0,
    **config: object,
) -> Path:
    """A peft adapter of base saved under out, its lora_B random."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, **config)
    model = get_peft_model(hf_model(base), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers' model with peft's adapter merged into its weights: the reference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base), adapter).merge_and_unload().eval()


def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def float32_llm(base: Path, **adapters: Path) -> LLM:
    """Float32 throughout, the KV cache too, with the adapters served by name."""
    specs = tuple(f"{name}={path}" for name, path in adapters.items())
    return LLM(base, dtype="float32", kv_cache_dtype="float32", prefill_chunk=16, lora=specs)


# arch -> (target modules, rank, alpha, rsLoRA): ranks, subsets and both scalings across them.
EXACT = {
    "llama": (ALL_MODULES, 4, 8, False),
    "qwen2": (["q_proj", "v_proj"], 8, 16, False),
    "qwen3": (["k_proj", "o_proj", "down_proj"], 3, 6, True),
    "mistral": (["gate_proj", "up_proj"], 16, 8, False),
    "smollm3": (ALL_MODULES, 2, 4, False),
    "gemma2": (ALL_MODULES, 4, 4, True),
    "gemma3": (["q_proj", "k_proj", "v_proj", "down_proj"], 5, 10, False),
}


@pytest.mark.parametrize("arch", EXACT)
def test_adapter_requests_match_transformers_with_the_merged_adapter(checkpoint, tmp_path, arch):
    targets, rank, alpha, rslora = EXACT[arch]
    base = checkpoint(arch)
    adapter = make_adapter(base, tmp_path / "a", targets, rank, alpha, use_rslora=rslora)
    merged = merged_model(base, adapter)
    ids = prompt(60, seed=5)  # longer than the sliding windows
    with torch.no_grad():
        ref = merged(torch.tensor([ids])).logits[0].log_softmax(-1)
        base_ref = hf_model(base)(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert (ref - base_ref).abs().max() > 0.1  # the adapter changes the model
    llm = float32_llm(base, a=adapter)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True, adapter="a")
    out = llm.generate([ids], params)[0]
    diff = max(
        abs(out.prompt_logprobs[pos][1] - ref[pos - 1, ids[pos]].item())
        for pos in range(1, len(ids))
    )
    assert diff < 1e-4
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, adapter="a")
    assert llm.generate([ids[:30]], params)[0].token_ids == greedy(merged, ids[:30], 30)


@pytest.fixture(scope="module")
def two_adapters(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(llama_dir, root / "a", seed=1),
        "b": make_adapter(llama_dir, root / "b", ["q_proj", "v_proj", "down_proj"], 8, 4, seed=2),
    }


def test_adapters_and_the_base_share_steps_and_each_gets_what_it_gets_alone(
    llama_dir, two_adapters, monkeypatch
):
    llm = float32_llm(llama_dir, **two_adapters)
    jobs = [  # (prompt, adapter): a long prompt on "a" prefills in chunks beside the decodes
        (prompt(5, seed=1), "a"),
        (prompt(6, seed=2), "b"),
        (prompt(7, seed=3), None),
        (prompt(70, seed=4), "a"),
    ]

    def params(adapter: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, adapter=adapter)

    alone = [llm.generate([ids], params(adapter))[0].token_ids for ids, adapter in jobs]
    # Each adapter changes the tokens: a step that lost a row's adapter would be seen.
    assert len({tuple(tokens) for tokens in alone[:3]}) == 3
    decoder = llm.engine.runner.decoder
    steps = []  # each step's rows by adapter name (None: the base), and its total rows
    start = decoder.start

    def recording(batch, kv_cache):
        names = decoder.adapters.names
        rows = {names[a]: len(r) for a, r in batch.lora_groups}
        steps.append((rows, len(batch.token_ids)))
        return start(batch, kv_cache)

    monkeypatch.setattr(decoder, "start", recording)
    outs = llm.generate([ids for ids, _ in jobs], [params(adapter) for _, adapter in jobs])
    assert [out.token_ids for out in outs] == alone
    # A step where both adapters and the base decoded while "a"'s long prompt prefilled.
    mixed = [
        (rows, total)
        for rows, total in steps
        if rows.get("a", 0) > 1 and rows.get("b") == 1 and total > sum(rows.values())
    ]
    assert mixed


def test_prefix_cache_serves_no_block_across_adapters(llama_dir, two_adapters):
    llm = float32_llm(llama_dir, **two_adapters)
    ids = prompt(64, seed=7)  # four full blocks
    runs = ["a", "b", None, "a"]
    outs = []
    for adapter in runs:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter=adapter)
        outs.append(llm.generate([ids], params)[0])
    assert [out.cached_prompt_tokens for out in outs] == [0, 0, 0, 48]
    merged = {name: merged_model(llama_dir, path) for name, path in two_adapters.items()}
    merged[None] = hf_model(llama_dir)
    for adapter, out in zip(runs, outs, strict=True):
        assert out.token_ids == greedy(merged[adapter], ids, 8), adapter


def test_unknown_adapter_in_a_request_is_refused(llama_dir, two_adapters):
    llm = float32_llm(llama_dir, a=two_adapters["a"])
    with pytest.raises(ValueError, match="no LoRA adapter 'b'"):
        llm.generate([prompt(5)], SamplingParams(adapter="b"))


def test_server_serves_each_adapter_as_a_model_and_404s_an_unknown_one(llama_dir, two_adapters):
    specs = tuple(f"{name}={path}" for name, path in two_adapters.items())
    text = "def main():\n    return"
    with running_server(llama_dir, lora=specs, kv_cache_dtype="float32") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == [MODEL, "a", "b"]
        assert client.models.retrieve("b").id == "b"
        texts = {}
        for name in (MODEL, "a", "b"):
            done = client.completions.create(model=name, prompt=text, max_tokens=8, temperature=0)
            assert done.model == name
            texts[name] = done.choices[0].text
        assert len(set(texts.values())) == 3
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(
                model="c", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert refused.value.body["code"] == "model_not_found"
        assert "'a'" in refused.value.body["message"]
        with pytest.raises(openai.NotFoundError):  # embeddings serve the base model only
            client.embeddings.create(model="a", input="hi")
        # Ollama's chat and generate pick adapters by name too (its tag `:latest` or none).
        ollama_client = ollama.Client(host=server.url)
        names = [m.model for m in ollama_client.list().models]
        assert names == [f"{MODEL}:latest", "a:latest", "b:latest"]
        for name in ("a", "b:latest"):
            done = ollama_client.generate(
                model=name, prompt=text, raw=True, options={"temperature": 0, "num_predict": 8}
            )
            assert done.model == name
            assert done.response == texts[name.removesuffix(":latest")]
        with pytest.raises(ollama.ResponseError) as missing:
            ollama_client.generate(model="c", prompt=text, raw=True)
        assert missing.value.status_code == 404


# -- adapters refused at start -----------------------------------------------------------------


def test_a_dora_adapter_is_refused(llama_dir, tmp_path):
    adapter = make_adapter(llama_dir, tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterError, match=r"'dora'.*DoRA"):
        float32_llm(llama_dir, dora=adapter)


def test_an_adapter_without_its_config_is_refused(llama_dir, two_adapters, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "adapter_model.safetensors").write_bytes(
        (two_adapters["a"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match=r"'bare'.*no adapter_config.json"):
        float32_llm(llama_dir, bare=bare)


def test_a_corrupt_adapter_file_is_refused(llama_dir, tmp_path):
    adapter = make_adapter(llama_dir, tmp_path / "cut")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match=r"'cut'.*cannot read adapter_model.safetensors"):
        float32_llm(llama_dir, cut=adapter)


def test_an_adapter_of_another_base_is_refused(checkpoint, llama_dir, tmp_path):
    other = make_adapter(checkpoint("qwen3"), tmp_path / "qwen3")  # head_dim 32, not 16
    with pytest.raises(AdapterError, match=r"'other'.*do not fit rank 4"):
        float32_llm(llama_dir, other=other)


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
def test_an_adapter_on_modules_gapless_lacks_is_refused(llama_dir, tmp_path):
    adapter = make_adapter(llama_dir, tmp_path / "head", ["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match=r"'head'.*modules gapless lacks: lm_head"):
        float32_llm(llama_dir, head=adapter)


def test_a_malformed_lora_flag_is_refused(llama_dir):
    with pytest.raises(AdapterError, match="NAME=PATH"):
        LLM(llama_dir, lora=("no-path",))


# -- GGUF bases ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def linear_rope(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """A Llama checkpoint whose rope scaling GGUF files say (llama3's they do not), and an
    adapter of it."""
    base = checkpoint("llama_linear")
    return base, make_adapter(base, tmp_path_factory.mktemp("adapter") / "a")


def test_an_adapter_on_a_gguf_base_matches_the_merged_adapter(linear_rope, tmp_path):
    """On the file's float32 weights, as llama.cpp permutes Llama's q and k rows (the loader
    puts them back, and the adapter applies to them as transformers holds them)."""
    base, adapter = linear_rope
    llm = float32_llm(write_gguf(base, tmp_path / "llama.gguf", QType.F32), a=adapter)
    ids = prompt(40, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, adapter="a")
    want = greedy(merged_model(base, adapter), ids, 20)
    assert llm.generate([ids], params)[0].token_ids == want


def test_decode_steps_with_adapter_rows_skip_the_native_decode_call(
    linear_rope, tmp_path, monkeypatch
):
    """The decode call holds the base linears only: a step with adapter rows runs the ops,
    one without still takes the call."""
    base, adapter = linear_rope
    path = write_gguf(base, tmp_path / "llama.gguf", QType.Q8_0)
    llm = LLM(path, prefill_chunk=16, lora=(f"a={adapter}",))
    fused = llm.engine.runner.decoder.decode_layers
    assert fused is not None
    calls = []
    run = fused.run
    monkeypatch.setattr(fused, "run", lambda *args: calls.append(1) or run(*args))
    ids = prompt(20, seed=3)
    outs = {}
    for adapter in ("a", None):
        calls.clear()
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, adapter=adapter)
        outs[adapter] = llm.generate([ids], params)[0].token_ids
        assert len(calls) == (0 if adapter else 5)  # every decode step but the prompt's
    assert outs["a"] != outs[None]
