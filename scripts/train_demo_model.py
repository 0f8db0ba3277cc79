"""Train gapless' demo model: a small Llama that continues Python code, on a CPU, in under an hour.

Corpus: the installed interpreter's standard library `.py` sources (about 30 MB). A stable 2% of
the files (chosen by a hash of their path, so the split does not shift when a Python release adds
or removes files) is held out for validation. The byte-level BPE tokenizer is gapless' own
(`build_bpe_tokenizer`), trained on the training files only.

The training graph is `transformers.LlamaForCausalLM`, installed as a test dependency of gapless;
it is used only here, so the server itself never needs transformers. Training runs in bf16
autocast with float32 master weights, AdamW and grad clipping.

Stopping rule and schedule: linear warmup, a constant peak learning rate, then a cosine decay
over the last fifth of the steps ("warmup-stable-decay"; with a ~20% decay it is reported to end
as low as a full cosine). `--steps N` trains exactly N steps. Otherwise the run fills `--minutes`
of wall clock: while the rate is constant, the step count is re-estimated after every step from
the recent pace, so a machine that gets busier or quieter (other jobs on a shared CPU) does not
end the run early or late; the count is fixed when the remaining time only covers the decay. It
is printed and logged, and rerunning with `--steps N` repeats the run exactly (seeds are fixed;
only floating-point reduction order can differ). Data preparation (~20 s) and the final
evaluation and save (~30 s) come on top of `--minutes`; a slowdown during the decay phase can
stretch the run a little.

The result is a Hugging Face checkpoint (bf16 safetensors, tied embeddings) that `gapless serve`
ships as `gapless-demo`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from gapless.model.demo import build_bpe_tokenizer, stdlib_sources, write_tokenizer_files

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "src" / "gapless" / "demo_model"
VAL_MODULUS = 50  # 1 file in 50 -> 2% held out
SAMPLE_PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory")
    p.add_argument("--minutes", type=float, default=45.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, help="train exactly this many steps (ignores --minutes)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    # Default size: chosen from a throughput probe on 2 CPU cores (see docs/demo-model.md).
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--context", type=int, default=512, help="training window, in tokens")
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=200, help="steps between val evaluations")
    p.add_argument("--val-windows", type=int, default=128, help="fixed windows per evaluation")
    p.add_argument("--max-corpus-mb", type=float, help="cap the corpus (for quick tests)")
    p.add_argument("--sample-tokens", type=int, default=64, help="tokens per sample completion")
    p.add_argument("--log", type=Path, help="write the loss curve and results as JSON here")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    return args


# --- data ----------------------------------------------------------------------------------------


def split_stdlib() -> tuple[list[Path], list[Path]]:
    """(train, validation) stdlib files; a file is held out by a CRC of its relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    val: list[Path] = []
    for path in stdlib_sources():
        key = path.relative_to(root).as_posix().encode()
        (val if zlib.crc32(key) % VAL_MODULUS == 0 else train).append(path)
    return train, val


def read_texts(files: Sequence[Path], max_bytes: int | None) -> list[str]:
    texts: list[str] = []
    remaining = math.inf if max_bytes is None else max_bytes
    for path in files:
        if remaining <= 0:
            break
        data = path.read_bytes()
        if remaining < len(data):
            data = data[: int(remaining)]
        remaining -= len(data)
        # A few stdlib files are not UTF-8 (test data); dropping bad bytes keeps it deterministic.
        texts.append(data.decode("utf-8", errors="ignore"))
    return texts


