"""One engine thread stepping the engine; per-request asyncio streams for the server."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gapless.device import tune_allocator
from gapless.engine import observability
from gapless.engine.engine import Engine, EngineFailed
from gapless.engine.events import Event, FinishedEvent
from gapless.engine.sampling_params import SamplingParams
from gapless.model.parallel import RankFailed

log = logging.getLogger("gapless.engine")


def engine_thread() -> ThreadPoolExecutor:
    """A thread for all of an engine's torch work: load the engine on it, then pass it to
    AsyncEngine, which steps the engine there.

    Why one thread: with libgomp (torch's OpenMP on Linux), a second thread that runs parallel
    ops beside the one that loaded the model gets its own team of workers; with more OpenMP
    threads than cores, libgomp's workers stop spinning between ops and every op pays a
    wake-up. A torch op from the engine thread then took ~100 us instead of ~22, and a
    SmolLM2 decode step 35-46 ms instead of 18-21 (2 cores).
    """
    tune_allocator()  # before the thread's first allocation (device.tune_allocator says why)
    return ThreadPoolExecutor(1, thread_name_prefix="gapless-engine")


class Summaries:
    """observability.summary() for live viewers, made on the engine thread while `sink` is set:
    after a step, at most once per `interval` seconds (the state after a burst of steps goes
    out one interval later), and once per `heartbeat` seconds while nothing changes, so ages
    tick and the step rate falls to 0 when idle. Nobody watching costs one check a step."""

    def __init__(self, engine: Engine, interval: float = 0.1, heartbeat: float = 1.0) -> None:
        self.engine = engine
        self.interval = interval
        self.heartbeat = heartbeat
        # Called on the engine thread with each summary; None: nobody watches.
        self.sink: Callable[[dict[str, Any]], None] | None = None
        self._due = False  # something changed since the last summary
        self._last = 0.0
        self._steps = engine.num_steps
        self._step_times: deque[float] = deque(maxlen=10_000)  # of the last second's steps

    def request(self) -> None:
        """A new viewer wants the current state (at the next chance, within one interval)."""
        self._due = True

    def stepped(self) -> None:
        """After Engine.step(), which may have run a step, or only taken in and cancelled."""
        if self.sink is not None:
            if self.engine.num_steps != self._steps:
                self._steps = self.engine.num_steps
                self._step_times.append(time.monotonic())
            self._due = True
            self.publish()

    def publish(self) -> float:
        """Publishes a summary if one is due; returns the seconds until the next may be."""
        sink = self.sink
        if sink is None:
            return 0.5
        now = time.monotonic()
        wait = self._last + (self.interval if self._due else self.heartbeat) - now
        if wait > 0:
            return wait
        times = self._step_times
        while times and times[0] < now - 1.0:
            times.popleft()
        self._due, self._last = False, now
        try:
            summary = observability.summary(self.engine)
            summary["steps_per_s"] = len(times)
            sink(summary)
        except Exception:  # a viewer's trouble must never stop the engine thread
            log.exception("publishing a step summary failed")
        return self.interval


class AsyncEngine:
    def __init__(self, engine: Engine, thread: ThreadPoolExecutor | None = None) -> None:
        """thread: the engine_thread() the engine was loaded on; else a new one."""
        self.engine = engine
        # By request id: where its events go, and how many of its choices are still running.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[int]]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = thread or engine_thread()
        self._running: Future[None] | None = None
        # Set when the engine can run no more steps; then called, from the engine thread.
        self.failure: str | None = None
        self.on_failure: Callable[[], None] | None = None
        self.summaries = Summaries(engine)

    def start(self) -> None:
        self._running = self._thread.submit(self._run)

    def stop(self) -> None:
        """Ends the engine thread after its current step. Idempotent."""
        self._stopping = True
        self._wake.set()
        if self._running is not None:
            self._running.result()
        self._thread.shutdown()

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[Event]:
        """Adds a request now and returns its events, ending with the FinishedEvent of the last
        of its n choices.

        Raises RequestError / QueueFull / EngineFailed at once. If the consumer stops iterating
        early (a client disconnect), the request is cancelled.
        """
        return self._open(
            request_id, params.n, lambda rid: self.engine.add_request(prompt, params, rid)
        )

    def embed(
        self,
        prompts: list[str | list[int]],
        request_id: str | None = None,
        pooling: str | None = None,
    ) -> AsyncIterator[Event]:
        """Adds an embedding request now (Engine.add_embedding) and returns its events,
        ending with the last of its prompts' FinishedEvents; as stream() otherwise."""
        return self._open(
            request_id,
            len(prompts),
            lambda rid: self.engine.add_embedding(prompts, rid, pooling),
        )

    def score(self, pairs: list[list[int]], request_id: str | None = None) -> AsyncIterator[Event]:
        """Adds a score request now (Engine.add_score) and returns its events, ending with the
        last of its pairs' FinishedEvents; as stream() otherwise."""
        return self._open(request_id, len(pairs), lambda rid: self.engine.add_score(pairs, rid))

    def _open(
        self, request_id: str | None, n: int, add: Callable[[str], object]
    ) -> AsyncIterator[Event]:
        """The events of a request of n sequences that add(request_id) adds."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        # Registered before the engine can see the request, so no event is missed.
        self._streams[request_id] = (loop, queue, [n])
        try:
            add(request_id)
        except Exception:
            del self._streams[request_id]
            raise
        self._wake.set()
        return self._events(request_id, queue, n)

    async def _events(
        self, request_id: str, queue: asyncio.Queue[Event], n: int
    ) -> AsyncIterator[Event]:
        finished = 0
        try:
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, FinishedEvent):
                    finished += 1
                    if finished == n:
                        return
        finally:
            if finished < n:
                self.engine.cancel(request_id)
                self._wake.set()

    def cancel(self, request_id: str) -> bool:
        cancelled = self.engine.cancel(request_id)
        self._wake.set()
        return cancelled

    def watch(self, sink: Callable[[dict[str, Any]], None] | None) -> None:
        """Step summaries go to sink(summary), on the engine thread (see Summaries), from
        the next chance on; None stops them. Thread-safe."""
        self.summaries.sink = sink
        if sink is not None:
            self.summaries.request()
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work:
                self._wake.wait(timeout=min(0.5, self.summaries.publish()))
                self._wake.clear()
                continue
            steps = self.engine.num_steps
            try:
                events = self.engine.step()
            except RankFailed as exc:
                log.error("%s; failing every request", exc)
                self.failure = str(exc)
                self._stopping = True
                events = self.engine.fail_all(self.failure)
            except Exception as exc:  # an engine bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                events = self.engine.fail_all(f"{type(exc).__name__}: {exc}")
            self.summaries.stepped()
            if not events and self.engine.num_steps == steps:
                # Work is queued but nothing could run (e.g. the sequence cap): don't spin.
                self._wake.wait(timeout=0.01)
                self._wake.clear()
            for event in events:
                target = self._streams.get(event.request_id)
                if target is None:
                    continue
                loop, queue, running = target
                if isinstance(event, FinishedEvent):
                    running[0] -= 1
                    if not running[0]:
                        del self._streams[event.request_id]
                loop.call_soon_threadsafe(queue.put_nowait, event)
        if self.failure is not None and self.on_failure is not None:
            self.on_failure()
