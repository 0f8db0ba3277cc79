"""KV events for prefix-aware routers (--kv-events-endpoint): the prefix cache's blocks as
they enter and leave it, in vLLM's KV-event format, so that a router that reads vLLM's
events (llm-d's KV-cache indexer, NVIDIA Dynamo's KV router) knows which replica holds which
prefix.

The wire format is vLLM's (vllm/distributed/kv_events.py): each message is three ZMQ frames,
[topic, sequence number as 8 bytes big-endian, payload], and the payload is a msgpack
`KVEventBatch`, which vLLM encodes with msgspec as arrays in field order (array_like), each
event tagged by its class name first:

    [ts, [event, ...], data_parallel_rank]
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

The hashes are the prefix cache's own (kv/prefix_cache.py; docs/distributed.md says how a
router computes them). gapless has no LoRA adapters (lora_id and lora_name are nil), and
medium is nil: the blocks are the cache attention reads, vLLM's "GPU" tier, on whatever
device that is.

The engine thread only queues events; a thread of this module encodes and sends them, so a
step never waits on the network. A subscriber that falls behind loses messages at ZMQ's
high-water mark, and sees it by a gap in the sequence numbers.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import msgpack
import zmq

# Messages ZMQ holds for a slow subscriber before it drops them (vLLM's default).
HIGH_WATER_MARK = 100_000
# How long close() waits for queued events to go out.
CLOSE_TIMEOUT_S = 1.0


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds the endpoint (else it connects to a router that binds),
    by vLLM's rule: a wildcard host, an IPv6 `::`, or an ipc:// or inproc:// path binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The prefix cache's events (kv/block_pool.py, CacheEvents) on a ZMQ PUB socket."""

    def __init__(self, endpoint: str, topic: str, block_size: int) -> None:
        self.block_size = block_size
        self._topic = topic.encode()
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(HIGH_WATER_MARK)
        if binds(endpoint):
            self._socket.bind(endpoint)  # here, so that a port in use stops the start
        else:
            self._socket.connect(endpoint)
        # Events as their wire arrays; None ends the thread.
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        # A new server's cache is empty: whatever a router kept of an earlier one is gone.
        # (Sent at once, it reaches only subscribers that are already connected.)
        self._queue.put(["AllBlocksCleared"])
        self._thread = threading.Thread(target=self._send, name="kv-events", daemon=True)
        self._thread.start()

    def stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int]) -> None:
        self._queue.put(
            ["BlockStored", block_hashes, parent, token_ids, self.block_size, None, None, None]
        )

    def removed(self, block_hashes: list[int]) -> None:
        self._queue.put(["BlockRemoved", block_hashes, None])

    def close(self) -> None:
        """Sends what is queued (for at most CLOSE_TIMEOUT_S), then closes the socket."""
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._socket.close(linger=0)

    def _send(self) -> None:
        """One batch per wake-up: every event queued meanwhile, in order."""
        seq = 0
        while True:
            events = [self._queue.get()]
            while events[-1] is not None and not self._queue.empty():
                events.append(self._queue.get())
            last = events[-1] is None
            if last:
                events.pop()
            if events:
                # data_parallel_rank 0: each replica is its own engine (vLLM's single rank).
                payload = msgpack.packb([time.time(), events, 0])
                self._socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                seq += 1
            if last:
                return
