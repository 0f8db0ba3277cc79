"""A checkpoint directory (e.g. `gapless bench make-model DIR`, the bench 0.5B shape) written
as a GGUF file of one quantized type, or mixed as llama.cpp's Q4_K_M files mix them.

    .venv/bin/python scripts/make_bench_gguf.py CKPT OUT.gguf --type Q4_0|Q8_0|Q4_K_M

Q4_0 and Q8_0 are the checkpoint's weights quantized by the `gguf` package. The `gguf` package
cannot quantize K-quants, so Q4_K_M's K-quant tensors are random valid blocks
(gapless/bench/gguf_files.py): the file's speed and memory are a real Q4_K_M file's, its tokens are
noise. Each tensor gets the type llama-quantize's Q4_K_M rule gives it: Q4_K; Q6_K for attn_v
and ffn_down in the layers it gives more bits; Q6_K token embeddings; and, where a row is not
a whole number of 256-value super-blocks (the 0.5B shape's 896 columns), Q5_0 for Q4_K and
Q8_0 for Q6_K.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gguf import GGMLQuantizationType as QType

from gapless.bench.gguf_files import write_gguf

FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q6_K: QType.Q8_0}


def q4_k_m_mix(cfg: dict) -> dict[str, QType]:
    """GGUF tensor name -> type, as llama-quantize's Q4_K_M gives them."""
    hidden, ffn, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]

    def more_bits(i: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def fit(qtype: QType, cols: int) -> QType:
        return qtype if cols % 256 == 0 else FALLBACK[qtype]

    mix = {"token_embd.weight": fit(QType.Q6_K, hidden), "output.weight": fit(QType.Q6_K, hidden)}
    for i in range(n):
        for name, cols in (
            ("attn_q", hidden),
            ("attn_k", hidden),
            ("attn_output", hidden),
            ("ffn_gate", hidden),
            ("ffn_up", hidden),
        ):
            mix[f"blk.{i}.{name}.weight"] = fit(QType.Q4_K, cols)
        wide = QType.Q6_K if more_bits(i) else QType.Q4_K
        mix[f"blk.{i}.attn_v.weight"] = fit(wide, hidden)
        mix[f"blk.{i}.ffn_down.weight"] = fit(wide, ffn)
    return mix


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--type", choices=("Q4_0", "Q8_0", "Q4_K_M"), required=True)
    args = p.parse_args()
    if args.type == "Q4_K_M":
        cfg = json.loads((args.ckpt / "config.json").read_text())
        write_gguf(args.ckpt, args.out, QType.Q4_K, mix=q4_k_m_mix(cfg), pad_vocab=True)
    else:
        write_gguf(args.ckpt, args.out, QType[args.type], pad_vocab=True)
    print(args.out)


if __name__ == "__main__":
    main()
