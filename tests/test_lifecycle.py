"""The lifecycle of tensor-parallel ranks: a build that fails leaves nothing behind and the
next one works; an `LLM`'s ranks end when it is closed, collected, or its process exits, and
one `LLM`'s end never touches another's ranks.

Ranks are found as they are: processes whose command line runs gapless' spawned rank.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_model import prompt
from test_server_cli import ServerProcess

from gapless import LLM, SamplingParams
from gapless.engine import distributed
from gapless.model.loader import WeightError
from gapless.model.parallel import ShardError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TP2 = {"dtype": "float32", "tensor_parallel_size": 2, "num_threads": 1}


def ranks_of(pid: int) -> set[int]:
    """The spawned worker ranks among a process's children."""
    ranks = set()
    for child in psutil.Process(pid).children():
        try:
            if "gapless.engine.distributed" in " ".join(child.cmdline()):
                ranks.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return ranks


def wait_gone(pids: set[int], timeout: float = 15) -> set[int]:
    """The pids still alive (and not zombies) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {p for p in pids if psutil.pid_exists(p) and not _zombie(p)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ports() -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.fixture
def truncated(checkpoint, tmp_path: Path) -> Path:
    """A qwen2 checkpoint whose safetensors file lost its second half."""
    path = tmp_path / "truncated"
    shutil.copytree(checkpoint("qwen2"), path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return path


def test_failed_builds_leave_nothing_behind_and_the_next_build_works(checkpoint, truncated):
    good = checkpoint("qwen2")
    # 3 KV heads neither split over 2 ranks nor divide 2.
    misfit = checkpoint("qwen2", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    ids = prompt(20)
    expected = LLM(good, dtype="float32").generate([ids], GREEDY)[0].token_ids
    me = os.getpid()
    ports = listening_ports()

    with pytest.raises(ShardError, match="3 KV heads"):
        LLM(misfit, **TP2)
    assert ranks_of(me) == set()  # the shape check comes before any rank starts

    with pytest.raises(WeightError, match="not a readable safetensors file"):
        LLM(truncated, **TP2)  # fails in weight loading, on every rank
    assert wait_gone(ranks_of(me), timeout=0) == set()
    assert listening_ports() == ports  # the group's store let go of its port

    llm = LLM(good, **TP2)
    ranks = ranks_of(me)
    assert len(ranks) == 1
    assert llm.generate([ids], GREEDY)[0].token_ids == expected
    llm.close()
    assert wait_gone(ranks) == set()
    llm.close()  # idempotent
    del llm  # the closed engine's process-group objects hold gloo's sockets until then
    gc.collect()
    assert listening_ports() == ports


def test_ranks_end_with_the_block_and_with_garbage_collection(checkpoint):
    me, path = os.getpid(), checkpoint("llama")
    with LLM(path, **TP2) as llm:
        ranks = ranks_of(me)
        assert len(ranks) == 1
        assert len(llm.generate([prompt(8)], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert wait_gone(ranks) == set()

    llm = LLM(path, **TP2)
    ranks = ranks_of(me)
    assert len(ranks) == 1
    del llm
    gc.collect()
    assert wait_gone(ranks) == set()


def test_rebinding_the_name_serves_the_second_model(checkpoint):
    """`llm = LLM(b)` over a live `llm = LLM(a)`: a is collected only after b is built, and
    its end must leave b's ranks and group alone."""
    me, ids = os.getpid(), prompt(12)
    first, second = checkpoint("llama"), checkpoint("qwen2")
    expected = [
        LLM(p, dtype="float32").generate([ids], GREEDY)[0].token_ids for p in (first, second)
    ]
    assert expected[0] != expected[1]  # else a rank still serving the first would pass
    llm = LLM(first, **TP2)
    first_ranks = ranks_of(me)
    assert llm.generate([ids], GREEDY)[0].token_ids == expected[0]
    llm = LLM(second, **TP2)
    gc.collect()
    assert wait_gone(first_ranks) == set()
    assert llm.generate([ids], GREEDY)[0].token_ids == expected[1]
    second_ranks = ranks_of(me)
    assert len(second_ranks) == 1
    llm.close()
    assert wait_gone(second_ranks) == set()


