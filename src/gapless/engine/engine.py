"""The step loop: schedule, run one hybrid forward, sample, emit events."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from gapless.device import rank_device
from gapless.engine import distributed
from gapless.engine.admission import Admission, CheckedPrompt, ImageInput, RequestError
from gapless.engine.config import EngineConfig
from gapless.engine.cost_model import LEARNING_CHUNK, StepCostModel, step_features
from gapless.engine.draft import DraftModel, check_draft
from gapless.engine.events import Event, FinishedEvent, ProgressEvent, TokenEvent, TokenLogprob
from gapless.engine.metrics import EngineMetrics
from gapless.engine.output import OutputStream
from gapless.engine.plan import Fork, ScheduledChunk, StepOutcome, StepPlan
from gapless.engine.request import POOLINGS, Request, RequestState
from gapless.engine.runner import ModelRunner
from gapless.engine.sampler import SamplingState, TokenCounts, sample, top_logprobs
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler
from gapless.engine.speculation import Speculation
from gapless.engine.structured import GrammarCompiler, GrammarError
from gapless.kv.block_pool import BlockPool
from gapless.kv.groups import KVGroup, LayerGroups, split_blocks
from gapless.model.checkpoint import load_model, read_model_config
from gapless.model.decoder import Decoder
from gapless.model.parallel import RankFailed, check_shardable
from gapless.model.tokenizer import Tokenizer
from gapless.model.vision import VisionLanguageModel, is_vision_language, load_vision_language

log = logging.getLogger("gapless.engine")


class QueueFull(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    """The engine can run no more steps (a tensor-parallel rank failed)."""


class Engine:
    def __init__(
        self,
        decoder: Decoder,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        runner: ModelRunner | None = None,
        draft: Decoder | None = None,
        vision: VisionLanguageModel | None = None,
    ) -> None:
        """`draft`: the draft model's decoder, with --speculate draft (its tokenizer checked
        against `tokenizer` already). `vision`: a vision-language model's encoder and
        processor (its decoder is `decoder`): prompts may then hold images."""
        self.config = config = config or EngineConfig()
        self.decoder = decoder
        self.vision = vision
        self.tokenizer = tokenizer
        mcfg, scheduling = decoder.config, config.scheduler
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if runner is None:
            # The layers grouped by window, each group's share of the budget by its bytes
            # per token (kv/groups.py). The draft's pool holds as many tokens as the target's
            # first group: its bytes count with that group's.
            groups = LayerGroups.of(mcfg.layer_windows)
            per_token = groups.bytes_per_token(ModelRunner.kv_bytes_per_layer_token(decoder))
            if draft is not None:
                per_token[0] += ModelRunner.kv_bytes_per_token(draft)
            num_blocks, window_blocks = split_blocks(
                groups,
                config.block_size,
                per_token,
                scheduling.max_num_seqs,
                scheduling.max_step_tokens(config.target_itl_ms is not None),
                self.max_model_len,
                config.kv_cache_tokens,
                int(config.kv_memory_gib * 2**30),
            )
            runner = ModelRunner(
                decoder, num_blocks, config.block_size, vision and vision.encoder, window_blocks
            )
        self.draft = None
        if draft is not None:
            self.draft = DraftModel(draft, runner.num_blocks, runner.block_size)
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        window_groups = [
            KVGroup(BlockPool(n, runner.block_size), w)
            for n, w in zip(runner.window_blocks, runner.groups.windows[1:], strict=True)
        ]
        if mcfg.max_window is None:
            # A sequence longer than the pool could be preempted and never fit again.
            self.max_model_len = min(
                self.max_model_len, self.pool.num_blocks * self.pool.block_size
            )
        self.runner = runner
        chunked = scheduling.chunked_prefill
        self.whole_prefill = not chunked or not runner.supports_chunked_prefill
        if chunked and not runner.supports_chunked_prefill:
            log.warning("this model runner cannot prefill in chunks: prefilling every prompt whole")
        self.cost_model: StepCostModel | None = None
        budget = encode_cost = None
        target = config.target_itl_ms
        if target is not None or vision is not None:
            # With images the fit prices an encode in prompt tokens, with a latency target or
            # without: a tower block costs as many as a few hundred of them on a CPU, where its
            # placeholder tokens' share said ~30 (docs/vision.md).
            self.cost_model = StepCostModel(
                math.inf if target is None else target / 1000,
                min(scheduling.prefill_chunk, LEARNING_CHUNK),
                scheduling.idle_prefill_chunk,
            )
            encode_cost = self.cost_model.encode_cost
            if target is not None:
                budget = self.cost_model.prefill_budget
        self.scheduler = Scheduler(
            scheduling,
            self.pool,
            budget,
            mcfg.max_window,
            self.max_model_len,
            window_groups,
            encode_cost,
            None if self.draft is None else self.draft.unseen,
        )
        self.eos_ids = tokenizer.eos_token_ids  # read once, with the tokenizer
        self.grammars = GrammarCompiler(tokenizer, mcfg.vocab_size, sorted(self.eos_ids))
        self.metrics = EngineMetrics()
        self.num_steps = 0
        # The last step that ran: its decode tokens, prompt tokens and wall time (summary()).
        self.last_step = (0, 0, 0.0)
        self._requests: dict[str, list[Request]] = {}  # by id: the live choices
        self._incoming: deque[Request] = deque()
        self._cancels: deque[str] = deque()
        # Requests ended since the scheduler last dropped the ended ones: in a step, it does
        # so when it books the step (Scheduler.update), after their computed blocks.
        self._ended: dict[Request, None] = {}
        self._lock = threading.Lock()
        self._close: Callable[[], object] = lambda: None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        group: distributed.Group | None = None,
    ) -> Engine:
        """The engine of a checkpoint. With tensor_parallel_size > 1 this process is rank 0
        of `group` (gapless serve forms it first), or of a group this call forms on this host
        (spawning its other ranks), and every rank loads its shard. A group this call forms
        is this engine's alone: close() ends it, and no other engine's. A build that fails
        ends the group before the error is raised, so a later build in this process starts
        afresh."""
        config = config or EngineConfig()
        quantize = (config.quantize, config.quantize_group_size)
        if config.tensor_parallel_size == 1:
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            device = rank_device(config.device, 0)
            if is_vision_language(path):
                if config.quantize is not None:
                    raise ValueError("--quantize is not supported for vision-language models")
                if config.draft_model is not None:
                    raise ValueError("a draft model is not supported for vision-language models")
                vision = load_vision_language(path, config.dtype, device)
                tokenizer = Tokenizer.from_pretrained(path)
                return cls(vision.decoder, tokenizer, config, vision=vision)
            model = load_model(path, config.dtype, device, None, *quantize)
            draft = None
            if config.draft_model is not None:
                draft, draft_tokenizer = load_model(
                    config.draft_model, config.dtype, device, None, *quantize
                )
                check_draft(model, (draft, draft_tokenizer))
            return cls(*model, config, draft=draft)
        if is_vision_language(path):
            raise ValueError("tensor parallelism is not supported for vision-language models")
        check_shardable(read_model_config(path), config.tensor_parallel_size)  # spawns nothing
        owns_group = group is None
        if group is None:
            launch = distributed.Launch(threads=config.num_threads, device=config.device)
            group = distributed.start(config.tensor_parallel_size, launch, f"the engine of {path}")
        parallel = group.parallel
        try:
            parallel.broadcast(distributed.LoadModel(str(path), config.dtype, *quantize))
            model = load_model(path, config.dtype, parallel.device, parallel, *quantize)
            engine = cls(*model, config)
            runner = engine.runner
            parallel.broadcast(
                distributed.AllocateKV(runner.num_blocks, runner.block_size, runner.window_blocks)
            )
        except BaseException:
            group.abort()
            raise
        if owns_group:
            engine._close = weakref.finalize(engine, group.stop)
        return engine

    def close(self) -> None:
        """Ends the tensor-parallel ranks this engine started (also done when it is garbage
        collected, and at exit); idempotent. The engine runs no step afterwards."""
        self._close()

    def reserve_peak_memory(self) -> None:
        """Runs the largest step this engine can schedule once, before serving. The allocator
        keeps what a step frees (see device.tune_allocator), so resident memory then starts
        at its high-water mark, rather than stepping up hours later when a long prompt first
        lands at the end of a long context; and that step's op caches are warm. A draft model
        runs its own largest step too: its catch-up chunks come out of the same budget.

        Whole-prompt prefill has no largest step short of the context length, and is skipped.
        """
        if self.whole_prefill:
            return
        context = min(self.max_model_len, self.pool.num_blocks * self.pool.block_size)
        num_tokens = min(self.scheduler.max_step_tokens, context)
        self.runner.run_largest_step(num_tokens, context)
        if self.draft is not None:
            self.draft.runner.run_largest_step(num_tokens, context)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        progress_callback: Callable[[ProgressEvent], None] | None = None,
        whole_prefill: bool = False,
        images: Sequence[ImageInput] = (),
    ) -> str:
        """Queues a request (thread-safe); it starts at the next step. Returns its id.

        A request for n choices is n sequences under one id, told apart by their events'
        `index`: the first prefills the prompt, the others fork from it (Scheduler.fork).
        With images (a vision-language model's), the prompt holds one image token per image
        (Admission.check_prompt)."""
        params = params or SamplingParams()
        # A CheckedPrompt (the server checks its prompts while parsing, off the event loop) is
        # not scanned again. The params' checks cost little (a bounded number of stop ids), so
        # they run here on every path, the server's too.
        checked = self.admission.check_prompt(prompt, images=images)
        self.admission.check_params(params)
        request_id = request_id or uuid.uuid4().hex
        choices = [
            self._choice(request_id, i, checked, params, progress_callback, whole_prefill)
            for i in range(params.n)
        ]
        first = choices[0]
        first.forks = choices[1:]
        self._queue(request_id, choices, [first])
        return request_id

    def add_embedding(
        self,
        prompts: list[str | list[int]],
        request_id: str | None = None,
        pooling: str | None = None,
        progress_callback: Callable[[ProgressEvent], None] | None = None,
    ) -> str:
        """Queues an embedding request (thread-safe): one sequence per prompt under one id.
        Each prompt prefills in chunks beside the running decodes, as any prompt does, then
        ends, sampling nothing: its FinishedEvent (`index` its position in prompts) carries
        its hidden states after the final norm, pooled (`pooling`, default the engine's) and
        L2-normalized. A prompt may fill the whole context, as it has no output."""
        pooling = pooling or self.config.pooling
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}", "pooling")
        if not prompts:
            raise RequestError("there is no prompt to embed", "prompt", None)
        checked = [self.admission.check_prompt(p, output=False) for p in prompts]
        request_id = request_id or uuid.uuid4().hex
        params = SamplingParams(max_tokens=0)
        sequences = [
            Request(
                request_id,
                list(ids),
                params,
                progress_callback,
                self.whole_prefill,
                index=i,
                output=OutputStream(self.tokenizer, params),
                pooling=pooling,
            )
            for i, ids in enumerate(checked)
        ]
        self._queue(request_id, sequences, sequences)
        return request_id

    def _queue(self, request_id: str, sequences: list[Request], incoming: list[Request]) -> None:
        """Registers a request's sequences under its id; `incoming` start at the next step."""
        with self._lock:
            if request_id in self._requests:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            limit = self.config.max_queue
            queued = len(self.scheduler.waiting) + len(self._incoming)
            if limit is not None and queued + len(incoming) > limit:
                raise QueueFull(f"the queue is full ({limit} waiting requests)")
            self._requests[request_id] = sequences
            self._incoming.extend(incoming)

    def _choice(
        self,
        request_id: str,
        index: int,
        checked: CheckedPrompt,
        params: SamplingParams,
        progress_callback: Callable[[ProgressEvent], None] | None,
        whole_prefill: bool,
    ) -> Request:
        sampling = SamplingState(params)
        if params.seed is not None:
            # On the CPU whatever the device: one uniform draw per token, and the same draws on
            # every device. Choice i draws from seed + i, wrapped into the seed range.
            seed = (params.seed + index + 2**63) % 2**64 - 2**63
            sampling.generator = torch.Generator().manual_seed(seed)
        if sampling.penalised:
            vocab = self.decoder.config.vocab_size
            sampling.counts = TokenCounts(checked, [], vocab, self.decoder.device)
        if params.grammar is not None:
            try:
                sampling.matcher = self.grammars.matcher(params.grammar)
            except GrammarError as e:
                raise RequestError(f"the grammar does not compile: {e}", "grammar") from e
        speculation = None
        if self.config.speculate != "none" and params.speculate:
            speculation = Speculation(self.config.num_speculative_tokens)
        return Request(
            request_id,
            list(checked),
            params,
            progress_callback,
            whole_prefill or self.whole_prefill,
            index=index,
            sampling=sampling,
            output=OutputStream(self.tokenizer, params),
            speculation=speculation,
            images=checked.images,
            rope_positions=checked.rope_positions,
        )

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

    @functools.cached_property
    def admission(self) -> Admission:
        """The checks every request passes (admission.py), against the context this engine
        settled on in __init__."""
        return Admission(
            self.tokenizer,
            self.max_model_len,
            self.decoder.config.vocab_size,
            self.vision,
            self.config.limit_mm_per_prompt,
            self.config.max_image_pixels,
        )

    @property
    def has_work(self) -> bool:
        return bool(
            self._incoming or self._cancels or self.scheduler.waiting or self.scheduler.running
        )

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One hybrid forward over everything scheduled, then one token per finished prompt
        or decode, and for a decode with proposed tokens, one more per accepted proposal. A
        failure is isolated to the requests it comes from: the others in the batch continue
        with the tokens they would have had."""
        events: list[Event] = []
        self._take_incoming(events)
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self._propose(plan)
        if not plan.chunks:
            return events
        features = self._features(plan)  # before the update moves num_computed
        outcome = StepOutcome()
        runs = self._execute(events, plan, outcome)
        self._sample_runs(events, runs, outcome)
        outcome.finished = self._take_ended()
        self.runner.copy_blocks(self.scheduler.update(plan, outcome))
        self._observe_step(plan, features, time.perf_counter() - started)
        return events

    def _propose(self, plan: StepPlan) -> None:
        """The draft model's part of the plan: it forgets what it held for the requests the
        plan preempted, reads and proposes, and the scheduler puts its proposals in the
        decodes' chunks."""
        if self.draft is None:
            return
        for request in plan.preempted:
            self.draft.release(request)
        if plan.drafts:
            self.scheduler.verify(plan, self.draft.propose(plan.drafts))

    def _execute(
        self, events: list[Event], plan: StepPlan, outcome: StepOutcome
    ) -> list[tuple[Request, torch.Tensor, list[int]]]:
        """Runs the plan's encodes and its forward, and reads each computed chunk's rows.
        Returns each request that samples now with its rows to sample and its proposals."""
        for chunk in [c for c in plan.chunks if not c.num_tokens]:  # an encode alone: no rows
            try:
                self.runner.encode(chunk)
            except Exception as exc:
                self._fail(events, chunk.request, exc)
        forks = {fork.parent: fork for fork in plan.forks}
        runs: list[tuple[Request, torch.Tensor, list[int]]] = []
        for chunk, rows in self._forward(events, [c for c in plan.chunks if c.num_tokens]):
            outcome.computed.append(chunk)
            try:
                # A draft's chunk has a row per token; the last 1 + len(draft) are sampled.
                last = rows[len(rows) - 1 - len(chunk.draft) :]
                fork = forks.get(chunk.request)
                runs += [(req, last, chunk.draft) for req in self._read(events, chunk, rows, fork)]
            except Exception as exc:
                self._fail(events, chunk.request, exc)
        return runs

    @staticmethod
    def _features(plan: StepPlan) -> list[float]:
        """The step's features for the cost model (cost_model.step_features)."""
        decodes = plan.decodes
        prompts = [c for c in plan.chunks if not c.request.is_decoding]
        # A draft's tokens attend as decodes do (runner), and cost as much.
        return step_features(
            [c.request.num_computed + 1 + i for c in decodes for i in range(c.num_tokens)],
            [(c.num_tokens, c.request.num_computed) for c in prompts],
            sum(
                c.request.images[i].length * units / c.request.images[i].units
                for c in plan.chunks
                for i, units in c.encodes
            ),
        )

    def _observe_step(self, plan: StepPlan, features: list[float], elapsed: float) -> None:
        decode_tokens = sum(c.num_tokens for c in plan.decodes)
        prefill_tokens = sum(c.num_tokens for c in plan.chunks) - decode_tokens
        self.num_steps += 1
        self.metrics.step_time.observe(elapsed)
        self.last_step = (decode_tokens, prefill_tokens, elapsed)
        if self.cost_model is not None:
            self.cost_model.observe(features, elapsed)

    def _forward(
        self, events: list[Event], chunks: list[ScheduledChunk]
    ) -> list[tuple[ScheduledChunk, torch.Tensor]]:
        """Each chunk with its logits, from one forward. If that fails, the chunks run one at a
        time and only those that fail alone fail their requests. (Rewriting a chunk's K/V is
        harmless: the same tokens write the same values.)"""
        if not chunks:
            return []
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

    def _read(
        self, events: list[Event], chunk: ScheduledChunk, rows: torch.Tensor, fork: Fork | None
    ) -> list[Request]:
        """Reads a computed chunk's rows (prompt logprobs, pooling, progress); returns the
        requests that now sample a token from rows[-1]: its own, and when it completes a prompt
        with n choices, the ones the plan forks from it. (Scheduler.update books the chunk.)"""
        req = chunk.request
        start = req.num_computed
        in_prompt = start < len(req.prompt_ids)
        if in_prompt and req.params.prompt_logprobs is not None:
            self._record_prompt_logprobs(req, start, rows)
        if req.pooling is not None:
            self._pool(req, start, rows[0])
        computed = start + chunk.num_tokens - len(chunk.draft)  # proposals: once accepted
        if in_prompt and req.first_token_time is None:
            processed = min(computed, len(req.prompt_ids))
            self._emit(events, req, ProgressEvent(req.request_id, processed, len(req.prompt_ids)))
        if computed < req.num_tokens:
            return []
        if req.pooling is not None:
            self._finish(events, req, "stop", embedding=self._embedding(req))
            return []
        if req.params.max_tokens == 0:
            self._finish(events, req, "length")
            return []
        if fork is None:
            return [req]
        for child in req.forks:
            child.prompt_logprobs = list(req.prompt_logprobs)
        req.forks = []
        return [req, *fork.children]

    @staticmethod
    def _pool(req: Request, start: int, hidden: torch.Tensor) -> None:
        """Books an embedding chunk's hidden state (runner.execute): the last token's, or
        (mean) the sum of the chunk's, added to the sum so far. A mean-pooled prompt reads no
        prefix cache, so it always starts again from its first token (after a preemption
        too)."""
        if req.pooling == "mean" and start > 0:
            req.pooled = req.pooled + hidden
        else:
            req.pooled = hidden

    @staticmethod
    def _embedding(req: Request) -> list[float]:
        pooled = req.pooled
        if req.pooling == "mean":
            pooled = pooled / len(req.prompt_ids)
        return F.normalize(pooled, dim=-1).tolist()

    def _sample_runs(
        self,
        events: list[Event],
        runs: list[tuple[Request, torch.Tensor, list[int]]],
        outcome: StepOutcome,
    ) -> None:
        """Samples each request's rows in order, all requests' row j in one batch, and appends
        each token as it comes. A request's next row is sampled only while its tokens are its
        draft's: row j's logits saw draft[j] in the context, so they are the next token's only
        if draft[j] is what was drawn (speculation.py says why this keeps the distribution).
        The outcome gets who sampled, and each verified request's accepted proposals (whose
        K/V it keeps; the rest is dropped: Scheduler.update)."""
        rows_of = {req: rows for req, rows, _ in runs}
        draft_of = {req: draft for req, _, draft in runs}
        accepted = dict.fromkeys(draft_of, 0)
        live = list(draft_of)
        position = 0
        while live:
            sampled = self._sample(events, [(req, rows_of[req][position]) for req in live])
            live = []
            for req, token, info in sampled:
                try:
                    self._append_token(events, req, token, info)
                except Exception as exc:
                    self._fail(events, req, exc)
                    continue
                if position == 0:
                    outcome.sampled.append(req)
                draft = draft_of[req]
                if position < len(draft) and token == draft[position]:
                    accepted[req] += 1
                    if req not in self._ended:
                        live.append(req)
            position += 1
        for req, draft in draft_of.items():
            if not draft:
                continue
            req.speculation.observe(len(draft), accepted[req])
            self.metrics.speculative_proposed_tokens += len(draft)
            self.metrics.speculative_accepted_tokens += accepted[req]
            outcome.accepted[req] = accepted[req]

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
        states = [r.sampling for r in reqs]
        rewind = [s.generator.get_state() if s.generator is not None else None for s in states]
        try:
            return [(r, t, i) for r, (t, i) in zip(reqs, sample(states, logits), strict=True)]
        except Exception:
            if len(reqs) > 1:
                log.exception("sampling %d rows failed: sampling them one at a time", len(reqs))
        out = []
        for row, (req, generator_state) in enumerate(zip(reqs, rewind, strict=True)):
            if generator_state is not None:
                req.sampling.generator.set_state(generator_state)
            try:
                [(token, info)] = sample([req.sampling], logits[row : row + 1])
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
        self.scheduler.finish(self._take_ended())
        return events

    def _take_ended(self) -> list[Request]:
        """The requests ended since the last call, for the scheduler to drop."""
        ended, self._ended = list(self._ended), {}
        return ended

    def _take_incoming(self, events: list[Event]) -> None:
        with self._lock:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
            cancels = list(self._cancels)
            self._cancels.clear()
        for request_id in cancels:
            for req in list(self._requests.get(request_id, [])):
                self._finish(events, req, "cancelled")
        self.scheduler.finish(self._take_ended())

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
        req.sampling.accept(token)
        req.output_ids.append(token)
        self._observe_token(req)
        finish = req.finish_reason(token, self.eos_ids, self.max_model_len)
        shown = None if req.is_stop_token(token, self.eos_ids) else token
        text, logprobs, stopped = req.output.render(shown, info, last=finish is not None)
        if stopped:
            finish = "stop"
        self._emit(
            events, req, TokenEvent(req.request_id, [token], text, logprobs or None, req.index)
        )
        if finish is not None:
            self._finish(events, req, finish)

    def _observe_token(self, req: Request) -> None:
        """A new token's timings and metrics."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.time_to_first_token.observe(now - req.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - req.last_token_time)
        req.last_token_time = now
        self.metrics.generation_tokens += 1

    def _finish(
        self,
        events: list[Event],
        req: Request,
        reason: str,
        error: str | None = None,
        embedding: list[float] | None = None,
    ) -> None:
        if req.state is RequestState.FINISHED or req in self._ended:
            return  # a fork already ended with the choice it waited on
        self._ended[req] = None  # the scheduler drops it (_take_ended)
        if self.draft is not None:
            self.draft.release(req)
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
                stop_string=req.output.stop_string,
                preempted=req.preemptions,
                timings=self._timings(req),
                index=req.index,
                embedding=embedding,
            ),
        )
        req.pooled = None
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

    def queued(self) -> list[Request]:
        """The requests added since the last step began, not yet the scheduler's
        (thread-safe)."""
        with self._lock:
            return list(self._incoming)


__all__ = ["Engine", "EngineFailed", "RequestError", "QueueFull", "ScheduledChunk"]
