"""The model runtime computes what transformers computes, however the batch is cut."""

from __future__ import annotations

import functools
import json
import shutil

import helpers
import pytest
import torch
from checkpoints import ARCHS, make_checkpoint

from gapless import LLM, SamplingParams
from gapless.engine.plan import ScheduledChunk
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.kernels import resolve_dtype
from gapless.model.config import ConfigError
from gapless.model.loader import WeightError, load_decoder


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# The model's tests (and their importers) draw from every id past bos, eos and pad.
prompt = functools.partial(helpers.prompt, low=3)


class Seq:
    """A sequence fed to the runner by hand, with enough blocks for its whole length."""

    def __init__(self, ids: list[int], first_block: int) -> None:
        self.req = Request("s", ids, SamplingParams())
        self.req.kv.tables = [list(range(first_block, first_block + len(ids) // 16 + 1))]

    def chunk(self, n: int) -> ScheduledChunk:
        return ScheduledChunk(self.req, n)


def run_chunks(runner: ModelRunner, seq: Seq, sizes: list[int]) -> torch.Tensor:
    out = []
    for n in sizes:
        out.append(runner.execute([seq.chunk(n)], {0})[0])
        seq.req.num_computed += n
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(checkpoint, arch, kernels_choice):
    path = checkpoint(arch)
    ids = prompt(80)  # longer than mistral's 24-token window
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    decoder = load_decoder(path, "float32")
    ours = run_chunks(ModelRunner(decoder, 16, 16), Seq(ids, 0), [80])
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_equals_one_call(checkpoint, arch, kernels_choice):
    decoder = load_decoder(checkpoint(arch), "float32")
    check_chunked_prefill_equals_one_call(ModelRunner(decoder, 32, 16))


def check_chunked_prefill_equals_one_call(runner: ModelRunner) -> None:
    ids = prompt(7 + 1 * 9 + 64 * 2)
    whole = run_chunks(runner, Seq(ids, 0), [len(ids)])
    sizes = [1] * 9 + [7] + [64, 64]
    pieces = run_chunks(runner, Seq(ids, 16), sizes)
    assert (whole - pieces).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_ragged_batch_equals_each_sequence_alone(checkpoint, arch, kernels_choice):
    decoder = load_decoder(checkpoint(arch), "float32")
    check_ragged_batch_equals_each_sequence_alone(ModelRunner(decoder, 64, 16))


def check_ragged_batch_equals_each_sequence_alone(runner: ModelRunner) -> None:
    prompts = [prompt(n, seed=n) for n in (40, 57, 33)]
    decoding = [prompt(n, seed=100 + n) for n in (30, 45)]

    alone = []
    for ids in prompts + decoding:
        alone.append(run_chunks(runner, Seq(ids, 0), [len(ids)]))

    seqs = [Seq(ids, 10 * i) for i, ids in enumerate(prompts + decoding)]
    # The decoding sequences have all but their last token cached already.
    for seq in seqs[3:]:
        run_chunks(runner, seq, [len(seq.req.prompt_ids) - 1])
    plans = [[13, 27], [50, 7], [33, 0]]  # chunk sizes per prompt, per step
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(2):
        chunks = [seqs[i].chunk(plans[i][step]) for i in range(3) if plans[i][step]]
        owners = [i for i in range(3) if plans[i][step]]
        if step == 0:
            chunks += [seqs[3].chunk(1), seqs[4].chunk(1)]
            owners += [3, 4]
        logits = runner.execute(chunks, set(range(len(chunks))))
        for owner, chunk, rows in zip(owners, chunks, logits, strict=True):
            got[owner].append(rows)
            seqs[owner].req.num_computed += chunk.num_tokens
    for i in range(3):
        assert (torch.cat(got[i]) - alone[i]).abs().max().item() < 1e-4
    for i in (3, 4):
        assert (got[i][0][-1] - alone[i][-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_generation_matches_transformers(checkpoint, arch):
    path = checkpoint(arch)
    ids = prompt(30, seed=3)
    with torch.no_grad():
        ref = (
            hf_model(path)
            .generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40)[
                0, 30:
            ]
            .tolist()
        )
    llm = LLM(path, dtype="float32", prefill_chunk=8)
    out = llm.generate([ids], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert out.prompt_token_ids == ids
    assert out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(ref)


def test_prompt_logprobs_match_transformers(checkpoint):
    path = checkpoint("qwen2")
    ids = prompt(50, seed=5)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].log_softmax(-1)
    # Float32 throughout, the KV cache too (auto stores it in float16 on most CPUs).
    llm = LLM(path, dtype="float32", kv_cache_dtype="float32", prefill_chunk=16)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        token, logprob, _ = out.prompt_logprobs[pos]
        assert token == ids[pos]
        assert abs(logprob - ref[pos - 1, ids[pos]].item()) < 1e-4


def test_sharded_checkpoint_loads_the_same(checkpoint, tmp_path):
    sharded = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = prompt(20)
    a = run_chunks(
        ModelRunner(load_decoder(checkpoint("llama"), "float32"), 4, 16), Seq(ids, 0), [20]
    )
    b = run_chunks(ModelRunner(load_decoder(sharded, "float32"), 4, 16), Seq(ids, 0), [20])
    assert torch.equal(a, b)


def test_block_accounting_returns_to_zero(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", prefill_chunk=16, kv_cache_tokens=2048)
    pool = llm.engine.kv.pool
    llm.generate(
        [prompt(n, seed=n) for n in (5, 40, 77)], SamplingParams(max_tokens=9, ignore_eos=True)
    )
    assert pool.num_used == 0
    assert pool.num_free + pool.num_cached == pool.num_blocks


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("llama"), tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ConfigError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"
    ):
        load_decoder(path)


def test_unsupported_rope_type_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("llama"), tmp_path / "m")
    edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None)
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'.*llama3"):
        load_decoder(path)


def test_missing_and_misshaped_tensors_are_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(checkpoint("qwen2"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(missing, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_decoder(path)

    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(7)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"model.layers.0.self_attn.k_proj.bias has shape \[7\]"):
        load_decoder(path)

    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(32)
    tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match="unexpected tensor model.layers.0.extra.weight"):
        load_decoder(path)


def test_dtype_choice():
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