@pytest.mark.parametrize("closed_first", [0, 1], ids=["older-closed-first", "newer-closed-first"])
def test_two_llms_alive_at_once_keep_their_own_ranks(checkpoint, closed_first):
    me, ids = os.getpid(), prompt(12)
    paths = (checkpoint("llama"), checkpoint("qwen2"))
    expected = [LLM(p, dtype="float32").generate([ids], GREEDY)[0].token_ids for p in paths]
    llms, ranks = [], []
    for path in paths:
        llms.append(LLM(path, **TP2))
        ranks.append(ranks_of(me) - set().union(*ranks))
    assert [len(r) for r in ranks] == [1, 1]
    for i in (0, 1, 0):  # interleaved
        assert llms[i].generate([ids], GREEDY)[0].token_ids == expected[i]

    open_ = 1 - closed_first
    llms[closed_first].close()
    assert wait_gone(ranks[closed_first]) == set()
    assert wait_gone(ranks[open_], timeout=0) == ranks[open_]
    assert llms[open_].generate([ids], GREEDY)[0].token_ids == expected[open_]
    llms[open_].close()
    assert wait_gone(ranks[open_]) == set()
    assert ranks_of(me) == set()


def test_a_second_group_on_a_live_groups_port_is_refused_naming_it():
    """With a fixed port (or under torchrun) two groups would share one rendezvous store."""
    me = os.getpid()
    launch = distributed.Launch(master_port=free_port(), threads=1)
    first = distributed.start(2, launch, "the first LLM")
    ranks = ranks_of(me)
    try:
        with pytest.raises(ValueError, match=r"rendezvous of the first LLM.*close it first"):
            distributed.start(2, launch, "the second LLM")
        assert ranks_of(me) == ranks  # refused before spawning
    finally:
        first.stop()
    assert wait_gone(ranks) == set()


MAKE_LLM = """
import sys, time
from gapless import LLM
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, num_threads=1)
print("built", flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
sys.stdin.readline()  # exits once the test has seen its ranks
"""


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_no_rank_outlives_the_process_that_made_its_llm(checkpoint, end):
    """A normal exit runs the close at exit; a SIGKILL runs nothing, and the ranks notice
    that their parent is gone."""
    script = [sys.executable, "-c", MAKE_LLM, str(checkpoint("llama"))]
    proc = subprocess.Popen(
        [*script, "hang" if end == "killed" else "exit"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "built\n"
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 1
        if end == "killed":
            proc.send_signal(signal.SIGKILL)
        else:
            proc.communicate("\n", timeout=60)  # now it exits
        assert proc.wait(timeout=60) == (-signal.SIGKILL if end == "killed" else 0)
        assert wait_gone(ranks) == set()
    finally:
        proc.kill()


def test_serve_that_cannot_start_under_tp_exits_nonzero_and_leaves_no_rank(checkpoint, truncated):
    misfit = checkpoint("qwen2", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    flags = ["--dtype", "float32", "--device", "cpu", "--threads", "1"]
    flags += ["--tensor-parallel-size", "2"]
    server = ServerProcess([str(misfit), *flags], dict(os.environ))
    assert server.proc.wait(timeout=60) == 2
    assert "3 KV heads neither split over 2 ranks" in server.rest_of_log()

    server = ServerProcess([str(truncated), *flags], dict(os.environ))
    ranks: set[int] = set()
    while not ranks and server.proc.poll() is None:  # the rank may fail and exit at once
        ranks = ranks_of(server.proc.pid)
        time.sleep(0.02)
    assert len(ranks) == 1
    assert server.proc.wait(timeout=60) == 2
    assert "not a readable safetensors file" in server.rest_of_log()
    assert wait_gone(ranks) == set()
