"""Prometheus text exposition of the engine's gauges, counters and latency histograms."""

from __future__ import annotations

from gapless.engine.engine import Engine
from gapless.engine.metrics import ShareMetrics
from gapless.engine.observability import stats
from gapless.server.tenants import Tenants

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "gapless_"

_HELP = {
    "requests_running": "Requests admitted to the batch (prefilling or decoding).",
    "requests_waiting": "Requests queued for admission.",
    "requests_prefilling": "Admitted requests whose prompt is not fully computed yet.",
    "kv_blocks_used": "KV cache blocks referenced by live requests.",
    "kv_blocks_cached": "Unreferenced KV blocks holding a reusable prompt prefix (evictable).",
    "kv_blocks_free": "KV cache blocks holding nothing.",
    "kv_blocks_total": "KV cache blocks in the pool.",
    "prefix_cache_hit_tokens_total": "Prompt tokens served from the prefix cache.",
    "prefix_cache_queried_tokens_total": "Prompt tokens looked up in the prefix cache.",
    "kv_disk_hits_total": "KV blocks read from the disk tier and checked.",
    "kv_disk_misses_total": "KV blocks looked up on the disk tier and not found.",
    "kv_disk_bytes_read_total": "Bytes of KV read from the disk tier.",
    "kv_disk_bytes_written_total": "Bytes of KV written to the disk tier.",
    "kv_disk_skipped_total": "Disk-tier files that failed their checks (computed instead).",
    "kv_disk_evictions_total": "Disk-tier files deleted to stay under --kv-disk-gb.",
    "kv_disk_errors_total": "Disk-tier reads or writes the file system refused.",
    "speculative_proposed_tokens_total": "Proposed tokens verified by speculative decoding.",
    "speculative_accepted_tokens_total": "Proposed tokens accepted: the output's own tokens.",
    "steps_in_flight": "Pipeline steps launched and not yet completed.",
    "steps_overlapped_total": "Pipeline steps launched while another was in flight.",
    "prompt_chunks_overlapped_total": "Prompt chunks launched while the prompt's chunk before"
    " was in flight (pipeline).",
}


def _scalar(lines: list[str], name: str, kind: str, help_text: str, value: int | float) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]


def render_metrics(engine: Engine, tenants: Tenants | None = None) -> str:
    """All metrics as Prometheus text.

    Runs on the event-loop thread while the engine thread steps: the values are plain ints
    read without a lock, so a scrape may mix two adjacent steps, which is fine for monitoring.
    """
    lines: list[str] = []
    values = stats(engine)
    for key, value in values.items():
        # Anything the engine adds to stats() shows up without a change here.
        kind = "counter" if key.endswith("_total") else "gauge"
        _scalar(lines, PREFIX + key, kind, _HELP.get(key, key.replace("_", " ") + "."), value)
    lines += _router_metrics(values, engine.kv.block_size)
    metrics = engine.metrics
    _scalar(
        lines,
        PREFIX + "generation_tokens_total",
        "counter",
        "Output tokens generated.",
        metrics.generation_tokens,
    )
    name = PREFIX + "requests_finished_total"
    lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
    for reason, count in sorted(dict(metrics.requests_finished).items()):
        lines.append(f'{name}{{finish_reason="{reason}"}} {count}')
    lines += metrics.time_to_first_token.render(
        PREFIX + "time_to_first_token_seconds", "Time from arrival to the first output token."
    )
    lines += metrics.inter_token_latency.render(
        PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens."
    )
    lines += metrics.step_time.render(
        PREFIX + "step_time_seconds", "Wall time of one engine step (one forward pass)."
    )
    lines += _by_class(metrics.by_class)
    if tenants is not None:
        name = PREFIX + "tenant_requests_finished_total"
        lines += [f"# HELP {name} Ended requests by tenant (--api-keys).", f"# TYPE {name} counter"]
        lines += [f'{name}{{tenant="{_label(t)}"}} {tenants.finished[t]}' for t in tenants.names]
        # The key file's tenants only: a bounded label set, whatever clients send.
        by_tenant = {t: metrics.by_tenant.get(t, ShareMetrics()) for t in tenants.names}
        lines += _latencies("tenant", by_tenant, "tenant")
    return "\n".join(lines) + "\n"


