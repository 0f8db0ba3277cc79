"""Tensor parallelism: two ranks compute what one computes, on one host and on two (network
namespaces), and a rank that dies fails the server cleanly.

One group of two ranks (this process and one worker, gloo, one thread each) serves every
in-process check: the worker loads whichever model rank 0 loads next.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import require_our_kernels
from server_fixture import SSEReader
from test_model import (
    Seq,
    check_chunked_prefill_equals_one_call,
    check_ragged_batch_equals_each_sequence_alone,
    prompt,
    run_chunks,
)
from test_server_cli import ServerProcess

from gapless import LLM, SamplingParams
from gapless.bench.gguf_files import write_gguf
from gapless.engine import distributed
from gapless.engine.runner import ModelRunner
from gapless.kernels.quant import BlockQuant
from gapless.model.checkpoint import load_model
from gapless.model.loader import load_decoder
from gapless.model.parallel import TensorParallel

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2() -> Iterator[TensorParallel]:
    threads = torch.get_num_threads()
    group = distributed.start(2, distributed.Launch(threads=1, collective_timeout_s=60))
    yield group.parallel
    group.stop()
    torch.set_num_threads(threads)


def sharded_runner(
    parallel: TensorParallel, path: Path, num_blocks: int, quantize: str | None = None
) -> ModelRunner:
    """Rank 0's runner of `path` (a checkpoint or a GGUF file), the worker holding the other
    half."""
    parallel.broadcast(distributed.LoadModel(str(path), "float32", quantize))
    decoder, _ = load_model(path, "float32", parallel.device, parallel, quantize)
    parallel.broadcast(distributed.AllocateKV(num_blocks, 16))
    return ModelRunner(decoder, num_blocks, 16)


# kv1: one KV head for two ranks, so each rank keeps a replica of it.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen3-kv1"])
def test_two_ranks_give_one_ranks_logits_and_tokens(checkpoint, tp2, arch):
    name, _, kv1 = arch.partition("-")
    path = checkpoint(name, num_key_value_heads=1) if kv1 else checkpoint(name)
    ids = prompt(80)  # longer than mistral's 24-token window
    one = run_chunks(ModelRunner(load_decoder(path, "float32"), 16, 16), Seq(ids, 0), [80])
    two = run_chunks(sharded_runner(tp2, path, 16), Seq(ids, 0), [80])
    assert (one - two).abs().max().item() < 1e-4

    expected = LLM(path, dtype="float32", prefill_chunk=8).generate([ids[:30]], GREEDY)
    llm = LLM(path, dtype="float32", prefill_chunk=8, tensor_parallel_size=2)
    assert llm.generate([ids[:30]], GREEDY)[0].token_ids == expected[0].token_ids


def test_int4_weights_shard_along_their_groups(checkpoint, tp2):
    # Each rank quantizes its own slice; o's and down's column halves start on a group
    # boundary, so the codes and scales (or GGUF blocks) equal one rank's. 40 rows take the
    # dequantized path.
    path, ids = checkpoint("qwen2"), prompt(40)
    one = load_decoder(path, "float32", quantize="int4")
    expected = run_chunks(ModelRunner(one, 16, 16), Seq(ids, 0), [40])
    runner = sharded_runner(tp2, path, 16, "int4")
    for name in ("o", "down"):  # rank 0's half of the columns
        whole, half = (getattr(d.layers[0], name).weight for d in (one, runner.decoder))
        if isinstance(half, BlockQuant):  # compared by value: rows may be interleaved
            assert torch.equal(half.dequantize(), whole.dequantize()[:, : half.cols])
            continue
        cols, groups = half.codes.shape[1], half.scale.shape[1]
        assert torch.equal(half.codes, whole.codes[:, :cols])
        assert torch.equal(half.scale, whole.scale[:, :groups])
    got = run_chunks(runner, Seq(ids, 0), [40])
    # Where the CPU multiplies bf16 fast, each rank's partial sums are rounded to bf16.
    tol = 1e-4 if one.kernels.reduced_dtype is None else 0.05
    assert (expected - got).abs().max().item() < tol * expected.abs().max().item()


def test_gguf_blocks_shard_by_whole_blocks(checkpoint, tp2, tmp_path):
    # Q8_0 rows cut as they are; o's and down's columns by whole blocks of 32 (64 and 128
    # columns over two ranks), with no dequantized copy.
    path, ids = write_gguf(checkpoint("qwen2"), tmp_path / "q8.gguf", QType.Q8_0), prompt(40)
    one, _ = load_model(path, "float32")
    require_our_kernels(one.kernels.gguf_blocks, "our GGUF block kernels")
    expected = run_chunks(ModelRunner(one, 16, 16), Seq(ids, 0), [40])
    runner = sharded_runner(tp2, path, 16)
    for name in ("qkv", "o", "down", "gate"):
        half = getattr(runner.decoder.layers[0], name).weight
        assert isinstance(half, BlockQuant)
    whole, half = (d.layers[0].down.weight for d in (one, runner.decoder))
    # By value: Q8_0 rows are held interleaved (BlockLinear), not in the file's layout.
    assert torch.equal(half.dequantize(), whole.dequantize()[:, : half.cols])
    got = run_chunks(runner, Seq(ids, 0), [40])
    assert (expected - got).abs().max().item() < 0.05 * expected.abs().max().item()


def test_two_ranks_prefill_in_chunks_as_in_one_call(checkpoint, tp2):
    check_chunked_prefill_equals_one_call(sharded_runner(tp2, checkpoint("mistral"), 32))


def test_two_ranks_run_a_ragged_batch_as_each_sequence_alone(checkpoint, tp2):
    check_ragged_batch_equals_each_sequence_alone(sharded_runner(tp2, checkpoint("qwen3"), 64))


# -- `gapless serve` with ranks in processes -------------------------------------------------


def _serve(path: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    flags = ["--dtype", "float32", "--device", "cpu", "--threads", "1"]
    return ServerProcess([str(path), *flags, *args], env or dict(os.environ))


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_a_failed_rank_ends_streams_with_an_error_then_503_then_exit(checkpoint, fault):
    check_a_failed_rank_fails_the_server(checkpoint("llama"), fault, "--tensor-parallel-size")


def check_a_failed_rank_fails_the_server(path: Path, fault: int, split_flag: str) -> None:
    """Two ranks split as split_flag says (tensor or pipeline); rank 1 gets `fault`
    mid-stream: the stream ends with an error naming it, new requests get 503, and the
    server exits 1, leaving no rank."""
    expected = LLM(path, dtype="float32").generate([prompt(12)], GREEDY)[0].text
    timeout = 5
    server = _serve(path, split_flag, "2", "--collective-timeout", str(timeout))
    workers: list[int] = []
    try:
        port = server.wait_for_line(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")[1]
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        body = {"prompt": prompt(12), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        long = {**body, "max_tokens": 2000, "stream": True}
        workers = _children(server.proc.pid)
        [worker] = workers
        with client.stream("POST", "/v1/completions", json=long) as response:
            reader = SSEReader(response)
            reader.read_until("data")
            os.kill(worker, fault)
            failed = time.monotonic()
            sse = reader.read_all()
        assert "rank 1 stopped responding" in sse.data[-1]["error"]["message"]
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_failed"
        # The timeout, then 2 s to name the rank and 2 s of 503s, then the exit.
        assert server.proc.wait(timeout=timeout + 10) == 1
        assert time.monotonic() - failed < timeout + 8
        assert "rank 1 stopped responding" in server.rest_of_log()
        assert not Path(f"/proc/{worker}").exists()  # ended and reaped: no rank is left
    finally:
        for pid in (server.proc.pid, *workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- two hosts: one rank in each of two network namespaces -----------------------------------

# Named by this process, so that runs side by side (CI, other worktrees) never share them.
NAMESPACES = (f"gapless-tp-{os.getpid()}-a", f"gapless-tp-{os.getpid()}-b")
VETHS = (f"gtp{os.getpid()}a", f"gtp{os.getpid()}b")
ADDRESSES = ("10.231.7.1", "10.231.7.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[None]:
    """Two network namespaces joined by a veth pair; skips the test if they can't be made."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command to make network namespaces with")
    try:
        for ns in NAMESPACES:
            _ip("netns", "add", ns)
        _ip("link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1])
        for ns, dev, addr in zip(NAMESPACES, VETHS, ADDRESSES, strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        _remove(NAMESPACES)
        pytest.skip(f"cannot make network namespaces: {e.stderr.strip()}")
    try:
        yield
    finally:
        _remove(NAMESPACES)


def _remove(namespaces: tuple[str, ...]) -> None:
    """Deleting a namespace deletes its end of the veth pair, and so the pair."""
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("split_flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_hosts_serve_one_ranks_tokens_and_stop_together(checkpoint, tmp_path, split_flag):
    path = checkpoint("qwen2")
    ids = prompt(12)
    expected = LLM(path, dtype="float32").generate([ids], GREEDY)[0].text
    port = 8131
    with (
        two_hosts(),
        (tmp_path / "rank0.log").open("w+b") as log0,
        (tmp_path / "rank1.log").open("w+b") as log1,
    ):
        logs = [log0, log1]
        ranks = []
        for node, ns in enumerate(NAMESPACES):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "gapless.cli", "serve"]
            cmd += [str(path), "--dtype", "float32", "--device", "cpu", "--threads", "1"]
            cmd += [split_flag, "2", "--nnodes", "2", "--node-rank", str(node)]
            cmd += ["--master-addr", ADDRESSES[0], "--master-port", "29531"]
            cmd += ["--port", str(port), "--log-level", "warning"]
            # gloo picks its interface by the host's name, which means nothing in here.
            env = {**os.environ, "GLOO_SOCKET_IFNAME": VETHS[node]}
            ranks.append(subprocess.Popen(cmd, env=env, stderr=logs[node]))
        try:
            ask = (
                "import httpx, json, sys, time\n"
                "for _ in range(300):\n"
                "    try:\n"
                f"        r = httpx.post('http://127.0.0.1:{port}/v1/completions', json=json.loads(sys.argv[1]), timeout=60)\n"
                "        break\n"
                "    except httpx.ConnectError:\n"
                "        time.sleep(0.2)\n"
                "print(r.json()['choices'][0]['text'], end='')\n"
            )
            body = {"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            client = ["ip", "netns", "exec", NAMESPACES[0], sys.executable, "-c", ask]
            answer = subprocess.run(
                [*client, json.dumps(body)], capture_output=True, text=True, timeout=120
            )
            logs[0].seek(0)
            assert answer.stdout == expected, answer.stderr + logs[0].read().decode()
            ranks[0].send_signal(signal.SIGTERM)
            assert [rank.wait(timeout=30) for rank in ranks] == [0, 0]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
