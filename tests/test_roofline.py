"""`gapless bench roofline`: work counted from the config matches hand arithmetic, and a quick
run on a tiny checkpoint reports every figure. Timings are machine-dependent, so only their
presence is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gapless.bench.make_model import make_model, model_config
from gapless.bench.roofline import (
    attended_keys,
    chunk_flops,
    decode_bytes,
    decode_weight_params,
    linear_params,
)
from gapless.cli import main
from gapless.model import families
from gapless.model.config import ModelConfig

# The tiny preset: hidden 64, 2 layers, 4 heads x 16, 2 KV heads, MLP 128, vocab 512,
# Qwen2 (q/k/v bias), tied embeddings.
LAYER_MATMULS = 64 * (64 + 32 + 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64  # qkv, o, gate_up, down
LINEAR_PARAMS = 2 * LAYER_MATMULS  # 73728
LAYER_OTHER = (64 + 32 + 32) + 2 * 64  # q/k/v biases, two norms
DECODE_PARAMS_B1 = 2 * (LAYER_MATMULS + LAYER_OTHER) + 64 + 512 * 64 + 64  # + norm, lm_head, row
LM_HEAD_FLOPS = 2 * 64 * 512
ATTN_FLOPS_PER_KEY = 4 * 4 * 16
KV_BYTES_PER_KEY_BF16 = 2 * 2 * 16 * 2  # K and V, per layer


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return families.model_config(model_config("tiny"))


def test_counts_match_hand_arithmetic(tiny_cfg: ModelConfig) -> None:
    assert linear_params(tiny_cfg) == LINEAR_PARAMS == 73728
    assert decode_weight_params(tiny_cfg, 1) == DECODE_PARAMS_B1 == 107136
    assert decode_weight_params(tiny_cfg, 8) == DECODE_PARAMS_B1 + 7 * 64

    # 8 fresh tokens see 1..8 keys: 36 per layer, 2 layers.
    assert attended_keys(tiny_cfg, 0, 8) == 72
    assert chunk_flops(tiny_cfg, 0, 8) == 8 * 2 * 73728 + LM_HEAD_FLOPS + 256 * 72
    # 4 tokens after 10 cached see 11..14 keys.
    assert chunk_flops(tiny_cfg, 10, 4) == 4 * 2 * 73728 + LM_HEAD_FLOPS + 256 * 2 * 50

    # Two sequences with 5 and 9 cached tokens attend 6 and 10 keys in each of 2 layers.
    kv = KV_BYTES_PER_KEY_BF16 * 2 * (6 + 10)
    assert decode_bytes(tiny_cfg, [5, 9], 2) == (DECODE_PARAMS_B1 + 64) * 2 + kv
    assert decode_bytes(tiny_cfg, [5], 4) == DECODE_PARAMS_B1 * 4 + 2 * 2 * 16 * 4 * 2 * 6


def test_sliding_window_caps_keys() -> None:
    raw = model_config("tiny") | {
        "architectures": ["MistralForCausalLM"],
        "sliding_window": 4,
        "use_sliding_window": True,
    }
    cfg = families.model_config(raw)
    # Positions 2..5 see min(p + 1, 4) = 3, 4, 4, 4 keys in each of 2 layers.
    assert attended_keys(cfg, 2, 4) == 30
    assert decode_bytes(cfg, [100], 2) - decode_bytes(cfg, [3], 2) == 0


def test_quick_run_reports_every_figure(tmp_path: Path, tiny_cfg: ModelConfig) -> None:
    model_dir = make_model(tmp_path / "m", preset="tiny")
    out = tmp_path / "out"
    argv = ["bench", "roofline", str(model_dir), "--quick", "--reps", "2", "--dtype", "bfloat16"]
    assert main([*argv, "--threads", "1", "--out", str(out)]) == 0
    r = json.loads((out / "roofline.json").read_text())

    assert r["dtype"] == "bfloat16" and r["threads"] == 1 and r["note"]
    for d in ("bfloat16", "float32"):
        assert r["peaks"]["matmul"][d]["best"] > 0
    assert r["peaks"]["bandwidth"]["best"] > 0 and r["peaks"]["bandwidth"]["cache_mb"] >= 0

    m = r["model"]
    assert m["linear_flops_per_token"] == 2 * LINEAR_PARAMS
    assert m["lm_head_flops"] == LM_HEAD_FLOPS
    assert m["attention_flops_per_key"] == ATTN_FLOPS_PER_KEY
    assert m["decode_weight_bytes_batch1"] == DECODE_PARAMS_B1 * 2
    assert m["kv_bytes_per_token"] == 2 * KV_BYTES_PER_KEY_BF16
    assert "lm_head" in m["formulas"]

    chunks = [(p["chunk"], p["context"]) for p in r["prefill"]]
    assert chunks == [(32, 0), (64, 0), (128, 0), (64, 256)]
    for p in r["prefill"]:
        n, s = p["chunk"], p["context"]
        keys = 2 * (n * s + n * (n + 1) // 2)
        assert p["flops"] == n * 2 * LINEAR_PARAMS + LM_HEAD_FLOPS + ATTN_FLOPS_PER_KEY * keys
        assert all(p[k] > 0 for k in ("ms", "tok_s", "tflops", "pct_of_peak"))

    assert [d["batch"] for d in r["decode"]] == [1, 2, 4]
    for d in r["decode"]:
        b, c = d["batch"], d["context"]
        weights = (DECODE_PARAMS_B1 + (b - 1) * 64) * 2
        assert d["bytes"] == weights + b * 2 * (c + 1) * KV_BYTES_PER_KEY_BF16
        assert all(d[k] > 0 for k in ("ms", "roofline_ms", "pct_of_roofline"))

    assert r["cpu"]["name"] and r["kernels"].startswith("kernels: ")
    h = r["long_history"]
    assert (h["chunk"], h["history"], h["decode_short_context"], h["decode_long_context"]) == (
        64,
        256,
        64,
        512,
    )
    assert h["ratio"] == pytest.approx(h["history_ms"] / h["fresh_ms"])
    assert h["decode_ratio"] == pytest.approx(h["decode_long_ms"] / h["decode_short_ms"])
    assert 0 < h["attention_ms"] < h["history_ms"] and 0 < h["attention_pct_of_step"] < 100
    assert h["attention_tflops"] > 0 and h["attention_pct_of_peak"] > 0

    overhead = r["engine_overhead"]
    assert overhead["batch"] == 4
    assert overhead["step_ms"] >= overhead["forward_ms"] > 0
