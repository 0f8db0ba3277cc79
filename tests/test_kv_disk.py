"""The KV disk tier (--kv-disk): a prefix computed by one engine is loaded by the next, with
the same tokens and bit-equal K/V; every fault of the disk or its files costs only the
tier, never a token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import greedy, prompt

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.events import FinishedEvent, TokenEvent

BS = 16
SHARED = prompt(20 * BS + 5, seed=3)  # 20 full blocks, then part of one
QUESTION = prompt(9, seed=4)


def engine_of(path: Path, disk: Path | None, **options) -> Engine:
    options = {"prefill_chunk": 64, "idle_prefill_chunk": 64, **options}
    config = EngineConfig.of(
        dtype="float32", kv_disk=None if disk is None else str(disk), **options
    )
    return Engine.from_pretrained(path, config)


def answer(engine: Engine, ids: list[int], max_tokens: int = 6) -> tuple[list[int], FinishedEvent]:
    rid = engine.add_request(ids, greedy(max_tokens))
    out, end = [], None
    while engine.has_work:
        for event in engine.step():
            if event.request_id != rid:
                continue
            if isinstance(event, TokenEvent):
                out += event.token_ids
            elif isinstance(event, FinishedEvent):
                end = event
    assert end is not None and end.finish_reason == "length", end
    return out, end


def disk_stats(engine: Engine):
    assert engine.kv.disk is not None
    return engine.kv.disk.stats


def files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kv"))


def prefix_kv(engine: Engine, rid_tokens: list[int]) -> list[torch.Tensor]:
    """Group 0's K/V of the prompt's cached full blocks, as the prefix cache holds them."""
    from gapless.kv.prefix_cache import block_hashes

    pool = engine.kv.pool
    blocks = [pool.lookup(h) for h in block_hashes(rid_tokens, BS)[:20]]
    kv = list(engine.runner.blocks_kv(0, blocks))
    pool.release(blocks)
    return kv


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_restarted_engine_loads_the_prefix_with_the_same_tokens_and_bit_equal_kv(
    checkpoint, tmp_path, arch
):
    path, disk = checkpoint(arch), tmp_path / "kv"
    cold = engine_of(path, None)
    want, _ = answer(cold, SHARED + QUESTION)
    want_kv = prefix_kv(cold, SHARED + QUESTION)

    first = engine_of(path, disk)
    assert answer(first, SHARED + QUESTION)[0] == want
    first.close()  # waits for the writes
    # Every full block of the prompt and the output (its last token is not computed).
    computed = len(SHARED + QUESTION) + 6 - 1
    assert len(files(disk)) == computed // BS * len(first.kv.groups)

    second = engine_of(path, disk)
    got, end = answer(second, SHARED + prompt(7, seed=5))
    stats = disk_stats(second)
    assert end.cached_prompt_tokens == 20 * BS  # both tiers count: here all from disk
    assert stats.hits > 0 and stats.skipped == 0
    again, _ = answer(second, SHARED + QUESTION)
    assert again == want
    loaded = prefix_kv(second, SHARED + QUESTION)
    assert all(torch.equal(a, b) for a, b in zip(loaded, want_kv, strict=True))
    second.close()


def damage(disk: Path, how: str) -> int:
    """Spoils every file of the tier in one way; returns how many."""
    spoiled = files(disk)
    for f in spoiled:
        blob = f.read_bytes()
        if how == "truncated":
            f.write_bytes(blob[: len(blob) // 2])
        elif how == "random":
            f.write_bytes(os.urandom(len(blob)))
        elif how == "flipped":  # the data's last byte: only the checksum sees it
            f.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
        elif how == "foreign":  # another model's file under this one's name
            f.write_bytes(blob.replace(f.parent.name.encode(), b"0" * len(f.parent.name)))
    return len(spoiled)


@pytest.mark.parametrize("how", ["truncated", "random", "flipped", "foreign"])
def test_a_spoiled_file_is_skipped_counted_and_computed(checkpoint, tmp_path, how):
    path, disk = checkpoint("llama"), tmp_path / "kv"
    want, _ = answer(engine_of(path, None), SHARED + QUESTION)
    writer = engine_of(path, disk)
    answer(writer, SHARED + QUESTION)
    writer.close()
    damage(disk, how)
    reader = engine_of(path, disk)
    got, end = answer(reader, SHARED + QUESTION)
    assert got == want
    assert end.cached_prompt_tokens == 0
    assert disk_stats(reader).skipped >= 1 and disk_stats(reader).hits == 0
    reader.close()


def test_a_read_only_or_vanished_directory_costs_only_the_tier(checkpoint, tmp_path):
    path = checkpoint("llama")
    want, _ = answer(engine_of(path, None), SHARED + QUESTION)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        engine = engine_of(path, locked)
        assert answer(engine, SHARED + QUESTION)[0] == want
        engine.close()
        if os.geteuid() != 0:  # root writes anyway
            assert disk_stats(engine).errors >= 1 and files(locked) == []
    finally:
        locked.chmod(0o700)
    gone = tmp_path / "gone"
    engine = engine_of(path, gone)
    answer(engine, SHARED + QUESTION)
    engine.kv.disk.flush()
    for f in gone.rglob("*"):
        if f.is_file():
            f.unlink()
    for d in sorted(gone.rglob("*"), reverse=True):
        d.rmdir()
    gone.rmdir()
    assert answer(engine, SHARED + prompt(7, seed=5))[0]  # computes: the RAM cache serves
    engine.close()


def test_a_full_disk_costs_only_the_tier(checkpoint, tmp_path, monkeypatch):
    path, disk = checkpoint("llama"), tmp_path / "kv"
    want, _ = answer(engine_of(path, None), SHARED + QUESTION)

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    engine = engine_of(path, disk)
    assert answer(engine, SHARED + QUESTION)[0] == want
    engine.close()
    assert disk_stats(engine).errors >= 1 and files(disk) == []


def test_the_tier_stays_under_its_size_least_recently_used_first(checkpoint, tmp_path):
    path, disk = checkpoint("llama"), tmp_path / "kv"
    engine = engine_of(path, disk)
    answer(engine, SHARED + QUESTION)
    engine.close()
    one = files(disk)[0].stat().st_size
    cap_gb = 12 * one / 1e9
    engine = engine_of(path, disk, kv_disk_gb=cap_gb)
    answer(engine, prompt(20 * BS, seed=9) + QUESTION)
    engine.close()
    stats = disk_stats(engine)
    assert stats.evictions > 0
    assert sum(f.stat().st_size for f in files(disk)) <= cap_gb * 1e9


def test_a_server_killed_mid_write_leaves_only_whole_blocks(checkpoint, tmp_path):
    """SIGKILL while a block is being written (its rename held back, so that the kill
    lands mid-write): the next engine reads the blocks renamed into place before it, and
    nothing of the one half-written."""
    path, disk = checkpoint("llama"), tmp_path / "kv"
    script = f"""
import sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
import gapless.kv.disk as disk
from test_kv_disk import engine_of, answer, SHARED, QUESTION
replace, renamed = disk.os.replace, []
def slow(src, dst):
    if len(renamed) == 5:
        print("writing", flush=True)
        threading.Event().wait()  # killed here, the 6th block written but not renamed
    replace(src, dst)
    renamed.append(dst)
disk.os.replace = slow
engine = engine_of(Path({str(path)!r}), Path({str(disk)!r}))
answer(engine, SHARED + QUESTION)
threading.Event().wait()
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert len(files(disk)) == 5 and len(list(disk.rglob("*.tmp"))) == 1
    want, _ = answer(engine_of(path, None), SHARED + QUESTION)
    engine = engine_of(path, disk)
    got, end = answer(engine, SHARED + QUESTION)
    assert got == want and end.cached_prompt_tokens == 5 * BS
    assert disk_stats(engine).skipped == 0
    engine.close()


def test_kv_disk_is_refused_under_tensor_parallelism():
    with pytest.raises(ValueError, match="--kv-disk runs without tensor or pipeline"):
        EngineConfig.of(kv_disk="/tmp/x", tensor_parallel_size=2)


def test_a_prefix_loads_beside_the_decodes_and_is_counted_where_users_look(checkpoint, tmp_path):
    """While a prefix loads from disk (a few steps' worth of blocks a step), every decoding
    stream gets its token in every step; /metrics counts the tier's reads and the live view
    shows the request's reloaded tokens beside its computed ones."""
    from gapless.engine.observability import stats, summary
    from gapless.server.metrics import render_metrics

    path, disk = checkpoint("llama"), tmp_path / "kv"
    writer = engine_of(path, disk)
    answer(writer, SHARED + QUESTION)
    writer.close()

    engine = engine_of(path, disk, prefill_chunk=32)  # 2 blocks of loads a step beside decodes
    streams = [engine.add_request(prompt(8, seed=20 + i), greedy(40)) for i in range(2)]
    while any(not r.output_ids for r in engine.scheduler.running):
        engine.step()
    loaded = engine.add_request(SHARED + QUESTION, greedy(3))
    reloaded = [0]
    while reloaded[-1] < 20 * BS:
        events = engine.step()
        got = {e.request_id for e in events if isinstance(e, TokenEvent)}
        assert set(streams) <= got, "a stream went a step without its token"
        rows = summary(engine)["requests"]
        reloaded += [r["reloaded"] for r in rows if r["id"] == loaded[:8]]
    assert len(set(reloaded)) > 3  # loaded over several steps
    counters = stats(engine)
    assert counters["kv_disk_hits_total"] == disk_stats(engine).hits == 20
    text = render_metrics(engine)
    assert "# TYPE gapless_kv_disk_hits_total counter" in text
    assert "gapless_kv_disk_hits_total 20" in text
    engine.close()


