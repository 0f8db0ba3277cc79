"""Tensor-parallel ranks as processes: forming the group, the workers' loop, shutting down.

Rank 0 runs the scheduler, the sampler and the HTTP server; every other rank is a worker that
runs forwards on its shard of the model. Rank 0 broadcasts each step's inputs on the group's
control collectives (gloo, no timeout to speak of, since workers wait on them while the server
idles); the forward's own run on its step collectives, under the collective timeout. Both are
the group's own (see Group), so one process may be rank 0 of several groups.

A process either runs under torchrun (RANK, WORLD_SIZE, ... in its environment) and is one
rank, or is its host's first rank and spawns the host's others.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from gapless.device import collective_backend, prepare_process, rank_device
from gapless.engine.options import check, option
from gapless.engine.runner import CopyBlocks, ModelRunner
from gapless.model.checkpoint import load_model
from gapless.model.decoder import Decoder
from gapless.model.parallel import TensorParallel
from gapless.model.pipeline import Stage
from gapless.model.quantize import DEFAULT_INT4_GROUP_SIZE

if TYPE_CHECKING:
    from gapless.model.parallel import Collectives
    from gapless.model.tokenizer import Tokenizer

log = logging.getLogger("gapless.distributed")

DEFAULT_PORT = 29500  # torchrun's
STARTUP_TIMEOUT = timedelta(minutes=10)  # for every rank to join
IDLE_TIMEOUT = timedelta(days=365)  # workers wait this long for rank 0's next step
HEARTBEAT_S = 0.5


TENSOR_PARALLELISM = "tensor and pipeline parallelism (see docs/distributed.md)"


@dataclass
class Launch:
    """Where this process's ranks sit; the first four have torchrun's names and meaning."""

    nnodes: int = option(1, "hosts, as torchrun", positive=True, section=TENSOR_PARALLELISM)
    node_rank: int = option(0, "this host's index", minimum=0, section=TENSOR_PARALLELISM)
    master_addr: str = option(
        "127.0.0.1", "node 0's address, as torchrun", section=TENSOR_PARALLELISM
    )
    master_port: int | None = option(
        None, "node 0's rendezvous port (29500; one host: any free)", section=TENSOR_PARALLELISM
    )
    collective_timeout_s: float = option(
        60.0,
        "a rank silent this long in a step fails the server",
        positive=True,
        flag="--collective-timeout",
        metavar="SECONDS",
        section=TENSOR_PARALLELISM,
    )
    # The engine's num_threads and device (EngineConfig), for the ranks this launch spawns.
    threads: int | None = None  # torch threads per rank; default: the host's cores / its ranks
    device: str = "auto"
    # With pipeline parallelism, the ranks of each stage (its tensor-parallel size).
    stage_size: int = 1

    def __post_init__(self) -> None:
        check(self)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is not one of {self.nnodes} hosts")


@dataclass
class LoadModel:
    path: str
    dtype: str
    quantize: str | None = None
    quantize_group_size: int = DEFAULT_INT4_GROUP_SIZE
    # Pipeline parallelism: the layers of each stage, rank r being stage r; empty: the ranks
    # split every layer (tensor parallelism).
    pipeline_layers: tuple[int, ...] = ()
    tied: bool = False  # the model's lm_head is its embeddings (a pipeline's last stage's)

    def load(self, parallel: TensorParallel) -> tuple[Decoder, Tokenizer]:
        """This rank's part of the model: its stage's (its shard of them, where the stage
        is split too), or its shard of every layer."""
        stage, shard = None, parallel
        if self.pipeline_layers:
            stage = Stage.of(parallel, self.pipeline_layers, self.tied)
            shard = parallel.within_stage
        quantize = (self.quantize, self.quantize_group_size)
        return load_model(self.path, self.dtype, parallel.device, shard, *quantize, stage)


@dataclass
class AllocateKV:
    num_blocks: int
    block_size: int
    window_blocks: tuple[int, ...] = ()  # ModelRunner's
    kv_cache_dtype: torch.dtype | None = None  # ModelRunner's


@dataclass(eq=False)
class Group:
    """A tensor-parallel group as this process sees it: its rank, the rendezvous store and
    the ranks it spawned on this host. Whoever started it owns it, and stop() or abort() end
    this group only: a process may be in several at once (two `LLM`s), each with its own
    store, collectives and worker processes, none of them torch.distributed's default group
    (of which a process has one)."""

    parallel: TensorParallel
    store: dist.Store
    rendezvous: tuple[str, int]
    owner: str  # who started it, as a refusal of another group on its rendezvous names it
    kind: str = "tensor parallel"  # or "pipeline parallel": how failures are named
    children: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    failed: bool = False

    def diagnose(self, exc: BaseException) -> str:
        """Rank 0's account of a failed step: which workers stopped beating. A worker that
        died or hangs stops; one that only waits in a collective for another does not."""
        self.failed = True
        ranks = range(1, self.parallel.size)
        before = [self.store.add(f"heartbeat/{r}", 0) for r in ranks]
        time.sleep(4 * HEARTBEAT_S)
        after = [self.store.add(f"heartbeat/{r}", 0) for r in ranks]
        silent = [str(r) for r, b, a in zip(ranks, before, after, strict=True) if a == b]
        who = f"rank {', '.join(silent)} stopped responding" if silent else "a rank failed"
        return f"{self.kind}: {who} ({type(exc).__name__}: {exc})"

    def abort(self) -> None:
        """Ends the group after a failure (a build that failed part way, a failed step):
        nothing more is sent, since a hung or dead worker could block it, and this host's
        workers are killed."""
        self.failed = True
        self.stop()

    def stop(self) -> None:
        """Tells the workers to exit and waits for this host's, then shuts the group's
        collectives down; idempotent. After a failure, see abort()."""
        if self not in _live:
            return
        _live.remove(self)
        parallel = self.parallel
        if parallel.rank == 0 and not self.failed:
            try:
                parallel.broadcast(None)
            except RuntimeError as e:
                log.warning("could not tell every rank to stop: %s", e)
                self.failed = True
        _end_children(self.children, wait_s=0 if self.failed else 10)
        parallel.steps.shutdown()
        parallel.control.shutdown()
        # Also ends the cycle parallel -> diagnose -> self, so that the collectives' and the
        # store's ports close with the last reference to them, with no garbage collection.
        parallel.diagnose = _stopped


def _stopped(exc: BaseException) -> str:
    return f"tensor parallel: the group was stopped ({type(exc).__name__}: {exc})"


# This process's groups until each stops: another group on one's rendezvous is refused, and
# exit_rank and the interpreter's exit stop whichever are left.
_live: list[Group] = []


def start(
    size: int,
    launch: Launch,
    owner: str = "a group started directly",
    kind: str = "tensor parallel",
) -> Group:
    """A new group of `size` ranks, with this process as one of them. Off torchrun, spawns
    the other ranks of this host first. If the group cannot form, the ranks spawned for it
    are stopped before the error is raised. Refused while another group of this process
    holds the same rendezvous address (under torchrun, or with a fixed port)."""
    env = os.environ
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    if torchrun:
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", 0))
        per_node = int(env.get("LOCAL_WORLD_SIZE", 1))
        if int(env["WORLD_SIZE"]) != size:
            raise ValueError(f"{kind} size {size}, but torchrun started {env['WORLD_SIZE']} ranks")
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        # torchrun's agent may already serve the rendezvous store on MASTER_PORT.
        store_host = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    else:
        if size % launch.nnodes:
            raise ValueError(f"{size} ranks do not split evenly over {launch.nnodes} hosts")
        per_node, local_rank = size // launch.nnodes, 0
        rank = launch.node_rank * per_node
        addr = launch.master_addr
        port = launch.master_port or (_free_port(addr) if launch.nnodes == 1 else DEFAULT_PORT)
        store_host = rank == 0
    for other in _live:
        if other.rendezvous == (addr, port):
            raise ValueError(
                f"tensor parallel: {addr}:{port} is already the rendezvous of {other.owner}, "
                "in this process; close it first (LLM.close(), Engine.close())"
            )
    children = []
    if not torchrun:
        for local in range(1, per_node):
            children.append(_spawn(rank + local, local, per_node, size, addr, port, launch))
    try:
        group = _join(rank, local_rank, per_node, size, addr, port, store_host, launch, owner)
    except BaseException:
        _end_children(children, wait_s=0)
        raise
    group.children = children
    group.kind = kind
    if rank == 0:
        group.parallel.diagnose = group.diagnose
    return group


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _join(
    rank: int,
    local_rank: int,
    per_node: int,
    size: int,
    addr: str,
    port: int,
    store_host: bool,
    launch: Launch,
    owner: str,
) -> Group:
    cores = len(os.sched_getaffinity(0))
    prepare_process(launch.threads or max(1, cores // per_node))
    device = rank_device(launch.device, local_rank)
    store = dist.TCPStore(addr, port, size, store_host, timeout=STARTUP_TIMEOUT)
    collective_timeout = timedelta(seconds=launch.collective_timeout_s)
    steps = _collectives(collective_backend(device), store, "steps", rank, size, collective_timeout)
    # Workers wait on it for as long as the server idles; rank 0's sends to a hung worker
    # must time out like any collective. (gloo takes each process's timeout as its own.)
    control_timeout = collective_timeout if rank == 0 else IDLE_TIMEOUT
    control = _collectives("gloo", store, "control", rank, size, control_timeout)
    log.info("rank %d of %d on %s joined %s:%d", rank, size, device, addr, port)
    parallel = TensorParallel(rank, size, steps, control, device)
    if 1 < launch.stage_size < size:  # each stage's own collectives for its layers
        t, stage = rank % launch.stage_size, rank // launch.stage_size
        within = _collectives(
            collective_backend(device),
            store,
            f"stage{stage}",
            t,
            launch.stage_size,
            collective_timeout,
        )
        parallel.within_stage = TensorParallel(t, launch.stage_size, within, control, device)
    group = Group(parallel, store, (addr, port), owner)
    _live.append(group)
    return group


def _collectives(
    backend: str, store: dist.Store, name: str, rank: int, size: int, timeout: timedelta
) -> Collectives:
    """A group's collectives of one kind, made directly rather than with init_process_group
    and new_group, which would make them the process's one default group and its subgroup."""
    store = dist.PrefixStore(name, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _spawn(
    rank: int, local_rank: int, per_node: int, size: int, addr: str, port: int, launch: Launch
) -> subprocess.Popen:
    """A worker rank as a fresh interpreter (not multiprocessing, which would re-run the
    caller's main module in it)."""
    launch_fields = dataclasses.asdict(launch)
    args = json.dumps([rank, local_rank, per_node, size, addr, port, launch_fields, os.getpid()])
    code = f"import json, gapless.engine.distributed as d; d._spawned(*json.loads({args!r}))"
    return subprocess.Popen([sys.executable, "-c", code])


def _spawned(
    rank: int,
    local_rank: int,
    per_node: int,
    size: int,
    addr: str,
    port: int,
    launch: dict,
    parent: int,
) -> None:
    logging.basicConfig(level="INFO", format=f"%(levelname)s:     rank {rank}: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    owner = f"worker rank {rank}"
    group = _join(rank, local_rank, per_node, size, addr, port, False, Launch(**launch), owner)
    exit_rank(serve_worker(group))


def exit_rank(status: int) -> NoReturn:
    """Shuts this process's groups down, then ends this rank's process without the interpreter's
    teardown: there, c10d's threads were sometimes destroyed while still joinable, and a rank
    died with "terminate called without an active exception" (SIGABRT, in 5 of 20 runs of the
    two-host test) after serving and stopping cleanly."""
    stop_all()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def serve_worker(group: Group) -> int:
    """A worker rank: runs what rank 0 broadcasts until it says stop. The exit status."""
    parallel = group.parallel
    threading.Thread(target=_beat, args=(group.store, parallel.rank), daemon=True).start()
    decoder: Decoder | None = None
    runner: ModelRunner | None = None
    try:
        while (message := parallel.broadcast()) is not None:
            if isinstance(message, LoadModel):
                runner = None  # frees the old model's KV cache first
                decoder, _ = message.load(parallel)
            elif isinstance(message, AllocateKV):
                assert decoder is not None
                runner = ModelRunner(
                    decoder,
                    message.num_blocks,
                    message.block_size,
                    window_blocks=message.window_blocks,
                    kv_cache_dtype=message.kv_cache_dtype,
                )
            elif isinstance(message, CopyBlocks):
                assert runner is not None
                runner.copy_blocks(message.pairs)
            else:
                assert runner is not None
                runner.run(message)
    except Exception:
        log.exception("rank %d failed; exiting", parallel.rank)
        group.failed = True
        return 1
    return 0


def _exit_with_parent(parent: int) -> None:
    """A spawned rank ends when the process that spawned it is gone, however that ended (a
    SIGKILL runs no cleanup there). Polled: Linux's parent-death signal follows the spawning
    thread, not the process, and a user may build an engine on a thread that then ends."""
    while os.getppid() == parent:
        time.sleep(HEARTBEAT_S)
    os._exit(1)


def _beat(store: dist.Store, rank: int) -> None:
    while True:
        store.add(f"heartbeat/{rank}", 1)
        time.sleep(HEARTBEAT_S)


def stop_all() -> None:
    """Stops every group of this process, the newest first."""
    for group in reversed(list(_live)):
        group.stop()


atexit.register(stop_all)


def _end_children(children: list[subprocess.Popen], wait_s: float) -> None:
    """Waits up to wait_s for this host's spawned ranks to exit, then kills the rest."""
    for child in children:
        try:
            child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
