"""The step loop: schedule, run one hybrid forward, sample, emit events."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gapless.engine import distributed
from gapless.engine.cost_model import LEARNING_CHUNK, StepCostModel, step_features
from gapless.engine.events import Event, FinishedEvent, ProgressEvent, TokenEvent, TokenLogprob
from gapless.engine.metrics import EngineMetrics
from gapless.engine.request import Request, RequestState
from gapless.engine.runner import ModelRunner
from gapless.engine.sampler import sample, top_logprobs
from gapless.engine.sampling_params import SamplingParams, SamplingParamsError
from gapless.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from gapless.engine.stopping import StopStringFilter
from gapless.engine.structured import GrammarCompiler, GrammarError
from gapless.kernels import rank_device
from gapless.kv.block_pool import BlockPool
from gapless.model.checkpoint import load_model, read_model_config
from gapless.model.decoder import Decoder
from gapless.model.parallel import RankFailed, check_shardable
from gapless.model.quantize import quantizer
from gapless.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("gapless.engine")


class RequestError(ValueError):
    """A request that can never run; `param` names the offending field."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    """The engine can run no more steps (a tensor-parallel rank failed)."""


@dataclass
class EngineConfig:
    dtype: str = "auto"
    device: str = "auto"  # cuda when available, else cpu
    quantize: str | None = None  # int8 or int4: weight-only, round-to-nearest at load
    quantize_group_size: int = 32  # int4: columns per scale and offset (32, 64 or 128)
    block_size: int = 16
    kv_cache_tokens: int | None = None  # KV capacity in tokens; overrides kv_memory_gib
    kv_memory_gib: float = 2.0
    max_num_seqs: int = 64
    prefill_chunk: int = 512
    idle_prefill_chunk: int = 4096
    chunked_prefill: bool = True
    prefill_policy: str = "shortest"
    enable_prefix_cache: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    target_itl_ms: float | None = None
    max_queue: int | None = None  # waiting requests beyond this are refused
    num_threads: int | None = None  # per rank under tensor parallelism
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        positive = ["block_size", "max_num_seqs", "prefill_chunk", "idle_prefill_chunk"]
        positive.append("tensor_parallel_size")
        positive += [
            name
            for name in ("kv_cache_tokens", "max_model_len", "target_itl_ms", "num_threads")
            if getattr(self, name) is not None
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.kv_memory_gib <= 0:
            raise ValueError(f"kv_memory_gib must be positive, got {self.kv_memory_gib!r}")
        quantizer(self.quantize, self.quantize_group_size)  # raises ValueError if unknown
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue!r}")
        if self.prefill_policy not in ("fcfs", "shortest"):
            raise ValueError(
                f"prefill_policy must be 'fcfs' or 'shortest', got {self.prefill_policy!r}"
            )


class Engine:
    def __init__(
        self,
        decoder: Decoder,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.decoder = decoder
        self.tokenizer = tokenizer
        mcfg = decoder.config
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if runner is None:
            bs = config.block_size
            if config.kv_cache_tokens is not None:
                num_blocks = -(-config.kv_cache_tokens // bs)
            else:
                per_block = ModelRunner.kv_bytes_per_token(decoder) * bs
                num_blocks = int(config.kv_memory_gib * 2**30) // per_block
                # No point holding more than every running sequence at full context.
                num_blocks = min(num_blocks, config.max_num_seqs * (-(-self.max_model_len // bs)))
            runner = ModelRunner(decoder, num_blocks, bs)
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        if mcfg.max_window is None:
            # A sequence longer than the pool could be preempted and never fit again.
            self.max_model_len = min(
                self.max_model_len, self.pool.num_blocks * self.pool.block_size
            )
        self.runner = runner
        self.whole_prefill = not config.chunked_prefill or not runner.supports_chunked_prefill
        if config.chunked_prefill and not runner.supports_chunked_prefill:
            log.warning("this model runner cannot prefill in chunks: prefilling every prompt whole")
        self.cost_model: StepCostModel | None = None
        budget = None
        if config.target_itl_ms is not None:
            self.cost_model = StepCostModel(
                config.target_itl_ms / 1000,
                min(config.prefill_chunk, LEARNING_CHUNK),
                config.idle_prefill_chunk,
            )
            budget = self.cost_model.prefill_budget
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                prefill_chunk=config.prefill_chunk,
                idle_prefill_chunk=config.idle_prefill_chunk,
                prefill_policy=config.prefill_policy,
                enable_prefix_cache=config.enable_prefix_cache,
                window=mcfg.max_window,
            ),
            self.pool,
            budget,
        )
        self.eos_ids = set(tokenizer.eos_token_ids) | set(mcfg.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, mcfg.vocab_size, sorted(self.eos_ids))
        self.metrics = EngineMetrics()
        self.num_steps = 0
        self._requests: dict[str, list[Request]] = {}  # by id: the live choices
        self._incoming: deque[Request] = deque()
        self._cancels: deque[str] = deque()
        self._lock = threading.Lock()
        self._close: Callable[[], object] = lambda: None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        launch: distributed.Launch | None = None,
    ) -> Engine:
        """The engine of a checkpoint. With tensor_parallel_size > 1 this process is rank 0:
        it forms the group (spawning this host's other ranks; `launch` says where they sit)
        and every rank loads its shard. A group this call forms is this engine's: close()
        ends it. A build that fails ends the group before the error is raised, so a later
        build in this process starts afresh."""
        config = config or EngineConfig()
        quantize = (config.quantize, config.quantize_group_size)
        if config.tensor_parallel_size == 1:
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            device = rank_device(config.device, 0)
            return cls(*load_model(path, config.dtype, device, None, *quantize), config)
        check_shardable(read_model_config(path), config.tensor_parallel_size)  # spawns nothing
        launch = launch or distributed.Launch(threads=config.num_threads, device=config.device)
        owns_group = distributed.current() is None
        parallel = distributed.start(config.tensor_parallel_size, launch)
        try:
            parallel.broadcast(distributed.LoadModel(str(path), config.dtype, *quantize))
            model = load_model(path, config.dtype, parallel.device, parallel, *quantize)
            engine = cls(*model, config)
            runner = engine.runner
            parallel.broadcast(distributed.AllocateKV(runner.num_blocks, runner.block_size))
        except BaseException:
            distributed.abort()
            raise
        if owns_group:
            engine._close = weakref.finalize(engine, distributed.stop)
        return engine

    def close(self) -> None:
        """Ends the tensor-parallel ranks this engine started (also done when it is garbage
        collected, and at exit); idempotent. The engine runs no step afterwards."""
        self._close()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        progress_callback: Callable[[ProgressEvent], None] | None = None,
        whole_prefill: bool = False,
    ) -> str:
        """Queues a request (thread-safe); it starts at the next step. Returns its id.

        A request for n choices is n sequences under one id, told apart by their events'
        `index`: the first prefills the prompt, the others fork from it (Scheduler.fork)."""
        params = params or SamplingParams()
        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        request_id = request_id or uuid.uuid4().hex
        choices = [
            self._choice(request_id, i, ids, params, progress_callback, whole_prefill)
            for i in range(params.n)
        ]
        first = choices[0]
        first.forks = choices[1:]
        with self._lock:
            if request_id in self._requests:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            limit = self.config.max_queue
            if limit is not None and len(self.scheduler.waiting) + len(self._incoming) >= limit:
                raise QueueFull(f"the queue is full ({limit} waiting requests)")
            self._requests[request_id] = choices
            self._incoming.append(first)
        return request_id

    def _choice(
        self,
        request_id: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        progress_callback: Callable[[ProgressEvent], None] | None,
        whole_prefill: bool,
    ) -> Request:
        request = Request(
            request_id, ids, params, progress_callback, whole_prefill or self.whole_prefill
        )
        request.index = index
        if params.seed is not None:
            # On the CPU whatever the device: one uniform draw per token, and the same draws on
            # every device. Choice i draws from seed + i, wrapped into the seed range.
            seed = (params.seed + index + 2**63) % 2**64 - 2**63
            request.generator = torch.Generator().manual_seed(seed)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        if params.stop:
            request.stop_filter = StopStringFilter(params.stop, params.include_stop_str_in_output)
        if params.grammar is not None:
            try:
                request.matcher = self.grammars.matcher(params.grammar)
            except GrammarError as e:
                raise RequestError(f"the grammar does not compile: {e}", "grammar") from e
        return request

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> str:
        """Pre-chunking behaviour: the whole prompt prefills in one step, then decodes."""
        return self.add_request(prompt, params, whole_prefill=True, **kw)

    def cancel(self, request_id: str) -> bool:
        """Thread-safe; takes effect at the next step boundary. False if no such live request."""
        with self._lock:
            if request_id not in self._requests:
                return False
            self._cancels.append(request_id)
            return True

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer.surely_exceeds(len(prompt), self.max_model_len):
            raise RequestError(
                f"the prompt has {len(prompt)} characters, more than this model's context of "
                f"{self.max_model_len} tokens can hold",
                "prompt",
                "context_length_exceeded",
            )
        try:
            return self.tokenizer.encode(prompt)
        except ValueError as e:  # text that is not valid Unicode
            raise RequestError(str(e), "prompt") from e

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        """The limits that need the model; SamplingParams checked the rest on construction."""
        try:
            params.check_vocab(self.decoder.config.vocab_size)
        except SamplingParamsError as e:
            raise RequestError(str(e), e.param, code=None) from e
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but this model's context is "
                f"{self.max_model_len} tokens (prompt plus output)",
                "prompt",
                "context_length_exceeded",
            )
        vocab = self.decoder.config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")

    @property
    def has_work(self) -> bool:
        return bool(
            self._incoming or self._cancels or self.scheduler.waiting or self.scheduler.running
        )

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One hybrid forward over everything scheduled, then one token per finished prompt
        or decode. A failure is isolated to the requests it comes from: the others in the
        batch continue with the tokens they would have had."""
        events: list[Event] = []
        self._take_incoming(events)
        started = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            return events
        features = step_features(
            [c.request.num_computed + 1 for c in chunks if c.request.is_decoding],
            [(c.num_tokens, c.request.num_computed) for c in chunks if not c.request.is_decoding],
        )
        to_sample: list[tuple[Request, torch.Tensor]] = []
        for chunk, rows in self._forward(events, chunks):
            try:
                to_sample += [(req, rows[-1]) for req in self._advance(events, chunk, rows)]
            except Exception as exc:
                self._fail(events, chunk.request, exc)
        for req, token, info in self._sample(events, to_sample):
            try:
                self._append_token(events, req, token, info)
            except Exception as exc:
                self._fail(events, req, exc)
        self.num_steps += 1
        elapsed = time.perf_counter() - started
        self.metrics.step_time.observe(elapsed)
        if self.cost_model is not None:
            self.cost_model.observe(features, elapsed)
        return events

    def _forward(
        self, events: list[Event], chunks: list[ScheduledChunk]
    ) -> list[tuple[ScheduledChunk, torch.Tensor]]:
        """Each chunk with its logits, from one forward. If that fails, the chunks run one at a
        time and only those that fail alone fail their requests. (Rewriting a chunk's K/V is
        harmless: the same tokens write the same values.)"""
        every_row = [
            c.request.num_computed < len(c.request.prompt_ids)
            and c.request.params.prompt_logprobs is not None
            for c in chunks
        ]
        try:
            logits = self.runner.execute(chunks, {i for i, e in enumerate(every_row) if e})
            return list(zip(chunks, logits, strict=True))
        except RankFailed:
            raise  # not the chunks' fault, and the ranks can run nothing more
        except Exception as exc:
            if len(chunks) == 1:
                self._fail(events, chunks[0].request, exc)
                return []
            log.exception("a forward of %d chunks failed: running them one at a time", len(chunks))
        survivors = []
        for chunk, every in zip(chunks, every_row, strict=True):
            try:
                survivors.append((chunk, self.runner.execute([chunk], {0} if every else set())[0]))
            except Exception as exc:
                self._fail(events, chunk.request, exc)
        return survivors

    def _advance(
        self, events: list[Event], chunk: ScheduledChunk, rows: torch.Tensor
    ) -> list[Request]:
        """Books a computed chunk; returns the requests that now sample a token from rows[-1]:
        its own, and when it completes a prompt with n choices, the forked ones too."""
        req = chunk.request
        in_prompt = req.num_computed < len(req.prompt_ids)
        if in_prompt and req.params.prompt_logprobs is not None:
            self._record_prompt_logprobs(req, req.num_computed, rows)
        req.num_computed += chunk.num_tokens
        self.scheduler.register_computed_blocks(req)
        if in_prompt and req.first_token_time is None:
            processed = min(req.num_computed, len(req.prompt_ids))
            self._emit(events, req, ProgressEvent(req.request_id, processed, len(req.prompt_ids)))
        if req.num_computed < req.num_tokens:
            return []
        if req.params.max_tokens == 0:
            self._finish(events, req, "length")
            return []
        if not req.forks:
            return [req]
        for fork in req.forks:
            fork.prompt_logprobs = list(req.prompt_logprobs)
        forked, copies = self.scheduler.fork(req, req.forks)
        req.forks = []
        self.runner.copy_blocks(copies)
        return [req, *forked]

    def _sample(
        self, events: list[Event], batch: list[tuple[Request, torch.Tensor]]
    ) -> list[tuple[Request, int, TokenLogprob | None]]:
        """Samples every row at once; if that fails, row by row, failing only the rows that
        fail alone. Seeded generators are rewound first, so the retried rows draw the same
        numbers they would have drawn in the batch."""
        if not batch:
            return []
        reqs = [r for r, _ in batch]
        logits = torch.stack([x for _, x in batch])
        states = [r.generator.get_state() if r.generator is not None else None for r in reqs]
        try:
            return [(r, t, i) for r, (t, i) in zip(reqs, sample(reqs, logits), strict=True)]
        except Exception:
            if len(reqs) > 1:
                log.exception("sampling %d rows failed: sampling them one at a time", len(reqs))
        out = []
        for row, (req, state) in enumerate(zip(reqs, states, strict=True)):
            if state is not None:
                req.generator.set_state(state)
            try:
                [(token, info)] = sample([req], logits[row : row + 1])
            except Exception as exc:
                self._fail(events, req, exc)
                continue
            out.append((req, token, info))
        return out

    def _fail(self, events: list[Event], req: Request, exc: Exception) -> None:
        log.error(
            "request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc
        )
        self._finish(events, req, "error", f"{type(exc).__name__}: {exc}")

    def fail_all(self, error: str) -> list[Event]:
        """Ends every live request with an error, releasing its KV; the engine stays usable."""
        events: list[Event] = []
        self._take_incoming(events)
        for choices in list(self._requests.values()):
            for req in list(choices):
                self._finish(events, req, "error", error)
        return events

    def _take_incoming(self, events: list[Event]) -> None:
        with self._lock:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
            cancels = list(self._cancels)
            self._cancels.clear()
        for request_id in cancels:
            for req in list(self._requests.get(request_id, [])):
                self._finish(events, req, "cancelled")

    def _record_prompt_logprobs(self, req: Request, start: int, rows: torch.Tensor) -> None:
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first token has no context
        logprobs = rows.log_softmax(-1)
        k = req.params.prompt_logprobs or 0
        for offset in range(len(rows)):
            target = start + offset + 1
            if target >= len(req.prompt_ids) or target < len(req.prompt_logprobs):
                continue
            req.prompt_logprobs.append(top_logprobs(logprobs[offset], req.prompt_ids[target], k))

    def _append_token(
        self, events: list[Event], req: Request, token: int, info: TokenLogprob | None
    ) -> None:
        now = time.monotonic()
        p = req.params
        if req.matcher is not None:
            req.matcher.accept(token)
        req.output_ids.append(token)
        if req.token_counts is not None:
            req.token_counts.add(token)
        req.state = RequestState.DECODING
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.time_to_first_token.observe(now - req.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - req.last_token_time)
        req.last_token_time = now
        self.metrics.generation_tokens += 1

        finish = None
        past_min = len(req.output_ids) >= p.min_tokens
        if past_min and (token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)):
            finish, text = "stop", ""
        else:
            text = req.detokenizer.add([token])
        if finish is None and req.matcher is not None and req.matcher.complete:
            finish = "stop"  # the grammar allows nothing more
        if finish is None and (
            len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len
        ):
            finish = "length"
        if finish is not None:
            text += req.detokenizer.flush()  # the last token carries all remaining text
        logprobs = [info] if info else []
        if req.stop_filter is not None:
            # Logprobs then travel with their tokens' text: none for text the stop cut off.
            text, logprobs = req.stop_filter.feed(text, info)
            if req.stop_filter.stopped:
                finish = "stop"
            elif finish is not None:
                rest, held = req.stop_filter.flush()
                text, logprobs = text + rest, logprobs + held
        self._emit(
            events, req, TokenEvent(req.request_id, [token], text, logprobs or None, req.index)
        )
        if finish is not None:
            self._finish(events, req, finish)

    def _finish(
        self, events: list[Event], req: Request, reason: str, error: str | None = None
    ) -> None:
        if req.state is RequestState.FINISHED:
            return  # a fork already ended with the choice it waited on
        self.scheduler.remove(req)
        req.state = RequestState.FINISHED
        req.finish_time = time.monotonic()
        with self._lock:
            choices = self._requests.get(req.request_id, [])
            if req in choices:
                choices.remove(req)
            if not choices:
                self._requests.pop(req.request_id, None)
            if req in self._incoming:
                self._incoming.remove(req)
        self.metrics.requests_finished[reason] = self.metrics.requests_finished.get(reason, 0) + 1
        self._emit(
            events,
            req,
            FinishedEvent(
                req.request_id,
                reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                cached_prompt_tokens=req.cached_prompt_tokens,
                prompt_logprobs=req.prompt_logprobs
                if req.params.prompt_logprobs is not None
                else None,
                error=error,
                stop_string=req.stop_filter.matched if req.stop_filter else None,
                preempted=req.preemptions,
                timings=self._timings(req),
                index=req.index,
            ),
        )
        # Choices still waiting to fork from this one end with it: they have no prompt KV.
        forks, req.forks = req.forks, []
        for fork in forks:
            self._finish(events, fork, reason, error)

    @staticmethod
    def _timings(req: Request) -> dict[str, float]:
        marks = {
            "first_scheduled": req.first_scheduled_time,
            "first_token": req.first_token_time,
            "finished": req.finish_time,
        }
        return {k: v - req.arrival_time for k, v in marks.items() if v is not None}

    def _emit(self, events: list[Event], req: Request, event: Event) -> None:
        if isinstance(event, ProgressEvent) and req.progress_callback is not None:
            req.progress_callback(event)
        events.append(event)

    # -- observability ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        running = self.scheduler.running
        return {
            "requests_running": len(running),
            "requests_waiting": len(self.scheduler.waiting) + len(self._incoming),
            "requests_prefilling": sum(r.state is RequestState.PREFILLING for r in running),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_total": self.pool.num_blocks,
            "prefix_cache_hit_tokens_total": self.scheduler.prefix_hit_tokens,
            "prefix_cache_queried_tokens_total": self.scheduler.prefix_queried_tokens,
            "preemptions_total": self.scheduler.preemptions,
        }


__all__ = ["Engine", "EngineConfig", "EngineFailed", "RequestError", "QueueFull", "ScheduledChunk"]
