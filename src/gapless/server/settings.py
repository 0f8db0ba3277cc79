"""The HTTP server's options (`gapless serve` builds its flags from these fields, as from the
engine's: engine/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gapless.engine.options import check, option
from gapless.server.images import ImageReader
from gapless.server.tool_calls import PARSERS

# --task: what the server serves. `generate`: every endpoint, the embedding ones included;
# `embed`: the embedding endpoints only (the others answer 400).
TASKS = ("generate", "embed")


@dataclass
class ServerSettings:
    """The HTTP server's options (engine/options.py: `gapless serve` builds its flags from
    these fields)."""

    served_model_name: str = option(
        None, "the model name clients use (default: the directory's name or the file's stem)"
    )
    api_key: str | None = option(
        None,
        "require `Authorization: Bearer KEY` or `x-api-key: KEY` on every API endpoint "
        "(default: $GAPLESS_API_KEY if set)",
        metavar="KEY",
    )
    api_keys: str | None = option(
        None,
        "a JSON file of API keys and their tenants, each with an optional default service "
        "class and max_in_flight (docs/server.md, API keys and tenants); reread on SIGHUP",
        metavar="FILE",
    )
    max_body_mb: float = option(
        16.0, "request body size limit in MiB (a batch job's line too)", positive=True
    )
    data_dir: str | None = option(
        None,
        "keep uploaded files and batch jobs (OpenAI's Files and Batches API) in an SQLite "
        "database under DIR, where a restart resumes them (default: none, and those "
        "endpoints answer 400)",
        metavar="DIR",
    )
    max_upload_mb: float = option(
        100.0, "the largest file upload (/v1/files), in MiB", positive=True
    )
    batch_lines_in_flight: int | None = option(
        None,
        "batch jobs' requests in the engine at once, all jobs together (default: half of "
        "--max-num-seqs), so that live requests find the batch with room",
        positive=True,
    )
    shutdown_grace_s: float = option(
        30.0,
        "on SIGTERM, time in-flight requests get to finish before they are cancelled",
        minimum=0,
        flag="--shutdown-grace",
        metavar="SECONDS",
    )
    kv_events_endpoint: str | None = option(
        None,
        "publish the prefix cache's block-stored and block-removed events in vLLM's KV-event "
        "format on a ZMQ PUB socket, for prefix-aware routers: tcp://*:5557 binds, "
        "tcp://router:5557 connects, as vLLM's --kv-events-config endpoint (docs/"
        "distributed.md, Replicas behind a router; default: none)",
        metavar="ENDPOINT",
    )
    kv_events_topic: str | None = option(
        None,
        "the topic frame of each --kv-events-endpoint message, e.g. kv@POD@MODEL as llm-d's "
        "KV-cache indexer reads it (default: empty, as vLLM's)",
        metavar="TOPIC",
    )
    tool_call_parser: str | None = option(
        None,
        "how the model writes tool calls (default: recognised from its chat template)",
        choices=PARSERS,
    )
    # The Responses API's stored responses (response_store.py); the least recently used are
    # evicted first.
    response_store_entries: int = option(
        1000, "stored responses (Responses API) kept at most", positive=True
    )
    response_store_bytes: int = option(
        64 * 2**20, "bytes of JSON the stored responses take at most", positive=True
    )
    task: str = option(
        "generate",
        "generate: every endpoint, embeddings included; embed: the embedding endpoints only",
        choices=TASKS,
    )
    allow_image_urls: bool = option(
        False,
        "fetch the http(s) image URLs that requests name (off: images come as data: URLs or "
        "base64); the server then fetches what a client names, so turn it on only for "
        "trusted clients",
    )
    image_url_max_mb: float = option(
        20.0, "the largest image fetched from a URL, in MiB", positive=True
    )
    image_url_timeout_s: float = option(
        10.0,
        "the longest an image URL's fetch may take, whole",
        positive=True,
        flag="--image-url-timeout",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        check(self)
        if self.api_key is not None and self.api_keys is not None:
            raise ValueError("--api-key and --api-keys: choose one (a key file holds many keys)")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)

    @property
    def image_reader(self) -> ImageReader:
        return ImageReader(
            self.allow_image_urls, int(self.image_url_max_mb * 2**20), self.image_url_timeout_s
        )
