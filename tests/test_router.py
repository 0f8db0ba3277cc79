"""Replicas behind an existing router: the Gateway API Inference Extension's model-server
metrics on /metrics, and the prefix cache's KV events in vLLM's format, read by a ZMQ
subscriber that decodes them with vLLM's own message types."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from helpers import gate_forwards
from server_fixture import MODEL, RunningServer, SSEReader, running_server

from gapless.kv.prefix_cache import block_hashes
from gapless.server.settings import ServerSettings

BLOCK = 16  # the engine's default block size
CHUNK = 16
TOPIC = f"kv@replica-0@{MODEL}"


# -- vLLM's KV-event types (vllm/distributed/kv_events.py), as its consumers declare them ---
# Fields in vLLM's order; msgspec decodes array_like structs by position and checks each type.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The first release's types (vLLM's example subscriber): no lora_name, no data_parallel_rank.
# A consumer built on them must read the same messages: msgspec skips trailing extra fields.
class FirstBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class FirstBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class FirstBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[FirstBlockStored | FirstBlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
DECODE_FIRST = msgspec.msgpack.Decoder(FirstBatch)


class Subscriber:
    """A router's end: a SUB socket bound here, which the server's PUB connects to (llm-d's
    layout), checking each message's frames and sequence numbers."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.last_seq: int | None = None

    def batches(self, timeout: float) -> Iterator[KVEventBatch]:
        """The batches that arrive within `timeout` seconds of each other."""
        while self.socket.poll(int(timeout * 1000)):
            topic, seq_bytes, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode()
            assert len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            assert self.last_seq is None or seq == self.last_seq + 1, (self.last_seq, seq)
            self.last_seq = seq
            batch = DECODE.decode(payload)
            assert batch.data_parallel_rank == 0
            assert abs(batch.ts - time.time()) < 60
            # The first release's types read the same events, their fields the same values.
            first = DECODE_FIRST.decode(payload)
            for old, new in zip(first.events, batch.events, strict=True):
                assert old.__struct_config__.tag == new.__struct_config__.tag
                fields = old.__struct_fields__
                assert [getattr(old, f) for f in fields] == [getattr(new, f) for f in fields]
            yield batch


@pytest.fixture(scope="module")
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.socket.close(linger=0)


@pytest.fixture(scope="module")
def server(llama_dir: Path, subscriber: Subscriber) -> Iterator[RunningServer]:
    settings = ServerSettings(
        MODEL, kv_events_endpoint=f"tcp://127.0.0.1:{subscriber.port}", kv_events_topic=TOPIC
    )
    # 32 blocks: a few long prompts evict the oldest cached ones. One sequence at a time and
    # small chunks, so that requests queue and prefill over several steps.
    with running_server(
        llama_dir,
        settings,
        kv_cache_tokens=32 * BLOCK,
        max_num_seqs=1,
        prefill_chunk=CHUNK,
        idle_prefill_chunk=CHUNK,
    ) as running:
        yield running


def prompt_ids(server: RunningServer, n: int, salt: str) -> list[int]:
    ids = server.engine.tokenizer.encode(f"{salt}: " + "the quick brown fox jumps over " * n)
    assert len(ids) >= n
    return ids[:n]


def complete(server: RunningServer, ids: list[int], max_tokens: int = 1) -> None:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200