def test_two_servers_share_one_directory(checkpoint, tmp_path):
    """Two engines of one model on one directory, writing the same blocks at once: each file
    is whole, and a third engine serves the prefix from what they wrote."""
    path, disk = checkpoint("llama"), tmp_path / "kv"
    want, _ = answer(engine_of(path, None), SHARED + QUESTION)
    a, b = engine_of(path, disk), engine_of(path, disk)
    ids = {e: e.add_request(SHARED + QUESTION, greedy(6)) for e in (a, b)}
    while a.has_work or b.has_work:
        for e in (a, b):
            if e.has_work:
                e.step()
    a.close()
    b.close()
    assert not list(disk.rglob("*.tmp")) and ids
    third = engine_of(path, disk)
    got, end = answer(third, SHARED + QUESTION)
    assert got == want and end.cached_prompt_tokens == 20 * BS
    assert disk_stats(third).skipped == 0
    third.close()


def test_prefixes_loading_together_beyond_the_pool_all_finish(checkpoint, tmp_path):
    """Three prompts on 20-block disk prefixes, each with 4 blocks of its own after it, load
    in the same steps into a pool of 62 blocks: their loads fill it, so no prompt has room
    for its own tokens, and nobody decodes. One gives way (it is preempted and recomputes),
    every prompt ends with the tokens it computes alone, and every block comes back."""
    path, disk = checkpoint("llama"), tmp_path / "kv"
    prefixes = [prompt(20 * BS + 1, seed=40 + i) for i in range(3)]
    prompts = [p + prompt(4 * BS, seed=50 + i) for i, p in enumerate(prefixes)]
    cold = engine_of(path, None)
    expected = [answer(cold, ids)[0] for ids in prompts]
    writer = engine_of(path, disk)
    for ids in prefixes:
        answer(writer, ids, 1)
    writer.close()
    engine = engine_of(path, disk, kv_cache_tokens=62 * BS, idle_prefill_chunk=64 * BS)
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    ends: dict[str, FinishedEvent] = {}
    for _ in range(2000):
        if not engine.has_work:
            break
        for event in engine.step():
            if isinstance(event, TokenEvent):
                out[event.request_id] += event.token_ids
            elif isinstance(event, FinishedEvent):
                ends[event.request_id] = event
    assert not engine.has_work, "the prompts waited on each other's blocks"
    assert [out[rid] for rid in ids] == expected
    assert sum(ends[rid].cached_prompt_tokens for rid in ids) >= 2 * 20 * BS
    assert engine.kv.pool.num_used == 0
    engine.close()
