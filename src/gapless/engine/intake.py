"""Intake: requests coming into an engine from any thread. Each is checked (Admission),
built into its sequences, registered under its id, and handed to the step loop at its next
step, as are cancellations."""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence

import torch

from gapless.engine.admission import Admission, CheckedPrompt, ImageInput, RequestError
from gapless.engine.config import EngineConfig
from gapless.engine.events import ProgressEvent
from gapless.engine.output import OutputStream
from gapless.engine.prompt_lookup import PromptLookup
from gapless.engine.request import POOLINGS, Request
from gapless.engine.sampler import SamplingState, TokenCounts
from gapless.engine.sampling_params import SamplingParams
from gapless.engine.speculation import Speculation
from gapless.engine.structured import GrammarCompiler, GrammarError


class QueueFull(RuntimeError):
    pass


class Intake:
    def __init__(
        self,
        config: EngineConfig,
        admission: Admission,
        grammars: GrammarCompiler,
        device: str,
        whole_prefill: bool,
        waiting: Callable[[], int],
    ) -> None:
        """whole_prefill: the engine prefills every prompt whole. waiting: how many sequences
        wait in the scheduler (the queue bound counts them with those not yet taken)."""
        self.config = config
        self.admission = admission
        self.grammars = grammars
        self.device = device
        self.whole_prefill = whole_prefill
        self.waiting = waiting
        self._live: dict[str, list[Request]] = {}  # by id: the sequences not yet ended
        self._incoming: deque[Request] = deque()
        self._cancels: deque[str] = deque()
        self._lock = threading.Lock()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        progress_callback: Callable[[ProgressEvent], None] | None = None,
        whole_prefill: bool = False,
        images: Sequence[ImageInput] = (),
    ) -> str:
        """Queues a request; it starts at the next step. Returns its id.

        A request for n choices is n sequences under one id, told apart by their events'
        `index`: the first prefills the prompt, the others fork from it (engine/forks.py).
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
        """Queues an embedding request: one sequence per prompt under one id. Each prompt
        prefills in chunks beside the running decodes, as any prompt does, then ends, sampling
        nothing: its FinishedEvent (`index` its position in prompts) carries its hidden states
        after the final norm, pooled (`pooling`, default the engine's) and L2-normalized
        (_prefill_only says the rest)."""
        pooling = pooling or self.config.pooling
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}", "pooling")
        if not prompts:
            raise RequestError("there is no prompt to embed", "prompt", None)
        sequences = self._prefill_only(prompts, request_id, pooling, progress_callback)
        self._queue(sequences[0].request_id, sequences, sequences)
        return sequences[0].request_id

    def add_score(
        self, pairs: list[list[int]], pooling: str | None, request_id: str | None = None
    ) -> str:
        """Queues a score request: one sequence per pair prompt (engine/scoring.py), each
        prefilled as an embedding's prompt is, then ended with its score in its FinishedEvent
        (`index` its position in pairs). `pooling`: the scorer's (`last`: a classifier reads
        the last token's hidden state; None: the yes/no recipe reads its logits).

        A rerank's pairs begin alike (the recipe's preamble and the query): every pair after
        the first waits to be admitted until the first has computed the tokens they share,
        and then the prefix cache serves them, so that the query is prefilled once."""
        if not pairs:
            raise RequestError("there is no pair to score", "prompt", None)
        sequences = self._prefill_only(pairs, request_id, pooling, None)
        first, *others = sequences
        shared = min((_common_prefix(first.prompt_ids, s.prompt_ids) for s in others), default=0)
        enough = self.config.scheduler.enable_prefix_cache and shared >= self.config.block_size
        for seq in sequences:
            seq.scores = True
            if enough and seq is not first:
                seq.prefix_leader, seq.shared_prefix = first, shared
        self._queue(first.request_id, sequences, sequences)
        return first.request_id

    def _prefill_only(
        self,
        prompts: list[str | list[int]] | list[list[int]],
        request_id: str | None,
        pooling: str | None,
        progress_callback: Callable[[ProgressEvent], None] | None,
    ) -> list[Request]:
        """The sequences of a request that prefills its prompts and samples nothing. A prompt
        may fill the whole context, as it has no output. Its service class is batch: nobody
        reads it token by token, and it is often bulk work (indexing, reranking)."""
        checked = [self.admission.check_prompt(p, output=False) for p in prompts]
        request_id = request_id or uuid.uuid4().hex
        params = SamplingParams(max_tokens=0, service_class="batch")
        return [
            Request(
                request_id,
                list(ids),
                params,
                progress_callback,
                self.whole_prefill,
                index=i,
                output=OutputStream(self.admission.tokenizer, params),
                pooling=pooling,
            )
            for i, ids in enumerate(checked)
        ]

    def _queue(self, request_id: str, sequences: list[Request], incoming: list[Request]) -> None:
        """Registers a request's sequences under its id; `incoming` start at the next step."""
        with self._lock:
            if request_id in self._live:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            limit = self.config.max_queue
            queued = self.waiting() + len(self._incoming)
            if limit is not None and queued + len(incoming) > limit:
                raise QueueFull(f"the queue is full ({limit} waiting requests)")
            self._live[request_id] = sequences
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
            vocab = self.admission.vocab_size
            sampling.counts = TokenCounts(checked, [], vocab, self.device)
        if params.grammar is not None:
            try:
                sampling.matcher = self.grammars.matcher(params.grammar)
            except GrammarError as e:
                raise RequestError(f"the grammar does not compile: {e}", "grammar") from e
        speculation = lookup = None
        if self.config.speculate != "none" and params.speculate:
            speculation = Speculation(self.config.num_speculative_tokens)
            if self.config.speculate == "ngram":
                lookup = PromptLookup()
        return Request(
            request_id,
            list(checked),
            params,
            progress_callback,
            whole_prefill or self.whole_prefill,
            index=index,
            sampling=sampling,
            output=OutputStream(self.admission.tokenizer, params),
            speculation=speculation,
            lookup=lookup,
            images=checked.images,
            rope_positions=checked.rope_positions,
        )

    def cancel(self, request_id: str) -> bool:
        """Takes effect at the next step boundary. False if no such live request."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancels.append(request_id)
            return True

    def take(self) -> tuple[list[Request], list[Request]]:
        """For the step loop: the sequences that start now, and the sequences of the requests
        cancelled since the last call."""
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            cancels, self._cancels = list(self._cancels), deque()
            cancelled = [req for rid in cancels for req in self._live.get(rid, [])]
        return incoming, cancelled

    def ended(self, req: Request) -> None:
        """A sequence ended: its id is free once all of its request's have."""
        with self._lock:
            sequences = self._live.get(req.request_id, [])
            if req in sequences:
                sequences.remove(req)
            if not sequences:
                self._live.pop(req.request_id, None)

    def sequences(self, request_id: str) -> list[Request]:
        """A request's sequences not yet ended."""
        with self._lock:
            return list(self._live.get(request_id, []))

    def live(self) -> list[Request]:
        """Every sequence not yet ended."""
        with self._lock:
            return [req for sequences in self._live.values() for req in sequences]

    def queued(self) -> list[Request]:
        """The sequences added since the last step began, not yet the scheduler's."""
        with self._lock:
            return list(self._incoming)

    @property
    def pending(self) -> bool:
        """Sequences or cancellations wait for the next step."""
        return bool(self._incoming or self._cancels)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