def _router_metrics(values: dict[str, int], block_size: int) -> list[str]:
    """The Gateway API Inference Extension's model-server protocol (what llm-d's and
    Kubernetes' inference gateway endpoint picker scrapes), under the vLLM names its picker
    reads by default: the same values as the gapless_ ones above.

    - TotalQueuedRequests, TotalRunningRequests: gauges, requests queued and being served.
    - KVCacheUtilization: a gauge, the fraction (0 to 1) of KV blocks in use, as vLLM counts
      it: cached blocks nobody references are free to take. `vllm:kv_cache_usage_perc` is
      its name now; pickers before vLLM's rename read `vllm:gpu_cache_usage_perc`.
    - BlockSize and NumGPUBlocks (optional): labels of `vllm:cache_config_info`, for the
      picker's prefix-cache scorer.
    The protocol's LoRA metric (`vllm:lora_requests_info`) is for servers with dynamic LoRA
    adapters; gapless has none, and like vLLM without --enable-lora it leaves it out.
    """
    usage = values["kv_blocks_used"] / values["kv_blocks_total"]
    lines: list[str] = []
    for name, help_text, value in (
        ("num_requests_waiting", "Requests queued for admission.", values["requests_waiting"]),
        ("num_requests_running", "Requests being served.", values["requests_running"]),
        ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", usage),
        ("gpu_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", usage),
    ):
        _scalar(lines, f"vllm:{name}", "gauge", help_text, value)
    name = "vllm:cache_config_info"
    labels = f'block_size="{block_size}",num_gpu_blocks="{values["kv_blocks_total"]}"'
    return [
        *lines,
        f"# HELP {name} The KV cache's configuration, in its labels.",
        f"# TYPE {name} gauge",
        f"{name}{{{labels}}} 1",
    ]


def _label(value: str) -> str:
    """A label value as Prometheus' text format escapes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _by_class(shares: dict[str, ShareMetrics]) -> list[str]:
    """The request metrics again, per service class: each family labelled `class`, with one
    series for each of SERVICE_CLASSES (the unlabelled families above are their sums), and
    the tokens that missed the class's targets (--class-ttft-ms, --class-itl-ms)."""
    name = PREFIX + "class_requests_finished_total"
    lines = [f"# HELP {name} Finished requests by service class.", f"# TYPE {name} counter"]
    lines += [f'{name}{{class="{c}"}} {m.requests_finished}' for c, m in shares.items()]
    for family, help_text in (
        ("ttft", "First tokens later than their class's time-to-first-token target."),
        ("itl", "Output tokens later than their class's inter-token latency target."),
    ):
        name = f"{PREFIX}class_{family}_target_missed_total"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        lines += [
            f'{name}{{class="{c}"}} {getattr(m, family + "_missed")}' for c, m in shares.items()
        ]
    return lines + _latencies("class", shares, "service class")


def _latencies(label: str, shares: dict[str, ShareMetrics], what: str) -> list[str]:
    """TTFT and ITL histograms, one series per share, labelled `label`."""
    lines = []
    for family, help_text in (
        ("time_to_first_token", "Time from arrival to the first output token"),
        ("inter_token_latency", "Time between consecutive output tokens"),
    ):
        name = f"{PREFIX}{label}_{family}_seconds"
        lines += [f"# HELP {name} {help_text}, by {what}.", f"# TYPE {name} histogram"]
        for c, m in shares.items():
            lines += getattr(m, family).samples(name, f'{label}="{_label(c)}"')
    return lines