def token_stream(tokenizer: tokenizers.Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One flat stream: `<|bos|> file <|eos|>` per file.

    The server encodes every prompt with a leading `<|bos|>` (add_bos_token), so the model sees
    it in training as "a file starts here"; `<|eos|>` teaches it to stop at the end of a file.
    """
    bos, eos = tokenizer.token_to_id("<|bos|>"), tokenizer.token_to_id("<|eos|>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def fixed_windows(stream: torch.Tensor, length: int, count: int | None) -> torch.Tensor:
    """Windows of `length` tokens: `count` evenly spaced ones, or all non-overlapping ones."""
    if len(stream) < length:
        raise SystemExit(f"validation split has {len(stream)} tokens, fewer than {length}")
    if count is None:
        n = len(stream) // length
        return stream[: n * length].view(n, length)
    starts = torch.linspace(0, len(stream) - length, min(count, len(stream) // length))
    return torch.stack([stream[s : s + length] for s in starts.long().tolist()])


# --- model and schedule ------------------------------------------------------------------------


def model_config(args: argparse.Namespace, tokenizer: tokenizers.Tokenizer) -> dict[str, Any]:
    """config.json: a plain LlamaForCausalLM that gapless and transformers both load."""
    end_id = tokenizer.token_to_id("<|end|>")
    eos_id = tokenizer.token_to_id("<|eos|>")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.intermediate,
        "hidden_act": "silu",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        # The model never saw positions past its training window; advertising more would let
        # the server accept prompts it can only answer with noise.
        "max_position_embeddings": args.context,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        # Tied: the embedding doubles as the output layer, which halves a vocab-heavy model.
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        # `<|end|>` ends a chat turn, `<|eos|>` a file (what this model learned to emit).
        "eos_token_id": [end_id, eos_id],
        "pad_token_id": tokenizer.token_to_id("<|pad|>"),
    }


@dataclass
class Schedule:
    """Learning rate: linear warmup, constant peak, cosine decay over the last fifth of `total`.

    The constant phase is what lets a timed run adapt: `total` can stay unknown (None) and be
    re-estimated freely until the decay has to start, without a jump in the rate.
    """

    peak: float
    floor: float
    warmup: int
    total: int | None = None

    @property
    def decay_start(self) -> int | None:
        # ceil(4/5 * total) in integers, so `--steps total` decays from exactly the same step.
        return None if self.total is None else -(-4 * self.total // 5)

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        start = self.decay_start
        if self.total is None or start is None or step < start:
            return self.peak
        progress = (step - start) / max(1, self.total - start)
        return self.floor + (self.peak - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def fix_total_if_due(self, step: int, steps_left: float) -> bool:
        """Timed runs: once the steps left only cover the decay, fix `total` (decay from now)."""
        if self.total is not None or step < self.warmup or steps_left > step / 4:
            return False
        self.total = 5 * step // 4  # the largest total whose decay_start is `step`
        return True


def next_token_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch: int, autocast: bool) -> float:
    """Mean next-token loss over all windows (every window has the same token count)."""
    model.eval()
    total = 0.0
    for chunk in windows.split(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total += next_token_loss(model, chunk).item() * len(chunk)
    model.train()
    return total / len(windows)


# --- output --------------------------------------------------------------------------------------


def save_checkpoint(
    model: LlamaForCausalLM,
    cfg: dict[str, Any],
    tokenizer: tokenizers.Tokenizer,
    args: argparse.Namespace,
) -> Path:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # With tied embeddings lm_head.weight is the embedding itself; HF checkpoints omit it.
    tensors = {
        name: t.detach().to(torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
        if name != "lm_head.weight"
    }
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(tokenizer, out, model_max_length=args.context)
    return weights


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, out: Path, max_new: int) -> dict[str, str]:
    """Greedy completions of SAMPLE_PROMPTS, encoded as the server does (with `<|bos|>`)."""
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    stops = set(model.config.eos_token_id)
    samples: dict[str, str] = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt).ids
        new: list[int] = []
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1]
            token = int(logits.argmax())
            if token in stops:
                break
            new.append(token)
        samples[prompt] = tok.decode(new)
    return samples


def write_log(path: Path | None, log: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(log, indent=2) + "\n", encoding="utf-8")


# --- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' thread pool
    torch.manual_seed(args.seed)
    hf_logging.disable_progress_bar()  # keep the log to the loss curve
    t0 = time.perf_counter()

    train_files, val_files = split_stdlib()
    cap = None if args.max_corpus_mb is None else int(args.max_corpus_mb * 1e6)
    train_texts = read_texts(train_files, cap)
    # A capped run still needs enough validation tokens for its fixed windows.
    val_texts = read_texts(val_files, None if cap is None else max(cap // 10, 50_000))
    all_bytes = sum(path.stat().st_size for path in train_files)
    tokenizer = build_bpe_tokenizer(args.vocab, train_files, max_bytes=cap or all_bytes)
    train = token_stream(tokenizer, train_texts)
    val = token_stream(tokenizer, val_texts)
    print(
        f"data: {len(train_files)} train / {len(val_files)} val files, "
        f"{len(train):,} / {len(val):,} tokens, vocab {tokenizer.get_vocab_size()}, "
        f"prep {time.perf_counter() - t0:.0f}s",
        flush=True,
    )

    cfg = model_config(args, tokenizer)
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))  # float32 master weights
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({2 * params / 1e6:.1f} MB in bf16)")
    # Norm gains are not decayed: pulling them to 0 would fight the normalisation itself.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay}],
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )

    window = args.context + 1  # context inputs, each with its next token as target
    val_windows = fixed_windows(val, window, args.val_windows)
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, Any]] = []
    log: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        # The corpus is this interpreter's stdlib, so the Python version is part of the recipe.
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "curve": curve,
    }

    t_train = time.perf_counter()
    val_loss = evaluate(model, val_windows, args.batch, autocast=True)
    curve.append({"step": 0, "elapsed": 0.0, "train_loss": None, "val_loss": val_loss})
    print(f"step 0: val loss {val_loss:.3f} (ln vocab = {math.log(cfg['vocab_size']):.3f})")

    schedule = Schedule(args.lr, args.lr * args.min_lr_ratio, args.warmup, args.steps)
    # Recent step end times; a window of eval_every steps includes one evaluation's cost.
    stamps = deque([time.perf_counter()], maxlen=args.eval_every + 1)
    step, since_eval, train_sum = 0, 0, 0.0
    while schedule.total is None or step < schedule.total:
        for group in opt.param_groups:
            group["lr"] = schedule.lr(step)
        starts = torch.randint(0, len(train) - window, (args.batch,), generator=gen)
        batch = torch.stack([train[s : s + window] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        since_eval += 1
        train_sum += loss.item()
        stamps.append(time.perf_counter())

        if schedule.total is None:
            per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
            seconds_left = args.minutes * 60 - (stamps[-1] - t_train)
            if schedule.fix_total_if_due(step, seconds_left / per_step):
                print(
                    f"{per_step:.3f}s/step: decaying the lr from step {step} to "
                    f"{schedule.total}; reproduce with --steps {schedule.total}",
                    flush=True,
                )

        if step % args.eval_every == 0 or step == schedule.total:
            val_loss = evaluate(model, val_windows, args.batch, autocast=True)
            point = {
                "step": step,
                "elapsed": round(time.perf_counter() - t_train, 1),
                "lr": schedule.lr(step - 1),
                "train_loss": train_sum / since_eval,
                "val_loss": val_loss,
                "val_ppl": math.exp(val_loss),
            }
            curve.append(point)
            since_eval, train_sum = 0, 0.0
            print(
                f"step {step}/{schedule.total or '?'} {point['elapsed']:.0f}s: "
                f"train {point['train_loss']:.3f} val {val_loss:.3f} ppl {point['val_ppl']:.1f}",
                flush=True,
            )
            write_log(args.log, log)

    total, train_seconds = step, time.perf_counter() - t_train
    weights = save_checkpoint(model, cfg, tokenizer, args)
    size_mb = weights.stat().st_size / 1e6
    # Report on what ships: the bf16 weights, run in float32 like the tests do.
    shipped = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    final = evaluate(shipped, fixed_windows(val, window, None), args.batch, autocast=False)
    samples = greedy_samples(shipped, args.out, args.sample_tokens)
    log |= {
        "steps": total,
        "decay_start": schedule.decay_start,
        "train_tokens": total * args.batch * args.context,
        "train_seconds": round(train_seconds, 1),
        "parameters": params,
        "safetensors_mb": round(size_mb, 2),
        "final_val_loss": final,
        "final_val_ppl": math.exp(final),
        "samples": samples,
    }
    write_log(args.log, log)
    print(
        f"saved {args.out} ({size_mb:.1f} MB weights) after {total} steps, "
        f"{time.perf_counter() - t0:.0f}s in all\n"
        f"final val loss (bf16 weights, whole held-out split): {final:.4f}, "
        f"ppl {math.exp(final):.2f}"
    )
    for prompt, completion in samples.items():
        print(f"--- {prompt!r}\n{prompt}{completion}")
    if size_mb > 25:
        print(f"warning: weights are {size_mb:.1f} MB, over the 25 MB package budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
