"""The trained demo model: it runs the same in gapless and transformers, it has learned Python
(its loss on held-out stdlib files is far below a random model's), and its training script works.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_script

from gapless import SamplingParams
from gapless.engine.plan import ScheduledChunk
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.model.decoder import Decoder
from gapless.model.demo import shipped_demo_checkpoint
from gapless.model.loader import load_decoder
from gapless.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DIR = ROOT / "src" / "gapless" / "demo_model"
SCRIPT = ROOT / "scripts" / "train_demo_model.py"

CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'


@pytest.fixture(scope="module")
def shipped() -> Path:
    if not (SHIPPED_DIR / "model.safetensors").is_file():
        pytest.skip(
            "the trained demo model is not built yet (no src/gapless/demo_model/"
            "model.safetensors); see docs/demo-model.md for the training command"
        )
    # Weights without the other files would be a broken ship, not a missing one: fail.
    assert shipped_demo_checkpoint() == SHIPPED_DIR
    return SHIPPED_DIR


def all_logits(decoder: Decoder, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, run as one prefill through our runner."""
    block_size = 16
    runner = ModelRunner(decoder, len(ids) // block_size + 1, block_size)
    request = Request("t", ids, SamplingParams())
    request.kv.tables = [list(range(runner.num_blocks))]
    return runner.execute([ScheduledChunk(request, len(ids))], {0})[0]


def test_shipped_checkpoint_files(shipped: Path) -> None:
    from safetensors import safe_open

    weights = shipped / "model.safetensors"
    assert weights.stat().st_size < 25_000_000
    config = json.loads((shipped / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    tok = Tokenizer.from_pretrained(shipped)
    stops = {tok.backend.token_to_id("<|end|>"), tok.backend.token_to_id("<|eos|>")}
    assert stops <= tok.eos_token_ids
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied embeddings
        assert {str(f.get_tensor(name).dtype) for name in names} == {"torch.bfloat16"}


def test_shipped_model_matches_transformers(shipped: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = Tokenizer.from_pretrained(shipped).encode(CODE)
    assert ids == AutoTokenizer.from_pretrained(shipped)(CODE).input_ids
    hf = AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = all_logits(load_decoder(shipped, "float32"), ids)
    assert (ours - ref).abs().max().item() < 1e-4


def test_shipped_model_predicts_held_out_stdlib(shipped: Path) -> None:
    tok = Tokenizer.from_pretrained(shipped)
    decoder = load_decoder(shipped, "float32")
    context = decoder.config.max_position_embeddings
    _, val_files = load_script("train_demo_model").split_stdlib()  # its corpus split
    # The encodings/ charmap tables are near-copies of each other and would make this too easy.
    files = [path for path in val_files if "encodings" not in path.parts]
    bos, eos = tok.backend.token_to_id("<|bos|>"), tok.backend.token_to_id("<|eos|>")
    losses = []
    for path in files:  # one window from the middle of each of 8 files: ~2000 predictions
        text = path.read_bytes().decode("utf-8", errors="ignore")
        ids = [bos, *tok.encode(text, add_special_tokens=False), eos]
        if len(ids) < context:
            continue
        start = (len(ids) - context) // 2
        window = ids[start : start + context]
        logprobs = all_logits(decoder, window)[:-1].log_softmax(-1)
        losses.append(-logprobs.gather(1, torch.tensor(window[1:])[:, None]))
        if len(losses) == 8:
            break
    loss = torch.cat(losses).mean().item()
    # A random model scores about ln(vocab); half of that means it has really learned Python.
    assert loss < 0.5 * math.log(decoder.config.vocab_size), loss


def test_training_script_smoke(tmp_path: Path) -> None:
    out, log = tmp_path / "ckpt", tmp_path / "log.json"
    tiny = "--layers 1 --hidden 64 --heads 2 --kv-heads 1 --intermediate 128 --vocab 512"
    quick = "--context 64 --max-corpus-mb 1 --eval-every 50 --warmup 20 --val-windows 32"
    # A fixed step count, not a time budget: on a busy machine a time budget trains less.
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--log", str(log), "--steps", "150"]
    cmd += tiny.split() + quick.split() + ["--sample-tokens", "16"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr

    curve = json.loads(log.read_text())["curve"]
    assert len(curve) >= 3 and curve[-1]["val_loss"] < curve[0]["val_loss"] - 1.0
    decoder = load_decoder(out, "float32")
    assert decoder.config.vocab_size == 512 and decoder.config.max_position_embeddings == 64
    tok = Tokenizer.from_pretrained(out)
    assert torch.isfinite(all_logits(decoder, tok.encode("import os\n"))).all()
