"""The step loop: schedule, run one hybrid forward, sample, emit events."""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gapless.engine import builder, distributed, scoring
from gapless.engine.admission import Admission, RequestError
from gapless.engine.config import EngineConfig
from gapless.engine.cost_model import plan_features
from gapless.engine.draft import DraftModel
from gapless.engine.emitter import Emitter, embedding, pool, record_prompt_logprobs
from gapless.engine.events import Event
from gapless.engine.in_flight import LaunchedStep
from gapless.engine.intake import Intake, QueueFull
from gapless.engine.metrics import EngineMetrics
from gapless.engine.plan import Fork, ScheduledChunk, StepOutcome, StepPlan
from gapless.engine.request import Request
from gapless.engine.runner import ModelRunner
from gapless.engine.sample_runs import sample_runs
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.scheduler import Scheduler
from gapless.engine.structured import GrammarCompiler
from gapless.model.decoder import Decoder
from gapless.model.parallel import RankFailed
from gapless.model.tokenizer import Tokenizer
from gapless.model.vision import VisionLanguageModel

log = logging.getLogger("gapless.engine")

NOT_A_SCORER = (
    "this model does not score pairs: serve a *ForSequenceClassification checkpoint, or a "
    "yes/no reranker such as Qwen3-Reranker with --reranker"
)


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
        model: Path | None = None,
    ) -> None:
        """`draft`: the draft model's decoder, with --speculate draft (its tokenizer checked
        against `tokenizer` already). `vision`: a vision-language model's encoder and
        processor (its decoder is `decoder`): prompts may then hold images. `runner`: one
        sized by builder.kv_runner unless given. `model`: the file or directory the weights
        came from (what the KV disk tier's fingerprint reads)."""
        self.config = config = config or EngineConfig()
        self.decoder = decoder
        self.vision = vision
        self.tokenizer = tokenizer
        # How it scores rerank and score requests' pairs; None: it does not.
        self.scorer = scoring.scorer_of(decoder, tokenizer, config.reranker)
        mcfg, scheduling = decoder.config, config.scheduler
        self.runner = runner = runner or builder.kv_runner(decoder, config, draft, vision)
        self.draft = None
        if draft is not None:
            cache_dtype = builder.kv_cache_dtype(draft, config)
            self.draft = DraftModel(draft, runner.num_blocks, runner.block_size, cache_dtype)
        self.kv = builder.kv_manager(runner, config, model)
        self.max_model_len = builder.max_model_len(decoder, config, self.kv)
        chunked = scheduling.chunked_prefill
        self.whole_prefill = not chunked or not runner.supports_chunked_prefill
        if chunked and not runner.supports_chunked_prefill:
            log.warning("this model runner cannot prefill in chunks: prefilling every prompt whole")
        self.cost_model = builder.cost_model(config, vision is not None)
        ttft_targets, itl_targets = config.latency_targets()
        budget = encode_cost = None
        if self.cost_model is not None:
            encode_cost = self.cost_model.encode_cost
            if itl_targets:
                budget = self.cost_model.prefill_budget
        self.scheduler = Scheduler(
            scheduling,
            self.kv,
            prefill_budget=budget,
            itl_targets=itl_targets,
            max_model_len=self.max_model_len,
            encode_cost=encode_cost,
            draft_unseen=None if self.draft is None else self.draft.unseen,
            micro_batches=config.pipeline_parallel_size,
            prompt_work=mcfg.prompt_work(),
        )
        # A pipeline of P stages keeps up to P steps in flight: while the later stages run one,
        # rank 0 runs its stage of the next (_step_in_flight).
        self.max_in_flight = config.pipeline_parallel_size
        self._in_flight: deque[LaunchedStep] = deque()
        self.steps_overlapped = 0  # steps launched while another was in flight
        self.metrics = EngineMetrics(ttft_targets, itl_targets)
        self.num_steps = 0
        # The last step that ran: its decode tokens, prompt tokens and wall time (summary()).
        self.last_step = (0, 0, 0.0)
        admission = Admission(
            tokenizer,
            self.max_model_len,
            mcfg.vocab_size,
            vision,
            config.limit_mm_per_prompt,
            config.max_image_pixels,
            generates=decoder.classifier is None,
            adapters=tuple(decoder.adapters.names) if decoder.adapters else (),
        )
        eos_ids = tokenizer.eos_token_ids  # read once, with the tokenizer
        self.grammars = GrammarCompiler(tokenizer, mcfg.vocab_size, sorted(eos_ids))
        self.intake = Intake(
            config,
            admission,
            self.grammars,
            decoder.device,
            self.whole_prefill,
            lambda: len(self.scheduler.waiting),
        )
        self.emitter = Emitter(eos_ids, self.max_model_len, self.metrics, self.intake, self.draft)
        self._close: Callable[[], object] = lambda: None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        group: distributed.Group | None = None,
    ) -> Engine:
        """The engine of a checkpoint, built by builder.build (which says what it sets up,
        and how tensor parallelism's ranks start). A tensor-parallel group that call forms is
        this engine's alone: close() ends it, and no other engine's."""
        parts, stop = builder.build(path, config or EngineConfig(), group)
        engine = cls(**vars(parts))
        if stop is not None:
            engine._close = weakref.finalize(engine, stop)
        return engine

    def close(self) -> None:
        """Ends the tensor-parallel ranks this engine started (also done when it is garbage
        collected, and at exit) and waits for the KV disk tier's writes; idempotent. The
        engine runs no step afterwards."""
        if self.kv.disk is not None:
            self.kv.disk.close()
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
        context = min(self.max_model_len, self.kv.capacity_tokens())
        num_tokens = min(self.scheduler.max_step_tokens, context)
        self.runner.run_largest_step(num_tokens, context)
        if self.draft is not None:
            self.draft.runner.run_largest_step(num_tokens, context)

    # -- requests (Intake's, thread-safe) ---------------------------------------------------

    @property
    def admission(self) -> Admission:
        """The checks every request passes (admission.py), against the context this engine
        settled on in __init__."""
        return self.intake.admission

    def add_request(self, prompt: str | list[int], *args: Any, **kwargs: Any) -> str:
        """Intake.add_request: queues a request; it starts at the next step."""
        return self.intake.add_request(prompt, *args, **kwargs)

    def add_embedding(self, prompts: list[str | list[int]], *args: Any, **kwargs: Any) -> str:
        """Intake.add_embedding: queues a request for one embedding per prompt."""
        return self.intake.add_embedding(prompts, *args, **kwargs)

    def add_score(self, pairs: list[list[int]], request_id: str | None = None) -> str:
        """Queues a score request: one relevance score per pair prompt (Scorer.pair; a
        rerank's pairs share their query's prefix), each prompt's FinishedEvent carrying its
        `score`. Refused where the model does not score."""
        if self.scorer is None:
            raise RequestError(NOT_A_SCORER, "model", "model_cannot_score")
        return self.intake.add_score(pairs, self.scorer.pooling, request_id)

    def submit(
        self, prompt: str | list[int], params: SamplingParams | None = None, **kw: Any
    ) -> str:
        """The pre-chunking baseline (README, Python API): the prompt prefills in one step."""
        return self.add_request(prompt, params, whole_prefill=True, **kw)

    def cancel(self, request_id: str) -> bool:
        """Takes effect at the next step boundary. False if no such live request."""
        return self.intake.cancel(request_id)

    def queued(self) -> list[Request]:
        """The requests added since the last step began, not yet the scheduler's."""
        return self.intake.queued()

    @property
    def has_work(self) -> bool:
        return bool(
            self.intake.pending
            or self.scheduler.waiting
            or self.scheduler.running
            or self._in_flight
        )

    @property
    def steps_in_flight(self) -> int:
        """Steps launched and not yet completed (up to the pipeline's stages)."""
        return len(self._in_flight)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One hybrid forward over everything scheduled, then one token per finished prompt
        or decode, and for a decode with proposed tokens, one more per accepted proposal. A
        failure is isolated to the requests it comes from: the others in the batch continue
        with the tokens they would have had. A pipeline's step launches a micro-batch and
        completes the oldest in flight (_step_in_flight)."""
        self._take_incoming()
        if self.max_in_flight > 1:
            return self._step_in_flight()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self._propose(plan)
        if not plan.chunks and not plan.loads:
            if self.kv.disk is not None:  # a prefix waiting on its disk reads, if any
                self.kv.wait_for_reads([r.kv for r in self.scheduler.running], 0.01)
            return self.emitter.take_events()
        features = plan_features(plan)  # before the update moves num_computed
        self._complete(plan, self._execute(plan), features, started)
        return self.emitter.take_events()

    def _step_in_flight(self) -> list[Event]:
        """Launches a micro-batch, if there is room and work; then, when the pipeline is full
        or nothing was launched, completes the oldest step in flight. Each stage runs them in launch order. A request's next token
        needs its last one, so a decode is in one micro-batch at a time; a prompt's chunks
        may follow each other in consecutive ones (Scheduler.schedule)."""
        launched = False
        if len(self._in_flight) < self.max_in_flight:
            launched = self._launch()
        if self._in_flight and (not launched or len(self._in_flight) == self.max_in_flight):
            step = self._in_flight.popleft()
            rows = step.rows()
            for req in self.scheduler.in_flight.landed(step.plan, step.requests()):
                self.emitter.finish(req, "cancelled")
            computed = [(c, r) for c, r in rows if not self.emitter.has_ended(c.request)]
            self._complete(step.plan, computed, step.features, step.started)
        return self.emitter.take_events()

    def _launch(self) -> bool:
        """Plans a micro-batch and launches its forward; False if there was nothing to plan.
        (What pipeline parallelism refuses leaves no encodes and no draft model here.)"""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self._propose(plan)
        if not plan.chunks:
            return False
        self.steps_overlapped += bool(self._in_flight)
        features = plan_features(plan)
        chunks = plan.chunks
        logits = self.runner.launch(chunks, self._every_row(chunks))
        step = LaunchedStep(
            plan, lambda: list(zip(chunks, logits(), strict=True)), features, started
        )
        self.scheduler.in_flight.launched(plan, step.requests())
        self._in_flight.append(step)
        return True

    def _complete(
        self,
        plan: StepPlan,
        computed: list[tuple[ScheduledChunk, torch.Tensor]],
        features: list[float],
        started: float,
    ) -> None:
        """Reads the rows of the plan's computed chunks, samples, and books the step."""
        outcome = StepOutcome()
        runs = self._read_rows(plan, computed, outcome)
        sample_runs(runs, outcome, self.emitter, self.metrics)
        outcome.finished = self.emitter.take_ended()
        self.runner.copy_blocks(self.scheduler.update(plan, outcome))
        if self.kv.disk is not None:  # the blocks the update offered to the prefix cache
            for group, writes in self.kv.take_writes().items():
                kv = self.runner.blocks_kv(group, [block for _, block in writes])
                for (block_hash, _), block_kv in zip(writes, kv, strict=True):
                    self.kv.disk.write(block_hash, group, block_kv)
        self._observe_step(plan, features, time.perf_counter() - started)

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

    def _execute(self, plan: StepPlan) -> list[tuple[ScheduledChunk, torch.Tensor]]:
        """Runs the plan's encodes, then its forward over the chunks with tokens whose encodes
        did not fail: each computed chunk with its rows."""
        for load in plan.loads:
            request = load.request
            loads = self.kv.take_loads(request.kv, load.num_blocks, request.num_computed)
            for group, (blocks, kvs) in loads.items():
                self.runner.load_blocks(group, blocks, kvs)
        encoded = []
        for chunk in plan.chunks:
            try:
                self.runner.encode(chunk)
                encoded.append(chunk)
            except Exception as exc:
                self.emitter.fail(chunk.request, exc)
        return self._forward([c for c in encoded if c.num_tokens])

    def _read_rows(
        self,
        plan: StepPlan,
        computed: list[tuple[ScheduledChunk, torch.Tensor]],
        outcome: StepOutcome,
    ) -> list[tuple[Request, torch.Tensor, list[int]]]:
        """Reads each computed chunk's rows. Returns each request that samples now with its
        rows to sample and its proposals."""
        forks = {fork.parent: fork for fork in plan.forks}
        runs: list[tuple[Request, torch.Tensor, list[int]]] = []
        for chunk, rows in computed:
            outcome.computed.append(chunk)
            try:
                # A draft's chunk has a row per token; the last 1 + len(draft) are sampled.
                last = rows[len(rows) - 1 - len(chunk.draft) :]
                fork = forks.get(chunk.request)
                runs += [(req, last, chunk.draft) for req in self._read(chunk, rows, fork)]
            except Exception as exc:
                self.emitter.fail(chunk.request, exc)
        return runs

    def _observe_step(self, plan: StepPlan, features: list[float], elapsed: float) -> None:
        decode_tokens = sum(c.num_tokens for c in plan.decodes)
        prefill_tokens = sum(c.num_tokens for c in plan.chunks) - decode_tokens
        self.num_steps += 1
        self.metrics.step_time.observe(elapsed)
        self.last_step = (decode_tokens, prefill_tokens, elapsed)
        if self.cost_model is not None:
            self.cost_model.observe(features, elapsed)

    def _forward(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, torch.Tensor]]:
        """Each chunk with its logits, from one forward. If that fails, the chunks run one at a
        time and only those that fail alone fail their requests. (Rewriting a chunk's K/V is
        harmless: the same tokens write the same values.)"""
        if not chunks:
            return []
        every_row = self._every_row(chunks)
        try:
            logits = self.runner.execute(chunks, every_row)
            return list(zip(chunks, logits, strict=True))
        except RankFailed:
            raise  # not the chunks' fault, and the ranks can run nothing more
        except Exception as exc:
            if len(chunks) == 1:
                self.emitter.fail(chunks[0].request, exc)
                return []
            log.exception("a forward of %d chunks failed: running them one at a time", len(chunks))
        survivors = []
        for i, chunk in enumerate(chunks):
            try:
                every = {0} if i in every_row else set()
                survivors.append((chunk, self.runner.execute([chunk], every)[0]))
            except Exception as exc:
                self.emitter.fail(chunk.request, exc)
        return survivors

    @staticmethod
    def _every_row(chunks: list[ScheduledChunk]) -> set[int]:
        """The chunks whose every row's logits are read: prompts asking for prompt logprobs."""
        return {
            i
            for i, c in enumerate(chunks)
            if c.request.num_scheduled < len(c.request.prompt_ids)
            and c.request.params.prompt_logprobs is not None
        }

    def _read(self, chunk: ScheduledChunk, rows: torch.Tensor, fork: Fork | None) -> list[Request]:
        """Reads a computed chunk's rows (prompt logprobs, pooling, progress); returns the
        requests that now sample a token from rows[-1]: its own, and when it completes a prompt
        with n choices, the ones the plan forks from it. (Scheduler.update books the chunk.)"""
        req = chunk.request
        start = req.num_computed
        in_prompt = start < len(req.prompt_ids)
        if in_prompt and req.params.prompt_logprobs is not None:
            record_prompt_logprobs(req, start, rows)
        if req.pooling is not None:
            pool(req, start, rows[0])
        computed = start + chunk.num_tokens - len(chunk.draft)  # proposals: once accepted
        if in_prompt and req.first_token_time is None:
            processed = min(computed, len(req.prompt_ids))
            self.emitter.progress(req, processed)
        if computed < req.num_tokens:
            return []
        if req.scores:  # its last token's row: a classifier's hidden state, or logits
            self.emitter.finish(req, "stop", score=self.scorer.score(rows[-1]))  # type: ignore[union-attr]
            return []
        if req.pooling is not None:
            self.emitter.finish(req, "stop", embedding=embedding(req))
            return []
        if req.params.max_tokens == 0:
            self.emitter.finish(req, "length")
            return []
        if fork is None:
            return [req]
        self.emitter.forked(req)
        return [req, *fork.children]

    def fail_all(self, error: str) -> list[Event]:
        """Ends every live request with an error, releasing its KV; the engine stays usable.
        The steps in flight are dropped (after a failed rank, none completes)."""
        while self._in_flight:
            step = self._in_flight.popleft()
            self.scheduler.in_flight.landed(step.plan, step.requests())
        self._take_incoming()
        for req in self.intake.live():
            self.emitter.finish(req, "error", error)
        self.scheduler.finish(self.emitter.take_ended())
        return self.emitter.take_events()

    def _take_incoming(self) -> None:
        incoming, cancelled = self.intake.take()
        for req in incoming:
            self.scheduler.add(req)
        for req in cancelled:
            if not self.scheduler.in_flight.cancel(req):
                self.emitter.finish(req, "cancelled")
        self.scheduler.finish(self.emitter.take_ended())


__all__ = ["Engine", "EngineFailed", "QueueFull", "RequestError", "ScheduledChunk"]
