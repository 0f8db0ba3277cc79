"""`gapless bench`: run a seeded workload against an OpenAI-compatible server, or against our
own server under several configurations (`--compare`), and write results, a table and plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from gapless.bench.client import RequestRecord, run_requests
from gapless.bench.compare import ServerError, ServerProcess, parse_configs
from gapless.bench.metrics import compute_metrics, parse_slo
from gapless.bench.report import format_table, plot_itl_cdf, plot_timeline
from gapless.bench.roofline import add_roofline_parser
from gapless.bench.workloads import WORKLOADS, BenchRequest, WorkloadSpec, build_workload

DEFAULT_VOCAB = 32000


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark a streaming /v1/completions server", description=__doc__
    )
    target = p.add_argument_group("target")
    target.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="model name sent in requests (compare: served name)")
    target.add_argument(
        "--compare",
        nargs="+",
        metavar='NAME="FLAGS"',
        help="start our server once per configuration and compare them",
    )
    target.add_argument("--model-dir", type=Path, help="checkpoint served in --compare mode")
    target.add_argument(
        "--server-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a compared server's /health",
    )

    wl = p.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="stall")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"prompt ids are drawn from [100, vocab); default: the checkpoint's "
        f"in --compare mode, else {DEFAULT_VOCAB}",
    )
    wl.add_argument("--num-streams", type=int, default=4, help="stall: decoding streams")
    wl.add_argument("--stream-tokens", type=int, default=256, help="stall: tokens per stream")
    wl.add_argument("--long-tokens", type=int, default=8192, help="stall: long prompt length")
    wl.add_argument("--long-at", type=float, default=3.0, help="stall: long prompt arrival (s)")
    wl.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate (req/s)")
    wl.add_argument("--num-requests", type=int, default=32)
    wl.add_argument("--duration", type=float, default=None, help="stop arrivals after S seconds")

    run = p.add_argument_group("run")
    run.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft:500,itl:100 (itl checks TPOT)")
    run.add_argument("--out", type=Path, default=None, help="output dir (default results/WORKLOAD)")
    run.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="omit ignore_eos for servers that reject it",
    )
    run.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="send prompts as token-id lists or as (approximate) text",
    )
    run.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed short requests before each run, so one-off start-up costs "
        "do not land in the first measured request",
    )
    run.add_argument("--request-timeout", type=float, default=600.0)
    p.set_defaults(func=bench_main)

    sub = p.add_subparsers(dest="bench_command", metavar="{make-model,roofline}")
    mm = sub.add_parser("make-model", help="write a seeded random-weight Qwen2 checkpoint")
    mm.add_argument("out_dir", type=Path)
    mm.add_argument("--preset", choices=("qwen2.5-0.5b", "tiny"), default="qwen2.5-0.5b")
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=make_model_main)
    add_roofline_parser(sub)


def make_model_main(args: argparse.Namespace) -> int:
    from gapless.bench.make_model import make_model

    try:
        out = make_model(args.out_dir, args.preset, args.seed)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}")
    return 0


def _served_vocab(model_dir: Path) -> int:
    """Ids a server accepts: the model's embedding rows may outnumber the tokenizer's ids."""
    from gapless.model.tokenizer import Tokenizer

    config_vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return min(config_vocab, Tokenizer.from_pretrained(model_dir).vocab_size)


def _spec(args: argparse.Namespace, vocab: int) -> WorkloadSpec:
    return WorkloadSpec(
        name=args.workload,
        seed=args.seed,
        vocab_size=vocab,
        num_streams=args.num_streams,
        stream_tokens=args.stream_tokens,
        long_tokens=args.long_tokens,
        long_at=args.long_at,
        rate=args.rate,
        num_requests=args.num_requests,
        duration=args.duration,
    )


def _run(
    args: argparse.Namespace, url: str, model: str, requests: list[BenchRequest]
) -> tuple[list[RequestRecord], float]:
    common = dict(
        ignore_eos=args.ignore_eos,
        use_text=args.prompt_format == "text",
        timeout_s=args.request_timeout,
    )
    if args.warmup > 0:
        warm = [BenchRequest(-1 - i, 0.0, requests[0].prompt[:8], 4) for i in range(args.warmup)]
        records, _ = asyncio.run(run_requests(url, model, warm, show_progress=False, **common))
        if errors := [r.error for r in records if r.error]:
            raise ServerError(f"warm-up request failed: {errors[0]}")
    return asyncio.run(run_requests(url, model, requests, **common))


def bench_main(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.compare:
        if args.model_dir is None:
            print("error: --compare needs --model-dir", file=sys.stderr)
            return 2
        configs = parse_configs(args.compare)
        model = args.model or args.model_dir.resolve().name
        vocab = args.vocab_size or _served_vocab(args.model_dir)
    else:
        if not args.url or not args.model:
            print("error: give --url and --model, or --compare with --model-dir", file=sys.stderr)
            return 2
        configs, model, vocab = {"default": None}, args.model, args.vocab_size or DEFAULT_VOCAB
    out = args.out or Path("results") / args.workload
    out.mkdir(parents=True, exist_ok=True)
    spec = _spec(args, vocab)
    requests = build_workload(spec)

    runs: dict[str, dict] = {}
    records_by_config: dict[str, list[RequestRecord]] = {}
    for name, flags in configs.items():
        print(
            f"== {name}: {len(requests)} requests ({args.workload}, seed {args.seed})",
            file=sys.stderr,
        )
        try:
            if flags is None:
                url = args.url
                records, duration = _run(args, url, model, requests)
            else:
                with ServerProcess(
                    args.model_dir, flags, model, out / f"server-{name}.log"
                ) as server:
                    server.start(args.server_timeout)
                    url = server.url
                    records, duration = _run(args, url, model, requests)
        except ServerError as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
        records_by_config[name] = records
        runs[name] = {
            "server_flags": None if flags is None else " ".join(flags),
            "url": url,
            "metrics": compute_metrics(records, duration, slo),
            "requests": [r.to_dict() for r in records],
        }

    results = {
        "config": {
            "workload": asdict(spec),
            "seed": args.seed,
            "url": args.url,
            "model": model,
            "model_dir": None if args.model_dir is None else str(args.model_dir),
            "slo_ms": slo,
            "ignore_eos": args.ignore_eos,
            "prompt_format": args.prompt_format,
        },
        "configs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = format_table({n: r["metrics"] for n, r in runs.items()})
    (out / "table.md").write_text(table)
    plot_timeline(records_by_config, out / "timeline.png")
    plot_itl_cdf(records_by_config, out / "itl_cdf.png")
    print(table)
    print(f"wrote {out}/results.json, table.md, timeline.png, itl_cdf.png", file=sys.stderr)
    failed = sum(r["metrics"]["failed"] for r in runs.values())
    return 1 if failed else 0
