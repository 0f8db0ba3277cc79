"""`gapless bench roofline`: how close our model forward comes to this machine's limits.

Measures the machine's matmul peak (TFLOP/s) and memory bandwidth (GB/s), counts the model's
work from its config, then times `ModelRunner.execute` (batch building + model forward, no
scheduling or sampling) for fresh prefill chunks and for decode steps. Prefill is reported as a
share of the matmul peak (it is compute-bound); decode as a share of the bandwidth roofline
(each step must stream every weight and the batch's KV cache once). It also sets a chunk
after a long history against a fresh chunk (with attention's share and speed), and a batch-1
decode at a long context against one at a short context, and names the CPU and the kernels
the probe picked.

FORMULAS below states how work is counted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from gapless.kernels import resolve_dtype
from gapless.kernels.machine import machine
from gapless.model import families
from gapless.model.config import ModelConfig
from gapless.model.loader import expected_shapes

# Useful work, not what padding or masking makes the kernels do.
FORMULAS = """\
prefill FLOPs of a chunk of n tokens at positions s..s+n-1 =
    2 * P_linear * n                      P_linear: q/k/v/o + MLP weights of all layers
  + 2 * hidden * vocab                    lm_head, for the chunk's last token only
  + 4 * heads * head_dim * K              QK^T and PV; K = keys attended summed over tokens and
                                          layers, a token at position p seeing p + 1 keys
                                          (at most its layer's window)
decode bytes of a step over B sequences, each with c cached tokens =
    (layer weights, norms, biases + final norm + lm_head + B embedding rows) * dtype size
  + 2 * kv_heads * head_dim * K * dtype size    K and V; K = (c + 1) * layers per sequence,
                                                (c + 1 capped at each layer's window)"""

NOTE = (
    "Times ModelRunner.execute only (batch build + model forward); the engine's step time "
    "adds scheduling and sampling on top."
)


def last_level_cache_bytes() -> int:
    """Largest CPU cache per sysfs (0 if unknown). Hosts can have L3s of hundreds of MB."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text.rstrip("KMG")) * units.get(text[-1], 1))
    return max(sizes)


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(
            mm_shapes=[(128, 128, 128), (64, 96, 256)],
            bw_bytes=32 << 20,
            chunks=[(32, 0), (64, 0), (128, 0), (64, 256)],
            decode_batches=[1, 2, 4],
            decode_context=64,
            engine_batch=4,
            long_history=(64, 256),  # (chunk, history)
            decode_contexts=(64, 512),  # batch 1, short against long
        )
    return dict(
        mm_shapes=[(2048, 2048, 2048), (512, 896, 4864)],
        # Far larger than the last-level cache, or bandwidth reads partly from cache.
        bw_bytes=max(512 << 20, 2 * last_level_cache_bytes()),
        chunks=[(128, 0), (512, 0), (2048, 0), (512, 4096)],
        decode_batches=[1, 8, 32],
        decode_context=256,
        engine_batch=32,
        long_history=(512, 7680),
        decode_contexts=(64, 8192),
    )


# --- counting -------------------------------------------------------------------------------


def linear_params(cfg: ModelConfig) -> int:
    """Matmul weights of the decoder layers (q/k/v/o and MLP projections), not embeddings."""
    return sum(
        math.prod(shape)
        for name, shape in expected_shapes(cfg).items()
        if name.startswith("model.layers.") and name.endswith("_proj.weight")
    )


def decode_weight_params(cfg: ModelConfig, batch: int) -> int:
    """Parameters a decode step reads: every layer tensor, the final norm, the whole lm_head,
    but only the batch's rows of the embedding table."""
    layers = sum(
        math.prod(shape)
        for name, shape in expected_shapes(cfg).items()
        if name.startswith("model.layers.")
    )
    h = cfg.hidden_size
    return layers + h + cfg.vocab_size * h + batch * h


def attended_keys(cfg: ModelConfig, start: int, n: int) -> int:
    """Keys attended by tokens start..start+n-1, summed over tokens and layers."""
    total = 0
    for window in cfg.layer_windows:
        if window is None:
            total += n * start + n * (n + 1) // 2  # token at position p sees p + 1 keys
        else:
            total += sum(min(p + 1, window) for p in range(start, start + n))
    return total


def chunk_flops(cfg: ModelConfig, start: int, n: int) -> int:
    attn_per_key = 4 * cfg.num_heads * cfg.head_dim
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    return 2 * linear_params(cfg) * n + lm_head + attn_per_key * attended_keys(cfg, start, n)


def decode_bytes(cfg: ModelConfig, contexts: list[int], elem_size: int) -> int:
    """Bytes one decode step must move; contexts[i] tokens are already cached for sequence i,
    so it attends contexts[i] + 1 keys (its own new token included)."""
    kv_per_key = 2 * cfg.num_kv_heads * cfg.head_dim
    keys = sum(attended_keys(cfg, c, 1) for c in contexts)
    return (decode_weight_params(cfg, len(contexts)) + kv_per_key * keys) * elem_size


# --- timing ---------------------------------------------------------------------------------


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


R = TypeVar("R")


def _timed(fn: Callable[..., R], times: list[float]) -> Callable[..., R]:
    """fn, appending the seconds of each call to times."""

    def timed(*args: object) -> R:
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
        return out

    return timed


def matmul_tflops(dtype: torch.dtype, shapes: list[tuple[int, int, int]], reps: int) -> dict:
    per_shape = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        t = median_time(lambda a=a, b=b: torch.mm(a, b), reps)
        per_shape[f"{m}x{k}x{n}"] = 2 * m * k * n / t / 1e12
    return {"best": max(per_shape.values()), "shapes": per_shape}


def bandwidth_gbs(nbytes: int, reps: int) -> dict:
    # float32 so the reduction stays memory-bound; buffers far larger than the caches.
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t_copy = median_time(lambda: dst.copy_(src), reps)
    t_sum = median_time(lambda: src.sum(), reps)
    copy = 2 * nbytes / t_copy / 1e9  # copy reads and writes every byte
    read = nbytes / t_sum / 1e9
    # Decode mostly streams weights, so the better of the two is its fair ceiling.
    return {
        "best": max(copy, read),
        "copy": copy,
        "read": read,
        "buffer_mb": nbytes >> 20,
        "cache_mb": last_level_cache_bytes() >> 20,
    }


def time_model(
    model_dir: Path, dtype: torch.dtype, sizes: dict, reps: int, peak_tflops: float, gbs: float
) -> tuple[list[dict], list[dict], dict, str]:
    """Prefill chunks, decode steps, a chunk at a long history against a fresh one, and the
    kernels the probe picked."""
    from gapless.bench.harness import Harness
    from gapless.engine.request import Request
    from gapless.engine.runner import ModelRunner
    from gapless.model.loader import load_decoder

    decoder = load_decoder(model_dir, str(dtype).removeprefix("torch."))
    cfg, elem = decoder.config, decoder.embed.element_size()
    bs, ctx = 16, sizes["decode_context"]
    seq_blocks = -(-(ctx + 1) // bs)
    long_n, long_start = sizes["long_history"]
    num_blocks = max(
        max(-(-(s + n) // bs) for n, s in sizes["chunks"]),
        max(sizes["decode_batches"]) * seq_blocks,
        -(-(long_n + long_start) // bs),
        -(-(max(sizes["decode_contexts"]) + 1) // bs),
    )
    harness = Harness(ModelRunner(decoder, num_blocks, bs))
    gen = torch.Generator().manual_seed(0)

    def request(num_tokens: int, cached: int) -> Request:
        ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen).tolist()
        return harness.request(ids, cached=cached)

    # Each timing reruns one unbooked step at a fixed context, then frees its requests' blocks.
    prefill = []
    for n, start in sizes["chunks"]:
        req = request(start + n, start)
        t = median_time(lambda req=req, n=n: harness.step([(req, n)], book=False), reps)
        harness.release(req)
        flops = chunk_flops(cfg, start, n)
        prefill.append(
            {
                "chunk": n,
                "context": start,
                "flops": flops,
                "ms": t * 1e3,
                "tok_s": n / t,
                "tflops": flops / t / 1e12,
                "pct_of_peak": 100 * flops / t / 1e12 / peak_tflops,
            }
        )

    decode = []
    for batch in sizes["decode_batches"]:
        # Each sequence gets its own blocks, as in a real batch.
        chunks = [(request(ctx + 1, ctx), 1) for _ in range(batch)]
        t = median_time(lambda chunks=chunks: harness.step(chunks, book=False), reps)
        for req, _ in chunks:
            harness.release(req)
        nbytes = decode_bytes(cfg, [ctx] * batch, elem)
        roofline_s = nbytes / (gbs * 1e9)
        decode.append(
            {
                "batch": batch,
                "context": ctx,
                "bytes": nbytes,
                "ms": t * 1e3,
                "roofline_ms": roofline_s * 1e3,
                "pct_of_roofline": 100 * roofline_s / t,
            }
        )

    # Attention's own time, summed over the layers of a step.
    attention_s: list[float] = []
    attend = decoder.kernels.attention
    timed_attention = _timed(attend, attention_s)

    def step(n: int, start: int) -> tuple[float, float]:
        """Median step time of one n-token chunk after `start` cached tokens, and the
        attention time of the median step."""
        req = request(start + n, start)
        harness.step([(req, n)], book=False)  # warm-up
        steps = []
        for _ in range(reps):
            attention_s.clear()
            t = time.perf_counter()
            harness.step([(req, n)], book=False)
            steps.append((time.perf_counter() - t, sum(attention_s)))
        harness.release(req)
        return sorted(steps)[len(steps) // 2]

    decoder.kernels.attention = timed_attention  # type: ignore[method-assign]
    fresh_s, _ = step(long_n, 0)
    history_s, history_attention_s = step(long_n, long_start)
    short_ctx, long_ctx = sizes["decode_contexts"]
    short_s, long_s = step(1, short_ctx)[0], step(1, long_ctx)[0]
    decoder.kernels.attention = attend  # type: ignore[method-assign]
    attention_flops = 4 * cfg.num_heads * cfg.head_dim * attended_keys(cfg, long_start, long_n)
    attention_tflops = attention_flops / history_attention_s / 1e12
    long_history = {
        "chunk": long_n,
        "history": long_start,
        "fresh_ms": fresh_s * 1e3,
        "history_ms": history_s * 1e3,
        "ratio": history_s / fresh_s,
        "attention_ms": history_attention_s * 1e3,
        "attention_pct_of_step": 100 * history_attention_s / history_s,
        "attention_tflops": attention_tflops,
        "attention_pct_of_peak": 100 * attention_tflops / peak_tflops,
        "decode_short_context": short_ctx,
        "decode_long_context": long_ctx,
        "decode_short_ms": short_s * 1e3,
        "decode_long_ms": long_s * 1e3,
        "decode_ratio": long_s / short_s,
    }
    return prefill, decode, long_history, decoder.kernels.describe()


def engine_overhead(model_dir: Path, dtype: torch.dtype, batch: int, steps: int) -> dict:
    """Step time of the whole engine (scheduling, sampling, detokenizing, events) against its
    model forward, with `batch` greedy sequences decoding."""
    from gapless.engine.config import EngineConfig
    from gapless.engine.engine import Engine
    from gapless.engine.sampling_params import SamplingParams

    dtype_name = str(dtype).removeprefix("torch.")
    engine = Engine.from_pretrained(
        model_dir, EngineConfig.of(dtype=dtype_name, max_num_seqs=batch)
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    vocab = min(engine.decoder.config.vocab_size, engine.tokenizer.vocab_size)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (64,), generator=gen).tolist(), params)
    engine.step()  # every prompt prefills in this step (idle budget), then all decode
    forward_times: list[float] = []
    # On one rank Decoder.start runs the whole forward; what it returns only hands the logits.
    engine.decoder.start = _timed(engine.decoder.start, forward_times)  # type: ignore[method-assign]
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    step, fwd = statistics.median(step_times), statistics.median(forward_times)
    return {
        "batch": batch,
        "step_ms": step * 1e3,
        "forward_ms": fwd * 1e3,
        "non_model_pct": 100 * (step - fwd) / step,
    }


# --- command --------------------------------------------------------------------------------


def add_roofline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "roofline", help="model forward speed against this machine's FLOP and bandwidth peaks"
    )
    p.add_argument("model_dir", type=Path)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median) per figure")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    p.add_argument("--quick", action="store_true", help="small sizes, for tests")
    p.add_argument("--out", type=Path, default=Path("results/roofline"))
    p.set_defaults(func=roofline_main)


def format_report(r: dict) -> str:
    peaks, model = r["peaks"], r["model"]
    lines = [
        f"cpu {r['cpu']['name']} ({' '.join(r['cpu']['isa']) or 'no avx2'}),"
        f" torch kernels {r['cpu']['torch_capability']}",
        r["kernels"],
        f"model {r['model_dir']}  dtype {r['dtype']}  threads {r['threads']}",
        "peaks: "
        + ", ".join(f"{d} matmul {v['best']:.3g} TFLOP/s" for d, v in peaks["matmul"].items())
        + f", bandwidth {peaks['bandwidth']['best']:.1f} GB/s"
        f" (copy {peaks['bandwidth']['copy']:.1f}, read {peaks['bandwidth']['read']:.1f})",
        f"work: {model['linear_flops_per_token'] / 1e9:.4g} GFLOP/token linear"
        f" + {model['lm_head_flops'] / 1e9:.4g} GFLOP lm_head per chunk"
        f" + {model['attention_flops_per_key']} FLOP per attended key;"
        f" decode weights {model['decode_weight_bytes_batch1'] / 1e6:.4g} MB/step,"
        f" KV {model['kv_bytes_per_token']} B/token",
        "",
        f"{'prefill chunk':>14} {'context':>8} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'% peak':>7}",
    ]
    for p in r["prefill"]:
        lines.append(
            f"{p['chunk']:>14} {p['context']:>8} {p['ms']:>9.1f} {p['tok_s']:>9.0f}"
            f" {p['tflops']:>8.3f} {p['pct_of_peak']:>6.1f}%"
        )
    lines += [
        "",
        f"{'decode batch':>14} {'context':>8} {'ms/step':>9} {'roof ms':>9} {'MB':>8}"
        f" {'% roof':>7}",
    ]
    for d in r["decode"]:
        lines.append(
            f"{d['batch']:>14} {d['context']:>8} {d['ms']:>9.2f} {d['roofline_ms']:>9.2f}"
            f" {d['bytes'] / 1e6:>8.1f} {d['pct_of_roofline']:>6.1f}%"
        )
    cache = peaks["bandwidth"]["cache_mb"] << 20
    if any(d["bytes"] < 2 * cache for d in r["decode"]):
        lines.append(
            f"(last-level cache {cache >> 20} MB: a step moving less than twice that partly "
            "reads from cache, so it can beat the memory roofline)"
        )
    h = r["long_history"]
    lines += [
        "",
        f"chunk of {h['chunk']} at {h['history']} history: {h['history_ms']:.1f} ms, against"
        f" {h['fresh_ms']:.1f} ms fresh: {h['ratio']:.2f}x; attention {h['attention_ms']:.1f} ms"
        f" ({h['attention_pct_of_step']:.0f}% of the step) at {h['attention_tflops']:.3f} TFLOP/s"
        f" ({h['attention_pct_of_peak']:.0f}% of the matmul peak)",
        f"decode batch 1 at {h['decode_long_context']} context: {h['decode_long_ms']:.1f} ms,"
        f" against {h['decode_short_ms']:.1f} ms at {h['decode_short_context']}:"
        f" {h['decode_ratio']:.2f}x",
    ]
    e = r["engine_overhead"]
    lines += [
        "",
        f"engine step with {e['batch']} greedy decodes: {e['step_ms']:.1f} ms, of which model"
        f" forward {e['forward_ms']:.1f} ms: non-model time {e['non_model_pct']:.1f}%",
    ]
    return "\n".join(lines + ["", r["model"]["formulas"], "", r["note"]])


def roofline_main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch threads: {threads}", flush=True)
    cfg = families.read_config_json(args.model_dir)
    cpu = machine()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    sizes = _sizes(args.quick)

    print("measuring machine peaks...", flush=True)
    matmul = {
        str(d).removeprefix("torch."): matmul_tflops(d, sizes["mm_shapes"], args.reps)
        for d in dict.fromkeys([torch.bfloat16, torch.float32, dtype])
    }
    bandwidth = bandwidth_gbs(sizes["bw_bytes"], args.reps)
    dtype_name = str(dtype).removeprefix("torch.")
    peak = matmul[dtype_name]["best"]

    print("timing the model forward...", flush=True)
    prefill, decode, long_history, chosen = time_model(
        args.model_dir, dtype, sizes, args.reps, peak, bandwidth["best"]
    )
    print("timing the engine step...", flush=True)
    overhead = engine_overhead(args.model_dir, dtype, sizes["engine_batch"], 4 * args.reps)
    elem = torch.tensor([], dtype=dtype).element_size()
    result = {
        "model_dir": str(args.model_dir),
        # torch's own kernels may be capped below the CPU's flags (ATEN_CPU_CAPABILITY).
        "cpu": {
            "name": cpu.cpu_name,
            "isa": list(cpu.cpu_isa),
            "torch_capability": cpu.torch_cpu_capability,
        },
        "kernels": chosen,
        "dtype": dtype_name,
        "threads": threads,
        "reps": args.reps,
        "quick": args.quick,
        "note": NOTE,
        "peaks": {"matmul": matmul, "bandwidth": bandwidth},
        "model": {
            "linear_flops_per_token": 2 * linear_params(cfg),
            "lm_head_flops": 2 * cfg.hidden_size * cfg.vocab_size,
            "attention_flops_per_key": 4 * cfg.num_heads * cfg.head_dim,
            "decode_weight_bytes_batch1": decode_weight_params(cfg, 1) * elem,
            "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem,
            "formulas": FORMULAS,
        },
        "prefill": prefill,
        "decode": decode,
        "long_history": long_history,
        "engine_overhead": overhead,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline.json").write_text(json.dumps(result, indent=1) + "\n")
    print(format_report(result))
    print(f"wrote {args.out / 'roofline.json'}")
    return 0