def router_metrics(server: RunningServer) -> tuple[dict[str, float], dict[str, str]]:
    """The vllm: samples of /metrics by name (each must be declared a gauge), and
    vllm:cache_config_info's labels."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    types = dict(re.findall(r"^# TYPE (vllm:\w+) (\w+)$", text, re.M))
    samples = dict(re.findall(r"^(vllm:\w+)(?:\{.*\})? (\S+)$", text, re.M))
    assert set(types) == set(samples) and set(types.values()) == {"gauge"}, types
    [labels] = re.findall(r"^vllm:cache_config_info\{(.*)\} 1$", text, re.M)
    return {k: float(v) for k, v in samples.items()}, dict(re.findall(r'(\w+)="([^"]*)"', labels))


# -- the model-server protocol's metrics ----------------------------------------------------


def test_metrics_follow_queue_running_and_kv_use(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    values, config = router_metrics(server)
    pool = server.engine.kv.pool
    assert config == {"block_size": str(BLOCK), "num_gpu_blocks": str(pool.num_blocks)}
    assert values["vllm:num_requests_waiting"] == values["vllm:num_requests_running"] == 0
    # One forward pass, then the engine waits: its state holds still while we scrape.
    gate = gate_forwards(server.engine, monkeypatch)
    queued = [
        threading.Thread(target=complete, args=(server, prompt_ids(server, 40, f"queued {i}")))
        for i in range(2)
    ]
    body = {"prompt": prompt_ids(server, 100, "running"), "max_tokens": 2, "stream": True}
    try:
        with server.client() as client, client.stream("POST", "/v1/completions", json=body) as r:
            reader = SSEReader(r)
            reader.read_until("progress")  # its first chunk ran
            for thread in queued:
                thread.start()
            deadline = time.monotonic() + 30
            while (values := router_metrics(server)[0])["vllm:num_requests_waiting"] != 2:
                assert time.monotonic() < deadline, values
                time.sleep(0.02)
            assert values["vllm:num_requests_running"] == 1
            usage = pool.num_used / pool.num_blocks
            assert usage > 0
            assert values["vllm:kv_cache_usage_perc"] == values["vllm:gpu_cache_usage_perc"]
            assert values["vllm:kv_cache_usage_perc"] == pytest.approx(usage)
            monkeypatch.undo()
            gate.release()
            assert reader.read_all().finish_reason == "length"
    finally:
        monkeypatch.undo()
        gate.release()
        for thread in queued:
            thread.join(timeout=120)
    values = router_metrics(server)[0]
    assert values["vllm:num_requests_waiting"] == values["vllm:num_requests_running"] == 0
    # The prompts' blocks stay cached, and vLLM counts cached blocks as free to take.
    assert pool.num_cached > 0
    assert values["vllm:kv_cache_usage_perc"] == 0


# -- KV events ------------------------------------------------------------------------------


def synchronise(server: RunningServer, sub: Subscriber) -> None:
    """Until the subscription reaches the server's PUB socket, what it publishes is dropped
    (ZMQ's slow joiner): send one-block prompts until their events arrive, then drain."""
    for i in range(100):
        complete(server, prompt_ids(server, BLOCK + 1, f"sync {i}"))
        if any(sub.batches(0.2)):
            break
    else:
        raise AssertionError("no KV events reached the subscriber")
    for _ in sub.batches(0.5):
        pass


def events(sub: Subscriber, timeout: float = 2.0) -> list[Any]:
    return [event for batch in sub.batches(timeout) for event in batch.events]


def test_kv_events_store_a_prompts_blocks_and_remove_them_when_evicted(
    server: RunningServer, subscriber: Subscriber
) -> None:
    synchronise(server, subscriber)
    ids = prompt_ids(server, 6 * BLOCK + 5, "stored then evicted")
    complete(server, ids)  # one output token: only the prompt's tokens are computed
    expected = block_hashes(ids, BLOCK)
    assert len(expected) == 6
    stored = events(subscriber)
    assert stored and all(isinstance(e, BlockStored) for e in stored), stored
    # Stored a chunk at a time, each a chain on from the one before.
    assert [h for e in stored for h in e.block_hashes] == expected
    parents = [e.parent_block_hash for e in stored]
    assert parents == [None, *(e.block_hashes[-1] for e in stored[:-1])]
    assert [t for e in stored for t in e.token_ids] == ids[: 6 * BLOCK]
    for e in stored:
        assert len(e.token_ids) == BLOCK * len(e.block_hashes)
        assert (e.block_size, e.lora_id, e.medium, e.lora_name) == (BLOCK, None, None, None)
    assert all(server.engine.kv.pool.holds(h) for h in expected)

    # Long prompts take every block: the oldest cached ones, this prompt's among them, go.
    removed: list[int] = []
    for i in range(3):
        complete(server, prompt_ids(server, 24 * BLOCK, f"evicting {i}"))
        gone = [e for e in events(subscriber) if isinstance(e, BlockRemoved)]
        removed += [h for e in gone for h in e.block_hashes]
        assert all(e.medium is None for e in gone)
    assert set(expected) <= set(removed)
    assert not any(server.engine.kv.pool.holds(h) for h in expected)
    assert len(removed) == len(set(removed))  # no block is removed twice
